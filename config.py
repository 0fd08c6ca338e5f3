"""Every setting of the four commands, declared once (type, default, rules, scope), the values a command line gives
them, and what a later command takes from a run. It imports nothing from summarizer/: every layer reads it."""
import difflib
import itertools
import json
import os
import re
import typing
from dataclasses import asdict, dataclass, field, fields

import command_line
from command_line import UserError

KAGGLE_INPUT = "/kaggle/input/nanogpt-fudannlp-cs-30040"
PROMPT_TEMPLATE = "\n\n### DIALOGUE:\n{dialogue}\n\n### SUMMARY:\n"
LOG_DESTINATIONS = ("tensorboard", "wandb")
LORA_TARGETS = ("attn.c_attn", "attn.c_proj", "mlp.c_fc", "mlp.c_proj")
ROUGE_TYPES = ("rouge1", "rouge2", "rougeL", "rougeLsum")
BOOL_FORMS = "true/false, yes/no, on/off or 1/0, in any case"


Bound = typing.NamedTuple("Bound", [("ok", typing.Callable), ("text", str)])  # ok(value), else '<key>=<value> <text>'
POSITIVE = Bound(lambda v: v > 0, "must be > 0")
NON_NEGATIVE = Bound(lambda v: v >= 0, "must be >= 0")
FRACTION = Bound(lambda v: 0 <= v < 1, "must be in [0, 1)")


def competition_file(name, fallback):
    path = os.path.join(KAGGLE_INPUT, name)
    return path if os.path.exists(path) else fallback


def option(default, help, scope, choices=None, bound=None, parse=None, why=None, path=False):
    """A setting (a callable default is called per Config); `why`: why a resume cannot change it."""
    why = why or {"shape": "the model's shape", "trained": "what the model was trained on"}.get(scope)
    metadata = dict(help=help, scope=scope, choices=choices, bound=bound, parse=parse, why=why, path=path)
    return field(**{"default_factory" if callable(default) else "default": default}, metadata=metadata)


NUMBER = r"(?:\d+(?:\.\d*)?|\.\d+)"


def parse_duration(text):
    """max_time's seconds from 5400, '5400s', '1.5h', '11h30m' or '1h30m15s' ('1h30' is ambiguous); None from ''."""
    if text is None or (isinstance(text, str) and not text.strip()):
        return None
    compact = re.sub(r"\s", "", str(text))
    compact += "s" if re.fullmatch(NUMBER, compact) else ""  # plain seconds
    match = re.fullmatch(rf"(?:({NUMBER})h)?(?:({NUMBER})m)?(?:({NUMBER})s)?", compact)
    if match is None and re.fullmatch(rf"(?:{NUMBER}h)?(?:{NUMBER}m)?{NUMBER}", compact):
        last = re.findall(r"[hm]", compact)[-1]  # the units after it are the ones meant
        meant = [compact + unit for unit in "hms"["hms".index(last) + 1:]]
        raise UserError(f"max_time={text!r} is ambiguous: write {meant[0]}"
                        + (f" (or {meant[1]})" if len(meant) > 1 else "") + ", each number with its unit")
    hours, minutes, seconds = (float(number or 0) for number in match.groups()) if match else (0, 0, 0)
    seconds += hours * 3600 + minutes * 60
    if type(text) is bool or seconds <= 0:
        raise UserError(f"max_time={text!r} is not a positive duration: write seconds (5400, 5400s) or hours, "
                        f"minutes and seconds, each number with its unit (1.5h, 45m, 11h30m, 1h30m15s)")
    return seconds


def describe_duration(seconds):  # 5415 -> '1h 30m 15s'
    hours, rest = divmod(round(seconds, 3), 3600)
    minutes, rest = divmod(rest, 60)
    parts = [f"{int(hours)}h" if hours else "", f"{int(minutes)}m" if minutes else "", f"{rest:g}s" if rest else ""]
    return " ".join(p for p in parts if p) or "0s"


def parse_targets(value):
    """lora_targets from 'attn.c_attn,mlp.c_fc' (a flag, an older checkpoint) or a list (a .json preset)."""
    names = value.split(",") if isinstance(value, str) else value
    if not isinstance(names, (list, tuple)) or not all(isinstance(n, str) for n in names):
        raise UserError(f"lora_targets={value!r}: give layer names, comma-separated, among {', '.join(LORA_TARGETS)}")
    return tuple(n.strip() for n in names if n.strip())


def sweep_keys():
    """The decoding settings but max_new_tokens (the prompts were cut to leave it room), seed and gen_batch_size."""
    return (*(key for key in keys(Decoding) if key != "max_new_tokens"), "seed", "gen_batch_size")


