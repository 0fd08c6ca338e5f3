"""One typed config for train.py, evaluate.py and predict.py: defaults, presets and --key=value overrides.

    python train.py [preset.py|preset.json ...] [--key=value ...]      later arguments win; --help lists the keys

Values are Python literals (`--learning_rate=3e-4`, `--compile=False`, `--prompt_template='"..."'`); for a text
field a bare word is taken as it is (`--init_from=gpt2-medium`, `--device=cuda:1`). Preset .py files are parsed
with `ast`, never executed: only top-level `name = <literal>` lines. `python config.py` prints the reference
table of all keys in Markdown.
"""
import ast
import dataclasses
import difflib
import json
import os
import re
import sys
import typing
from dataclasses import dataclass, field, fields

from summarizer.errors import UserError
from summarizer.files import atomic_write

KAGGLE_INPUT = "/kaggle/input/nanogpt-fudannlp-cs-30040"
PROMPT_TEMPLATE = "\n\n### DIALOGUE:\n{dialogue}\n\n### SUMMARY:\n"
LOG_DESTINATIONS = ("tensorboard", "wandb")
GPT2_NAMES = ("gpt2", "gpt2-medium", "gpt2-large", "gpt2-xl")
LORA_TARGETS = ("attn.c_attn", "attn.c_proj", "mlp.c_fc", "mlp.c_proj")
ROUGE_TYPES = ("rouge1", "rouge2", "rougeL", "rougeLsum")


def competition_file(name, fallback):
    """The Kaggle competition's input file when running on Kaggle, else the local path."""
    path = os.path.join(KAGGLE_INPUT, name)
    return path if os.path.exists(path) else fallback


def option(default, help, choices=None):
    """A config field with its one-line doc (and allowed values); a callable default is evaluated per Config."""
    metadata = {"help": help, "choices": choices}
    if callable(default):
        return field(default_factory=default, metadata=metadata)
    return field(default=default, metadata=metadata)


@dataclass
class Split:
    """Which rows train and which validate: inference takes them from the checkpoint."""
    train_csv: str = option(lambda: competition_file("train.csv", "data/train.csv"),
                            f"training CSV (id, dialogue, summary); {KAGGLE_INPUT}/train.csv on Kaggle, "
                            "else data/train.csv")
    validation_csv: str = option("", "validation CSV; '' = hold out val_fraction of train_csv")
    dialogue_column: str = option("", "dialogue column; '' = auto (dialogue, article, document, text)")
    summary_column: str = option("", "summary column; '' = auto (summary, highlights, abstract)")
    id_column: str = option("", "id column; '' = auto (id)")
    val_fraction: float = option(0.05, "fraction of train_csv held out for validation when validation_csv is ''")
    split_seed: int = option(42, "seed of the train/validation split (same split on every rank and every run)")


@dataclass
class Submission:
    """What predict.py summarizes, and the sample submission its ids must match."""
    test_csv: str = option(lambda: competition_file("test.csv", "data/test.csv"),
                           f"CSV to summarize (id, dialogue); {KAGGLE_INPUT}/test.csv on Kaggle, else data/test.csv")
    sample_submission_csv: str = option(lambda: competition_file("sample_submission.csv", ""),
                                        "sample submission whose ids submission.csv must match; '' = no check")


@dataclass
class RowFormat:
    """How a training row is made: fixed by training, so inference takes it from the checkpoint."""
    prompt_template: str = option(PROMPT_TEMPLATE, "prompt around the dialogue; the model continues it with the "
                                                   "summary and <|endoftext|>; must contain {dialogue} once")
    train_on_prompt: bool = option(False, "also train on the prompt tokens (default: loss on summary + EOS only)")
    block_size: int = option(1024, "longest sequence in tokens, a multiple of 8; longer dialogues are cut")


