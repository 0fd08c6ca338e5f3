"""Every setting of train.py, evaluate.py, predict.py and export.py: the groups of settings, each with its
default and one-line help, flat in Config; and load_config(argv), a command line read into a checked Config.

The command line and presets are read in summarizer/command_line.py, and the rules a Config must follow are in
summarizer/rules.py; both import this module, which imports neither at its top.
"""
import os
from dataclasses import dataclass, field, fields

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
    block_size: int = option(1024, "longest sequence in tokens, a multiple of 8, at most the model's positions "
                                   "(GPT-2: 1024); longer dialogues are cut")


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
    compare: str = option("", "evaluate.py: also compare with another evaluation of the same dialogues (its out_dir "
                              "or eval_predictions.csv): paired ROUGE differences on stdout and in eval_report.html")


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

    def contradiction(self):
        """The first of these settings that contradicts the others, in one line naming them; '' when none does.
        Config validation and generate() both ask it (they raise UserError and ValueError with it)."""
        if not 0 <= self.min_new_tokens <= self.max_new_tokens:
            return f"min_new_tokens={self.min_new_tokens} must be in [0, max_new_tokens={self.max_new_tokens}]"
        if self.mbr_samples and self.temperature <= 0:
            return f"mbr_samples={self.mbr_samples} samples its candidates: set temperature > 0 (e.g. 0.7)"
        if self.num_beams > 1 and self.temperature > 0 and not (self.mbr_samples and self.mbr_include_beam):
            return (f"num_beams={self.num_beams} is beam search, which does not sample: use temperature=0.0 or "
                    f"num_beams=1 (or, for MBR's beam candidate, mbr_samples > 0 and mbr_include_beam=True)")
        return ""


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
    rank_weight: float = option(0.0, "calibrate.py (start it from a trained run, --init_from=out/best.pt), > 0: "
                                     "candidate summaries of every training dialogue are generated first, and this "
                                     "weighs a ranking loss on them (better ROUGE, higher score) added to the token "
                                     "loss")
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
READ_ONLY_BY = {Calibration: "calibrate.py"}  # groups one command alone reads: another refuses them


@dataclass
class Config(*reversed(GROUPS)):
    """Every setting of train.py, evaluate.py, predict.py and export.py, flat (--key=value, config.json, a
    checkpoint's saved config); the groups above name the settings that belong together."""

    def __post_init__(self):
        from summarizer.rules import check  # it imports this module
        check(self)


def keys(group):
    """The names of a group's settings."""
    return tuple(f.name for f in fields(group))


def part(cfg, group):
    """The group's settings of a Config (e.g. part(cfg, Decoding) for generate)."""
    return group(**{key: getattr(cfg, key) for key in keys(group)})


FIELDS = {f.name: f for f in fields(Config)}


def load_config(argv):
    """The checked Config that a command line asks for: presets in their order, then --key=value flags, which beat
    any preset whatever the order; --help prints every key and exits."""
    from summarizer.command_line import read_arguments  # it imports this module
    return Config(**read_arguments(argv))
