"""Fine-tune GPT-2 to summarize dialogues.

    python train.py [preset.py|preset.json] [--key=value ...]                  one process (CPU or one GPU)
    torchrun --nproc_per_node=N --standalone train.py [...]                     DDP, N processes
    accelerate launch --multi_gpu --num_processes N train.py --backend=accelerate
    train.notebook_main(["config/kaggle_t4x2.py", ...], num_processes=2)              from a notebook cell
"""
import collections
import contextlib
import json
import logging
import math
import os
import shlex
import signal
import sys
import threading
import time
import traceback
from dataclasses import asdict

import torch
from tqdm import tqdm

from summarizer import calibrate
import data
from summarizer import inference
from summarizer import lora
from summarizer.budget import DiskPlan, TimeBudget, save_problem
from summarizer.checkpoint import (archive_previous_run, build_model, keep_best_of_metric, lora_base_reference, make_out_dir,
                        save_checkpoint)
from config import FIELDS, FIXED_KEYS, format_config, grad_accum_steps, load_config, save_config
from summarizer.errors import UserError
from summarizer.evaluation import evaluate
from summarizer.files import no_empty_folder_left
from generate import compile_decode
from summarizer.metrics import rouge
from model import GPT, GPTConfig, Packed, Targets
from summarizer.runtime import Runtime, compiler_error, one_line_errors, out_of_memory_hint, peak_flops, warn_compile_failed
from summarizer.schedule import describe_schedule, learning_rate, lr_schedule, resumed_schedule
from summarizer.submission import check_against_sample, predict
from summarizer.tracking import Tracker, drop_rows_after, plot_metrics

NAN_PATIENCE = 3  # consecutive non-finite losses (no update is applied for them) before the run stops
SKIP_WINDOW, SKIP_WARN = 20, 5  # warn when more than SKIP_WARN of the last SKIP_WINDOW steps were skipped (fp16)
SHAPE_KEYS = ("n_layer", "n_head", "n_embd", "bias")  # a resumed run cannot change these (block_size: checked apart)
# What a resumed run may change, and what it applies it to; the rest of the config simply takes effect.
OPTIMIZER_KEYS = ("weight_decay", "beta1", "beta2")
FORKED_CUDA = "Cannot re-initialize CUDA in forked subprocess"
STOP_SIGNALS = (signal.SIGINT, signal.SIGTERM)  # save ckpt.pt after the current step and stop (stop_requests)


def main(argv=None):
    """Entry point for the command line and for notebook_launcher; user errors and out-of-memory end in one line,
    and so does a crash of one rank of a distributed job (after its traceback), naming the rank."""
    argv = sys.argv[1:] if argv is None else argv
    with one_line_errors():
        cfg = load_config(argv)
        try:
            with no_empty_folder_left(cfg.out_dir), Runtime(cfg) as rt:
                trainer = Trainer(cfg, rt)
                trainer.fit()
                if trainer.stop_agreed:
                    if rt.is_main:
                        print(f"stopped by {signal.Signals(trainer.stop_agreed).name} after iter {trainer.iter_num}: "
                              f"{os.path.join(cfg.out_dir, 'ckpt.pt')} holds it; continue with:\n"
                              f"  {continue_command(argv, rt.world_size)}")
                    # under torchrun a non-zero status would add the launcher's failure report to a clean stop
                    sys.exit(0 if rt.distributed else 128 + trainer.stop_agreed)
                if trainer.out_of_time and rt.is_main:
                    ckpt = os.path.join(cfg.out_dir, "ckpt.pt")
                    print(f"max_time={cfg.max_time}: stopped after iter {trainer.iter_num} of {cfg.max_iters} with "
                          f"time left for what follows; {ckpt} holds it; continue with:\n"
                          f"  {continue_command(argv, rt.world_size)}\n"
                          f"or in a new session, with this output attached as input, add "
                          f"--resume_from=<the attached copy of {os.path.abspath(ckpt)}>")
                # this run's config is the contract: every key counts as given
                if cfg.evaluate_after:
                    evaluate(cfg, set(FIELDS), rt)
                if cfg.predict_after:
                    predict(cfg, set(FIELDS), rt)
        except (UserError, torch.OutOfMemoryError):
            raise
        except Exception as e:
            rank = os.environ.get("RANK")
            if rank is None:
                raise
            if FORKED_CUDA in str(e):  # notebook_launcher's forked workers (accelerate issue 3524)
                print(f"error (rank {rank}): CUDA cannot start in a process forked from this notebook: train with "
                      f"the notebook's torchrun cell (python -m torch.distributed.run ... train.py) instead of "
                      f"notebook_main", file=sys.stderr)
                sys.exit(1)
            # Among the launcher's reports and the other ranks' errors (e.g. "connection closed by peer") the
            # root cause is this rank's last line.
            traceback.print_exc()
            first_line = str(e).strip().partition("\n")[0]
            print(f"error (rank {rank}): {type(e).__name__}: {first_line}", file=sys.stderr)
            sys.exit(1)