@dataclass
class Run:
    """Where a run starts from and writes to."""
    data_cache_dir: str = option(".cache/data", "where tokenized CSVs are cached (keyed by file contents and settings)")
    out_dir: str = option("out", "checkpoints, config.json, logs and submission.csv go here")
    init_from: str = option("gpt2", "'scratch', 'resume' (out_dir/ckpt.pt), a GPT-2 name (gpt2 .. gpt2-xl) "
                                    "or a local transformers model directory")
    resume_from: str = option("", "init_from=resume: the ckpt.pt to continue, e.g. an earlier session's output "
                                  "attached as input; '' = out_dir/ckpt.pt")
    ckpt: str = option("", "checkpoint evaluate.py/predict.py/export.py load; '' = out_dir/best.pt")
    baseline: str = option("", "evaluate.py/predict.py: score this instead of the checkpoint: 'scratch' (untrained, "
                               "the preset's shape), a GPT-2 name or a transformers directory; its outputs go to "
                               "out_dir/baseline-<name>/")


@dataclass
class ModelShape:
    """A model's shape from scratch (a pretrained or resumed model brings its own)."""
    n_layer: int = option(12, "transformer blocks (init_from='scratch' only)")
    n_head: int = option(12, "attention heads (init_from='scratch' only)")
    n_embd: int = option(768, "embedding width, a multiple of n_head (init_from='scratch' only)")
    bias: bool = option(True, "biases in Linear and LayerNorm layers (init_from='scratch' only)")


@dataclass
class Training:
    """The optimization: batch, steps, learning rate and its schedule, time budget."""
    dropout: float = option(0.0, "dropout probability while training")
    batch_size: int = option(256, "effective batch: sequences per optimizer step, summed over ranks and accumulation")
    micro_batch_size: int = option(8, "sequences per forward pass on one rank")
    max_iters: int = option(300, "optimizer steps")
    learning_rate: float = option(2e-4, "peak learning rate")
    min_lr: float = option(2e-5, "learning rate at the end of the cosine decay")
    warmup_iters: int = option(20, "steps of linear warmup")
    lr_decay_iters: int = option(0, "step where the cosine decay reaches min_lr; 0 = max_iters")
    grad_clip: float = option(1.0, "clip the gradient norm to this; 0 = off")
    seed: int = option(1337, "seed of the data order, dropout and sampling")
    max_time: str = option("", "time budget of the run, in seconds or as a duration (11h30m): training stops in "
                               "time to evaluate, write ckpt.pt and run evaluate_after/predict_after; '' = none")
    gradient_checkpointing: bool = option(False, "recompute each block's activations in backward instead of "
                                                 "keeping them: far less activation memory for ~1/3 more compute")


@dataclass
class AdamW:
    """AdamW's settings, which a resumed run applies to the optimizer it restores."""
    weight_decay: float = option(0.1, "AdamW weight decay on 2-D weights")
    beta1: float = option(0.9, "AdamW beta1")
    beta2: float = option(0.95, "AdamW beta2")


@dataclass
class Lora:
    """LoRA adapters (lora_rank 0 = full fine-tuning)."""
    lora_rank: int = option(0, "0 = full fine-tuning; > 0 = train only LoRA adapters of this rank (peft) on the "
                               "lora_targets; best.pt holds the merged weights")
    lora_alpha: float = option(16.0, "LoRA scaling: the adapters' update is multiplied by lora_alpha / lora_rank")
    lora_dropout: float = option(0.05, "dropout on the LoRA adapters' input while training")
    lora_targets: str = option(",".join(LORA_TARGETS), f"comma-separated Linear layers of each block that get "
                                                        f"adapters, among {', '.join(LORA_TARGETS)}")


@dataclass
class Evaluation:
    """Evaluation during training, checkpoints kept, and logging."""
    eval_interval: int = option(50, "evaluate (val loss, ROUGE) and checkpoint every this many steps")
    eval_val_batches: int = option(0, "micro-batches of validation loss per evaluation; 0 = whole split")
    rouge_samples: int = option(200, "validation dialogues summarized for ROUGE per evaluation; 0 = no ROUGE")
    best_metric: str = option("rougeL", "which score picks the checkpoint kept as best", ("rougeL", "val_loss"))
    log_interval: int = option(10, "print training loss every this many steps")
    evaluate_after: bool = option(False, "train.py: when training ends, run evaluate.py on best.pt")
    predict_after: bool = option(False, "train.py: when training ends, run predict.py on best.pt (submission.csv)")
    log_to: str = option("", "also send metrics.jsonl's rows, comma-separated, to: tensorboard (out_dir/tensorboard), "
                             "wandb; '' = nowhere else")
    wandb_project: str = option("gpt2-summarization", "log_to=wandb: the W&B project")
    wandb_run_name: str = option("", "log_to=wandb: the W&B run name; '' = one W&B makes up")


