"""Fine-tune GPT-2 to summarize dialogues.

    python train.py [preset.py|preset.json] [--key=value ...]                  one process (CPU or one GPU)
    torchrun --nproc_per_node=N --standalone train.py [...]                     DDP, N processes
    accelerate launch --multi_gpu --num_processes N train.py --backend=accelerate
    train.notebook_main(["config/kaggle_t4x2.py", ...], num_processes=2)              from a notebook cell

Writes its checkpoints (ckpt.pt to resume, best.pt to use), config.json, metrics and logs into out_dir; with a
time budget (--max_time) it stops in time to save and to run evaluate_after/predict_after.
"""
# Reads top to bottom: main, then the Trainer's loop (fit, train_step). What a run is built from is
# summarizer/preparation.py's (prepare: the one way in); what ckpt.pt holds, summarizer/state.py's TrainingState.
from summarizer import quiet_start  # the standard library alone: first, before seconds of imports

quiet_start.until_imported(__name__)
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
from command_line import UserError, arguments
from config import FIELDS, flags_given
from model import Targets
from summarizer import inference, run_folder
from summarizer.checkpoint import intact_in
from summarizer.evaluation import evaluate, validation_loss
from summarizer.files import DiskFull
from summarizer.launch import (
    STOP_SIGNALS,
    StopSignals,
    error_lines,
    full_disk_keeps_checkpoints,
    lost_rank_keeps_checkpoints,
    notebook_launch,
    one_line_errors,
    process_age,
    training_memory_hint,
)
from summarizer.loading import resume_path, resuming
from summarizer.preparation import prepare, run_settings
from summarizer.report import predict
from summarizer.runtime import Runtime
from summarizer.schedule import advance, cut_short
from summarizer.settings_report import settings_report
from summarizer.tracking import log_row, plot_metrics, progress_postfix

quiet_start.imported(__name__)

NAN_PATIENCE = 3  # consecutive non-finite losses (no update is applied for them) before the run stops
SKIP_WINDOW, SKIP_WARN = 20, 5  # warn when more than SKIP_WARN of the last SKIP_WINDOW steps were skipped (fp16)
OUT_OF_TIME = "max_time"  # fit()'s reason to stop when the run's clock leaves no room for another step


def main(argv=None):
    """Entry point for the command line and for the notebook launcher; errors end in one line. From the command
    line, max_time counts from the process's start (imports and set-up included)."""
    started = time.monotonic() - (process_age() if argv is None else 0.0)
    argv = sys.argv[1:] if argv is None else argv
    with one_line_errors():
        cfg, start_ckpt, from_run = run_settings(argv, __doc__)
        # a resume that reads out_dir/ckpt.pt: another out_dir must name it
        reads = f"--resume_from={resume_path(cfg)}" if resuming(cfg) and not cfg.resume_from else None
        # an error's line comes before the process group's teardown: under torchrun, the launcher stops this rank
        # (SIGTERM) moments after another one failed
        with Runtime(cfg) as rt, one_line_errors(), error_lines(cfg.out_dir), \
                run_folder.claimed(cfg.out_dir, rt.is_main, rt.stop_if, reads):
            if rt.is_main:
                print(settings_report(argv, os.path.join(cfg.out_dir, run_folder.CONFIG), from_run))
            go_on = continue_command(argv, rt.world_size)
            ckpt = os.path.join(cfg.out_dir, run_folder.CKPT)
            signals = StopSignals(lambda step: f"stopping after iter {step}, then saving {ckpt}" if rt.is_main
                                  else None, lambda: saved_so_far(cfg.out_dir), rt.distributed)
            with signals, full_disk_keeps_checkpoints(cfg.out_dir), \
                    lost_rank_keeps_checkpoints(cfg.out_dir, go_on, rt.distributed):
                trainer = Trainer(prepare(cfg, rt, start_ckpt, started, flags_given(argv)), rt, signals)
                cfg = trainer.run.cfg  # micro_batch_size=auto chosen
                del start_ckpt  # its tensors map the file, whose disk space a save must be able to free
                try:
                    stopped_by = trainer.fit()
                    step, clock, schedule = trainer.run.state.step, trainer.run.clock, trainer.run.state.schedule
                finally:  # its DDP module holds the process group, which must outlive it (Runtime's close)
                    trainer = None
            if stopped_by in STOP_SIGNALS:
                if rt.is_main:
                    print(f"stopped by {signal.Signals(stopped_by).name} after iter {step}: "
                          f"{ckpt} holds it; continue with:\n  {go_on}")
                # under torchrun a non-zero status would add the launcher's failure report to a clean stop
                sys.exit(0 if rt.distributed else 128 + stopped_by)
            if stopped_by == OUT_OF_TIME and rt.is_main:
                if short := cut_short(schedule, step):
                    print(short)
                print(f"max_time={cfg.max_time:g}: stopped after iter {step} of {cfg.max_iters} "
                      f"{clock.ending()}; {ckpt} holds it; continue with:\n  {go_on}\n"
                      f"or in a new session, with this output attached as input, add "
                      f"--resume_from=<the attached copy of {os.path.abspath(ckpt)}>")
            # this run's config is the contract: every key counts as given
            took, best = {}, os.path.join(cfg.out_dir, run_folder.BEST)  # took: for max_time's last word
            for key, after in (("predict_after", predict), ("evaluate_after", evaluate)):  # the submission first
                # what cannot end within the budget is not started (rank 0's clock decides for every rank)
                later = continue_command(argv, rt.world_size, f"{key.split('_')[0]}.py", f"--ckpt={best}")
                skip = getattr(cfg, key) and clock and rt.is_main and clock.after_run_problem(key, later)
                if getattr(cfg, key) and not rt.all_gather_objects(skip)[0]:
                    began = time.monotonic()
                    after(cfg, set(FIELDS), rt)
                    took[key] = time.monotonic() - began
                elif skip:
                    print(skip)
            if clock and took and clock.left() < 0 and rt.is_main:
                print(clock.after_run_ending(took))

