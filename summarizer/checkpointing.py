"""The training run's checkpoints: ckpt.pt (everything resuming needs) after every evaluation, best.pt when the
configured metric improved, and restoring a run from ckpt.pt. `trainer` is train.Trainer: its model, optimizer,
scaler, schedule and counters are the state saved and restored."""
import math
import os
import sys
from dataclasses import asdict

import data
from config import AdamW, keys
from summarizer import lora
from summarizer.budget import save_problem
from summarizer.checkpoint import keep_best_of_metric, save_checkpoint
from summarizer.errors import UserError
from summarizer.schedule import describe_schedule, resumed_schedule
from summarizer.tracking import drop_rows_after
from summarizer.training import apply_hyperparameters, resume_path, rng_state, set_rng_state


def checkpoint(trainer, stats):
    """After an evaluation: ckpt.pt, and best.pt when the configured metric improved; diverged weights are not
    worth resuming from, so a non-finite val_loss keeps the previous checkpoints."""
    cfg = trainer.cfg
    if not math.isfinite(stats["val_loss"]):
        if trainer.rt.is_main:
            print(f"warning: val_loss is {stats['val_loss']} at iter {trainer.iter_num}; keeping the previous "
                  f"checkpoints", file=sys.stderr)
        return
    score, best = stats[cfg.best_metric], trainer.best_score
    improved = math.isfinite(score) and (best is None or (score < best if cfg.best_metric == "val_loss"
                                                          else score > best))
    if improved:
        trainer.best_score = score
    save(trainer, stats, best=improved)


def save(trainer, stats, best):
    """Rank 0 writes ckpt.pt, and with `best` best.pt (weights, config, metrics); the others wait. A LoRA run's
    ckpt.pt keeps its adapters and where its base comes from; its best.pt the merged weights."""
    cfg, rt = trainer.cfg, trainer.rt
    rng = rt.all_gather_objects(rng_state())
    model_state, optimizer_state = rt.parallel.training_state(trainer.model, trainer.optimizer)
    writes = []
    if rt.is_main:
        weights = {"model_args": asdict(trainer.model.config), "iter_num": trainer.iter_num,
                   "best_metric": cfg.best_metric, "best_score": trainer.best_score, "config": asdict(cfg),
                   "metrics": {k: v for k, v in stats.items() if isinstance(v, float)},
                   "tokenizer": data.TOKENIZER_ID, "train_rows": trainer.train_rows,
                   "validation_digest": trainer.val_set.digest}
        trained = ({"model": lora.adapter_state_dict(model_state), "lora_base": trainer.lora_base}
                   if trainer.lora_base else {"model": model_state})
        writes.append((os.path.join(cfg.out_dir, "ckpt.pt"),
                       {**weights, **trained, "optimizer": optimizer_state, "scaler": trainer.scaler.state_dict(),
                        "rng": rng, "schedule": trainer.schedule, "skipped_steps": trainer.skipped,
                        "candidates": trainer.candidates_key}))
        if best:
            merged = lora.merged_state_dict(model_state, **lora.settings(cfg)) if cfg.lora_rank else model_state
            writes.append((os.path.join(cfg.out_dir, "best.pt"), {**weights, "model": merged}))
    rt.stop_if(save_problem(writes, trainer.iter_num) if rt.is_main else None)
    for path, state in writes:
        save_checkpoint(state, path)
    rt.barrier()


def restore(trainer, ckpt):
    """Continue the checkpoint's run: its optimizer, scaler, step, best score, RNG and LR schedule, with the
    hyperparameters this run's config changed applied. Returns the lines that say so."""
    cfg, rt, saved, path = trainer.cfg, trainer.rt, ckpt["config"], resume_path(trainer.cfg)
    if ckpt["iter_num"] >= cfg.max_iters:
        raise UserError(f"{path} is at iter {ckpt['iter_num']} and max_iters={cfg.max_iters}: nothing to train; "
                        f"continue with --max_iters above {ckpt['iter_num']}")
    rt.parallel.load_optimizer_state(trainer.model, trainer.optimizer, ckpt["optimizer"], path)
    apply_hyperparameters(trainer.optimizer, cfg)
    if ckpt["scaler"]:  # {} from a run without fp16
        trainer.scaler.load_state_dict(ckpt["scaler"])
    trainer.iter_num = ckpt["iter_num"]
    trainer.skipped = ckpt["skipped_steps"]
    if rt.rank < len(ckpt["rng"]):  # a rank the saved run did not have keeps its fresh seed
        set_rng_state(ckpt["rng"][rt.rank])
    trainer.schedule = resumed_schedule(ckpt["schedule"], saved, cfg, trainer.iter_num)
    notes = [f"resuming {path} at iter {trainer.iter_num}; "
             + describe_schedule(trainer.schedule, trainer.iter_num, cfg.max_iters)]
    if rt.is_main:
        dropped = drop_rows_after(os.path.join(cfg.out_dir, "metrics.jsonl"), trainer.iter_num)
        if dropped:
            notes.append(f"metrics.jsonl: {dropped} row(s) logged after iter {trainer.iter_num} were dropped; "
                         f"those steps run and are logged again")
    if ckpt["best_metric"] == cfg.best_metric:
        trainer.best_score = ckpt["best_score"]
    else:
        kept = keep_best_of_metric(cfg.out_dir, ckpt["best_metric"]) if rt.is_main else None
        notes.append(f"best_metric is now {cfg.best_metric} (was {ckpt['best_metric']}): best.pt follows "
                     f"{cfg.best_metric} from the next evaluation on"
                     + (f"; the best by {ckpt['best_metric']} is kept as {kept}" if kept else ""))
    changed = [f"{k} {saved[k]!r} -> {getattr(cfg, k)!r}" for k in (*keys(AdamW), "dropout", "grad_clip")
               if saved[k] != getattr(cfg, k)]
    if changed:
        notes.append(f"changed since the checkpoint, applied from iter {trainer.iter_num}: {', '.join(changed)}")
    return notes
