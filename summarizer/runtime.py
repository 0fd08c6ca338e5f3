"""Where the job runs: the Runtime of this process (rank, device, precision, compile, the few collectives the
trainer uses), its backend (a single process, torchrun's DDP or FSDP, Accelerate: one object each that shards,
wraps and gathers the model its way), compiling a model with a fallback to eager, and peak FLOPS."""
import contextlib
import datetime
import gc
import importlib.metadata
import json
import os
import re
import subprocess
import sys
import traceback

import torch
import torch.distributed as dist
import torch.distributed.fsdp
from torch.distributed.checkpoint.state_dict import (
    StateDictOptions,
    get_model_state_dict,
    get_optimizer_state_dict,
    set_optimizer_state_dict,
)
from torch.nn.parallel import DistributedDataParallel
from tqdm import tqdm

from config import grad_accum_steps
from generate import decode_step, eager_step
from summarizer.errors import UserError
from summarizer.files import atomic_write
from summarizer.run_folder import COMPILE_CACHE

# Dense peak TFLOPS per GPU by dtype (vendor datasheets, no sparsity), matched on whole words of the device name,
# more specific names first.
PEAK_TFLOPS = {
    "H200": {"bfloat16": 989.0, "float16": 989.0, "float32": 67.0},
    "H100 PCIE": {"bfloat16": 756.0, "float16": 756.0, "float32": 51.0},
    "H100": {"bfloat16": 989.0, "float16": 989.0, "float32": 67.0},
    "A100": {"bfloat16": 312.0, "float16": 312.0, "float32": 19.5},
    "A10": {"bfloat16": 125.0, "float16": 125.0, "float32": 31.2},
    "L4": {"bfloat16": 121.0, "float16": 121.0, "float32": 30.3},
    "V100": {"float16": 125.0, "float32": 15.7},
    "T4": {"float16": 65.0, "float32": 8.1},
}


def peak_flops(device_name, dtype):
    """Peak FLOP/s of a GPU named like torch.cuda.get_device_name() ("Tesla T4", "NVIDIA A100-SXM4-80GB") for a
    dtype name, or None when unknown. Whole words only: an L40S is not an L4, nor an A10G an A10."""
    for key, table in PEAK_TFLOPS.items():
        if re.search(rf"\b{key}\b", device_name.upper()):
            return table[dtype] * 1e12 if dtype in table else None
    return None


ACCELERATE_PRECISIONS = {"no": None, "fp16": "float16", "bf16": "bfloat16"}


def choose_precision(requested, device_type, capability=None, accelerate_precision="no"):
    """(dtype name, use GradScaler) from the config's `dtype`, the device's properties and, under `accelerate
    launch`, Accelerate's mixed_precision ('no' is its default when the user chose nothing, so it defers to us).
    CUDA: bf16 from compute capability 8.0 (A100, H100, L4, A10), else fp16 + GradScaler (T4 is 7.5, V100 7.0).
    CPU: fp32 unless asked otherwise."""
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


def use_compile(requested, device_type, accelerate_dynamo="no"):
    """The config's `compile`: 'auto' compiles on CUDA only (on CPU a short run spends more time compiling than
    it saves), True and False force it on or off on any device. Under `accelerate launch`, Accelerate's dynamo
    backend 'inductor' turns 'auto' on (we compile, with our trial and fallback); it contradicts compile=False."""
    if accelerate_dynamo not in ("no", "inductor"):
        raise UserError(f"Accelerate's dynamo_backend={accelerate_dynamo} is not supported: this trainer compiles with "
                        f"inductor (--compile=True); set accelerate's dynamo_backend to no or inductor")
    if accelerate_dynamo == "inductor":
        if requested is False:
            raise UserError(f"--compile=False disagrees with Accelerate's dynamo_backend={accelerate_dynamo} (from "
                            f"accelerate config, --dynamo_backend or ACCELERATE_DYNAMO_BACKEND): drop one of them")
        return True
    return requested is True or (requested == "auto" and device_type == "cuda")


# What compiling generate's decode step costs and saves on a GPU: compile=auto compiles a command's decoding when the
# steps it will run save more than the compile takes (decode_compile_pays). Python's and the kernel launches' time
# per module call is what a compiled step saves; a GPT-2 block is about ten module calls.
DECODE_COMPILE_S = 30.0  # a cold compile of the decode step (the first H100 run's first batch: 35-45 s with it)
CACHED_COMPILE_S = 8.0  # with the run's compiled work loaded (compile_cache.bin): Dynamo traces again, no more
SAVED_PER_BLOCK_S = 2.5e-4  # per decode step and transformer block