# ---- the loop ------------------------------------------------------------------------------------------------

class StepDone(NamedTuple):
    """An optimizer step: the mean loss per target token over all ranks, the gradient norm before clipping,
    skipped (an fp16 overflow or a non-finite loss), the stop signal some rank received (or None), the steps
    max_time leaves after it by rank 0's clock (-1: no budget), the GlobalBatch it trained on, its learning rate."""
    loss: float
    grad_norm: float
    skipped: bool
    stop_signal: int | None
    steps_left: int
    batch: data.GlobalBatch
    lr: float


class Trainer:
    """The loop of a prepared Run (summarizer/preparation.py's prepare, the one way in): fit() trains it. `signals`:
    the StopSignals that ask the run to stop after a step (else none)."""

    def __init__(self, run, rt, signals=None):
        self.run, self.rt, self.signals = run, rt, signals or StopSignals(None, lambda: "", rt.distributed)
        self.upcoming = None  # (step, on_host(step)): the next step's micro-batches, built while a step computes

    def fit(self):
        """Train to max_iters, or until a stop signal or the run's clock stops it after a step (which it returns:
        a signal number or OUT_OF_TIME; None at max_iters)."""
        cfg, rt, state, clock = self.run.cfg, self.rt, self.run.state, self.run.clock
        bad_steps, skips, warned_at = 0, collections.deque(maxlen=SKIP_WINDOW), -SKIP_WINDOW
        first_step = self.next_stop = state.step + 1  # next_stop: the step a stop signal received now stops after
        # closed by `with` also when an error ends the run, so the error starts on a line of its own
        bar = tqdm(total=cfg.max_iters, initial=state.step, disable=not rt.is_main, dynamic_ncols=True,
                   desc="training", unit="it")
        with self.run.tracker, self.signals.training(lambda: self.next_stop), training_memory_hint(cfg, rt), bar:
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
                    fix = (f"lower learning_rate (now {cfg.learning_rate:g})" + (
                        ", or use --dtype=bfloat16 (Ampere or newer) or --dtype=float32" if rt.dtype == "float16"
                        else ""))
                    raise UserError(f"loss is {done.loss} for {bad_steps} iterations in a row (iter {state.step}); "
                                    f"stopped: {saved_so_far(cfg.out_dir)}; {fix}")
                out_of_time = done.steps_left == 0  # this session ended at its budget
                stats = {"iter": state.step, "loss": done.loss, "lr": done.lr, "grad_norm": done.grad_norm,
                         "tokens_per_s": done.batch.tokens / seconds, "ms_per_iter": 1000 * seconds,
                         "padded_fraction": 1 - done.batch.tokens / done.batch.positions,
                         "micro_batches": len(done.batch.micro_batches)}
                if self.run.compiled_module:  # what compiling cost, and whether the steps still run compiled
                    if state.step == first_step:
                        stats["compile_s"] = seconds  # the first step's: its compile, unless start-up's checks ran it
                    if self.run.compiled_module.why:
                        stats["compile_fallback"] = self.run.compiled_module.why
                if state.scaler.is_enabled():
                    stats.update(loss_scale=state.scaler.get_scale(), skipped_steps=state.skipped_steps)
                if self.run.peak_flops:
                    flops = self.model.training_flops(done.batch.tokens, done.batch.targets, done.batch.attended)
                    stats["mfu"] = flops / seconds / rt.world_size / self.run.peak_flops
                if state.step % cfg.eval_interval == 0 or state.step == cfg.max_iters or out_of_time:
                    start = time.perf_counter()
                    stats.update(self.validate())
                    self.save(stats)
                    if clock:
                        clock.evaluated(time.perf_counter() - start)
                elif done.stop_signal:
                    state.save(cfg, rt, stats, best=False)
                if rt.device.type == "cuda":  # after an evaluation: its KV cache and the save counted
                    stats["peak_mem_gb"] = torch.cuda.max_memory_allocated(rt.device) / 2**30
                skips.append(done.skipped)
                if rt.is_main:
                    self.log(stats, bar, done.steps_left)
                    if sum(skips) > SKIP_WARN and state.step - warned_at >= SKIP_WINDOW:
                        warned_at = state.step
                        bar.write(f"warning: the fp16 GradScaler skipped {sum(skips)} of the last {SKIP_WINDOW} "
                                  f"steps (loss scale now {state.scaler.get_scale():g}): gradients keep "
                                  f"overflowing; lower learning_rate, or use --dtype=bfloat16 (Ampere or newer) "
                                  f"or --dtype=float32", file=sys.stderr)
                if done.stop_signal or out_of_time:
                    return done.stop_signal or OUT_OF_TIME
        return None

    def train_step(self, step):
        """One optimizer step over global batch `step` (0-based); see StepDone."""
        cfg, rt, state, clock = self.run.cfg, self.rt, self.run.state, self.run.clock
        upcoming, self.upcoming = self.upcoming, None
        batch, micro_batches = upcoming[1] if upcoming and upcoming[0] == step else self.on_host(step)
        # Each micro-batch's loss is a sum over its targets divided by the target count of the *global* batch
        # (times world_size, which DDP's gradient averaging divides back out): the gradient is then the
        # per-token mean over the whole global batch, however it is split across ranks and micro-steps.
        scale = rt.world_size / batch.targets
        loss_sum = torch.zeros((), device=rt.device)
        steps_left = clock.steps_left(step, batch.tokens) if clock else None
        settled = steps_left == 0 or clock.settled(step, batch.tokens) if clock else True
        for i, (x, found) in enumerate(micro_batches):
            x, found = x.to(rt.device, non_blocking=True), found.to(rt.device)
            with rt.parallel.no_sync(self.run.module, sync=i == len(micro_batches) - 1):
                with rt.autocast():
                    _, loss = self.run.module(x, found)
                loss = loss * len(found.index)  # summed over the micro-batch's targets
                state.scaler.scale(loss * scale).backward()
            loss_sum += loss.detach().float()
        # What stops the run travels with the losses, in one reduction and one host sync per step: the steps rank
        # 0's clock leaves after this one (-1: no budget) and whether its estimate is settled enough to cool down
        # by, and a slot per stop signal that a rank received until now (during this step too). Filled from Python
        # numbers: kernels, not host syncs.
        stops = torch.zeros(2 + len(STOP_SIGNALS), device=rt.device)
        if rt.is_main:
            stops[0], stops[1] = -1 if steps_left is None else steps_left, settled
        self.next_stop = step + 2  # first: a signal handled from here on is too late for this step's reduction
        if self.signals.stop_after == step + 1:
            stops[2 + STOP_SIGNALS.index(self.signals.received)] = 1
        if step + 1 < cfg.max_iters:  # while the device computes the step's queued kernels, before the host waits
            self.upcoming = step + 1, self.on_host(step + 1)
        reduced = rt.all_reduce_sum(torch.cat([loss_sum[None], stops])).tolist()
        loss, steps_left = reduced[0] * scale / rt.world_size, int(reduced[1])
        stop_signal = next((s for s, n in zip(STOP_SIGNALS, reduced[3:], strict=True) if n), None)
        budget = steps_left if steps_left >= 0 else None
        lr, state.schedule = advance(state.schedule, step, budget, bool(reduced[2]), steps_left == 0,
                                     self.run.last_session)
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
        state.optimizer.zero_grad(set_to_none=not rt.parallel.keeps_gradients)
        return StepDone(loss, grad_norm, skipped, stop_signal, steps_left, batch, lr)

    def on_host(self, step):
        """(global batch `step`, its micro-batches as (x, Targets)), pinned on CUDA: their copies to the device
        then wait for nothing the device does."""
        batch = self.run.batches(step)
        kept = (lambda t: t.pin_memory()) if self.rt.device.type == "cuda" else (lambda t: t)
        return batch, [(kept(x), Targets(*map(kept, Targets.of(y)))) for x, y in batch.micro_batches]

    @torch.no_grad()
    def validate(self):
        """Validation loss and ROUGE on a fixed validation subset, summarized in the same batches as one process
        would; every rank returns the same numbers."""
        run, rt = self.run, self.rt
        if not len(run.val_set):  # best_metric=last without validation rows: nothing to measure
            return {}
        self.model.eval()
        metrics = {"val_loss": validation_loss(self.model, run.val_set, run.cfg, rt)}
        if run.rouge_prompts:
            start = time.perf_counter()
            model = inference.rouge_model(self.model, run.cfg, rt)
            predictions = inference.summarize_on_ranks(model, run.rouge_prompts, run.cfg, rt, progress=False)
            if run.clock:
                run.clock.summarized(time.perf_counter() - start, len(predictions))
            metrics.update(inference.rouge(predictions, run.val_set.summaries[:len(predictions)]))
        self.model.train()
        return metrics

    def save(self, stats):
        """After an evaluation: ckpt.pt, and best.pt when the configured metric improved; diverged weights are not
        worth resuming from, so a non-finite val_loss keeps the previous checkpoints."""
        cfg, state = self.run.cfg, self.run.state
        if not math.isfinite(stats.get("val_loss", 0.0)):
            if self.rt.is_main:
                print(f"warning: val_loss is {stats['val_loss']} at iter {state.step}; keeping the previous "
                      f"checkpoints", file=sys.stderr)
            return
        best = state.improved(stats, cfg.best_metric)
        if best and cfg.best_metric != "last":
            state.best_score, state.best_val_loss = stats[cfg.best_metric], stats["val_loss"]
        state.save(cfg, self.rt, stats, best=best)

    def log(self, stats, bar, steps_left):
        """Rank 0: metrics.jsonl and log_to every log_interval steps and at evaluations, the progress bar (with the
        `steps_left` that max_time leaves), and the plot after an evaluation."""
        cfg, state = self.run.cfg, self.run.state
        if state.step % cfg.log_interval == 0 or "val_loss" in stats:
            log_row(cfg.out_dir, stats, self.run.tracker)
        clock = self.run.clock
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
        return self.run.state.model


