"""Benchmarks (python -m bench), the hardware preflight (python -m bench.preflight) and the GPU check (bash
bench/gpu_check.sh), and what they share."""
import os
import time

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
    """The environment of a child process that runs this repository's code: the caller's (os.environ), ROOT put
    first on its PYTHONPATH, never replacing it (a package found through it must stay found), and `extra`."""
    environ = dict(os.environ if environ is None else environ)
    path = environ.get("PYTHONPATH")
    return {**environ, "PYTHONPATH": ROOT + (os.pathsep + path if path else ""), **extra}


def synchronize(device):
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def timed(fn, device):
    """(fn's output, the seconds it took, the device's queued work waited for before and after)."""
    synchronize(device)
    start = time.perf_counter()
    output = fn()
    synchronize(device)
    return output, time.perf_counter() - start
