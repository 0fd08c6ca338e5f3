"""eval_report.html and --compare: the report of the demo run shows its scores and its worst examples and fetches
nothing (a real browser renders it without console errors); the paired bootstrap gives the known answers; the
comparison's line matches the two eval_predictions.csv; evaluations of other dialogues are refused in one line."""
import base64
import contextlib
import io
import json
import os
import re
import shutil
import subprocess
import types
from html.parser import HTMLParser

import numpy as np
import pandas as pd
import pytest
from matplotlib import image

import data
import evaluate
import train
from config import Config
from conftest import HANG, REPO, one_error_line, synthetic_rows
from summarizer import evaluation, inference, report

DEMO = os.path.join(REPO, "data", "demo")
PRESET = os.path.join(REPO, "config", "demo.py")
DEMO_CSVS = [f"--train_csv={DEMO}/train.csv", f"--validation_csv={DEMO}/validation.csv",
             f"--test_csv={DEMO}/test.csv", f"--sample_submission_csv={DEMO}/sample_submission.csv"]
LINE = re.compile(r"^(rouge1|rouge2|rougeL) ([+-]\d\.\d{4}) \[([+-]\d\.\d{4}), ([+-]\d\.\d{4})\] vs (.+): better on "
                  r"(\d+), worse on (\d+) of (\d+)$", flags=re.M)


class Fetches(HTMLParser):
    """What a page would load or run: elements that fetch or script, src/href values that are not in-page anchors
    or inline data, and url()/@import in styles."""
    LOADING = {"script", "link", "iframe", "object", "embed", "audio", "video", "source", "base", "frame"}

    def __init__(self):
        super().__init__()
        self.found, self.in_style = [], False

    def handle_starttag(self, tag, attrs):
        self.found += [tag] if tag in self.LOADING else []
        self.in_style = tag == "style"
        for name, value in attrs:
            if name in ("src", "href", "srcset", "action", "poster", "data", "background") and not (
                    value or "").startswith(("#", "data:")):
                self.found.append(f"{tag} {name}={value}")
            if name.startswith("on") or (name == "style" and "url(" in (value or "")):
                self.found.append(f"{tag} {name}={value}")

    def handle_data(self, data):
        if self.in_style and ("url(" in data or "@import" in data):
            self.found.append(f"style {data.strip()[:80]}")

    def handle_endtag(self, tag):
        self.in_style = False


def fetches(page):
    """Everything `page` (HTML) would fetch or run, inline SVG figures included."""
    parser = Fetches()
    parser.feed(page)
    for svg in re.findall(r"data:image/svg\+xml;base64,([A-Za-z0-9+/=]+)", page):
        parser.found += re.findall(r"(?:href|src)=\"(?![#]|data:)[^\"]*\"", base64.b64decode(svg).decode())
    return parser.found


def section(page, anchor):
    return page.split(f'<section id="{anchor}">', 1)[1].split("</section>", 1)[0]


def shown_ids(page, anchor):
    return re.findall(r'<span class="id">(.*?)</span>', section(page, anchor))


def ids_by_rouge(frame, n, lowest=True):
    """The ids of the n lowest (or highest) ROUGE-L, ties in file order."""
    scores = frame["rougeL"].to_numpy()
    return frame["id"].to_numpy()[np.argsort(scores if lowest else -scores, kind="stable")[:n]].tolist()


# ---- the paired bootstrap --------------------------------------------------------------------------------------

def test_identical_scores_differ_by_zero_with_an_interval_of_zero():
    scores = np.random.default_rng(0).uniform(0, 1, 819)
    assert evaluation.paired_bootstrap(scores, scores.copy()) == (0.0, (0.0, 0.0))


def test_a_run_better_on_every_dialogue_has_an_interval_above_zero_that_unpaired_intervals_miss():
    rng = np.random.default_rng(1)
    theirs = rng.uniform(0, 0.8, 200)
    ours = theirs + rng.uniform(0.001, 0.02, 200)
    mean, (low, high) = evaluation.paired_bootstrap(ours, theirs)
    assert 0 < low <= mean <= high and mean == pytest.approx(np.mean(ours - theirs))
    # each run's own interval overlaps the other's: only pairing the dialogues shows the difference
    assert evaluation.bootstrap_interval(ours)[0] < evaluation.bootstrap_interval(theirs)[1]


def test_swapping_the_runs_flips_the_sign():
    rng = np.random.default_rng(2)
    ours, theirs = rng.uniform(0, 1, 300), rng.uniform(0, 1, 300)
    mean, (low, high) = evaluation.paired_bootstrap(ours, theirs)
    swapped, (swapped_low, swapped_high) = evaluation.paired_bootstrap(theirs, ours)
    assert low < 0 < high  # two unrelated runs: no difference to find
    assert (swapped, swapped_low, swapped_high) == pytest.approx((-mean, -high, -low), abs=1e-12)


