"""The rules a Config follows: each value alone (its choices, its range) and the values that must agree with each
other. Config() checks them as it is made, so a mistake stops as one `error: ...` line naming the key."""
import re
from dataclasses import fields

from config import LOG_DESTINATIONS, LORA_TARGETS, Decoding, part
from summarizer.command_line import BOOL_FORMS, lora_target_list, parse_duration, parse_sweep
from summarizer.errors import UserError


def check(cfg):
    """Raise UserError naming the first key whose value cannot work."""
    check_ranges(cfg)
    check_combinations(cfg)


def check_ranges(cfg):
    """Each value alone: among its choices, in its range."""
    for f in fields(cfg):
        choices = f.metadata["choices"]
        if choices and getattr(cfg, f.name) not in choices:
            yes_no = f" (True and False also as {BOOL_FORMS})" if True in choices else ""
            raise UserError(f"{f.name}={getattr(cfg, f.name)!r} is not one of {', '.join(map(str, choices))}{yes_no}")
    positive = ("batch_size", "micro_batch_size", "n_layer", "n_head", "n_embd", "block_size", "eval_interval",
                "log_interval", "max_new_tokens", "num_beams", "gen_batch_size", "dist_timeout", "max_iters",
                "learning_rate", "lora_alpha")
    non_negative = ("warmup_iters", "lr_decay_iters", "eval_val_batches", "rouge_samples", "top_k",
                    "no_repeat_ngram_size", "split_seed", "seed", "min_lr", "weight_decay", "grad_clip",
                    "temperature", "mbr_samples", "lora_rank", "rank_weight", "rank_margin", "rank_length_exponent")
    for name in positive:
        if getattr(cfg, name) <= 0:
            raise UserError(f"{name}={getattr(cfg, name)} must be > 0")
    for name in non_negative:
        if getattr(cfg, name) < 0:
            raise UserError(f"{name}={getattr(cfg, name)} must be >= 0")
    for name in ("val_fraction", "dropout", "beta1", "beta2", "lora_dropout", "epsilon"):
        if not 0 <= getattr(cfg, name) < 1:
            raise UserError(f"{name}={getattr(cfg, name)} must be in [0, 1)")
    parse_duration(cfg.max_time)
    if cfg.rank_candidates < 2:
        raise UserError(f"rank_candidates={cfg.rank_candidates} must be >= 2: the ranking loss compares candidates")
    if cfg.gen_memory_gb < 0:
        raise UserError(f"gen_memory_gb={cfg.gen_memory_gb} must be >= 0 (0 = auto)")
    for target in lora_target_list(cfg.lora_targets) or [""]:
        if target not in LORA_TARGETS:
            raise UserError(f"lora_targets={cfg.lora_targets!r}: {target!r} is not one of {', '.join(LORA_TARGETS)} "
                            f"(give one or more, comma-separated)")
    if not 0 < cfg.top_p <= 1:
        raise UserError(f"top_p={cfg.top_p} must be in (0, 1]")
    if cfg.repetition_penalty <= 0:
        raise UserError(f"repetition_penalty={cfg.repetition_penalty} must be > 0 (1.0 = off)")


def check_combinations(cfg):
    """Values that must agree with each other, and the texts that are parsed."""
    unknown = [d for d in cfg.log_to.split(",") if d and d not in LOG_DESTINATIONS]
    if unknown:
        raise UserError(f"log_to={cfg.log_to!r}: {unknown[0]!r} is not one of {', '.join(LOG_DESTINATIONS)} "
                        f"(comma-separated, no spaces)")
    if not re.fullmatch(r"auto|cpu|cuda(:\d+)?", cfg.device):
        raise UserError(f"device={cfg.device!r} is not one of auto, cpu, cuda, cuda:N")
    if cfg.n_embd % cfg.n_head:
        raise UserError(f"n_embd={cfg.n_embd} is not a multiple of n_head={cfg.n_head}")
    if cfg.block_size % 8:
        raise UserError(f"block_size={cfg.block_size} must be a multiple of 8 (batches are padded to multiples of 8)")
    grad_accum_steps(cfg, world_size=1)
    if contradiction := part(cfg, Decoding).contradiction():
        raise UserError(contradiction)
    parse_sweep(cfg.sweep)
    if cfg.best_metric == "rougeL" and cfg.rouge_samples == 0:
        raise UserError("best_metric='rougeL' needs rouge_samples > 0 (or use best_metric='val_loss')")
    try:
        ok = cfg.prompt_template.count("{dialogue}") == 1 and cfg.prompt_template.format(dialogue="") is not None
    except (KeyError, IndexError, ValueError):
        ok = False
    if not ok:
        raise UserError(f"prompt_template={cfg.prompt_template!r} must contain {{dialogue}} exactly once and no "
                        f"other braces (write {{{{ and }}}} for literal ones)")


def grad_accum_steps(cfg, world_size):
    """Micro-batches each rank runs per optimizer step so that all ranks together process batch_size sequences;
    UserError when batch_size does not split so (checked with world_size=1 as every Config is made)."""
    per_pass = cfg.micro_batch_size * world_size
    if cfg.batch_size % per_pass == 0:
        return cfg.batch_size // per_pass
    if world_size == 1:
        raise UserError(f"batch_size={cfg.batch_size} is not a multiple of micro_batch_size={cfg.micro_batch_size}")
    raise UserError(f"batch_size={cfg.batch_size} is not a multiple of micro_batch_size * world_size = "
                    f"{cfg.micro_batch_size} * {world_size} = {per_pass}: set --batch_size to a multiple of "
                    f"{per_pass} or --micro_batch_size so that micro_batch_size * {world_size} divides "
                    f"{cfg.batch_size}")
