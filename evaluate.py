"""ROUGE of a checkpoint on the validation split, or of several decoding settings side by side (--sweep).

    python evaluate.py [preset] [--ckpt=path | --baseline=scratch|gpt2|<hf dir>] [--key=value ...]
    python evaluate.py [preset] --sweep="num_beams=1,4 length_penalty=0.8,1.0,1.2"

Scores the checkpoint (--ckpt, default out_dir/best.pt), whatever init_from the training flags say; --baseline
scores GPT-2 without fine-tuning or an untrained model (scratch, the preset's shape) instead, into
out_dir/baseline-<name>/.
"""
import dataclasses
import json
import os
import sys
import time

import numpy as np
import pandas as pd
import torch

import data
from checkpoint import load_checkpoint, make_out_dir, model_from_checkpoint
from config import ROUGE_TYPES, UserError, load_config, parse_sweep
from files import atomic_write
from generate import summarize_sharded
from metrics import rouge, rouge_per_example
from model import GPT, GPTConfig
from runtime import Runtime


def load_model(cfg, rt):
    """The model to score, and first a line on rank 0 saying which weights it is: the checkpoint (ckpt, else
    out_dir/best.pt) with its iter and best score, or the baseline the config names (GPT-2 without fine-tuning,
    or an untrained model of the preset's shape)."""
    if cfg.baseline == "scratch":
        torch.manual_seed(cfg.seed)
        model = GPT(GPTConfig(block_size=cfg.block_size, n_layer=cfg.n_layer, n_head=cfg.n_head,
                              n_embd=cfg.n_embd, bias=cfg.bias))
        source = described = f"baseline=scratch (untrained, {cfg.n_layer} layers x {cfg.n_embd})"
    elif cfg.baseline:
        try:
            model = GPT.from_pretrained(cfg.baseline)
        except FileNotFoundError as e:
            raise UserError(f"baseline={e}") from None
        source = described = f"baseline={cfg.baseline} (not fine-tuned)"
    else:
        source = cfg.ckpt or os.path.join(cfg.out_dir, "best.pt")
        ckpt = load_checkpoint(source)
        model = model_from_checkpoint(ckpt, source)
        described = f"{source} ({describe_checkpoint(ckpt)})"
    if rt.is_main:
        print(f"weights: {described}")
    head, tail = data.template_tokens(cfg.prompt_template)
    if model.config.block_size - cfg.max_new_tokens <= len(head) + len(tail):
        raise UserError(f"{source} has block_size={model.config.block_size}, too small for max_new_tokens="
                        f"{cfg.max_new_tokens} plus the {len(head) + len(tail)}-token prompt template: use "
                        f"max_new_tokens < {model.config.block_size - len(head) - len(tail)}")
    model = model.to(rt.device).eval()
    if rt.compile:
        model.compile_decode()
    return model


def describe_checkpoint(ckpt):
    """'iter 300, best rougeL 0.4123, val_loss 2.1034' from what train.py saved with the weights."""
    metrics = ckpt.get("metrics", {})
    best_metric = ckpt.get("config", {}).get("best_metric", "val_loss")
    scores = [f"best {best_metric} {metrics[best_metric]:.4f}" if best_metric in metrics else ""]
    scores += [f"{k} {metrics[k]:.4f}" for k in ("val_loss", "rougeL") if k in metrics and k != best_metric]
    return ", ".join([f"iter {ckpt.get('iter_num', '?')}", *filter(None, scores)])


def output_dir(cfg):
    """Where evaluate.py/predict.py write: out_dir for the checkpoint, out_dir/baseline-<name> for a baseline, so
    a baseline's outputs never replace the checkpoint's."""
    if not cfg.baseline:
        return cfg.out_dir
    return os.path.join(cfg.out_dir, f"baseline-{os.path.basename(os.path.normpath(cfg.baseline))}")


def bootstrap_interval(values, samples=1000, seed=0):
    """95% percentile bootstrap interval of the mean."""
    values = np.asarray(values, dtype=float)
    rng = np.random.default_rng(seed)
    means = values[rng.integers(0, len(values), size=(samples, len(values)))].mean(axis=1)
    return float(np.percentile(means, 2.5)), float(np.percentile(means, 97.5))


