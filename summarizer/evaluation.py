"""Scoring a run on its validation split: ROUGE with bootstrap intervals (evaluate), or several decoding settings
side by side (sweep). evaluate.py is their command line; train.py runs evaluate after training on request."""
import dataclasses
import json
import os
import time

import numpy as np
import pandas as pd
import torch

import data
from config import ROUGE_TYPES, parse_sweep
from model import Targets
from summarizer import inference
from summarizer.checkpoint import make_out_dir, move_aside
from summarizer.errors import UserError
from summarizer.files import atomic_write
from summarizer.metrics import rouge_per_example


@torch.no_grad()
def validation_loss(model, val_set, cfg, rt):
    """The mean loss per target token over the validation split (eval_val_batches micro-batches of it; 0 = all),
    each rank taking its share; every rank returns the same number."""
    loss_sum, targets = torch.zeros((), device=rt.device), 0
    batches = list(data.eval_batches(val_set, cfg.micro_batch_size, rt.rank, rt.world_size, cfg.eval_val_batches,
                                     cfg.seed, cfg.train_on_prompt))
    if rt.backend == "fsdp":  # each forward all-gathers weights with the other ranks: all run as many
        no_rows = torch.zeros(0, data.PAD_MULTIPLE, dtype=torch.long)
        batches += [(no_rows, no_rows - 1)] * (max(rt.all_gather_objects(len(batches))) - len(batches))
    for x, y in batches:
        found = Targets.of(y)
        with rt.autocast():
            _, loss = model(x.to(rt.device), found.to(rt.device))
        loss_sum += loss.float() * len(found.index)
        targets += len(found.index)
    totals = rt.all_reduce_sum(torch.stack([loss_sum, torch.tensor(float(targets), device=rt.device)]))
    return (totals[0] / totals[1].clamp(min=1)).item()


def validation_run(cfg, explicit, rt):
    """(run, validation examples) for scoring, after the first line and the notes on what was checked and cut."""
    out = inference.output_dir(cfg)
    if rt.is_main:
        make_out_dir(out)
    run = inference.load_run(cfg, explicit, rt, inference.describe_validation)
    val, notes = inference.validation_set(run, cfg, explicit, rt)
    prompts, cut = run.prompts(val.dialogues)
    if rt.is_main:
        for note in [*notes, inference.cut_line(run, cut, len(val)) if cut else ""]:
            if note:
                print(note)
    return run, val, prompts


def evaluate(cfg, explicit, rt):
    """ROUGE of the run on its whole validation split: a table on stdout, eval_predictions.csv and
    eval_metrics.json in inference.output_dir. Returns the report on rank 0, None on the other ranks."""
    run, val, prompts = validation_run(cfg, explicit, rt)
    predictions = inference.summarize_sharded(run.model, prompts, run.cfg, rt, step=run.step)
    if not rt.is_main:
        return None
    scores = rouge_per_example(predictions, val.summaries)
    report = {t: {"mean": float(np.mean(v)), "ci95": bootstrap_interval(v)} for t, v in scores.items()}
    report["weights"] = run.weights
    report["n"] = len(predictions)
    report["mean_generated_tokens"] = mean_tokens(predictions)
    report["mean_reference_tokens"] = mean_tokens(val.summaries)
    frame = pd.DataFrame({"id": val.ids, "dialogue": val.dialogues, "reference": val.summaries,
                          "prediction": predictions, **{t: scores[t] for t in ("rouge1", "rouge2", "rougeL")}})
    out = inference.output_dir(cfg)
    moved = set_aside_other_weights(out, run.weights)
    if moved:
        print(moved)
    predictions_csv, metrics_json = os.path.join(out, "eval_predictions.csv"), os.path.join(out, "eval_metrics.json")
    with atomic_write(predictions_csv) as f:
        frame.to_csv(f, index=False)
    with atomic_write(metrics_json) as f:
        json.dump(report, f, indent=2)
    print(format_report(report))
    print(f"wrote {predictions_csv} and {metrics_json}")
    return report


def set_aside_other_weights(out, weights):
    """Move out's eval_predictions.csv and eval_metrics.json into out/previous-eval-<time>/ when other weights
    made them, so scoring another checkpoint into this folder replaces nothing. A line saying so, or None."""
    path = os.path.join(out, "eval_metrics.json")
    try:
        with open(path, encoding="utf-8") as f:
            made_by = json.load(f).get("weights")
    except (OSError, ValueError):
        made_by = None
    if made_by == weights or not os.path.exists(path):
        return None
    found, folder = move_aside(out, ["eval_predictions.csv", "eval_metrics.json"], "previous-eval")
    return (f"{out} held the evaluation of other weights ({made_by or 'unnamed'}): moved its {', '.join(found)} "
            f"to {folder}")


