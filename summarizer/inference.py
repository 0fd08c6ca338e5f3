"""A trained run's model and contract, read from its checkpoint, and the summaries it writes (evaluate.py, predict.py,
export.py, training's ROUGE); ROUGE, by which MBR chooses. A --baseline has no run: the command line is its config."""
import contextlib
import functools
import math
import os
import sys
from dataclasses import asdict, dataclass, replace

import numpy as np
import torch
from nltk.stem import porter
from rapidfuzz import process
from rapidfuzz.distance import LCSseq
from rouge_score import rouge_scorer, tokenize, tokenizers
from rouge_score.scoring import fmeasure
from tqdm import tqdm

import data
from command_line import UserError
from config import ROUGE_TYPES, Config, Decoding, Split, flags_given, keys, load_config, part, resolve
from generate import generate, greedy_slots, plain_greedy
from model import GPT, GPTConfig
from summarizer import loading, run_folder
from summarizer.checkpoint import load_checkpoint
from summarizer.launch import one_line_errors, out_of_memory_hint
from summarizer.memory import generation_batches, generation_memory, halved_until_it_runs
from summarizer.process import Process

RUN_DECODING = (*keys(Decoding), "seed")  # what a trained run decodes with unless a flag says otherwise


def utterances(dialogue):
    return [line.strip() for line in data.clean_text(dialogue).split("\n") if line.strip()]


# The extractive baselines of the SAMSum paper (Gliwa et al., 2019: LEAD-3, LONGEST-3) and the first line alone:
# what a model must beat. Each takes a dialogue's utterances and keeps some, in their order.
EXTRACTIVE = {"first_line": (lambda lines: lines[:1], "the first line of each dialogue"),
              "lead3": (lambda lines: lines[:3], "the first 3 lines of each dialogue"),
              "longest3": (lambda lines: [line for i, line in enumerate(lines) if i in sorted(range(len(lines)),
                           key=lambda i: (-len(lines[i]), i))[:3]], "the 3 longest lines of each dialogue, in order")}


@dataclass
class SummaryModel:
    """A model and the config that prompts and decodes it: the run's, with this command's decoding and data flags."""
    model: torch.nn.Module
    cfg: Config
    weights: str = ""  # what the weights are, for the first line
    ckpt: dict | None = None
    overridden: list = ()  # decoding keys this command changed
    trained_max_new_tokens: int = 0  # the run's, which its prompts were cut for; 0: cfg's (the run being trained)
    path: str = ""  # the checkpoint file; '' for a baseline
    extractive: str = ""  # an EXTRACTIVE baseline's name: no model, its summaries are lines of the dialogue

    def prompt_format(self):
        """data.PromptFormat as training applied it, or shorter dialogues for a larger max_new_tokens now."""
        return data.prompt_format(self.cfg.prompt_template, self.model.config.block_size,
                                  max(self.cfg.max_new_tokens, self.trained_max_new_tokens))

    def cut_warning(self):
        """A line where a larger max_new_tokens leaves a dialogue under half the tokens training gave it."""
        now, block, run = self.prompt_format().max_dialogue, self.model.config.block_size, self.trained_max_new_tokens
        trained = data.prompt_format(self.cfg.prompt_template, block, run or self.cfg.max_new_tokens).max_dialogue
        if 2 * now < trained:
            return (f"warning: max_new_tokens={self.cfg.max_new_tokens} leaves each dialogue its first {now} tokens, "
                    f"where training kept {trained} (max_new_tokens={run}, block_size={block}): the summaries of what "
                    f"is left will score low; give at most --max_new_tokens={run + trained // 2}")
        return None

    def prompts(self, dialogues):
        """(prompt tokens per dialogue, how many were cut); an extractive baseline reads the dialogues."""
        if self.extractive:
            return list(dialogues), 0
        encoded = list(map(self.prompt_format().encode, dialogues))
        return [prompt or [data.EOT_ID] for prompt, _ in encoded], sum(cut for _, cut in encoded)

    def summarize(self, prompts, proc, cfg=None):
        if self.extractive:
            return [" ".join(EXTRACTIVE[self.extractive][0](utterances(dialogue))) for dialogue in prompts]
        cfg = cfg or self.cfg
        graphed = proc.graphs and plain_greedy(part(cfg, Decoding))  # whether they replayed is known after
        if proc.is_main:
            print(f"summarizing {len(prompts)} dialogues" + ("" if graphed else ": eager decode steps"))
        summaries = summarize_on_ranks(self.model, prompts, cfg, proc)
        if proc.is_main and graphed:
            print(f"summarized {len(prompts)} dialogues: {proc.graphs.describe()}")
        return summaries


