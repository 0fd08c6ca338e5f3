"""Fine-tune GPT-2 to summarize dialogues; out_dir gets the checkpoints (ckpt.pt to resume, best.pt to use).

    python train.py [preset.py|preset.json] [--key=value ...]                  one process (CPU or one GPU)
    torchrun --nproc_per_node=N --standalone train.py [...]                     DDP, N processes
    accelerate launch --multi_gpu --num_processes N train.py --backend=accelerate
    train.notebook_main(["config/kaggle_t4x2.py", ...], num_processes=2)              from a notebook cell
"""
# Reads top to bottom: main, then the Trainer's loop (fit, train_step). What a run is built from is
# summarizer/preparation.py's (prepare: the one way in); what ckpt.pt holds, summarizer/state.py's TrainingState.
import summarizer  # the standard library alone: first, before seconds of imports

summarizer.until_imported(__name__)
import collections
import math
import os
import shlex
import signal
import sys
import time
from typing import NamedTuple

import torch
from tqdm import tqdm

import data
from command_line import DiskFull, UserError, arguments
from config import FIELDS, flags_given, settings_report
from model import Targets
from summarizer import inference, run_folder
from summarizer.clock import advance, cut_short
from summarizer.evaluation import evaluate, validation_loss
from summarizer.launch import (
    STOP_SIGNALS,
    StopSignals,
    notebook_launch,
    one_line_errors,
    process_age,
    run_ending,
    saved_so_far,
    training_memory_hint,
)
from summarizer.loading import resume_path, resuming
from summarizer.preparation import prepare, read_settings
from summarizer.process import Process
from summarizer.report import predict
from summarizer.tracking import log_row, plot_metrics, progress_postfix

summarizer.imported(__name__)

NAN_PATIENCE = 3  # consecutive non-finite losses (no update is applied for them) before the run stops
SKIP_WINDOW, SKIP_WARN = 20, 5  # warn when more than SKIP_WARN of the last SKIP_WINDOW steps were skipped (fp16)
OTHER_DTYPE = "use --dtype=bfloat16 (Ampere or newer) or --dtype=float32"  # where fp16's range is the trouble
OUT_OF_TIME = "max_time"  # fit()'s reason to stop when the run's clock leaves no room for another step


def main(argv=None):
    """From the command line, max_time counts from the process's start (imports and set-up included)."""
    started = time.monotonic() - (process_age() if argv is None else 0.0)
    argv = sys.argv[1:] if argv is None else argv
    with one_line_errors():
        cfg, start_ckpt, from_run = read_settings(argv, __doc__)
        # a resume that reads out_dir/ckpt.pt: another out_dir must name it
        reads = f"--resume_from={resume_path(cfg)}" if resuming(cfg) and not cfg.resume_from else None
        # an error's line comes before the process group's teardown: under torchrun, the launcher stops this rank
        # (SIGTERM) moments after another one failed
        with Process(cfg) as proc, run_ending(cfg.out_dir, continue_command(argv, proc.world_size), proc) as signals, \
                run_folder.claimed(cfg.out_dir, proc.is_main, proc.stop_if, reads):
            if proc.is_main:
                print(settings_report(argv, os.path.join(cfg.out_dir, run_folder.CONFIG), from_run))
            trainer = Trainer(prepare(cfg, proc, start_ckpt, started, flags_given(argv)), proc, signals)
            del start_ckpt  # its tensors map the file, whose disk space a save must be able to free
            try:
                stopped_by, setup = trainer.fit(), trainer.setup
                cfg, step, clock = setup.cfg, setup.state.step, setup.clock
                short = cut_short(setup.state.schedule, step)
            finally:  # its DDP module holds the process group, which must outlive it (Process's close)
                trainer = setup = None
            say_why_it_stopped(stopped_by, cfg, proc, step, clock, short, continue_command(argv, proc.world_size))
            after_runs(cfg, proc, argv, clock)


def say_why_it_stopped(stopped_by, cfg, proc, step, clock, short, go_on):
    """Rank 0's lines for a run stopped before max_iters: by a signal (the process ends) or by max_time."""
    ckpt = os.path.join(cfg.out_dir, run_folder.CKPT)
    if stopped_by in STOP_SIGNALS:
        if proc.is_main:
            print(f"stopped by {signal.Signals(stopped_by).name} after iter {step}: {ckpt} holds it; continue with:"
                  f"\n  {go_on}")
        # under torchrun a non-zero status would add the launcher's failure report to a clean stop
        sys.exit(0 if proc.distributed else 128 + stopped_by)
    if stopped_by == OUT_OF_TIME and proc.is_main:
        if short:
            print(short)
        print(f"max_time={cfg.max_time:g}: stopped after iter {step} of {cfg.max_iters} {clock.ending()}; {ckpt} "
              f"holds it; continue with:\n  {go_on}\nor in a new session, with this output attached as input, add "
              f"--resume_from=<the attached copy of {os.path.abspath(ckpt)}>")