def continue_command(argv, world_size):
    """The command line that resumes this run from out_dir/ckpt.pt: its arguments with --init_from=resume, under
    torchrun when the run had several processes."""
    args = [a for a in argv if not a.startswith(("--init_from=", "--resume_from="))] + ["--init_from=resume"]
    launcher = (["torchrun", f"--nproc_per_node={os.environ.get('LOCAL_WORLD_SIZE', world_size)}", "--standalone"]
                if world_size > 1 else ["python"])
    return shlex.join([*launcher, "train.py", *args])


@contextlib.contextmanager
def stop_requests(trainer):
    """While training, SIGINT (Ctrl-C, a notebook's stop button) and SIGTERM (a session or job ending) only set
    trainer.stop_signal; the ranks agree on it at the end of the step (train_step) and stop together."""
    if threading.current_thread() is not threading.main_thread():
        yield
        return

    def request(signum, frame):
        trainer.stop_signal = trainer.stop_signal or signum  # torchrun forwards a second copy: not a new request
    previous = {s: signal.signal(s, request) for s in STOP_SIGNALS}
    try:
        yield
    finally:
        for s, handler in previous.items():
            signal.signal(s, handler)


def resuming(cfg):
    return cfg.init_from == "resume" or bool(cfg.resume_from)


def lora_base_source(cfg):
    """Where a resumed LoRA run's base is now, if the command says (init_from beside resume_from), else None."""
    return cfg.init_from if cfg.init_from != "resume" else None


def model_to_train(cfg):
    """(model, ckpt.pt's contents when resuming, else None) as init_from says: 'scratch', a GPT-2 name or local
    transformers directory, or 'resume' (which must not change what the run fixed); with LoRA adapters (base
    frozen) when lora_rank > 0. Resuming reads resume_from (default out_dir/ckpt.pt); given with it, an init_from
    other than 'resume' says where a LoRA checkpoint's base model is now."""
    if not resuming(cfg):
        model, _ = build_model(cfg.init_from, cfg)
        if cfg.lora_rank:
            lora.add_adapters(model, **lora.settings(cfg))
        return model, None
    path = resume_path(cfg)
    model, ckpt = build_model(path, cfg, keep_adapters=True, lora_base=lora_base_source(cfg))
    if "optimizer" not in ckpt:
        raise UserError(f"{path} holds weights only (a best.pt?), not what resuming needs")
    if model.config.block_size != cfg.block_size:
        raise UserError(f"{path} was trained with block_size={model.config.block_size}, not {cfg.block_size}: "
                        f"resume with --block_size={model.config.block_size}")
    for key in (*SHAPE_KEYS, *lora.KEYS, *FIXED_KEYS):
        if ckpt["config"].get(key, getattr(cfg, key)) != getattr(cfg, key):
            what = ("the adapters" if key in lora.KEYS else "the model's shape" if key in SHAPE_KEYS
                    else "what the model was trained on")
            raise UserError(f"{path} was trained with {key}={ckpt['config'][key]!r}, not {getattr(cfg, key)!r}: "
                            f"{what} cannot change when resuming; resume with --{key}={ckpt['config'][key]!r}")
    return model, ckpt


def resume_path(cfg):
    return cfg.resume_from or os.path.join(cfg.out_dir, "ckpt.pt")


def configure_optimizer(model, cfg, device_type):
    """AdamW with weight decay on 2-D weights only (not biases, LayerNorms); fused on CUDA."""
    params = [p for p in model.parameters() if p.requires_grad]
    groups = [{"params": [p for p in params if p.dim() >= 2], "weight_decay": cfg.weight_decay},
              {"params": [p for p in params if p.dim() < 2], "weight_decay": 0.0}]
    return torch.optim.AdamW(groups, lr=cfg.learning_rate, betas=(cfg.beta1, cfg.beta2),
                             fused=device_type == "cuda")


def apply_hyperparameters(optimizer, cfg):
    """Set the config's AdamW settings on the groups configure_optimizer made (a resumed optimizer's state
    dict brings back the old ones)."""
    decay, no_decay = optimizer.param_groups
    decay["weight_decay"], no_decay["weight_decay"] = cfg.weight_decay, 0.0
    for group in optimizer.param_groups:
        group["betas"] = (cfg.beta1, cfg.beta2)