# ---- the command line ----------------------------------------------------------------------------------------

def saved_so_far(out_dir):
    """What a run stopped now leaves: its checkpoints that load, or that none was saved yet."""
    intact = intact_in(out_dir)
    return f"intact: {', '.join(intact)}" if intact else f"nothing is saved in {out_dir} yet"


def notebook_main(argv=(), num_processes=2, port=29500):
    """Train from a notebook cell in `num_processes` processes, one per GPU (Kaggle's 2x T4)."""
    notebook_launch(main, list(argv), num_processes, port)


def continue_command(argv, world_size, script="train.py", last="--init_from=resume"):
    """The command line that resumes this run from out_dir/ckpt.pt: its arguments with --init_from=resume (or runs
    `script` with `last`: an after-run done later), under torchrun when the run had several processes."""
    presets, flags = arguments(argv)
    # a learning_rate given to a resume restarts a decay that has ended: continuing leaves it out (ckpt.pt has it)
    kept = (f for f in flags if not f.startswith(("--init_from=", "--resume_from=", "--learning_rate=", "--ckpt=")))
    launcher = (["torchrun", f"--nproc_per_node={os.environ.get('LOCAL_WORLD_SIZE', world_size)}", "--standalone"]
                if world_size > 1 else ["python"])
    return shlex.join([*launcher, script, *presets, *kept, last])


if __name__ == "__main__":
    main()