def decode_compile_pays(decode_steps, n_layer, compile_seconds):
    """(whether compiling the decode step repays itself over `decode_steps` steps of an n_layer model, the words
    that say so)."""
    saved = decode_steps * n_layer * SAVED_PER_BLOCK_S
    return saved > compile_seconds, (f"{decode_steps} decode steps of {n_layer} blocks save ~{saved:.0f} s, "
                                     f"{'more' if saved > compile_seconds else 'less'} than the "
                                     f"~{compile_seconds:.0f} s a compile takes")


def compiled_by():
    """What compiled work is valid for: this torch, Triton and Python."""
    try:
        triton_version = importlib.metadata.version("triton")
    except importlib.metadata.PackageNotFoundError:  # a CPU build
        triton_version = None
    return {"torch": torch.__version__, "triton": triton_version, "python": ".".join(map(str, sys.version_info[:2]))}


def load_compile_cache(folder, device_name):
    """Bring back the compiled work a run saved in `folder` (save_compile_cache) when this torch, Triton, Python
    and device made it: (loaded, the line that says what happened, or None where there is no file)."""
    path = os.path.join(folder, COMPILE_CACHE)
    if not os.path.isfile(path):
        return False, None
    try:  # a damaged or foreign file costs a compile, not the run
        with open(path, "rb") as f:
            made_by, artifacts = json.loads(f.readline()), f.read()
        here = {**compiled_by(), "device": device_name}
        if made_by != here:
            differ = ", ".join(f"{key} {made_by.get(key)} (here {value})" for key, value in here.items()
                               if made_by.get(key) != value)
            return False, f"{path} was compiled for another {differ}: compiling afresh"
        info = torch.compiler.load_cache_artifacts(artifacts)
    except Exception as e:
        return False, f"{path} cannot be read ({type(e).__name__}: {e}): compiling afresh"
    count = sum(len(names) for names in info.artifacts.values()) if info else 0
    return count > 0, f"compiled work: {count} artifact(s) from {path}"


def save_compile_cache(folder, device_name):
    """Write what this process compiled (inductor's kernels, AOTAutograd's graphs, autotuning) to
    folder/compile_cache.bin, with what it is valid for; nothing when nothing was compiled."""
    saved = torch.compiler.save_cache_artifacts()
    if saved:
        with atomic_write(os.path.join(folder, COMPILE_CACHE), "wb") as f:
            f.write(json.dumps({**compiled_by(), "device": device_name}).encode() + b"\n")
            f.write(saved[0])


def compiler_error(error):
    """Whether `error` is the compiler's (dynamo's tracing, inductor's code generation, a missing C++ compiler or
    Triton): only then is running eagerly a fallback. Errors of the program itself, an out-of-memory included
    (also one the compiler wraps), are not: eager would meet them too, needing more memory."""
    import torch._inductor.exc as inductor  # loaded only when something failed

    causes = (error, getattr(error, "inner_exception", None), error.__cause__, error.__context__)
    if any(isinstance(e, torch.OutOfMemoryError) for e in causes):
        return False
    compiler = tuple(getattr(inductor, name) for name in ("InductorError", "CppCompileError", "InvalidCxxCompiler",
                                                         "CUDACompileError", "LoweringException")
                     if hasattr(inductor, name))
    # fullgraph=True turns dynamo's recompile limit into an error that is not a TorchDynamoException (named
    # FailOnCacheLimitHit before torch 2.6)
    recompiles = tuple(getattr(torch._dynamo.exc, name) for name in ("FailOnRecompileLimitHit", "FailOnCacheLimitHit")
                       if hasattr(torch._dynamo.exc, name))
    return isinstance(error, (torch._dynamo.exc.TorchDynamoException, *compiler, *recompiles))


@contextlib.contextmanager
def out_of_memory_hint(doing, settings):
    """Re-raise a torch.OutOfMemoryError inside as one whose message is one line: what ran out of memory and the
    settings to lower (entry points print it as `error: ...`)."""
    try:
        yield
    except torch.OutOfMemoryError as e:
        if str(e).startswith("out of memory while"):  # already said by an inner hint
            raise
        detail = str(e).strip().partition("\n")[0]
        raise torch.OutOfMemoryError(f"out of memory while {doing}: lower {settings}"
                                     + (f" ({detail})" if detail else "")) from None


