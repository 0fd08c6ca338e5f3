"""What the user reads: eval_report.html (one page, offline, without JavaScript) and submission.csv."""
import base64
import html
import io
import json
import os
import re
import tempfile

import numpy as np
import pandas as pd
from matplotlib import rc_context
from matplotlib.figure import Figure

import data
from command_line import UserError, atomic_write
from config import ROUGE_TYPES
from summarizer import inference, run_folder, tracking

WORST, BEST, CHANGED = 20, 10, 20  # examples shown: lowest and highest ROUGE-L, largest change against --compare
LENGTH_BUCKETS = 5  # dialogue-length buckets of (about) equal size in the ROUGE-L-by-length figure
WORD = re.compile(r"([A-Za-z0-9]+)")  # a word as ROUGE's tokenizer cuts text (before lowercasing and stemming)
# text stays text (smaller, sharp, the browser's fonts); a fixed salt makes the same evaluation the same file
SVG_STYLE = {"svg.fonttype": "none", "svg.hashsalt": "eval-report", "font.size": 9}

CSS = """
body { font: 14px/1.45 system-ui, -apple-system, "Segoe UI", Roboto, sans-serif; color: #1d1d1f; margin: 0 auto;
       max-width: 1280px; padding: 0.5rem 2rem 3rem; }
h1 { margin-bottom: 0.2rem; } h2 { margin-top: 2rem; border-bottom: 2px solid #e3e3e8; }
nav a { margin-right: 1rem; } .muted { color: #6e6e73; } table { border-collapse: collapse; margin: 0.5rem 0; }
th, td { border-bottom: 1px solid #e3e3e8; padding: 0.3rem 0.6rem; text-align: left; vertical-align: top; }
th { background: #f5f5f7; } td.num { white-space: nowrap; }
.num { text-align: right; font-variant-numeric: tabular-nums; }
table.examples { width: 100%; table-layout: fixed; } table.examples .num { width: 5.5rem; }
table.examples .key { width: 9rem; } table.examples .text { overflow-wrap: anywhere; }
tr.dialogue td { border-bottom: 2px solid #c7c7cc; padding-top: 0; }
mark { background: #c9ecc4; padding: 0 1px; border-radius: 2px; } details summary { cursor: pointer; color: #0a58ca; }
details pre { white-space: pre-wrap; font: inherit; background: #f5f5f7; padding: 0.5rem; margin: 0.3rem 0; }
.figures { display: grid; grid-template-columns: repeat(auto-fit, minmax(480px, 1fr)); gap: 1rem; }
figure { margin: 0; } figure img { width: 100%; height: auto; } figcaption { color: #6e6e73; }
figure.wide { grid-column: 1 / -1; }
tr.picked td { background: #eef6ff; } .better { color: #1a7f37; } .worse { color: #c62828; }
"""


def write_report(path, frame, report, curve="", comparison=None, sweep_rows=None):
    words = inference.StemCachedTokenizer()
    sections = [scored_section(report), scores_section(report), figures_section(frame, report, curve),
                sweep_section(sweep_rows, report) if sweep_rows else "",
                comparison_section(frame, comparison, words) if comparison else "", examples_section(frame, words)]
    links = [("scored", "what was scored"), ("scores", "ROUGE and diagnostics"), ("figures", "figures"),
             ("sweep", "sweep"), ("compare", "comparison"), ("worst", "worst summaries"), ("best", "best summaries")]
    nav = "".join(f'<a href="#{anchor}">{text}</a>' for anchor, text in links if f'id="{anchor}"' in "".join(sections))
    page = ("<!DOCTYPE html>\n<html lang=\"en\">\n<head>\n<meta charset=\"utf-8\">\n"
            "<meta name=\"viewport\" content=\"width=device-width, initial-scale=1\">\n"
            f"<title>Evaluation: {esc(report['weights'])}</title>\n<style>{CSS}</style>\n</head>\n<body>\n"
            f"<h1>Evaluation report</h1>\n<p class=\"muted\">{esc(report['weights'])}</p>\n<nav>{nav}</nav>\n"
            + "\n".join(filter(None, sections)) + "\n</body>\n</html>\n")
    with atomic_write(path) as f:
        f.write(page)


def esc(value):
    return html.escape(str(value))