def after_runs(cfg, proc, argv, clock):
    """The submission first; what cannot end within the budget is not started (rank 0's clock decides)."""
    took, best = {}, os.path.join(cfg.out_dir, run_folder.BEST)
    for key, after in (("predict_after", predict), ("evaluate_after", evaluate)):
        later = continue_command(argv, proc.world_size, f"{key.split('_')[0]}.py", f"--ckpt={best}")
        skip = getattr(cfg, key) and clock and proc.is_main and clock.after_run_problem(key, later)
        if getattr(cfg, key) and not proc.all_gather_objects(skip)[0]:
            began = time.monotonic()
            after(cfg, set(FIELDS), proc)  # this run's config is the contract: every key counts as given
            took[key] = time.monotonic() - began
        elif skip:
            print(skip)
    if clock and took and clock.left() < 0 and proc.is_main:
        print(clock.after_run_ending(took))  # max_time's last word

# ---- the loop ------------------------------------------------------------------------------------------------

class StepDone(NamedTuple):
    """An optimizer step; loss: per target token over all ranks; steps_left: by rank 0's clock (-1: no budget)."""
    loss: float
    grad_norm: float
    skipped: bool
    stop_signal: int | None
    steps_left: int
    batch: data.GlobalBatch
    lr: float


class Trainer:
    """The loop of a prepared Setup (preparation.py's prepare); `signals`: the StopSignals that stop it after a step."""

    def __init__(self, setup, proc, signals=None):
        self.setup, self.proc, self.signals = setup, proc, signals or StopSignals(distributed=proc.distributed)
        self.upcoming = None  # (step, on_host(step)): the next step's micro-batches, built while a step computes
        self.skips, self.warned_at = collections.deque(maxlen=SKIP_WINDOW), -SKIP_WINDOW

    def fit(self):
        """Train to max_iters (None), or until a stop signal or the clock stops it (the signal, or OUT_OF_TIME)."""
        cfg, proc, state, clock = self.setup.cfg, self.proc, self.setup.state, self.setup.clock
        bad_steps = 0
        self.first_step = self.next_stop = state.step + 1  # next_stop: the step a stop signal received now stops after
        # closed by `with` also when an error ends the run, so the error starts on a line of its own
        bar = tqdm(total=cfg.max_iters, initial=state.step, disable=not proc.is_main, dynamic_ncols=True,
                   desc="training", unit="it")
        with self.setup.tracker, self.signals.training(lambda: self.next_stop), training_memory_hint(cfg, proc), bar:
            while state.step < cfg.max_iters:
                start = time.perf_counter()
                done = self.train_step(state.step)
                seconds = time.perf_counter() - start
                if clock:
                    clock.stepped(seconds, done.batch.tokens)
                state.step += 1
                state.skipped_steps += done.skipped
                bad_steps = 0 if math.isfinite(done.loss) else bad_steps + 1
                if bad_steps >= NAN_PATIENCE:
                    raise UserError(self.diverged(done.loss, bad_steps))
                out_of_time = done.steps_left == 0  # this session ended at its budget
                stats = self.stats(done, seconds)
                if state.step % cfg.eval_interval == 0 or state.step == cfg.max_iters or out_of_time:
                    start = time.perf_counter()
                    stats.update(self.validate())
                    self.save(stats)
                    if clock:
                        clock.evaluated(time.perf_counter() - start)
                elif done.stop_signal:
                    state.save(cfg, proc, stats, best=False)
                if proc.device.type == "cuda":  # after an evaluation: its KV cache and the save counted
                    stats["peak_mem_gb"] = torch.cuda.max_memory_allocated(proc.device) / 2**30
                if proc.is_main:
                    self.log(stats, bar, done.steps_left)
                    self.warn_of_skips(done.skipped, bar)
                if done.stop_signal or out_of_time:
                    return done.stop_signal or OUT_OF_TIME
        return None

    def stats(self, done, seconds):
        setup, state, batch = self.setup, self.setup.state, done.batch
        stats = {"iter": state.step, "loss": done.loss, "lr": done.lr, "grad_norm": done.grad_norm,
                 "tokens_per_s": batch.tokens / seconds, "ms_per_iter": 1000 * seconds,
                 "padded_fraction": 1 - batch.tokens / batch.positions, "micro_batches": len(batch.micro_batches)}
        if setup.compiled_module:  # what compiling cost, and whether the steps still run compiled
            if state.step == self.first_step:
                stats["compile_s"] = seconds  # the first step's: its compile, unless start-up's checks ran it
            if setup.compiled_module.why:
                stats["compile_fallback"] = setup.compiled_module.why
        if state.scaler.is_enabled():
            stats.update(loss_scale=state.scaler.get_scale(), skipped_steps=state.skipped_steps)
        if setup.peak_flops:
            flops = self.model.training_flops(batch.tokens, batch.targets, batch.attended)
            stats["mfu"] = flops / seconds / self.proc.world_size / setup.peak_flops
        return stats

    def diverged(self, loss, bad_steps):
        cfg, step = self.setup.cfg, self.setup.state.step
        return (f"loss is {loss} for {bad_steps} iterations in a row (iter {step}); stopped: "
                f"{saved_so_far(cfg.out_dir)}; lower learning_rate (now {cfg.learning_rate:g})"
                + f", or {OTHER_DTYPE}" * (self.proc.dtype == "float16"))

    def warn_of_skips(self, skipped, bar):
        self.skips.append(skipped)
        state = self.setup.state
        if sum(self.skips) > SKIP_WARN and state.step - self.warned_at >= SKIP_WINDOW:
            self.warned_at = state.step
            bar.write(f"warning: the fp16 GradScaler skipped {sum(self.skips)} of the last {SKIP_WINDOW} steps (loss "
                      f"scale now {state.scaler.get_scale():g}): gradients keep overflowing; lower learning_rate, or "
                      f"{OTHER_DTYPE}", file=sys.stderr)

    def train_step(self, step):
        cfg, proc, state, clock = self.setup.cfg, self.proc, self.setup.state, self.setup.clock
        upcoming, self.upcoming = self.upcoming, None
        batch, micro_batches = upcoming[1] if upcoming and upcoming[0] == step else self.on_host(step)
        # Each micro-batch's loss is a sum over its targets divided by the target count of the *global* batch
        # (times world_size, which DDP's gradient averaging divides back out): the gradient is then the
        # per-token mean over the whole global batch, however it is split across ranks and micro-steps.
        scale = proc.world_size / batch.targets
        loss_sum = torch.zeros((), device=proc.device)
        steps_left = clock.steps_left(step, batch.tokens) if clock else None
        settled = steps_left == 0 or clock.settled(step, batch.tokens) if clock else True
        for i, (x, found) in enumerate(micro_batches):
            x, found = x.to(proc.device, non_blocking=True), found.to(proc.device)
            with proc.parallel.no_sync(self.setup.module, sync=i == len(micro_batches) - 1):
                with proc.autocast():
                    _, loss = self.setup.module(x, found)
                loss = loss * len(found.index)  # summed over the micro-batch's targets
                state.scaler.scale(loss * scale).backward()
            loss_sum += loss.detach().float()
        # What stops the run travels with the losses, in one reduction and one host sync per step: the steps rank
        # 0's clock leaves after this one (-1: no budget) and whether its estimate is settled enough to cool down
        # by, and a slot per stop signal that a rank received until now (during this step too). Filled from Python
        # numbers: kernels, not host syncs.
        stops = torch.zeros(2 + len(STOP_SIGNALS), device=proc.device)
        if proc.is_main:
            stops[0], stops[1] = -1 if steps_left is None else steps_left, settled
        self.next_stop = step + 2  # first: a signal handled from here on is too late for this step's reduction
        if self.signals.stop_after == step + 1:
            stops[2 + STOP_SIGNALS.index(self.signals.received)] = 1
        if step + 1 < cfg.max_iters:  # while the device computes the step's queued kernels, before the host waits
            self.upcoming = step + 1, self.on_host(step + 1)
        reduced = proc.all_reduce_sum(torch.cat([loss_sum[None], stops])).tolist()
        loss, steps_left = reduced[0] * scale / proc.world_size, int(reduced[1])
        stop_signal = next((s for s, n in zip(STOP_SIGNALS, reduced[3:], strict=True) if n), None)
        budget = steps_left if steps_left >= 0 else None
        lr, state.schedule = advance(state.schedule, step, budget, bool(reduced[2]), steps_left == 0,
                                     self.setup.last_session)
        for group in state.optimizer.param_groups:
            group["lr"] = lr
        grad_norm, skipped = math.nan, True
        if math.isfinite(loss):
            state.scaler.unscale_(state.optimizer)  # true gradients, for the norm and the clipping
            grad_norm = torch.nn.utils.clip_grad_norm_(self.model.parameters(), cfg.grad_clip or math.inf).item()
            loss_scale = state.scaler.get_scale()
            state.scaler.step(state.optimizer)  # with fp16, skips the update if any gradient overflowed
            state.scaler.update()
            skipped = state.scaler.get_scale() < loss_scale
        state.optimizer.zero_grad(set_to_none=not proc.parallel.keeps_gradients)
        return StepDone(loss, grad_norm, skipped, stop_signal, steps_left, batch, lr)

    def on_host(self, step):
        """(global batch `step`, its micro-batches), pinned on CUDA: their copies wait for nothing the device does."""
        batch = self.setup.batches(step)
        kept = (lambda t: t.pin_memory()) if self.proc.device.type == "cuda" else (lambda t: t)
        return batch, [(kept(x), Targets(*map(kept, Targets.of(y)))) for x, y in batch.micro_batches]

    @torch.no_grad()
    def validate(self):
        setup, proc = self.setup, self.proc
        if not len(setup.val_set):  # best_metric=last without validation rows: nothing to measure
            return {}
        self.model.eval()
        metrics = {"val_loss": validation_loss(self.model, setup.val_set, setup.cfg, proc)}
        if setup.rouge_prompts:
            start = time.perf_counter()
            model = inference.rouge_model(self.model, setup.cfg, proc)
            predictions = inference.summarize_on_ranks(model, setup.rouge_prompts, setup.cfg, proc, progress=False)
            if setup.clock:
                setup.clock.summarized(time.perf_counter() - start, len(predictions))
            metrics.update(inference.rouge(predictions, setup.val_set.summaries[:len(predictions)]))
        self.model.train()
        return metrics

    def save(self, stats):
        """Diverged weights are not worth resuming from: a non-finite val_loss keeps the previous checkpoints."""
        cfg, state = self.setup.cfg, self.setup.state
        if not math.isfinite(stats.get("val_loss", 0.0)):
            if self.proc.is_main:
                print(f"warning: val_loss is {stats['val_loss']} at iter {state.step}; keeping the previous "
                      f"checkpoints", file=sys.stderr)
            return
        best = state.improved(stats, cfg.best_metric)
        if best and cfg.best_metric != "last":
            state.best_score, state.best_val_loss = stats[cfg.best_metric], stats["val_loss"]
        state.save(cfg, self.proc, stats, best=best)

    def log(self, stats, bar, steps_left):
        """Rank 0: metrics.jsonl and log_to, the progress bar, and after an evaluation its line and the plot."""
        cfg, state = self.setup.cfg, self.setup.state
        if state.step % cfg.log_interval == 0 or "val_loss" in stats:
            log_row(cfg.out_dir, stats, self.setup.tracker)
        clock = self.setup.clock
        bar.set_postfix(progress_postfix(stats, state.skipped_steps if state.scaler.is_enabled() else None,
                                         (clock.left(), steps_left) if clock else None))
        bar.update(1)
        if "val_loss" in stats:
            scores = " ".join(f"{k} {stats[k]:.4f}" for k in ("val_loss", "rouge1", "rouge2", "rougeL") if k in stats)
            bar.write(f"iter {state.step}: {scores}")
            try:  # the plot is a view of metrics.jsonl: a full disk skips it, the run goes on
                plot_metrics(os.path.join(cfg.out_dir, run_folder.METRICS),
                             os.path.join(cfg.out_dir, run_folder.PLOT),
                             f"{cfg.out_dir} ({cfg.init_from}, {self.model.num_params() / 1e6:.1f}M)")
            except DiskFull as e:
                bar.write(f"warning: {e}: {run_folder.PLOT} is not updated; training goes on", file=sys.stderr)

    @property
    def model(self):
        return self.setup.state.model


# ---- the command line ----------------------------------------------------------------------------------------

def notebook_main(argv=(), num_processes=2, port=29500):
    """Train from a notebook cell in one process per GPU (Kaggle's 2x T4)."""
    notebook_launch(main, list(argv), num_processes, port)


def continue_command(argv, world_size, script="train.py", last="--init_from=resume"):
    """The command line that resumes this run (or runs `script` with `last`), under torchrun for several processes."""
    presets, flags = arguments(argv)
    # a learning_rate given to a resume restarts a decay that has ended: continuing leaves it out (ckpt.pt has it)
    kept = (f for f in flags if not f.startswith(("--init_from=", "--resume_from=", "--learning_rate=", "--ckpt=")))
    launcher = (["torchrun", f"--nproc_per_node={os.environ.get('LOCAL_WORLD_SIZE', world_size)}", "--standalone"]
                if world_size > 1 else ["python"])
    return shlex.join([*launcher, script, *presets, *kept, last])


if __name__ == "__main__":
    main()