def warn_compile_failed(error, fallback):
    """One stderr line for a torch.compile failure: the compiler's own error and what runs instead; returns the
    error, in one line."""
    error = getattr(error, "inner_exception", None) or error  # dynamo wraps the backend's exception
    reason = str(error).strip().splitlines()
    why = f"{type(error).__name__}: {reason[0] if reason else ''}"
    tqdm.write(f"warning: torch.compile failed ({why}); {fallback}", file=sys.stderr)  # a line of its own under a bar
    return why


def backward_compiled_in_forward():
    """AOTAutograd compiles the backward graph at the forward, not lazily at the first backward: a compiler error
    there meets CompiledModule's fallback."""
    config = torch._functorch.config
    if hasattr(config, "force_non_lazy_backward_lowering"):
        return config.patch(force_non_lazy_backward_lowering=True)
    return contextlib.nullcontext()


def rng_state():
    """This process's torch RNG (dropout); data order needs none, the sampler is a function of the step."""
    state = {"torch": torch.get_rng_state()}
    if torch.cuda.is_available() and torch.cuda.is_initialized():
        state["cuda"] = torch.cuda.get_rng_state()
    return state


def set_rng_state(state):
    torch.set_rng_state(state["torch"])
    if "cuda" in state and torch.cuda.is_available():
        torch.cuda.set_rng_state(state["cuda"])


class EagerFallback:
    """The one compile fallback, of training and of decoding: calls go to `compiled` until the compiler fails at
    one (it compiles lazily: at a first call, at a recompile, or at a recompile limit), then one warning line that
    says `instead`, and `eager` for the rest of the run. Errors of the program itself (out of memory included)
    propagate."""

    def __init__(self, compiled, eager, instead):
        self.compiled, self.eager, self.instead = compiled, eager, instead
        self.failed, self.why = False, None  # why: the compiler's error, in one line

    def __call__(self, *args):
        if not self.failed:
            try:
                return self.compiled(*args)
            except Exception as e:  # a failed compile ran nothing: the eager call below does the whole work
                if not compiler_error(e):
                    raise
                self.why = warn_compile_failed(e, self.instead)
                self.failed = True
        return self.eager(*args)


class CompiledModule(torch.nn.Module):
    """`module` under torch.compile, eager after a compiler failure (EagerFallback). Its parameters are `module`'s,
    so a backend's wrapper (DDP) and the optimizer see the same tensors either way."""

    def __init__(self, module):
        super().__init__()
        # One graph (fullgraph) with its sizes symbolic from the start (dynamic): micro-batch widths and target
        # counts change every step.
        self.compiled = compiled = torch.compile(module, fullgraph=True, dynamic=True)

        def compiled_forward(*args):  # not a method: the module would hold itself, and outlive its last user
            with backward_compiled_in_forward():
                return compiled(*args)
        self.fallback = EagerFallback(compiled_forward, module, "training eagerly from now on (tokens_per_s and mfu "
                                                                "are eager's)")

    def forward(self, *args):
        return self.fallback(*args)


class CompiledDecodeStep(EagerFallback):
    """generate's decode step under torch.compile (compiled at its first call), eager after a compiler failure. A
    process has one at most (Runtime.decoding): training's ROUGE decoding, evaluate_after and predict_after run
    the graphs it compiled."""

    def __init__(self):
        compiled = torch.compile(decode_step, dynamic=True, fullgraph=True)
        super().__init__(compiled, eager_decode_step, "decoding eagerly")


def eager_decode_step(model, *args):
    return eager_step(model.lm_head.weight.device)(model, *args)


def compile_model(module, trial, autocast):
    """A CompiledModule of `module` (a GPT, or a stage's module around it), tried now on trial(compiled) -> a loss,
    forward and backward, because compiling happens lazily at the first call; the eager module, with one warning
    line, if the compiler fails there. Any other error (out of memory included) propagates. Leaves no gradients
    behind and draws no random numbers."""
    rng = rng_state()
    try:
        compiled = CompiledModule(module)
        with autocast:
            loss = trial(compiled.compiled)
        loss.sum().backward()
        return compiled
    except Exception as e:  # compiler support varies by platform, GPU, C++ compiler and torch build
        if not compiler_error(e):
            raise  # e.g. out of memory: eager needs more, not less
        warn_compile_failed(e, "training eagerly")
        return module
    finally:
        module.zero_grad(set_to_none=True)
        set_rng_state(rng)


def resolve_backend(requested, environ):
    """'auto' picks Accelerate under `accelerate launch`, DDP under torchrun, else a single process."""
    if requested != "auto":
        return requested
    if any(key.startswith("ACCELERATE_") for key in environ):
        return "accelerate"
    return "ddp" if "RANK" in environ and "WORLD_SIZE" in environ else "none"


