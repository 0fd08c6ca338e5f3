"""Fine-tune GPT-2 to summarize dialogues.

    python train.py [preset.py|preset.json] [--key=value ...]                  one process (CPU or one GPU)
    torchrun --nproc_per_node=N --standalone train.py [...]                     DDP, N processes
    accelerate launch --multi_gpu --num_processes N train.py --backend=accelerate
    train.notebook_main(["config/kaggle_t4x2.py", ...], num_processes=2)              from a notebook cell

Writes its checkpoints (ckpt.pt to resume, best.pt to use), config.json, metrics and logs into out_dir; with a
time budget (--max_time) it stops in time to save and to run evaluate_after/predict_after.
"""
# Reads top to bottom: main, then the Trainer: its set-up and its loop (fit, train_step), which stops at max_iters,
# at a stop signal (summarizer/launch.py) or when the run's clock (summarizer/clock.py) leaves no room for another
# step; then what main reads from the command line and what a run is built from (data, the ROUGE model, the
# objective). The checkpoint's contents are summarizer.state's TrainingState; out_dir is summarizer.run_folder's.
from summarizer import quiet_start  # the standard library alone: first, before seconds of imports

quiet_start.until_imported(__name__)
import collections
import contextlib
import math
import os
import shlex
import signal
import sys
import time
from dataclasses import asdict, replace
from typing import NamedTuple

import torch
from tqdm import tqdm

import data
from config import (
    FIELDS,
    Use,
    arguments,
    flags_given,
    grad_accum_steps,
    load_config,
    own_keys,
    resolve,
    settings_given,
)
from model import GPT, GPTConfig, Targets
from summarizer import inference, lora, run_folder
from summarizer.checkpoint import intact_in
from summarizer.clock import RunClock, start_up_deadline
from summarizer.compiling import CompiledModule, compile_model
from summarizer.errors import DiskFull, UserError
from summarizer.evaluation import evaluate, validation_loss
from summarizer.launch import (
    STOP_SIGNALS,
    StopSignals,
    full_disk_keeps_checkpoints,
    lost_rank_keeps_checkpoints,
    notebook_launch,
    one_line_errors,
    out_of_memory_hint,
    process_age,
    rank_error_lines,
)
from summarizer.loading import (
    check_shape,
    is_checkpoint,
    kept_lora_base,
    model_to_train,
    resume_path,
    resuming,
    start_checkpoint,
)
from summarizer.memory import choose_micro_batch
from summarizer.metrics import rouge
from summarizer.runtime import Runtime
from summarizer.schedule import cooled, decayed, learning_rate, sessions_done
from summarizer.settings_report import FromRun, check_command, save_config, settings_report
from summarizer.state import TrainingState, rng_state, set_rng_state
from summarizer.submission import check_against_sample, predict
from summarizer.tracking import Tracker, log_row, peak_flops, plot_metrics, progress_postfix, resumed_history

quiet_start.imported(__name__)

NAN_PATIENCE = 3  # consecutive non-finite losses (no update is applied for them) before the run stops
SKIP_WINDOW, SKIP_WARN = 20, 5  # warn when more than SKIP_WARN of the last SKIP_WINDOW steps were skipped (fp16)
OUT_OF_TIME = "max_time"  # fit()'s reason to stop when the run's clock leaves no room for another step


