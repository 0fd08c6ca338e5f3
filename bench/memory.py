"""python -m bench --section=memory: GiB per GPU to fine-tune each GPT-2 size in each mode, and whether it fits a T4:
summarizer/memory.py's plan (the one micro_batch_size=auto chooses by) asked as a run asks it, at the longest
micro-batch of a SAMSum epoch. --memory_measured also measures whole-depth activations beside the plan's figure.
"""
import dataclasses
import os

import torch

import data
from bench import GIB, PRESETS, ROOT
from config import PROMPT_TEMPLATE, Config, load_config
from model import GPT, PRETRAINED, GPTConfig, Targets
from summarizer import lora, memory

T4_USABLE_GIB = 15.0
MICRO_BATCH = 8
FALLBACK_LENGTH = 1024  # no SAMSum file: assume the worst micro-batch, every row at block_size
LORA_RANK = 8
MODES = ("full", "full+checkpointing", "lora+checkpointing", "fsdp2+checkpointing")
FSDP_RANKS = 2


def longest_micro_batch(csv_path, micro_batch_size):
    """(x, y, description): csv_path's micro_batch_size longest rows, or block_size-wide random ones without it."""
    if not os.path.exists(csv_path):
        x = torch.randint(0, data.EOT_ID, (micro_batch_size, FALLBACK_LENGTH))
        y = torch.full_like(x, -1)
        y[:, -77:] = x[:, -77:]  # SAMSum's longest summary is 76 tokens, + EOS
        return x, y, f"fallback {micro_batch_size} x {FALLBACK_LENGTH} (no {csv_path})"
    cfg = Config(train_csv=csv_path, micro_batch_size=micro_batch_size)
    table = data.read_table(csv_path, "train_csv", cfg)
    examples = data.Examples.from_rows(table, data.tokenize_table(
        table, data.prompt_format(PROMPT_TEMPLATE, cfg.block_size, cfg.max_new_tokens), cfg.block_size),
                                       list(range(len(table.ids))))
    widest = examples.lengths.argsort(kind="stable")[-micro_batch_size:]  # the most positions a micro-batch holds
    x, y = data.collate(examples, widest)
    return x, y, f"SAMSum validation ({len(examples)} rows): its {x.shape[0]} longest rows, {x.shape[0]} x {x.shape[1]}"


def build(shape, device, cfg=None):
    """A GPT of `shape` on `device`, with cfg's LoRA adapters if it has them."""
    with torch.device(device):
        model = GPT(GPTConfig(**shape))
    return lora.add_adapters(model, **lora.settings(cfg)) if cfg and cfg.lora_rank else model


def planned_run(name, cfg, backend, world_size, longest_row, most_targets, longest_prompt):
    """(memory.Workload, its ActivationRates) of gpt2 model `name` (meta tensors) trained under `cfg` in fp16."""
    model = build(PRETRAINED[name], "meta", cfg)
    if backend != "fsdp":  # as train.py's prepare: a LoRA run's frozen base in the compute dtype
        lora.cast_base(model, torch.float16)
    run = memory.Workload(model, cfg, backend, world_size, torch.float16, longest_row, most_targets, longest_prompt)
    return run, memory.ActivationRates.measure(model.config, lora.settings(cfg), torch.float16)


def mode_plan(name, mode, x, y, preset, prompt_tokens):
    """(memory.plan's Plan, its ActivationRates) of gpt2 model `name` trained in `mode` on micro-batch (x, y), on a
    T4's usable memory, at `preset`'s decoding for prompts of `prompt_tokens` tokens."""
    rows, fsdp = x.shape[0], mode.startswith("fsdp2")
    cfg = dataclasses.replace(preset, lora_rank=LORA_RANK if mode.startswith("lora") else 0, micro_batch_size=rows,
                              batch_size=rows, gradient_checkpointing=mode.endswith("checkpointing"))
    run, rates = planned_run(name, cfg, "fsdp" if fsdp else "none", FSDP_RANKS if fsdp else 1, x.shape[1],
                             int((y >= 0).sum(1).max()), prompt_tokens)
    return memory.plan(run, rows, rates, T4_USABLE_GIB * GIB), rates


