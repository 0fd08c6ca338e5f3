"""Preparing a training run, the one way into the Trainer (train.py): from the command line's settings (run_settings:
resolved against the checkpoint a run continues or starts from, checked before any work) to what the loop needs
(prepare: data, the model and its state, the disk plan, an earlier run set aside, the compiled step, the clock primed
for the budget), which rank 0 then announces (announce: the notes, the start lines and config.json)."""
import os
import sys
import time
from dataclasses import dataclass, replace

import torch

import data
from command_line import UserError
from config import Use, flags_given, load_config, own_keys, resolve, rows_per_rank, settings_given
from model import Targets
from summarizer import inference, lora, run_folder
from summarizer.clock import RunClock, used_up
from summarizer.compiling import CompiledModule
from summarizer.launch import training_memory_hint
from summarizer.loading import (
    check_shape,
    from_hub_cache,
    kept_lora_base,
    model_to_train,
    resume_path,
    resuming,
    start_checkpoint,
)
from summarizer.memory import choose_micro_batch, micro_batch_that_runs, workload
from summarizer.report import check_against_sample
from summarizer.schedule import decayed, sessions_done
from summarizer.settings_report import FromRun, save_config
from summarizer.state import TrainingState, rng_state, set_rng_state
from summarizer.tracking import Tracker, peak_flops, resumed_history

WARM_RUNS = 2  # before step 1, a step and a batch of summaries are timed this many times warm


@dataclass
class Run:
    """What the loop needs of a prepared run (cfg with micro_batch_size chosen; module: compiled and wrapped; clock:
    max_time's, or None; last_session: of those the run is planned over; peak_flops: for mfu, None on a CPU)."""
    cfg: object
    state: TrainingState
    batches: data.TrainBatches
    module: torch.nn.Module
    compiled_module: CompiledModule | None
    val_set: object
    rouge_prompts: list
    tracker: Tracker
    clock: RunClock | None
    last_session: bool
    peak_flops: float | None


def prepare(cfg, rt, start_ckpt=None, started=None, given=(), verdict_only=False):
    """The Run of run_settings' `cfg` and `start_ckpt` in `rt`; `started`: what max_time counts from (else now);
    `given`: the keys the command line gave (resumed_schedule). Only once every check has passed is an earlier run
    set aside and the run announced: `verdict_only` (bench/preflight.py's) stops before that, out_dir as it was."""
    started = time.monotonic() if started is None else started
    tracker, splits, after = check_before_model(cfg, rt)
    phase = StartUp(cfg.max_time, started, time.monotonic, rt)
    phase("building the model")
    torch.manual_seed(cfg.seed)  # identical initial weights on every rank
    model, resumed = model_to_train(cfg, start_ckpt)
    model.gradient_checkpointing = cfg.gradient_checkpointing
    lora_base = kept_lora_base(cfg, model, resumed) if rt.is_main else None  # its hash: of the base as loaded
    if rt.backend != "fsdp":  # FSDP gathers its units in 16 bits anyway (and torch < 2.8 wants one dtype a unit)
        lora.cast_base(model, getattr(torch, rt.dtype))
    compiled_module = CompiledModule(model) if rt.compile_training else None  # auto's check runs the run's step
    cfg, chosen = auto_micro_batch(cfg, rt, model, splits, compiled_module or model, phase)
    tracker.cfg = cfg  # the tracker logs the chosen settings
    state, disk, notes = training_state(cfg, rt, model, resumed, splits, given, lora_base)
    batches, val_set = data.TrainBatches(splits.train, cfg, rt.rank, rt.world_size), splits.val
    summarizer = inference.Summarizer(state.model, cfg)
    prompts, _ = summarizer.prompts(val_set.dialogues[:min(cfg.rouge_samples, len(val_set))])
    module, compiled = step_module(rt, state, compiled_module)
    clock = None
    if cfg.max_time is not None:  # counts from `started`: whatever start-up takes is inside the budget
        clock = RunClock(cfg.max_time, started, time.monotonic, cfg.eval_interval, len(prompts), after,
                         step_tokens=cfg.batch_size * float((splits.train.lengths - 1).mean()),
                         validation_tokens=validation_tokens(cfg, val_set), save_bytes=disk.ckpt + disk.best)
        # the batch of summaries timed: the evaluations' prompts, else the after-run's kind, if any
        timed = prompts or (summarizer.prompts(val_set.dialogues[:cfg.gen_batch_size])[0] if after else [])
        clock.prime(*time_step(cfg, rt, batches, state, module, phase), time_decoding(cfg, rt, state, timed, phase))
        rt.stop_if(clock.start_up_problem() if rt.is_main else None)  # every rank stops with rank 0's verdict
    # max_time's cooldown comes in the last of the sessions the run is planned over
    run = Run(cfg, state, batches, module, compiled_module, val_set, prompts, tracker, clock,
              sessions_done(state.schedule) + 1 >= cfg.sessions,
              peak_flops(rt.device_name, rt.dtype) if rt.device.type == "cuda" else None)
    if verdict_only:
        return run
    if rt.is_main and not resuming(cfg) and (moved := run_folder.set_aside_earlier_run(cfg.out_dir)):
        print(moved)
    announce(run, rt, notes, len(splits.train), rt.describe(compiled), chosen, disk)
    return run


