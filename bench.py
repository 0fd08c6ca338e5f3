"""Side-by-side benchmarks: ours vs transformers vs the naive approach, same weights, same process.

python bench.py [--section=generate|all] [--model=small|gpt2] [--json]
"""
import argparse
import json
import os
import statistics
import tempfile
import threading
import time

import numpy as np
import torch

from data import EOT_ID, get_tokenizer
from model import GPT

SAMSUM_CSV = os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "shared", "data", "samsum-validation.csv")
TEMPLATE = "\n\n### DIALOGUE:\n{dialogue}\n\n### SUMMARY:\n"
MODELS = {"small": dict(n_layer=6, n_head=6, n_embd=384), "gpt2": dict(n_layer=12, n_head=12, n_embd=768)}


def samsum_prompts(n, seed=0):
    """Prompt token lists with SAMSum's lengths: the real validation dialogues when ../shared has them, else
    random tokens with lengths from a log-normal fitted to SAMSum prompts (median ~130, long right tail)."""
    rng = np.random.default_rng(seed)
    if os.path.exists(SAMSUM_CSV):
        import pandas as pd
        dialogues = pd.read_csv(SAMSUM_CSV)["dialogue"].dropna().tolist()
        picked = rng.choice(len(dialogues), size=min(n, len(dialogues)), replace=False)
        enc = get_tokenizer()
        return [enc.encode_ordinary(TEMPLATE.format(dialogue=dialogues[i])) for i in picked], "samsum"
    lengths = np.clip(rng.lognormal(mean=np.log(130), sigma=0.6, size=n), 16, 760).astype(int)
    return [rng.integers(0, EOT_ID, size=k).tolist() for k in lengths], "synthetic"


def make_models(shape, device):
    """A random-weight GPT2LMHeadModel and our GPT loaded from it through the real from_pretrained path.
    initializer_range 0.1 keeps logits apart so greedy comparisons are not decided by float ties."""
    from transformers import GPT2Config, GPT2LMHeadModel
    torch.manual_seed(0)
    config = GPT2Config(n_positions=1024, initializer_range=0.1, **MODELS[shape])
    hf = GPT2LMHeadModel(config).eval()
    with tempfile.TemporaryDirectory() as tmp:
        hf.save_pretrained(tmp)
        ours = GPT.from_pretrained(tmp).eval()
    return hf.to(device), ours.to(device)


class PeakMemory:
    """Peak memory above the start of the block: CUDA max_memory_allocated, or sampled RSS on CPU."""

    def __init__(self, device):
        self.device, self.peak_mb = device, 0.0

    @staticmethod
    def rss_mb():
        with open("/proc/self/statm") as f:
            return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE") / 2**20

    def _poll(self):
        while not self._done.is_set():
            self.peak_mb = max(self.peak_mb, self.rss_mb() - self._base)
            time.sleep(0.002)

    def __enter__(self):
        if self.device.type == "cuda":
            torch.cuda.synchronize()
            torch.cuda.reset_peak_memory_stats()
            self._base = torch.cuda.memory_allocated()
        else:
            self._base, self._done = self.rss_mb(), threading.Event()
            self._thread = threading.Thread(target=self._poll, daemon=True)
            self._thread.start()
        return self

    def __exit__(self, *exc):
        if self.device.type == "cuda":
            torch.cuda.synchronize()
            self.peak_mb = (torch.cuda.max_memory_allocated() - self._base) / 2**20
        else:
            self._done.set()
            self._thread.join()


def timed(fn, device):
    if device.type == "cuda":
        torch.cuda.synchronize()
    t0 = time.perf_counter()
    out = fn()
    if device.type == "cuda":
        torch.cuda.synchronize()
    return out, time.perf_counter() - t0


def interleaved(candidates, device, repeats):
    """Run each candidate once to warm up, then `repeats` rounds in turn; median seconds and peak memory."""
    outputs, times, memory = {}, {name: [] for name in candidates}, {}
    for name, fn in candidates.items():
        with PeakMemory(device) as mem:
            outputs[name] = fn()
        memory[name] = mem.peak_mb
    for _ in range(repeats):
        for name, fn in candidates.items():
            times[name].append(timed(fn, device)[1])
    return outputs, {name: statistics.median(t) for name, t in times.items()}, memory


def bench_generate(args, device):
    hf, ours = make_models(args.model, device)
    prompts, source = samsum_prompts(args.gen_prompts)
    order = sorted(range(len(prompts)), key=lambda i: len(prompts[i]))
    batches = [[prompts[i] for i in order[s:s + args.gen_batch]] for s in range(0, len(order), args.gen_batch)]
    max_new = args.max_new_tokens
    rows = []
    # The naive loop runs only where every row generates max_new tokens, so its small subset is representative.
    for scenario, eos in [("no_eos", EOT_ID), ("eos", summary_end_token(ours, prompts, max_new))]:
        rows += [dict(row, figure=f"{scenario}:{row['figure']}") for row in
                 compare_generate(hf, ours, batches, max_new, eos, args, device, with_naive=scenario == "no_eos")]
    rows.append(dict(section="generate", figure="setup", value=f"{args.model} model, {len(prompts)} {source} "
                     f"prompts, batch {args.gen_batch}, max_new_tokens {max_new}, naive on {args.naive_prompts}, "
                     f"median of {args.repeats}, {device}"))
    return rows


