"""Preparing a training run, the one way into the Trainer (train.py): from the command line's settings (run_settings:
resolved against the checkpoint a run continues or starts from, checked before any work) to what the loop needs
(prepare: data, the model and its state, the disk plan, an earlier run set aside, the compiled step, the clock primed
for the budget, the start lines and config.json)."""
import os
import sys
import time
from dataclasses import dataclass, replace

import torch

import data
from config import Use, flags_given, grad_accum_steps, load_config, own_keys, resolve, settings_given
from summarizer import inference, run_folder
from summarizer.clock import RunClock
from summarizer.compiling import CompiledModule, compile_model
from summarizer.errors import UserError
from summarizer.launch import memory_hint
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
from summarizer.out_of_memory import micro_batch_that_runs
from summarizer.schedule import decayed, sessions_done
from summarizer.settings_report import FromRun, check_command, save_config
from summarizer.state import TrainingState, rng_state, set_rng_state
from summarizer.submission import check_against_sample
from summarizer.tracking import Tracker, peak_flops, resumed_history


@dataclass
class Run:
    """What the loop needs of a prepared run: its settings (micro_batch_size chosen), the training state (what
    ckpt.pt holds), the objective and the module a step calls (compiled and wrapped), the validation rows and the
    prompts its ROUGE decodes with `decode_step`, the tracker, max_time's clock (or None) and whether this is the
    last session the run is planned over."""
    cfg: object
    state: TrainingState
    objective: object
    module: torch.nn.Module
    compiled_module: CompiledModule | None
    compile_seconds: float | None
    val_set: object
    rouge_prompts: list
    decode_step: object
    tracker: Tracker
    clock: RunClock | None
    last_session: bool
    peak_flops: float | None