def open_summary_model(cfg, explicit=(), use="inference"):
    """The SummaryModel that cfg names, on the CPU: a checkpoint's, its config resolved for `use`; or a baseline's."""
    if cfg.baseline in EXTRACTIVE:
        return SummaryModel(None, cfg, f"baseline={cfg.baseline} (extractive, no model: "
                                     f"{EXTRACTIVE[cfg.baseline][1]})", extractive=cfg.baseline)
    if cfg.baseline:
        loading.check_named(cfg.baseline, "baseline", EXTRACTIVE)
        torch.manual_seed(cfg.seed)
        loading.check_shape(cfg, explicit, cfg.baseline, key="baseline")
        model, _ = loading.build_model(cfg.baseline, replace(cfg, dropout=0.0), key="baseline")
        what = (f"untrained, {cfg.n_layer} layers x {cfg.n_embd}" if cfg.baseline == "scratch" else "not fine-tuned")
        summary_model = SummaryModel(model, cfg, f"baseline={cfg.baseline} ({what})", None, [], cfg.max_new_tokens)
    else:
        path = checkpoint_path(cfg)
        ckpt = load_checkpoint(path, "ckpt")  # read once, then down the layers: the model, the settings
        model = loading.model_from_checkpoint(ckpt, path)
        run_cfg, changed = resolve(cfg, explicit, ckpt["config"], path, use)
        overridden = [key for key, _, _ in changed if key in RUN_DECODING]
        summary_model = SummaryModel(model, run_cfg, f"{path} ({describe_checkpoint(ckpt)})", ckpt, overridden,
                                ckpt["config"]["max_new_tokens"], path=path)
    summary_model.prompt_format()  # a max_new_tokens too large for block_size stops here, before any work
    return summary_model


def load_summary_model(cfg, explicit, proc, describe_data):
    """open_summary_model, its first line on rank 0, the model on proc's device cast once to proc's dtype."""
    if proc.is_main:
        run_folder.make(output_dir(cfg), reads=None if cfg.ckpt or cfg.baseline else f"--ckpt={checkpoint_path(cfg)}")
    summary_model = open_summary_model(cfg, explicit)
    run_cfg, model = summary_model.cfg, summary_model.model
    if proc.is_main and model is None:  # an extractive baseline
        print(f"weights: {summary_model.weights}; {describe_data(run_cfg)}")
    elif proc.is_main:
        print(f"weights: {summary_model.weights}; template {run_cfg.prompt_template!r}; {describe_data(run_cfg)}; "
              f"decoding: {describe_decoding(run_cfg, summary_model.overridden, summary_model.ckpt is not None)}")
        for note in filter(None, (summary_model.cut_warning(), training_note(summary_model.path))):
            print(note)
    if model is not None:
        summary_model.model = model.to(proc.device, getattr(torch, proc.dtype)).eval()
    return summary_model


def training_note(path):
    holder = path and run_folder.training_in(os.path.dirname(os.path.abspath(path)))
    return holder and (f"note: a training run holds {os.path.dirname(path) or '.'} ({holder}): this reads its last "
                       f"complete save, {path}")


def describe_checkpoint(ckpt):
    """'iter 300, best rougeL 0.4123, val_loss 2.1034'"""
    metrics, best_metric = ckpt["metrics"], ckpt["best_metric"]
    scores = [f"best {best_metric} {metrics[best_metric]:.4f}" if best_metric in metrics else ""]
    scores += [f"{k} {metrics[k]:.4f}" for k in ("val_loss", "rougeL") if k in metrics and k != best_metric]
    return ", ".join([f"iter {ckpt['iter_num']}", *filter(None, scores)])


