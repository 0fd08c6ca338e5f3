"""Compiling, one owner: whether a command compiles (use_compile), and the training step under torch.compile with
its fallback to eager (CompiledModule). (Decoding is not compiled: greedy's steps replay as CUDA graphs,
generate.StepGraphs.)"""
import contextlib
import sys

import torch
from tqdm import tqdm

from command_line import UserError, first_line
from summarizer.launch import out_of_memory


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


def backward_compiled_in_forward():
    """AOTAutograd compiles the backward graph at the forward, not lazily at the first backward: a compiler error
    there meets CompiledModule's fallback."""
    config = torch._functorch.config
    if hasattr(config, "force_non_lazy_backward_lowering"):
        return config.patch(force_non_lazy_backward_lowering=True)
    return contextlib.nullcontext()


class CompiledModule(torch.nn.Module):
    """`module` under torch.compile (fullgraph; sizes symbolic from the start, as micro-batch widths and target
    counts change every step). Where the compiler fails at a call (a first call, a recompile, its limit): one warning
    line and `module` eagerly for the rest of the run (`why`: the compiler's error in one line; None while compiled).
    Its parameters are `module`'s, so DDP and the optimizer see the same tensors either way."""

    def __init__(self, module):
        super().__init__()
        self.compiled, self.why = torch.compile(module, fullgraph=True, dynamic=True), None

    def forward(self, *args):
        if self.why is None:
            try:
                with backward_compiled_in_forward():
                    return self.compiled(*args)
            except Exception as e:  # a failed compile ran nothing: the eager call below does the whole work
                if not compiler_error(e):
                    raise
                error = getattr(e, "inner_exception", None) or e  # dynamo wraps the backend's exception
                self.why = f"{type(error).__name__}: {first_line(error)}"
                tqdm.write(f"warning: torch.compile failed ({self.why}); training eagerly from now on (tokens_per_s "
                           f"and mfu are eager's)", file=sys.stderr)  # a line of its own under a bar
        return self.compiled._orig_mod(*args)