def rng_state():
    """This process's torch RNG (dropout); data order needs none, the sampler is a function of the step."""
    state = {"torch": torch.get_rng_state()}
    if torch.cuda.is_available() and torch.cuda.is_initialized():
        state["cuda"] = torch.cuda.get_rng_state()
    return state


def set_rng_state(state):
    torch.set_rng_state(state["torch"])
    if "cuda" in state and torch.cuda.is_available():
        torch.cuda.set_rng_state(state["cuda"])


class Trainer:

    def __init__(self, cfg, rt):
        self.cfg, self.rt = cfg, rt
        started = time.monotonic()
        self.accum_steps = grad_accum_steps(cfg, rt.world_size)
        self.tracker = Tracker(cfg, rt.is_main)
        if rt.is_main:
            make_out_dir(cfg.out_dir)
            if not resuming(cfg):
                moved = archive_previous_run(cfg.out_dir)
                if moved:
                    print(moved)
        splits = data.load_datasets(cfg, is_main=rt.is_main, barrier=rt.barrier)
        after_summaries = len(splits.val) if cfg.evaluate_after else 0
        if cfg.predict_after:  # the files predict reads after hours of training, checked now
            test = data.read_test(cfg)
            after_summaries += len(test.ids)
            if cfg.sample_submission_csv:
                check_against_sample(test.ids, cfg.sample_submission_csv)
        self.time = TimeBudget(cfg, after_summaries, started)
        self.train_set, self.val_set = splits.train, splits.val
        self.batches = data.TrainBatches(self.train_set, cfg, rt.rank, rt.world_size)
        self.train_rows = self.train_set.fingerprints()  # kept in checkpoints: inference refuses to score these
        torch.manual_seed(cfg.seed)  # identical initial weights on every rank
        model, ckpt = model_to_train(cfg)
        self.lora_base = self.base_reference(model, ckpt) if rt.is_main else None
        disk = DiskPlan(model, cfg, small_lora=self.lora_base is not None, train_rows=len(self.train_set)) \
            if rt.is_main else None
        rt.stop_if(disk.problem() if rt.is_main else None)
        model.gradient_checkpointing = cfg.gradient_checkpointing
        model = model.to(rt.device)
        self.candidates_key = None  # a calibration stage's: what its candidates.pt was made for
        if cfg.rank_weight:
            self.candidates_key, candidates = self.calibration_candidates(model, ckpt)
            self.batches = calibrate.RankedBatches(self.train_set, candidates, cfg, rt.rank, rt.world_size)
            if rt.is_main:
                print(f"calibration: {calibrate.describe(candidates)} in {calibrate.candidates_path(cfg)}")
        self.model = rt.shard(model)
        self.optimizer = configure_optimizer(self.model, cfg, rt.device.type)
        self.scaler = torch.amp.GradScaler(rt.device.type, enabled=rt.use_scaler)
        self.iter_num, self.best_score = 0, None
        self.schedule = lr_schedule(asdict(cfg))
        self.skipped, self.recent_skips = 0, collections.deque(maxlen=SKIP_WINDOW)
        self.skip_warned_at = -SKIP_WINDOW
        # a signal this rank received; the one the ranks agreed on after a step (and stopped for)
        self.stop_signal = self.stop_agreed = None
        self.out_of_time = False  # the ranks agreed that max_time leaves no room for another step
        torch.manual_seed(cfg.seed + rt.rank)  # dropout masks differ per rank
        resume_notes = self.restore(ckpt) if ckpt is not None else []
        n = min(cfg.rouge_samples, len(self.val_set))
        self.rouge_prompts, _ = inference.Run(self.model, cfg).prompts(self.val_set.dialogues[:n])
        trained = self.model
        if rt.compile:
            x, y = self.on_device(self.batches.micro_batches(self.iter_num)[0])[:2]
            with self.out_of_memory_hint():
                trained = compile_model(self.model, x, y, rt.autocast())
            if trained is not self.model:
                compile_decode(self.model)  # for ROUGE
        self.wrapped = rt.wrap(trained)
        self.peak = peak_flops(rt.device_name, rt.dtype) if rt.device.type == "cuda" else None
        if rt.is_main:
            print(format_config(cfg))
            for note in [*splits.notes, *resume_notes]:
                print(note)
            if cfg.lora_rank and cfg.init_from == "scratch":
                print(f"warning: lora_rank={cfg.lora_rank} with init_from=scratch trains small adapters on frozen "
                      f"random weights, which learns little: start from GPT-2 (init_from=gpt2) or train every "
                      f"weight (lora_rank=0)", file=sys.stderr)
            print(f"{len(self.train_set)} training and {len(self.val_set)} validation examples; "
                  f"{cfg.batch_size} sequences per step = {cfg.micro_batch_size} per micro-batch x "
                  f"{rt.world_size} process(es) x {self.accum_steps} accumulation steps; "
                  f"{self.model.num_params() / 1e6:.1f}M parameters{trained_params(self.model, cfg)}; {rt.describe()}")
            print(f"checkpoints in {cfg.out_dir}: {disk.describe()} at their peak")
            save_config(cfg, os.path.join(cfg.out_dir, "config.json"))

    def base_reference(self, model, ckpt):
        """What ckpt.pt keeps of a LoRA run's frozen base instead of its weights (where it comes from, its hash),
        or None where it keeps the weights: full fine-tuning, adapters on a random (scratch) base, a checkpoint
        of an earlier version that held its base."""
        cfg = self.cfg
        if not cfg.lora_rank:
            return None
        if ckpt is not None:
            reference = ckpt.get("lora_base")
            return reference and {**reference, "init_from": lora_base_source(cfg) or reference["init_from"]}
        return None if cfg.init_from == "scratch" else lora_base_reference(cfg.init_from, model)

    def calibration_candidates(self, model, ckpt):
        """(key, Candidates) of a calibration stage: made by the starting weights, or on resuming those that the
        checkpoint's stage trained on (the file must be there: the weights that made it are not)."""
        cfg, rt = self.cfg, self.rt
        if ckpt is None:
            key = rt.all_gather_objects(calibrate.candidates_key(model, self.train_set, cfg) if rt.is_main else None)[0]
        elif ckpt.get("candidates") is None:
            raise UserError(f"{resume_path(cfg)} was trained without the ranking loss: start the calibration stage "
                            f"from its weights in a new out_dir (--init_from=<its best.pt> --out_dir=<new>), or "
                            f"resume with --rank_weight=0")
        else:
            key = ckpt["candidates"]
        return key, calibrate.make_candidates(model, self.train_set, cfg, rt, key, may_generate=ckpt is None)

    def restore(self, ckpt):
        """Continue the checkpoint's run: its optimizer, scaler, step, best score, RNG and LR schedule, with the
        hyperparameters this run's config changed applied. Returns the lines that say so."""
        cfg, saved, path = self.cfg, ckpt["config"], resume_path(self.cfg)
        if ckpt["iter_num"] >= cfg.max_iters:
            raise UserError(f"{path} is at iter {ckpt['iter_num']} and max_iters={cfg.max_iters}: nothing to train; "
                            f"continue with --max_iters above {ckpt['iter_num']}")
        self.rt.load_optimizer_state(self.model, self.optimizer, ckpt["optimizer"], path)
        apply_hyperparameters(self.optimizer, cfg)
        if ckpt.get("scaler"):
            self.scaler.load_state_dict(ckpt["scaler"])
        self.iter_num = ckpt["iter_num"]
        notes = [f"resuming {path} at iter {self.iter_num}"]
        if self.rt.is_main:
            dropped = drop_rows_after(os.path.join(cfg.out_dir, "metrics.jsonl"), self.iter_num)
            if dropped:
                notes.append(f"metrics.jsonl: {dropped} row(s) logged after iter {self.iter_num} were dropped; "
                             f"those steps run and are logged again")
        best_metric = ckpt.get("best_metric") or saved["best_metric"]
        if best_metric == cfg.best_metric:
            self.best_score = ckpt["best_score"]
            if "best_metric" not in ckpt and best_metric == "val_loss" and self.best_score is not None:
                self.best_score = -self.best_score  # before best_metric was stored by name: -val_loss
        else:
            kept = keep_best_of_metric(cfg.out_dir, best_metric) if self.rt.is_main else None
            notes.append(f"best_metric is now {cfg.best_metric} (was {best_metric}): best.pt follows "
                         f"{cfg.best_metric} from the next evaluation on"
                         + (f"; the best by {best_metric} is kept as {kept}" if kept else ""))
        self.skipped = ckpt.get("skipped_steps", 0)
        if self.rt.rank < len(ckpt["rng"]):
            set_rng_state(ckpt["rng"][self.rt.rank])
        schedule = ckpt.get("schedule") or lr_schedule(saved)
        self.schedule = resumed_schedule(schedule, saved, cfg, self.iter_num)
        changed = [f"{k} {saved[k]!r} -> {getattr(cfg, k)!r}" for k in (*OPTIMIZER_KEYS, "dropout", "grad_clip")
                   if k in saved and saved[k] != getattr(cfg, k)]
        notes[0] += "; " + describe_schedule(self.schedule, self.iter_num, cfg.max_iters)
        if changed:
            notes.append(f"changed since the checkpoint, applied from iter {self.iter_num}: {', '.join(changed)}")
        return notes

    def fit(self):
        cfg, rt = self.cfg, self.rt
        # closed by `with` also when an error ends the run, so the error starts on a line of its own
        with self.tracker, self.out_of_memory_hint(), stop_requests(self), tqdm(
                total=cfg.max_iters, initial=self.iter_num, disable=not rt.is_main, dynamic_ncols=True,
                desc="training", unit="it") as bar:
            bad_steps = 0
            while self.iter_num < cfg.max_iters:
                lr = learning_rate(self.iter_num, self.schedule)
                for group in self.optimizer.param_groups:
                    group["lr"] = lr
                start = time.perf_counter()
                loss, tokens, grad_norm, skipped = self.train_step(self.iter_num)
                seconds = time.perf_counter() - start
                self.time.step_done(seconds)
                self.iter_num += 1
                bad_steps = 0 if math.isfinite(loss) else bad_steps + 1
                if bad_steps >= NAN_PATIENCE:
                    raise UserError(f"loss is {loss} for {bad_steps} iterations in a row (iter {self.iter_num}); "
                                    f"stopped. {cfg.out_dir}/best.pt and ckpt.pt are untouched since the last eval. "
                                    f"Lower learning_rate or use dtype=float32/bfloat16")
                self.skipped += skipped
                self.recent_skips.append(skipped)
                stats = {"iter": self.iter_num, "loss": loss, "lr": lr, "grad_norm": grad_norm,
                         "tokens_per_s": tokens / seconds, "ms_per_iter": 1000 * seconds}
                if cfg.rank_weight:
                    stats["rank_loss"] = self.rank_loss
                if self.scaler.is_enabled():
                    stats.update(loss_scale=self.scaler.get_scale(), skipped_steps=self.skipped)
                if self.peak:
                    stats["mfu"] = self.step_flops(self.iter_num - 1) / seconds / rt.world_size / self.peak
                if rt.device.type == "cuda":
                    stats["peak_mem_gb"] = torch.cuda.max_memory_allocated(rt.device) / 2**30
                if self.iter_num % cfg.eval_interval == 0 or self.iter_num == cfg.max_iters or self.out_of_time:
                    start = time.perf_counter()
                    stats.update(self.evaluate())
                    self.checkpoint(stats)
                    self.time.evaluation_done(time.perf_counter() - start)
                elif self.stop_agreed:
                    self.save(stats, best=False)
                if rt.is_main:
                    self.log(stats, bar)
                if self.stop_agreed or self.out_of_time:
                    return

    def out_of_memory_hint(self):
        """What an out-of-memory while training says to lower (one generating summaries names gen_batch_size)."""
        n = self.cfg.micro_batch_size
        return out_of_memory_hint(f"training on micro-batches of {n} sequences",
                                  f"--micro_batch_size (now {n}; batch_size stays, with more accumulation steps)"
                                  + ("" if self.cfg.gradient_checkpointing else " or set --gradient_checkpointing=True")
                                  + (" or set --fsdp_reduce_once=False (it keeps the weights gathered and the "
                                     "gradients unsharded)" if self.rt.backend == "fsdp" and self.rt.reduce_once is True
                                     else ""))

    def train_step(self, step):
        """One optimizer step over global batch `step`. Returns its mean loss per target token (over all ranks),
        the number of real tokens all ranks processed, the gradient norm before clipping, whether the step
        was skipped (fp16 overflow: the GradScaler applies no update and lowers its scale; or a non-finite loss).
        Sets stop_agreed to the signal (stop_requests) some rank received, else None, and out_of_time when some
        rank's max_time leaves no room for another step: the same on every rank."""
        cfg, rt = self.cfg, self.rt
        micro_batches = self.batches.micro_batches(step)
        # Each micro-batch's loss is a sum over its targets divided by the target count of the *global* batch
        # (times world_size, which DDP's gradient averaging divides back out): the gradient is then the
        # per-token mean over the whole global batch, however it is split across ranks and micro-steps.
        scale = rt.world_size / self.batches.target_tokens(step)
        loss_sum, rank_sum = torch.zeros((), device=rt.device), torch.zeros((), device=rt.device)
        # a signal received, or max_time leaving no room after this step; no host-to-device copy unless set
        requests = torch.zeros(len(STOP_SIGNALS) + 1, device=rt.device)
        if self.stop_signal:
            requests[STOP_SIGNALS.index(self.stop_signal)] = 1
        if self.time.stop_now():
            requests[-1] = 1
        # the ranking loss (a calibration stage) is a mean over the global batch's dialogues
        rank_scale = cfg.rank_weight * rt.world_size / cfg.batch_size
        for i, batch in enumerate(micro_batches):
            with rt.no_sync(self.wrapped, sync=i == len(micro_batches) - 1):
                with rt.autocast():
                    token_loss, rank_loss = self.micro_batch_losses(self.on_device(batch))
                self.scaler.scale(token_loss * scale + rank_loss * rank_scale if rank_scale else
                                  token_loss * scale).backward()
            loss_sum += token_loss.detach().float()
            rank_sum += rank_loss.detach()
        # the stop request travels with the losses: one reduction and one host sync per step, as before
        loss_sum, rank_sum, *requests = rt.all_reduce_sum(torch.cat([loss_sum[None], rank_sum[None],
                                                                     requests])).tolist()
        loss = loss_sum * scale / rt.world_size
        self.rank_loss = rank_sum / cfg.batch_size
        grad_norm, skipped = math.nan, True
        if math.isfinite(loss):
            self.scaler.unscale_(self.optimizer)  # true gradients, for the norm and the clipping
            grad_norm = torch.nn.utils.clip_grad_norm_(self.model.parameters(), cfg.grad_clip or math.inf).item()
            loss_scale = self.scaler.get_scale()
            self.scaler.step(self.optimizer)  # with fp16, skips the update if any gradient overflowed
            self.scaler.update()
            skipped = self.scaler.get_scale() < loss_scale
        self.optimizer.zero_grad(set_to_none=True)
        global_batch = self.batches.sampler.global_batch(step)
        self.stop_agreed = next((s for s, n in zip(STOP_SIGNALS, requests) if n), None)
        self.out_of_time = bool(requests[-1])
        return loss, int((self.train_set.lengths[global_batch] - 1).sum()), grad_norm, skipped

    def on_device(self, batch):
        """A micro-batch on the training device: (x, Targets) of a training batch (x, y), or a RankBatch."""
        if isinstance(batch, calibrate.RankBatch):
            return batch.to(self.rt.device)
        x, y = batch
        return x.to(self.rt.device, non_blocking=True), Targets.of(y).to(self.rt.device)

    def micro_batch_losses(self, batch):
        """(token loss summed over the micro-batch's targets, ranking loss summed over its dialogues: 0 but in
        a calibration stage), from one forward of the trained model."""
        if isinstance(batch, calibrate.RankBatch):
            return calibrate.micro_batch_losses(self.wrapped, batch, self.cfg)
        x, found = batch
        _, loss = self.wrapped(x, found)
        return loss * len(found.index), torch.zeros((), device=x.device)

    def step_flops(self, step):
        """Model FLOPs of optimizer step `step` (all ranks): real tokens only, padding is not useful work."""
        lengths = self.train_set.lengths[self.batches.sampler.global_batch(step)] - 1
        return self.model.training_flops(int(lengths.sum()), self.batches.target_tokens(step),
                                         int((lengths ** 2).sum()))

    @torch.no_grad()
    def evaluate(self):
        """Validation loss (all ranks' shares summed) and ROUGE on a fixed validation subset, summarized in the
        same batches as one process would (summarize_sharded); every rank returns the same numbers."""
        cfg, rt = self.cfg, self.rt
        self.model.eval()
        loss_sum, targets = torch.zeros((), device=rt.device), 0
        batches = list(data.eval_batches(self.val_set, cfg.micro_batch_size, rt.rank, rt.world_size,
                                         cfg.eval_val_batches, cfg.seed, cfg.train_on_prompt))
        if rt.backend == "fsdp":  # each forward all-gathers weights with the other ranks: all run as many
            no_rows = torch.zeros(0, data.PAD_MULTIPLE, dtype=torch.long)
            batches += [(no_rows, no_rows - 1)] * (max(rt.all_gather_objects(len(batches))) - len(batches))
        for x, y in batches:
            found = Targets.of(y)
            with rt.autocast():
                _, loss = self.model(x.to(rt.device), found.to(rt.device))
            loss_sum += loss.float() * len(found.index)
            targets += len(found.index)
        totals = rt.all_reduce_sum(torch.stack([loss_sum, torch.tensor(float(targets), device=rt.device)]))
        metrics = {"val_loss": (totals[0] / totals[1].clamp(min=1)).item()}
        if self.rouge_prompts:
            start = time.perf_counter()
            predictions = inference.summarize_sharded(self.generator(), self.rouge_prompts, cfg, rt, progress=False)
            self.time.summarized(len(predictions), time.perf_counter() - start)
            metrics.update(rouge(predictions, self.val_set.summaries[:len(predictions)]))
        self.model.train()
        return metrics

    def generator(self):
        """The model that summarizes for ROUGE. Under FSDP, where every forward is a collective that ranks
        generating different lengths cannot keep in step, a plain copy with the gathered (and LoRA-merged)
        weights: it needs room for a full copy of the weights on each GPU."""
        if self.rt.backend != "fsdp":
            return self.model
        weights = self.rt.full_weights(self.model)
        if self.cfg.lora_rank:
            weights = lora.merged_state_dict(weights, **lora.settings(self.cfg))
        with torch.device(self.rt.device):
            copy = GPT(GPTConfig(**asdict(self.model.config)))
        copy.load_state_dict(weights)
        if self.rt.compile:
            compile_decode(copy)
        return copy.eval()

    def checkpoint(self, stats):
        """After an evaluation: ckpt.pt, and best.pt when the configured metric improved."""
        cfg = self.cfg
        if not math.isfinite(stats["val_loss"]):  # diverged weights are not worth resuming from
            if self.rt.is_main:
                print(f"warning: val_loss is {stats['val_loss']} at iter {self.iter_num}; keeping the previous "
                      f"checkpoints", file=sys.stderr)
            return
        score, best = stats[cfg.best_metric], self.best_score
        improved = math.isfinite(score) and (best is None or (score < best if cfg.best_metric == "val_loss"
                                                              else score > best))
        if improved:
            self.best_score = score
        self.save(stats, best=improved)

    def save(self, stats, best):
        """Rank 0 writes ckpt.pt (all that resuming needs), and with `best` best.pt (weights, config, metrics);
        the others wait."""
        cfg, rt = self.cfg, self.rt
        rng = rt.all_gather_objects(rng_state())
        model_state, optimizer_state = rt.training_state(self.model, self.optimizer)
        if rt.is_main:
            weights = {"model_args": asdict(self.model.config), "iter_num": self.iter_num,
                       "best_metric": cfg.best_metric, "best_score": self.best_score, "config": asdict(cfg),
                       "metrics": {k: v for k, v in stats.items() if isinstance(v, float)},
                       "tokenizer": data.TOKENIZER_ID, "train_rows": self.train_rows,
                       "validation_digest": self.val_set.digest}
            # ckpt.pt: what resuming needs (of a LoRA run the adapters, and where its base comes from); best.pt: merged
            trained = {"model": lora.adapter_state_dict(model_state), "lora_base": self.lora_base} if self.lora_base \
                else {"model": model_state}
            writes = [(os.path.join(cfg.out_dir, "ckpt.pt"),
                       {**weights, **trained, "optimizer": optimizer_state, "scaler": self.scaler.state_dict(),
                        "rng": rng, "schedule": self.schedule, "skipped_steps": self.skipped,
                        "candidates": self.candidates_key})]
            if best:
                merged = lora.merged_state_dict(model_state, **lora.settings(cfg)) if cfg.lora_rank else model_state
                writes.append((os.path.join(cfg.out_dir, "best.pt"), {**weights, "model": merged}))
        rt.stop_if(save_problem(writes, self.iter_num) if rt.is_main else None)
        if rt.is_main:
            for path, state in writes:
                save_checkpoint(state, path)
        rt.barrier()

    def log(self, stats, bar):
        if self.iter_num % self.cfg.log_interval == 0 or "val_loss" in stats:
            with open(os.path.join(self.cfg.out_dir, "metrics.jsonl"), "a") as f:
                f.write(json.dumps(stats) + "\n")
            self.tracker.log(stats)
        postfix = {"loss": f"{stats['loss']:.4f}", **({"rank": f"{stats['rank_loss']:.4f}"} if "rank_loss" in stats
                                                       else {}), "lr": f"{stats['lr']:.2e}",
                   "tok/s": f"{stats['tokens_per_s']:.0f}", "ms/it": f"{stats['ms_per_iter']:.0f}"}
        if "mfu" in stats:
            postfix["mfu"] = f"{100 * stats['mfu']:.1f}%"
        if "peak_mem_gb" in stats:
            postfix["mem"] = f"{stats['peak_mem_gb']:.1f}G"
        if self.scaler.is_enabled():
            postfix["skipped"] = self.skipped
        bar.set_postfix(postfix)
        bar.update(1)
        if sum(self.recent_skips) > SKIP_WARN and self.iter_num - self.skip_warned_at >= SKIP_WINDOW:
            self.skip_warned_at = self.iter_num
            bar.write(f"warning: the fp16 GradScaler skipped {sum(self.recent_skips)} of the last {SKIP_WINDOW} steps "
                      f"(loss scale now {self.scaler.get_scale():g}): gradients keep overflowing; lower "
                      f"learning_rate, or use --dtype=bfloat16 (Ampere or newer) or --dtype=float32", file=sys.stderr)
        if "val_loss" in stats:
            scores = " ".join(f"{k} {stats[k]:.4f}" for k in ("val_loss", "rouge1", "rouge2", "rougeL") if k in stats)
            bar.write(f"iter {self.iter_num}: {scores}")
            plot_metrics(os.path.join(self.cfg.out_dir, "metrics.jsonl"), os.path.join(self.cfg.out_dir, "metrics.png"))


