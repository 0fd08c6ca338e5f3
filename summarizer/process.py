"""Where the job runs: this process's Process (rank, device, precision, compile and CUDA graphs, its backend)."""
import contextlib
import functools
import os
import sys
import traceback
import warnings

import torch
from tqdm import tqdm

from command_line import UserError, error_line
from generate import StepGraphs
from summarizer.backends import BACKENDS, accelerate_settings, nccl_flags, resolve_backend, use_compile

ACCELERATE_PRECISIONS = {"no": None, "fp16": "float16", "bf16": "bfloat16"}


def choose_precision(requested, device_type, capability=None, accelerate_precision="no"):
    """(dtype name, use GradScaler). Accelerate's mixed_precision 'no' is its default, so it defers to us. CUDA: bf16
    from compute capability 8.0, else fp16 + GradScaler; CPU: fp32 unless asked."""
    if accelerate_precision not in ACCELERATE_PRECISIONS:
        raise UserError(f"Accelerate's mixed_precision={accelerate_precision!r} is not supported here: use 'no', "
                        f"'fp16' or 'bf16' (accelerate launch --mixed_precision=...) and this trainer's --dtype")
    adopted = ACCELERATE_PRECISIONS[accelerate_precision]
    if adopted and requested == "auto":
        requested = adopted
    elif adopted and requested != adopted:
        raise UserError(f"--dtype={requested} disagrees with Accelerate's mixed_precision={accelerate_precision} "
                        f"(from accelerate config, --mixed_precision or ACCELERATE_MIXED_PRECISION): set one of "
                        f"them only, e.g. --dtype=auto to follow Accelerate, or accelerate launch --mixed_precision=no")
    if requested == "auto":
        if device_type != "cuda":
            return "float32", False
        requested = "bfloat16" if capability >= (8, 0) else "float16"
    if requested == "bfloat16" and device_type == "cuda" and capability < (8, 0):
        raise UserError(f"dtype=bfloat16 needs a GPU of compute capability >= 8.0, this one is "
                        f"{capability[0]}.{capability[1]} (e.g. a T4): use --dtype=float16 or --dtype=auto")
    return requested, requested == "float16"


def expandable_segments():
    """Widths that vary every step fragment fixed segments. Set through the setter, not a variable: torch 2.8-2.11
    warn that PYTORCH_CUDA_ALLOC_CONF is deprecated, and some ignore PYTORCH_ALLOC_CONF (pytorch#183387)."""
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", FutureWarning)  # torch 2.13 names the setter torch._C's
        torch.cuda.memory._set_allocator_settings("expandable_segments:True")


class Process:
    """Rank, world size, device, precision and compile of this process; its backend (proc.parallel) and collectives."""

    def __init__(self, cfg):
        self.backend = resolve_backend(cfg.backend, os.environ)
        want_cuda = cfg.device.startswith("cuda") or (cfg.device == "auto" and torch.cuda.is_available())
        if want_cuda and not torch.cuda.is_available():
            raise UserError(f"device={cfg.device} but no CUDA GPU is visible: use --device=cpu")
        if want_cuda and not {"PYTORCH_ALLOC_CONF", "PYTORCH_CUDA_ALLOC_CONF"} & os.environ.keys():  # the user's wins
            expandable_segments()
        for key, value in nccl_flags(cfg).items():
            os.environ.setdefault(key, value)  # the user's own environment wins
        accelerate_precision, accelerate_dynamo = (accelerate_settings(os.environ) if self.backend == "accelerate"
                                                   else ("no", "no"))
        self.parallel = BACKENDS[self.backend](cfg, want_cuda)
        self.rank, self.world_size, self.device = self.parallel.rank, self.parallel.world_size, self.parallel.device
        # the collectives are the backend's own (a single process has none): bound here, they run no code of this
        # module at each step
        self.barrier, self.all_reduce_sum = self.parallel.barrier, self.parallel.all_reduce_sum
        self.all_gather_objects = self.parallel.all_gather_objects
        self.is_main, self.distributed = self.rank == 0, self.world_size > 1
        capability = torch.cuda.get_device_capability(self.device) if self.device.type == "cuda" else None
        self.dtype, self.use_scaler = choose_precision(cfg.dtype, self.device.type, capability, accelerate_precision)
        self.autocast = (contextlib.nullcontext if self.dtype == "float32" else
                         functools.partial(torch.autocast, self.device.type, dtype=getattr(torch, self.dtype)))
        self.compile = use_compile(cfg.compile, self.device.type, accelerate_dynamo)
        # FSDP2's hooks do not trace into one graph (fullgraph=True): its training step runs eagerly (its decoding,
        # on a gathered copy of the weights, is graphed as any other)
        self.compile_training = self.compile and self.backend != "fsdp"
        # greedy decoding as CUDA graphs where compile applies on a GPU (compile=False: eager, a way out)
        self.graphs = (StepGraphs(warn=functools.partial(tqdm.write, file=sys.stderr),  # a line of its own under a bar
                                  error_line=error_line)
                       if self.compile and self.device.type == "cuda" else None)
        self.gen_batch_cap = None  # the most prompts a generation batch takes since one ran out of memory
        if self.dtype == "float16" and self.device.type == "cpu" and self.is_main:
            print("warning: dtype=float16 on cpu is emulated and many times slower than float32: use "
                  "--dtype=float32 (or --dtype=auto, float32 on a CPU)", file=sys.stderr)
        self.device_name = torch.cuda.get_device_name(self.device) if self.device.type == "cuda" else "cpu"
        self.decided_by = [f"Accelerate's {name}={value}" for name, value in
                           (("mixed_precision", accelerate_precision), ("dynamo_backend", accelerate_dynamo))
                           if value != "no"]
        if self.backend == "fsdp":  # a step's micro-batches are cut where padding is least: any step may accumulate
            self.parallel.plan(cfg.fsdp_reduce_once, self.dtype, self.is_main)

    def describe(self, compiled):
        """What runs, in words; `compiled` says what runs under torch.compile."""
        return (f"{self.dtype}{' with GradScaler' if self.use_scaler else ''} on {self.device_name}, "
                f"{compiled}, backend {self.backend}"
                + (f" (following {', '.join(self.decided_by)})" if self.decided_by else "")
                + f"; {self.graphs.describe() if self.graphs else 'eager decode steps'}")

    def __enter__(self):
        return self

    def __exit__(self, kind, error, trace):
        if trace is not None:  # what the failed work held (a DDP module, FSDP's state) goes before its group
            traceback.clear_frames(trace)
        self.parallel.close(clean=kind is None)

    def stop_if(self, problem):
        """Every rank stops together when rank 0 found `problem`: its one error line, the others quietly."""
        problem = self.all_gather_objects(problem if self.is_main else None)[0]
        if problem and self.is_main:
            raise UserError(problem)
        if problem:
            sys.exit(2)
