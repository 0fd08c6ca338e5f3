"""A run scored on its validation split: ROUGE with bootstrap intervals and diagnostics (evaluate) or several decoding
settings side by side (sweep), either against another evaluation by a paired bootstrap (--compare)."""
import collections
import dataclasses
import json
import os
import time

import numpy as np
import pandas as pd
import torch
from rouge_score import tokenize

import data
from command_line import UserError, atomic_write
from config import ROUGE_TYPES, sweep_settings
from model import Targets
from summarizer import inference, run_folder
from summarizer.report import SWEEP_HEAD, interval_text, sweep_cells, write_report

COMPARED = ("rouge1", "rouge2", "rougeL")  # the per-dialogue scores every eval_predictions.csv holds
REPEAT_N = 3  # a summary that repeats a word 3-gram is looping, not summarizing
TIE = 1e-9  # per-dialogue score changes this small are the same score
TIMED_ROUNDS = 2  # a sweep's speeds: rounds through its settings, forward then backward (a load that drifts cancels)


@torch.no_grad()
def validation_loss(model, val_set, cfg, proc):
    """The mean loss per target token over eval_val_batches micro-batches (0 = all), the same on every rank."""
    loss_sum, targets = torch.zeros((), device=proc.device), 0
    batches = list(data.eval_batches(val_set, cfg.micro_batch_size, proc.rank, proc.world_size, cfg.eval_val_batches,
                                     cfg.seed, cfg.train_on_prompt))
    if proc.backend == "fsdp":  # each forward all-gathers weights with the other ranks: all run as many
        no_rows = torch.zeros(0, data.PAD_MULTIPLE, dtype=torch.long)
        batches += [(no_rows, no_rows - 1)] * (max(proc.all_gather_objects(len(batches))) - len(batches))
    for x, y in batches:
        found = Targets.of(y)
        with proc.autocast():
            _, loss = model(x.to(proc.device), found.to(proc.device))
        loss_sum += loss.float() * len(found.index)
        targets += len(found.index)
    totals = proc.all_reduce_sum(torch.stack([loss_sum, torch.tensor(float(targets), device=proc.device)]))
    return (totals[0] / totals[1]).item()  # callers have validation rows: no mean of none


def prepare_scoring(cfg, explicit, proc):
    other = read_evaluation(cfg.compare) if cfg.compare else None  # a wrong path stops before any work
    summary_model = inference.load_summary_model(cfg, explicit, proc, inference.describe_validation)
    val, notes = inference.validation_set(summary_model, explicit, proc)
    prompts, cut = summary_model.prompts(val.dialogues)
    if proc.is_main:
        for note in [*notes, inference.cut_line(summary_model, cut, len(val))] if cut else notes:
            print(note)
    return summary_model, val, prompts, None if other is None else matched(other, val, cfg.compare)


def evaluate(cfg, explicit, proc):
    """ROUGE of the run on its validation split, printed and written (write_evaluation); the report on rank 0."""
    summary_model, val, prompts, other = prepare_scoring(cfg, explicit, proc)
    predictions = summary_model.summarize(prompts, proc)
    if not proc.is_main:
        return None
    frame = scored_frame(val, predictions)
    report = scores_report(frame, summary_model, summary_model.cfg, summary_model.overridden)
    print(format_report(report))
    write_evaluation(cfg, summary_model, frame, report, other)
    return report


def scored_frame(val, predictions):
    """eval_predictions.csv's rows: the texts, their ROUGE F1 and token lengths."""
    scores = inference.rouge_per_example(predictions, val.summaries)
    return pd.DataFrame({"id": val.ids, "dialogue": val.dialogues, "reference": val.summaries,
                         "prediction": predictions, **scores, "generated_tokens": token_counts(predictions),
                         "reference_tokens": token_counts(val.summaries),
                         "dialogue_tokens": token_counts(val.dialogues)})


def scores_report(frame, summary_model, decoding_cfg, overridden):
    return {**{t: {"mean": float(frame[t].mean()), "ci95": bootstrap_interval(frame[t])} for t in ROUGE_TYPES},
            "weights": summary_model.weights, "step": summary_model.ckpt["iter_num"] if summary_model.ckpt else None,
            "decoding": inference.describe_decoding(decoding_cfg, overridden, summary_model.ckpt is not None),
            "split": inference.describe_validation(summary_model.cfg), "n": len(frame),
            "mean_generated_tokens": float(frame["generated_tokens"].mean()),
            "mean_reference_tokens": float(frame["reference_tokens"].mean()),
            "diagnostics": diagnostics(frame, decoding_cfg.max_new_tokens)}


