"""submission.csv (id,summary) for test_csv, by a run's model with its prompt and decoding."""
import json
import os

import pandas as pd

import data
from command_line import UserError, atomic_write
from summarizer import inference, run_folder


def write_submission(ids, summaries, path):
    """Summaries folded to one line each."""
    frame = pd.DataFrame({"id": ids, "summary": [" ".join(s.split()) for s in summaries]})
    with atomic_write(path) as f:
        frame.to_csv(f, index=False)


def check_against_sample(ids, path):
    """UserError unless the sample has the columns id,summary and exactly the test ids; returns a note when
    its order differs, else ''."""
    _, sample = data.read_frame(path, "sample_submission_csv",
                                "pass --sample_submission_csv=PATH, or --sample_submission_csv='' to skip the check")
    skip = "--sample_submission_csv='' skips the check"
    if list(sample.columns) != ["id", "summary"]:
        raise UserError(f"sample_submission_csv {path} has columns {list(sample.columns)}, expected ['id', 'summary'] "
                        f"(submission.csv's): pass the sample submission of test_csv's competition ({skip})")
    sample_ids = set(sample["id"].str.strip())
    missing, extra = sample_ids - set(ids), set(ids) - sample_ids
    if missing or extra:  # examples from both sides: 0.0 against 0 shows only side by side
        examples = "; ".join(f"{label} {sorted(ids)[:3]}" for label, ids in
                             (("e.g. the sample's", missing), ("e.g. test_csv's", extra)) if ids)
        raise UserError(f"test_csv ids differ from sample_submission_csv {path}: {len(missing)} of its ids are not "
                        f"in test_csv, {len(extra)} test ids are not in it ({examples}): pass the test_csv and "
                        f"sample_submission_csv of one competition ({skip})")
    return ("" if list(sample["id"].str.strip()) == list(ids) else f"note: submission.csv lists the ids in "
            f"test_csv's order, which differs from sample_submission_csv {path}'s")


def predict(cfg, explicit, rt):
    """Rank 0 writes submission.csv and returns its path; the others return None."""
    out = inference.output_dir(cfg)
    summarizer = inference.load_summarizer(cfg, explicit, rt, lambda run_cfg: f"test {run_cfg.test_csv}")
    test = data.read_test(summarizer.cfg)
    if (note := cfg.sample_submission_csv and check_against_sample(test.ids, cfg.sample_submission_csv)) and rt.is_main:
        print(note)  # every rank checks: each stops alike
    prompts, cut = summarizer.prompts(test.dialogues)
    if rt.is_main and cut:
        print(inference.cut_line(summarizer, cut, len(prompts)))
    summaries = summarizer.summarize(prompts, rt)
    if not rt.is_main:
        return None
    made_by = {"weights": summarizer.weights, "test_csv": summarizer.cfg.test_csv,
               "decoding": inference.describe_decoding(summarizer.cfg, summarizer.overridden,
                                                       summarizer.ckpt is not None)}
    run_folder.set_aside_other_output(out, run_folder.SUBMISSION_RECORD, (run_folder.SUBMISSION,
                                      run_folder.SUBMISSION_RECORD), "previous-submission", made_by)
    path = os.path.join(out, run_folder.SUBMISSION)
    write_submission(test.ids, summaries, path)
    with atomic_write(os.path.join(out, run_folder.SUBMISSION_RECORD)) as f:
        json.dump(made_by, f, indent=2)
    if test.empty:
        print(f"{test.empty} test dialogue(s) are empty; they were summarized from the bare prompt")
    empty = sum(not s.split() for s in summaries)
    print(f"wrote {len(summaries)} summaries to {path}"
          + (f" ({empty} empty: the model produced nothing for them)" if empty else ""))
    return path
