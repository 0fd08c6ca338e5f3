"""evaluate.py and predict.py on a briefly trained tiny model: the report is what rouge-score computes from the
written predictions, submission.csv has test.csv's ids in order, and two ranks write what one process writes."""
import json
import os
import re
import subprocess

import pandas as pd
import pytest
from rouge_score import rouge_scorer

import evaluate
import predict
import train
from command_line import UserError
from config import load_config
from conftest import HANG, REPO, save_csv, synthetic_rows, tiny, tiny_gpt, torchrun
from summarizer import evaluation, inference, report

# how evaluate.py and predict.py run the trained model (its shape comes from the checkpoint)
RUNTIME = ["--device=cpu", "--dtype=float32", "--compile=False", "--max_new_tokens=20", "--gen_batch_size=4"]
# ids a careless writer would mangle: leading zeros, a float-looking one, a comma, a quote, a space
TRICKY_IDS = ["007", "1e3", "a,b", 'say "hi"', "two words", "12", "0", "x-1", "NaN", "10", "9"]


@pytest.fixture(scope="module")
def trained(tmp_path_factory):
    """A tiny model trained for a few steps, long enough that its summaries overlap the references only in part."""
    folder = tmp_path_factory.mktemp("trained")
    save_csv(folder / "train.csv", synthetic_rows(64, seed=0))
    save_csv(folder / "validation.csv", synthetic_rows(24, seed=3))
    test = pd.DataFrame(synthetic_rows(len(TRICKY_IDS), seed=4))
    test["id"] = TRICKY_IDS
    # different lengths, so length-sorted generation batches differ from file order
    test["dialogue"] = [d + "\nTom: and one more thing." * (i % 4) for i, d in enumerate(test["dialogue"])]
    save_csv(folder / "test.csv", test, test=True)
    train.main([*tiny(n_embd=64, max_new_tokens=20), "--gen_batch_size=4", f"--train_csv={folder / 'train.csv'}",
                f"--validation_csv={folder / 'validation.csv'}",
                f"--test_csv={folder / 'test.csv'}", f"--out_dir={folder / 'out'}",
                f"--data_cache_dir={folder / 'cache'}", "--batch_size=16", "--micro_batch_size=16",
                "--max_iters=60", "--eval_interval=60", "--learning_rate=1e-2", "--warmup_iters=5",
                "--rouge_samples=0", "--best_metric=val_loss", "--log_interval=1000"])
    return folder


def args(folder, out_dir, *extra):
    return [*RUNTIME, f"--train_csv={folder / 'train.csv'}", f"--validation_csv={folder / 'validation.csv'}",
            f"--test_csv={folder / 'test.csv'}", f"--data_cache_dir={folder / 'cache'}",
            f"--ckpt={folder / 'out' / 'best.pt'}", f"--out_dir={out_dir}", "--sample_submission_csv=", *extra]


@pytest.mark.slow
def test_reported_rouge_is_rouge_score_of_the_written_predictions(trained, tmp_path, capsys):
    evaluate.main(args(trained, tmp_path))
    printed = capsys.readouterr().out
    frame = pd.read_csv(tmp_path / "eval_predictions.csv", dtype=str, keep_default_na=False)
    report = json.loads((tmp_path / "eval_metrics.json").read_text())
    validation = pd.read_csv(trained / "validation.csv", dtype=str)
    assert frame["id"].tolist() == validation["id"].tolist()
    assert frame["reference"].tolist() == validation["summary"].tolist()
    scorer = rouge_scorer.RougeScorer(["rouge1", "rouge2", "rougeL", "rougeLsum"], use_stemmer=True)
    scores = [scorer.score(r, p) for r, p in zip(frame["reference"], frame["prediction"], strict=True)]
    for kind in ("rouge1", "rouge2", "rougeL", "rougeLsum"):
        f1 = [s[kind].fmeasure for s in scores]
        assert report[kind]["mean"] == pytest.approx(sum(f1) / len(f1), abs=1e-12)
        low, high = report[kind]["ci95"]
        assert low <= report[kind]["mean"] <= high
        assert f"{kind:<10} {report[kind]['mean']:>7.4f}" in printed
        if kind != "rougeLsum":
            assert [float(v) for v in frame[kind]] == pytest.approx(f1, abs=1e-9)
    # partly learned: scores spread between wrong and right, so the comparisons above are not between constants
    assert len(set(frame["rougeL"])) >= 5 and 0 < report["rougeL"]["mean"] < 0.95
    assert report["n"] == len(validation) and str(tmp_path / "eval_predictions.csv") in printed


