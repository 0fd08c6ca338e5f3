"""The CUDA-only code paths on a real GPU, in one table: for each precision (fp32, fp16 + GradScaler, bf16) with
torch.compile off and on, the real Trainer's tokens/s, MFU and peak memory, and the batched generator's tokens/s
and whether compiled greedy output equals eager. Random weights and random dialogues: nothing to download.

    bash scripts/gpu_check.sh                           GPT-2 (124M) shapes on the first GPU
    python scripts/gpu_check.py --device=cpu --model=tiny --dtypes=float32,float16 --compile=False --iters=2
"""
import argparse
import contextlib
import gc
import io
import json
import os
import random
import statistics
import sys
import tempfile
import time

import pandas as pd
import torch

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
from config import UserError, load_config  # noqa: E402
from generate import compile_decode, generate  # noqa: E402
from model import GPT, GPTConfig  # noqa: E402
from runtime import Runtime, choose_precision  # noqa: E402
from train import Trainer  # noqa: E402

MODELS = {"gpt2": dict(n_layer=12, n_head=12, n_embd=768, block_size=1024),
          "tiny": dict(n_layer=1, n_head=2, n_embd=32, block_size=128)}
WORDS = ("hi hey ok yes no sure thanks see you tomorrow tonight later at the a to for with and but so we I it is "
         "are was will can do did have has going meet call send buy dinner party work home office movie coffee "
         "train bus late early today weekend Monday Friday sorry great cool fine love miss need want know").split()
NAMES = ("Amanda", "Jerry", "Tom", "Lily", "Sam", "Kate", "Mike", "Anna")


def write_dialogues(path, n, seed=0):
    """A CSV of n random-word chats with SAMSum's shape: 3-14 turns of 2-15 words, a 6-25 word summary."""
    rng = random.Random(seed)
    rows = []
    for i in range(n):
        turns = [f"{rng.choice(NAMES)}: {' '.join(rng.choices(WORDS, k=rng.randint(2, 15)))}"
                 for _ in range(rng.randint(3, 14))]
        rows.append({"id": str(i), "dialogue": "\n".join(turns),
                     "summary": " ".join(rng.choices(WORDS, k=rng.randint(6, 25)))})
    pd.DataFrame(rows).to_csv(path, index=False)