def accelerate_settings(environ):
    """(mixed_precision, dynamo backend) that `accelerate launch` passes in the environment, lower case; refuses
    the distributed types this trainer does not implement through Accelerate."""
    for key, what in (("ACCELERATE_USE_FSDP", "FSDP"), ("ACCELERATE_USE_DEEPSPEED", "DeepSpeed")):
        if environ.get(key, "false").lower() in ("1", "true", "yes"):
            raise UserError(f"the Accelerate config asks for {what}, which this trainer does not run through "
                            f"Accelerate: use `accelerate launch --multi_gpu` (DDP) or torchrun with --backend=fsdp")
    return (environ.get("ACCELERATE_MIXED_PRECISION", "no").lower(),
            environ.get("ACCELERATE_DYNAMO_BACKEND", "no").lower())


class Runtime:
    """Rank, world size, device, precision and compile of this process; its backend (rt.parallel) and the few
    collective operations the trainer uses."""

    def __init__(self, cfg):
        self.backend = resolve_backend(cfg.backend, os.environ)
        want_cuda = cfg.device.startswith("cuda") or (cfg.device == "auto" and torch.cuda.is_available())
        if want_cuda and not torch.cuda.is_available():
            raise UserError(f"device={cfg.device} but no CUDA GPU is visible: use --device=cpu")
        if want_cuda:  # read at the first CUDA allocation: widths that vary every step fragment fixed segments
            os.environ.setdefault("PYTORCH_CUDA_ALLOC_CONF", "expandable_segments:True")
        for key, value in nccl_flags(cfg).items():
            os.environ.setdefault(key, value)  # the user's own environment wins
        accelerate_precision, accelerate_dynamo = (accelerate_settings(os.environ) if self.backend == "accelerate"
                                                   else ("no", "no"))
        self.parallel = BACKENDS[self.backend](cfg, want_cuda)
        self.rank, self.world_size, self.device = self.parallel.rank, self.parallel.world_size, self.parallel.device
        self.is_main = self.rank == 0
        capability = torch.cuda.get_device_capability(self.device) if self.device.type == "cuda" else None
        self.dtype, self.use_scaler = choose_precision(cfg.dtype, self.device.type, capability, accelerate_precision)
        self.compile = use_compile(cfg.compile, self.device.type, accelerate_dynamo)
        # FSDP2's hooks do not trace into one graph (fullgraph=True): its training step runs eagerly, its decoding
        # (a gathered copy of the weights) compiles
        self.compile_training = self.compile and self.backend != "fsdp"
        self.compile_rule = "auto" if cfg.compile == "auto" and accelerate_dynamo == "no" else "set"
        self.compiled_work = None  # None: not looked for yet; then whether a run's compile_cache.bin was loaded
        self.decode_choice = None  # (the decode step, the words): the process's first decoding decides
        if self.dtype == "float16" and self.device.type == "cpu" and self.is_main:
            print("warning: dtype=float16 on cpu is emulated and many times slower than float32: use "
                  "--dtype=float32 (or --dtype=auto, float32 on a CPU)", file=sys.stderr)
        self.device_name = torch.cuda.get_device_name(self.device) if self.device.type == "cuda" else "cpu"
        self.decided_by = [f"Accelerate's {name}={value}" for name, value in
                           (("mixed_precision", accelerate_precision), ("dynamo_backend", accelerate_dynamo))
                           if value != "no"]
        if self.backend == "fsdp":
            accumulates = cfg.micro_batch_size == "auto" or grad_accum_steps(cfg, self.world_size) > 1
            self.parallel.plan(cfg.fsdp_reduce_once if accumulates else False, self.dtype, self.is_main)

    def load_compiled_work(self, folder):
        """Before anything compiles: the compiled work a run saved in `folder`, when it was made here (the line that
        says what came of it, or None where there is none). A process looks once: a training run's after-run
        decodes with what the run compiled and loaded already."""
        if not self.compile or self.compiled_work is not None:
            return None
        self.compiled_work, line = load_compile_cache(folder, self.device_name)
        return line

    def save_compiled_work(self, folder):
        """Rank 0 keeps what this process compiled in `folder`, for later processes (load_compiled_work)."""
        if self.compile and self.is_main:
            save_compile_cache(folder, self.device_name)

    def decoding(self, decode_steps, n_layer):
        """(generate's decode step for this process's decoding: a CompiledDecodeStep, or None for eager; words that
        say which and why). The first call decides for the process, so a training run's after-run decodes with the
        graphs its evaluations compiled: compile=True compiles, False does not, and auto compiles on a GPU when
        the `decode_steps` of the caller's work (a training run: its evaluations and its after-run) repay it."""
        if self.decode_choice is None:
            if self.compile_rule == "auto" and self.compile:
                pays, why = decode_compile_pays(decode_steps, n_layer,
                                                CACHED_COMPILE_S if self.compiled_work else DECODE_COMPILE_S)
                why = f"compile=auto: {why}"
            else:
                pays = self.compile
                why = f"compile={self.compile}" if self.compile_rule == "set" else "compile=auto: on a GPU only"
            self.decode_choice = (CompiledDecodeStep() if pays else None,
                                  f"{'torch.compile' if pays else 'eager'} decoding ({why})")
        return self.decode_choice

    def describe(self, compiled):
        """What runs, in words: the line the trainer prints (and what it prints is what runs); `compiled` says what
        runs under torch.compile."""
        return (f"{self.dtype}{' with GradScaler' if self.use_scaler else ''} on {self.device_name}, "
                f"{compiled}, backend {self.backend}"
                + (f" (following {', '.join(self.decided_by)})" if self.decided_by else ""))

    def __enter__(self):
        return self

    def __exit__(self, kind, error, trace):
        if trace is not None:  # what the failed work held (a DDP module, FSDP's state) goes before its group
            traceback.clear_frames(trace)
        self.parallel.close(clean=kind is None)

    @property
    def distributed(self):
        return self.world_size > 1

    def autocast(self):
        if self.dtype == "float32":
            return contextlib.nullcontext()
        return torch.autocast(self.device.type, dtype=getattr(torch, self.dtype))

    def barrier(self):
        if self.distributed:
            dist.barrier()

    def all_reduce_sum(self, tensor):
        if self.distributed:
            dist.all_reduce(tensor, op=dist.ReduceOp.SUM)
        return tensor

    def stop_if(self, problem):
        """Every rank stops together when rank 0 found `problem` (rank 0 ends with it as its one error line; the
        others exit quietly); with None from rank 0 every rank goes on."""
        problem = self.all_gather_objects(problem if self.is_main else None)[0]
        if problem and self.is_main:
            raise UserError(problem)
        if problem:
            sys.exit(2)

    def all_gather_objects(self, obj):
        """Every rank's `obj`, in rank order, on every rank."""
        if not self.distributed:
            return [obj]
        gathered = [None] * self.world_size
        dist.all_gather_object(gathered, obj)
        return gathered


