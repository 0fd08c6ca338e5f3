"""Building the training state, in the order a run needs it: out_dir, data (and the files read after training),
the model to train (fresh, pretrained or resumed), the disk plan, a calibration stage's candidates, the
optimizer, and the compiled step. train.Trainer runs the loop over what these return."""
import os
import sys
from dataclasses import asdict

import torch

import data
from config import Lora, ModelShape, RowFormat, keys
from model import GPT, GPTConfig, Targets
from summarizer import calibrate, lora, runtime
from summarizer.budget import DiskPlan
from summarizer.checkpoint import archive_previous_run, build_model, lora_base_reference, make_out_dir
from summarizer.errors import UserError
from summarizer.inference import CompiledDecodeStep
from summarizer.runtime import compiler_error, warn_compile_failed
from summarizer.submission import check_against_sample


def prepare_out_dir(cfg, rt):
    """Rank 0 makes out_dir and, for a run that does not resume, moves an earlier run's files aside."""
    if rt.is_main:
        make_out_dir(cfg.out_dir)
        if not resuming(cfg):
            moved = archive_previous_run(cfg.out_dir)
            if moved:
                print(moved)


def datasets(cfg, rt):
    """(the train/validation Splits, how many dialogues evaluate_after/predict_after will summarize); the files
    predict reads after hours of training are checked now."""
    splits = data.load_datasets(cfg, is_main=rt.is_main, barrier=rt.barrier)
    after_summaries = len(splits.val) if cfg.evaluate_after else 0
    if cfg.predict_after:
        test = data.read_test(cfg)
        after_summaries += len(test.ids)
        if cfg.sample_submission_csv:
            check_against_sample(test.ids, cfg.sample_submission_csv)
    return splits, after_summaries


def resuming(cfg):
    return cfg.init_from == "resume" or bool(cfg.resume_from)


def resume_path(cfg):
    return cfg.resume_from or os.path.join(cfg.out_dir, "ckpt.pt")


def lora_base_source(cfg):
    """Where a resumed LoRA run's base is now, if the command says (init_from beside resume_from), else None."""
    return cfg.init_from if cfg.init_from != "resume" else None


def model_to_train(cfg):
    """(model, ckpt.pt's contents when resuming, else None) as init_from says: 'scratch', a GPT-2 name or local
    transformers directory, or 'resume' (resume_path), which must not change what the run fixed; with LoRA
    adapters (base frozen) when lora_rank > 0."""
    if not resuming(cfg):
        model, _ = build_model(cfg.init_from, cfg)
        if cfg.lora_rank:
            lora.add_adapters(model, **lora.settings(cfg))
        return model, None
    path = resume_path(cfg)
    if not os.path.isfile(path):
        raise UserError(f"{path} does not exist: nothing to resume; continue another run's with "
                        f"--resume_from=<its ckpt.pt>, or start afresh without --init_from=resume")
    model, ckpt = build_model(path, cfg, keep_adapters=True, lora_base=lora_base_source(cfg))
    if "optimizer" not in ckpt:
        raise UserError(f"{path} holds weights only (a best.pt?), not what resuming needs")
    if model.config.block_size != cfg.block_size:
        raise UserError(f"{path} was trained with block_size={model.config.block_size}, not {cfg.block_size}: "
                        f"resume with --block_size={model.config.block_size}")
    fixed = {**dict.fromkeys(keys(ModelShape), "the model's shape"), **dict.fromkeys(keys(Lora), "the adapters"),
             **dict.fromkeys(keys(RowFormat), "what the model was trained on")}
    for key, what in fixed.items():
        if ckpt["config"][key] != getattr(cfg, key):
            raise UserError(f"{path} was trained with {key}={ckpt['config'][key]!r}, not {getattr(cfg, key)!r}: "
                            f"{what} cannot change when resuming; resume with --{key}={ckpt['config'][key]!r}")
    return model, ckpt


def lora_base(cfg, model, ckpt):
    """What ckpt.pt keeps of a LoRA run's frozen base instead of its weights (where it comes from, its hash),
    or None where it keeps the weights: full fine-tuning, adapters on a random (scratch) base."""
    if not cfg.lora_rank:
        return None
    if ckpt is not None:
        reference = ckpt.get("lora_base")  # none: the adapters sit on a scratch base, which ckpt.pt holds
        return reference and {**reference, "init_from": lora_base_source(cfg) or reference["init_from"]}
    return None if cfg.init_from == "scratch" else lora_base_reference(cfg.init_from, model)


def check_disk(model, cfg, rt, small_lora, train_rows):
    """Rank 0's DiskPlan of out_dir (None on other ranks); every rank stops if it does not fit."""
    disk = DiskPlan(model, cfg, small_lora=small_lora, train_rows=train_rows) if rt.is_main else None
    rt.stop_if(disk.problem() if rt.is_main else None)
    return disk