@dataclass
class System:
    """Device, precision, compile and the distributed backend."""
    device: str = option("auto", "auto, cpu, cuda or cuda:N")
    dtype: str = option("auto", "auto = float16 on GPUs before Ampere (T4), bfloat16 on newer, float32 on CPU",
                        ("auto", "float32", "bfloat16", "float16"))
    compile: bool | str = option("auto", "torch.compile the training and decoding steps: auto = on CUDA only (on CPU "
                                         "compiling costs more than a short run saves), True/False = on/off anywhere",
                                 ("auto", True, False))
    backend: str = option("auto", "auto = accelerate under `accelerate launch`, ddp under torchrun, else none; fsdp "
                                  "(under torchrun) shards weights, gradients and optimizer state across the ranks",
                          ("auto", "ddp", "fsdp", "accelerate", "none"))
    fsdp_reduce_once: bool | str = option("auto", "backend=fsdp with gradient accumulation: reduce-scatter gradients "
                                          "once per optimizer step, the weights gathered and fp32 gradients unsharded "
                                          "through its micro-steps (far less traffic, more memory); auto = when these, "
                                          "the shards and AdamW state fit the GPU (activations not counted), False = "
                                          "after every micro-step", ("auto", True, False))
    nccl_p2p_disable: bool = option(False, "set NCCL_P2P_DISABLE=1: GPUs talk through host memory (hosts without "
                                           "working peer-to-peer, e.g. Kaggle's 2xT4)")
    nccl_ib_disable: bool = option(False, "set NCCL_IB_DISABLE=1: nodes talk over TCP sockets, not InfiniBand "
                                          "(only for a broken InfiniBand setup)")
    dist_timeout: int = option(1800, "seconds a rank waits for the others in a collective before failing")


@dataclass
class Decoding:
    """How summaries are decoded: generate()'s settings."""
    max_new_tokens: int = option(128, "longest generated summary in tokens; must be < block_size")
    min_new_tokens: int = option(0, "shortest generated summary in tokens: <|endoftext|> is masked before it")
    num_beams: int = option(1, "beam search width; 1 = greedy or sampling")
    temperature: float = option(0.0, "0 = greedy; > 0 samples (num_beams must be 1, except for MBR's beam candidate)")
    top_k: int = option(0, "sample only among the k most likely tokens; 0 = off")
    top_p: float = option(1.0, "nucleus sampling mass; 1.0 = off")
    epsilon: float = option(0.0, "epsilon sampling: never sample a token of probability below this; 0 = off")
    length_penalty: float = option(1.0, "beam search: > 1 favours longer summaries, < 1 shorter")
    repetition_penalty: float = option(1.0, "> 1 discourages repeating tokens already in the prompt or summary")
    no_repeat_ngram_size: int = option(0, "never repeat an n-gram of this size; 0 = off")
    mbr_samples: int = option(0, "minimum Bayes risk decoding: sample this many summaries per dialogue (needs "
                                 "temperature > 0) and keep the one that agrees most with the others; 0 = off")
    mbr_metric: str = option("rougeL", "MBR: the agreement between two candidate summaries", ROUGE_TYPES)
    mbr_include_beam: bool = option(True, "MBR: the greedy (num_beams=1) or beam search summary is a candidate too")


@dataclass
class Summarizing:
    """How many dialogues one generate() call takes, and evaluate.py's sweep."""
    gen_batch_size: int = option(32, "dialogues summarized per generate() call (fewer where gen_memory_gb says)")
    gen_memory_gb: float = option(0.0, "GiB the KV cache of one generate() call may take (rows x num_beams or "
                                       "mbr_samples); 0 = auto: half the GPU's free memory, 2 on CPU")
    sweep: str = option("", "evaluate.py: score every combination of these decoding settings instead, e.g. "
                            "'num_beams=1,4 min_new_tokens=0,8' (keys apart by spaces, values by commas)")


