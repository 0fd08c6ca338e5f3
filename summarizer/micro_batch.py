"""micro_batch_size=auto on the device, before step 1: the plan (summarizer/memory.py) has never met the user's GPU
and leaves backward's transient buffers to its headroom, so the micro-batch it chose runs a step's peak once, on what
the run's step calls (compiled where it compiles: a compiled, checkpointed step may peak higher, pytorch#120381); an
out-of-memory error lowers it, on every rank alike, rather than ending the run at its first step. (A generation
batch that runs out of memory is lowered where batches are formed: inference.summarize_on_ranks.)"""
import functools
from dataclasses import replace

import numpy as np
import torch

import data
from model import Targets
from summarizer.backends import zero_gradients
from summarizer.launch import training_memory_hint
from summarizer.memory import halved_until_it_runs, parameter_bytes
from summarizer.state import rng_state, set_rng_state


def micro_batch_that_runs(cfg, rt, model, train_set, chosen):
    """(cfg with the largest micro-batch, from the plan's down, whose peak_step runs on every rank; the start line's
    words)."""
    rows, tried, met = halved_until_it_runs(
        rt, cfg.micro_batch_size, lambda rows: peak_step(replace(cfg, micro_batch_size=rows), rt, model, train_set),
        functools.partial(training_memory_hint, replace(cfg, micro_batch_size=1), rt))
    return replace(cfg, micro_batch_size=rows), chosen + (
        f"; out of memory at {' and '.join(tried)} ({met}): lowered to {rows}" if tried else "")


def peak_step(cfg, rt, model, train_set):
    """A step's peak on `model` (the model, or its CompiledModule) before any backend wraps it (no collective: a rank
    out of memory leaves it alone), beside AdamW's state and, where the backend keeps them between steps, the
    gradients. Leaves no gradients, draws no random numbers."""
    rng = rng_state()
    rows = np.argsort(train_set.lengths, kind="stable")[-cfg.micro_batch_size:]
    x, y = data.collate(train_set, rows, cfg.train_on_prompt)
    held = torch.empty(parameter_bytes(model, rt.backend, rt.world_size)[2], dtype=torch.uint8, device=rt.device)
    if rt.parallel.keeps_gradients:
        zero_gradients(model)
    try:
        with rt.autocast():
            _, loss = model(x.to(rt.device), Targets.of(y).to(rt.device))
        loss.backward()
    finally:
        del held
        model.zero_grad(set_to_none=True)
        set_rng_state(rng)
