"""The one way into train.py's Trainer: read_settings (checked before any work), then prepare (what the loop needs)."""
import os
import sys
import time
from dataclasses import dataclass, replace

import torch

import data
from command_line import UserError, atomic_write
from config import config_json, flags_given, load_config, resolve, rows_per_rank, settings_given
from model import Targets
from summarizer import inference, run_folder
from summarizer.backends import CompiledModule
from summarizer.clock import Clock, decayed, sessions_done, used_up
from summarizer.launch import training_memory_hint
from summarizer.loading import (
    cast_base,
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
from summarizer.state import TrainingState, rng_restored
from summarizer.tracking import Tracker, peak_flops, resumed_history

WARM_RUNS = 2  # before step 1, a step and a batch of summaries are timed this many times warm


@dataclass
class Setup:
    """What the loop needs (last_session: of those the run is planned over, where max_time's cooldown comes)."""
    cfg: object
    state: TrainingState
    batches: data.TrainBatches
    module: torch.nn.Module
    compiled_module: CompiledModule | None
    val_set: object
    rouge_prompts: list
    tracker: Tracker
    clock: Clock | None
    last_session: bool
    peak_flops: float | None


def prepare(cfg, proc, start_ckpt=None, started=None, given=(), verdict_only=False):
    """The Setup; only once every check has passed is an earlier run set aside and the run announced: `verdict_only`
    (bench/preflight.py's) stops before, leaving out_dir as it was."""
    started = time.monotonic() if started is None else started
    tracker, splits, after = check_before_model(cfg, proc)
    phase = StartUp(cfg.max_time, started, time.monotonic, proc)
    phase("building the model")
    torch.manual_seed(cfg.seed)  # identical initial weights on every rank
    model, resumed = model_to_train(cfg, start_ckpt)
    model.gradient_checkpointing = cfg.gradient_checkpointing
    lora_base = kept_lora_base(cfg, model, resumed) if proc.is_main else None  # its hash: of the base as loaded
    if proc.backend != "fsdp":  # FSDP gathers its units in 16 bits anyway (and torch < 2.8 wants one dtype a unit)
        cast_base(model, getattr(torch, proc.dtype))
    compiled_module = CompiledModule(model) if proc.compile_training else None  # auto's check runs the run's step
    cfg, chosen = auto_micro_batch(cfg, proc, model, splits, compiled_module or model, phase)
    tracker.cfg = cfg  # the tracker logs the chosen settings
    state, disk, notes = training_state(cfg, proc, model, resumed, splits, given, lora_base)
    batches, val_set = data.TrainBatches(splits.train, cfg, proc.rank, proc.world_size), splits.val
    summary_model = inference.SummaryModel(state.model, cfg)
    prompts, _ = summary_model.prompts(val_set.dialogues[:min(cfg.rouge_samples, len(val_set))])
    module = proc.parallel.wrap(compiled_module or state.model)
    clock = None
    if cfg.max_time is not None:  # counts from `started`: whatever start-up takes is inside the budget
        clock = Clock(cfg.max_time, started, time.monotonic, cfg.eval_interval, len(prompts), after,
                         step_tokens=cfg.batch_size * float((splits.train.lengths - 1).mean()),
                         validation_tokens=validation_tokens(cfg, val_set), save_bytes=disk.ckpt + disk.best)
        # the batch of summaries timed: the evaluations' prompts, else the after-run's kind, if any
        timed = prompts or (summary_model.prompts(val_set.dialogues[:cfg.gen_batch_size])[0] if after else [])
        clock.prime(*time_step(cfg, proc, batches, state, module, phase), time_decoding(cfg, proc, state, timed, phase))
        proc.stop_if(clock.start_up_problem() if proc.is_main else None)  # every rank stops with rank 0's verdict
    # max_time's cooldown comes in the last of the sessions the run is planned over
    setup = Setup(cfg, state, batches, module, compiled_module, val_set, prompts, tracker, clock,
              sessions_done(state.schedule) + 1 >= cfg.sessions,
              peak_flops(proc.device_name, proc.dtype) if proc.device.type == "cuda" else None)
    if verdict_only:
        return setup
    if proc.is_main and not resuming(cfg) and (moved := run_folder.set_aside_earlier_run(cfg.out_dir)):
        print(moved)
    announce(setup, proc, notes, len(splits.train), chosen, disk)
    return setup


def auto_micro_batch(cfg, proc, model, splits, step, phase):
    """(cfg with auto's choice, the choice in words); fsdp_reduce_once=auto first: the plan counts what it holds."""
    auto = cfg.micro_batch_size == "auto"
    if not auto and not (proc.backend == "fsdp" and cfg.fsdp_reduce_once == "auto"):
        return cfg, None
    phase("planning memory" + " for micro_batch_size=auto" * auto)
    run, budget = workload(cfg, proc, model, splits.train, splits.val)
    if not auto:
        return cfg, None
    rows, chosen = choose_micro_batch(run, budget)
    cfg = replace(cfg, micro_batch_size=rows)
    # under FSDP the peak is a sharded model's, which runs only with the other ranks (a rank out of memory would
    # leave them waiting): the plan's choice stands
    if proc.backend == "fsdp":
        return cfg, chosen
    phase("running a step on the longest rows")
    return micro_batch_that_runs(cfg, proc, step.to(proc.device), splits.train, chosen)


def announce(setup, proc, notes, train_rows, chosen, disk):
    if not proc.is_main:
        return
    cfg, state, clock = setup.cfg, setup.state, setup.clock
    # the backend trains eagerly (FSDP) where the runtime compiles but not the training step
    runs = proc.describe("torch.compile (compiled at its first call)" if setup.compiled_module else
                         f"eager training ({proc.backend})" if proc.compile else "eager")
    trained = ""
    if cfg.lora_rank:
        count = sum(p.numel() for p in state.model.parameters() if p.requires_grad)
        trained = f" ({count / 1e6:.2f}M trained: LoRA rank {cfg.lora_rank} on {','.join(cfg.lora_targets)})"
    if cfg.lora_rank and cfg.init_from == "scratch":
        print(f"warning: lora_rank={cfg.lora_rank} with init_from=scratch trains small adapters on frozen "
              f"random weights, which learns little: start from GPT-2 (init_from=gpt2) or train every "
              f"weight (lora_rank=0)", file=sys.stderr)
    lines = [f"{train_rows} training and {len(setup.val_set)} validation examples; {cfg.batch_size} sequences per "
             f"step over {proc.world_size} process(es), cut by length into micro-batches of at most the positions of "
             f"micro_batch_size={cfg.micro_batch_size} of the longest rows; {state.model.num_params() / 1e6:.1f}M "
             f"parameters{trained}; {runs}",
             *([chosen] if chosen else []),
             f"checkpoints in {cfg.out_dir}: {disk.describe()} at their peak; {disk.room()}",
             *([clock.budget_line(state.step, cfg.max_iters, decayed(state.step, state.schedule),
                                  sessions_done(state.schedule) + 1, cfg.sessions)] if clock else [])]
    print("\n".join([*notes, *lines]))
    os.makedirs(cfg.out_dir, exist_ok=True)  # prepare() without train.py's claim on out_dir (tests, bench)
    with atomic_write(os.path.join(cfg.out_dir, run_folder.CONFIG)) as f:
        f.write(config_json(cfg))


class StartUp:
    """Start-up's phases, which a big model takes minutes over: rank 0 names each; a spent max_time stops there."""

    def __init__(self, budget, started, now, proc):
        self.budget, self.started, self.now, self.proc = budget, started, now, proc
        self.doing = "the imports and reading the data"

    def __call__(self, what):
        took = self.now() - self.started
        if self.budget is not None:
            self.proc.stop_if(used_up(self.budget, took, f"so far (the last: {self.doing})") + ", or a smaller model "
                            "or micro_batch_size" if took > self.budget and self.proc.is_main else None)
        self.doing = what
        if self.proc.is_main:
            print(f"start-up: {what} ...", flush=True)


def training_state(cfg, proc, model, resumed, splits, given, base):
    disk = run_folder.DiskPlan(model, cfg, small_lora=base is not None, train_rows=len(splits.train))
    proc.stop_if(disk.problem(resumed is not None) if proc.is_main else None)
    path = resume_path(cfg) if resumed else None
    state = TrainingState.start(proc.parallel.shard(model.to(proc.device)), cfg, proc,
                                train_rows=splits.train.fingerprints(), validation_digest=splits.val.digest,
                                lora_base=base, base=resumed["config"]["init_from"] if resumed else cfg.init_from)
    torch.manual_seed(cfg.seed + proc.rank)  # dropout masks differ per rank
    notes = list(splits.notes)
    if resumed:
        notes += state.restore(resumed, cfg, proc, path, given)
        if proc.is_main:
            notes += filter(None, [resumed_history(path, cfg.out_dir, state.step)])
    return state, disk, notes


def time_step(cfg, proc, batches, state, module, phase):
    """(a warm step's seconds, its tokens): the slowest warm run of the step's longest micro-batch, as a busy
    machine's quiet moment must not mislead. The first run is step 1's every micro-batch: a compiler specializes on
    ranges of sizes, and what their sizes compile is paid here, not in step 1, which the budget would not hold (an
    H200's step 1 recompiled for 40 s and ended its run 27 s past max_time)."""
    runs, batch = [], batches(state.step)
    micro_batches = [(x.to(proc.device, non_blocking=True), Targets.of(y).to(proc.device))
                     for x, y in batch.micro_batches]  # the longest first
    phase("timing a training step (its first call pays the one-time costs)")
    with training_memory_hint(cfg, proc), rng_restored():
        for run in range(1 + WARM_RUNS):
            start = time.perf_counter()
            for x, found in micro_batches if run == 0 else micro_batches[:1]:
                with proc.autocast():
                    _, loss = module(x, found)
                loss.backward()
            runs.append(time.perf_counter() - start)
        phase("timing a training step (warm)")
    state.optimizer.zero_grad(set_to_none=not proc.parallel.keeps_gradients)
    return max(runs[1:]) * len(batch.micro_batches), batch.tokens


def time_decoding(cfg, proc, state, prompts, phase):
    """[(seconds, summaries)]: untrained weights run to max_new_tokens, an upper bound."""
    prompts, timed = prompts[:cfg.gen_batch_size * proc.world_size], []
    if prompts:
        phase(f"timing a batch of {len(prompts)} summaries")
        model = inference.rouge_model(state.model, cfg, proc)
        with rng_restored():
            for _ in range(1 + WARM_RUNS):
                start = time.perf_counter()
                inference.summarize_on_ranks(model, prompts, cfg, proc, progress=False)
                timed.append((time.perf_counter() - start, len(prompts)))
    return timed


def validation_tokens(cfg, val_set):
    rows = len(val_set)
    read = min(1, (cfg.eval_val_batches * cfg.micro_batch_size or rows) / max(1, rows))
    return float((val_set.lengths - 1).sum()) * read


def read_settings(argv, usage=None):
    """(Config, the checkpoint it starts from or None, FromRun). A resume continues the run: only a flag changes it;
    a new run from its weights repeats its recipe: a preset changes it too."""
    cfg, flags = load_config(argv, usage), flags_given(argv)
    path, start_ckpt = start_checkpoint(cfg)
    from_run = None
    if start_ckpt is not None:
        use = "resume" if resuming(cfg) else "weights"
        given = flags if use == "resume" else {key for key, _, _ in settings_given(argv)}
        cfg, changed = resolve(cfg, given, start_ckpt["config"], path, use)
        from_run = (path, use, changed)
    check_shape(cfg, flags, cfg.init_from, ckpt=None if resuming(cfg) else start_ckpt)
    # the settings alone leave no validation rows (the rows a split or a CSV leaves are counted by read_inputs)
    if not cfg.validation_csv and cfg.val_fraction == 0 and (problem := validation_problem(cfg, 0)):
        raise UserError(problem)
    return cfg, start_ckpt, from_run


def validation_problem(cfg, rows):
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


def check_before_model(cfg, proc):
    """(Tracker, Splits, {after-run: its dialogues}): train.py's and bench/preflight.py's checks before the model."""
    rows_per_rank(cfg.batch_size, proc.world_size)
    tracker = Tracker(cfg, proc.is_main)  # a missing package or login stops the run before any work
    if not resuming(cfg):
        from_hub_cache(cfg.init_from)
    splits, after = read_inputs(cfg, proc)
    return tracker, splits, after


def read_inputs(cfg, proc):
    """The files predict reads after hours of training are checked now."""
    splits = data.load_splits(cfg, is_main=proc.is_main, barrier=proc.barrier)
    if problem := validation_problem(cfg, len(splits.val)):
        raise UserError(problem)
    if proc.is_main:  # the rule evaluate.py refuses a checkpoint's training rows by
        splits.notes += filter(None, [data.repeats_note(cfg, splits.train, splits.val)])
    if proc.is_main and len(splits.train) < cfg.batch_size:  # a step's rows run over the end of an epoch
        splits.notes.append(f"note: {len(splits.train)} training rows for batch_size={cfg.batch_size}: each step "
                            f"trains on some rows more than once; lower batch_size or bring more rows")
    after = {"evaluate_after": len(splits.val)} if cfg.evaluate_after else {}
    if cfg.predict_after:
        test = data.read_test(cfg)
        after["predict_after"] = len(test.ids)
        if cfg.sample_submission_csv:
            check_against_sample(test.ids, cfg.sample_submission_csv)
    return splits, after