def parse_sweep(value):
    """{key: (value, ...)} from 'num_beams=1,4 length_penalty=0.8,1.0' or a mapping (config.json), typed as flags."""
    if not isinstance(value, (str, dict)):
        raise UserError(f"sweep={value!r}: write 'key=value1,value2 key2=...'")
    text = isinstance(value, str)
    settings = {}
    for key, values in [group.partition("=")[::2] for group in value.split()] if text else value.items():
        if text and not values:
            raise UserError(f"sweep={value!r}: cannot read {key!r}, write key=value1,value2,...")
        if key == "max_new_tokens":
            raise UserError(f"sweep={value!r}: max_new_tokens cannot be swept: the run's prompts are cut to leave "
                            f"room for its summaries, so one evaluation has one max_new_tokens; evaluate once per "
                            f"value with --max_new_tokens=N")
        if key not in sweep_keys():
            raise UserError(f"sweep={value!r}: {key!r} is not a decoding setting; sweep one of "
                            f"{', '.join(sweep_keys())}")
        try:
            settings[key] = tuple(parse_override(f"--{key}={v}")[1] if text else typed(key, v, f"sweep {key}")
                                  for v in (values.split(",") if text else values))
        except UserError as e:
            raise UserError(f"sweep={value!r}: {e}") from None
    return settings


def sweep_settings(sweep):
    """Every combination of a sweep's values, as [{key: value}, ...] (the last key varies fastest); [] for {}."""
    return [dict(zip(sweep, values, strict=True)) for values in itertools.product(*sweep.values())] if sweep else []


@dataclass
class Split:
    """Which rows train and which validate: inference takes them from the checkpoint."""
    train_csv: str = option(lambda: competition_file("train.csv", "data/train.csv"),
                            f"training CSV (id, dialogue, summary); {KAGGLE_INPUT}/train.csv on Kaggle, "
                            "else data/train.csv", "run", path=True)
    validation_csv: str = option("", "validation CSV; '' = hold out val_fraction of train_csv", "run", path=True)
    dialogue_column: str = option("", "dialogue column; '' = auto (dialogue, article, document, text)", "run")
    summary_column: str = option("", "summary column; '' = auto (summary, highlights, abstract)", "run")
    id_column: str = option("", "id column; '' = auto (id)", "run")
    val_fraction: float = option(0.05, "fraction of train_csv held out for validation when validation_csv is ''",
                                 "run", bound=FRACTION)
    split_seed: int = option(42, "seed of the train/validation split (same split on every rank and every run)",
                             "run", bound=NON_NEGATIVE)


@dataclass
class Submission:
    """What predict.py summarizes, and the sample submission its ids must match."""
    test_csv: str = option(lambda: competition_file("test.csv", "data/test.csv"),
                           f"CSV to summarize (id, dialogue); {KAGGLE_INPUT}/test.csv on Kaggle, else data/test.csv",
                           "training", path=True)
    sample_submission_csv: str = option(lambda: competition_file("sample_submission.csv", ""),
                                        "sample submission whose ids submission.csv must match; '' = no check",
                                        "training", path=True)
    test_dialogue_column: str = option("", "test_csv's dialogue column, where it differs from train_csv's; '' = "
                                           "dialogue_column", "training")
    test_id_column: str = option("", "test_csv's id column, where it differs from train_csv's; '' = id_column",
                                 "training")


@dataclass
class RowFormat:
    """How a training row is made: fixed by training, so inference takes it from the checkpoint."""
    prompt_template: str = option(PROMPT_TEMPLATE, "prompt around the dialogue; the model continues it with the "
                                                   "summary and <|endoftext|>; must contain {dialogue} once", "trained")
    train_on_prompt: bool = option(False, "also train on the prompt tokens (default: loss on summary + EOS only)",
                                   "trained")
    block_size: int = option(1024, "longest sequence in tokens, a multiple of 8, at most the model's positions "
                                   "(GPT-2: 1024); longer dialogues are cut", "trained", bound=POSITIVE)

    def problems(self):
        problems = []
        if self.block_size % 8:
            problems.append(f"block_size={self.block_size} must be a multiple of 8 (batches are padded to multiples "
                            f"of 8)")
        try:
            ok = self.prompt_template.format(dialogue="") is not None and self.prompt_template.count("{dialogue}") == 1
        except (KeyError, IndexError, ValueError):
            ok = False
        if not ok:
            problems.append(f"prompt_template={self.prompt_template!r} must contain {{dialogue}} exactly once and no "
                            f"other braces (write {{{{ and }}}} for literal ones)")
        return problems