@dataclass
class Calibration:
    """The calibration stage: a ranking loss on candidate summaries (docs/calibration.md)."""
    rank_weight: float = option(0.0, "> 0: calibration stage (start it from a trained run, --init_from=out/best.pt): "
                                     "candidate summaries of every training dialogue are generated first, and this "
                                     "weighs a ranking loss on them (better ROUGE, higher score) added to the token "
                                     "loss; 0 = token loss only")
    rank_margin: float = option(0.01, "calibration: the ranking loss's margin per rank of difference between two "
                                      "candidates' length-normalised log-probabilities")
    rank_length_exponent: float = option(1.0, "calibration: a candidate's score is its summed token log-probability "
                                              "/ its length ** this")
    rank_candidates: int = option(8, "calibration: candidate summaries drawn per training dialogue "
                                     "(distinct ones kept)")
    rank_decoding: str = option("beam", "calibration: how candidates are drawn: beam (beam search's n-best list) or "
                                        "sample (temperature 0.7, top-k 50)", ("beam", "sample"))
    candidates_file: str = option("", "calibration: where the candidates are kept; '' = out_dir/candidates.pt")


@dataclass
class Export:
    """export.py's output."""
    export_dir: str = option("", "export.py: the transformers model folder to write (new or empty)")
    overwrite: bool = option(False, "export.py: replace an earlier export in export_dir")


# in the order of --help and the reference
GROUPS = (Split, Submission, RowFormat, Run, ModelShape, Training, AdamW, Lora, Evaluation, System, Decoding,
          Summarizing, Calibration, Export)


@dataclass
class Config(*reversed(GROUPS)):
    """Every setting of train.py, evaluate.py, predict.py and export.py, flat (--key=value, config.json, a
    checkpoint's saved config); the groups above name the settings that belong together."""

    def __post_init__(self):
        check_values(self)


def keys(group):
    """The names of a group's settings."""
    return tuple(f.name for f in fields(group))


def part(cfg, group):
    """The group's settings of a Config (e.g. part(cfg, Decoding) for generate)."""
    return group(**{key: getattr(cfg, key) for key in keys(group)})


def check_values(cfg):
    """Raise UserError naming the first key whose value cannot work."""
    check_ranges(cfg)
    check_combinations(cfg)


def check_ranges(cfg):
    """Each value alone: among its choices, in its range."""
    for f in fields(cfg):
        choices = f.metadata["choices"]
        if choices and getattr(cfg, f.name) not in choices:
            raise UserError(f"{f.name}={getattr(cfg, f.name)!r} is not one of {', '.join(map(str, choices))}")
    positive = ("batch_size", "micro_batch_size", "n_layer", "n_head", "n_embd", "block_size", "eval_interval",
                "log_interval", "max_new_tokens", "num_beams", "gen_batch_size", "dist_timeout", "max_iters")
    non_negative = ("warmup_iters", "lr_decay_iters", "eval_val_batches", "rouge_samples", "top_k",
                    "no_repeat_ngram_size", "split_seed", "seed", "min_lr", "weight_decay", "grad_clip",
                    "temperature", "mbr_samples", "lora_rank")
    for name in positive:
        if getattr(cfg, name) <= 0:
            raise UserError(f"{name}={getattr(cfg, name)} must be > 0")
    for name in non_negative:
        if getattr(cfg, name) < 0:
            raise UserError(f"{name}={getattr(cfg, name)} must be >= 0")
    for name in ("val_fraction", "dropout", "beta1", "beta2", "lora_dropout", "epsilon"):
        if not 0 <= getattr(cfg, name) < 1:
            raise UserError(f"{name}={getattr(cfg, name)} must be in [0, 1)")
    parse_duration(cfg.max_time)
    for name in ("rank_weight", "rank_margin", "rank_length_exponent"):
        if getattr(cfg, name) < 0:
            raise UserError(f"{name}={getattr(cfg, name)} must be >= 0")
    if cfg.rank_candidates < 2:
        raise UserError(f"rank_candidates={cfg.rank_candidates} must be >= 2: the ranking loss compares candidates")
    if cfg.gen_memory_gb < 0:
        raise UserError(f"gen_memory_gb={cfg.gen_memory_gb} must be >= 0 (0 = auto)")
    if cfg.learning_rate <= 0:
        raise UserError(f"learning_rate={cfg.learning_rate} must be > 0")
    if cfg.lora_alpha <= 0:
        raise UserError(f"lora_alpha={cfg.lora_alpha} must be > 0")
    for target in lora_target_list(cfg.lora_targets) or [""]:
        if target not in LORA_TARGETS:
            raise UserError(f"lora_targets={cfg.lora_targets!r}: {target!r} is not one of {', '.join(LORA_TARGETS)} "
                            f"(give one or more, comma-separated)")
    if not 0 < cfg.top_p <= 1:
        raise UserError(f"top_p={cfg.top_p} must be in (0, 1]")
    if cfg.repetition_penalty <= 0:
        raise UserError(f"repetition_penalty={cfg.repetition_penalty} must be > 0 (1.0 = off)")


