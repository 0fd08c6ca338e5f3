"""python -m bench --section=memory: GiB per GPU to fine-tune each GPT-2 size in each mode, and whether it fits a T4.

Weights, gradients and optimizer state are the bytes of real tensors: the model of each shape is built on the meta
device (no memory), with LoRA adapters where the mode has them, given a gradient per trainable parameter, and
stepped once by AdamW, whose state is then counted. FSDP2 shards every parameter on dim 0 (padded to a multiple
of the world size); a rank also holds, while it computes, the all-gathered fp32 root unit (embeddings, ln_f),
two all-gathered blocks (the one computing and the one prefetched) and their unsharded gradients.

Activations are measured: a forward pass of the longest micro-batch of a SAMSum epoch under fp16 autocast on the
CPU, with torch.autograd.graph.saved_tensors_hooks counting the bytes of every distinct storage autograd keeps
for backward (parameters excluded; autocast's fp16 weight copies included, as they are kept too). It runs on a
one-block model of the real width, and each storage is credited to the block or to the rest (embeddings, ln_f,
lm_head, the loss) by who saved it first; the total is rest + n_layer x block (a 1- vs 2-block difference gives
the same figures, and so does the whole-depth gpt2, --memory_measured). With gradient checkpointing autograd
keeps each block's input only, and backward recomputes one block at a time, so one block's activations are
added. Not counted: backward's transient buffers, DDP's gradient buckets and the CUDA context. On CPU, like on a
T4, scaled_dot_product_attention keeps O(T) state (no T x T attention matrix).
"""
import dataclasses
import glob
import math
import os

import torch

import data
from bench import ROOT
from config import PROMPT_TEMPLATE, Config, Decoding, load_config, part
from model import GPT, PRETRAINED, GPTConfig, Targets
from summarizer import inference, lora, memory

GIB = 2**30
T4_USABLE_GIB = 15.0
MICRO_BATCH = 8
FALLBACK_LENGTH = 1024  # no SAMSum file: assume the worst micro-batch, every row at block_size
LORA_RANK = 8
MODES = ("full", "full+checkpointing", "lora+checkpointing", "fsdp2+checkpointing")
FSDP_RANKS = 2


def longest_micro_batch(csv_path, micro_batch_size):
    """(x, y, description): the micro-batch with the most tokens (padding included) that the training sampler
    makes in one epoch of csv_path's rows, or a block_size-wide synthetic one when the file is missing."""
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
    sampler = data.LengthGroupedSampler(examples.lengths, cfg.batch_size, micro_batch_size, cfg.seed)
    steps = math.ceil(len(examples) / cfg.batch_size)
    batches = [indices for step in range(steps) for indices in sampler.micro_batches(step)]
    widest = max(batches, key=lambda indices: int(examples.lengths[indices].max()))
    x, y = data.collate(examples, widest)
    return x, y, f"SAMSum validation ({len(examples)} rows): longest micro-batch {x.shape[0]} x {x.shape[1]}"


def build(shape, n_layer, with_lora, device):
    config = GPTConfig(n_layer=n_layer, n_head=shape["n_head"], n_embd=shape["n_embd"])
    with torch.device(device):
        model = GPT(config)
    if with_lora:
        lora.add_adapters(model, **lora.settings(Config(lora_rank=LORA_RANK)))
    return model


def state_bytes(shape, with_lora):
    """{"single": (weights, gradients, AdamW state), "fsdp2": the same for one of FSDP_RANKS ranks} in bytes,
    counted from the real (meta) tensors of the whole model, as the run's own plan counts them."""
    model = build(shape, shape["n_layer"], with_lora, "meta")
    return {"single": memory.state_bytes(model, "none", 1), "fsdp2": memory.state_bytes(model, "fsdp", FSDP_RANKS)}


def saved_bytes(model, x, y):
    """memory.saved_bytes under fp16 autocast on the CPU."""
    return memory.saved_bytes(model, x, Targets.of(y), torch.autocast("cpu", dtype=torch.float16))