# ---- the backends ----------------------------------------------------------------------------------------

class SingleProcess:
    """One process: the model as it is; state dicts as PyTorch writes them."""

    def __init__(self, cfg, want_cuda):
        self.rank, self.world_size = 0, 1
        self.device = torch.device(cfg.device if cfg.device != "auto" else ("cuda" if want_cuda else "cpu"))

    def close(self, clean):
        pass

    def shard(self, model):
        return model

    def wrap(self, model):
        return model

    def no_sync(self, wrapped, sync):
        return contextlib.nullcontext()

    def training_state(self, model, optimizer):
        """(model, optimizer) state dicts as ckpt.pt keeps them, complete, on rank 0; every rank must call this."""
        return model.state_dict(), optimizer.state_dict()

    def load_optimizer_state(self, model, optimizer, state, path):
        """Load an optimizer state dict saved by training_state."""
        if any(isinstance(key, str) for key in state["state"]):
            raise UserError(f"{path} was written by a run with --backend=fsdp, whose optimizer state another "
                            f"backend cannot load: resume with the backend it was trained with")
        optimizer.load_state_dict(state)
        # load_state_dict keeps CPU tensors of the right dtype as they are: views of the checkpoint's mmap'd
        # pages, which would keep the replaced file's disk space in use until the process ends
        for per_param in optimizer.state.values():
            for key, value in per_param.items():
                if isinstance(value, torch.Tensor) and value.device.type == "cpu":
                    per_param[key] = value.clone()

    def full_weights(self, model):
        """The model's complete state dict on every rank."""
        return model.state_dict()