def check_combinations(cfg):
    """Values that must agree with each other, and the texts that are parsed."""
    unknown = [d for d in cfg.log_to.split(",") if d and d not in LOG_DESTINATIONS]
    if unknown:
        raise UserError(f"log_to={cfg.log_to!r}: {unknown[0]!r} is not one of {', '.join(LOG_DESTINATIONS)} "
                        f"(comma-separated, no spaces)")
    if not re.fullmatch(r"auto|cpu|cuda(:\d+)?", cfg.device):
        raise UserError(f"device={cfg.device!r} is not one of auto, cpu, cuda, cuda:N")
    if cfg.n_embd % cfg.n_head:
        raise UserError(f"n_embd={cfg.n_embd} is not a multiple of n_head={cfg.n_head}")
    if cfg.block_size % 8:
        raise UserError(f"block_size={cfg.block_size} must be a multiple of 8 (batches are padded to multiples of 8)")
    if cfg.init_from in GPT2_NAMES and cfg.block_size > 1024:
        raise UserError(f"block_size={cfg.block_size} exceeds GPT-2's 1024 positions: use block_size <= 1024 "
                        f"or init_from='scratch'")
    if cfg.batch_size % cfg.micro_batch_size:
        raise UserError(f"batch_size={cfg.batch_size} is not a multiple of micro_batch_size={cfg.micro_batch_size}")
    if not 0 <= cfg.min_new_tokens <= cfg.max_new_tokens:
        raise UserError(f"min_new_tokens={cfg.min_new_tokens} must be in [0, max_new_tokens={cfg.max_new_tokens}]")
    if cfg.mbr_samples and cfg.temperature == 0:
        raise UserError(f"mbr_samples={cfg.mbr_samples} samples its candidates: set temperature > 0 (e.g. 0.7)")
    if cfg.num_beams > 1 and cfg.temperature > 0 and not (cfg.mbr_samples and cfg.mbr_include_beam):
        raise UserError(f"num_beams={cfg.num_beams} is beam search, which does not sample: use temperature=0.0 "
                        f"or num_beams=1 (or, for MBR's beam candidate, mbr_samples > 0 and mbr_include_beam=True)")
    parse_sweep(cfg.sweep)
    if cfg.best_metric == "rougeL" and cfg.rouge_samples == 0:
        raise UserError("best_metric='rougeL' needs rouge_samples > 0 (or use best_metric='val_loss')")
    try:
        ok = cfg.prompt_template.count("{dialogue}") == 1 and cfg.prompt_template.format(dialogue="") is not None
    except (KeyError, IndexError, ValueError):
        ok = False
    if not ok:
        raise UserError(f"prompt_template={cfg.prompt_template!r} must contain {{dialogue}} exactly once and no "
                        f"other braces (write {{{{ and }}}} for literal ones)")


def parse_duration(text):
    """max_time's seconds: '' -> None, '5400' or '5400s' -> 5400.0, '11h30m' -> 41400.0, '1.5h' -> 5400.0."""
    if not text.strip():
        return None
    parts = re.fullmatch(r"\s*(?:([\d.]+)h)?\s*(?:([\d.]+)m)?\s*(?:([\d.]+)s?)?\s*", text)
    try:
        hours, minutes, seconds = (float(p or 0) for p in parts.groups())
    except (AttributeError, ValueError):
        parts = None
    if parts is None or not any(parts.groups()) or hours * 3600 + minutes * 60 + seconds <= 0:
        raise UserError(f"max_time={text!r} is not a positive duration: write seconds (41400) or e.g. 11h30m, 45m")
    return hours * 3600 + minutes * 60 + seconds