@dataclass
class Paths:
    """Where a run starts from and writes to."""
    data_cache_dir: str = option(".cache/data", "where tokenized CSVs are cached (keyed by file contents and "
                                                "settings)", "command", path=True)
    out_dir: str = option("out", "checkpoints, config.json, logs and submission.csv go here", "command", path=True)
    init_from: str = option("gpt2", "'scratch', 'resume' (out_dir/ckpt.pt), a GPT-2 name (gpt2 .. gpt2-xl) "
                                    "or a local transformers model directory", "command", path=True)
    resume_from: str = option("", "init_from=resume: the ckpt.pt to continue, e.g. an earlier session's output "
                                  "attached as input; '' = out_dir/ckpt.pt", "command", path=True)
    ckpt: str = option("", "checkpoint evaluate.py/predict.py/export.py load; '' = out_dir/best.pt", "command",
                       path=True)
    output_quota_dir: str = option("/kaggle/working", "a folder that keeps at most output_quota_gb as output "
                                                      "(Kaggle's: what is beyond is lost at Save Version); a run "
                                                      "writing under it plans its checkpoints against what the quota "
                                                      "leaves; '' = none", "command", path=True)
    output_quota_gb: float = option(20.0, "GB that output_quota_dir keeps", "command", bound=POSITIVE)
    baseline: str = option("", "evaluate.py/predict.py: score this instead of the checkpoint: 'scratch' (untrained, "
                               "the preset's shape), a GPT-2 name, a transformers directory, or an extractive "
                               "baseline: first_line, lead3 or longest3 (lines of the dialogue, no model); its "
                               "outputs go to out_dir/baseline-<name>/", "command", path=True)


@dataclass
class ModelShape:
    """A model's shape from scratch (a pretrained or resumed model brings its own)."""
    n_layer: int = option(12, "transformer blocks (init_from='scratch' only)", "shape", bound=POSITIVE)
    n_head: int = option(12, "attention heads (init_from='scratch' only)", "shape", bound=POSITIVE)
    n_embd: int = option(768, "embedding width, a multiple of n_head (init_from='scratch' only)", "shape",
                         bound=POSITIVE)
    bias: bool = option(True, "biases in Linear and LayerNorm layers (init_from='scratch' only)", "shape")

    def problems(self):
        ok = self.n_head <= 0 or self.n_embd % self.n_head == 0  # n_head <= 0 is its bound's problem
        return [] if ok else [f"n_embd={self.n_embd} is not a multiple of n_head={self.n_head}"]


@dataclass
class Training:
    """The optimization: batch, steps, learning rate and its schedule, time budget."""
    dropout: float = option(0.0, "dropout probability while training", "training", bound=FRACTION)
    batch_size: int = option(256, "effective batch: sequences per optimizer step over all processes (a multiple of "
                                  "their number) and micro-batches", "trained", why="the rows of each step",
                             bound=POSITIVE)
    micro_batch_size: int | str = option(8, "a micro-batch's memory on one rank: at most the positions and targets "
                                            "of this many of the longest rows (a step's rows are cut by length where "
                                            "padding is least, so a micro-batch of short rows holds more); auto = "
                                            "the most the run's memory plan fits on its GPU", "run",
                                         bound=Bound(lambda v: v == "auto" or (type(v) is int and v > 0),
                                                     "must be a number > 0 or auto"))
    max_iters: int = option(300, "optimizer steps", "training", bound=POSITIVE)
    learning_rate: float = option(2e-4, "peak learning rate", "training", bound=POSITIVE)
    min_lr: float = option(2e-5, "learning rate at the end of the cosine decay", "training", bound=NON_NEGATIVE)
    warmup_iters: int = option(20, "steps of linear warmup", "trained", why="the warmup of the schedule",
                               bound=NON_NEGATIVE)
    lr_decay_iters: int = option(0, "step where the cosine decay reaches min_lr; 0 = max_iters", "training",
                                 bound=NON_NEGATIVE)
    grad_clip: float = option(1.0, "clip the gradient norm to this; 0 = off", "training", bound=NON_NEGATIVE)
    seed: int = option(1337, "seed of the data order, dropout and sampling", "run", bound=NON_NEGATIVE)
    max_time: float | None = option(None, "time budget of the run in seconds, given as seconds or a duration "
                                          "(11h30m): training stops in time to evaluate, write ckpt.pt and run "
                                          "evaluate_after/predict_after; None or '' = none; this process's own, never "
                                          "a checkpoint's", "command", parse=parse_duration)
    sessions: int = option(1, "how many max_time sessions (processes that end at their budget) the run is planned "
                              "over: the learning rate cools down to min_lr at the end of the last; each earlier one "
                              "trains at the schedule's LR to its budget", "training", bound=POSITIVE)
    gradient_checkpointing: bool = option(False, "recompute each block's activations in backward instead of "
                                                 "keeping them: far less activation memory for ~1/3 more compute",
                                                 "training")