def prepare(cfg, rt, objective, start=None, started=None):
    """The Run of `cfg` (from run_settings) in `rt`, training `objective` (a class: train.py's TokenLoss, or a
    stage's own, e.g. summarizer/ranking.py's Ranking). `start`: the checkpoint run_settings loaded to resume or start
    from (else it is loaded here); `started`: what max_time counts from (else now). Rank 0 prints what start-up
    does and, before step 1, what runs; a budget that start-up spends stops every rank."""
    tracker = Tracker(cfg, rt.is_main)  # a missing package or login stops the run before any work
    splits, after_summaries = datasets(cfg, rt)
    train_set, val_set = splits.train, splits.val
    clock = None
    if cfg.max_time is not None:  # counts from `started`: whatever start-up takes is inside the budget
        clock = RunClock(cfg.max_time, time.monotonic() if started is None else started, time.monotonic,
                         cfg.eval_interval, min(cfg.rouge_samples, len(val_set)), after_summaries,
                         int(cfg.evaluate_after) + int(cfg.predict_after),
                         step_tokens=cfg.batch_size * float((train_set.lengths - 1).mean()))
    starting = Starting(rt, clock)
    starting("building the model")
    torch.manual_seed(cfg.seed)  # identical initial weights on every rank
    model, ckpt = model_to_train(cfg, start)
    chosen = None  # micro_batch_size=auto: the choice, in words
    if cfg.micro_batch_size == "auto":
        starting("planning memory for micro_batch_size=auto")
        rows, chosen = choose_micro_batch(cfg, rt, model, train_set, val_set)
        cfg = replace(cfg, micro_batch_size=rows)
    base = kept_lora_base(cfg, model, ckpt) if rt.is_main else None
    disk = run_folder.DiskPlan(model, cfg, small_lora=base is not None, train_rows=len(train_set))
    rt.stop_if(disk.problem(resuming(cfg)) if rt.is_main else None)
    # before anything compiles: the compiled work of the run this one continues, starts from or replaces
    cached = rt.load_compiled_work(os.path.dirname(os.path.abspath(
        resume_path(cfg) if resuming(cfg) else cfg.init_from if is_checkpoint(cfg.init_from) else
        os.path.join(cfg.out_dir, run_folder.CKPT))))
    # every input is checked: an earlier run's files can go aside
    moved = run_folder.set_aside_earlier_run(cfg.out_dir) if rt.is_main and not resuming(cfg) else None
    if moved:
        print(moved)
    model.gradient_checkpointing = cfg.gradient_checkpointing
    model = model.to(rt.device)
    # micro_batch_size=auto: an out-of-memory error in a step's peak lowers it; not under FSDP, whose peak is a sharded
    # model's, which runs only with the other ranks (a rank out of memory would leave them waiting)
    if chosen and rt.backend != "fsdp":
        starting("running a step on the longest rows")
        cfg, chosen = micro_batch_that_runs(cfg, rt, model, train_set, chosen)
    tracker.cfg = cfg  # the hyperparameters it logs are the chosen settings
    objective = objective(cfg, rt, train_set, model, ckpt)
    state = TrainingState.start(rt.parallel.shard(model), cfg, rt, train_rows=train_set.fingerprints(),
                                validation_digest=val_set.digest, lora_base=base,
                                base=ckpt["config"]["init_from"] if ckpt else cfg.init_from,
                                extra=dict(objective.checkpoint_keys))
    torch.manual_seed(cfg.seed + rt.rank)  # dropout masks differ per rank
    notes = list(splits.notes) + ([cached] if cached and rt.is_main else [])
    if ckpt is not None:
        notes += state.restore(ckpt, cfg, rt, resume_path(cfg))
        if rt.is_main:
            notes += filter(None, [resumed_history(resume_path(cfg), cfg.out_dir, state.step)])
    model = state.model
    prompts, _ = inference.Summarizer(model, cfg).prompts(val_set.dialogues[:min(cfg.rouge_samples, len(val_set))])
    # compiled or eager: the decoding of every evaluation and of evaluate_after/predict_after, in this process
    evaluations = (cfg.max_iters - state.step) // cfg.eval_interval + 1
    decode_step, decoding = rt.decoding(evaluations * inference.decode_steps(len(prompts), cfg, rt.world_size)
                                        + inference.decode_steps(after_summaries, cfg, rt.world_size),
                                        model.config.n_layer)
    module, compiled_module, compiled, seconds = step_module(cfg, rt, objective, state, starting)
    accum_steps = grad_accum_steps(cfg, rt.world_size)
    if clock:
        clock.validation_tokens, clock.save_bytes = validation_tokens(cfg, val_set), disk.ckpt + disk.best
        # the batch of summaries timed: the evaluations' prompts, else the after-run's kind, if any
        summaries = prompts or (inference.Summarizer(model, cfg).prompts(val_set.dialogues[:cfg.gen_batch_size])[0]
                                if after_summaries else [])
        prime_clock(clock, cfg, rt, objective, state, module, summaries, decode_step, accum_steps, starting)
    if rt.is_main:
        if cfg.lora_rank and cfg.init_from == "scratch":
            print(f"warning: lora_rank={cfg.lora_rank} with init_from=scratch trains small adapters on frozen "
                  f"random weights, which learns little: start from GPT-2 (init_from=gpt2) or train every "
                  f"weight (lora_rank=0)", file=sys.stderr)
        print("\n".join([*notes, *start_lines(cfg, rt, state, len(train_set), len(val_set), accum_steps,
                                                f"{rt.describe(compiled)}; {decoding}", chosen, disk, clock)]))
        save_config(cfg, os.path.join(cfg.out_dir, run_folder.CONFIG))
    # max_time's cooldown comes in the last of the sessions the run is planned over
    return Run(cfg, state, objective, module, compiled_module, seconds, val_set, prompts, decode_step,
               tracker, clock, sessions_done(state.schedule) + 1 >= cfg.sessions,
               peak_flops(rt.device_name, rt.dtype) if rt.device.type == "cuda" else None)


class Starting:
    """Before step 1, which a big model reaches after minutes: rank 0 says what start-up does next, and a budget
    that start-up has spent stops every rank there, in one line."""

    def __init__(self, rt, clock):
        self.rt, self.clock = rt, clock

    def __call__(self, what):
        if self.rt.is_main:
            print(f"start-up: {what} ...", flush=True)
        if self.clock:
            self.rt.stop_if(self.clock.start_up_problem() if self.rt.is_main and self.clock.left() <= 0 else None)


