"""Compiling, one owner: whether a command compiles (use_compile), the one fallback to eager of training and of
decoding (EagerFallback: CompiledModule, CompiledDecodeStep), whether compiling a command's decode step pays for
itself (decode_compile_pays), and the compiled work a run keeps beside its checkpoints (compile_cache.bin). The
Runtime holds the choices a process makes with it."""
import contextlib
import importlib.metadata
import json
import os
import sys

import torch
from tqdm import tqdm

from generate import decode_step, eager_step
from summarizer.errors import UserError
from summarizer.files import atomic_write
from summarizer.launch import out_of_memory
from summarizer.run_folder import COMPILE_CACHE
from summarizer.state import rng_state, set_rng_state


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
    if any(out_of_memory(e) for e in causes):
        return False
    compiler = tuple(getattr(inductor, name) for name in ("InductorError", "CppCompileError", "InvalidCxxCompiler",
                                                         "CUDACompileError", "LoweringException")
                     if hasattr(inductor, name))
    # fullgraph=True turns dynamo's recompile limit into an error that is not a TorchDynamoException
    return isinstance(error, (torch._dynamo.exc.TorchDynamoException, torch._dynamo.exc.FailOnRecompileLimitHit,
                              *compiler))


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
    """A CompiledModule of the GPT `module`, tried now on trial(compiled) -> a loss, forward and backward, because
    compiling happens lazily at the first call; the eager module, with one warning line (EagerFallback's), if the
    compiler fails there. Leaves no gradients behind and draws no random numbers."""
    rng, compiled = rng_state(), CompiledModule(module)

    def forward_backward():
        with autocast:
            loss = trial(compiled.compiled)
        loss.sum().backward()
    tried = EagerFallback(forward_backward, lambda: None, "training eagerly")
    try:
        tried()
        return module if tried.failed else compiled
    finally:
        module.zero_grad(set_to_none=True)
        set_rng_state(rng)