def synchronize(device):
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def train_case(args, dtype, compile, folder, csv):
    """Median tokens/s, MFU, ms/iter and peak memory over args.iters Trainer steps, the first third not counted
    (they include recompiles for new sequence lengths and the allocator's warm-up)."""
    argv = [f"--train_csv={csv}", f"--out_dir={folder}/{dtype}-{compile}", f"--data_cache_dir={folder}/cache",
            "--init_from=scratch", *(f"--{k}={v}" for k, v in MODELS[args.model].items()), f"--device={args.device}",
            f"--dtype={dtype}", f"--compile={compile}", f"--batch_size={args.micro_batch_size}",
            f"--micro_batch_size={args.micro_batch_size}", f"--max_iters={args.iters}",
            f"--eval_interval={args.iters}", "--eval_val_batches=1", "--rouge_samples=0", "--best_metric=val_loss",
            "--log_interval=1", "--warmup_iters=2", f"--max_new_tokens={args.max_new_tokens}"]
    cfg = load_config(argv)
    if torch.device(args.device).type == "cuda":
        torch.cuda.reset_peak_memory_stats()
    # The Trainer's printout and progress bar would bury the table; a compile fallback shows in the row's note.
    with Runtime(cfg) as rt, contextlib.redirect_stdout(io.StringIO()), contextlib.redirect_stderr(io.StringIO()):
        trainer = Trainer(cfg, rt)
        trainer.fit()
    with open(os.path.join(cfg.out_dir, "metrics.jsonl")) as f:
        steps = [json.loads(line) for line in f][args.iters // 3:]
    median = {key: statistics.median(s[key] for s in steps) if key in steps[0] else None
              for key in ("tokens_per_s", "mfu", "ms_per_iter", "peak_mem_gb")}
    return dict(median, loss=steps[-1]["loss"], compiled=trainer.wrapped is not trainer.model)


def generate_case(args, dtype, compile, device, eager_outputs):
    """Generated tokens/s of one batched greedy generate() after a warm-up call (which compiles), and how many
    compiled outputs equal the eager ones at this precision."""
    torch.manual_seed(0)
    shape = MODELS[args.model]
    model = GPT(GPTConfig(**shape)).to(device).eval()
    if compile:
        compile_decode(model)
    rng = random.Random(0)
    longest = shape["block_size"] - args.max_new_tokens
    prompts = [[rng.randrange(50256) for _ in range(rng.randint(min(64, longest), min(256, longest)))]
               for _ in range(args.gen_prompts)]
    autocast = (torch.autocast(device.type, dtype=getattr(torch, dtype)) if dtype != "float32"
                else contextlib.nullcontext())
    with autocast:
        generate(model, prompts, args.max_new_tokens, eos_token_id=-1)  # never ends early: every row is full
        synchronize(device)
        start = time.perf_counter()
        outputs = generate(model, prompts, args.max_new_tokens, eos_token_id=-1)
        synchronize(device)
    seconds = time.perf_counter() - start
    if not compile:
        eager_outputs[dtype] = outputs
    same = sum(a == b for a, b in zip(outputs, eager_outputs[dtype])) if dtype in eager_outputs else None
    return dict(gen_tokens_per_s=len(prompts) * args.max_new_tokens / seconds,
                same=f"{same}/{len(outputs)}" if compile and same is not None else "-",
                compiled=model.decode_compiled)


COLUMNS = [("dtype", "<9"), ("compile", "<7"), ("train tok/s", ">11"), ("MFU", ">6"), ("ms/iter", ">8"),
           ("peak GB", ">7"), ("loss", ">7"), ("gen tok/s", ">9"), ("greedy=eager", ">12"), ("note", "")]


def table_row(*cells):
    return " ".join(format(str(cell), spec) for cell, (_, spec) in zip(cells, COLUMNS)).rstrip()


def check(args, dtype, compile, device, capability, folder, csv, eager_outputs):
    """One table row: the training and generation figures of (dtype, compile), or why they could not be had."""
    try:
        _, use_scaler = choose_precision(dtype, device.type, capability)
        t = train_case(args, dtype, compile, folder, csv)
        g = generate_case(args, dtype, compile, device, eager_outputs)
    except UserError as e:
        return table_row(dtype, compile, *["-"] * 7, f"not run: {e}")
    except Exception as e:  # e.g. out of memory: the other cases still run
        return table_row(dtype, compile, *["-"] * 7, f"failed: {type(e).__name__}: {str(e).strip()[:200]}")
    finally:
        gc.collect()
        if device.type == "cuda":
            torch.cuda.empty_cache()
    notes = (["GradScaler"] * use_scaler + ["training compile failed, ran eagerly"] * (compile and not t["compiled"])
             + ["decode compile failed, ran eagerly"] * (compile and not g["compiled"]))
    return table_row(dtype, compile, f"{t['tokens_per_s']:.0f}",
                     "-" if t["mfu"] is None else f"{100 * t['mfu']:.1f}%", f"{t['ms_per_iter']:.0f}",
                     "-" if t["peak_mem_gb"] is None else f"{t['peak_mem_gb']:.2f}", f"{t['loss']:.3f}",
                     f"{g['gen_tokens_per_s']:.0f}", g["same"], ", ".join(notes))


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", default="gpt2", choices=list(MODELS))
    parser.add_argument("--device", default="cuda")
    parser.add_argument("--dtypes", default="float32,float16,bfloat16")
    parser.add_argument("--compile", default="False,True", help="False, True or both (eager first)")
    parser.add_argument("--iters", type=int, default=30, help="training steps per case")
    parser.add_argument("--micro_batch_size", type=int, default=8)
    parser.add_argument("--gen_prompts", type=int, default=32)
    parser.add_argument("--max_new_tokens", type=int, default=64)
    args = parser.parse_args(argv)
    device = torch.device(args.device)
    capability = torch.cuda.get_device_capability(device) if device.type == "cuda" else None
    name = torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu"
    eager_outputs = {}
    with tempfile.TemporaryDirectory() as folder:
        csv = os.path.join(folder, "train.csv")
        write_dialogues(csv, 40 * args.micro_batch_size)
        rows = [check(args, dtype, compile == "True", device, capability, folder, csv, eager_outputs)
                for dtype in args.dtypes.split(",") for compile in args.compile.split(",")]
    print(f"\n{args.model} shapes, micro-batch {args.micro_batch_size}, {args.iters} training steps per row, "
          f"generation {args.gen_prompts} prompts x {args.max_new_tokens} new tokens; {name}"
          f"{f' (compute capability {capability[0]}.{capability[1]})' if capability else ''}, torch {torch.__version__}")
    print(table_row(*(title for title, _ in COLUMNS)))
    print("\n".join(rows))


if __name__ == "__main__":
    main()