def step_module(cfg, rt, objective, state, starting):
    """(what a step calls: the objective's module, compiled when the runtime compiles (tried on the first
    micro-batch, on the device) and wrapped by the backend; the CompiledModule in it, or None; what runs under
    torch.compile, in words, for the start line; the seconds the step's compile took, or None)."""
    module, compiled, seconds = objective.module(state.model), "eager", None
    if rt.compile_training:
        first = objective.on_device(objective.batches(state.step).micro_batches[0], rt.device)
        starting("compiling the training step")
        start = time.perf_counter()
        with memory_hint(cfg, rt):
            module = compile_model(module, lambda m: objective.losses(m, first)[0], rt.autocast())
        if isinstance(module, CompiledModule):
            seconds = time.perf_counter() - start
            compiled = f"torch.compile (compiled in {seconds:.0f} s)"
    elif rt.compile:  # the backend trains eagerly (FSDP): decoding compiles alone
        compiled = f"eager training ({rt.backend}), torch.compile decoding"
    return rt.parallel.wrap(module), module if isinstance(module, CompiledModule) else None, compiled, seconds


def prime_clock(clock, cfg, rt, objective, state, module, prompts, decode_step, accum_steps, starting):
    """Before step 1 of a run with max_time, what its clock needs to judge the budget: the first micro-batch's
    forward and backward twice, then (when the run summarizes) a batch of `prompts` decoded twice; the first of
    each pays the one-time costs (compiling, first calls), the second runs warm. Summaries of weights not yet
    trained run to max_new_tokens: an upper bound. Each is announced, and a budget spent by one stops the run
    before the next. Leaves no gradients and draws no random numbers."""
    rng = rng_state()
    batch = objective.batches(state.step)
    first = objective.on_device(batch.micro_batches[0], rt.device)
    starting("timing a training step (its first call pays the one-time costs)")
    with memory_hint(cfg, rt):
        for _ in range(2):
            start = time.perf_counter()
            with rt.autocast():
                token_loss, weighed, _ = objective.losses(module, first)
            (token_loss + weighed).backward()
            seconds = time.perf_counter() - start
        starting("timing a training step (warm)")
    state.optimizer.zero_grad(set_to_none=True)
    clock.primed = seconds * accum_steps / batch.tokens  # the first micro-batch is the step's longest
    prompts = prompts[:cfg.gen_batch_size * rt.world_size]
    if prompts:
        starting(f"timing a batch of {len(prompts)} summaries")
        model = inference.rouge_model(state.model, cfg, rt)
        for _ in range(2):
            start = time.perf_counter()
            inference.summarize_sharded(model, prompts, cfg, rt, progress=False, decode_step=decode_step)
            clock.summaries.add(time.perf_counter() - start, len(prompts))
    set_rng_state(rng)


def validation_tokens(cfg, val_set):
    """The tokens an evaluation's validation loss reads (eval_val_batches micro-batches, or the whole split)."""
    rows = len(val_set)
    read = min(1, (cfg.eval_val_batches * cfg.micro_batch_size or rows) / max(1, rows))
    return float((val_set.lengths - 1).sum()) * read


def start_lines(cfg, rt, state, train_rows, validation_rows, accum_steps, runs, chosen, disk, clock):
    """What rank 0 prints of the run before the first step: the rows, the batch, the model and what runs; the
    micro-batch micro_batch_size=auto chose (in words, or None); the disk plan; what max_time buys (clock)."""
    trained = ""
    if cfg.lora_rank:
        count = sum(p.numel() for p in state.model.parameters() if p.requires_grad)
        trained = f" ({count / 1e6:.2f}M trained: LoRA rank {cfg.lora_rank} on {','.join(cfg.lora_targets)})"
    return [f"{train_rows} training and {validation_rows} validation examples; {cfg.batch_size} sequences per "
            f"step = {cfg.micro_batch_size} per micro-batch x {rt.world_size} process(es) x {accum_steps} "
            f"accumulation steps; {state.model.num_params() / 1e6:.1f}M parameters{trained}; {runs}",
            *([chosen] if chosen else []),
            f"checkpoints in {cfg.out_dir}: {disk.describe()} at their peak; {disk.room()}",
            *([clock.budget_line(state.step, cfg.max_iters, decayed(state.step, state.schedule),
                                 sessions_done(state.schedule) + 1, cfg.sessions)] if clock else [])]


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