@dataclass
class AdamW:
    """AdamW's settings, which a resumed run applies to the optimizer it restores."""
    weight_decay: float = option(0.1, "AdamW weight decay on 2-D weights", "training", bound=NON_NEGATIVE)
    beta1: float = option(0.9, "AdamW beta1", "training", bound=FRACTION)
    beta2: float = option(0.95, "AdamW beta2", "training", bound=FRACTION)


@dataclass
class Lora:
    """LoRA adapters (lora_rank 0 = full fine-tuning)."""
    lora_rank: int = option(0, "0 = full fine-tuning; > 0 = train only LoRA adapters of this rank (peft) on the "
                               "lora_targets; best.pt holds the merged weights",
                               "trained", why="the adapters", bound=NON_NEGATIVE)
    lora_alpha: float = option(16.0, "LoRA scaling: the adapters' update is multiplied by lora_alpha / lora_rank",
                               "trained", why="the adapters", bound=POSITIVE)
    lora_dropout: float = option(0.05, "dropout on the LoRA adapters' input while training",
                                 "trained", why="the adapters", bound=FRACTION)
    lora_targets: tuple = option(LORA_TARGETS, f"Linear layers of each block that get adapters (comma-separated on "
                                               f"the command line), among {', '.join(LORA_TARGETS)}",
                                               "trained", why="the adapters", parse=parse_targets)

    def problems(self):
        unknown = [target for target in self.lora_targets or ("",) if target not in LORA_TARGETS]
        return [f"lora_targets={','.join(self.lora_targets)!r}: {unknown[0]!r} is not one of "
                f"{', '.join(LORA_TARGETS)} (give one or more, comma-separated)"] if unknown else []


@dataclass
class Evaluation:
    """Evaluation during training, checkpoints kept, and logging."""
    eval_interval: int = option(50, "evaluate (val loss, ROUGE) and checkpoint every this many steps", "training",
                                bound=POSITIVE)
    eval_val_batches: int = option(0, "micro-batches of validation loss per evaluation; 0 = whole split",
                                   "training", bound=NON_NEGATIVE)
    rouge_samples: int = option(200, "validation dialogues summarized for ROUGE per evaluation; 0 = no ROUGE",
                                "training", bound=NON_NEGATIVE)
    best_metric: str = option("rougeL", "which score picks the checkpoint kept as best.pt; last = every save (a run "
                                        "without validation rows)", "training", ("rougeL", "val_loss", "last"))
    log_interval: int = option(10, "print training loss every this many steps", "training", bound=POSITIVE)
    evaluate_after: bool = option(False, "train.py: when training ends, run evaluate.py on best.pt", "training")
    predict_after: bool = option(False, "train.py: when training ends, run predict.py on best.pt (submission.csv)",
                                 "training")
    log_to: str = option("", "also send metrics.jsonl's rows, comma-separated, to: tensorboard "
                             "(out_dir/tensorboard), wandb; '' = nowhere else", "training")
    wandb_project: str = option("gpt2-summarization", "log_to=wandb: the W&B project", "training")
    wandb_run_name: str = option("", "log_to=wandb: the W&B run name; '' = one W&B makes up", "training")
    compare: str = option("", "evaluate.py: also compare with another evaluation of the same dialogues (its "
                              "out_dir or eval_predictions.csv): paired ROUGE differences on stdout and in "
                              "eval_report.html", "command", path=True)

    def problems(self):
        problems = []
        if self.best_metric == "rougeL" and self.rouge_samples == 0:
            problems.append("best_metric='rougeL' needs rouge_samples > 0 (or use best_metric='val_loss')")
        if unknown := [d for d in self.log_to.split(",") if d and d not in LOG_DESTINATIONS]:
            problems.append(f"log_to={self.log_to!r}: {unknown[0]!r} is not one of {', '.join(LOG_DESTINATIONS)} "
                            f"(comma-separated, no spaces)")
        return problems