def diagnostics(frame, max_new_tokens):
    """What moves a leaderboard score besides the words: length, cut at max_new_tokens, empty, looping."""
    generated = frame["generated_tokens"]
    return {"length_ratio": float(generated.mean() / max(frame["reference_tokens"].mean(), 1e-9)),
            "max_new_tokens": max_new_tokens,
            "at_max_new_tokens": int((generated >= max_new_tokens).sum()),
            "empty": int((frame["prediction"].str.strip() == "").sum()),
            "repeated_ngram": REPEAT_N,
            "with_repeated_ngram": int(sum(repeats_ngram(text) for text in frame["prediction"]))}


def repeats_ngram(text, n=REPEAT_N):
    words = tokenize.tokenize(text, None)
    ngrams = [tuple(words[i:i + n]) for i in range(len(words) - n + 1)]
    return len(set(ngrams)) < len(ngrams)


def write_evaluation(cfg, summary_model, frame, report, other=None, sweep_rows=None):
    """eval_predictions.csv, eval_metrics.json and eval_report.html (`other`: --compare's), another's moved aside."""
    out = inference.output_dir(cfg)
    made_by = {key: report.get(key) for key in ("weights", "split", "decoding", "sweep")}  # as eval_metrics.json has
    run_folder.set_aside_other_output(out, run_folder.EVAL_METRICS, (*run_folder.EVAL_FILES, run_folder.SWEEP_CSV,
                                      run_folder.SWEEP_MD), "previous-eval", made_by)
    comparison = None if other is None else Comparison(cfg.compare, other, compare(frame, other))
    if comparison is not None:
        report["compare"] = {"with": comparison.label, **comparison.stats}
    paths = [os.path.join(out, name) for name in run_folder.EVAL_FILES]
    with atomic_write(paths[0]) as f:
        frame.to_csv(f, index=False)
    with atomic_write(paths[1]) as f:
        json.dump(report, f, indent=2)
    curve = os.path.join(os.path.dirname(summary_model.path), run_folder.METRICS) if summary_model.path else ""
    write_report(paths[2], frame, report, curve=curve if os.path.isfile(curve) else "", comparison=comparison,
                 sweep_rows=sweep_rows)
    if comparison is not None:
        for t in COMPARED:  # 'rougeL +0.0123 [+0.0041, +0.0207] vs out-a: better on 301, worse on 240 of 819'
            stats = comparison.stats[t]
            print(f"{t} {stats['mean_diff']:+.4f} {interval_text(stats['ci95'], signed=True)} vs {comparison.label}: "
                  f"better on {stats['better']}, worse on {stats['worse']} of {len(frame)}")
    print(f"wrote {paths[0]}, {paths[1]} and {paths[2]}")


def bootstrap_interval(values, samples=1000, seed=0):
    """95% percentile bootstrap interval of the mean; None for fewer than two values."""
    values = np.asarray(values, dtype=float)
    if len(values) < 2:
        return None
    means = values[np.random.default_rng(seed).integers(0, len(values), size=(samples, len(values)))].mean(axis=1)
    return float(np.percentile(means, 2.5)), float(np.percentile(means, 97.5))


def paired_bootstrap(ours, theirs, samples=1000, seed=0):
    """(mean of ours - theirs, its 95% interval), resampling dialogues with both scores: what they share cancels out."""
    differences = np.asarray(ours, dtype=float) - np.asarray(theirs, dtype=float)
    return float(differences.mean()), bootstrap_interval(differences, samples, seed)


def token_counts(texts):
    return [len(tokens) for tokens in data.get_tokenizer().encode_ordinary_batch(list(texts))]


Comparison = collections.namedtuple("Comparison", "label other stats")  # --compare's label, its frame, compare()