def summary_end_token(model, prompts, max_new):
    """A random-weight model never says <|endoftext|>, so every row runs to max_new_tokens. A fine-tuned one
    ends each summary at its own length; to measure that case, use as EOS the token this model emits most
    often after a few tokens (found on a calibration batch), so rows end at varied lengths, as summaries do."""
    counts = {}
    for row in model.generate(prompts[:16], max_new, eos_token_id=-1):
        for token in set(row[4:]):
            counts[token] = counts.get(token, 0) + 1
    return max(counts, key=counts.get)


def compare_generate(hf, ours, batches, max_new, eos, args, device, with_naive):
    """Summaries/s of our batched generator, transformers' batched generate and (optionally) a naive
    no-cache loop, one prompt at a time, on an evenly spread subset of the same length-sorted prompts."""
    flat = [p for batch in batches for p in batch]
    naive_picks = list(range(0, len(flat), max(1, len(flat) // args.naive_prompts)))[:args.naive_prompts]

    def ours_batched():
        return [row for batch in batches for row in ours.generate(batch, max_new, eos_token_id=eos)]

    @torch.inference_mode()
    def hf_batched():
        rows = []
        for batch in batches:
            width = max(len(p) for p in batch)
            ids = torch.tensor([[eos] * (width - len(p)) + p for p in batch], device=device)
            mask = torch.tensor([[0] * (width - len(p)) + [1] * len(p) for p in batch], device=device)
            out = hf.generate(ids, attention_mask=mask, max_new_tokens=max_new, do_sample=False,
                              pad_token_id=eos, eos_token_id=eos)[:, width:].tolist()
            rows += [r[:r.index(eos)] if eos in r else r for r in out]
        return rows

    @torch.inference_mode()
    def naive_one_at_a_time():
        rows = []
        for i in naive_picks:
            seq = list(flat[i])
            for _ in range(max_new):
                token = int(ours(torch.tensor([seq], device=device))[0][0, -1].argmax())
                if token == eos:
                    break
                seq.append(token)
            rows.append(seq[len(flat[i]):])
        return rows

    candidates = {"ours": ours_batched, "transformers": hf_batched}
    if with_naive:
        candidates["naive"] = naive_one_at_a_time
    outputs, seconds, memory = interleaved(candidates, device, args.repeats)
    n = len(flat)
    rate = {"ours": n / seconds["ours"], "transformers": n / seconds["transformers"]}
    matches = sum(a == b for a, b in zip(outputs["ours"], outputs["transformers"]))
    rows = [
        dict(section="generate", figure="summaries_per_s_ours", value=rate["ours"], peak_mb=memory["ours"]),
        dict(section="generate", figure="summaries_per_s_transformers", value=rate["transformers"],
             peak_mb=memory["transformers"]),
        dict(section="generate", figure="speedup_vs_transformers", value=rate["ours"] / rate["transformers"],
             target=">= 1.5"),
        dict(section="generate", figure="greedy_identical_to_transformers", value=f"{matches}/{n}",
             target=f"{n}/{n}"),
        dict(section="generate", figure="mean_new_tokens", value=statistics.mean(map(len, outputs["ours"]))),
    ]
    if with_naive:
        naive_rate = len(naive_picks) / seconds["naive"]
        naive_matches = sum(outputs["ours"][i] == row for i, row in zip(naive_picks, outputs["naive"]))
        rows += [
            dict(section="generate", figure="summaries_per_s_naive", value=naive_rate, peak_mb=memory["naive"]),
            dict(section="generate", figure="speedup_vs_naive", value=rate["ours"] / naive_rate, target=">= 20"),
            dict(section="generate", figure="greedy_identical_to_naive",
                 value=f"{naive_matches}/{len(naive_picks)}", target=f"{len(naive_picks)}/{len(naive_picks)}"),
        ]
    return rows


SECTIONS = {"generate": bench_generate}


def main():
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--section", default="all", choices=["all", *SECTIONS])
    parser.add_argument("--model", default="small", choices=list(MODELS))
    parser.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    parser.add_argument("--json", action="store_true", help="one JSON object per figure instead of a table")
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--gen_prompts", type=int, default=48)
    parser.add_argument("--gen_batch", type=int, default=16)
    parser.add_argument("--naive_prompts", type=int, default=3)
    parser.add_argument("--max_new_tokens", type=int, default=32)
    args = parser.parse_args()
    device = torch.device(args.device)
    sections = SECTIONS if args.section == "all" else {args.section: SECTIONS[args.section]}
    for name, run in sections.items():
        rows = run(args, device)
        for row in rows:
            if args.json:
                print(json.dumps(row))
            else:
                value = f"{row['value']:.2f}" if isinstance(row["value"], float) else row["value"]
                extra = f"  (target {row['target']})" if "target" in row else ""
                extra += f"  peak {row['peak_mb']:.0f} MiB" if "peak_mb" in row else ""
                print(f"{row['section']:<9} {row['figure']:<44} {value}{extra}")


if __name__ == "__main__":
    main()