@dataclass
class System:
    """Device, precision, compile and the distributed backend."""
    device: str = option("auto", "auto, cpu, cuda or cuda:N", "command")
    dtype: str = option("auto", "auto = float16 on GPUs before Ampere (T4), bfloat16 on newer, float32 on CPU",
                        "command", ("auto", "float32", "bfloat16", "float16"))
    compile: bool | str = option("auto", "torch.compile the training step and replay greedy decoding's steps as "
                                         "CUDA graphs: auto = on CUDA only (on CPU compiling costs more than a "
                                         "short run saves); True/False = on/off anywhere (graphs on CUDA only)",
                                 "command", ("auto", True, False))
    backend: str = option("auto", "auto = accelerate under `accelerate launch`, ddp under torchrun, else none; fsdp "
                                  "(under torchrun) shards weights, gradients and optimizer state across the ranks",
                          "command", ("auto", "ddp", "fsdp", "accelerate", "none"))
    fsdp_reduce_once: bool | str = option("auto", "backend=fsdp with gradient accumulation: reduce-scatter gradients "
                                          "once per optimizer step, the weights gathered and fp32 gradients "
                                          "unsharded through its micro-steps (far less traffic, more memory); auto "
                                          "= where the memory ledger of one row with it fits the GPU (decided "
                                          "before micro_batch_size=auto, which counts it), False = after every "
                                          "micro-step",
                                          "command", ("auto", True, False))
    nccl_p2p_disable: bool = option(False, "set NCCL_P2P_DISABLE=1 and NCCL_CUMEM_HOST_ENABLE=0: GPUs talk through "
                                           "host memory's /dev/shm files (hosts without peer access, e.g. Kaggle's "
                                           "2xT4)", "command")
    nccl_ib_disable: bool = option(False, "set NCCL_IB_DISABLE=1: nodes talk over TCP sockets, not InfiniBand "
                                          "(only for a broken InfiniBand setup)", "command")
    dist_timeout: int = option(1800, "seconds a rank waits for the others in a collective before failing",
                               "command", bound=POSITIVE)
    dist_start_timeout: int = option(120, "seconds the ranks have at start-up to meet and run a first collective "
                                          "(NCCL's setup included) before the run stops in one line", "command",
                                     bound=POSITIVE)

    def problems(self):
        ok = re.fullmatch(r"auto|cpu|cuda(:\d+)?", self.device)
        return [] if ok else [f"device={self.device!r} is not one of auto, cpu, cuda, cuda:N"]


@dataclass
class Decoding:
    """How summaries are decoded: generate()'s settings."""
    max_new_tokens: int = option(128, "longest generated summary in tokens; must be < block_size",
                                 "decoding", bound=POSITIVE)
    min_new_tokens: int = option(0, "shortest generated summary in tokens: <|endoftext|> is masked before it",
                                 "decoding")
    num_beams: int = option(1, "beam search width; 1 = greedy or sampling", "decoding", bound=POSITIVE)
    temperature: float = option(0.0, "0 = greedy; > 0 samples (num_beams must be 1, except for MBR's beam "
                                     "candidate)", "decoding", bound=NON_NEGATIVE)
    top_k: int = option(0, "sample only among the k most likely tokens; 0 = off", "decoding", bound=NON_NEGATIVE)
    top_p: float = option(1.0, "nucleus sampling mass; 1.0 = off", "decoding", bound=Bound(lambda v: 0 < v <= 1,
                                                                                  "must be in (0, 1]"))
    epsilon: float = option(0.0, "epsilon sampling: never sample a token of probability below this; 0 = off",
                            "decoding", bound=FRACTION)
    length_penalty: float = option(1.0, "beam search: > 1 favours longer summaries, < 1 shorter", "decoding")
    repetition_penalty: float = option(1.0, "> 1 discourages repeating tokens already in the prompt or summary",
                                       "decoding", bound=Bound(lambda v: v > 0, "must be > 0 (1.0 = off)"))
    no_repeat_ngram_size: int = option(0, "never repeat an n-gram of this size; 0 = off",
                                       "decoding", bound=NON_NEGATIVE)
    mbr_samples: int = option(0, "minimum Bayes risk decoding: sample this many summaries per dialogue (needs "
                                 "temperature > 0) and keep the one that agrees most with the others; 0 = off",
                                 "decoding", bound=NON_NEGATIVE)
    mbr_metric: str = option("rougeL", "MBR: the agreement between two candidate summaries",
                             "decoding", ROUGE_TYPES)
    mbr_include_beam: bool = option(True, "MBR: the greedy (num_beams=1) or beam search summary is a candidate too",
                                    "decoding")

    def contradiction(self):
        """The first setting that contradicts the others, in one line; ''. Config and generate() both ask it."""
        if not 0 <= self.min_new_tokens <= self.max_new_tokens:
            return f"min_new_tokens={self.min_new_tokens} must be in [0, max_new_tokens={self.max_new_tokens}]"
        if self.mbr_samples and self.temperature <= 0:
            return f"mbr_samples={self.mbr_samples} samples its candidates: set temperature > 0 (e.g. 0.7)"
        if self.num_beams > 1 and self.temperature > 0 and not (self.mbr_samples and self.mbr_include_beam):
            return (f"num_beams={self.num_beams} is beam search, which does not sample: use temperature=0.0 or "
                    f"num_beams=1 (or, for MBR's beam candidate, mbr_samples > 0 and mbr_include_beam=True)")
        return ""

    def problems(self):
        return [self.contradiction()] if self.contradiction() else []