def activation_bytes(shape, x, y):
    """{mode: bytes} of activations for the whole model, from one-block models of the real width: one block's
    bytes x n_layer + the rest. A checkpointed block keeps only its input (the residual stream)."""
    torch.manual_seed(0)
    n = shape["n_layer"]
    full = saved_bytes(build(shape, 1, False, "cpu"), x, y)
    block_lora = saved_bytes(build(shape, 1, True, "cpu"), x, y)["block"]
    checkpointed = full["rest"] + n * full["input"]
    return {"full": full["rest"] + n * full["block"], "full+checkpointing": checkpointed + full["block"],
            "lora+checkpointing": checkpointed + block_lora, "fsdp2+checkpointing": checkpointed + full["block"],
            "block": full["block"]}


def measured_activation_bytes(shape, x, y, blocks):
    """{mode: bytes} from whole-depth models, no extrapolation; the checkpointed mode adds the recompute of one
    block in backward (measured by activation_bytes)."""
    torch.manual_seed(0)
    model = build(shape, shape["n_layer"], False, "cpu")
    saved = saved_bytes(model, x, y)
    result = {"full": saved["block"] + saved["rest"]}
    model.gradient_checkpointing = True
    saved = saved_bytes(model, x, y)
    result["full+checkpointing"] = saved["block"] + saved["rest"] + blocks["block"]
    return result


def per_rank(mode, states, activations):
    """(weights, gradients, optimizer, activations) bytes on one GPU in `mode`."""
    if mode.startswith("fsdp2"):
        return (*states["full"]["fsdp2"], activations[mode])
    return (*states["lora" if mode.startswith("lora") else "full"]["single"], activations[mode])


def after_training(shape, mode, parts, full_weights, preset, length):
    """(evaluation, save) bytes on one GPU after the steps: the ROUGE evaluation holds the weights and AdamW's state
    (gradients freed) and decodes with a KV cache and logits in the half of the free memory generation_memory
    takes (under FSDP from a gathered copy of the `full_weights`, train.rouge_model), at `preset`'s decoding and
    prompts of `length` tokens; a LoRA run's save builds, on rank 0, the merged fp32 copy of every adapted weight
    (W + B @ A)."""
    weights, _, optimizer, _ = parts
    held = weights + optimizer + (full_weights if mode.startswith("fsdp2") else 0)
    config = GPTConfig(n_layer=shape["n_layer"], n_head=shape["n_head"], n_embd=shape["n_embd"])
    room = max(T4_USABLE_GIB * GIB - held, 0) / 2
    prompts = [[0] * length] * min(preset.rouge_samples, preset.gen_batch_size)
    decoding = part(preset, Decoding)
    batch = len(inference.generation_batches(prompts, decoding, preset.gen_batch_size, config, room,
                                             torch.float16)[0])
    kv = inference.kv_cache_bytes(config, batch * inference.cache_rows_per_prompt(decoding),
                                  length + preset.max_new_tokens, torch.float16)
    evaluation = held + kv + memory.LOGITS_COPIES * batch * config.vocab_size * 4
    merged = 0
    if mode.startswith("lora"):
        model = build(shape, shape["n_layer"], True, "meta")
        merged = memory.nbytes(p for n, p in model.named_parameters() if ".base_layer." in n and n.endswith("weight"))
    return evaluation, held + merged


def t4_micro_batch(name, preset):
    """A preset's ({key: value}) micro_batch_size, or for auto the one the run's memory plan chooses on a T4 for
    gpt2 model `name`, rows as long as block_size (the worst a micro-batch can be), on FSDP_RANKS GPUs."""
    cfg = Config(**preset)
    if cfg.micro_batch_size != "auto":
        return cfg.micro_batch_size
    model = build(PRETRAINED[name], PRETRAINED[name]["n_layer"], bool(cfg.lora_rank), "meta")
    run = memory.Run(model, cfg, "fsdp" if cfg.backend == "fsdp" else "ddp", FSDP_RANKS, torch.float16,
                     cfg.block_size, cfg.max_new_tokens, cfg.block_size - cfg.max_new_tokens)
    rates = memory.ActivationRates.measure(model.config, lora.settings(cfg), torch.float16)
    return memory.largest_micro_batch(run, T4_USABLE_GIB * GIB * memory.HEADROOM, rates)[0]


