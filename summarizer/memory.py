"""The T4 ledger: the bytes one GPU of a run holds at the peak of each phase (train, validation, rouge_build,
rouge_decode, save, after; host), counted before step 1 by running the project's own code on fake tensors at the real
shapes (no second formula to drift from the code). micro_batch_size=auto, fsdp_reduce_once=auto, generation batches and
bench --section=memory use it. Not counted: the CUDA context (a budget is free memory) and fragmentation (HEADROOM)."""
import bisect
import contextlib
import copy
import functools
import math
import os
import resource
import weakref
from collections import deque
from dataclasses import asdict, dataclass, replace
from pathlib import Path

import numpy as np
import torch
from torch._subclasses.fake_tensor import FakeTensorMode
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_leaves

import data
from command_line import UserError, first_line
from config import Decoding, part, rows_per_rank
from generate import greedy_slots, plain_greedy
from model import GPT, GPTConfig, Targets
from summarizer.backends import zero_gradients
from summarizer.launch import out_of_memory, training_memory_hint
from summarizer.loading import lora_settings, merged_weights
from summarizer.run_folder import nbytes
from summarizer.state import rng_restored

HEADROOM = 0.9  # the share of a GPU's free memory a plan may fill: allocator fragmentation, rounding
LOGITS_COPIES = 3  # float32 scores, their softmax and its cumulative sum, per row being decoded
CPU_SHARE = 0.5  # the share of the host's available memory a CPU run's plan may fill
# a container's memory limit and what its processes use: cgroup v2's, then v1's
CGROUP_FILES = (("/sys/fs/cgroup/memory.max", "/sys/fs/cgroup/memory.current"),
                ("/sys/fs/cgroup/memory/memory.limit_in_bytes", "/sys/fs/cgroup/memory/memory.usage_in_bytes"))