def main(argv=None, objective=None, script="train.py", usage=__doc__):
    """Entry point for the command line and for the notebook launcher; errors end in one line. From the command
    line, max_time counts from the process's start (imports and set-up included). `objective`: what a step
    minimizes, TokenLoss unless a stage built on this loop (`script`, whose --help prints `usage`) brings its own."""
    started = time.monotonic() - (process_age() if argv is None else 0.0)
    argv = sys.argv[1:] if argv is None else argv
    with one_line_errors():
        cfg, checkpoint, from_run = run_settings(argv, objective or TokenLoss, script, usage)
        # a resume that reads out_dir/ckpt.pt: another out_dir must name it
        reads = f"--resume_from={resume_path(cfg)}" if resuming(cfg) and not cfg.resume_from else None
        # an error's line comes before the process group's teardown: under torchrun, the launcher stops this rank
        # (SIGTERM) moments after another one failed
        with Runtime(cfg) as rt, one_line_errors(), rank_error_lines(), \
                run_folder.claimed(cfg.out_dir, rt.is_main, rt.stop_if, reads):
            if rt.is_main:
                config_json = os.path.join(cfg.out_dir, run_folder.CONFIG)
                print(settings_report(argv, config_json, from_run))
            go_on = continue_command(script, argv, rt.world_size)
            ckpt, trainer = os.path.join(cfg.out_dir, run_folder.CKPT), None
            signals = StopSignals(lambda: f"stopping after iter {trainer.state.step + 1}, then saving {ckpt}"
                                  if rt.is_main else None, lambda: saved_so_far(cfg.out_dir), rt.distributed)
            with signals, full_disk_keeps_checkpoints(cfg.out_dir), lost_rank_keeps_checkpoints(cfg.out_dir, go_on):
                with start_up_deadline(cfg.max_time, started, time.monotonic):
                    trainer = Trainer(cfg, rt, objective, checkpoint, started, signals)
                cfg = trainer.cfg  # micro_batch_size=auto chosen
                del checkpoint  # its tensors map the file, whose disk space a save must be able to free
                try:
                    stopped_by = trainer.fit()
                    step, clock = trainer.state.step, trainer.clock
                finally:  # its DDP module holds the process group, which must outlive it (Runtime's close)
                    trainer = None
            # the compiled work is a cache: a folder that cannot keep it costs later commands a compile, no more
            with contextlib.suppress(OSError, DiskFull):
                rt.save_compiled_work(cfg.out_dir)
            if stopped_by in STOP_SIGNALS:
                if rt.is_main:
                    print(f"stopped by {signal.Signals(stopped_by).name} after iter {step}: "
                          f"{ckpt} holds it; continue with:\n  {go_on}")
                # under torchrun a non-zero status would add the launcher's failure report to a clean stop
                sys.exit(0 if rt.distributed else 128 + stopped_by)
            if stopped_by == OUT_OF_TIME and rt.is_main:
                print(f"max_time={cfg.max_time:g}: stopped after iter {step} of {cfg.max_iters} "
                      f"{clock.ending()}; {ckpt} holds it; continue with:\n"
                      f"  {go_on}\n"
                      f"or in a new session, with this output attached as input, add "
                      f"--resume_from=<the attached copy of {os.path.abspath(ckpt)}>")
            # this run's config is the contract: every key counts as given
            if cfg.evaluate_after:
                evaluate(cfg, set(FIELDS), rt)
            if cfg.predict_after:
                predict(cfg, set(FIELDS), rt)

# ---- the trainer -------------------------------------------------------------------------------------------

class StepDone(NamedTuple):
    """An optimizer step: the mean loss per target token over all ranks, the gradient norm before clipping,
    skipped (an fp16 overflow or a non-finite loss), the objective's second loss term per dialogue, the stop
    signal some rank received (or None), the steps max_time leaves after it by rank 0's clock (-1: no budget),
    the GlobalBatch it trained on, and its learning rate."""
    loss: float
    grad_norm: float
    skipped: bool
    extra: float
    stop_signal: int | None
    steps_left: int
    batch: data.GlobalBatch
    lr: float