def auto_micro_batch(cfg, rt, model, splits, step, phase):
    """(cfg with micro_batch_size=auto's choice: the memory plan's, lowered by an out-of-memory error in its peak,
    run by `step`; the choice, in words), or (cfg, None) for a micro_batch_size the user fixed.
    fsdp_reduce_once=auto is decided first, as the plan counts what it holds."""
    auto = cfg.micro_batch_size == "auto"
    if not auto and not (rt.backend == "fsdp" and cfg.fsdp_reduce_once == "auto"):
        return cfg, None
    phase("planning memory" + " for micro_batch_size=auto" * auto)
    run, budget = workload(cfg, rt, model, splits.train, splits.val)
    if not auto:
        return cfg, None
    rows, chosen = choose_micro_batch(run, budget)
    cfg = replace(cfg, micro_batch_size=rows)
    # under FSDP the peak is a sharded model's, which runs only with the other ranks (a rank out of memory would
    # leave them waiting): the plan's choice stands
    if rt.backend == "fsdp":
        return cfg, chosen
    phase("running a step on the longest rows")
    return micro_batch_that_runs(cfg, rt, step.to(rt.device), splits.train, chosen)


def announce(run, rt, notes, train_rows, runs, chosen, disk):
    """Rank 0, before step 1: the notes of start-up, the rows, the batch, the model, what runs (`runs`), auto's
    micro-batch (`chosen`, or None), the disk plan and what max_time buys; config.json."""
    if not rt.is_main:
        return
    cfg, state, clock = run.cfg, run.state, run.clock
    trained = ""
    if cfg.lora_rank:
        count = sum(p.numel() for p in state.model.parameters() if p.requires_grad)
        trained = f" ({count / 1e6:.2f}M trained: LoRA rank {cfg.lora_rank} on {','.join(cfg.lora_targets)})"
    if cfg.lora_rank and cfg.init_from == "scratch":
        print(f"warning: lora_rank={cfg.lora_rank} with init_from=scratch trains small adapters on frozen "
              f"random weights, which learns little: start from GPT-2 (init_from=gpt2) or train every "
              f"weight (lora_rank=0)", file=sys.stderr)
    lines = [f"{train_rows} training and {len(run.val_set)} validation examples; {cfg.batch_size} sequences per "
             f"step over {rt.world_size} process(es), cut by length into micro-batches of at most the positions of "
             f"micro_batch_size={cfg.micro_batch_size} of the longest rows; {state.model.num_params() / 1e6:.1f}M "
             f"parameters{trained}; {runs}",
             *([chosen] if chosen else []),
             f"checkpoints in {cfg.out_dir}: {disk.describe()} at their peak; {disk.room()}",
             *([clock.budget_line(state.step, cfg.max_iters, decayed(state.step, state.schedule),
                                  sessions_done(state.schedule) + 1, cfg.sessions)] if clock else [])]
    print("\n".join([*notes, *lines]))
    save_config(cfg, os.path.join(cfg.out_dir, run_folder.CONFIG))