def table(head, rows, classes=None, attrs=""):
    """Cells hold HTML; head None: no header row; a row given as a string is a whole <tr>."""
    classes = classes or {}

    def cells(tag, values):
        return "".join(f'<{tag} class="{classes[i]}">{v}</{tag}>' if i in classes else f"<{tag}>{v}</{tag}>"
                       for i, v in enumerate(values))
    body = "".join(row if isinstance(row, str) else f"<tr>{cells('td', row)}</tr>" for row in rows)
    header = "" if head is None else f"<tr>{cells('th', head)}</tr>"
    return f"<table{attrs}>{header}{body}</table>"


def section(anchor, title, *parts):
    return f'<section id="{anchor}"><h2>{title}</h2>{"".join(parts)}</section>'


def note(text):
    return f'<p class="muted">{text}</p>'


def scored_section(report):
    rows = [("weights", report["weights"]), ("step", "" if report.get("step") is None else report["step"]),
            ("decoding", report["decoding"]), ("validation split", report["split"]), ("dialogues", report["n"])]
    if report.get("setting"):
        rows.insert(3, ("sweep setting", f"{report['setting']} (the one the sweep below recommends)"))
    return section("scored", "What was scored", table(None, [[f"<b>{esc(k)}</b>", esc(v)] for k, v in rows]))


def scores_section(report):
    rouge = [[t, f"{report[t]['mean']:.4f}", interval_text(report[t]["ci95"])] for t in ROUGE_TYPES]
    found, n = report["diagnostics"], report["n"]
    diagnostics = [
        ("mean summary length in tokens, generated / reference",
         f"{report['mean_generated_tokens']:.1f} / {report['mean_reference_tokens']:.1f}"),
        ("length ratio, generated / reference", f"{found['length_ratio']:.2f}"),
        (f"summaries that reached max_new_tokens={found['max_new_tokens']} (cut off)",
         share(found["at_max_new_tokens"], n)),
        ("empty summaries", share(found["empty"], n)),
        (f"summaries that repeat a word {found['repeated_ngram']}-gram", share(found["with_repeated_ngram"], n))]
    return section("scores", "ROUGE F1",
                   note("rouge-score with the Porter stemmer, as the competition scores; 95% bootstrap intervals of "
                        "the mean over the dialogues."),
                   table(["metric", "mean", "95% interval"], rouge, {1: "num", 2: "num"}), "<h3>Diagnostics</h3>",
                   table(None, [[esc(k), esc(v)] for k, v in diagnostics], {1: "num"}))


def interval_text(ci95, signed=False):
    if ci95 is None or ci95[0] is None:
        return "(no interval: fewer than 2 dialogues)"
    return f"[{ci95[0]:{'+' if signed else ''}.4f}, {ci95[1]:{'+' if signed else ''}.4f}]"


def share(count, n):
    return f"{count} of {n} ({100 * count / max(n, 1):.1f}%)"


SWEEP_HEAD = ["setting", "ROUGE-1", "ROUGE-2", "ROUGE-L", "mean length (tokens)", "summaries/s",
              "ROUGE-L - best's (paired 95%)", "within noise of the best"]


def sweep_cells(row, picked=None):
    interval = interval_text((row["rougeL_vs_best_low"], row["rougeL_vs_best_high"]), signed=True)
    return [row["setting"], *(f"{row[t]:.4f}" for t in ("rouge1", "rouge2", "rougeL")), f"{row['mean_tokens']:.1f}",
            f"{row['summaries_per_s']:.1f}", f"{row['rougeL_vs_best']:+.4f} {interval}",
            "yes, recommended" if row["setting"] == picked else "yes" if row["within_best_ci95"] else ""]


def sweep_section(rows, report):
    body = [[esc(cell) for cell in sweep_cells(row, report["setting"])] for row in rows]
    return section("sweep", "Sweep",
                   note("Each setting's ROUGE-L minus the best's, paired over the same dialogues (95% bootstrap "
                        "interval). The recommended setting, which this report details, is the fastest whose "
                        "interval holds 0."),
                   table(SWEEP_HEAD, body, dict.fromkeys(range(1, 7), "num")))


