"""ROUGE of a checkpoint on the validation split, or of several decoding settings side by side (--sweep).

    python evaluate.py [preset] [--ckpt=path | --init_from=gpt2|<hf dir>|scratch] [--key=value ...]
    python evaluate.py [preset] --sweep="num_beams=1,4 length_penalty=0.8,1.0,1.2"

--init_from scores GPT-2 without fine-tuning, or an untrained model (scratch, with the preset's shape) as a
baseline; without it the checkpoint (--ckpt, default out_dir/best.pt) is scored.
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
from generate import summarize_sharded
from metrics import rouge_per_example
from model import GPT, GPTConfig
from runtime import Runtime


def load_model(cfg, rt, init_from=""):
    """The model to score: a checkpoint (ckpt, else out_dir/best.pt), or with init_from (the user typed
    --init_from=...) GPT-2 weights without fine-tuning, or an untrained model ('scratch', a baseline)."""
    if init_from == "scratch":
        torch.manual_seed(cfg.seed)
        model, source = GPT(GPTConfig(block_size=cfg.block_size, n_layer=cfg.n_layer, n_head=cfg.n_head,
                                      n_embd=cfg.n_embd, bias=cfg.bias)), "init_from=scratch"
    elif init_from:
        try:
            model, source = GPT.from_pretrained(init_from), f"init_from={init_from}"
        except FileNotFoundError as e:
            raise UserError(str(e)) from None
    else:
        source = cfg.ckpt or os.path.join(cfg.out_dir, "best.pt")
        model = model_from_checkpoint(load_checkpoint(source), source)
    head, tail = data.template_tokens(cfg.prompt_template)
    if model.config.block_size - cfg.max_new_tokens <= len(head) + len(tail):
        raise UserError(f"{source} has block_size={model.config.block_size}, too small for max_new_tokens="
                        f"{cfg.max_new_tokens} plus the {len(head) + len(tail)}-token prompt template: use "
                        f"max_new_tokens < {model.config.block_size - len(head) - len(tail)}")
    model = model.to(rt.device).eval()
    if rt.compile:
        model.compile_decode()
    return model


def bootstrap_interval(values, samples=1000, seed=0):
    """95% percentile bootstrap interval of the mean."""
    values = np.asarray(values, dtype=float)
    rng = np.random.default_rng(seed)
    means = values[rng.integers(0, len(values), size=(samples, len(values)))].mean(axis=1)
    return float(np.percentile(means, 2.5)), float(np.percentile(means, 97.5))


def evaluate(cfg, rt, init_from=""):
    """ROUGE of the model on the whole validation split: a table on stdout, eval_predictions.csv and
    eval_metrics.json in out_dir. Returns the report on rank 0, None on the other ranks."""
    if rt.is_main:
        make_out_dir(cfg.out_dir)
    val = data.load_datasets(cfg, is_main=rt.is_main, barrier=rt.barrier).val
    model = load_model(cfg, rt, init_from)
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
    predictions_csv = os.path.join(cfg.out_dir, "eval_predictions.csv")
    metrics_json = os.path.join(cfg.out_dir, "eval_metrics.json")
    write_atomic(lambda f: frame.to_csv(f, index=False), predictions_csv)
    write_atomic(lambda f: json.dump(report, f, indent=2), metrics_json)
    print(format_report(report))
    print(f"wrote {predictions_csv} and {metrics_json}")
    return report


def mean_tokens(texts):
    enc = data.get_tokenizer()
    return float(np.mean([len(enc.encode_ordinary(text)) for text in texts]))


def sweep(cfg, rt, init_from=""):
    """Score every decoding setting of cfg.sweep on the validation split with one loaded model: a table on
    stdout and in out_dir/sweep.csv and sweep.md, and the best setting (ROUGE-L) as flags for predict.py.
    Every setting is checked before any work. Returns the table's rows on rank 0, None on the other ranks."""
    settings = parse_sweep(cfg.sweep)
    configs = []
    for setting in settings:
        try:
            configs.append(dataclasses.replace(cfg, **setting))
        except UserError as e:
            raise UserError(f"sweep setting {' '.join(f'{k}={v}' for k, v in setting.items())}: {e}") from None
    if rt.is_main:
        make_out_dir(cfg.out_dir)
    val = data.load_datasets(cfg, is_main=rt.is_main, barrier=rt.barrier).val
    model = load_model(cfg, rt, init_from)
    rows = []
    for i, (setting, setting_cfg) in enumerate(zip(settings, configs)):
        label = " ".join(f"{k}={v}" for k, v in setting.items())
        if rt.is_main:
            print(f"setting {i + 1}/{len(settings)}: {label}")
        start = time.perf_counter()
        predictions = summarize_sharded(model, val.dialogues, setting_cfg, rt)
        seconds = time.perf_counter() - start
        if rt.is_main:
            scores = {t: float(np.mean(v)) for t, v in rouge_per_example(predictions, val.summaries).items()}
            rows.append({"setting": label, "rouge1": scores["rouge1"], "rouge2": scores["rouge2"],
                         "rougeL": scores["rougeL"], "mean_tokens": mean_tokens(predictions),
                         "summaries_per_s": len(predictions) / seconds})
    if not rt.is_main:
        return None
    table = format_sweep(rows)
    paths = [os.path.join(cfg.out_dir, name) for name in ("sweep.csv", "sweep.md")]
    write_atomic(lambda f: pd.DataFrame(rows).to_csv(f, index=False), paths[0])
    write_atomic(lambda f: f.write(table + "\n"), paths[1])
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


def write_atomic(write, path):
    """write(text file) into a temp file next to `path`, then rename it over `path`."""
    tmp = f"{path}.tmp{os.getpid()}"
    with open(tmp, "w", encoding="utf-8", newline="") as f:
        write(f)
    os.replace(tmp, path)


def main(argv=None):
    argv = sys.argv[1:] if argv is None else argv
    try:
        cfg = load_config(argv)
        # init_from in a preset is how training started; only --init_from= on the command line replaces the checkpoint
        init_from = next((cfg.init_from for a in argv if a.startswith("--init_from=")), "")
        with Runtime(cfg) as rt:
            (sweep if cfg.sweep else evaluate)(cfg, rt, init_from)
    except UserError as e:
        print(f"error: {e}", file=sys.stderr)
        sys.exit(2)


if __name__ == "__main__":
    main()