def trained_params(model, cfg):
    """' (0.30M trained: LoRA rank 8)' for a LoRA run, else ''."""
    if not cfg.lora_rank:
        return ""
    trained = sum(p.numel() for p in model.parameters() if p.requires_grad)
    return f" ({trained / 1e6:.2f}M trained: LoRA rank {cfg.lora_rank} on {cfg.lora_targets})"


def compile_model(model, x, y, autocast):
    """torch.compile'd `model`, tried on one forward and backward of batch (x, y) now (y: targets, Targets, or a
    calibration stage's Packed rows), because compiling happens
    lazily at the first call; the eager model, with one warning line, if the compiler fails. Any other error
    (out of memory included) propagates. Leaves no gradients behind and draws no random numbers.
    One graph (fullgraph) with its sizes symbolic from the start (dynamic): micro-batch widths and target counts
    change every step, and a graph specialised to the first ones would be compiled again for the second."""
    rng = rng_state()
    try:
        compiled = torch.compile(model, fullgraph=True, dynamic=True)
        with autocast:
            _, loss = compiled(x, y if isinstance(y, (Targets, Packed)) else Targets.of(y))
        loss.sum().backward()
        return compiled
    except Exception as e:  # compiler support varies by platform, GPU, C++ compiler and torch build
        if not compiler_error(e):
            raise  # e.g. out of memory: eager needs more, not less
        warn_compile_failed(e, "training eagerly")
        return model
    finally:
        model.zero_grad(set_to_none=True)
        set_rng_state(rng)