class Trainer:
    """A training run: set up in __init__ (out_dir, data, model, objective, state, compile), then fit() runs the
    loop. Its TrainingState is what ckpt.pt holds. `start`: the checkpoint train.main loaded to resume or start
    from (else it is loaded here); `started`: what max_time counts from (else now); `signals`: the StopSignals
    that ask the run to stop after a step (else none)."""

    def __init__(self, cfg, rt, objective=None, start=None, started=None, signals=None):
        self.cfg, self.rt, self.clock = cfg, rt, None
        self.signals = signals or StopSignals(None, lambda: "", rt.distributed)
        Tracker(cfg, rt.is_main)  # a missing package or login stops the run before any work
        splits, after_summaries = datasets(cfg, rt)
        self.train_set, self.val_set = splits.train, splits.val
        if cfg.max_time is not None:  # counts from `started`: whatever start-up takes is inside the budget
            self.clock = RunClock(cfg.max_time, time.monotonic() if started is None else started, time.monotonic,
                                  cfg.eval_interval, min(cfg.rouge_samples, len(self.val_set)), after_summaries,
                                  int(cfg.evaluate_after) + int(cfg.predict_after),
                                  step_tokens=cfg.batch_size * float((self.train_set.lengths - 1).mean()))
        self.starting("building the model")
        torch.manual_seed(cfg.seed)  # identical initial weights on every rank
        model, ckpt = model_to_train(cfg, start)
        self.micro_batch = None  # micro_batch_size=auto: the choice, in words
        if cfg.micro_batch_size == "auto":
            self.starting("planning memory for micro_batch_size=auto")
            rows, self.micro_batch = choose_micro_batch(cfg, rt, model, self.train_set, self.val_set)
            self.cfg = cfg = replace(cfg, micro_batch_size=rows)
        self.accum_steps = grad_accum_steps(cfg, rt.world_size)
        self.tracker = Tracker(cfg, rt.is_main)  # the one that logs: its hyperparameters are the chosen settings
        base = kept_lora_base(cfg, model, ckpt) if rt.is_main else None
        disk = run_folder.DiskPlan(model, cfg, small_lora=base is not None, train_rows=len(self.train_set))
        if self.clock:  # an evaluation before one is timed: its validation loss's tokens and its saves' bytes
            rows = len(self.val_set)
            read = min(1, (cfg.eval_val_batches * cfg.micro_batch_size or rows) / max(1, rows))
            self.clock.validation_tokens = float((self.val_set.lengths - 1).sum()) * read
            self.clock.save_bytes = disk.ckpt + disk.best
        rt.stop_if(disk.problem(resuming(cfg)) if rt.is_main else None)
        # before anything compiles: the compiled work of the run this one continues, starts from or replaces
        start_folder = os.path.dirname(os.path.abspath(resume_path(cfg) if resuming(cfg) else
                                                       cfg.init_from if is_checkpoint(cfg.init_from) else
                                                       os.path.join(cfg.out_dir, run_folder.CKPT)))
        cached = rt.load_compiled_work(start_folder)
        # every input is checked: an earlier run's files can go aside
        moved = run_folder.set_aside_earlier_run(cfg.out_dir) if rt.is_main and not resuming(cfg) else None
        if moved:
            print(moved)
        model.gradient_checkpointing = cfg.gradient_checkpointing
        model = model.to(rt.device)
        self.objective = (objective or TokenLoss)(cfg, rt, self.train_set, model, ckpt)
        self.state = TrainingState.start(rt.parallel.shard(model), cfg, rt,
                                         train_rows=self.train_set.fingerprints(),
                                         validation_digest=self.val_set.digest, lora_base=base,
                                         base=ckpt["config"]["init_from"] if ckpt else cfg.init_from,
                                         extra=dict(self.objective.checkpoint_keys))
        torch.manual_seed(cfg.seed + rt.rank)  # dropout masks differ per rank
        notes = list(splits.notes) + ([cached] if cached and rt.is_main else [])
        if ckpt is not None:
            notes += self.state.restore(ckpt, cfg, rt, resume_path(cfg))
            if rt.is_main:
                notes += filter(None, [resumed_history(resume_path(cfg), cfg.out_dir, self.state.step)])
        n = min(cfg.rouge_samples, len(self.val_set))
        self.rouge_prompts, _ = inference.Summarizer(self.model, cfg).prompts(self.val_set.dialogues[:n])
        # compiled or eager: the decoding of every evaluation and of evaluate_after/predict_after, in this process
        evaluations = (cfg.max_iters - self.state.step) // cfg.eval_interval + 1
        self.decode_step, self.decoding = rt.decoding(
            evaluations * inference.decode_steps(len(self.rouge_prompts), cfg, rt.world_size)
            + inference.decode_steps(after_summaries, cfg, rt.world_size), self.model.config.n_layer)
        self.module, self.compiled, self.compile_seconds = self.step_module()
        if self.clock:
            self.prime_clock(after_summaries)
        # max_time's cooldown comes in the last of the sessions the run is planned over
        self.last_session = sessions_done(self.state.schedule) + 1 >= cfg.sessions
        self.peak = peak_flops(rt.device_name, rt.dtype) if rt.device.type == "cuda" else None
        if rt.is_main:
            if cfg.lora_rank and cfg.init_from == "scratch":
                print(f"warning: lora_rank={cfg.lora_rank} with init_from=scratch trains small adapters on frozen "
                      f"random weights, which learns little: start from GPT-2 (init_from=gpt2) or train every "
                      f"weight (lora_rank=0)", file=sys.stderr)
            print("\n".join([*notes, *self.start_lines(disk)]))
            save_config(cfg, os.path.join(cfg.out_dir, run_folder.CONFIG))
    def fit(self):
        """Train to max_iters, or until a stop signal or the run's clock stops it after a step (which it returns:
        a signal number or OUT_OF_TIME; None at max_iters)."""
        cfg, rt, state, clock = self.cfg, self.rt, self.state, self.clock
        if clock:  # every rank stops with rank 0's verdict
            rt.stop_if(clock.start_up_problem() if rt.is_main else None)
        bad_steps, skips, warned_at = 0, collections.deque(maxlen=SKIP_WINDOW), -SKIP_WINDOW
        first_step = state.step + 1
        # closed by `with` also when an error ends the run, so the error starts on a line of its own
        bar = tqdm(total=cfg.max_iters, initial=state.step, disable=not rt.is_main, dynamic_ncols=True,
                   desc="training", unit="it")
        with self.tracker, self.signals.training(), memory_hint(cfg, rt), bar:
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
                batch = done.batch
                stats = {"iter": state.step, "loss": done.loss, "lr": done.lr, "grad_norm": done.grad_norm,
                         "tokens_per_s": batch.tokens / seconds, "ms_per_iter": 1000 * seconds}
                if self.objective.extra_loss:
                    stats[self.objective.extra_loss] = done.extra
                if self.compiled_module:  # what compiling cost, and whether the steps still run compiled
                    if state.step == first_step:
                        stats["compile_s"] = self.compile_seconds
                    if self.compiled_module.fallback.failed:
                        stats["compile_fallback"] = self.compiled_module.fallback.why
                if state.scaler.is_enabled():
                    stats.update(loss_scale=state.scaler.get_scale(), skipped_steps=state.skipped_steps)
                if self.peak:
                    flops = self.model.training_flops(batch.tokens, batch.targets, batch.attended)
                    stats["mfu"] = flops / seconds / rt.world_size / self.peak
                if state.step % cfg.eval_interval == 0 or state.step == cfg.max_iters or out_of_time:
                    start = time.perf_counter()
                    stats.update(self.validate())
                    self.checkpoint(stats)
                    if clock:
                        clock.evaluated(time.perf_counter() - start)
                elif done.stop_signal:
                    state.save(cfg, rt, stats, best=False)
                if rt.device.type == "cuda":  # after an evaluation: its KV cache and the save counted
                    stats["peak_mem_gb"] = torch.cuda.max_memory_allocated(rt.device) / 2**30
                skips.append(done.skipped)
                if rt.is_main:
                    self.log(stats, bar)
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
        cfg, rt, state = self.cfg, self.rt, self.state
        batch = self.objective.batches(step)
        # Each micro-batch's loss is a sum over its targets divided by the target count of the *global* batch
        # (times world_size, which DDP's gradient averaging divides back out): the gradient is then the
        # per-token mean over the whole global batch, however it is split across ranks and micro-steps.
        scale = rt.world_size / batch.targets
        loss_sum, extra_sum = torch.zeros((), device=rt.device), torch.zeros((), device=rt.device)
        steps_left = self.clock.steps_left(step, batch.tokens) if self.clock else None
        settled = steps_left == 0 or self.clock.settled(step, batch.tokens) if self.clock else True
        for i, micro_batch in enumerate(batch.micro_batches):
            with rt.parallel.no_sync(self.module, sync=i == len(batch.micro_batches) - 1):
                with rt.autocast():
                    token_loss, weighed, extra = self.objective.losses(
                        self.module, self.objective.on_device(micro_batch, rt.device))
                state.scaler.scale(token_loss * scale + weighed).backward()
            loss_sum += token_loss.detach().float()
            extra_sum += extra.detach().float()
        # What stops the run travels with the losses, in one reduction and one host sync per step: the steps rank
        # 0's clock leaves after this one (-1: no budget) and whether its estimate is settled enough to cool down
        # by, and a slot per stop signal that a rank received until now (during this step too). Filled from Python
        # numbers: kernels, not host syncs.
        stops = torch.zeros(2 + len(STOP_SIGNALS), device=rt.device)
        if rt.is_main:
            stops[0], stops[1] = -1 if steps_left is None else steps_left, settled
        if self.signals.received:
            stops[2 + STOP_SIGNALS.index(self.signals.received)] = 1
        reduced = rt.all_reduce_sum(torch.cat([loss_sum[None], extra_sum[None], stops])).tolist()
        loss, extra, steps_left = reduced[0] * scale / rt.world_size, reduced[1] / cfg.batch_size, int(reduced[2])
        stop_signal = next((s for s, n in zip(STOP_SIGNALS, reduced[4:], strict=True) if n), None)
        cooling = steps_left if steps_left >= 0 and reduced[3] else None  # the steps the cooldown goes by
        lr = learning_rate(step, state.schedule, cooling, self.last_session)
        state.schedule = cooled(state.schedule, step, cooling, steps_left == 0, self.last_session)
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
        state.optimizer.zero_grad(set_to_none=True)
        return StepDone(loss, grad_norm, skipped, extra, stop_signal, steps_left, batch, lr)

    @torch.no_grad()
    def validate(self):
        """Validation loss and ROUGE on a fixed validation subset, summarized in the same batches as one process
        would; every rank returns the same numbers."""
        if not len(self.val_set):  # best_metric=last without validation rows: nothing to measure
            return {}
        self.model.eval()
        metrics = {"val_loss": validation_loss(self.model, self.val_set, self.cfg, self.rt)}
        if self.rouge_prompts:
            start = time.perf_counter()
            model = rouge_model(self.model, self.cfg, self.rt)
            predictions = inference.summarize_sharded(model, self.rouge_prompts, self.cfg, self.rt, progress=False,
                                                      decode_step=self.decode_step)
            if self.clock:
                self.clock.summarized(time.perf_counter() - start, len(predictions))
            metrics.update(rouge(predictions, self.val_set.summaries[:len(predictions)]))
        self.model.train()
        return metrics

    def checkpoint(self, stats):
        """After an evaluation: ckpt.pt, and best.pt when the configured metric improved; diverged weights are not
        worth resuming from, so a non-finite val_loss keeps the previous checkpoints."""
        if not math.isfinite(stats.get("val_loss", 0.0)):
            if self.rt.is_main:
                print(f"warning: val_loss is {stats['val_loss']} at iter {self.state.step}; keeping the previous "
                      f"checkpoints", file=sys.stderr)
            return
        self.state.save(self.cfg, self.rt, stats, best=self.state.improved(stats, self.cfg.best_metric))

    def log(self, stats, bar):
        """Rank 0: metrics.jsonl and log_to every log_interval steps and at evaluations, the progress bar, and the
        plot after an evaluation."""
        cfg, step = self.cfg, self.state.step
        if step % cfg.log_interval == 0 or "val_loss" in stats:
            log_row(cfg.out_dir, stats, self.tracker)
        bar.set_postfix(progress_postfix(stats, self.state.skipped_steps if self.scaler.is_enabled() else None))
        bar.update(1)
        if "val_loss" in stats:
            scores = " ".join(f"{k} {stats[k]:.4f}" for k in ("val_loss", "rouge1", "rouge2", "rougeL") if k in stats)
            bar.write(f"iter {step}: {scores}")
            try:  # the plot is a view of metrics.jsonl: a full disk skips it, the run goes on
                plot_metrics(os.path.join(cfg.out_dir, run_folder.METRICS),
                             os.path.join(cfg.out_dir, run_folder.PLOT),
                             f"{cfg.out_dir} ({cfg.init_from}, {self.model.num_params() / 1e6:.1f}M)")
            except DiskFull as e:
                bar.write(f"warning: {e}: {run_folder.PLOT} is not updated; training goes on", file=sys.stderr)

    @property
    def model(self):
        return self.state.model

    @property
    def scaler(self):
        return self.state.scaler
    def step_module(self):
        """(what a step calls: the objective's module, compiled when the runtime compiles (tried on the first
        micro-batch, on the device) and wrapped by the backend; what runs under torch.compile, in words, for the
        start line; the seconds the step's compile took, or None)."""
        module, compiled, seconds = self.objective.module(self.model), "eager", None
        if self.rt.compile_training:
            first = self.objective.on_device(self.objective.batches(self.state.step).micro_batches[0], self.rt.device)
            self.starting("compiling the training step")
            start = time.perf_counter()
            with memory_hint(self.cfg, self.rt):
                module = compile_model(module, lambda m: self.objective.losses(m, first)[0], self.rt.autocast())
            if isinstance(module, CompiledModule):
                seconds = time.perf_counter() - start
                compiled = f"torch.compile (compiled in {seconds:.0f} s)"
        elif self.rt.compile:  # the backend trains eagerly (FSDP): decoding compiles alone
            compiled = f"eager training ({self.rt.backend}), torch.compile decoding"
        self.compiled_module = module if isinstance(module, CompiledModule) else None
        return self.rt.parallel.wrap(module), compiled, seconds

    def prime_clock(self, after_summaries):
        """Before step 1 of a run with max_time, what its clock needs to judge the budget: the first micro-batch's
        forward and backward twice, then (when the run summarizes) one batch of prompts decoded twice; the first of
        each pays the one-time costs (compiling, first calls), the second runs warm. Summaries of weights not yet
        trained run to max_new_tokens: an upper bound. Each is announced, and a budget spent by one stops the run
        before the next. Leaves no gradients and draws no random numbers."""
        cfg, rt, clock = self.cfg, self.rt, self.clock
        rng = rng_state()
        batch = self.objective.batches(self.state.step)
        first = self.objective.on_device(batch.micro_batches[0], rt.device)
        self.starting("timing a training step (its first call pays the one-time costs)")
        with memory_hint(cfg, rt):
            for _ in range(2):
                start = time.perf_counter()
                with rt.autocast():
                    token_loss, weighed, _ = self.objective.losses(self.module, first)
                (token_loss + weighed).backward()
                seconds = time.perf_counter() - start
            self.starting("timing a training step (warm)")
        self.state.optimizer.zero_grad(set_to_none=True)
        clock.primed = seconds * self.accum_steps / batch.tokens  # the first micro-batch is the step's longest
        prompts = self.rouge_prompts
        if after_summaries and not prompts:
            prompts, _ = inference.Summarizer(self.model, cfg).prompts(self.val_set.dialogues[:cfg.gen_batch_size])
        prompts = prompts[:cfg.gen_batch_size * rt.world_size]
        if prompts:
            self.starting(f"timing a batch of {len(prompts)} summaries")
            model = rouge_model(self.model, cfg, rt)
            for _ in range(2):
                start = time.perf_counter()
                inference.summarize_sharded(model, prompts, cfg, rt, progress=False, decode_step=self.decode_step)
                clock.summaries.add(time.perf_counter() - start, len(prompts))
        set_rng_state(rng)

    def starting(self, what):
        """Before step 1, which a big model reaches after minutes: rank 0 says what start-up does next, and a budget
        that start-up has spent stops every rank here, in one line."""
        if self.rt.is_main:
            print(f"start-up: {what} ...", flush=True)
        if self.clock:
            self.rt.stop_if(self.clock.start_up_problem() if self.rt.is_main and self.clock.left() <= 0 else None)

    def start_lines(self, disk):
        """What rank 0 prints before the first step: the line that says what runs, the disk plan."""
        cfg, rt = self.cfg, self.rt
        trained = ""
        if cfg.lora_rank:
            count = sum(p.numel() for p in self.model.parameters() if p.requires_grad)
            trained = f" ({count / 1e6:.2f}M trained: LoRA rank {cfg.lora_rank} on {','.join(cfg.lora_targets)})"
        lines = [f"{len(self.train_set)} training and {len(self.val_set)} validation examples; "
                 f"{cfg.batch_size} sequences per step = {cfg.micro_batch_size} per micro-batch x "
                 f"{rt.world_size} process(es) x {self.accum_steps} accumulation steps; "
                 f"{self.model.num_params() / 1e6:.1f}M parameters{trained}; {rt.describe(self.compiled)}; "
                 f"{self.decoding}",
                 *([self.micro_batch] if self.micro_batch else []),
                 f"checkpoints in {cfg.out_dir}: {disk.describe()} at their peak; {disk.room()}"]
        if self.clock:
            lines.append(self.clock.budget_line(self.state.step, cfg.max_iters,
                                                decayed(self.state.step, self.state.schedule),
                                                sessions_done(self.state.schedule) + 1, cfg.sessions))
        return lines