@dataclass
class Summarizing:
    """How many dialogues one generate() call takes, and evaluate.py's sweep."""
    gen_batch_size: int = option(32, "dialogues summarized per generate() call (fewer where gen_memory_gb says)",
                                 "command", bound=POSITIVE)
    gen_memory_gb: float = option(0.0, "GiB the KV cache and logits of one generate() call may take (docs/memory.md); "
                                       "0 = auto: half the GPU's free memory, 2 on CPU", "command",
                                  bound=Bound(lambda v: v >= 0, "must be >= 0 (0 = auto)"))
    sweep: dict = option(dict, "evaluate.py: score every combination of these decoding settings instead, e.g. "
                               "'num_beams=1,4 min_new_tokens=0,8' (keys apart by spaces, values by commas)",
                               "command", parse=parse_sweep)


@dataclass
class Export:
    """export.py's output."""
    export_dir: str = option("", "export.py: the transformers model folder to write (new or empty)", "command",
                             path=True)
    overwrite: bool = option(False, "export.py: replace an earlier export in export_dir", "command")


# in the order of --help and the reference
GROUPS = (Split, Submission, RowFormat, Paths, ModelShape, Training, AdamW, Lora, Evaluation, System, Decoding,
          Summarizing, Export)


@dataclass
class Config(*reversed(GROUPS)):
    """Every setting, flat (--key=value, config.json, a checkpoint's config); groups name those that belong together."""

    def __post_init__(self):
        if problems := self.problems():
            raise UserError("; ".join(problems))

    def problems(self):
        """Each value's broken choices or range, then the broken rules of each group whose values keep those."""
        problems = {}  # key: its value's problem
        for f in fields(self):
            value, choices, bound = getattr(self, f.name), f.metadata["choices"], f.metadata["bound"]
            if choices and value not in choices:
                yes_no = f" (True and False also as {BOOL_FORMS})" if True in choices else ""
                problems[f.name] = f"{f.name}={value!r} is not one of {', '.join(map(str, choices))}{yes_no}"
            elif bound and not bound.ok(value):
                problems[f.name] = f"{f.name}={value!r} {bound.text}"
        return [*problems.values()] + [p for group in GROUPS if hasattr(group, "problems")
                                       and not problems.keys() & set(keys(group)) for p in group.problems(self)]


def keys(group):
    return tuple(f.name for f in fields(group))


def part(cfg, group):
    return group(**{key: getattr(cfg, key) for key in keys(group)})


def rows_per_rank(batch_size, world_size):
    """The rows of a step each process takes: batch_size's one rule, checked before the model is built."""
    if batch_size % world_size:
        raise UserError(f"batch_size={batch_size} does not split over the {world_size} processes of this run (each "
                        f"takes as many of a step's rows): give --batch_size a multiple of {world_size}, e.g. "
                        f"{(batch_size // world_size + 1) * world_size}")
    return batch_size // world_size


FIELDS = {f.name: f for f in fields(Config)}


# The settings each command reads, which its --help lists (any command accepts every key, so that one preset serves
# them all). evaluate.py and predict.py read the shape and the row format for a --baseline, which has no run.
TRAINING_KEYS = tuple(key for key in FIELDS if key not in (*keys(Export), "ckpt", "baseline", "compare", "sweep"))
DECODING_KEYS = (*keys(RowFormat), *keys(ModelShape), "out_dir", "ckpt", "baseline", "seed", "device", "dtype",
                 "compile", "nccl_p2p_disable", "dist_timeout", "dist_start_timeout", *keys(Decoding),
                 "gen_batch_size", "gen_memory_gb")
READS = {"train.py": TRAINING_KEYS,
         "evaluate.py": (*keys(Split), "data_cache_dir", "compare", "sweep", *DECODING_KEYS),
         "predict.py": (*keys(Submission), *DECODING_KEYS),
         "export.py": ("out_dir", "ckpt", *keys(Decoding), *keys(Export))}

# What a later command takes from a run: a row per scope (each setting has one), a column per use of a run's
# checkpoint, an entry per TAKES ("given": by a flag, and for a new run from the weights a preset too: a preset would
# silently change the run a resume continues). resolve() applies it; docs/config.md prints it.
USES = {"resume": "a resume (`--init_from=resume`): continues the run",
        "weights": "a new run from its weights (`--init_from=<a checkpoint>`): the same recipe",
        "inference": "evaluate.py, predict.py: decode the run's model on its data",
        "export": "export.py: the run's model, and a card that describes the run"}