def lora_target_list(lora_targets):
    return [t.strip() for t in lora_targets.split(",") if t.strip()]


def sweep_keys():
    """What evaluate.py --sweep may vary: the decoding settings but the summary budget (fixed by training), the
    sampling seed and the generation batch."""
    return (*keys(Decoding)[1:], "seed", "gen_batch_size")


def parse_sweep(text):
    """'num_beams=1,4 length_penalty=0.8,1.0' -> every combination, as [{key: value}, ...] (the last key varies
    fastest); [] for ''. Values are read as --key=value would be."""
    settings = [{}] if text.strip() else []
    for group in text.split():
        key, eq, values = group.partition("=")
        if not eq or not values:
            raise UserError(f"sweep={text!r}: cannot read {group!r}, write key=value1,value2,...")
        if key not in sweep_keys():
            raise UserError(f"sweep={text!r}: {key!r} is not a decoding setting; "
                            f"sweep one of {', '.join(sweep_keys())}")
        try:
            typed_values = [parse_override(f"--{key}={value}")[1] for value in values.split(",")]
        except UserError as e:
            raise UserError(f"sweep={text!r}: {e}") from None
        settings = [dict(s, **{key: v}) for s in settings for v in typed_values]
    return settings


def grad_accum_steps(cfg, world_size):
    """Micro-batches each rank runs per optimizer step so that all ranks together process batch_size sequences."""
    per_pass = cfg.micro_batch_size * world_size
    if cfg.batch_size % per_pass:
        raise UserError(f"batch_size={cfg.batch_size} is not a multiple of micro_batch_size * world_size = "
                        f"{cfg.micro_batch_size} * {world_size} = {per_pass}: set --batch_size to a multiple of "
                        f"{per_pass} or --micro_batch_size so that micro_batch_size * {world_size} divides "
                        f"{cfg.batch_size}")
    return cfg.batch_size // per_pass


# ---- parsing --------------------------------------------------------------------------------------------

FIELDS = {f.name: f for f in fields(Config)}


def check_key(key, source):
    if key not in FIELDS:
        close = difflib.get_close_matches(key, FIELDS, n=1)
        hint = f"did you mean {close[0]!r}?" if close else "run with --help to list the keys"
        raise UserError(f"unknown config key {key!r} in {source}: {hint}")


def types_of(f):
    """The types a field accepts: (int,), or (bool, str) for `bool | str`."""
    return typing.get_args(f.type) or (f.type,)


def type_name(f):
    return " or ".join(kind.__name__ for kind in types_of(f))


def typed(key, value, source):
    """`value` as the field's type (an int is accepted for a float), or UserError naming the key."""
    check_key(key, source)
    kinds = types_of(FIELDS[key])
    if kinds == (float,) and type(value) is int:
        return float(value)
    if type(value) not in kinds:
        raise UserError(f"{key} expects {type_name(FIELDS[key])}, got {value!r} ({type(value).__name__}) in {source}")
    return value


def parse_override(arg):
    """'--key=value' -> (key, value) with the value as a Python literal, or as text for a text field."""
    key, eq, text = arg[2:].partition("=")
    if not arg.startswith("--") or not eq:
        raise UserError(f"cannot read argument {arg!r}: use --key=value, or a preset .py/.json file")
    source = f"--{key}={text}"
    check_key(key, source)
    try:
        value = ast.literal_eval(text)
    except (ValueError, SyntaxError):
        value = text
    if FIELDS[key].type is str and not isinstance(value, str):
        value = text
    return key, typed(key, value, source)