def bench_memory(args, samsum_csv):
    x, y, batch = longest_micro_batch(samsum_csv, args.memory_micro_batch)
    names = args.memory_models.split(",")
    preset = load_config([PRESETS[0]])  # the evaluation's decoding during training
    length = longest_prompt(samsum_csv, preset)
    rows = []
    for name in names:
        shape = dict(PRETRAINED[name])
        states = {"full": state_bytes(shape, False), "lora": state_bytes(shape, True)}
        activations = activation_bytes(shape, x, y)
        measured = (measured_activation_bytes(shape, x, y, activations) if name in args.memory_measured.split(",")
                    else {})
        for mode in MODES:
            parts = per_rank(mode, states, activations)
            total = sum(parts) / GIB
            evaluation, save = after_training(shape, mode, parts, states["full"]["single"][0], preset, length)
            peak = max(total, evaluation / GIB, save / GIB)
            row = dict(section="memory", figure=f"{name}:{mode}:gib_per_rank", value=total,
                       weights_gib=parts[0] / GIB, grads_gib=parts[1] / GIB, optimizer_gib=parts[2] / GIB,
                       activations_gib=parts[3] / GIB, evaluation_gib=evaluation / GIB, save_gib=save / GIB,
                       peak_gib=peak, fits_t4=peak <= T4_USABLE_GIB)
            if mode in measured:
                row["measured_activations_gib"] = measured[mode] / GIB
            rows.append(row)
    rows += generation_rows(samsum_csv)
    rows.append(dict(section="memory", figure="setup", value=f"{batch}, fp16 autocast on CPU, AdamW, LoRA rank "
                     f"{LORA_RANK} on attn.c_attn/attn.c_proj/mlp.c_fc/mlp.c_proj, FSDP2 on {FSDP_RANKS} ranks; "
                     f"fits = total <= {T4_USABLE_GIB} GiB (T4)"))
    return rows


# ---- generation: weights, KV cache and logits of one generate() call on a T4 --------------------------------------

PRESETS = sorted(glob.glob(os.path.join(ROOT, "config", "kaggle_t4x2*.py")))
DECODINGS = {"greedy": dict(), "beam4": dict(num_beams=4),
             "mbr16": dict(temperature=0.7, mbr_samples=16, mbr_include_beam=True)}


def longest_prompt(csv_path, cfg):
    """Tokens of the longest prompt inference makes of csv_path's dialogues (cut to fit), or the most a prompt
    may have (block_size - max_new_tokens) when the file is missing."""
    budget = cfg.block_size - cfg.max_new_tokens
    if not os.path.exists(csv_path):
        return budget
    fmt = data.prompt_format(cfg.prompt_template, cfg.block_size, cfg.max_new_tokens)
    return max(len(fmt.encode(d)[0]) for d in data.read_table(csv_path, "validation_csv", cfg).dialogues)


def generation_rows(samsum_csv):
    """`<model>:generate:<decoding>:gib` at each Kaggle preset's settings: fp16 weights, plus the KV cache and
    logits of a batch of SAMSum's longest prompt, as generation_batches sizes it in the auto budget of a T4 (half
    of what the weights leave free)."""
    rows = []
    for preset in PRESETS:
        base = load_config([preset])
        shape = PRETRAINED[base.init_from]
        config = GPTConfig(n_layer=shape["n_layer"], n_head=shape["n_head"], n_embd=shape["n_embd"])
        weights = memory.nbytes(build(shape, shape["n_layer"], False, "meta").parameters()) // 2  # held in fp16
        room = (T4_USABLE_GIB * GIB - weights) / 2
        length = longest_prompt(samsum_csv, base)
        for decoding, options in DECODINGS.items():
            cfg = dataclasses.replace(base, **options)
            settings = part(cfg, Decoding)
            prompts = [[0] * length] * cfg.gen_batch_size
            batch = len(inference.generation_batches(prompts, settings, cfg.gen_batch_size, config, room,
                                                     torch.float16)[0])
            per_prompt = inference.cache_rows_per_prompt(settings)
            kv = inference.kv_cache_bytes(config, batch * per_prompt, length + cfg.max_new_tokens, torch.float16)
            logits = memory.LOGITS_COPIES * batch * max(cfg.num_beams, cfg.mbr_samples, 1) * config.vocab_size * 4
            total = (weights + kv + logits) / GIB
            rows.append(dict(section="memory", figure=f"{base.init_from}:generate:{decoding}:gib", value=total,
                             weights_gib=weights / GIB, kv_cache_gib=kv / GIB, logits_gib=logits / GIB,
                             prompts_per_batch=batch, gen_batch_size=cfg.gen_batch_size, prompt_tokens=length,
                             preset=os.path.basename(preset), fits_t4=total <= T4_USABLE_GIB))
    return rows