def comparison_section(frame, comparison, words):
    label, other = esc(comparison.label), comparison.other
    summary = [[t, f"{s['mean_diff']:+.4f}", interval_text(s["ci95"], signed=True), s["better"], s["worse"],
                s["same"]] for t, s in comparison.stats.items()]
    change = frame["rougeL"].to_numpy() - other["rougeL"].to_numpy()
    order = [i for i in np.argsort(-abs(change), kind="stable")[:CHANGED] if change[i] != 0]
    rows = []
    for i in order:
        reference = words_of(frame["reference"][i], words)
        ours, theirs = frame["prediction"][i], other["prediction"][i]
        direction = "better" if change[i] > 0 else "worse"
        rows += [[id_cell(frame["id"][i]), f'<span class="{direction}">{change[i]:+.4f}</span>',
                  marked(frame["reference"][i], words_of(ours, words) | words_of(theirs, words), words),
                  f'{marked(ours, reference, words)}<br><span class="muted">ROUGE-L {frame["rougeL"][i]:.4f}</span>',
                  f'{marked(theirs, reference, words)}<br><span class="muted">ROUGE-L {other["rougeL"][i]:.4f}</span>'],
                 dialogue_row(frame["dialogue"][i], 5)]
    return section("compare", f"Compared with {label}",
                   note(f"This evaluation minus {label} on the same {len(frame)} dialogues: the mean difference with "
                        f"its paired 95% bootstrap interval, and on how many dialogues this one scores better, worse "
                        f"or the same."),
                   table(["metric", "difference", "95% interval", "better", "worse", "same"], summary,
                         dict.fromkeys(range(1, 6), "num")),
                   f"<h3>The {len(order)} dialogues whose ROUGE-L changed most</h3>" if order else
                   "<h3>No dialogue's ROUGE-L changed</h3>"
                   + note(f"Every one of the {len(frame)} dialogues scores the same ROUGE-L in both evaluations."),
                   table(["id", "ROUGE-L change", "reference", "this summary", f"summary of {label}"], rows,
                         {0: "key", 1: "num", 2: "text", 3: "text", 4: "text"}, ' class="examples"') if order else "")


def examples_section(frame, words):
    scores = frame["rougeL"].to_numpy()
    worst, best = np.argsort(scores, kind="stable")[:WORST], np.argsort(-scores, kind="stable")[:BEST]
    return (section("worst", f"The {len(worst)} worst summaries (lowest ROUGE-L)", example_table(frame, worst, words))
            + section("best", f"The {len(best)} best summaries (highest ROUGE-L)", example_table(frame, best, words)))


def example_table(frame, indices, words):
    rows = []
    for i in indices:
        reference, prediction = frame["reference"][i], frame["prediction"][i]
        rows += [[id_cell(frame["id"][i]), *(f"{frame[t][i]:.4f}" for t in ("rouge1", "rouge2", "rougeL")),
                  marked(reference, words_of(prediction, words), words),
                  marked(prediction, words_of(reference, words), words) or "<i>(empty)</i>"],
                 dialogue_row(frame["dialogue"][i], 6)]
    return table(["id", "ROUGE-1", "ROUGE-2", "ROUGE-L", "reference", "summary (shared words marked)"], rows,
                 {0: "key", 1: "num", 2: "num", 3: "num", 4: "text", 5: "text"}, ' class="examples"')


def id_cell(value):
    return f'<span class="id">{esc(value)}</span>'


def dialogue_row(dialogue, columns):
    return (f'<tr class="dialogue"><td colspan="{columns}"><details><summary>dialogue ({len(dialogue.split())} '
            f"words)</summary><pre>{esc(dialogue)}</pre></details></td></tr>")


def words_of(text, words):
    return set(words.tokenize(text))


def marked(text, shared, words):
    parts = WORD.split(text)  # the words at odd places
    return "".join(f"<mark>{part}</mark>" if i % 2 and shared & words_of(part, words) else esc(part)
                   for i, part in enumerate(parts))


def figures_section(frame, report, curve):
    with rc_context(SVG_STYLE):
        figures = [figure(svg(rouge_histogram, frame), "Per-dialogue ROUGE-L: where the mean comes from."),
                   figure(svg(rouge_by_length, frame), "ROUGE-L by dialogue length: long dialogues are cut to fit "
                                                       "block_size and are harder to summarize."),
                   figure(svg(lengths_scatter, frame, report["diagnostics"]["max_new_tokens"]),
                          "Generated against reference length: points above the diagonal run long, points on the "
                          "dashed line were cut off.")]
    if curve:
        figures.append(figure(training_curve(curve), f"The training run ({esc(curve)}).", "wide"))
    return section("figures", "Figures", f'<div class="figures">{"".join(figures)}</div>')