SCOPES = {  # scope: (what it holds, what each of USES takes)
    "shape": ("the model's shape", "run run run run"),
    "trained": ("what training fixed: the row format, `batch_size`, `warmup_iters`, the adapters", "run given run run"),
    "training": ("how the run trains, what it does at its end, the test CSV", "given given own run"),
    "run": ("the data, its split and `seed`, `micro_batch_size`", "given given given run"),
    "decoding": ("how summaries are decoded", "given given given given"),
    "command": ("where and how this command runs: paths, device, precision, budget", "own own own own"),
}
TAKES = {"own": "its own", "given": "the run's unless given", "run": "the run's (a flag against it is refused)"}
REFUSED = {"resume": "resume with --{key}={theirs!r} ({why} cannot change when resuming)",
           "weights": "drop the flag (the checkpoint brings the model's shape)",
           "inference": "drop the flag (the run's value holds for every later command)",
           "export": "drop the flag (the model card describes the run)"}


def takes(key, use):
    """What command `use` takes of setting `key` from a run: "own", "given" or "run"."""
    return SCOPES[FIELDS[key].metadata["scope"]][1].split()[list(USES).index(use)]


def resolve(cfg, given, saved, path, use):
    """(the Config `use` runs with, [(key, the run's value, this command's)] that the `given` keys changed)."""
    values, changed = {}, []
    for key in FIELDS:
        mine, take = getattr(cfg, key), takes(key, use)
        values[key] = mine if take == "own" else saved[key]  # a run's file need not hold a command's own keys
        if take == "own" or key not in given or mine == values[key]:
            continue
        if take == "run":
            theirs, why = values[key], FIELDS[key].metadata["why"]
            raise UserError(f"--{key}={mine!r} contradicts {path}: it was trained with {key}={theirs!r}, not "
                            f"{mine!r}: " + REFUSED[use].format(key=key, theirs=theirs, why=why))
        changed.append((key, values[key], mine))
        values[key] = mine
    return Config(**values), changed


def load_config(argv, usage=None, command="train.py"):
    """The Config of presets in their order, then --key=value flags, which beat any preset whatever the order."""
    if "-h" in argv or "--help" in argv:  # the keys the command reads, with their defaults
        defaults = Config()
        command_line.print_help(usage, f"The settings {command} reads, with their defaults:\n" + "\n".join(
            f"--{key}={getattr(defaults, key)!r}\n    {FIELDS[key].metadata['help']}" for key in FIELDS
            if key in READS[command]))
        raise SystemExit(0)
    return Config(**{key: value for key, value, _ in settings_given(argv)})


def settings_given(argv):
    """(key, value, the preset's path or 'command line') for each key set, in the order they apply."""
    presets, flags = command_line.arguments(argv)
    given, problems = [(key, value, path) for path in presets for key, value in read_preset(path).items()], []
    for arg in flags:  # every flag read, so that one line names all their problems
        try:
            given.append((*parse_override(arg), "command line"))
        except UserError as e:
            problems.append(str(e))
    if problems:
        raise UserError("; ".join(problems))
    return given


def flags_given(argv):
    return dict(parse_override(arg) for arg in command_line.arguments(argv)[1] if arg not in ("-h", "--help"))


def parse_override(arg):
    """'--key=value' -> (key, value): a Python literal, or text for a text field."""
    key, text = command_line.flag(arg)
    source = f"--{key}={text}"
    check_key(key, source)
    value = command_line.literal(text)
    return key, typed(key, text if FIELDS[key].type is str and not isinstance(value, str) else value, source)


def read_preset(path):
    return {key: typed(key, value, source) for key, value, source in command_line.preset(path)}


def check_key(key, source):
    if key not in FIELDS:
        close = difflib.get_close_matches(key, FIELDS, n=1)
        hint = f"did you mean {close[0]!r}?" if close else "run with --help to list the keys"
        raise UserError(f"unknown config key {key!r} in {source}: {hint}")


def types_of(f):
    return typing.get_args(f.type) or (f.type,)


def type_name(f):
    return " or ".join("None" if kind is type(None) else kind.__name__ for kind in types_of(f))


YES_NO = {**dict.fromkeys(("true", "yes", "on", "1"), True), **dict.fromkeys(("false", "no", "off", "0"), False)}


def as_bool(value):  # True or False for a yes/no word (any case), a bool or 1/0; None for anything else
    return YES_NO.get(str(value).strip().lower()) if type(value) in (bool, int, str) else None