# ---- the report of an evaluation, without a model ----------------------------------------------------------------

@pytest.fixture(scope="module")
def samsum_sized(tmp_path_factory):
    """An evaluation as large as SAMSum's validation split (819 dialogues), scored against shuffled references,
    with 2 empty summaries, 3 that loop and 1 as long as max_new_tokens; its report. Returns (frame, metrics,
    page, path)."""
    rows = synthetic_rows(819, seed=5)
    val = types.SimpleNamespace(ids=[r["id"] for r in rows], dialogues=[r["dialogue"] * 6 for r in rows],
                                summaries=[r["summary"] for r in rows])
    predictions = list(np.random.default_rng(0).permutation(val.summaries))
    predictions[10:16] = ["", "", "we will, we will, we will go", "a b c a b c", "yes no maybe yes no maybe",
                          " ".join(f"w{i}" for i in range(40))]
    cfg = Config(validation_csv="validation.csv", max_new_tokens=40)
    summary_model = types.SimpleNamespace(weights="out/best.pt (iter 300)", ckpt={"iter_num": 300}, cfg=cfg)
    frame = evaluation.scored_frame(val, predictions)
    metrics = evaluation.scores_report(frame, summary_model, cfg, [])
    path = tmp_path_factory.mktemp("report") / "eval_report.html"
    report.write_report(path, frame, metrics)
    return frame, metrics, path.read_text(encoding="utf-8"), path


def test_the_report_shows_what_was_scored_its_rouge_and_diagnostics(samsum_sized):
    frame, metrics, page, path = samsum_sized
    assert os.path.getsize(path) < 5e6
    scored = section(page, "scored")
    assert "out/best.pt (iter 300)" in scored and "<td>300</td>" in scored and "<td>819</td>" in scored
    assert "greedy: max_new_tokens=40" in scored and "validation.csv" in scored
    scores = section(page, "scores")
    for t in ("rouge1", "rouge2", "rougeL", "rougeLsum"):
        low, high = metrics[t]["ci95"]
        assert f'<td>{t}</td><td class="num">{np.mean(frame[t]):.4f}</td><td class="num">[{low:.4f}, {high:.4f}]' \
            in scores
    assert ">2 of 819 (0.2%)<" in scores  # empty
    assert ">3 of 819 (0.4%)<" in scores  # repeat a word 3-gram
    assert ">1 of 819 (0.1%)<" in scores  # reached max_new_tokens=40
    enc = data.get_tokenizer()
    generated, reference = ([len(enc.encode_ordinary(text)) for text in frame[c]] for c in ("prediction", "reference"))
    assert f'>{np.mean(generated) / np.mean(reference):.2f}<' in scores


def test_the_report_lists_the_worst_and_best_summaries_with_their_dialogues(samsum_sized):
    frame, _, page, _ = samsum_sized
    assert shown_ids(page, "worst") == ids_by_rouge(frame, 20)
    assert shown_ids(page, "best") == ids_by_rouge(frame, 10, lowest=False)
    assert section(page, "worst").count("<details><summary>dialogue") == 20
    assert page.count("data:image/svg+xml;base64,") == 3 and "data:image/png" not in page  # no metrics.jsonl here


def test_the_report_fetches_and_runs_nothing(samsum_sized):
    assert fetches(samsum_sized[2]) == []
    # the check finds what it looks for
    assert len(fetches('<img src="https://x/y.png"><script>1</script><style>@import "a.css";</style>')) == 3


def test_shared_words_are_marked_as_rouge_counts_them():
    words = inference.StemCachedTokenizer()
    shared = report.words_of("Amanda bakes cookies for <Jerry>", words)
    assert (report.marked("They baked a cookie & <b>Jerry</b>", shared, words)
            == "They <mark>baked</mark> a <mark>cookie</mark> &amp; &lt;b&gt;<mark>Jerry</mark>&lt;/b&gt;")


# ---- refusals --------------------------------------------------------------------------------------------------