def evaluate(cfg, rt):
    """ROUGE of the model on the whole validation split: a table on stdout, eval_predictions.csv and
    eval_metrics.json in output_dir. Returns the report on rank 0, None on the other ranks."""
    out = output_dir(cfg)
    if rt.is_main:
        make_out_dir(out)
    val = data.load_datasets(cfg, is_main=rt.is_main, barrier=rt.barrier).val
    model = load_model(cfg, rt)
    predictions = summarize_sharded(model, val.dialogues, cfg, rt)
    if not rt.is_main:
        return None
    scores = rouge_per_example(predictions, val.summaries)
    report = {t: {"mean": float(np.mean(v)), "ci95": bootstrap_interval(v)} for t, v in scores.items()}
    report["n"] = len(predictions)
    report["mean_generated_tokens"] = mean_tokens(predictions)
    report["mean_reference_tokens"] = mean_tokens(val.summaries)
    frame = pd.DataFrame({"id": val.ids, "dialogue": val.dialogues, "reference": val.summaries,
                          "prediction": predictions, **{t: scores[t] for t in ("rouge1", "rouge2", "rougeL")}})
    predictions_csv = os.path.join(out, "eval_predictions.csv")
    metrics_json = os.path.join(out, "eval_metrics.json")
    with atomic_write(predictions_csv) as f:
        frame.to_csv(f, index=False)
    with atomic_write(metrics_json) as f:
        json.dump(report, f, indent=2)
    print(format_report(report))
    print(f"wrote {predictions_csv} and {metrics_json}")
    return report


def mean_tokens(texts):
    enc = data.get_tokenizer()
    return float(np.mean([len(enc.encode_ordinary(text)) for text in texts]))


def sweep(cfg, rt):
    """Score every decoding setting of cfg.sweep on the validation split with one loaded model: a table on
    stdout and in sweep.csv and sweep.md in output_dir, and the best setting (ROUGE-L) as flags for predict.py.
    Every setting is checked before any work. Returns the table's rows on rank 0, None on the other ranks."""
    settings = parse_sweep(cfg.sweep)
    configs = []
    for setting in settings:
        try:
            configs.append(dataclasses.replace(cfg, **setting))
        except UserError as e:
            raise UserError(f"sweep setting {' '.join(f'{k}={v}' for k, v in setting.items())}: {e}") from None
    out = output_dir(cfg)
    if rt.is_main:
        make_out_dir(out)
    val = data.load_datasets(cfg, is_main=rt.is_main, barrier=rt.barrier).val
    model = load_model(cfg, rt)
    rows = []
    for i, (setting, setting_cfg) in enumerate(zip(settings, configs)):
        label = " ".join(f"{k}={v}" for k, v in setting.items())
        if rt.is_main:
            print(f"setting {i + 1}/{len(settings)}: {label}")
        start = time.perf_counter()
        predictions = summarize_sharded(model, val.dialogues, setting_cfg, rt)
        seconds = time.perf_counter() - start
        if rt.is_main:
            scores = rouge(predictions, val.summaries)
            rows.append({"setting": label, "rouge1": scores["rouge1"], "rouge2": scores["rouge2"],
                         "rougeL": scores["rougeL"], "mean_tokens": mean_tokens(predictions),
                         "summaries_per_s": len(predictions) / seconds})
    if not rt.is_main:
        return None
    table = format_sweep(rows)
    paths = [os.path.join(out, name) for name in ("sweep.csv", "sweep.md")]
    with atomic_write(paths[0]) as f:
        pd.DataFrame(rows).to_csv(f, index=False)
    with atomic_write(paths[1]) as f:
        f.write(table + "\n")
    best = max(rows, key=lambda row: row["rougeL"])
    flags = " ".join(f"--{k}={v}" for k, v in settings[rows.index(best)].items())
    print(table)
    print(f"wrote {paths[0]} and {paths[1]}")
    print(f"best ROUGE-L {best['rougeL']:.4f}: {best['setting']}; pass to predict.py: {flags}")
    return rows


def format_sweep(rows):
    lines = [f"ROUGE F1 of {len(rows)} decoding settings on the validation split",
             "| setting | ROUGE-1 | ROUGE-2 | ROUGE-L | mean length (tokens) | summaries/s |",
             "| --- | --- | --- | --- | --- | --- |"]
    lines += [f"| {r['setting']} | {r['rouge1']:.4f} | {r['rouge2']:.4f} | {r['rougeL']:.4f} | "
              f"{r['mean_tokens']:.1f} | {r['summaries_per_s']:.1f} |" for r in rows]
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


def main(argv=None):
    try:
        cfg = load_config(sys.argv[1:] if argv is None else argv)
        with Runtime(cfg) as rt:
            (sweep if cfg.sweep else evaluate)(cfg, rt)
    except UserError as e:
        print(f"error: {e}", file=sys.stderr)
        sys.exit(2)


if __name__ == "__main__":
    main()