def bootstrap_interval(values, samples=1000, seed=0):
    """95% percentile bootstrap interval of the mean."""
    values = np.asarray(values, dtype=float)
    rng = np.random.default_rng(seed)
    means = values[rng.integers(0, len(values), size=(samples, len(values)))].mean(axis=1)
    return float(np.percentile(means, 2.5)), float(np.percentile(means, 97.5))


def mean_tokens(texts):
    enc = data.get_tokenizer()
    return float(np.mean([len(enc.encode_ordinary(text)) for text in texts]))


def sweep(cfg, explicit, rt):
    """Score every decoding setting of cfg.sweep (each on top of the run's decoding) on the validation split with
    one loaded model: a table on stdout and in sweep.csv and sweep.md in inference.output_dir, and the best
    setting (ROUGE-L) as flags for predict.py. Every setting is checked before any work. Returns the table's rows
    on rank 0, None on the other ranks."""
    settings = parse_sweep(cfg.sweep)
    setting_configs(cfg, settings)  # before any work, as far as the command line tells
    run, val, prompts = validation_run(cfg, explicit, rt)
    rows, per_example = [], []
    for i, (setting, setting_cfg) in enumerate(zip(settings, setting_configs(run.cfg, settings), strict=True)):
        label = " ".join(f"{k}={v}" for k, v in setting.items())
        if rt.is_main:
            print(f"setting {i + 1}/{len(settings)}: {label}")
        start = time.perf_counter()
        predictions = inference.summarize_sharded(run.model, prompts, setting_cfg, rt, step=run.step)
        seconds = time.perf_counter() - start
        if rt.is_main:
            scores = rouge_per_example(predictions, val.summaries)
            per_example.append(scores["rougeL"])
            rows.append({"setting": label, **{t: float(np.mean(scores[t])) for t in ("rouge1", "rouge2", "rougeL")},
                         "mean_tokens": mean_tokens(predictions), "summaries_per_s": len(predictions) / seconds})
    if not rt.is_main:
        return None
    best = max(range(len(rows)), key=lambda i: rows[i]["rougeL"])
    low, high = bootstrap_interval(per_example[best])
    for row in rows:  # differences inside the best one's 95% interval are noise on this many dialogues
        row["within_best_ci95"] = bool(low <= row["rougeL"] <= high)
    fastest = max((row for row in rows if row["within_best_ci95"]), key=lambda row: row["summaries_per_s"])
    table = format_sweep(rows)
    out = inference.output_dir(cfg)
    paths = [os.path.join(out, name) for name in ("sweep.csv", "sweep.md")]
    with atomic_write(paths[0]) as f:
        pd.DataFrame(rows).to_csv(f, index=False)
    with atomic_write(paths[1]) as f:
        f.write(table + "\n")
    flags = " ".join(f"--{k}={v}" for k, v in settings[rows.index(fastest)].items())
    print(table)
    print(f"wrote {paths[0]} and {paths[1]}")
    print(f"best ROUGE-L {rows[best]['rougeL']:.4f}: {rows[best]['setting']} (95% interval [{low:.4f}, {high:.4f}]); "
          f"the fastest setting within it: {fastest['setting']} ({fastest['summaries_per_s']:.1f} summaries/s); "
          f"pass to predict.py: {flags}")
    return rows


def setting_configs(base, settings):
    """`base` with each sweep setting applied, or a UserError naming the first setting that cannot work."""
    configs = []
    for setting in settings:
        try:
            configs.append(dataclasses.replace(base, **setting))
        except UserError as e:
            raise UserError(f"sweep setting {' '.join(f'{k}={v}' for k, v in setting.items())}: {e}") from None
    return configs


def format_sweep(rows):
    lines = [f"ROUGE F1 of {len(rows)} decoding settings on the validation split",
             "| setting | ROUGE-1 | ROUGE-2 | ROUGE-L | mean length (tokens) | summaries/s | within the best's 95% |",
             "| --- | --- | --- | --- | --- | --- | --- |"]
    lines += [f"| {r['setting']} | {r['rouge1']:.4f} | {r['rouge2']:.4f} | {r['rougeL']:.4f} | "
              f"{r['mean_tokens']:.1f} | {r['summaries_per_s']:.1f} | {'yes' if r['within_best_ci95'] else ''} |"
              for r in rows]
    return "\n".join(lines)


def format_report(report):
    lines = [f"ROUGE F1 on {report['n']} validation dialogues (rouge-score, stemmer on)",
             f"{'metric':<10} {'mean':>7}   95% bootstrap interval"]
    for t in ROUGE_TYPES:
        low, high = report[t]["ci95"]
        lines.append(f"{t:<10} {report[t]['mean']:>7.4f}   [{low:.4f}, {high:.4f}]")
    lines.append(f"mean length: generated {report['mean_generated_tokens']:.1f} tokens, "
                 f"reference {report['mean_reference_tokens']:.1f} tokens")
    return "\n".join(lines)