# ---- the command line ------------------------------------------------------------------------------------------

def run_settings(argv, objective, script, usage):
    """(the run's Config, the checkpoint it continues or starts from or None, what the settings block says of that
    checkpoint: its path, the keys this command decides, what the flags changed) from the command line, checked
    before any work: a run from a checkpoint takes its settings but what the flags change (resolve), then the
    source's shape, the validation rows the run needs, and what the objective needs. A resume continues the run:
    only a flag changes it; a new run from the weights is a new run of the run's recipe: a preset changes it too."""
    cfg, flags = load_config(argv, usage, script), flags_given(argv)
    check_command(flags, script)
    path, start = start_checkpoint(cfg)
    from_run = None
    if start is not None:
        use = Use.RESUME if resuming(cfg) else Use.WEIGHTS
        given = flags if use is Use.RESUME else {key for key, _, _ in settings_given(argv)}
        cfg, changed = resolve(cfg, given, start["config"], path, use)
        from_run = FromRun(path, own_keys(use), changed)
    check_shape(cfg, flags, cfg.init_from)
    check_validation(cfg)
    problem = objective.problem(cfg)
    if problem:
        raise UserError(problem)
    return cfg, start, from_run


def saved_so_far(out_dir):
    """What a run stopped now leaves: its checkpoints that load, or that none was saved yet."""
    intact = intact_in(out_dir)
    return f"intact: {', '.join(intact)}" if intact else f"nothing is saved in {out_dir} yet"


