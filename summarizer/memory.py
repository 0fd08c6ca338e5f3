"""The memory one GPU of a training run needs at its peaks, planned before step 1 from the sizes of real tensors:
what micro_batch_size=auto chooses by (no probing: summarizer/micro_batch.py runs the choice's peak once, and
lowers it only on an out-of-memory error) and what bench --section=memory reports.
- Weights, gradients and AdamW's state are the model's own tensors: under FSDP one rank's shards plus the units it
  gathers while computing; under DDP the gradients are its buckets (gradient_as_bucket_view).
- Activations are what autograd keeps for backward, measured on a one-block model of the run's width over a short
  probe under the run's autocast: per token, and per target (only targets go through lm_head). Attention keeps O(T)
  state, so a micro-batch's bytes are these rates times its rows, length and targets.
- The evaluation holds the weights and AdamW's state (gradients freed), the copy ROUGE decodes with (train.
  rouge_model: in the run's dtype, tied, gathered under FSDP) and one generation batch's KV cache and logits.
- A LoRA run merges one adapted weight at a time, in float32, for that copy and for its save (which moves each to
  the host).
Not counted: backward's transient buffers and the CUDA context, which HEADROOM leaves room for."""
import bisect
import contextlib
import math
import os
import resource
from dataclasses import asdict, dataclass, replace
from pathlib import Path

import torch

from command_line import UserError
from config import Decoding, part, rows_per_rank
from generate import greedy_slots, plain_greedy
from model import GPT, GPTConfig, Targets
from summarizer import lora

PROBE_TOKENS = 64  # the probe's sequence: long enough that per-token rates are exact, short enough to be instant
HEADROOM = 0.9  # the share of a GPU's free memory a plan may fill: the CUDA context, allocator fragmentation
LOGITS_COPIES = 3  # float32 scores, their softmax and its cumulative sum, per row being decoded
CPU_SHARE = 0.5  # the share of the host's available memory a CPU run's plan may fill
# a container's memory limit and what its processes use: cgroup v2's, then v1's
CGROUP_FILES = (("/sys/fs/cgroup/memory.max", "/sys/fs/cgroup/memory.current"),
                ("/sys/fs/cgroup/memory/memory.limit_in_bytes", "/sys/fs/cgroup/memory/memory.usage_in_bytes"))


def nbytes(tensors, per_tensor=0):
    """Bytes of distinct tensors (a tied weight once), plus `per_tensor` for each (what a file adds to record one):
    the one count of tensor bytes, which the run folder's disk plan and bench ask too."""
    seen, total = set(), 0
    for t in tensors:
        key = (t.untyped_storage().data_ptr(), t.storage_offset(), t.nbytes) if t.device.type != "meta" else id(t)
        if key not in seen:
            seen.add(key)
            total += t.nbytes + per_tensor
    return total