def describe_decoding(cfg, overridden=(), from_run=True):
    """'beam search: num_beams=4 max_new_tokens=48 (the run's, except --num_beams)', and what this kind ignores."""
    if cfg.baseline in EXTRACTIVE:
        return "none: lines of the dialogue"
    defaults = Config()
    kind = ("MBR" if cfg.mbr_samples else "beam search" if cfg.num_beams > 1 else
            "sampling" if cfg.temperature > 0 else "greedy")
    inert = {*(("top_k", "top_p", "epsilon", "seed") if cfg.temperature == 0 else ()),  # a greedy seed: training's
             *(("length_penalty",) if cfg.num_beams == 1 else ()),
             *(() if cfg.mbr_samples else ("mbr_metric", "mbr_include_beam"))}
    given = [key for key in RUN_DECODING if key == "max_new_tokens" or getattr(cfg, key) != getattr(defaults, key)]
    ignored = " ".join(f"{k}={getattr(cfg, k)}" for k in given if k in inert and k != "seed")
    source = ("the run's" + (f", except {', '.join(f'--{k}' for k in overridden)}" if overridden else "")
              if from_run else "this command's")
    return (f"{kind}: {' '.join(f'{k}={getattr(cfg, k)}' for k in given if k not in inert)} ({source})"
            + (f"; {ignored} ignored by {kind}" if ignored else ""))


def describe_validation(cfg):
    if cfg.validation_csv:
        return f"validation {cfg.validation_csv}"
    return f"validation {cfg.val_fraction:g} of {cfg.train_csv} held out (split_seed {cfg.split_seed})"


def validation_set(summary_model, explicit, proc):
    """(validation examples, notes): rows the checkpoint trained on are refused, unless duplicates in its own split."""
    cfg, ckpt = summary_model.cfg, summary_model.ckpt
    if ckpt is None and cfg.validation_csv:  # a baseline trained on nothing: no train_csv
        splits, (_, val, _) = None, data.validation_examples(cfg, proc.is_main, proc.barrier)
    else:
        splits = data.load_splits(cfg, is_main=proc.is_main, barrier=proc.barrier)
        val = splits.val
    if not len(val):
        raise UserError(f"no validation rows to score: {describe_validation(cfg)} leaves none; pass "
                        f"--validation_csv=<a CSV with summaries>" + (" the run did not train on" if ckpt else ""))
    seen = data.repeated_rows(val, ckpt["train_rows"]) if ckpt is not None else None
    if seen is None or not seen.any():  # a baseline trained on nothing here
        return val, []
    own = (all(getattr(cfg, key) == ckpt["config"][key] for key in keys(Split))
           and splits.train.digest == ckpt["train_rows"]["digest"] and val.digest == ckpt["validation_digest"])
    first = val.ids[int(np.argmax(seen))]
    if own:
        return val, [f"note: {int(seen.sum())} validation row(s) of the run's own split repeat a training row "
                     f"(duplicates in {cfg.train_csv}, e.g. id {first}); scored as in training"]
    changed = [f"--{key}" for key in keys(Split) if key in explicit]
    raise UserError(f"{int(seen.sum())} of the {len(val)} validation rows ({describe_validation(cfg)}) "
                    f"were trained on by this checkpoint (same dialogue or id, e.g. id {first}): its score would be "
                    f"inflated; score a CSV the run did not train on"
                    + (f", or drop {', '.join(changed)} to use the run's own validation split" if changed else ""))


def decoding_command(argv, usage, command, work):
    """evaluate.py's and predict.py's main: `work(cfg, flags given, proc)`, errors in one line, no empty folder left."""
    argv = sys.argv[1:] if argv is None else argv
    with one_line_errors():
        cfg = load_config(argv, usage, command)
        with run_folder.no_empty_folder_left(cfg.out_dir, output_dir(cfg)), Process(cfg) as proc:
            work(cfg, flags_given(argv), proc)


def checkpoint_path(cfg):
    return cfg.ckpt or os.path.join(cfg.out_dir, run_folder.BEST)


