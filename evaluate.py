"""ROUGE of a checkpoint on the validation split, and the batched summarizer train.py and predict.py share.

    python evaluate.py [preset] [--ckpt=path | --baseline=scratch|gpt2|<hf dir>] [--key=value ...]

Scores the checkpoint (--ckpt, default out_dir/best.pt), whatever init_from the training flags say; --baseline
scores GPT-2 without fine-tuning or an untrained model (scratch, the preset's shape) instead, into
out_dir/baseline-<name>/.
"""
import json
import os
import sys
import time

import numpy as np
import pandas as pd
import torch
from rouge_score import rouge_scorer
from tqdm import tqdm

import data
from checkpoint import load_checkpoint, make_out_dir, model_from_checkpoint
from config import UserError, load_config
from files import atomic_write
from model import GPT, GPTConfig
from runtime import Runtime

ROUGE_TYPES = ("rouge1", "rouge2", "rougeL", "rougeLsum")


def summarize(model, dialogues, cfg, autocast, progress=False, rank=0, world_size=1):
    """Greedy (or as configured) summaries of `dialogues`, in their order, with the batched KV-cache generator.
    Batches are length-sorted so left padding stays small. With world_size > 1 this rank summarizes every
    world_size-th batch from `rank` on and leaves None for the rest: a batch then holds the same dialogues
    whatever the number of ranks, so sharded output is exactly the single-process output."""
    enc = data.get_tokenizer()
    max_prompt = model.config.block_size - cfg.max_new_tokens
    # A template without text around {dialogue} gives an empty dialogue no tokens; start from <|endoftext|>.
    prompts = [data.encode_prompt(d, max_prompt, cfg.prompt_template) or [data.EOT_ID] for d in dialogues]
    order = sorted(range(len(prompts)), key=lambda i: len(prompts[i]))
    batches = [order[s:s + cfg.gen_batch_size] for s in range(0, len(order), cfg.gen_batch_size)][rank::world_size]
    summaries = [None] * len(prompts)
    was_training = model.training
    model.eval()
    bar = tqdm(total=sum(map(len, batches)), desc="summarizing", unit="summary", disable=not progress,
               dynamic_ncols=True)
    start = time.perf_counter()
    for batch in batches:
        with autocast:
            new_tokens = model.generate(
                [prompts[i] for i in batch], cfg.max_new_tokens, eos_token_id=data.EOT_ID,
                temperature=cfg.temperature, top_k=cfg.top_k, top_p=cfg.top_p, num_beams=cfg.num_beams,
                length_penalty=cfg.length_penalty, repetition_penalty=cfg.repetition_penalty,
                no_repeat_ngram_size=cfg.no_repeat_ngram_size, seed=cfg.seed)
        for i, tokens in zip(batch, new_tokens):
            summaries[i] = enc.decode(tokens).strip()
        bar.update(len(batch))
        bar.set_postfix(summaries_per_s=f"{bar.n / (time.perf_counter() - start):.1f}")
    bar.close()
    model.train(was_training)
    return summaries


def summarize_sharded(model, dialogues, cfg, rt, progress=True):
    """Every rank summarizes its share of `dialogues`; all of them, in order, on every rank."""
    mine = summarize(model, dialogues, cfg, rt.autocast(), progress=progress and rt.is_main, rank=rt.rank,
                     world_size=rt.world_size)
    shards = rt.all_gather_objects(mine)
    return [next(s for s in column if s is not None) for column in zip(*shards)]


def rouge_per_example(predictions, references):
    """rouge-score F1 (Porter stemmer on) for each (prediction, reference) pair: {type: [f1, ...]}."""
    scorer = rouge_scorer.RougeScorer(list(ROUGE_TYPES), use_stemmer=True)
    scores = {t: [] for t in ROUGE_TYPES}
    for prediction, reference in zip(predictions, references):
        result = scorer.score(reference, prediction)
        for t in ROUGE_TYPES:
            scores[t].append(result[t].fmeasure)
    return scores


def rouge(predictions, references):
    """Mean ROUGE F1 over the pairs: {type: mean}."""
    return {t: sum(v) / max(1, len(v)) for t, v in rouge_per_example(predictions, references).items()}


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
    enc = data.get_tokenizer()
    report = {t: {"mean": float(np.mean(v)), "ci95": bootstrap_interval(v)} for t, v in scores.items()}
    report["n"] = len(predictions)
    report["mean_generated_tokens"] = float(np.mean([len(enc.encode_ordinary(p)) for p in predictions]))
    report["mean_reference_tokens"] = float(np.mean([len(enc.encode_ordinary(r)) for r in val.summaries]))
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
            evaluate(cfg, rt)
    except UserError as e:
        print(f"error: {e}", file=sys.stderr)
        sys.exit(2)


if __name__ == "__main__":
    main()