class DDP(SingleProcess):
    """torchrun's processes, one per GPU (or gloo on CPU): gradients all-reduced by DistributedDataParallel."""

    def __init__(self, cfg, want_cuda):
        if "RANK" not in os.environ:
            raise UserError(f"backend={cfg.backend} needs torchrun: torchrun --nproc_per_node=N --standalone "
                            f"train.py --backend={cfg.backend}")
        self.rank, self.world_size = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
        self.device = torch.device(f"cuda:{int(os.environ.get('LOCAL_RANK', 0))}" if want_cuda else "cpu")
        if want_cuda:
            torch.cuda.set_device(self.device)
        meet(cfg, self.device, self.world_size)

    def close(self, clean):
        if dist.is_initialized():
            part(self.device, clean, self.rank)

    def wrap(self, model):
        if self.world_size == 1:
            return model
        return DistributedDataParallel(model, device_ids=[self.device.index] if self.device.type == "cuda" else None)

    def no_sync(self, wrapped, sync):
        """Skip the gradient reduction on all but the last micro-step of an accumulation."""
        if sync or self.world_size == 1:
            return contextlib.nullcontext()
        return wrapped.no_sync()


# What to set when NCCL's first collective fails, in this order: Kaggle's T4s have no peer access, and NCCL >= 2.24
# sets up its shared-memory transport with cuMem host buffers, which fails there ("Cuda failure 217 'peer access is
# not supported'", NVIDIA/nccl#1838); NCCL_CUMEM_HOST_ENABLE=0 takes the older /dev/shm files, NCCL_SHM_DISABLE=1
# no shared memory at all (a small /dev/shm fails the files too).
NCCL_SETTINGS = ({"NCCL_CUMEM_HOST_ENABLE": "0"}, {"NCCL_SHM_DISABLE": "1"})


def nccl_flags(cfg):
    """The NCCL variables the config's flags ask for (set only where the environment has none)."""
    return {key: "1" for key, on in (("NCCL_P2P_DISABLE", cfg.nccl_p2p_disable),
                                     ("NCCL_IB_DISABLE", cfg.nccl_ib_disable)) if on}


def next_nccl_setting(environ):
    """The first of NCCL_SETTINGS that `environ` does not already have, or None."""
    return next((s for s in NCCL_SETTINGS if any(environ.get(k) != v for k, v in s.items())), None)


def nccl_in_effect(environ):
    """The NCCL_* variables of `environ`, as KEY=value words."""
    return " ".join(f"{k}={v}" for k, v in sorted(environ.items()) if k.startswith("NCCL_")) or "NCCL's defaults"


def meet(cfg, device, world_size):
    """Start the process group and run one collective within dist_start_timeout seconds, so that a rank that
    never arrives or a transport that fails (NCCL's, at its setup) stops every rank in one line at start-up,
    naming what to change; later collectives may take dist_timeout seconds each."""
    nccl = device.type == "cuda"
    bound = min((cfg.dist_start_timeout, "dist_start_timeout"), (cfg.dist_timeout, "dist_timeout"))
    start = datetime.timedelta(seconds=bound[0])
    try:
        dist.init_process_group("nccl" if nccl else "gloo", device_id=device if nccl else None, timeout=start)
        dist.all_reduce(torch.ones(1, device=device))
        if nccl:
            torch.cuda.synchronize(device)  # NCCL reports a failed setup at the first wait
    except (RuntimeError, dist.DistError) as e:  # DistStoreError, DistBackendError; NCCL's errors
        detail = " ".join(str(e).split())[:300]
        timed_out = "clients joined" in detail or "timed out" in detail.lower()
        what = (f"the {world_size} processes did not all start and meet within {bound[1]}={bound[0]} s" if timed_out
                else f"the first collective between the {world_size} processes failed")
        fix = ""
        if nccl:
            setting = next_nccl_setting(os.environ)
            fix = (f" (NCCL ran with {nccl_in_effect(os.environ)}): set "
                   + (" ".join(f"{k}={v}" for k, v in setting.items()) + " in the environment and run again "
                      "(a notebook: os.environ[...] before the training cell); docs/troubleshooting.md"
                      if setting else "see docs/troubleshooting.md (NCCL settings) and run python -m "
                                      "bench.preflight"))
        raise UserError(f"{what} ({detail}){fix}") from None
    if bound[0] != cfg.dist_timeout:
        dist.distributed_c10d._set_pg_timeout(datetime.timedelta(seconds=cfg.dist_timeout))


# How long a process may take to end after the ranks' last collective (its outputs are complete by then) before a
# watchdog ends it: destroying a group takes well under a second.
TEARDOWN_SECONDS = 60
WATCHDOG = """
import os, select, signal, sys
pipe, parent, seconds, line = int(sys.argv[1]), int(sys.argv[2]), float(sys.argv[3]), sys.argv[4]
if not select.select([pipe], [], [], seconds)[0]:  # the pipe is readable (at its end) once the parent has exited
    print(line, file=sys.stderr, flush=True)
    os.kill(parent, signal.SIGKILL)
"""