@pytest.mark.slow
def test_scoring_other_weights_into_a_folder_moves_its_evaluation_aside_and_says_so(trained, tmp_path, capsys):
    evaluate.main(args(trained, tmp_path))
    first = json.loads((tmp_path / "eval_metrics.json").read_text())
    assert first["weights"].startswith(str(trained / "out" / "best.pt"))
    evaluate.main(args(trained, tmp_path))  # the same weights again: replaced, nothing set aside
    assert not list(tmp_path.glob("previous-eval-*"))
    capsys.readouterr()
    evaluate.main([*args(trained, tmp_path), f"--ckpt={trained / 'out' / 'ckpt.pt'}"])
    aside = list(tmp_path.glob("previous-eval-*"))
    assert len(aside) == 1 and json.loads((aside[0] / "eval_metrics.json").read_text()) == first
    assert (aside[0] / "eval_predictions.csv").is_file() and str(aside[0]) in capsys.readouterr().out
    assert json.loads((tmp_path / "eval_metrics.json").read_text())["weights"].startswith(
        str(trained / "out" / "ckpt.pt"))


@pytest.mark.slow
def test_a_submission_of_other_weights_is_moved_aside_and_said(trained, tmp_path, capsys):
    """predict.py keeps an earlier submission.csv of other weights as evaluate.py keeps an evaluation."""
    predict.main(args(trained, tmp_path))
    first = (tmp_path / "submission.csv").read_text()
    predict.main(args(trained, tmp_path))  # the same weights again: replaced, nothing set aside
    assert not list(tmp_path.glob("previous-submission-*"))
    capsys.readouterr()
    predict.main([*args(trained, tmp_path), f"--ckpt={trained / 'out' / 'ckpt.pt'}"])
    aside = list(tmp_path.glob("previous-submission-*"))
    assert len(aside) == 1 and (aside[0] / "submission.csv").read_text() == first
    assert f"held the output of other weights ({trained / 'out' / 'best.pt'}" in capsys.readouterr().out
    assert json.loads((tmp_path / "submission.json").read_text())["weights"].startswith(
        str(trained / "out" / "ckpt.pt"))


@pytest.mark.slow
def test_sweep_scores_every_setting_with_one_model_and_names_the_best(trained, tmp_path, capsys):
    # temperature 5 samples nonsense: the best setting is not in the first rows
    evaluate.main(args(trained, tmp_path / "sweep", "--sweep=temperature=5.0,0.0 repetition_penalty=1.0,1.3"))
    printed = capsys.readouterr().out
    table = pd.read_csv(tmp_path / "sweep" / "sweep.csv")
    assert printed.count("weights: ") == 1 and table["setting"].tolist() == [
        "temperature=5.0 repetition_penalty=1.0", "temperature=5.0 repetition_penalty=1.3",
        "temperature=0.0 repetition_penalty=1.0", "temperature=0.0 repetition_penalty=1.3"]
    assert list(table.columns) == ["setting", "rouge1", "rouge2", "rougeL", "mean_tokens", "summaries_per_s",
                                   "rougeL_vs_best", "rougeL_vs_best_low", "rougeL_vs_best_high", "within_best_ci95"]
    assert (table["summaries_per_s"] > 0).all() and (table["mean_tokens"] > 0).all()
    markdown = (tmp_path / "sweep" / "sweep.md").read_text()
    for row in table.itertuples():
        assert f"| {row.setting} | {row.rouge1:.4f} | {row.rouge2:.4f} | {row.rougeL:.4f} |" in markdown
    best = table.loc[table["rougeL"].idxmax()]
    assert best["setting"].startswith("temperature=0.0") and table["rougeL"][:2].max() < best["rougeL"] - 0.1
    assert f"best ROUGE-L {best['rougeL']:.4f}: {best['setting']}; " in printed
    assert best["within_best_ci95"] and not table["within_best_ci95"][:2].any()
    # differences whose paired interval holds 0 are noise: the fastest of those settings is recommended
    fastest = table[table["within_best_ci95"]].sort_values("summaries_per_s").iloc[-1]
    flags = " ".join(f"--{kv}" for kv in fastest["setting"].split())
    assert f"the fastest setting a paired test cannot tell from it: {fastest['setting']} (" in printed
    assert 'id="sweep"' in (tmp_path / "sweep" / "eval_report.html").read_text()  # the recommended setting's
    assert printed.rstrip().endswith(f"pass to predict.py: {flags}")
    # the greedy row is what evaluate.py reports for the same settings
    evaluate.main(args(trained, tmp_path / "plain"))
    report = json.loads((tmp_path / "plain" / "eval_metrics.json").read_text())
    greedy = table.set_index("setting").loc["temperature=0.0 repetition_penalty=1.0"]
    assert greedy["rougeL"] == pytest.approx(report["rougeL"]["mean"], abs=1e-12)
    assert greedy["mean_tokens"] == pytest.approx(report["mean_generated_tokens"], abs=1e-9)