def output_dir(cfg):
    """out_dir, or out_dir/baseline-<name>, so that a baseline never replaces a run's files."""
    if not cfg.baseline:
        return cfg.out_dir
    return os.path.join(cfg.out_dir, f"baseline-{os.path.basename(os.path.normpath(cfg.baseline))}")


def cut_line(summary_model, cut, total):
    fmt, block_size = summary_model.prompt_format(), summary_model.model.config.block_size
    template = len(fmt.head) + len(fmt.tail)
    return (f"cut the end of {cut} of {total} dialogue(s): a prompt keeps a dialogue's first {fmt.max_dialogue} "
            f"tokens (block_size {block_size} - {block_size - fmt.max_dialogue - template} summary tokens - "
            f"{template} template tokens)")


def summarize_batches(model, prompts, cfg, autocast, progress=False, rank=0, world_size=1, memory=None, graphs=None):
    """One summary per prompt, in order, None for other ranks' batches (every world_size-th is this rank's, the same
    batches whatever the ranks: sharded output is single-process output). graphs released at the end."""
    memory = generation_memory(cfg, model.lm_head.weight.device) if memory is None else memory
    dtype = autocast.fast_dtype if isinstance(autocast, torch.autocast) else model.lm_head.weight.dtype
    decoding = part(cfg, Decoding)
    batches = generation_batches(prompts, decoding, cfg.gen_batch_size, model.config, memory, dtype, rank, world_size)
    # the largest greedy cache first: the storage of the graphs (StepGraphs.hold), sized by it, serves every batch
    batches.sort(key=lambda batch: -len(batch) * greedy_slots(max(len(prompts[i]) for i in batch),
                                                              decoding.max_new_tokens, model.config.block_size))
    summaries = [None] * len(prompts)
    was_training = model.training
    model.eval()
    # every rank's progress, as this rank's share of the batches times world_size shows it
    bar = tqdm(total=len(prompts), desc="summarizing", unit="summary", disable=not progress, dynamic_ncols=True,
               smoothing=0)  # the rate since the start
    try:  # an out-of-memory error leaves the model as it was too: summarize_on_ranks tries again
        for batch in batches:
            try:
                with autocast:
                    new_tokens = generate(model, [prompts[i] for i in batch], decoding, eos_token_id=data.EOT_ID,
                                          seed=cfg.seed, mbr_pick=mbr_pick, graphs=graphs)
            except Exception as e:  # an out-of-memory's: what summarize_on_ranks keeps, and the size it halves
                e.done, e.size = summaries, len(batch)
                raise
            for i, tokens in zip(batch, new_tokens, strict=True):
                summaries[i] = data.summary_text(tokens)
            bar.update(min(len(batch) * world_size, bar.total - bar.n))
        bar.update(bar.total - bar.n)  # this rank is done: so, within a batch, are the others
    finally:
        bar.close()
        model.train(was_training)
        if graphs:
            graphs.release()
    return summaries


def summarize_on_ranks(model, prompts, cfg, proc, progress=True):
    """All of the summaries, in order, on every rank; a batch out of memory on any lowers proc.gen_batch_cap on all."""
    autocast = contextlib.nullcontext() if model.lm_head.weight.dtype == getattr(torch, proc.dtype) else proc.autocast()
    memory = min(proc.all_gather_objects(generation_memory(cfg, model.lm_head.weight.device)))  # the same batches
    summaries, todo = [None] * len(prompts), []

    def attempt(size):
        todo[:] = [i for i, summary in enumerate(summaries) if summary is None]
        return summarize_batches(model, [prompts[i] for i in todo], replace(cfg, gen_batch_size=size),
                                 autocast, progress and proc.is_main, proc.rank, proc.world_size, memory, proc.graphs)

    def keep(shards):  # each rank's summaries of todo, None where another rank's batch
        for i, column in zip(todo, zip(*shards, strict=True), strict=True):
            summaries[i] = next((summary for summary in column if summary is not None), None)
    others = [f"--{key} (now {getattr(cfg, key)})" for key in ("num_beams", "mbr_samples") if getattr(cfg, key) > 1]
    hint = functools.partial(out_of_memory_hint, "summarizing 1 dialogue at a time",
                             " or ".join([f"--max_new_tokens (now {cfg.max_new_tokens})", *others]))
    size, tried, met = halved_until_it_runs(proc, min(cfg.gen_batch_size, proc.gen_batch_cap or math.inf), attempt,
                                            hint, keep)
    if tried:
        proc.gen_batch_cap = size
        if proc.is_main:
            print(f"out of memory while summarizing {' and then '.join(tried)} dialogues at a time ({met}): went on "
                  f"in batches of at most {size} (gen_batch_size={size} from now on in this process)", flush=True)
    return summaries