def notebook_main(argv=(), num_processes=2, port=29500):
    """Train from a notebook cell in `num_processes` processes, one per GPU (Kaggle's 2x T4)."""
    notebook_launch(main, list(argv), num_processes, port)


def continue_command(script, argv, world_size):
    """The command line that resumes this run from out_dir/ckpt.pt: its arguments with --init_from=resume, under
    torchrun when the run had several processes."""
    presets, flags = arguments(argv)
    args = [*presets, *(f for f in flags if not f.startswith(("--init_from=", "--resume_from="))), "--init_from=resume"]
    launcher = (["torchrun", f"--nproc_per_node={os.environ.get('LOCAL_WORLD_SIZE', world_size)}", "--standalone"]
                if world_size > 1 else ["python"])
    return shlex.join([*launcher, script, *args])


# ---- what a run is built from --------------------------------------------------------------------------------

def validation_problem(cfg, rows):
    """Why a run with `rows` validation rows cannot work (best_metric or evaluate_after needs some), else None."""
    if rows:
        return None
    source = (f"validation_csv={cfg.validation_csv} leaves no validation rows" if cfg.validation_csv else
              f"val_fraction={cfg.val_fraction:g} of train_csv leaves no validation rows")
    if cfg.evaluate_after:
        return (f"{source} for evaluate_after=True to score: pass --validation_csv=<a CSV> or --val_fraction=0.05, "
                f"or --evaluate_after=False")
    if cfg.best_metric != "last":
        return (f"{source} to choose best.pt by best_metric={cfg.best_metric!r}: pass --validation_csv=<a CSV> or "
                f"--val_fraction=0.05, or --best_metric=last to keep the last save as best.pt")
    return None


