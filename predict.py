"""Write submission.csv (id,summary) for test.csv with a trained checkpoint.

    python predict.py [preset] [--ckpt=path | --baseline=...] [--key=value ...]
    torchrun --nproc_per_node=2 predict.py [...]          the test set is sharded; rank 0 writes the file
"""
import os
import sys

import pandas as pd

import data
from checkpoint import make_out_dir
from config import UserError, load_config
from evaluate import load_model, output_dir, summarize_sharded
from files import atomic_write
from runtime import Runtime


def write_submission(ids, summaries, path):
    """One row per id, in order; summaries folded to one line. Written to a temp file, then renamed."""
    frame = pd.DataFrame({"id": ids, "summary": [" ".join(s.split()) for s in summaries]})
    with atomic_write(path) as f:
        frame.to_csv(f, index=False)


def check_against_sample(ids, path):
    """UserError unless the sample submission has the columns id,summary and exactly the test ids."""
    _, sample = data.read_frame(path, "sample_submission_csv",
                                "pass --sample_submission_csv=PATH, or --sample_submission_csv='' to skip the check")
    if list(sample.columns) != ["id", "summary"]:
        raise UserError(f"sample_submission_csv {path} has columns {list(sample.columns)}, expected ['id', 'summary']")
    sample_ids = set(sample["id"].str.strip())
    missing, extra = sample_ids - set(ids), set(ids) - sample_ids
    if missing or extra:
        raise UserError(f"test_csv ids differ from sample_submission_csv {path}: {len(missing)} of its ids are not "
                        f"in test_csv, {len(extra)} test ids are not in it (e.g. {sorted(missing or extra)[:3]})")


def predict(cfg, rt):
    """Summarize every test dialogue (sharded across ranks); rank 0 writes submission.csv into output_dir (out_dir,
    or out_dir/baseline-<name> for a baseline) and returns its path."""
    out = output_dir(cfg)
    if rt.is_main:
        make_out_dir(out)
    test = data.read_test(cfg)
    if cfg.sample_submission_csv:
        check_against_sample(test.ids, cfg.sample_submission_csv)
    model = load_model(cfg, rt)
    summaries = summarize_sharded(model, test.dialogues, cfg, rt)
    if not rt.is_main:
        return None
    path = os.path.join(out, "submission.csv")
    write_submission(test.ids, summaries, path)
    if test.empty:
        print(f"{test.empty} test dialogue(s) are empty; they were summarized from the bare prompt")
    empty = sum(not s.split() for s in summaries)
    print(f"wrote {len(summaries)} summaries to {path}"
          + (f" ({empty} empty: the model produced nothing for them)" if empty else ""))
    return path


def main(argv=None):
    try:
        cfg = load_config(sys.argv[1:] if argv is None else argv)
        with Runtime(cfg) as rt:
            predict(cfg, rt)
    except UserError as e:
        print(f"error: {e}", file=sys.stderr)
        sys.exit(2)


if __name__ == "__main__":
    main()