def read_evaluation(where):
    path = os.path.join(where, run_folder.EVAL_PREDICTIONS) if os.path.isdir(where) else where
    if not os.path.isfile(path):
        raise UserError(f"--compare={where}: {path} does not exist; give an out_dir that evaluate.py wrote into, "
                        f"or its {run_folder.EVAL_PREDICTIONS}")
    frame = pd.read_csv(path, dtype=str, keep_default_na=False)
    if missing := [c for c in ("id", "dialogue", "reference", "prediction", *COMPARED) if c not in frame]:
        raise UserError(f"--compare={where}: {path} has no {', '.join(missing)} column(s); it is not an "
                        f"{run_folder.EVAL_PREDICTIONS} that evaluate.py wrote")
    try:
        return frame.astype(dict.fromkeys(COMPARED, float))
    except ValueError as e:
        raise UserError(f"--compare={where}: {path} has a score that is not a number ({e})") from None


def matched(other, val, where):
    """`other`'s rows in `val`'s order, or a one-line UserError naming how their dialogues differ."""
    ours, theirs = pd.Index(val.ids), pd.Index(other["id"])
    refused = f"--compare={where} scored other dialogues than this evaluation"
    if theirs.has_duplicates:
        raise UserError(f"{refused}: id {theirs[theirs.duplicated()][0]} is there twice")
    missing, extra = ours.difference(theirs), theirs.difference(ours)
    if len(missing) or len(extra):
        sides = [f"{len(missing)} of the {len(ours)} ids here are not there (e.g. {missing[0]})" if len(missing)
                 else "", f"{len(extra)} of its {len(theirs)} are not here (e.g. {extra[0]})" if len(extra) else ""]
        raise UserError(f"{refused}: {', and '.join(filter(None, sides))}")
    other = other.set_index("id").loc[list(val.ids)].reset_index()
    for column, texts in (("dialogue", val.dialogues), ("reference", val.summaries)):
        # compared by words: a CSV round trip may change line endings
        if differ := [i for i, (a, b) in enumerate(zip(other[column], texts, strict=True)) if a.split() != b.split()]:
            raise UserError(f"{refused}: {len(differ)} of the {len(ours)} ids have another {column} there "
                            f"(e.g. id {val.ids[differ[0]]})")
    return other


def compare(frame, other):
    """Per ROUGE: the paired mean difference and interval, and on how many dialogues frame is better, worse, same."""
    stats = {}
    for t in COMPARED:
        differences = frame[t].to_numpy(dtype=float) - other[t].to_numpy(dtype=float)
        stats[t] = {"mean_diff": float(differences.mean()), "ci95": bootstrap_interval(differences),
                    "better": int((differences > TIE).sum()), "worse": int((differences < -TIE).sum()),
                    "same": int((abs(differences) <= TIE).sum())}
    return stats


def interleaved_seconds(model, prompts, configs, proc):
    """Seconds each config takes on `prompts`, over TIMED_ROUNDS rounds in alternating order after a warm one: a
    changing load falls on every config alike (timed in turn, the speeds followed the settings' order)."""
    seconds = [0.0] * len(configs)
    for round_ in range(1 + TIMED_ROUNDS):
        for i in (range(len(configs)) if round_ % 2 else reversed(range(len(configs)))):
            start = time.perf_counter()
            inference.summarize_on_ranks(model, prompts, configs[i], proc, progress=False)
            seconds[i] += (time.perf_counter() - start) / TIMED_ROUNDS if round_ else 0.0
    return seconds