def part(device, clean, rank):
    """End the process group in an order that cannot deadlock. A gloo group's destructor joins its worker threads,
    and a worker may need the GIL to drop the last reference to a finished collective's tensors: when a C++ holder
    drops the group's last reference (DDP's Reducer, at the interpreter's exit) the GIL stays held and both wait
    (pytorch/pytorch#56297, #75097). So: whatever still holds the group (the run's DDP module, FSDP's state) is
    collected first, while the group's registry keeps it alive; a clean end meets the other ranks in one blocking
    all-reduce whose tensor stays referenced here until the group is gone (no worker drops its last reference);
    then destroy_process_group drops the group from Python, which releases the GIL while the workers stop. A
    watchdog process bounds the rest of this process's life by TEARDOWN_SECONDS, in case a runtime still hangs.
    After an error (its frames cleared by Runtime), no collection: under torchrun the launcher stops the other ranks
    within moments."""
    if clean:  # no rank tears its connections down while another still uses them
        gc.collect()  # reference cycles through the model, its hooks and the objective
        done = torch.ones(1, device=device)
        dist.all_reduce(done)
        if device.type == "cuda":
            torch.cuda.synchronize(device)
    watch_exit(TEARDOWN_SECONDS, f"warning (rank {rank}): the process group's teardown did not end within "
                                 f"{TEARDOWN_SECONDS} s of the ranks' last collective; the outputs are complete: "
                                 f"ending the process")
    dist.destroy_process_group()


def watch_exit(seconds, line):
    """Start a watchdog process that writes `line` to stderr and kills this process if it is still alive `seconds`
    from now. A process, not a thread: a thread needs the GIL, which a hung teardown may hold. It learns of this
    process's end from a pipe whose only writer is this process (the fd stays open until the process ends)."""
    read, write = os.pipe()  # not inherited by later children (PEP 446): only this process holds `write`
    subprocess.Popen([sys.executable, "-S", "-c", WATCHDOG, str(read), str(os.getpid()), str(seconds), line],
                     pass_fds=(read,), stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL)
    os.close(read)


class Accelerate(DDP):
    """`accelerate launch`: Accelerate's process group and DDP wrapper; precision and compile stay ours."""

    def __init__(self, cfg, want_cuda):
        from accelerate import Accelerator
        from accelerate.utils import InitProcessGroupKwargs
        # Accelerate must not add an autocast or a torch.compile of its own around the model.
        self.accelerator = Accelerator(cpu=not want_cuda, mixed_precision="no", dynamo_backend="no",
                                       kwargs_handlers=[InitProcessGroupKwargs(
                                           timeout=datetime.timedelta(seconds=cfg.dist_timeout))])
        self.rank, self.world_size = self.accelerator.process_index, self.accelerator.num_processes
        self.device = self.accelerator.device

    def close(self, clean):
        self.accelerator.free_memory()  # it keeps the models it prepared: its DDP module holds the group
        if dist.is_initialized():  # end_training skips the group under notebook_launcher's forked workers
            part(self.device, clean, self.rank)

    def wrap(self, model):
        return self.accelerator.prepare_model(model)



def reduce_once_bytes(model, world_size, dtype):
    """(held, kept): bytes per rank that reducing gradients once per optimizer step holds between FSDP's
    micro-steps (every weight gathered in `dtype`, an fp32 gradient per trainable parameter), and what FSDP keeps
    anyway (its shards of the fp32 weights and gradients, and AdamW's two moments), from the unsharded model."""
    params = list(model.parameters())  # tied weights once
    gradients = sum(p.nbytes for p in params if p.requires_grad)  # fp32 like the weights, and each AdamW moment
    held = sum(p.numel() for p in params) * dtype.itemsize + gradients
    return held, (sum(p.nbytes for p in params) + 3 * gradients) / world_size