def typed(key, value, source):
    """`value` as the field's type (an int for a float, a yes/no word or 1/0 for a bool), or UserError."""
    check_key(key, source)
    f = FIELDS[key]
    if f.metadata["parse"]:
        return f.metadata["parse"](value)
    kinds = types_of(f)
    if kinds == (float,) and type(value) is int:
        return float(value)
    if bool in kinds and as_bool(value) is not None:
        return as_bool(value)
    if kinds == (bool,):
        raise UserError(f"{key}={value!r} is not a yes/no value: write {BOOL_FORMS} (in {source})")
    if type(value) not in kinds:
        raise UserError(f"{key} expects {type_name(f)}, got {value!r} ({type(value).__name__}) in {source}")
    return os.path.expanduser(value) if f.metadata["path"] else value


def config_json(cfg):
    return json.dumps(asdict(cfg), indent=2) + "\n"


def changed_values(given):
    """[(key, value, source)] that a preset or a flag changed (a preset's value a flag overrode too)."""
    defaults, cfg = Config(), Config(**{key: value for key, value, _ in given})
    source = {key: where for key, _, where in given}
    moved = {key for key, value, _ in given if value != getattr(cfg, key)}  # a preset's value a flag overrode
    return [(key, getattr(cfg, key), source[key]) for key in FIELDS
            if getattr(cfg, key) != getattr(defaults, key) or key in moved]


SETTINGS_WIDTH = 110  # the settings block's lines, but for a single value too long for one


def settings_report(argv, json_path, from_run=None):
    """The start-up block: per source (presets, then the command line) the keys it changed, by group; `from_run`:
    (the run's checkpoint, the command's use of it, what the command changed of the run's settings)."""
    given = settings_given(argv)
    changed, every_key = changed_values(given), f"every key in {json_path} before step 1"
    sources, final = dict.fromkeys(where for *_, where in given), {key: where for key, _, where in given}
    if from_run:
        path, use, of_run = from_run
        changed = [change for change in changed if takes(change[0], use) == "own"]
        lines = [f"settings (the run's, from {path}, and this command's; {every_key}):"]
        lines += [] if of_run else ["  changed from the run's: none"]
        for source in sources:
            if words := [f"{key}={old!r} -> {new!r}" for key, old, new in of_run if final[key] == source]:
                by = "the command line" if source == "command line" else source
                lines += pack([words], f"  changed from the run's by {by}: ", "    ")
    elif not changed:
        return f"settings: the defaults; {every_key}"
    else:
        lines = [f"settings (changed from the defaults; {every_key}):"]
    for source in sources:
        segments = [[f"{group.__name__}: {words[0]}", *words[1:]] for group in GROUPS if (words := [
            setting_text(key, value) for key, value, where in changed if where == source and key in keys(group)])]
        lines += pack(segments, f"  {source}: ", "    ") if segments else []
    return "\n".join(lines)


def pack(segments, first, indent, width=SETTINGS_WIDTH):
    """Segments of words joined by ' | ' in lines of at most `width`, a segment unbroken where it fits one."""
    lines = [first]
    for segment in segments:
        whole = " ".join(segment)
        for j, word in enumerate(segment):
            sep, fits = (" | ", whole if len(indent) + len(whole) <= width else word) if j == 0 else (" ", word)
            if lines[-1] in (first, indent):
                lines[-1] += word
            elif len(lines[-1]) + len(sep) + len(fits) > width:
                lines.append(indent + word)
            else:
                lines[-1] += sep + word
    return lines


def setting_text(key, value):
    text = f"{key}={value!r}"
    if key == "max_time" and value:
        text += f" [{describe_duration(value)} = {round(value, 3):.10g} s]"
    return text


def markdown_reference():
    """docs/config.md's keys (`python config.py` prints it): SCOPES as a table, then each group's keys."""
    defaults = Config()
    table = ["| scope | what | " + " | ".join(USES.values()) + " |", "| --- " * (len(USES) + 2) + "|",
            *(f"| `{scope}` | {what} | " + " | ".join(TAKES[take] for take in row.split()) + " |"
              for scope, (what, row) in SCOPES.items())]
    sections = ["What a command that uses a run's checkpoint takes from it, by each key's scope (\"given\": a flag, "
                "and for a new run from the weights a preset too):\n\n" + "\n".join(table)]
    for group in GROUPS:
        rows = [f"### {group.__name__}\n\n{group.__doc__}\n", "| key | type | default | scope | meaning |",
                "| --- | --- | --- | --- | --- |"]
        for f in fields(group):
            default = repr(getattr(defaults, f.name)).replace("|", "\\|")
            rows.append(f"| `{f.name}` | {type_name(f)} | `{default}` | {f.metadata['scope']} | {f.metadata['help']} |")
        sections.append("\n".join(rows))
    return "\n\n".join(sections)


if __name__ == "__main__":
    print(markdown_reference())