def rouge_model(model, cfg, proc):
    """The model training's ROUGE decodes with: a plain GPT in proc's dtype (greedy as CUDA graphs, no autocast), a
    merged copy for LoRA and FSDP (ranks decoding different lengths cannot keep FSDP's collectives in step)."""
    dtype = getattr(torch, proc.dtype)
    if proc.backend != "fsdp" and not cfg.lora_rank and model.lm_head.weight.dtype == dtype:
        return model
    weights = proc.parallel.full_weights(model)
    copy = GPT.on_meta(GPTConfig(**asdict(model.config))).to(dtype)
    copy.lm_head.weight = copy.transformer.to_empty(device=proc.device).wte.weight  # one tensor, as in the model
    held = copy.state_dict()
    merged = loading.merged_weights(weights, **loading.lora_settings(cfg)) if cfg.lora_rank else weights.items()
    for key, value in merged:
        held[key].copy_(value)  # cast as it copies: one merged float32 weight at a time, never a whole dict
    return copy.eval()


# ---- ROUGE as the competition scores it (rouge-score F1, Porter stemmer on), and MBR's choice by it ------------

def rouge_per_example(predictions, references):
    """{type: [F1 of each (prediction, reference)]}, rouge-score with the stemmer, as the competition scores."""
    scorer = rouge_scorer.RougeScorer(list(ROUGE_TYPES), tokenizer=StemCachedTokenizer())
    results = [scorer.score(reference, prediction)
               for prediction, reference in zip(predictions, references, strict=True)]
    return {t: [result[t].fmeasure for result in results] for t in ROUGE_TYPES}


def rouge(predictions, references):
    return {t: sum(v) / max(1, len(v)) for t, v in rouge_per_example(predictions, references).items()}


class StemCachedTokenizer(tokenizers.Tokenizer):
    """rouge-score's tokenizer, each text and word stemmed once: MBR scores every candidate against every other."""

    def __init__(self):
        self.stem = functools.cache(porter.PorterStemmer().stem)
        self.tokens = functools.cache(lambda text: tokenize.tokenize(text, self))

    def tokenize(self, text):
        return self.tokens(text)


def mbr_pick(candidates, metric="rougeL"):
    return mbr_select([data.summary_text(tokens) for tokens in candidates], metric)


def agreement(candidates, metric="rougeL"):
    """`metric` F1 of every candidate against every other; rougeL's LCS by rapidfuzz (rouge-score's took MBR's time)."""
    tokenizer = StemCachedTokenizer()
    if metric == "rougeL":
        tokens = [tokenizer.tokenize(c) for c in candidates]
        lcs = process.cdist(tokens, tokens, scorer=LCSseq.similarity).tolist()
        return [[fmeasure(n / len(prediction), n / len(reference)) if prediction and reference else 0.0
                 for reference, n in zip(tokens, row, strict=True)]
                for prediction, row in zip(tokens, lcs, strict=True)]
    scorer = rouge_scorer.RougeScorer([metric], tokenizer=tokenizer)
    return [[scorer.score(reference, prediction)[metric].fmeasure for reference in candidates]
            for prediction in candidates]


def mbr_select(candidates, metric="rougeL"):
    """Index of the highest mean F1 against the others; ties go to the earlier."""
    scores = agreement(candidates, metric)
    utility = [(sum(row) - row[i]) / max(1, len(candidates) - 1) for i, row in enumerate(scores)]
    return max(range(len(candidates)), key=lambda i: (utility[i], -i))