class FirstCallClock:
    """evaluation.py's time.perf_counter, advanced by the decoding alone: a batch costs a second, and the process's
    first batch COLD_BATCHES more (its one-time costs)."""
    COLD_BATCHES = 20

    def __init__(self):
        self.now, self.cold = 0.0, True

    def perf_counter(self):
        return self.now


@pytest.mark.slow
def test_a_sweep_times_each_setting_warm_so_their_order_changes_no_speed(trained, tmp_path, monkeypatch):
    """Two settings that decode the same summaries (greedy ignores the seed), the process's first batch paying 20x a
    warm one, on a machine whose load grows through the sweep (a batch costs 1 s more every 10 s): their summaries/s
    are within 1.3x (the first setting paid the warm-up, 4x slower, before; timed one after the other, the later
    setting was 2x slower)."""
    clock, generate = FirstCallClock(), inference.generate

    def timed(model, prompts, *args, **kwargs):
        clock.now += (1.0 + clock.now / 10) * (1 + FirstCallClock.COLD_BATCHES * clock.cold)
        clock.cold = False
        return generate(model, prompts, *args, **kwargs)
    monkeypatch.setattr(evaluation, "time", clock)
    monkeypatch.setattr(inference, "generate", timed)
    evaluate.main(args(trained, tmp_path, "--sweep=seed=1,2"))
    rows = pd.read_csv(tmp_path / "sweep.csv")
    fast, slow = sorted(rows["summaries_per_s"])[::-1]
    assert rows["rougeL"][0] == rows["rougeL"][1] and fast <= 1.3 * slow, rows


@pytest.mark.slow
def test_a_sweep_setting_that_cannot_work_is_one_error_line_before_any_work(trained, tmp_path, capsys):
    with pytest.raises(SystemExit) as exit:
        evaluate.main(args(trained, tmp_path / "out", "--sweep=num_beams=1,2 temperature=0,0.7"))
    assert exit.value.code == 2
    err = capsys.readouterr().err.strip()
    assert err.count("\n") == 0 and err.startswith("error: sweep setting num_beams=2 temperature=0.7: num_beams=2")
    assert not (tmp_path / "out").exists()


@pytest.mark.slow
def test_submission_has_the_test_ids_in_order_and_no_missing_summary(trained, tmp_path, capsys):
    predict.main(args(trained, tmp_path))
    printed = capsys.readouterr().out
    assert f"wrote {len(TRICKY_IDS)} summaries to {tmp_path / 'submission.csv'}" in printed
    submission = pd.read_csv(tmp_path / "submission.csv", dtype=str, keep_default_na=False)
    assert list(submission.columns) == ["id", "summary"]
    assert submission["id"].tolist() == TRICKY_IDS  # "NaN" included: test.csv's ids are text
    # an empty summary (the model produced nothing) is the only thing a default CSV reader sees as missing,
    # and predict.py reports how many there are
    missing = pd.read_csv(tmp_path / "submission.csv")["summary"].isna()
    assert missing.tolist() == (submission["summary"] == "").tolist()
    reported = re.search(r"\((\d+) empty: the model produced nothing", printed)
    assert missing.sum() == (int(reported[1]) if reported else 0) < len(TRICKY_IDS) // 2