def test_comparing_with_an_evaluation_of_other_dialogues_is_refused_in_one_line(tmp_path, capsys):
    validation = pd.read_csv(f"{DEMO}/validation.csv", dtype=str, keep_default_na=False)
    other = pd.DataFrame({"id": validation["id"], "dialogue": validation["dialogue"],
                          "reference": validation["summary"], "prediction": validation["summary"],
                          "rouge1": 1.0, "rouge2": 1.0, "rougeL": 1.0})
    argv = [PRESET, "--baseline=scratch", *DEMO_CSVS, f"--data_cache_dir={tmp_path / 'cache'}",
            f"--out_dir={tmp_path / 'out'}"]
    fewer = tmp_path / "fewer.csv"
    other.drop(index=[3, 4]).to_csv(fewer, index=False)
    line = one_error_line(capsys, evaluate.main, [*argv, f"--compare={fewer}"])
    assert line == (f"error: --compare={fewer} scored other dialogues than this evaluation: 2 of the "
                    f"{len(other)} ids here are not there (e.g. {other['id'][3]})")
    changed = tmp_path / "changed"
    changed.mkdir()
    other.assign(reference=[r + " Or not." if i == 7 else r for i, r in enumerate(other["reference"])]).to_csv(
        changed / "eval_predictions.csv", index=False)
    line = one_error_line(capsys, evaluate.main, [*argv, f"--compare={changed}"])
    assert line.endswith(f"1 of the {len(other)} ids have another reference there (e.g. id {other['id'][7]})")
    line = one_error_line(capsys, evaluate.main, [*argv, f"--compare={tmp_path / 'nowhere'}"])
    assert line.startswith(f"error: --compare={tmp_path / 'nowhere'}: ") and "does not exist" in line
    assert not (tmp_path / "out").exists()  # refused before anything was written


# ---- the demo run ------------------------------------------------------------------------------------------------

@pytest.fixture(scope="module")
def demo(tmp_path_factory):
    """config/demo.py trained briefly, its evaluation (evaluate_after), an untrained model of its shape scored into
    out-demo/baseline-scratch, then the trained model evaluated again --compare'd with it. Returns (out_dir,
    what the comparison printed)."""
    folder = tmp_path_factory.mktemp("demo")
    out = folder / "out-demo"
    common = [PRESET, *DEMO_CSVS, f"--out_dir={out}", f"--data_cache_dir={folder / 'cache'}"]
    with contextlib.redirect_stdout(io.StringIO()):
        # what the report shows is the evaluation below: training scores no ROUGE and evaluates nothing after
        train.main([*common, "--max_iters=30", "--eval_interval=15", "--predict_after=False", "--evaluate_after=False",
                    "--rouge_samples=0", "--best_metric=val_loss"])
        evaluate.main([*common, "--baseline=scratch"])
    printed = io.StringIO()
    with contextlib.redirect_stdout(printed):
        evaluate.main([*common, f"--compare={out / 'baseline-scratch'}"])
    return out, printed.getvalue()


@pytest.mark.slow
def test_the_demo_report_shows_the_runs_rouge_and_its_worst_examples(demo):
    out, _ = demo
    page = (out / "eval_report.html").read_text(encoding="utf-8")
    metrics = json.loads((out / "eval_metrics.json").read_text())
    frame = pd.read_csv(out / "eval_predictions.csv", dtype={"id": str}, keep_default_na=False)
    assert f'<td>rougeL</td><td class="num">{metrics["rougeL"]["mean"]:.4f}</td>' in section(page, "scores")
    assert 0 < metrics["rougeL"]["mean"] < 1 and frame["rougeL"].nunique() > 5  # a spread, not constants
    assert shown_ids(page, "worst")[:5] == ids_by_rouge(frame, 5)
    assert f"{out / 'best.pt'}" in section(page, "scored") and metrics["step"] in (15, 30)
    assert "data:image/png;base64," in section(page, "figures")  # the training curve: the run has metrics.jsonl
    assert fetches(page) == []


@pytest.mark.slow
def test_compare_prints_the_paired_differences_and_reports_the_dialogues_that_changed_most(demo):
    out, printed = demo
    ours = pd.read_csv(out / "eval_predictions.csv", dtype={"id": str}, keep_default_na=False)
    theirs = pd.read_csv(out / "baseline-scratch" / "eval_predictions.csv", dtype={"id": str}, keep_default_na=False)
    both = ours.merge(theirs, on="id", suffixes=("", "_other"), validate="one_to_one")
    lines = {m[1]: m for m in LINE.finditer(printed)}
    assert sorted(lines) == ["rouge1", "rouge2", "rougeL"]
    for t, m in lines.items():
        change = both[t] - both[f"{t}_other"]
        assert m[2] == f"{change.mean():+.4f}" and float(m[3]) <= float(m[2]) <= float(m[4])
        assert m[5] == str(out / "baseline-scratch") and int(m[8]) == len(ours) == len(theirs)
        assert (int(m[6]), int(m[7])) == ((change > 1e-9).sum(), (change < -1e-9).sum())
    assert float(lines["rougeL"][3]) > 0  # trained beats untrained
    page = (out / "eval_report.html").read_text(encoding="utf-8")
    change = (both["rougeL"] - both["rougeL_other"]).abs().to_numpy()
    most = both["id"].to_numpy()[np.argsort(-change, kind="stable")[:3]]
    assert shown_ids(page, "compare")[:3] == most.tolist()
    assert json.loads((out / "eval_metrics.json").read_text())["compare"]["with"] == str(out / "baseline-scratch")


