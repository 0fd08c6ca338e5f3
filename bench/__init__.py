"""What the benchmarks (python -m bench), the preflight and the GPU check share."""
import contextlib
import os
import subprocess
import sys
import time

import numpy as np
import pandas as pd
import torch

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
SAMSUM_CSV = os.path.join(ROOT, "..", "shared", "data", "samsum-validation.csv")  # --samsum_csv's default
GIB = 2**30
# the Kaggle presets (paths from ROOT), by the GPT-2 model each fine-tunes
PRESETS = {"gpt2": "config/kaggle_t4x2.py", "gpt2-medium": "config/kaggle_t4x2_gpt2-medium.py",
           "gpt2-large": "config/kaggle_t4x2_gpt2-large.py", "gpt2-xl": "config/kaggle_t4x2_gpt2-xl.py"}
# the shapes a benchmark's --model names
MODELS = {"tiny": dict(n_layer=1, n_head=2, n_embd=32, block_size=128),
          "small": dict(n_layer=6, n_head=6, n_embd=384, block_size=1024),
          "gpt2": dict(n_layer=12, n_head=12, n_embd=768, block_size=1024)}


def child_environ(environ=None, **extra):
    """os.environ (or `environ`) with ROOT first on PYTHONPATH, never replacing it (what it finds stays found)."""
    environ = dict(os.environ if environ is None else environ)
    path = environ.get("PYTHONPATH")
    return {**environ, "PYTHONPATH": ROOT + (os.pathsep + path if path else ""), **extra}


def training_csv(folder, samsum_csv=SAMSUM_CSV, rows=400):
    """samsum_csv when it exists, else random chats of its shape."""
    if os.path.exists(samsum_csv):
        return samsum_csv, "SAMSum validation"
    rng = np.random.default_rng(0)
    words = "hi ok yes no sure thanks see you tomorrow at the party dinner work home movie coffee late".split()
    chats = ["\n".join(f"P{rng.integers(4)}: {' '.join(rng.choice(words, rng.integers(2, 30)))}"
                       for _ in range(rng.integers(3, 15))) for _ in range(rows)]
    path = os.path.join(folder, "chats.csv")
    pd.DataFrame({"id": range(rows), "dialogue": chats,
                  "summary": [" ".join(rng.choice(words, rng.integers(5, 30))) for _ in range(rows)]}).to_csv(path)
    return path, "synthetic SAMSum-shaped chats"


def torchrun(args, nproc, env, timeout):
    argv = [sys.executable, "-m", "torch.distributed.run", f"--nproc_per_node={nproc}", "--standalone", *args]
    try:
        done = subprocess.run(argv, cwd=ROOT, env=env, capture_output=True, text=True, timeout=timeout)
    except subprocess.TimeoutExpired as e:
        return None, (e.stdout or b"").decode() if isinstance(e.stdout, bytes) else (e.stdout or "")
    return done.returncode, done.stdout + done.stderr


def demo_arguments(folder, device="cpu"):
    argv = [os.path.join(ROOT, "config", "demo.py"), f"--data_cache_dir={folder}/cache", f"--device={device}",
            "--evaluate_after=False", "--predict_after=False", "--sample_submission_csv="]
    return argv + [f"--{split}_csv={os.path.join(ROOT, 'data', 'demo', split + '.csv')}"
                   for split in ("train", "validation", "test")]


def train_quietly(argv):
    """Train as train.py would, its log on stderr: stdout is the benchmark's."""
    import train
    from config import load_config
    from summarizer.preparation import prepare
    from summarizer.process import Process
    cfg = load_config(argv)
    with contextlib.redirect_stdout(sys.stderr), Process(cfg) as proc:
        train.Trainer(prepare(cfg, proc), proc).fit()
    return cfg


def progress(what):
    print(f"bench: {what}", file=sys.stderr, flush=True)


def synchronize(device):
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def timed(fn, device):
    """(fn's output, its seconds, the device's queued work waited for before and after)."""
    synchronize(device)
    start = time.perf_counter()
    output = fn()
    synchronize(device)
    return output, time.perf_counter() - start