class FSDP(DDP):
    """torchrun's processes with FSDP2's fully_shard: weights, gradients and optimizer state sharded across ranks."""

    def __init__(self, cfg, want_cuda):
        if not hasattr(torch.distributed.fsdp, "fully_shard"):
            raise UserError(f"backend=fsdp needs PyTorch 2.6 or newer (fully_shard), this is {torch.__version__}: "
                            f"upgrade torch, or use backend=ddp")
        super().__init__(cfg, want_cuda)
        self.model = None  # the sharded model, once shard() ran

    def plan(self, reduce_once, dtype, is_main):
        """fsdp_reduce_once (False without accumulation; 'auto': decided by shard) and the compute dtype."""
        self.reduce_once, self.dtype, self.is_main = reduce_once, dtype, is_main

    def shard(self, model):
        """Shard the model in place with fully_shard: one unit per block, then the root (embeddings, ln_f, the tied
        lm_head). Its parameters become fp32 DTensors (build the optimizer after this); with a 16-bit dtype each
        unit is all-gathered in that dtype and its gradients are reduce-scattered in fp32. hidden_states is a
        forward method too (the calibration stage calls it). Decides fsdp_reduce_once='auto'."""
        if self.reduce_once == "auto":
            self.reduce_once = self.reduce_once_fits(model)
        policy = torch.distributed.fsdp.MixedPrecisionPolicy()
        if self.dtype != "float32":
            policy = torch.distributed.fsdp.MixedPrecisionPolicy(param_dtype=getattr(torch, self.dtype),
                                                                 reduce_dtype=torch.float32)
        for block in model.transformer.h:
            torch.distributed.fsdp.fully_shard(block, mp_policy=policy)
        torch.distributed.fsdp.fully_shard(model, mp_policy=policy)
        torch.distributed.fsdp.register_fsdp_forward_method(model, "hidden_states")
        self.model = model
        return model

    def reduce_once_fits(self, model):
        """Whether every GPU has room for FSDP's shards, AdamW's state and what reducing gradients once per
        optimizer step holds (reduce_once_bytes); activations are not counted. On the CPU, yes. Rank 0 says why
        not."""
        if self.device.type != "cuda":
            return True
        held, kept = reduce_once_bytes(model, self.world_size, getattr(torch, self.dtype))
        total = torch.tensor(torch.cuda.mem_get_info(self.device)[1], device=self.device)
        dist.all_reduce(total, op=dist.ReduceOp.MIN)  # all ranks decide alike
        fits = held + kept <= total.item()
        if not fits and self.is_main:
            print(f"FSDP reduce-scatters gradients after every micro-step: reducing once per optimizer step would "
                  f"hold {held / 2**30:.1f} GiB of gathered {self.dtype} weights and fp32 gradients beside "
                  f"{kept / 2**30:.1f} GiB of shards and AdamW state, more than the GPU's "
                  f"{total.item() / 2**30:.1f} GiB (--fsdp_reduce_once=True tries anyway)")
        return fits

    def close(self, clean):
        self.model = None  # the sharded model holds the group: it goes first
        super().close(clean)

    def wrap(self, model):
        return model

    def no_sync(self, wrapped, sync):
        """FSDP reduce-scatters after every micro-step, unless reduce_once (accumulation)."""
        return self.accumulation(sync) if self.reduce_once else contextlib.nullcontext()

    @contextlib.contextmanager
    def accumulation(self, sync):
        """One micro-step with reduce_once: the first forward of an optimizer step gathers the weights, which stay
        gathered until the last backward; gradients accumulate unsharded in fp32 and are reduce-scattered
        (averaged, as DDP's all-reduce) by the last backward only."""
        self.model.set_requires_gradient_sync(sync)
        self.model.set_reshard_after_backward(sync)
        for block in self.model.transformer.h:  # the root unit is never resharded after forward
            block.set_reshard_after_forward(False, recurse=False)
        yield
        if sync:  # evaluation and generation reshard after each forward again
            for block in self.model.transformer.h:
                block.set_reshard_after_forward(True, recurse=False)

    def training_state(self, model, optimizer):
        """Gathered from the shards onto rank 0's CPU ({} elsewhere), the optimizer's keyed by parameter name."""
        options = StateDictOptions(full_state_dict=True, cpu_offload=True)
        return get_model_state_dict(model, options=options), get_optimizer_state_dict(model, optimizer, options=options)

    def load_optimizer_state(self, model, optimizer, state, path):
        """Each rank takes its shards of an optimizer state dict saved by training_state."""
        if not any(isinstance(key, str) for key in state["state"]):
            raise UserError(f"{path} was written by a run with another backend, whose optimizer state FSDP cannot "
                            f"load: resume with the backend it was trained with")
        set_optimizer_state_dict(model, optimizer, state, options=StateDictOptions(full_state_dict=True))

    def full_weights(self, model):
        """The model's complete state dict on every rank, all-gathered onto each rank's device."""
        return get_model_state_dict(model, options=StateDictOptions(full_state_dict=True))


BACKENDS = {"none": SingleProcess, "ddp": DDP, "fsdp": FSDP, "accelerate": Accelerate}