@pytest.mark.slow
def test_two_ranks_write_the_submission_one_process_writes(trained, tmp_path):
    predict.main(args(trained, tmp_path / "single"))
    env = dict(os.environ, OMP_NUM_THREADS="1", PYTHONPATH=REPO)
    result = subprocess.run(torchrun("--nproc_per_node=2", "--standalone", "predict.py",
                                     *args(trained, tmp_path / "sharded")), cwd=REPO, env=env, capture_output=True,
                            text=True, timeout=HANG)
    assert result.returncode == 0, result.stderr[-3000:]
    assert result.stdout.count("wrote 11 summaries") == 1  # rank 0 only
    single = (tmp_path / "single" / "submission.csv").read_bytes()
    assert (tmp_path / "sharded" / "submission.csv").read_bytes() == single


def test_summaries_are_written_as_single_lines_and_read_back_unchanged(tmp_path):
    path = str(tmp_path / "submission.csv")
    report.write_submission(["1", "2", "3"], ["Tom will\ncome\r\n at 5.", "", 'A, "quoted" one'], path)
    back = pd.read_csv(path, dtype=str, keep_default_na=False)
    assert back.values.tolist() == [["1", "Tom will come at 5."], ["2", ""], ["3", 'A, "quoted" one']]
    assert os.listdir(tmp_path) == ["submission.csv"]


@pytest.mark.slow
def test_a_sample_submission_with_other_ids_is_one_error_line(trained, tmp_path, capsys):
    sample = tmp_path / "sample_submission.csv"
    pd.DataFrame({"id": TRICKY_IDS[:-1] + ["extra"], "summary": ""}).to_csv(sample, index=False)
    with pytest.raises(SystemExit) as exit:
        predict.main([*args(trained, tmp_path / "out"), f"--sample_submission_csv={sample}"])
    assert exit.value.code == 2
    err = capsys.readouterr().err.strip()
    assert err.count("\n") == 0 and err.startswith("error: test_csv ids differ from sample_submission_csv")
    assert "1 of its ids are not in test_csv, 1 test ids are not in it" in err
    assert not (tmp_path / "out" / "submission.csv").exists()


def test_a_sample_submission_saved_by_excel_is_read_like_test_csv(tmp_path):
    # BOM, CRLF and Windows-1252 bytes: read as data.py reads the competition CSVs, so the ids compare equal
    sample = tmp_path / "sample_submission.csv"
    sample.write_bytes(b"\xef\xbb\xbfid,summary\r\n007,\r\ncaf\xe9,x\r\n")
    report.check_against_sample(["007", "café"], str(sample))
    with pytest.raises(UserError, match="1 of its ids are not in test_csv"):
        report.check_against_sample(["007", "cafe"], str(sample))


def test_a_sample_submission_in_another_order_is_a_note_that_submission_csv_follows_test_csv(tmp_path):
    sample = tmp_path / "sample_submission.csv"
    sample.write_text("id,summary\n2,\n1,\n3,\n")
    assert report.check_against_sample(["2", "1", "3"], str(sample)) == ""
    assert report.check_against_sample(["1", "2", "3"], str(sample)) == (
        f"note: submission.csv lists the ids in test_csv's order, which differs from sample_submission_csv {sample}'s")


# ---- issue 43: extractive baselines --------------------------------------------------------------------------

def test_extractive_baselines_score_lines_of_each_dialogue_with_the_same_report(tmp_path, capsys):
    """--baseline=first_line (lead3, longest3) needs no model, nor a train_csv beside the validation CSV: its
    summaries are the dialogue's first line (first 3 lines, 3 longest lines in order), scored into
    out_dir/baseline-<name>/ like a checkpoint's; predict.py writes them as a submission."""
    rows = [{"id": "a", "dialogue": "Tom: Hi!\nAnn: Shall we bake cookies tonight?\nTom: Yes.\nAnn: Great, see you.",
             "summary": "Tom and Ann will bake cookies tonight."},
            {"id": "b", "dialogue": "Sam: lunch?\r\nKate: ok, at noon at the usual place\r\n",
             "summary": "Lunch at noon."}]
    save_csv(tmp_path / "validation.csv", rows)
    save_csv(tmp_path / "test.csv", rows, test=True)
    flags = [f"--train_csv={tmp_path / 'missing.csv'}", f"--validation_csv={tmp_path / 'validation.csv'}",
             f"--test_csv={tmp_path / 'test.csv'}", "--sample_submission_csv=", f"--out_dir={tmp_path / 'out'}",
             f"--data_cache_dir={tmp_path / 'cache'}", "--device=cpu"]
    expected = {"first_line": ["Tom: Hi!", "Sam: lunch?"],
                "lead3": ["Tom: Hi! Ann: Shall we bake cookies tonight? Tom: Yes.",
                          "Sam: lunch? Kate: ok, at noon at the usual place"],
                "longest3": ["Ann: Shall we bake cookies tonight? Tom: Yes. Ann: Great, see you.",
                             "Sam: lunch? Kate: ok, at noon at the usual place"]}
    for name, summaries in expected.items():
        evaluate.main([*flags, f"--baseline={name}"])
        out = tmp_path / "out" / f"baseline-{name}"
        scored = pd.read_csv(out / "eval_predictions.csv", keep_default_na=False)
        assert list(scored["prediction"]) == summaries
        scorer = rouge_scorer.RougeScorer(["rougeL"], use_stemmer=True)
        pairs = zip(rows, summaries, strict=True)
        expected_rouge = sum(scorer.score(r["summary"], s)["rougeL"].fmeasure for r, s in pairs) / 2
        report = json.loads((out / "eval_metrics.json").read_text())
        assert report["rougeL"]["mean"] == pytest.approx(expected_rouge) and report["decoding"].startswith("none")
        assert (out / "eval_report.html").is_file()
    predict.main([*flags, "--baseline=first_line"])
    submitted = pd.read_csv(tmp_path / "out" / "baseline-first_line" / "submission.csv")
    assert list(submitted["summary"]) == expected["first_line"]


