"""micro_batch_size=auto on the device, before step 1: the plan (summarizer/memory.py) has never met the user's GPU
and leaves backward's transient buffers to its headroom, so the micro-batch it chose runs a step's peak once, on what
the run's step calls (compiled where it compiles: a compiled, checkpointed step may peak higher, pytorch#120381); an
out-of-memory error lowers it, on every rank alike, rather than ending the run at its first step. (A generation
batch that runs out of memory is lowered where batches are formed: inference.summarize_on_ranks.)"""
from dataclasses import replace

import numpy as np
import torch

import data
from command_line import first_line
from model import Targets
from summarizer.backends import zero_gradients
from summarizer.launch import out_of_memory, training_memory_hint
from summarizer.memory import parameter_bytes
from summarizer.state import rng_restored


def micro_batch_that_runs(cfg, rt, model, train_set, chosen):
    """(cfg with the largest micro-batch, from the plan's down, halved at each out-of-memory, whose peak_step runs on
    every rank; the start line's words). Every rank tells the others whether it ran, so all choose alike and none
    waits."""
    tried, met = [], None
    while True:
        try:
            peak_step(cfg, rt, model, train_set)
            mine = None
        except Exception as e:  # left here, the error frees what the step held
            if not out_of_memory(e):
                raise
            mine = f"rank {rt.rank}: {first_line(e)}"
        if not (failed := [m for m in rt.all_gather_objects(mine) if m]):
            return cfg, chosen + (f"; out of memory at {' and '.join(tried)} ({met}): lowered to "
                                  f"{cfg.micro_batch_size}" if tried else "")
        met = failed[0]
        if cfg.micro_batch_size == 1:
            with training_memory_hint(cfg, rt):
                raise torch.OutOfMemoryError(met)
        tried.append(str(cfg.micro_batch_size))
        cfg = replace(cfg, micro_batch_size=cfg.micro_batch_size // 2)


def peak_step(cfg, rt, model, train_set):
    """A step's peak on `model` (the model, or its CompiledModule) before any backend wraps it (no collective: a rank
    out of memory leaves it alone), beside AdamW's state and, where the backend keeps them between steps, the
    gradients. Leaves no gradients, draws no random numbers."""
    rows = np.argsort(train_set.lengths, kind="stable")[-cfg.micro_batch_size:]
    x, y = data.collate(train_set, rows, cfg.train_on_prompt)
    held = torch.empty(parameter_bytes(model, rt.backend, rt.world_size)[2], dtype=torch.uint8, device=rt.device)
    if rt.parallel.keeps_gradients:
        zero_gradients(model)
    try:
        with rng_restored():
            with rt.autocast():
                _, loss = model(x.to(rt.device), Targets.of(y).to(rt.device))
            loss.backward()
    finally:
        del held
        model.zero_grad(set_to_none=True)
