"""Write submission.csv (id,summary) for test.csv with a trained checkpoint.

    python predict.py [preset] [--ckpt=path] [--key=value ...]
    torchrun --nproc_per_node=2 predict.py [...]          the test set is sharded; rank 0 writes the file
"""
import os
import sys

import pandas as pd

import data
from config import UserError, load_config
from evaluate import load_model, summarize
from runtime import Runtime


def write_submission(ids, summaries, path):
    """One row per id, in order; summaries folded to one line. Written to a temp file, then renamed."""
    frame = pd.DataFrame({"id": ids, "summary": [" ".join(s.split()) for s in summaries]})
    tmp = f"{path}.tmp{os.getpid()}"
    frame.to_csv(tmp, index=False)
    os.replace(tmp, path)


def check_against_sample(ids, sample_path):
    sample = pd.read_csv(sample_path, dtype=str, keep_default_na=False)
    if list(sample.columns) != ["id", "summary"]:
        raise UserError(f"{sample_path} has columns {list(sample.columns)}, expected ['id', 'summary']")
    missing, extra = set(sample["id"]) - set(ids), set(ids) - set(sample["id"])
    if missing or extra:
        raise UserError(f"test ids differ from {sample_path}: {len(missing)} missing, {len(extra)} extra "
                        f"(e.g. {sorted(missing or extra)[:3]})")


def predict(cfg, rt):
    test = data.read_test(cfg)
    model = load_model(cfg, rt.device)
    mine = list(range(len(test.ids)))[rt.rank::rt.world_size]
    summaries = summarize(model, [test.dialogues[i] for i in mine], cfg, rt.autocast(), progress=rt.is_main)
    gathered = dict(pair for shard in rt.all_gather_objects(list(zip(mine, summaries))) for pair in shard)
    if not rt.is_main:
        return
    summaries = [gathered[i] for i in range(len(test.ids))]
    if cfg.sample_submission_csv:
        check_against_sample(test.ids, cfg.sample_submission_csv)
    path = os.path.join(cfg.out_dir, "submission.csv")
    write_submission(test.ids, summaries, path)
    empty = sum(not s.strip() for s in summaries)
    print(f"wrote {len(summaries)} summaries to {path}" + (f" ({empty} empty: the model produced nothing)" if empty else ""))


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