def measured_activation_bytes(shape, x, y, one_block):
    """{mode: bytes} autograd keeps in a fp16-autocast forward of whole-depth models (+ `one_block`'s recompute)."""
    torch.manual_seed(0)
    model = build(shape, "cpu")
    autocast = torch.autocast("cpu", dtype=torch.float16)
    saved = memory.saved_bytes(model, x, Targets.of(y), autocast)
    result = {"full": saved["block"] + saved["rest"]}
    model.gradient_checkpointing = True
    saved = memory.saved_bytes(model, x, Targets.of(y), autocast)
    result["full+checkpointing"] = saved["block"] + saved["rest"] + one_block
    return result


def t4_micro_batch(name, preset):
    """A preset's micro_batch_size, or for auto the plan's on FSDP_RANKS T4s at rows of block_size (the worst)."""
    cfg = Config(**preset)
    if cfg.micro_batch_size != "auto":
        return cfg.micro_batch_size
    run, rates = planned_run(name, cfg, "fsdp" if cfg.backend == "fsdp" else "ddp", FSDP_RANKS, cfg.block_size,
                             cfg.max_new_tokens, cfg.block_size - cfg.max_new_tokens)
    return memory.largest_micro_batch(run, T4_USABLE_GIB * GIB * memory.HEADROOM, rates)[0]


def bench_memory(args, samsum_csv):
    x, y, batch = longest_micro_batch(samsum_csv, args.memory_micro_batch)
    preset = load_config([os.path.join(ROOT, PRESETS["gpt2"])])  # the evaluation's decoding during training
    length = longest_prompt(samsum_csv, preset)
    rows = []
    for name in args.memory_models.split(","):
        plans = {mode: mode_plan(name, mode, x, y, preset, length) for mode in MODES}
        measured = {}
        if name in args.memory_measured.split(","):
            rates = plans["full"][1]
            measured = measured_activation_bytes(PRETRAINED[name], x, y, rates.block_fixed + x.numel() * rates.block)
        for mode, (plan, _) in plans.items():
            row = dict(section="memory", figure=f"{name}:{mode}:gib_per_rank", value=plan.training / GIB,
                       weights_gib=plan.weights / GIB, grads_gib=plan.grads / GIB, optimizer_gib=plan.optimizer / GIB,
                       activations_gib=plan.activations / GIB, evaluation_gib=plan.evaluation / GIB,
                       save_gib=plan.save / GIB, peak_gib=plan.peak / GIB, fits_t4=plan.peak <= T4_USABLE_GIB * GIB)
            if mode in measured:
                row["measured_activations_gib"] = measured[mode] / GIB
            rows.append(row)
    rows += generation_rows(samsum_csv)
    rows.append(dict(section="memory", figure="setup", value=f"{batch}, fp16 autocast on CPU, AdamW, LoRA rank "
                     f"{LORA_RANK} on attn.c_attn/attn.c_proj/mlp.c_fc/mlp.c_proj, FSDP2 on {FSDP_RANKS} ranks; "
                     f"fits = total <= {T4_USABLE_GIB} GiB (T4)"))
    return rows


# ---- generation: weights, KV cache and logits of one generate() call on a T4 --------------------------------------

DECODINGS = {"greedy": dict(), "beam4": dict(num_beams=4),
             "mbr16": dict(temperature=0.7, mbr_samples=16, mbr_include_beam=True)}


def longest_prompt(csv_path, cfg):
    """Tokens of the longest prompt of csv_path's dialogues, or the most a prompt may have without the file."""
    budget = cfg.block_size - cfg.max_new_tokens
    if not os.path.exists(csv_path):
        return budget
    fmt = data.prompt_format(cfg.prompt_template, cfg.block_size, cfg.max_new_tokens)
    return max(len(fmt.encode(d)[0]) for d in data.read_table(csv_path, "validation_csv", cfg).dialogues)


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
        length = longest_prompt(samsum_csv, base)
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
