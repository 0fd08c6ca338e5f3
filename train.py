"""Fine-tune GPT-2 to summarize dialogues.

    python train.py [preset.py|preset.json] [--key=value ...]                  one process (CPU or one GPU)
    torchrun --nproc_per_node=N --standalone train.py [...]                     DDP, N processes
    accelerate launch --multi_gpu --num_processes N train.py --backend=accelerate
    train.notebook_main(["config/kaggle_t4x2.py", ...], num_processes=2)              from a notebook cell
"""
import collections
import contextlib
import math
import os
import shlex
import signal
import sys
import threading
import time
from dataclasses import asdict

import torch
from tqdm import tqdm

import data
from config import FIELDS, changed_settings, grad_accum_steps, load_config, save_config
from model import Targets
from summarizer import calibrate, checkpointing, inference, training
from summarizer.budget import TimeBudget, process_age
from summarizer.errors import UserError
from summarizer.evaluation import evaluate, validation_loss
from summarizer.files import no_empty_folder_left
from summarizer.launch import notebook_launch, one_line_errors, rank_error_lines
from summarizer.metrics import rouge
from summarizer.runtime import Runtime, peak_flops
from summarizer.schedule import learning_rate, lr_schedule
from summarizer.submission import predict
from summarizer.tracking import Tracker, log_row, plot_metrics, progress_postfix

NAN_PATIENCE = 3  # consecutive non-finite losses (no update is applied for them) before the run stops
SKIP_WINDOW, SKIP_WARN = 20, 5  # warn when more than SKIP_WARN of the last SKIP_WINDOW steps were skipped (fp16)
STOP_SIGNALS = (signal.SIGINT, signal.SIGTERM)  # save ckpt.pt after the step in progress and stop (StopRequest)


def main(argv=None):
    """Entry point for the command line and for the notebook launcher; errors end in one line. From the command
    line, max_time counts from the process's start (imports and set-up included)."""
    started = time.monotonic() - (process_age() if argv is None else 0.0)
    argv = sys.argv[1:] if argv is None else argv
    with one_line_errors():
        cfg = load_config(argv)
        with rank_error_lines(), no_empty_folder_left(cfg.out_dir), Runtime(cfg) as rt:
            if rt.is_main:
                print(f"settings: {changed_settings(argv) or 'the defaults'}; every key: "
                      f"{os.path.join(cfg.out_dir, 'config.json')}")
            stop = StopRequest(rt, cfg.out_dir)
            with stop.handlers():
                trainer = Trainer(cfg, rt, stop, started)
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


def notebook_main(argv=(), num_processes=2, port=29500):
    """Train from a notebook cell in `num_processes` processes, one per GPU (Kaggle's 2x T4)."""
    notebook_launch(main, list(argv), num_processes, port)


def continue_command(argv, world_size):
    """The command line that resumes this run from out_dir/ckpt.pt: its arguments with --init_from=resume, under
    torchrun when the run had several processes."""
    args = [a for a in argv if not a.startswith(("--init_from=", "--resume_from="))] + ["--init_from=resume"]
    launcher = (["torchrun", f"--nproc_per_node={os.environ.get('LOCAL_WORLD_SIZE', world_size)}", "--standalone"]
                if world_size > 1 else ["python"])
    return shlex.join([*launcher, "train.py", *args])


class StopRequest:
    """The first stop signal this process received (SIGINT: Ctrl-C, a notebook's stop button; SIGTERM: a session
    or job ending). Training stops after the step in progress, on every rank together, and rank 0 says so at once;
    a second Ctrl-C in a single process stops at once."""

    def __init__(self, rt, out_dir):
        self.rt, self.out_dir = rt, out_dir
        self.signal = self.trainer = None  # the trainer, once built: which step is in progress

    def __call__(self, signum, frame):
        if self.signal is None:
            self.signal = signum
            if self.rt.is_main:
                step = self.trainer.iter_num + 1 if self.trainer else 1
                print(f"\n{signal.Signals(signum).name}: stopping after iter {step}, then saving "
                      f"{os.path.join(self.out_dir, 'ckpt.pt')}", file=sys.stderr, flush=True)
        elif signum == signal.SIGINT and not self.rt.distributed:  # under torchrun a rank gets copies of one signal
            print(f"second Ctrl-C: stopping at once; {self.out_dir}/ckpt.pt and best.pt stay as the last save "
                  f"left them", file=sys.stderr, flush=True)
            raise KeyboardInterrupt

    @contextlib.contextmanager
    def handlers(self):
        """SIGINT and SIGTERM come here while inside (in the main thread; elsewhere they cannot be caught)."""
        if threading.current_thread() is not threading.main_thread():
            yield
            return
        previous = {s: signal.signal(s, self) for s in STOP_SIGNALS}
        try:
            yield
        finally:
            for s, handler in previous.items():
                signal.signal(s, handler)