@pytest.mark.slow
def test_chromium_renders_the_demo_report_without_console_errors(demo, tmp_path):
    chromium = shutil.which("chromium")
    if chromium is None:
        pytest.skip("no chromium: apt-get install -y chromium (.ci/run installs it)")
    out, _ = demo
    errors = screenshot(chromium, out / "eval_report.html", tmp_path / "report.png", tmp_path)
    assert errors == []
    pixels = image.imread(tmp_path / "report.png")[..., :3]
    assert pixels.shape[:2] == (1600, 1280)
    ink = (pixels < 0.9).any(axis=2)  # not near white
    assert 0.02 < ink.mean() < 0.9 and len(np.unique(pixels.reshape(-1, 3), axis=0)) > 50
    # the console check finds errors where there are some
    broken = tmp_path / "broken.html"
    broken.write_text("<!DOCTYPE html><p>x</p><script>console.error('broken')</script>")
    assert any("broken" in line for line in screenshot(chromium, broken, tmp_path / "broken.png", tmp_path))


def screenshot(chromium, page, png, folder):
    """Render the page in headless Chromium into png (1280 x 1600); the console lines it logged."""
    result = subprocess.run([chromium, "--headless", "--no-sandbox", "--disable-gpu", "--hide-scrollbars",
                             f"--user-data-dir={folder / 'chromium'}", "--window-size=1280,1600",
                             f"--screenshot={png}", "--enable-logging=stderr", "--v=0", page.as_uri()],
                            capture_output=True, text=True, timeout=HANG)
    assert result.returncode == 0 and png.is_file(), result.stderr[-3000:]
    return [line for line in result.stderr.splitlines() if ":CONSOLE" in line]


def test_sweep_rows_are_compared_with_the_best_by_the_paired_test():
    rng = np.random.default_rng(3)
    best, noise = rng.uniform(0, 1, 400), rng.normal(0, 0.05, 400)
    # slower best; as good but for noise; fastest, and a little worse on every dialogue
    scores = (best, best + noise - noise.mean() - 0.001, best - 0.001)
    frames = [pd.DataFrame({"rougeL": s}) for s in scores]
    rows = [{"rougeL": float(s.mean()), "summaries_per_s": speed} for s, speed in zip(scores, (1, 2, 3), strict=True)]
    assert evaluation.against_the_best(rows, frames) == (0, 1)
    assert [row["within_best_ci95"] for row in rows] == [True, True, False]
    assert rows[0]["rougeL_vs_best"] == 0 and rows[1]["rougeL_vs_best_low"] < 0 < rows[1]["rougeL_vs_best_high"]
    assert rows[2]["rougeL_vs_best_high"] < 0


# ---- issue 43: what one dialogue and no change can say ----------------------------------------------------------

def test_one_dialogue_gives_no_interval_and_the_report_says_so(tmp_path):
    rows = synthetic_rows(1, seed=3)
    val = types.SimpleNamespace(ids=[rows[0]["id"]], dialogues=[rows[0]["dialogue"]], summaries=[rows[0]["summary"]])
    frame = evaluation.scored_frame(val, ["they will meet"])
    summary_model = types.SimpleNamespace(weights="out/best.pt (iter 3)", ckpt={"iter_num": 3}, cfg=Config())
    metrics = evaluation.scores_report(frame, summary_model, Config(), [])
    assert evaluation.bootstrap_interval([0.5]) is None and metrics["rougeL"]["ci95"] is None
    assert "(no interval: fewer than 2 dialogues)" in evaluation.format_report(metrics)
    comparison = evaluation.Comparison("other", frame.copy(), evaluation.compare(frame, frame.copy()))
    report.write_report(tmp_path / "eval_report.html", frame, metrics, comparison=comparison)
    page = (tmp_path / "eval_report.html").read_text(encoding="utf-8")
    assert "(no interval: fewer than 2 dialogues)" in section(page, "scores")
    assert "(no interval: fewer than 2 dialogues)" in section(page, "compare")


def test_a_comparison_where_no_dialogue_changed_says_so_instead_of_an_empty_table(samsum_sized, tmp_path):
    frame, metrics, _, _ = samsum_sized
    comparison = evaluation.Comparison("itself", frame.copy(), evaluation.compare(frame, frame.copy()))
    report.write_report(tmp_path / "eval_report.html", frame, metrics, comparison=comparison)
    compared = section((tmp_path / "eval_report.html").read_text(encoding="utf-8"), "compare")
    assert "No dialogue's ROUGE-L changed" in compared and "changed most" not in compared
    assert 'class="examples"' not in compared
