"""What ckpt.pt holds of a run in progress and a resume restores; the file's record is summarizer.checkpoint's."""
import math
import os
from dataclasses import asdict, dataclass

import torch

import data
from command_line import UserError
from config import AdamW, keys
from summarizer import run_folder
from summarizer.checkpoint import FORMAT, Record, save_checkpoint, shape_settings
from summarizer.clock import describe_schedule, lr_schedule, resumed_schedule, sessions_done
from summarizer.loading import adapter_state_dict, lora_settings, merged_weights


@dataclass
class TrainingState:
    """`step`: the optimizer steps done (iter_num); the sampler needs no state: a batch is a function of the step."""
    model: torch.nn.Module
    optimizer: torch.optim.Optimizer
    scaler: torch.amp.GradScaler
    schedule: dict
    train_rows: dict
    validation_digest: str
    lora_base: dict | None = None
    base: str | None = None  # None: this run's init_from
    step: int = 0
    best_score: float | None = None
    best_val_loss: float | None = None  # the best evaluation's: it breaks a tie of best_metric
    skipped_steps: int = 0

    @classmethod
    def start(cls, model, cfg, proc, **record):
        """Step 0: AdamW with weight decay on 2-D weights only (not biases, LayerNorms), fused on CUDA."""
        params = [p for p in model.parameters() if p.requires_grad]
        groups = [{"params": [p for p in params if p.dim() >= 2], "weight_decay": cfg.weight_decay},
                  {"params": [p for p in params if p.dim() < 2], "weight_decay": 0.0}]
        optimizer = torch.optim.AdamW(groups, lr=cfg.learning_rate, betas=(cfg.beta1, cfg.beta2),
                                      fused=proc.device.type == "cuda")
        return cls(model, optimizer, torch.amp.GradScaler(proc.device.type, enabled=proc.use_scaler),
                   lr_schedule(asdict(cfg)), **record)

    def improved(self, stats, metric):
        """Whether `stats` beat the best so far by `metric`; a tie of ROUGE (0 early on) goes to the lower val_loss."""
        if metric == "last":
            return True
        score, best = stats[metric], self.best_score
        if not math.isfinite(score) or best is None or metric == "val_loss":
            return math.isfinite(score) and (best is None or score < best)
        best_val_loss = math.inf if self.best_val_loss is None else self.best_val_loss
        return score > best or (score == best and stats["val_loss"] < best_val_loss)

    def save(self, cfg, proc, metrics, best):
        """Rank 0 writes ckpt.pt (and best.pt: a LoRA run's merged); a save the disk cannot hold stops all first."""
        rng = proc.all_gather_objects(rng_state())
        model_state, optimizer_state = proc.parallel.training_state(self.model, self.optimizer)
        writes = []
        if proc.is_main:
            model_args = asdict(self.model.config)
            config = {**asdict(cfg), "init_from": self.base or cfg.init_from, **shape_settings(model_args)}
            record = Record(format=FORMAT, model_args=model_args, config=config,
                            tokenizer=data.TOKENIZER_ID, iter_num=self.step, best_metric=cfg.best_metric,
                            best_score=self.best_score, best_val_loss=self.best_val_loss,
                            metrics={k: v for k, v in metrics.items() if isinstance(v, float)},
                            train_rows=self.train_rows, validation_digest=self.validation_digest, model={})
            trained = ({"model": adapter_state_dict(model_state), "lora_base": self.lora_base}
                       if self.lora_base else {"model": model_state})
            writes.append((os.path.join(cfg.out_dir, run_folder.CKPT),
                           {**record, **trained, "optimizer": optimizer_state,
                            "scaler": self.scaler.state_dict(), "rng": rng, "schedule": self.schedule,
                            "skipped_steps": self.skipped_steps}))
            if best:
                merged = model_state if not cfg.lora_rank else {  # what the merge makes goes to the host at once
                    key: value if value is model_state.get(key) else value.cpu()
                    for key, value in merged_weights(model_state, **lora_settings(cfg))}
                writes.append((os.path.join(cfg.out_dir, run_folder.BEST), {**record, "model": merged}))
        proc.stop_if(run_folder.save_problem(writes, self.step, run_folder.Quota.of(cfg)) if proc.is_main else None)
        for path, state in writes:
            save_checkpoint(state, path)
        proc.barrier()

    def restore(self, ckpt, cfg, proc, path, given=()):
        """Continue the checkpoint's run with this config's changes (`given`: the flags); the lines that say so."""
        saved = ckpt["config"]
        if ckpt["iter_num"] >= cfg.max_iters:
            raise UserError(f"{path} is at iter {ckpt['iter_num']} and max_iters={cfg.max_iters}: nothing to train; "
                            f"continue with --max_iters above {ckpt['iter_num']}")
        if ckpt["train_rows"]["digest"] != self.train_rows["digest"]:
            raise UserError(f"train_csv={cfg.train_csv} holds other rows than {path} was trained on (from "
                            f"{saved['train_csv']}): resume with that CSV, or train on this one in a new run that "
                            f"starts from its weights: --init_from={path} --out_dir=<a new folder>")
        proc.parallel.load_optimizer_state(self.model, self.optimizer, ckpt["optimizer"], path)
        # the optimizer's state dict brings back the saved run's AdamW settings: this run's config decides
        for group, decay in zip(self.optimizer.param_groups, (cfg.weight_decay, 0.0), strict=True):
            group.update(weight_decay=decay, betas=(cfg.beta1, cfg.beta2))
        if ckpt["scaler"]:  # {} from a run without fp16
            self.scaler.load_state_dict(ckpt["scaler"])
        self.step, self.skipped_steps = ckpt["iter_num"], ckpt["skipped_steps"]
        if proc.rank < len(ckpt["rng"]):  # a rank the saved run did not have keeps its fresh seed
            set_rng_state(ckpt["rng"][proc.rank])
        self.schedule = resumed_schedule(ckpt["schedule"], saved, cfg, self.step, given)
        notes = [f"resuming {path} at iter {self.step}; "
                 + describe_schedule(self.schedule, self.step, cfg.max_iters, cfg.learning_rate,
                                     cfg.max_time is not None and sessions_done(self.schedule) + 1 >= cfg.sessions)]
        if ckpt["best_metric"] == cfg.best_metric:
            self.best_score, self.best_val_loss = ckpt["best_score"], ckpt["best_val_loss"]
        else:
            kept = run_folder.keep_best_of_metric(cfg.out_dir, ckpt["best_metric"]) if proc.is_main else None
            notes.append(f"best_metric is now {cfg.best_metric} (was {ckpt['best_metric']}): best.pt follows "
                         f"{cfg.best_metric} from the next evaluation on"
                         + (f"; the best by {ckpt['best_metric']} is kept as {kept}" if kept else ""))
        if ckpt["validation_digest"] != self.validation_digest:
            notes.append(f"note: the validation rows are not those of {path}: best.pt's {cfg.best_metric} so far was "
                         f"measured on the others, so a later best.pt is chosen by another yardstick")
        if changed := [f"{k} {saved[k]!r} -> {getattr(cfg, k)!r}" for k in (*keys(AdamW), "dropout", "grad_clip")
                       if saved[k] != getattr(cfg, k)]:
            notes.append(f"changed since the checkpoint, applied from iter {self.step}: {', '.join(changed)}")
        return notes


def rng_state():
    """This process's torch RNG (dropout); the data order needs none."""
    state = {"torch": torch.get_rng_state()}
    if torch.cuda.is_available() and torch.cuda.is_initialized():
        state["cuda"] = torch.cuda.get_rng_state()
    return state


def set_rng_state(state):
    torch.set_rng_state(state["torch"])
    if "cuda" in state and torch.cuda.is_available():
        torch.cuda.set_rng_state(state["cuda"])


def rng_restored():
    """Side work (a timing, a memory probe) leaves the RNG as it found it: the run's dropout draws what it would."""
    return torch.random.fork_rng(devices=[torch.cuda.current_device()] if torch.cuda.is_initialized() else [])