def check_validation(cfg):
    """One line, before any work, when the settings alone leave no validation rows that the run needs (the rows a
    split or a CSV leaves are counted by datasets())."""
    if not cfg.validation_csv and cfg.val_fraction == 0:
        problem = validation_problem(cfg, 0)
        if problem:
            raise UserError(problem)


def datasets(cfg, rt):
    """(the train/validation Splits, how many dialogues evaluate_after/predict_after will summarize); the files
    predict reads after hours of training are checked now."""
    splits = data.load_datasets(cfg, is_main=rt.is_main, barrier=rt.barrier)
    problem = validation_problem(cfg, len(splits.val))
    if problem:
        raise UserError(problem)
    if rt.is_main:  # the rule evaluate.py refuses a checkpoint's training rows by
        splits.notes += filter(None, [data.repeats_note(cfg, splits.train, splits.val)])
    after_summaries = len(splits.val) if cfg.evaluate_after else 0
    if cfg.predict_after:
        test = data.read_test(cfg)
        after_summaries += len(test.ids)
        if cfg.sample_submission_csv:
            check_against_sample(test.ids, cfg.sample_submission_csv)
    return splits, after_summaries


def rouge_model(model, cfg, rt):
    """The model that summarizes for ROUGE during training, held as evaluate_after and predict_after hold theirs (a
    plain GPT, its weights in rt's dtype), so that they run the graphs this decoding compiled (Runtime.decode_step):
    the trained model itself where it is one (float32, no adapters, no FSDP), else a copy of its weights, gathered
    under FSDP (where every forward is a collective that ranks generating different lengths cannot keep in step)
    and LoRA-merged: room for a copy of the weights in rt's dtype on each GPU."""
    dtype = getattr(torch, rt.dtype)
    if rt.backend != "fsdp" and not cfg.lora_rank and model.lm_head.weight.dtype == dtype:
        return model
    weights = rt.parallel.full_weights(model)
    if cfg.lora_rank:
        weights = lora.merged_state_dict(weights, **lora.settings(cfg))
    with torch.device("meta"):
        copy = GPT(GPTConfig(**asdict(model.config))).to(dtype)
    copy.to_empty(device=rt.device).load_state_dict(weights)  # cast as it copies: no float32 copy first
    return copy.eval()