# ---- issue 65: nothing overwritten ----------------------------------------------------------------------------

@pytest.mark.parametrize("command, data, record", [(predict, "test_csv", "submission.json"),
                                                    (evaluate, "validation_csv", "eval_metrics.json")])
def test_outputs_of_other_data_or_decoding_are_moved_aside_and_the_same_inputs_replace_them(
        command, data, record, tiny_hf_dir, tmp_path, capsys):
    """The same weights with another test_csv (predict.py) or validation split (evaluate.py), or another decoding:
    the earlier files move into previous-*-<time>/, in one line that says what differed and where they went; the
    same inputs again replace them."""
    first, second = (save_csv(tmp_path / f"{name}.csv", synthetic_rows(n, seed=n)) for name, n in (("a", 6), ("b", 3)))
    out = tmp_path / "out" / f"baseline-{os.path.basename(tiny_hf_dir)}"
    flags = ["--device=cpu", "--dtype=float32", "--compile=False", "--max_new_tokens=4", "--block_size=128",
             f"--baseline={tiny_hf_dir}",
             f"--out_dir={tmp_path / 'out'}", f"--data_cache_dir={tmp_path / 'cache'}", "--sample_submission_csv="]

    def written():
        return {p.name: p.read_text() for p in out.iterdir() if p.is_file()}
    command.main([*flags, f"--{data}={first}"])
    command.main([*flags, f"--{data}={first}"])  # the same inputs: the same files, replaced
    assert not [p for p in out.iterdir() if p.is_dir()]
    before, said = written(), []
    for changed, was in ((f"--{data}={second}", first), ("--num_beams=2", "greedy: max_new_tokens=4")):
        capsys.readouterr()
        command.main([*flags, f"--{data}={second}", changed])
        line = [line for line in capsys.readouterr().out.splitlines() if "held the output of other" in line]
        aside = sorted(p for p in out.iterdir() if p.is_dir())[-1]
        assert len(line) == 1 and line[0].endswith(f" to {aside}") and was in line[0], line
        assert {p.name: p.read_text() for p in aside.iterdir()} == before
        before, said = written(), [*said, line[0]]
    assert "other decoding" in said[1] and json.loads((out / record).read_text())["decoding"].startswith("beam")


def test_a_max_new_tokens_that_leaves_dialogues_under_half_their_training_length_is_warned_in_one_line():
    """A larger max_new_tokens than training's shortens every prompt (data.prompt_format); followed to the edge of
    block_size, the error's hint kept each dialogue's first token, with no warning."""
    def warning(max_new_tokens):
        cfg = load_config([f"--max_new_tokens={max_new_tokens}"])
        return inference.SummaryModel(tiny_gpt(block_size=256), cfg, trained_max_new_tokens=48).cut_warning()
    line = warning(238)
    assert line.startswith("warning: max_new_tokens=238 leaves each dialogue its first ") and "\n" not in line
    fits = int(line.rsplit("--max_new_tokens=", 1)[1])
    assert warning(fits) is None and warning(fits + 1) is not None and warning(48) is None