def calibration_candidates(model, train_set, cfg, rt, ckpt):
    """(key, Candidates) of a calibration stage: made by the starting weights, or on resuming those that the
    checkpoint's stage trained on (the file must be there: the weights that made it are not)."""
    if ckpt is None:
        key = rt.all_gather_objects(calibrate.candidates_key(model, train_set, cfg) if rt.is_main else None)[0]
    elif ckpt["candidates"] is None:
        raise UserError(f"{resume_path(cfg)} was trained without the ranking loss: start the calibration stage "
                        f"from its weights in a new out_dir (--init_from=<its best.pt> --out_dir=<new>), or "
                        f"resume with --rank_weight=0")
    else:
        key = ckpt["candidates"]
    candidates = calibrate.make_candidates(model, train_set, cfg, rt, key, may_generate=ckpt is None)
    if rt.is_main:
        print(f"calibration: {calibrate.describe(candidates)} in {calibrate.candidates_path(cfg)}")
    return key, candidates


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


def compiled_and_wrapped(model, cfg, rt, first_batch):
    """(what a training step calls: the model, or a calibration stage's PackedScorer, compiled when the runtime
    compiles (tried on first_batch(), on the device) and wrapped by the backend; the decode step for ROUGE)."""
    trained, step = calibrate.PackedScorer(model) if cfg.rank_weight else model, None
    if rt.compile:
        x, y = first_batch()[:2]
        with out_of_memory_hint(cfg, rt):
            compiled = compile_model(trained, x, y, rt.autocast())
        if compiled is not trained:
            trained, step = compiled, CompiledDecodeStep()
    return rt.parallel.wrap(trained), step


def compile_model(model, x, y, autocast):
    """torch.compile'd `model` (a GPT, or a calibration stage's PackedScorer), tried on one forward and backward
    of micro-batch (x, y) now, because compiling happens lazily at the first call; the eager model, with one
    warning line, if the compiler fails. Any other error (out of memory included) propagates. Leaves no
    gradients behind and draws no random numbers. One graph (fullgraph) with its sizes symbolic from the start
    (dynamic): micro-batch widths and target counts change every step."""
    rng = rng_state()
    try:
        compiled = torch.compile(model, fullgraph=True, dynamic=True)
        with autocast:
            out = compiled(x, Targets.of(y) if isinstance(y, torch.Tensor) else y)
        (out[1] if isinstance(out, tuple) else out).sum().backward()
        return compiled
    except Exception as e:  # compiler support varies by platform, GPU, C++ compiler and torch build
        if not compiler_error(e):
            raise  # e.g. out of memory: eager needs more, not less
        warn_compile_failed(e, "training eagerly")
        return model
    finally:
        model.zero_grad(set_to_none=True)
        set_rng_state(rng)


def out_of_memory_hint(cfg, rt):
    """What an out-of-memory while training says to lower (one generating summaries names gen_batch_size)."""
    n, reduce_once = cfg.micro_batch_size, getattr(rt.parallel, "reduce_once", False)
    return runtime.out_of_memory_hint(f"training on micro-batches of {n} sequences",
                                      f"--micro_batch_size (now {n}; batch_size stays, with more accumulation steps)"
                                      + ("" if cfg.gradient_checkpointing else " or set --gradient_checkpointing=True")
                                      + (" or set --fsdp_reduce_once=False (it keeps the weights gathered and the "
                                         "gradients unsharded)" if reduce_once is True else ""))


def step_flops(model, train_set, batches, step):
    """Model FLOPs of optimizer step `step` (all ranks): real tokens only, padding is not useful work."""
    lengths = train_set.lengths[batches.sampler.global_batch(step)] - 1
    return model.training_flops(int(lengths.sum()), batches.target_tokens(step), int((lengths ** 2).sum()))


def rouge_model(model, cfg, rt):
    """The model that summarizes for ROUGE during training: the trained one, or under FSDP, where every forward is
    a collective that ranks generating different lengths cannot keep in step, a plain copy with the gathered (and
    LoRA-merged) weights: it needs room for a full copy of the weights on each GPU."""
    if rt.backend != "fsdp":
        return model
    weights = rt.parallel.full_weights(model)
    if cfg.lora_rank:
        weights = lora.merged_state_dict(weights, **lora.settings(cfg))
    with torch.device(rt.device):
        copy = GPT(GPTConfig(**asdict(model.config)))
    copy.load_state_dict(weights)
    return copy.eval()


def start_lines(trainer, notes, disk):
    """What rank 0 prints before the first step: notes, the line that says what runs, the disk plan."""
    cfg, rt, model = trainer.cfg, trainer.rt, trainer.model
    lines = list(notes)
    if cfg.lora_rank and cfg.init_from == "scratch":
        print(f"warning: lora_rank={cfg.lora_rank} with init_from=scratch trains small adapters on frozen "
              f"random weights, which learns little: start from GPT-2 (init_from=gpt2) or train every "
              f"weight (lora_rank=0)", file=sys.stderr)
    trained = ""
    if cfg.lora_rank:
        count = sum(p.numel() for p in model.parameters() if p.requires_grad)
        trained = f" ({count / 1e6:.2f}M trained: LoRA rank {cfg.lora_rank} on {cfg.lora_targets})"
    lines.append(f"{len(trainer.train_set)} training and {len(trainer.val_set)} validation examples; "
                 f"{cfg.batch_size} sequences per step = {cfg.micro_batch_size} per micro-batch x "
                 f"{rt.world_size} process(es) x {trainer.accum_steps} accumulation steps; "
                 f"{model.num_params() / 1e6:.1f}M parameters{trained}; {rt.describe()}")
    lines.append(f"checkpoints in {cfg.out_dir}: {disk.describe()} at their peak")
    return lines