def figure(image, caption, kind=""):
    mime, data = image
    uri = f"data:{mime};base64,{base64.b64encode(data).decode('ascii')}"
    attrs = f' class="{kind}"' if kind else ""
    return f'<figure{attrs}><img alt="{esc(caption)}" src="{uri}"><figcaption>{caption}</figcaption></figure>'


def svg(draw, *args):
    ax = Figure(figsize=(6, 3.6), layout="tight").subplots()
    draw(ax, *args)
    buffer = io.BytesIO()
    ax.figure.savefig(buffer, format="svg", metadata={"Date": None})
    return "image/svg+xml", buffer.getvalue()


def rouge_histogram(ax, frame):
    values = frame["rougeL"]
    ax.hist(values, bins=np.linspace(0, 1, 21), color="#4c72b0", edgecolor="white")
    ax.axvline(values.mean(), color="#c62828", linestyle="--", label=f"mean {values.mean():.4f}")
    ax.set(xlabel="ROUGE-L F1 of one summary", ylabel="dialogues", title="Per-dialogue ROUGE-L", xlim=(0, 1))
    ax.legend()


def rouge_by_length(ax, frame):
    buckets = pd.qcut(frame["dialogue_tokens"].rank(method="first"), min(LENGTH_BUCKETS, len(frame)), labels=False)
    groups = frame.groupby(buckets).agg(low=("dialogue_tokens", "min"), high=("dialogue_tokens", "max"),
                                        rouge=("rougeL", "mean"), n=("rougeL", "size"))
    bars = ax.bar([f"{g.low}-{g.high}" for g in groups.itertuples()], groups["rouge"], color="#55a868")
    ax.bar_label(bars, labels=[f"n={n}" for n in groups["n"]], fontsize=8)
    ax.axhline(frame["rougeL"].mean(), color="#c62828", linestyle="--", label="all dialogues")
    ax.set(xlabel="dialogue length (tokens)", ylabel="mean ROUGE-L", title="ROUGE-L by dialogue length",
           ylim=(0, 1.3 * max(groups["rouge"].max(), 0.01)))  # room above the bars for their labels and the legend
    ax.legend(loc="upper left")


def lengths_scatter(ax, frame, max_new_tokens):
    ax.scatter(frame["reference_tokens"], frame["generated_tokens"], s=14, alpha=0.5, color="#4c72b0", linewidths=0)
    top = max(frame["reference_tokens"].max(), frame["generated_tokens"].max(), max_new_tokens) + 2
    ax.plot([0, top], [0, top], color="#6e6e73", linewidth=1, label="same length")
    ax.axhline(max_new_tokens, color="#c62828", linestyle="--", linewidth=1, label=f"max_new_tokens={max_new_tokens}")
    ax.set(xlabel="reference length (tokens)", ylabel="generated length (tokens)", xlim=(0, top), ylim=(0, top),
           title="Generated against reference length")
    ax.legend(loc="upper left")


def training_curve(jsonl_path):
    with tempfile.TemporaryDirectory() as folder:
        png = os.path.join(folder, "metrics.png")
        tracking.plot_metrics(jsonl_path, png, title=os.path.dirname(jsonl_path) or ".")
        with open(png, "rb") as f:
            return "image/png", f.read()


def write_submission(ids, summaries, path):
    frame = pd.DataFrame({"id": ids, "summary": [" ".join(s.split()) for s in summaries]})
    with atomic_write(path) as f:
        frame.to_csv(f, index=False)


def check_against_sample(ids, path):
    """UserError unless the sample has columns id,summary and the test ids; a note where its order differs."""
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


def predict(cfg, explicit, proc):
    out = inference.output_dir(cfg)
    summary_model = inference.load_summary_model(cfg, explicit, proc, lambda run_cfg: f"test {run_cfg.test_csv}")
    test = data.read_test(summary_model.cfg)
    note = cfg.sample_submission_csv and check_against_sample(test.ids, cfg.sample_submission_csv)
    if note and proc.is_main:
        print(note)  # every rank checks: each stops alike
    prompts, cut = summary_model.prompts(test.dialogues)
    if proc.is_main and cut:
        print(inference.cut_line(summary_model, cut, len(prompts)))
    summaries = summary_model.summarize(prompts, proc)
    if not proc.is_main:
        return None
    made_by = {"weights": summary_model.weights, "test_csv": summary_model.cfg.test_csv,
               "decoding": inference.describe_decoding(summary_model.cfg, summary_model.overridden,
                                                       summary_model.ckpt is not None)}
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