def memory_hint(cfg, rt):
    """What an out-of-memory while training says to lower (one generating summaries names gen_batch_size)."""
    n, reduce_once = cfg.micro_batch_size, getattr(rt.parallel, "reduce_once", False)
    return out_of_memory_hint(f"training on micro-batches of {n} sequences",
                              f"--micro_batch_size (now {n}; batch_size stays, with more accumulation steps)"
                              + ("" if cfg.gradient_checkpointing else " or set --gradient_checkpointing=True")
                              + (" or set --fsdp_reduce_once=False (it keeps the weights gathered and the "
                                 "gradients unsharded)" if reduce_once is True else ""))


class TokenLoss:
    """What a step minimizes: the cross-entropy of the summary tokens, summed over a micro-batch (the loop divides
    it by the global batch's targets). A stage built on this loop replaces it with an objective of its own that
    offers the same six things; `extra_loss` is its second term, summed over a micro-batch's dialogues."""
    checkpoint_keys = {}  # what this objective adds to ckpt.pt
    extra_loss = None  # the metrics.jsonl name of a second loss term, if any

    @staticmethod
    def problem(cfg):
        """Why the run's settings cannot train this objective (asked before any work), else None."""
        return None

    def __init__(self, cfg, rt, train_set, model, ckpt):
        self.batches = data.TrainBatches(train_set, cfg, rt.rank, rt.world_size)

    def module(self, model):
        """What a step calls (compiled and wrapped by the backend)."""
        return model

    def on_device(self, batch, device):
        x, y = batch
        return x.to(device, non_blocking=True), Targets.of(y).to(device)

    def losses(self, module, batch):
        """(token loss summed over the micro-batch's targets, a second term already weighed, its unweighed sum)."""
        x, found = batch
        _, loss = module(x, found)
        zero = torch.zeros((), device=x.device)
        return loss * len(found.index), zero, zero


if __name__ == "__main__":
    main()
