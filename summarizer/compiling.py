"""Compiling, one owner: whether a command compiles (use_compile), the training step under torch.compile with its
fallback to eager (EagerFallback, CompiledModule), and greedy decoding's steps as CUDA graphs with theirs
(StepGraphs). The Runtime holds the choices a process makes with it."""
import contextlib
import sys

import torch
from tqdm import tqdm

from generate import GreedyBatch, static_step
from model import KVCache
from summarizer.errors import UserError
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
    """The compile fallback (training's; decoding does not compile): calls go to `compiled` until the compiler fails at
    one (lazily: a first call, a recompile, a recompile limit), then one warning line that says `instead`, and
    `eager` for the rest of the run. The program's own errors (out of memory included) propagate."""

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


def capture_graph(step):
    """(a CUDA graph of step(), the output its replays write, step()'s output run eagerly): the warm-up runs on a
    side stream, as capture wants, and the step's writes (its KV slot) are the same in warm-up and replay."""
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        for _ in range(3):  # lazy initialization (cuBLAS, kernels chosen at a first call) stays out of the graph
            expected = step()
    torch.cuda.current_stream().wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        output = step()
    return graph, output, expected


class StepGraphs:
    """Greedy's static-shape step (generate.static_step) as a CUDA graph per (model, rows, slots) bucket, captured
    at its first use by `capture` (capture_graph) and replayed. The batch is held in fixed buffers (hold): per
    bucket its small inputs, and for every bucket one KV storage per layer, sized for the largest, whose front
    each bucket's caches view. The first replay of a bucket is checked against the eager step; a capture error or
    a disagreement decodes eagerly from then on, with one line. release() frees graphs and buffers."""
    def __init__(self, capture=capture_graph):
        self.capture, self.failed = capture, False
        self.release()

    def release(self):
        self.graphs, self.inputs, self.storage = {}, {}, []

    def hold(self, model, batch):
        """The batch copied into this bucket's fixed buffers (as it is once graphs failed)."""
        if self.failed:
            return batch
        first = batch.caches[0].kv
        if not self.storage or self.storage[0].numel() < first.numel() or self.storage[0].dtype != first.dtype:
            self.release()  # the graphs read the storage they were captured on: they go with it
            self.storage = [cache.kv.new_empty(first.numel()) for cache in batch.caches]
        key = (model, len(batch.tokens), batch.caches[0].slots)
        if key not in self.inputs:
            caches = [KVCache(batch.caches[0].slots, kv[:first.numel()].view(first.shape)) for kv in self.storage]
            self.inputs[key] = GreedyBatch(*(torch.empty_like(t) for t in batch[:4]), caches)
        held = self.inputs[key]
        for target, source in zip(held.tensors(), batch.tensors(), strict=True):
            target.copy_(source)
        return held

    def __call__(self, model, batch):
        """The step's logits: the bucket's graph replayed, captured and checked at its first use."""
        key = (model, len(batch.tokens), batch.caches[0].slots)
        if not self.failed and key not in self.graphs:
            try:
                graph, logits, expected = self.capture(lambda: static_step(model, batch))
                graph.replay()
                agree = torch.equal(logits.argmax(-1), expected.argmax(-1)) and torch.allclose(
                    logits.float(), expected.float(), rtol=1e-2, atol=1e-2)
                why = None if agree else "its first replay disagreed with the eager step"
            except torch.OutOfMemoryError:
                raise
            except Exception as e:  # the step's own errors meet the eager step again below
                why = f"capture failed ({type(e).__name__}: {str(e).strip().partition(chr(10))[0]})"
            if why:
                tqdm.write(f"warning: CUDA graph {why}; decoding eagerly from now on", file=sys.stderr)
                self.failed = True
                self.release()
            else:
                self.graphs[key] = graph, logits
                return logits
        if self.failed:
            return static_step(model, batch)
        graph, logits = self.graphs[key]
        graph.replay()
        return logits