class Trainer:
    """The training loop and its run control (stop signals, max_time, NaN patience, fp16 skips) over the state
    that summarizer.training builds and summarizer.checkpointing saves and restores."""

    def __init__(self, cfg, rt, stop=None, started=None):
        self.cfg, self.rt = cfg, rt
        self.stop = stop or StopRequest(rt, cfg.out_dir)
        self.stop.trainer = self
        started = time.monotonic() if started is None else started  # what max_time counts from
        self.accum_steps = grad_accum_steps(cfg, rt.world_size)
        self.tracker = Tracker(cfg, rt.is_main)  # a missing package or login stops the run before any work
        training.prepare_out_dir(cfg, rt)
        splits, after_summaries = training.datasets(cfg, rt)
        self.time = TimeBudget(cfg, after_summaries, started)
        self.train_set, self.val_set = splits.train, splits.val
        self.train_rows = self.train_set.fingerprints()  # kept in checkpoints: inference refuses to score these
        torch.manual_seed(cfg.seed)  # identical initial weights on every rank
        model, ckpt = training.model_to_train(cfg)
        self.lora_base = training.lora_base(cfg, model, ckpt) if rt.is_main else None
        disk = training.check_disk(model, cfg, rt, self.lora_base is not None, len(self.train_set))
        model.gradient_checkpointing = cfg.gradient_checkpointing
        model = model.to(rt.device)
        self.batches, self.candidates_key = data.TrainBatches(self.train_set, cfg, rt.rank, rt.world_size), None
        if cfg.rank_weight:
            self.candidates_key, candidates = training.calibration_candidates(model, self.train_set, cfg, rt, ckpt)
            self.batches = calibrate.RankedBatches(self.train_set, candidates, cfg, rt.rank, rt.world_size)
        self.model = rt.parallel.shard(model)
        self.optimizer = training.configure_optimizer(self.model, cfg, rt.device.type)
        self.scaler = torch.amp.GradScaler(rt.device.type, enabled=rt.use_scaler)
        self.iter_num, self.best_score, self.skipped = 0, None, 0
        self.schedule = lr_schedule(asdict(cfg))
        self.recent_skips, self.skip_warned_at = collections.deque(maxlen=SKIP_WINDOW), -SKIP_WINDOW
        self.stop_agreed = None  # the stop signal the ranks agreed on after a step
        self.out_of_time = False  # the ranks agreed that max_time leaves no room for another step
        torch.manual_seed(cfg.seed + rt.rank)  # dropout masks differ per rank
        notes = [*splits.notes, *(checkpointing.restore(self, ckpt) if ckpt is not None else [])]
        n = min(cfg.rouge_samples, len(self.val_set))
        self.rouge_prompts, _ = inference.Run(self.model, cfg).prompts(self.val_set.dialogues[:n])
        self.wrapped, self.decode_step = training.compiled_and_wrapped(
            self.model, cfg, rt, lambda: self.on_device(self.batches.micro_batches(self.iter_num)[0]))
        self.peak = peak_flops(rt.device_name, rt.dtype) if rt.device.type == "cuda" else None
        if rt.is_main:
            print("\n".join(training.start_lines(self, notes, disk)))
            save_config(cfg, os.path.join(cfg.out_dir, "config.json"))

    def fit(self):
        cfg, rt = self.cfg, self.rt
        # closed by `with` also when an error ends the run, so the error starts on a line of its own
        with self.tracker, training.out_of_memory_hint(self.cfg, self.rt), tqdm(
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
                stats = self.step_stats(loss, lr, grad_norm, tokens, seconds)
                if self.iter_num % cfg.eval_interval == 0 or self.iter_num == cfg.max_iters or self.out_of_time:
                    start = time.perf_counter()
                    stats.update(self.evaluate())
                    checkpointing.checkpoint(self, stats)
                    self.time.evaluation_done(time.perf_counter() - start)
                elif self.stop_agreed:
                    checkpointing.save(self, stats, best=False)
                if rt.is_main:
                    self.log(stats, bar)
                if self.stop_agreed or self.out_of_time:
                    return

    def step_stats(self, loss, lr, grad_norm, tokens, seconds):
        """The metrics.jsonl row of the step just done (before its evaluation, if any)."""
        stats = {"iter": self.iter_num, "loss": loss, "lr": lr, "grad_norm": grad_norm,
                 "tokens_per_s": tokens / seconds, "ms_per_iter": 1000 * seconds}
        if self.cfg.rank_weight:
            stats["rank_loss"] = self.rank_loss
        if self.scaler.is_enabled():
            stats.update(loss_scale=self.scaler.get_scale(), skipped_steps=self.skipped)
        if self.peak:
            flops = training.step_flops(self.model, self.train_set, self.batches, self.iter_num - 1)
            stats["mfu"] = flops / seconds / self.rt.world_size / self.peak
        if self.rt.device.type == "cuda":
            stats["peak_mem_gb"] = torch.cuda.max_memory_allocated(self.rt.device) / 2**30
        return stats

    def train_step(self, step):
        """One optimizer step over global batch `step`: (mean loss per target token over all ranks, real tokens,
        gradient norm before clipping, skipped: an fp16 overflow or a non-finite loss). Sets stop_agreed (a signal
        some rank received) and out_of_time (some rank's max_time has no room for another step) on every rank."""
        cfg, rt = self.cfg, self.rt
        micro_batches = self.batches.micro_batches(step)
        # Each micro-batch's loss is a sum over its targets divided by the target count of the *global* batch
        # (times world_size, which DDP's gradient averaging divides back out): the gradient is then the
        # per-token mean over the whole global batch, however it is split across ranks and micro-steps.
        scale = rt.world_size / self.batches.target_tokens(step)
        rank_scale = cfg.rank_weight * rt.world_size / cfg.batch_size  # the ranking loss: a mean over dialogues
        loss_sum, rank_sum = torch.zeros((), device=rt.device), torch.zeros((), device=rt.device)
        out_of_time = self.time.stop_now()  # whether max_time leaves room for a step after this one
        for i, batch in enumerate(micro_batches):
            with rt.parallel.no_sync(self.wrapped, sync=i == len(micro_batches) - 1):
                with rt.autocast():
                    token_loss, rank_loss = self.micro_batch_losses(self.on_device(batch))
                self.scaler.scale(token_loss * scale + rank_loss * rank_scale if rank_scale else
                                  token_loss * scale).backward()
            loss_sum += token_loss.detach().float()
            rank_sum += rank_loss.detach()
        # a signal received until now (during this step too), or no room after it; no copy to the device unless set
        requests = torch.zeros(len(STOP_SIGNALS) + 1, device=rt.device)
        if self.stop.signal:
            requests[STOP_SIGNALS.index(self.stop.signal)] = 1
        if out_of_time:
            requests[-1] = 1
        # the stop request travels with the losses: one reduction and one host sync per step
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
        self.stop_agreed = next((s for s, n in zip(STOP_SIGNALS, requests, strict=False) if n), None)
        self.out_of_time = bool(requests[-1])
        tokens = int((self.train_set.lengths[self.batches.sampler.global_batch(step)] - 1).sum())
        return loss, tokens, grad_norm, skipped

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

    @torch.no_grad()
    def evaluate(self):
        """Validation loss and ROUGE on a fixed validation subset, summarized in the same batches as one process
        would; every rank returns the same numbers."""
        self.model.eval()
        metrics = {"val_loss": validation_loss(self.model, self.val_set, self.cfg, self.rt)}
        if self.rouge_prompts:
            start = time.perf_counter()
            model = training.rouge_model(self.model, self.cfg, self.rt)
            predictions = inference.summarize_sharded(model, self.rouge_prompts, self.cfg, self.rt, progress=False,
                                                      step=self.decode_step)
            self.time.summarized(len(predictions), time.perf_counter() - start)
            metrics.update(rouge(predictions, self.val_set.summaries[:len(predictions)]))
        self.model.train()
        return metrics

    def log(self, stats, bar):
        """Rank 0: metrics.jsonl and log_to every log_interval steps and at evaluations, the progress bar, a
        warning when fp16 keeps skipping steps, and the plot after an evaluation."""
        if self.iter_num % self.cfg.log_interval == 0 or "val_loss" in stats:
            log_row(self.cfg.out_dir, stats, self.tracker)
        bar.set_postfix(progress_postfix(stats, self.skipped if self.scaler.is_enabled() else None))
        bar.update(1)
        if sum(self.recent_skips) > SKIP_WARN and self.iter_num - self.skip_warned_at >= SKIP_WINDOW:
            self.skip_warned_at = self.iter_num
            bar.write(f"warning: the fp16 GradScaler skipped {sum(self.recent_skips)} of the last {SKIP_WINDOW} steps "
                      f"(loss scale now {self.scaler.get_scale():g}): gradients keep overflowing; lower "
                      f"learning_rate, or use --dtype=bfloat16 (Ampere or newer) or --dtype=float32", file=sys.stderr)
        if "val_loss" in stats:
            scores = " ".join(f"{k} {stats[k]:.4f}" for k in ("val_loss", "rouge1", "rouge2", "rougeL") if k in stats)
            bar.write(f"iter {self.iter_num}: {scores}")
            plot_metrics(os.path.join(self.cfg.out_dir, "metrics.jsonl"), os.path.join(self.cfg.out_dir, "metrics.png"),
                         f"{self.cfg.out_dir} ({self.cfg.init_from}, {self.model.num_params() / 1e6:.1f}M)")


if __name__ == "__main__":
    main()
