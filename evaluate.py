"""ROUGE of a checkpoint on the validation split, and the batched summarizer train.py and predict.py share.

    python evaluate.py [preset] [--ckpt=path | --init_from=gpt2|<hf dir>] [--key=value ...]
"""
import json
import os
import sys
import time

import numpy as np
import pandas as pd
from rouge_score import rouge_scorer
from tqdm import tqdm

import data
from checkpoint import load_checkpoint, model_from_checkpoint
from config import UserError, load_config
from model import GPT
from runtime import Runtime

ROUGE_TYPES = ("rouge1", "rouge2", "rougeL", "rougeLsum")


def summarize(model, dialogues, cfg, autocast, progress=False):
    """Greedy (or as configured) summaries of `dialogues`, in their order, with the batched KV-cache generator.
    Batches are length-sorted so left padding stays small."""
    enc = data.get_tokenizer()
    max_prompt = model.config.block_size - cfg.max_new_tokens
    prompts = [data.encode_prompt(d, max_prompt, cfg.prompt_template) for d in dialogues]
    order = sorted(range(len(prompts)), key=lambda i: len(prompts[i]))
    summaries = [""] * len(prompts)
    was_training = model.training
    model.eval()
    bar = tqdm(total=len(prompts), desc="summarizing", unit="summary", disable=not progress, dynamic_ncols=True)
    start = time.perf_counter()
    for s in range(0, len(order), cfg.gen_batch_size):
        batch = order[s:s + cfg.gen_batch_size]
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


def load_model(cfg, device, pretrained=False):
    """The model to score: a checkpoint (ckpt, else out_dir/best.pt) or, with pretrained=True (the user typed
    --init_from=gpt2|<hf dir>), GPT-2 weights without fine-tuning."""
    if pretrained:
        try:
            model = GPT.from_pretrained(cfg.init_from)
        except FileNotFoundError as e:
            raise UserError(str(e)) from None
    else:
        path = cfg.ckpt or os.path.join(cfg.out_dir, "best.pt")
        model = model_from_checkpoint(load_checkpoint(path), path)
    if cfg.max_new_tokens >= model.config.block_size:
        raise UserError(f"max_new_tokens={cfg.max_new_tokens} leaves no room for the dialogue in the model's "
                        f"block_size {model.config.block_size}")
    return model.to(device).eval()


def bootstrap_interval(values, samples=1000, seed=0):
    """95% percentile bootstrap interval of the mean."""
    values = np.asarray(values, dtype=float)
    rng = np.random.default_rng(seed)
    means = values[rng.integers(0, len(values), size=(samples, len(values)))].mean(axis=1)
    return float(np.percentile(means, 2.5)), float(np.percentile(means, 97.5))


def evaluate(cfg, rt, pretrained=False):
    val = data.load_datasets(cfg, is_main=rt.is_main, barrier=rt.barrier).val
    model = load_model(cfg, rt.device, pretrained)
    mine = list(range(len(val.ids)))[rt.rank::rt.world_size]
    predictions = summarize(model, [val.dialogues[i] for i in mine], cfg, rt.autocast(), progress=rt.is_main)
    gathered = dict(pair for shard in rt.all_gather_objects(list(zip(mine, predictions))) for pair in shard)
    if not rt.is_main:
        return None
    predictions = [gathered[i] for i in range(len(val.ids))]
    scores = rouge_per_example(predictions, val.summaries)
    enc = data.get_tokenizer()
    report = {t: {"mean": float(np.mean(v)), "ci95": bootstrap_interval(v)} for t, v in scores.items()}
    report["n"] = len(predictions)
    report["mean_generated_tokens"] = float(np.mean([len(enc.encode_ordinary(p)) for p in predictions]))
    report["mean_reference_tokens"] = float(np.mean([len(enc.encode_ordinary(r)) for r in val.summaries]))
    frame = pd.DataFrame({"id": val.ids, "dialogue": val.dialogues, "reference": val.summaries,
                          "prediction": predictions, **{t: scores[t] for t in ("rouge1", "rouge2", "rougeL")}})
    write_atomic(lambda p: frame.to_csv(p, index=False), os.path.join(cfg.out_dir, "eval_predictions.csv"))
    write_atomic(lambda p: open(p, "w").write(json.dumps(report, indent=2)),
                 os.path.join(cfg.out_dir, "eval_metrics.json"))
    print(format_report(report))
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


def write_atomic(write, path):
    tmp = f"{path}.tmp{os.getpid()}"
    write(tmp)
    os.replace(tmp, path)


def main(argv=None):
    argv = sys.argv[1:] if argv is None else argv
    try:
        cfg = load_config(argv)
        with Runtime(cfg) as rt:
            evaluate(cfg, rt, pretrained=any(a.startswith("--init_from=") for a in argv))
    except UserError as e:
        print(f"error: {e}", file=sys.stderr)
        sys.exit(2)


if __name__ == "__main__":
    main()
