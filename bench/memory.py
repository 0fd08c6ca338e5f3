"""python -m bench --section=memory: the T4 ledger (summarizer/memory.py, what micro_batch_size=auto chooses by), a
line per Kaggle preset and phase: GiB on one of RANKS T4s at the micro-batch the preset runs (auto: chosen as on a
T4) with SAMSum's longest rows and prompt, against what a T4 leaves; and the host's GiB while loading. Minutes on a
CPU (every phase runs the model's code on fake tensors): each preset says so on stderr as it starts.
"""
import dataclasses
import os

import torch

import data
from bench import GIB, PRESETS, ROOT, progress
from config import Config, load_config
from model import GPT, PRETRAINED, GPTConfig
from summarizer import loading, memory

T4_GIB = 14.74  # a T4's memory as torch.cuda.get_device_properties reports it
# The CUDA context's part of it: torch 2.10 with CUDA 12 and lazy module loading holds 0.3-0.45 GiB on a T4 (issue
# 74's reading of torch.cuda.mem_get_info before and after torch.cuda.init); the upper end.
CUDA_CONTEXT_GIB = 0.45
T4_USABLE_GIB = T4_GIB - CUDA_CONTEXT_GIB
MARGIN_GIB = 0.5  # what every phase must leave of T4_USABLE_GIB: fragmentation, the allocator's rounding
HOST_GIB = 30  # a Kaggle session's host memory
RANKS = 2
FALLBACK_LENGTH = 1024  # no SAMSum file: the worst micro-batch, every row at block_size


def lengths(csv_path, cfg):
    """(the longest row, the most targets a row has, the longest prompt) in tokens of csv_path's dialogues, or the
    most a preset allows without it."""
    if not os.path.exists(csv_path):
        return cfg.block_size, cfg.max_new_tokens + 1, cfg.block_size - cfg.max_new_tokens
    table = data.read_table(csv_path, "train_csv", cfg)
    fmt = data.prompt_format(cfg.prompt_template, cfg.block_size, cfg.max_new_tokens)
    examples = data.Examples.from_rows(table, data.tokenize_table(table, fmt, cfg.block_size),
                                       list(range(len(table.ids))))
    return (int(examples.lengths.max()), int(examples.target_counts(cfg.train_on_prompt).max()),
            max(len(fmt.encode(d)[0]) for d in table.dialogues))


def build(shape, device, cfg=None):
    """A GPT of `shape` on `device`, with cfg's LoRA adapters and checkpointing if it has them."""
    with torch.device(device):
        model = GPT(GPTConfig(**shape))
    model.gradient_checkpointing = bool(cfg and cfg.gradient_checkpointing)
    return loading.add_adapters(model, **loading.lora_settings(cfg)) if cfg and cfg.lora_rank else model


def preset_run(name, cfg, found, ranks=RANKS):
    """The memory.Workload of preset `cfg` for gpt2 model `name` (meta tensors) on `ranks` T4s in fp16, built as
    train.py's prepare builds it; `found`: lengths()."""
    fsdp = cfg.backend == "fsdp"
    model = build(PRETRAINED[name], "meta", cfg)
    if not fsdp:  # a LoRA run's frozen base in the compute dtype
        loading.cast_base(model, torch.float16)
    backend = "fsdp" if fsdp else "ddp" if ranks > 1 else "none"
    return memory.Workload(model, cfg, backend, ranks, torch.float16, *found)


def preset_ledger(name, cfg, csv_path=""):
    """(the micro-batch, memory.Ledger) of preset `cfg` for gpt2 model `name` on RANKS T4s."""
    budget = T4_USABLE_GIB * GIB * memory.HEADROOM
    run, _ = memory.decide_reduce_once(preset_run(name, cfg, lengths(csv_path, cfg)), budget)
    if cfg.micro_batch_size == "auto":
        return memory.largest_micro_batch(run, budget)
    return cfg.micro_batch_size, memory.ledger(run, cfg.micro_batch_size, budget)


def t4_micro_batch(name, preset):
    """A preset's micro_batch_size, or for auto the ledger's on RANKS T4s at rows of block_size (the worst)."""
    return preset_ledger(name, Config(**preset))[0]


def bench_memory(args, samsum_csv):
    rows = []
    for name, path in PRESETS.items():
        progress(f"memory: the ledger of {path} (a minute or more)")
        cfg = load_config([os.path.join(ROOT, path)])
        micro, ledger = preset_ledger(name, cfg, samsum_csv)
        for phase, size in ledger.phases.items():
            rows.append(dict(section="memory", figure=f"{name}:{phase}:gib", value=size / GIB,
                             left_gib=T4_USABLE_GIB - size / GIB, micro_batch_size=micro,
                             fits_t4=size / GIB <= T4_USABLE_GIB - MARGIN_GIB))
        rows.append(dict(section="memory", figure=f"{name}:host:gib", value=ledger.host / GIB,
                         fits_t4=ledger.host / GIB <= HOST_GIB))
    rows += generation_rows(samsum_csv)
    found = "SAMSum validation" if os.path.exists(samsum_csv) else f"no {samsum_csv}: rows of block_size"
    rows.append(dict(section="memory", figure="setup", value=f"{found}; fp16 on {RANKS} ranks; fits = at least "
                     f"{MARGIN_GIB} GiB left of {T4_USABLE_GIB:.2f} (a T4's {T4_GIB} less the CUDA context's "
                     f"{CUDA_CONTEXT_GIB}); host: of {HOST_GIB} GiB"))
    return rows


# ---- generation: weights, KV cache and logits of one generate() call on a T4 --------------------------------------

DECODINGS = {"greedy": dict(), "beam4": dict(num_beams=4),
             "mbr16": dict(temperature=0.7, mbr_samples=16, mbr_include_beam=True)}


def generation_rows(samsum_csv):
    """`<model>:generate:<decoding>:gib` per Kaggle preset: fp16 weights, KV cache and logits of a batch of SAMSum's
    longest prompt as generation_batches sizes it on a T4 (half of what the weights leave free)."""
    rows = []
    for preset in PRESETS.values():
        base = load_config([os.path.join(ROOT, preset)])
        shape = PRETRAINED[base.init_from]
        model = build(shape, "meta")
        weights = memory.nbytes(model.parameters()) // 2  # held in fp16
        room = (T4_USABLE_GIB * GIB - weights) / 2
        length = lengths(samsum_csv, base)[2]
        for decoding, options in DECODINGS.items():
            cfg = dataclasses.replace(base, **options)
            batch, kv, logits = memory.decoding_bytes(cfg, model.config, torch.float16, cfg.gen_batch_size, length,
                                                      room)
            total = (weights + kv + logits) / GIB
            rows.append(dict(section="memory", figure=f"{base.init_from}:generate:{decoding}:gib", value=total,
                             weights_gib=weights / GIB, kv_cache_gib=kv / GIB, logits_gib=logits / GIB,
                             prompts_per_batch=batch, gen_batch_size=cfg.gen_batch_size, prompt_tokens=length,
                             preset=os.path.basename(preset), fits_t4=total <= T4_USABLE_GIB))
    return rows