def read_preset(path):
    """{key: value} from a preset: a .json object, or a .py file of top-level `name = <literal>` lines."""
    if not os.path.isfile(path):
        raise UserError(f"preset {path} does not exist: pass an existing .py or .json file")
    with open(path, encoding="utf-8") as f:
        text = f.read()
    if path.endswith(".json"):
        try:
            values = json.loads(text)
        except json.JSONDecodeError as e:
            raise UserError(f"preset {path} is not valid JSON: {e}") from None
        if not isinstance(values, dict):
            raise UserError(f"preset {path} must hold a JSON object of key: value")
        return {key: typed(key, value, path) for key, value in values.items()}
    if not path.endswith(".py"):
        raise UserError(f"preset {path} must end in .py or .json")
    try:
        tree = ast.parse(text, filename=path)
    except SyntaxError as e:
        raise UserError(f"preset {path} line {e.lineno}: syntax error: {e.msg}") from None
    values = {}
    for node in tree.body:
        source = f"{path} line {node.lineno}"
        if isinstance(node, ast.Expr) and isinstance(node.value, ast.Constant) and isinstance(node.value.value, str):
            continue  # a docstring
        if not (isinstance(node, ast.Assign) and len(node.targets) == 1 and isinstance(node.targets[0], ast.Name)):
            raise UserError(f"{source}: only `name = <literal>` lines are allowed in a preset, got "
                            f"{ast.get_source_segment(text, node)!r}")
        try:
            value = ast.literal_eval(node.value)
        except ValueError:
            raise UserError(f"{source}: {ast.get_source_segment(text, node.value)!r} is not a literal "
                            f"(write the value itself, e.g. 256, not 8 * 32)") from None
        values[node.targets[0].id] = typed(node.targets[0].id, value, source)
    return values


def load_config(argv, base=None):
    """The Config from `base` (default: the defaults) updated by presets and --key=value overrides, in order."""
    if "-h" in argv or "--help" in argv:
        print_help()
        raise SystemExit(0)
    values = dataclasses.asdict(base) if base is not None else {}
    for arg in argv:
        if arg.startswith("--"):
            key, value = parse_override(arg)
            values[key] = value
        else:
            values.update(read_preset(arg))
    return Config(**values)


def explicit_keys(argv):
    """The keys given as --key=value (not those a preset sets): what a command asks for in so many words."""
    return {parse_override(arg)[0] for arg in argv if arg.startswith("--") and arg not in ("-h", "--help")}


def print_help():
    """The usage and every key; a reader that stops early (`--help | head`) is not an error."""
    try:
        print(__doc__.strip() + "\n\n" + help_text(), flush=True)
    except BrokenPipeError:
        os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())  # Python's flush at exit would fail again


def save_config(cfg, path):
    """Write the resolved config as JSON, atomically."""
    os.makedirs(os.path.dirname(path) or ".", exist_ok=True)
    with atomic_write(path) as f:
        json.dump(dataclasses.asdict(cfg), f, indent=2)
        f.write("\n")


def changed_settings(argv):
    """'batch_size=32 (config/demo.py), max_iters=5 (command line)': the keys whose value differs from the
    default, and the preset or command line that set them last."""
    defaults, cfg, source = Config(), load_config(argv), {}
    for arg in argv:
        keys_set = [parse_override(arg)[0]] if arg.startswith("--") else read_preset(arg)
        source.update(dict.fromkeys(keys_set, "command line" if arg.startswith("--") else arg))
    changed = [key for key in FIELDS if getattr(cfg, key) != getattr(defaults, key)]
    return ", ".join(f"{key}={getattr(cfg, key)!r} ({source[key]})" for key in changed)


def help_text():
    defaults = Config()
    return "\n".join(f"--{name}={getattr(defaults, name)!r}\n    {f.metadata['help']}" for name, f in FIELDS.items())


def markdown_reference():
    """docs/config.md's reference: a table of keys per group of settings."""
    defaults, sections = Config(), []
    for group in GROUPS:
        rows = [f"### {group.__name__}\n\n{group.__doc__}\n", "| key | type | default | meaning |",
                "| --- | --- | --- | --- |"]
        for f in fields(group):
            default = repr(getattr(defaults, f.name)).replace("|", "\\|")
            rows.append(f"| `{f.name}` | {type_name(f)} | `{default}` | {f.metadata['help']} |")
        sections.append("\n".join(rows))
    return "\n\n".join(sections)


if __name__ == "__main__":
    print(markdown_reference())