def sweep(cfg, explicit, proc):
    """Every setting of cfg.sweep scored with one model: a table, and the fastest setting within noise of the best."""
    settings = sweep_settings(cfg.sweep)
    if cfg.baseline in inference.EXTRACTIVE:
        raise UserError(f"baseline={cfg.baseline} is extractive: it has no decoding settings to sweep")
    setting_configs(cfg, settings)  # before any work, as far as the command line tells
    summary_model, val, prompts, other = prepare_scoring(cfg, explicit, proc)
    configs, rows, frames = setting_configs(summary_model.cfg, settings), [], []
    timed = prompts[:cfg.gen_batch_size * proc.world_size]
    speeds = [len(timed) / seconds for seconds in interleaved_seconds(summary_model.model, timed, configs, proc)]
    for i, (setting, setting_cfg) in enumerate(zip(settings, configs, strict=True)):
        label = " ".join(f"{k}={v}" for k, v in setting.items())
        if proc.is_main:
            print(f"setting {i + 1}/{len(settings)}: {label}")
        predictions = summary_model.summarize(prompts, proc, setting_cfg)
        if proc.is_main:
            frames.append(scored_frame(val, predictions))
            rows.append({"setting": label, **{t: float(frames[-1][t].mean()) for t in COMPARED},
                         "mean_tokens": float(frames[-1]["generated_tokens"].mean()), "summaries_per_s": speeds[i]})
    if not proc.is_main:
        return None
    best, pick = against_the_best(rows, frames)
    table = format_sweep(rows)
    print(table)
    report = scores_report(frames[pick], summary_model, configs[pick], [*summary_model.overridden, *settings[pick]])
    report["setting"], report["sweep"] = rows[pick]["setting"], cfg.sweep
    write_evaluation(cfg, summary_model, frames[pick], report, other, sweep_rows=rows)  # first: moves earlier aside
    paths = [os.path.join(inference.output_dir(cfg), name) for name in (run_folder.SWEEP_CSV, run_folder.SWEEP_MD)]
    with atomic_write(paths[0]) as f:
        pd.DataFrame(rows).to_csv(f, index=False)
    with atomic_write(paths[1]) as f:
        f.write(table + "\n")
    print(f"wrote {paths[0]} and {paths[1]}")
    print(f"best ROUGE-L {rows[best]['rougeL']:.4f}: {rows[best]['setting']}; the fastest setting a paired test "
          f"cannot tell from it: {rows[pick]['setting']} (ROUGE-L {rows[pick]['rougeL_vs_best']:+.4f} "
          f"{interval_text((rows[pick]['rougeL_vs_best_low'], rows[pick]['rougeL_vs_best_high']), signed=True)}, "
          f"{rows[pick]['summaries_per_s']:.1f} summaries/s); pass to predict.py: "
          + " ".join(f"--{k}={v}" for k, v in settings[pick].items()))
    return rows


def against_the_best(rows, frames):
    """Each row's paired ROUGE-L difference from the best's; returns (the best, the fastest within noise of it)."""
    best = max(range(len(rows)), key=lambda i: rows[i]["rougeL"])
    for row, frame in zip(rows, frames, strict=True):
        difference, ci95 = paired_bootstrap(frame["rougeL"], frames[best]["rougeL"])
        low, high = ci95 or (None, None)  # one dialogue gives no interval: no setting is told from the best's
        row.update(rougeL_vs_best=difference, rougeL_vs_best_low=low, rougeL_vs_best_high=high,
                   within_best_ci95=ci95 is None or bool(low <= 0 <= high))
    fastest = max((i for i, row in enumerate(rows) if row["within_best_ci95"]),
                  key=lambda i: rows[i]["summaries_per_s"])
    return best, fastest


def setting_configs(base, settings):
    configs = []
    for setting in settings:
        try:
            configs.append(dataclasses.replace(base, **setting))
        except UserError as e:
            raise UserError(f"sweep setting {' '.join(f'{k}={v}' for k, v in setting.items())}: {e}") from None
    return configs


def format_sweep(rows):
    lines = [f"ROUGE F1 of {len(rows)} decoding settings on the validation split", SWEEP_HEAD,
             ["---"] * len(SWEEP_HEAD), *map(sweep_cells, rows)]
    return "\n".join(cells if isinstance(cells, str) else f"| {' | '.join(cells)} |" for cells in lines)


def format_report(report):
    lines = [f"ROUGE F1 on {report['n']} validation dialogues (rouge-score, stemmer on)",
             f"{'metric':<10} {'mean':>7}   95% bootstrap interval"]
    lines += [f"{t:<10} {report[t]['mean']:>7.4f}   {interval_text(report[t]['ci95'])}" for t in ROUGE_TYPES]
    found = report["diagnostics"]
    lines.append(f"mean length: generated {report['mean_generated_tokens']:.1f} tokens, reference "
                 f"{report['mean_reference_tokens']:.1f} tokens (ratio {found['length_ratio']:.2f}); "
                 f"{found['at_max_new_tokens']} at max_new_tokens={found['max_new_tokens']}, {found['empty']} empty, "
                 f"{found['with_repeated_ngram']} repeating a word {found['repeated_ngram']}-gram")
    return "\n".join(lines)