def shard_bytes(tensors, world_size):
    """Bytes of one rank's FSDP2 shards: dim 0 cut in world_size equal pieces (padded); scalars whole."""
    return sum(math.ceil(t.shape[0] / world_size) * (t.numel() // t.shape[0]) * t.element_size() if t.dim()
               else t.element_size() for t in tensors)


def parameter_bytes(model, backend, world_size):
    """(weights, gradients, AdamW's state) bytes on one GPU, from the model's tensors (meta ones will do): the
    tied wte / lm_head weight once, a gradient and two float32 moments per trainable parameter."""
    params = list(model.parameters())
    trainable = [p for p in params if p.requires_grad]
    moments = 2 * sum(p.numel() for p in trainable) * 4
    if backend != "fsdp":
        return nbytes(params), nbytes(trainable), moments  # DDP's buckets are the gradients
    gathered = (nbytes(p for n, p in model.named_parameters() if ".h." not in n)
                + 2 * nbytes(model.transformer.h[0].parameters()))
    return (shard_bytes(params, world_size) + gathered, shard_bytes(trainable, world_size) + gathered,
            math.ceil(moments / world_size))


def saved_bytes(model, x, targets, autocast):
    """{"block", "rest", "input"}: bytes of the storages autograd keeps in one forward of (x, targets), by whether
    the first block or the rest saved them first, and the first block's input (what a checkpointed block keeps)."""
    params = {p.untyped_storage().data_ptr() for p in model.parameters()}
    kept, owner, where, inputs = {}, {}, ["rest"], []

    def pack(tensor):  # held in `kept`, so no storage is freed and its address reused while counting
        ptr = tensor.untyped_storage().data_ptr()
        if ptr not in kept:
            kept[ptr], owner[ptr] = tensor, where[0]
        return ptr

    def unpack(ptr):
        raise RuntimeError("saved_bytes counts a forward pass; it cannot run backward")

    def enter(_, args):
        where[0] = "block"
        inputs.append(args[0].nbytes)

    block = model.transformer.h[0]
    hooks = [block.register_forward_pre_hook(enter),
             block.register_forward_hook(lambda *_: where.__setitem__(0, "rest"))]
    try:
        with torch.autograd.graph.saved_tensors_hooks(pack, unpack), autocast:
            model(x, targets)
    finally:
        for hook in hooks:
            hook.remove()
    totals = {"block": 0, "rest": 0, "input": inputs[0]}
    for ptr, tensor in kept.items():
        if ptr not in params:
            totals[owner[ptr]] += tensor.untyped_storage().nbytes()
    kept.clear()  # the graph holds `pack`, which holds `kept`: a cycle through C++ that gc cannot free
    return totals


@dataclass(frozen=True)
class ActivationRates:
    """What autograd keeps for backward: a block's bytes whatever the tokens (autocast's 16-bit copies of its
    weights) and per token, the rest's (embeddings, ln_f, lm_head: the copy of the tied wte) whatever the tokens,
    per token and per target, and a block's input per token (what a checkpointed block keeps)."""
    block_fixed: float
    block: float
    rest_fixed: float
    rest: float
    target: float
    block_input: float

    def bytes(self, rows, length, targets, n_layer, checkpointing):
        tokens = rows * length
        rest = self.rest_fixed + tokens * self.rest + targets * self.target
        one_block = self.block_fixed + tokens * self.block
        if checkpointing:  # each block keeps its input; backward recomputes one block at a time
            return rest + tokens * n_layer * self.block_input + one_block
        return rest + n_layer * one_block

    @classmethod
    def measure(cls, config, lora_settings, dtype):
        """The rates of a model like `config` (with lora_settings' adapters) trained in `dtype`, from three probes
        on the CPU: two lengths with one target, and every position a target."""
        torch.manual_seed(0)
        one = GPT(GPTConfig(**{**asdict(config), "n_layer": 1, "block_size": PROBE_TOKENS}))
        if lora_settings["lora_rank"]:
            lora.cast_base(lora.add_adapters(one, **lora_settings), dtype)
        one.train()
        autocast = torch.autocast("cpu", dtype=dtype, enabled=dtype != torch.float32)

        def probe(length, every):
            x = torch.randint(0, config.vocab_size, (1, length))
            y = x.clone() if every else torch.full_like(x, -1)
            y[0, -1] = x[0, -1]
            return saved_bytes(one, x, Targets.of(y), autocast)
        half = PROBE_TOKENS // 2
        short, long, targets = probe(half, False), probe(PROBE_TOKENS, False), probe(PROBE_TOKENS, True)
        block, rest = (long["block"] - short["block"]) / half, (long["rest"] - short["rest"]) / half
        return cls(block_fixed=long["block"] - PROBE_TOKENS * block, block=block,
                   rest_fixed=long["rest"] - PROBE_TOKENS * rest, rest=rest,
                   target=(targets["rest"] - long["rest"]) / (PROBE_TOKENS - 1),
                   block_input=long["input"] / PROBE_TOKENS)


@dataclass(frozen=True)
class Plan:
    """Bytes on one GPU: the training step's parts, the evaluation's peak and the save's."""
    weights: int
    grads: int
    optimizer: int
    activations: int
    evaluation: int
    save: int

    @property
    def training(self):
        return self.weights + self.grads + self.optimizer + self.activations

    @property
    def peak(self):
        return max(self.training, self.evaluation, self.save)

    def describe(self):
        return (f"training {self.training / 2**30:.1f} GiB, evaluation {self.evaluation / 2**30:.1f}, save "
                f"{self.save / 2**30:.1f}")


@dataclass(frozen=True)
class Workload:
    """What a plan needs of a run: its model (meta tensors will do), settings, processes, the dtype it trains and
    decodes in, and its longest training row, the most targets a row has, and its longest prompt (tokens)."""
    model: torch.nn.Module
    cfg: object
    backend: str
    world_size: int
    dtype: torch.dtype
    longest_row: int
    most_targets: int
    longest_prompt: int


def plan(run, rows, rates, budget):
    """The Plan of `run` at micro-batches of `rows` (each as long as its longest row), on a GPU whose plan may fill
    `budget` bytes (generation takes half of what the rest leaves, as generation_memory sizes it)."""
    cfg, model = run.cfg, run.model
    weights, grads, optimizer = parameter_bytes(model, run.backend, run.world_size)
    activations = rates.bytes(rows, run.longest_row, rows * run.most_targets, model.config.n_layer,
                              cfg.gradient_checkpointing)
    full = nbytes(model.parameters())
    plain = run.backend != "fsdp" and not cfg.lora_rank and run.dtype == torch.float32
    named = dict(model.named_parameters())  # tied weights once
    copy = 0 if plain else (sum(p.numel() for n, p in named.items() if ".lora_" not in n) * run.dtype.itemsize
                            + (full if run.backend == "fsdp" else 0))
    held = weights + optimizer + copy
    room = cfg.gen_memory_gb * 2**30 or max(budget - held, 0) / 2
    batch, kv, logits = decoding_bytes(cfg, model.config, run.dtype, min(cfg.rouge_samples, cfg.gen_batch_size),
                                       run.longest_prompt, room)
    evaluation = held + kv + logits if batch else weights + optimizer
    # a LoRA save's merge at its peak: the weight merged last, B @ A and its scaled copy (or the merged weight), float32
    merging = 3 * 4 * max((p.numel() for n, p in named.items() if ".base_layer." in n), default=0)
    return Plan(weights, grads, optimizer, activations, evaluation, weights + optimizer + merging)


def decoding_bytes(cfg, model_config, dtype, prompts, prompt_tokens, room):
    """(prompts, KV cache bytes, logits bytes) of the first generation batch of `prompts` prompts of `prompt_tokens`
    tokens in batches of `room` bytes (as generation_batches forms them)."""
    kv, logits = dialogue_bytes(part(cfg, Decoding), prompt_tokens, model_config, dtype)
    batch = min(prompts, cfg.gen_batch_size, max(1, int(room // (kv + logits)))) if prompts else 0
    return batch, batch * kv, batch * logits


def device_memory(device):
    """Bytes a plan may fill on `device`: HEADROOM of a GPU's free memory, CPU_SHARE of what the host leaves."""
    if device.type == "cuda":
        return int(torch.cuda.mem_get_info(device)[0] * HEADROOM)
    return int(host_memory() * CPU_SHARE)


def host_memory():
    """Bytes this process may still take on the host: its available memory (free, and the page cache the kernel
    drops on demand), at most what RLIMIT_AS (`ulimit -v`) and its container's cgroup (CGROUP_FILES) leave."""
    meminfo = dict(line.split(":") for line in Path("/proc/meminfo").read_text().splitlines())
    left = [int(meminfo["MemAvailable"].split()[0]) * 1024]  # kB
    if (address_space := resource.getrlimit(resource.RLIMIT_AS)[0]) != resource.RLIM_INFINITY:
        left.append(address_space - int(Path("/proc/self/statm").read_text().split()[0]) * os.sysconf("SC_PAGE_SIZE"))
    for limit, usage in CGROUP_FILES:
        with contextlib.suppress(OSError, ValueError):  # no such cgroup, or no limit (memory.max: "max")
            left.append(int(Path(limit).read_text()) - int(Path(usage).read_text()))
    return max(min(left), 0)


def choose_micro_batch(cfg, rt, model, train_set, val_set):
    """micro_batch_size=auto: (the rows every rank's micro-batches take, the words for the start line), from the
    plan of this run on the smallest budget of its ranks (device_memory)."""
    budget = min(rt.all_gather_objects(device_memory(rt.device)))
    dtype = getattr(torch, rt.dtype)
    run = Workload(model, cfg, rt.backend, rt.world_size, dtype, longest_row=int(train_set.lengths.max()),
              most_targets=int(train_set.target_counts(cfg.train_on_prompt).max()),
              longest_prompt=int(val_set.prompt_lens.max()) if len(val_set) else 0)
    rows, chosen = largest_micro_batch(run, budget, ActivationRates.measure(model.config, lora.settings(cfg), dtype))
    words = (f"micro_batch_size=auto: {rows} (the plan's peak {chosen.peak / 2**30:.1f} of {budget / 2**30:.1f} GiB "
             f"usable: {chosen.describe()})")
    if chosen.peak > budget:
        words += ("; warning: even one row does not fit the plan: lower block_size, or set --gradient_checkpointing="
                  "True, --lora_rank=8 or --backend=fsdp")
    return rows, words


def largest_micro_batch(run, budget, rates):
    """(rows, its Plan): the largest micro-batch, up to a rank's rows per step, whose plan fits `budget` bytes; the
    smallest, 1, when none does."""
    fitting = [rows for rows in range(1, rows_per_rank(run.cfg.batch_size, run.world_size) + 1)
               if plan(run, rows, rates, budget).peak <= budget]
    rows = fitting[-1] if fitting else 1
    return rows, plan(run, rows, rates, budget)


def reduce_once_bytes(model, world_size, dtype):
    """(held, kept): bytes per rank that reducing gradients once per optimizer step holds between FSDP's
    micro-steps (every weight gathered in `dtype`, an fp32 gradient per trainable parameter), and what FSDP keeps
    anyway (its shards of the fp32 weights and gradients, and AdamW's two moments), from the unsharded model."""
    params = list(model.parameters())  # tied weights once
    gradients = nbytes(p for p in params if p.requires_grad)  # fp32 like the weights, and each AdamW moment
    held = sum(p.numel() for p in params) * dtype.itemsize + gradients
    return held, (nbytes(params) + 3 * gradients) / world_size


# ---- a generation's batches -----------------------------------------------------------------------------------

CPU_GEN_MEMORY_GB = 2.0  # gen_memory_gb=0 on a CPU


def generation_memory(cfg, device):
    """Bytes the KV cache and logits of one generate() call may take: gen_memory_gb, else half the GPU's free memory
    (counting what the caching allocator holds unused), else CPU_GEN_MEMORY_GB; never more than the device has
    left (on a CPU: host_memory)."""
    if device.type == "cuda":
        cached = torch.cuda.memory_reserved(device) - torch.cuda.memory_allocated(device)
        left = torch.cuda.mem_get_info(device)[0] + cached
        return min(cfg.gen_memory_gb * 2**30 or left / 2, left)
    return min(cfg.gen_memory_gb * 2**30 or CPU_GEN_MEMORY_GB * 2**30, host_memory())


def cache_slots_per_prompt(decoding, prompt_tokens, block_size):
    """KV-cache slots (one token's keys and values in every layer) that one prompt of P tokens holds at the peak of
    generate(), M new tokens after it. Plain greedy: its static cache (greedy_slots) twice (the copy that drops
    ended rows, or CUDA graphs' buffers). Else the prefill's P, shared by the prompt's rows (beams, samples, MBR's
    candidate; 1 for greedy with processors), and their M own slots each, all twice at a copy (dropping ended
    prompts, reordering beams). MBR's candidate decodes before its samples, over the same prefill."""
    d, P, M = decoding, prompt_tokens, decoding.max_new_tokens
    if plain_greedy(d) and not d.mbr_samples:
        return 2 * greedy_slots(P, M, block_size)
    return 2 * (P + max(d.num_beams, d.mbr_samples) * M)


def kv_cache_bytes(model_config, slots, dtype):
    return 2 * model_config.n_layer * model_config.n_embd * slots * dtype.itemsize


def dialogue_bytes(decoding, prompt_tokens, model_config, dtype):
    """(KV cache bytes, logits bytes) that one dialogue of `prompt_tokens` tokens holds at the peak of generate()."""
    slots = cache_slots_per_prompt(decoding, prompt_tokens, model_config.block_size)
    rows = max(decoding.num_beams, decoding.mbr_samples, 1)
    return kv_cache_bytes(model_config, slots, dtype), LOGITS_COPIES * rows * model_config.vocab_size * 4


def check_one_dialogue(decoding, prompt_tokens, model_config, memory, dtype):
    """UserError, before any allocation, where one dialogue of `prompt_tokens` tokens does not fit `memory` bytes,
    naming the setting that multiplies what it holds and the largest value of it that fits."""
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
    """This rank's (every world_size-th) batches of prompt indices, length-sorted (left padding stays small): at most
    batch_size prompts whose KV caches and logits fit `memory` bytes; UserError where the longest prompt alone does
    not (check_one_dialogue)."""
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