class StartUp:
    """Start-up's phases before step 1, which a big model reaches after minutes: rank 0 says each as it begins, and a
    max_time budget from `started` that the phases so far spent stops every rank there, with rank 0's line."""

    def __init__(self, budget, started, now, rt):
        self.budget, self.started, self.now, self.rt = budget, started, now, rt
        self.doing = "the imports and reading the data"

    def __call__(self, what):
        took = self.now() - self.started
        if self.budget is not None:
            self.rt.stop_if(used_up(self.budget, took, f"so far (the last: {self.doing})") + ", or a smaller model "
                            "or micro_batch_size" if took > self.budget and self.rt.is_main else None)
        self.doing = what
        if self.rt.is_main:
            print(f"start-up: {what} ...", flush=True)


def training_state(cfg, rt, model, resumed, splits, given, base):
    """(the TrainingState of `model`, continuing `resumed` if given, with `base`, what ckpt.pt keeps of a LoRA
    run's base; the disk plan, checked before any work; the notes of start-up)."""
    disk = run_folder.DiskPlan(model, cfg, small_lora=base is not None, train_rows=len(splits.train))
    rt.stop_if(disk.problem(resumed is not None) if rt.is_main else None)
    path = resume_path(cfg) if resumed else None
    state = TrainingState.start(rt.parallel.shard(model.to(rt.device)), cfg, rt,
                                train_rows=splits.train.fingerprints(), validation_digest=splits.val.digest,
                                lora_base=base, base=resumed["config"]["init_from"] if resumed else cfg.init_from)
    torch.manual_seed(cfg.seed + rt.rank)  # dropout masks differ per rank
    notes = list(splits.notes)
    if resumed:
        notes += state.restore(resumed, cfg, rt, path, given)
        if rt.is_main:
            notes += filter(None, [resumed_history(path, cfg.out_dir, state.step)])
    return state, disk, notes


def step_module(rt, state, compiled):
    """(what a step calls: the model, or its CompiledModule `compiled` (compiled at its first call, eager after a
    compiler failure) where the runtime compiles training, wrapped by the backend; what runs, in words, for the
    start line)."""
    # the backend trains eagerly (FSDP) where the runtime compiles but not the training step
    words = ("torch.compile (compiled at its first call)" if compiled else
             f"eager training ({rt.backend})" if rt.compile else "eager")
    return rt.parallel.wrap(compiled or state.model), words


def time_step(cfg, rt, batches, state, module, phase):
    """Before step 1 under max_time: (the seconds of a warm step, its tokens), from the step's longest micro-batch
    run 1 + WARM_RUNS times, the first paying the one-time costs, the slowest warm one counted (a quiet moment of a
    busy machine must not mislead). Leaves no gradients and draws no random numbers."""
    rng, runs, batch = rng_state(), [], batches(state.step)
    x, y = batch.micro_batches[0]  # the step's longest
    x, found = x.to(rt.device, non_blocking=True), Targets.of(y).to(rt.device)
    phase("timing a training step (its first call pays the one-time costs)")
    with training_memory_hint(cfg, rt):
        for _ in range(1 + WARM_RUNS):
            start = time.perf_counter()
            with rt.autocast():
                _, loss = module(x, found)
            loss.backward()
            runs.append(time.perf_counter() - start)
        phase("timing a training step (warm)")
    state.optimizer.zero_grad(set_to_none=not rt.parallel.keeps_gradients)
    set_rng_state(rng)
    return max(runs[1:]) * len(batch.micro_batches), batch.tokens