def shard_bytes(tensors, world_size):
    """Bytes of one rank's FSDP2 shards: dim 0 cut in world_size equal pieces (padded); scalars whole."""
    return sum(math.ceil(t.shape[0] / world_size) * (t.numel() // t.shape[0]) * t.element_size() if t.dim()
               else t.element_size() for t in tensors)


def parameter_bytes(model, backend, world_size):
    """(weights, gradients, AdamW's state) bytes on one GPU; DDP's buckets are the gradients (gradient_as_bucket_view).
    FSDP: a rank's shards and the units it gathers (the root, two blocks)."""
    params = list(model.parameters())
    trainable = [p for p in params if p.requires_grad]
    moments = 2 * sum(p.numel() for p in trainable) * 4
    if backend != "fsdp":
        return nbytes(params), nbytes(trainable), moments
    gathered = (nbytes(p for n, p in model.named_parameters() if ".h." not in n)
                + 2 * nbytes(model.transformer.h[0].parameters()))
    return (shard_bytes(params, world_size) + gathered, shard_bytes(trainable, world_size) + gathered,
            math.ceil(moments / world_size))


class LiveBytes(TorchDispatchMode):
    """The bytes of the storages made inside it and still alive, and their peak (fake tensors hold nothing)."""

    def __init__(self):
        super().__init__()
        self.live, self.now, self.peak = set(), 0, 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        inputs = {t.untyped_storage()._cdata for t in tree_leaves((args, kwargs)) if isinstance(t, torch.Tensor)}
        for t in tree_leaves(out):  # a view of a tensor made before (a weight's transpose) is no new storage
            key = isinstance(t, torch.Tensor) and (storage := t.untyped_storage())._cdata
            if key and key not in self.live and key not in inputs:
                self.live.add(key)
                self.now += storage.nbytes()
                self.peak = max(self.peak, self.now)
                weakref.finalize(storage, self.free, key, storage.nbytes())
        return out

    def free(self, key, size):
        self.live.discard(key)
        self.now -= size


def twin(model, fake=None):
    """`model` (adapters, checkpointing, tying) on tensors that hold no memory: fake CPU ones under `fake`, or meta."""
    with fake or contextlib.nullcontext():
        memo = {id(t): torch.empty(t.shape, dtype=t.dtype, device="cpu" if fake else "meta")
                for t in (*model.parameters(), *model.buffers())}
        memo |= {id(p): torch.nn.Parameter(memo[id(p)], p.requires_grad) for p in model.parameters()}
    return copy.deepcopy(model, memo)


def pass_peak(model, fake, rows, length, targets, dtype, train):
    """The peak of a micro-batch's forward (backward with `train`) under CPU autocast: a GPU's casts and attention."""
    with fake:
        x = torch.zeros(rows, length, dtype=torch.long)
        found = Targets(x, torch.zeros(targets, dtype=torch.long))
    with (fake, LiveBytes() as live, torch.autocast("cpu", dtype=dtype, enabled=dtype != torch.float32),
          torch.set_grad_enabled(train)):
        loss = model.train(train)(x, found)[1]
        if train:
            loss.backward()
    model.zero_grad(set_to_none=True)
    return live.peak


@dataclass(frozen=True)
class Workload:
    """What a ledger needs of a run; lengths in tokens."""
    model: torch.nn.Module
    cfg: object
    backend: str
    world_size: int
    dtype: torch.dtype
    longest_row: int
    most_targets: int
    longest_prompt: int
    reduce_once: bool = False


@dataclass(frozen=True)
class Ledger:
    phases: dict
    host: int

    @property
    def peak(self):
        return max(self.phases.values())

    def describe(self):
        return ", ".join(f"{phase} {size / 2**30:.1f}" for phase, size in self.phases.items()) + " GiB"


def ledger(run, rows, budget):
    """The Ledger of `run` at micro-batches of `rows` of its longest row, where a plan may fill `budget` bytes."""
    cfg, model, fsdp = run.cfg, run.model, run.backend == "fsdp"
    fake = FakeTensorMode()
    faked, meta = twin(model, fake), twin(model)
    full, grads = nbytes(model.parameters()), nbytes(p for p in model.parameters() if p.requires_grad)
    weights, grad_held, moments = parameter_bytes(model, run.backend, run.world_size)
    pass_of = functools.partial(pass_peak, faked, fake, rows, run.longest_row, rows * run.most_targets, run.dtype)
    # DDP's gradients are its buckets, kept between steps (backends.DDP.keeps_gradients); the pass counts them once
    held = weights + moments + (grads if run.backend in ("ddp", "accelerate") and run.world_size > 1 else 0)
    train = weights + moments + pass_of(True)
    if fsdp:  # the pass's gradients are a rank's shards once each unit's backward ends; reduce-once keeps them whole
        train += grad_held - grads + (reduce_once_bytes(model, run.world_size, run.dtype)[0] - 2 * (
            weights - shard_bytes(model.parameters(), run.world_size)) if run.reduce_once else 0)
    with torch.device("meta"):  # rouge_model's copy and best.pt's weights as evaluate_after loads them
        copied = nbytes(GPT(GPTConfig(**asdict(model.config))).to(run.dtype).parameters())
    if not fsdp and not cfg.lora_rank and run.dtype == torch.float32:
        copied = 0  # rouge_model decodes with the trained model itself
    with LiveBytes() as merging:  # a LoRA run's merge, one weight at a time (rouge_model's copy, best.pt's save)
        if cfg.lora_rank:
            deque(merged_weights(meta.state_dict(), **lora_settings(cfg)), maxlen=0)
    merged = merging.peak
    prompts = min(cfg.rouge_samples, cfg.gen_batch_size)
    phases = dict(train=train,
                  validation=held + pass_of(False),
                  rouge_build=held + (full if fsdp else 0) + merged + copied,  # FSDP: every rank's gathered weights
                  rouge_decode=held + copied + batch_bytes(run, prompts, budget - held - copied),
                  save=held + (merged if not fsdp else 0))
    after = full // 4 * run.dtype.itemsize
    phases["after"] = after + batch_bytes(run, cfg.gen_batch_size, budget - after)
    host = max(run.world_size * full, full + 2 * full if fsdp else 0)  # loading; FSDP's save on rank 0's CPU
    return Ledger(phases, host)


def batch_bytes(run, prompts, left):
    """KV cache and logits bytes of the first generation batch of `prompts` longest prompts."""
    room = run.cfg.gen_memory_gb * 2**30 or max(left, 0) / 2
    return sum(decoding_bytes(run.cfg, run.model.config, run.dtype, prompts, run.longest_prompt, room)[1:])


def decoding_bytes(cfg, model_config, dtype, prompts, prompt_tokens, room):
    """(prompts, KV cache bytes, logits bytes) of the first generation batch as generation_batches forms it."""
    kv, logits = dialogue_bytes(part(cfg, Decoding), prompt_tokens, model_config, dtype)
    batch = min(prompts, cfg.gen_batch_size, max(1, int(room // (kv + logits)))) if prompts else 0
    return batch, batch * kv, batch * logits


def device_memory(device):
    if device.type == "cuda":
        return int(torch.cuda.mem_get_info(device)[0] * HEADROOM)
    return host_memory(CPU_SHARE)


def host_memory(share=1.0):
    """Bytes this process may still take on the host: `share` of what the host and its cgroup have available (others use
    them too), at most HEADROOM of what `ulimit -v` leaves its own address space."""
    meminfo = dict(line.split(":") for line in Path("/proc/meminfo").read_text().splitlines())
    shared = [int(meminfo["MemAvailable"].split()[0]) * 1024]  # kB: free, and the page cache dropped on demand
    for limit, usage in CGROUP_FILES:
        with contextlib.suppress(OSError, ValueError):  # no such cgroup, or no limit (memory.max: "max")
            shared.append(int(Path(limit).read_text()) - int(Path(usage).read_text()))
    left = [share * min(shared)]
    if (address_space := resource.getrlimit(resource.RLIMIT_AS)[0]) != resource.RLIM_INFINITY:
        in_use = int(Path("/proc/self/statm").read_text().split()[0]) * os.sysconf("SC_PAGE_SIZE")
        left.append(HEADROOM * (address_space - in_use))
    return int(max(min(left), 0))


def workload(cfg, proc, model, train_set, val_set):
    """(the Workload of this run, the smallest budget of its ranks), fsdp_reduce_once=auto decided."""
    # the plan counts the weights, so those already on the device (a CPU run's) are part of its budget
    held = nbytes(p for p in model.parameters() if p.device.type == proc.device.type)
    budget = min(proc.all_gather_objects(device_memory(proc.device) + held))
    run, one = decide_reduce_once(Workload(model, cfg, proc.backend, proc.world_size, getattr(torch, proc.dtype),
                                           longest_row=int(train_set.lengths.max()),
                                           most_targets=int(train_set.target_counts(cfg.train_on_prompt).max()),
                                           longest_prompt=int(val_set.prompt_lens.max()) if len(val_set) else 0),
                                  budget)
    if one is not None:
        proc.parallel.reduce_once = run.reduce_once
        if not run.reduce_once and proc.is_main:
            print(f"FSDP reduce-scatters gradients after every micro-step: reducing once per optimizer step would "
                  f"need {one.peak / 2**30:.1f} GiB ({one.describe()}), more than the {budget / 2**30:.1f} GiB "
                  f"usable (--fsdp_reduce_once=True tries anyway)")
    return run, budget


def decide_reduce_once(run, budget):
    """(run with reduce-once as fsdp_reduce_once says, auto: on where one row fits with it; that ledger)."""
    run = replace(run, reduce_once=run.backend == "fsdp" and run.cfg.fsdp_reduce_once is not False)
    if not run.reduce_once or run.cfg.fsdp_reduce_once != "auto":
        return run, None
    one = ledger(run, 1, budget)
    return replace(run, reduce_once=one.peak <= budget), one


def choose_micro_batch(run, budget):
    rows, chosen = largest_micro_batch(run, budget)
    words = (f"micro_batch_size=auto: {rows} (the plan's peak {chosen.peak / 2**30:.1f} of {budget / 2**30:.1f} GiB "
             f"usable: {chosen.describe()})")
    if chosen.peak > budget:
        cfg = run.cfg  # the advice names only what is off
        off = [flag for flag, on in (("--gradient_checkpointing=True", cfg.gradient_checkpointing),
                                     ("--lora_rank=8", cfg.lora_rank), ("--backend=fsdp", run.backend == "fsdp"))
               if not on]
        words += "; warning: even one row does not fit the plan: lower block_size" + "".join(f", or {f}" for f in off)
    return rows, words


def largest_micro_batch(run, budget):
    """(rows, its Ledger): the largest micro-batch, up to a rank's rows per step, that fits `budget` (else 1)."""
    counts = range(1, rows_per_rank(run.cfg.batch_size, run.world_size) + 1)
    rows = counts[max(bisect.bisect_right(counts, False, key=lambda n: ledger(run, n, budget).peak > budget) - 1, 0)]
    return rows, ledger(run, rows, budget)


def reduce_once_bytes(model, world_size, dtype):
    """(held, kept) bytes per rank: reduce-once's gathered weights and fp32 gradients; FSDP's shards, moments."""
    params = list(model.parameters())  # tied weights once
    gradients = nbytes(p for p in params if p.requires_grad)  # fp32 like the weights, and each AdamW moment
    held = sum(p.numel() for p in params) * dtype.itemsize + gradients
    return held, (nbytes(params) + 3 * gradients) / world_size


def halved_until_it_runs(proc, size, attempt, hint, keep=None):
    """attempt(size) on every rank, `size` halved alike on all after an out-of-memory error on any (told to all: none
    waits). An error may carry .size (where it ran out) and .done (its work, given to keep). Returns (size, the sizes
    that ran out, the first error line); at size 1 raises inside hint()."""
    tried, met = [], None
    while True:
        try:
            mine, failed = attempt(size), None
        except Exception as e:  # left here, the error frees what the attempt held
            if not out_of_memory(e):
                raise
            mine, failed = getattr(e, "done", None), (getattr(e, "size", size), f"rank {proc.rank}: {first_line(e)}")
        shards = proc.all_gather_objects((mine, failed))
        if keep:
            keep([shard for shard, _ in shards])
        if not (failures := [failure for _, failure in shards if failure]):
            return size, tried, met
        size, met = min(failures)
        if size == 1:
            with hint():
                raise torch.OutOfMemoryError(met)
        tried.append(str(size))
        size //= 2


# ---- micro_batch_size=auto on the device, before step 1 ---------------------------------------------------------
# The plan never met this GPU (and a compiled, checkpointed step may peak higher, pytorch#120381): the chosen
# micro-batch's peak runs once; an out-of-memory error lowers it on every rank rather than ending the run at step 1.

def micro_batch_that_runs(cfg, proc, model, train_set, chosen):
    rows, tried, met = halved_until_it_runs(
        proc, cfg.micro_batch_size, lambda rows: peak_step(replace(cfg, micro_batch_size=rows), proc, model, train_set),
        functools.partial(training_memory_hint, replace(cfg, micro_batch_size=1), proc))
    return replace(cfg, micro_batch_size=rows), chosen + (
        f"; out of memory at {' and '.join(tried)} ({met}): lowered to {rows}" if tried else "")


def peak_step(cfg, proc, model, train_set):
    """A step's peak on `model`, unwrapped (no collective), beside AdamW's state; leaves no gradients or RNG change."""
    rows = np.argsort(train_set.lengths, kind="stable")[-cfg.micro_batch_size:]
    x, y = data.collate(train_set, rows, cfg.train_on_prompt)
    held = torch.empty(parameter_bytes(model, proc.backend, proc.world_size)[2], dtype=torch.uint8, device=proc.device)
    if proc.parallel.keeps_gradients:
        zero_gradients(model)
    try:
        with rng_restored(), proc.autocast():
            _, loss = model(x.to(proc.device), Targets.of(y).to(proc.device))
            loss.backward()
    finally:
        del held
        model.zero_grad(set_to_none=True)


# ---- a generation's batches -----------------------------------------------------------------------------------

CPU_GEN_MEMORY_GB = 2.0  # gen_memory_gb=0 on a CPU


def generation_memory(cfg, device):
    """Bytes one generate() call may take: gen_memory_gb, else half the GPU's free memory (its cache's unused bytes
    counted), else CPU_GEN_MEMORY_GB; at most what the device has left."""
    if device.type == "cuda":
        cached = torch.cuda.memory_reserved(device) - torch.cuda.memory_allocated(device)
        left = torch.cuda.mem_get_info(device)[0] + cached
        return min(cfg.gen_memory_gb * 2**30 or left / 2, left)
    return min(cfg.gen_memory_gb * 2**30 or CPU_GEN_MEMORY_GB * 2**30, host_memory())


def cache_slots_per_prompt(decoding, prompt_tokens, block_size):
    """KV-cache slots a prompt of P tokens holds at generate()'s peak, M new tokens after it: greedy's static cache
    twice (a copy drops ended rows); else the prefill's P shared by the prompt's rows, M own slots each, twice."""
    d, P, M = decoding, prompt_tokens, decoding.max_new_tokens
    if plain_greedy(d) and not d.mbr_samples:
        return 2 * greedy_slots(P, M, block_size)
    return 2 * (P + max(d.num_beams, d.mbr_samples) * M)


def kv_cache_bytes(model_config, slots, dtype):
    return 2 * model_config.n_layer * model_config.n_embd * slots * dtype.itemsize


def dialogue_bytes(decoding, prompt_tokens, model_config, dtype):
    slots = cache_slots_per_prompt(decoding, prompt_tokens, model_config.block_size)
    rows = max(decoding.num_beams, decoding.mbr_samples, 1)
    return kv_cache_bytes(model_config, slots, dtype), LOGITS_COPIES * rows * model_config.vocab_size * 4


def check_one_dialogue(decoding, prompt_tokens, model_config, memory, dtype):
    """UserError, before any allocation, when one dialogue does not fit `memory`, naming the largest value that fits."""
    key = next((key for key in ("mbr_samples", "num_beams") if getattr(decoding, key) > 1), "max_new_tokens")

    def needs(value):
        return sum(dialogue_bytes(replace(decoding, **{key: value}), prompt_tokens, model_config, dtype))
    if needs(now := getattr(decoding, key)) > memory:
        fits = bisect.bisect_right(range(1, now), memory, key=needs)  # 0: not even one
        raise UserError(f"{key}={now} does not fit: one dialogue ({prompt_tokens} prompt tokens) holds "
                        f"{needs(now) / 2**30:.1f} GiB of KV cache and logits, where a generate() call may take "
                        f"{memory / 2**30:.1f} GiB (gen_memory_gb, at most what the device has left): "
                        + (f"the largest {key} that fits is {fits}" if fits else
                           f"not even {key}=1 fits ({needs(1) / 2**30:.2g} GiB): give --gen_memory_gb above that"))


def generation_batches(prompts, decoding, batch_size, model_config, memory, dtype, rank=0, world_size=1):
    """This rank's length-sorted batches of prompt indices: at most batch_size whose caches and logits fit `memory`."""
    order, batches = sorted(range(len(prompts)), key=lambda i: len(prompts[i])), []
    if order:
        check_one_dialogue(decoding, len(prompts[order[-1]]), model_config, memory, dtype)
    for i in order:  # the longest prompt so far (lengths ascend) sets the batch's bytes
        batch = batches[-1] if batches else []
        if batch and len(batch) < batch_size and (len(batch) + 1) * sum(
                dialogue_bytes(decoding, len(prompts[i]), model_config, dtype)) <= memory:
            batch.append(i)
        else:
            batches.append([i])
    return batches[rank::world_size]