@contextlib.contextmanager
def quiet_launcher_logs():
    """Silence torch.distributed.elastic's loggers: when a worker fails they log the launcher's own traceback,
    while the worker has already printed the error that matters (main)."""
    loggers = [logging.getLogger(name) for name in list(logging.root.manager.loggerDict)
               if name.startswith("torch.distributed.elastic")]
    levels = [logger.level for logger in loggers]
    for logger in loggers:
        logger.setLevel(logging.CRITICAL)
    try:
        yield
    finally:
        for logger, level in zip(loggers, levels):
            logger.setLevel(level)


def notebook_main(argv=(), num_processes=2, port=29500):
    """Train from a notebook cell in `num_processes` processes, one per GPU (Kaggle's 2x T4), with Accelerate's
    notebook_launcher. The processes are forked, so nothing in the notebook may have used CUDA before; where
    forked workers cannot use CUDA at all, they say to use the notebook's torchrun cell instead."""
    try:
        load_config(argv)  # a mistake in the arguments ends here, before any process starts
        if torch.cuda.is_initialized():
            raise UserError("CUDA was already initialised in this notebook (a cell used the GPU), and processes "
                            "forked from it cannot use CUDA: restart the kernel and call notebook_main first")
        from accelerate import notebook_launcher
        from torch.distributed.elastic.multiprocessing.errors import ChildFailedError
        try:
            with quiet_launcher_logs():
                notebook_launcher(main, ([*argv, "--backend=accelerate"],), num_processes=num_processes,
                                  use_port=str(port))
        except torch.distributed.DistNetworkError as e:
            if "EADDRINUSE" not in str(e):
                raise
            raise UserError(f"port {port} is in use, probably by the processes of an earlier launch that are "
                            f"still running: restart the kernel, or pass port=<another port>") from None
        except ChildFailedError as e:  # each worker printed its own one-line error above
            if all(failure.exitcode == 2 for failure in e.failures.values()):
                sys.exit(2)  # a user error: nothing to add to the workers' lines
            failed = ", ".join(str(rank) for rank in sorted(e.failures))
            raise UserError(f"training failed in rank(s) {failed}: see the error line(s) above") from None
        except (ValueError, RuntimeError) as e:  # Accelerate's own checks of the notebook's state
            if not any(s in str(e) for s in ("should only be initialized inside", "has been initialized before")):
                raise
            raise UserError(f"{str(e).splitlines()[0]} (restart the kernel and call notebook_main first)") from None
    except UserError as e:
        print(f"error: {e}", file=sys.stderr)
        sys.exit(2)


if __name__ == "__main__":
    main()