def time_decoding(cfg, rt, state, prompts, phase):
    """Before step 1 under max_time: [(seconds, summaries)] of a batch of `prompts` decoded 1 + WARM_RUNS times, the
    first paying the one-time costs (untrained weights run to max_new_tokens: an upper bound). No random numbers."""
    prompts, timed = prompts[:cfg.gen_batch_size * rt.world_size], []
    if prompts:
        rng = rng_state()
        phase(f"timing a batch of {len(prompts)} summaries")
        model = inference.rouge_model(state.model, cfg, rt)
        for _ in range(1 + WARM_RUNS):
            start = time.perf_counter()
            inference.summarize_on_ranks(model, prompts, cfg, rt, progress=False)
            timed.append((time.perf_counter() - start, len(prompts)))
        set_rng_state(rng)
    return timed


def validation_tokens(cfg, val_set):
    """The tokens an evaluation's validation loss reads (eval_val_batches micro-batches, or the whole split)."""
    rows = len(val_set)
    read = min(1, (cfg.eval_val_batches * cfg.micro_batch_size or rows) / max(1, rows))
    return float((val_set.lengths - 1).sum()) * read


def run_settings(argv, usage=None):
    """(the run's Config, the checkpoint it continues or starts from or None, the settings block's FromRun) from the
    command line, checked before any work. A resume continues the run: only a flag changes it; a new run from the
    weights is a new run of the run's recipe: a preset changes it too."""
    cfg, flags = load_config(argv, usage), flags_given(argv)
    path, start_ckpt = start_checkpoint(cfg)
    from_run = None
    if start_ckpt is not None:
        use = Use.RESUME if resuming(cfg) else Use.WEIGHTS
        given = flags if use is Use.RESUME else {key for key, _, _ in settings_given(argv)}
        cfg, changed = resolve(cfg, given, start_ckpt["config"], path, use)
        from_run = FromRun(path, own_keys(use), changed)
    check_shape(cfg, flags, cfg.init_from, ckpt=None if resuming(cfg) else start_ckpt)
    # the settings alone leave no validation rows (the rows a split or a CSV leaves are counted by read_inputs)
    if not cfg.validation_csv and cfg.val_fraction == 0 and (problem := validation_problem(cfg, 0)):
        raise UserError(problem)
    return cfg, start_ckpt, from_run


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


def check_before_model(cfg, rt):
    """(the Tracker, the Splits, {after-run: the dialogues it summarizes}) once train.py's and bench/preflight.py's
    checks before the model pass: the batch's split, the loggers, init_from's weights, the inputs."""
    rows_per_rank(cfg.batch_size, rt.world_size)
    tracker = Tracker(cfg, rt.is_main)  # a missing package or login stops the run before any work
    if not resuming(cfg):
        from_hub_cache(cfg.init_from)
    splits, after = read_inputs(cfg, rt)
    return tracker, splits, after


def read_inputs(cfg, rt):
    """(the train/validation Splits, {each after-run on: the dialogues it summarizes}); the files predict reads
    after hours of training are checked now."""
    splits = data.load_splits(cfg, is_main=rt.is_main, barrier=rt.barrier)
    if problem := validation_problem(cfg, len(splits.val)):
        raise UserError(problem)
    if rt.is_main:  # the rule evaluate.py refuses a checkpoint's training rows by
        splits.notes += filter(None, [data.repeats_note(cfg, splits.train, splits.val)])
    if rt.is_main and len(splits.train) < cfg.batch_size:  # a step's rows run over the end of an epoch
        splits.notes.append(f"note: {len(splits.train)} training rows for batch_size={cfg.batch_size}: each step "
                            f"trains on some rows more than once; lower batch_size or bring more rows")
    after = {"evaluate_after": len(splits.val)} if cfg.evaluate_after else {}
    if cfg.predict_after:
        test = data.read_test(cfg)
        after["predict_after"] = len(test.ids)
        if cfg.sample_submission_csv:
            check_against_sample(test.ids, cfg.sample_submission_csv)
    return splits, after
