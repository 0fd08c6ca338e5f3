"""A checkpoint: its record (typed, with a format version: older ones are upgraded as they load) and its file
(read with weights_only, so a file cannot run code)."""
import glob
import os
import zipfile
from typing import TypedDict

import torch

from command_line import DiskFull, UserError, atomic_write, first_line
from config import FIELDS, ModelShape, keys, typed
from summarizer import run_folder

# ---- the record --------------------------------------------------------------------------------------------

# What TrainingState.save writes; load_checkpoint reads 3 to FORMAT (FORMATS). A change of what a checkpoint's
# contents mean bumps it (a new setting only needs its entry in ABSENT), with its upgrade step (UPGRADES) and a
# fixture written by the last commit of the format before (tests/fixtures/checkpoints/make.sh):
# tests/test_checkpoint_formats.py reads every fixture.
FORMAT = 5
FORMATS = {3: "the version of 2026-11-25", 4: "the version of 2026-11-26 up to f63e9be", 5: "this version"}
# Formats 1 and 2, written on the project's first two days before any release, are retired: 103baa6 still reads them.
RETIRED_FORMATS = {1: "2026-11-23", 2: "2026-11-24"}


class Record(TypedDict):
    format: int
    model_args: dict  # the model's GPTConfig
    config: dict  # the run's settings, config.Config's types (the shape keys: the model's); a command's own may lack
    tokenizer: str  # data.TOKENIZER_ID of the BPE its token ids mean
    iter_num: int  # optimizer steps done
    best_metric: str
    best_score: float | None  # the best evaluation's best_metric (a loss as it is: lower is better)
    best_val_loss: float | None  # the best evaluation's val_loss, which breaks a ROUGE tie
    metrics: dict  # the last evaluation's
    train_rows: dict  # data.Examples.fingerprints() of the training rows
    validation_digest: str
    model: dict  # the state dict (a LoRA ckpt.pt: its adapters alone)


class Checkpoint(Record, total=False):
    """ckpt.pt: the Record (all best.pt holds) and what a resume needs; a retired calibration run's `candidates`
    key refuses a resume."""
    lora_base: dict | None  # a LoRA run: where its frozen base comes from and its hash, instead of its weights
    optimizer: dict
    scaler: dict  # {} without fp16
    rng: list  # each rank's
    schedule: dict  # summarizer.clock's lr_schedule
    skipped_steps: int


def shape_settings(model_args):
    return {key: model_args[key] for key in (*keys(ModelShape), "block_size")}


def format_of(ckpt):
    """A file's `format`, else told by the keys each version added."""
    if "format" in ckpt:
        return ckpt["format"]
    return 3 if "best_val_loss" in ckpt else 2 if "tokenizer" in ckpt else 1


def upgrade_3(ckpt):
    """Settings kept as text are typed, and the config's shape keys are the model's."""
    config = {**ckpt["config"], **shape_settings(ckpt["model_args"])}
    return {**ckpt, "format": 4, "config": {key: typed(key, value, "the checkpoint's config")
                                             for key, value in config.items() if key in FIELDS}}


UPGRADES = {3: upgrade_3, 4: lambda ckpt: {**ckpt, "format": 5}}  # 5 marked a command setting a run's file lacks

# Settings a later command takes from a run, added since format 5, with the value in effect before each existed: a
# checkpoint that lacks one gets it as it loads. A new setting needs no new format; a format changes when a meaning
# does.
ABSENT = {"sessions": 1, "test_dialogue_column": "", "test_id_column": ""}
# The settings of the calibration stage (retired after 605acfc), which the files written before keep: dropped as a
# checkpoint loads.
RETIRED = ("rank_weight", "rank_margin", "rank_length_exponent", "rank_candidates", "rank_decoding", "candidates_file")


def upgraded(ckpt, path):
    version = format_of(ckpt)
    if version in RETIRED_FORMATS:
        raise UserError(f"{path} is a checkpoint of format {version}, written on {RETIRED_FORMATS[version]} before "
                        f"any release; this version reads formats 3 to {FORMAT} and commit 103baa6 is the last that "
                        f"reads it: train anew, or predict with that commit (git checkout 103baa6)")
    if not isinstance(version, int) or version > FORMAT:
        raise UserError(f"{path} is a checkpoint of format {version}, written by a newer version of this program "
                        f"than this one (formats 3 to {FORMAT}): update the code (git pull) to read it")
    written = version
    try:
        while version < FORMAT:
            ckpt = UPGRADES[version](ckpt)
            version += 1
        kept = {key: value for key, value in ckpt["config"].items() if key not in RETIRED}
        ckpt = {**ckpt, "config": {**ABSENT, **kept}}
    except (KeyError, TypeError, UserError) as e:
        raise UserError(f"{path} is a checkpoint of format {written} ({FORMATS[written]}) that cannot be upgraded "
                        f"to format {FORMAT}: {type(e).__name__} {e}; read it with that version, or train "
                        f"again") from None
    return ckpt


# ---- the file ------------------------------------------------------------------------------------------------

def save_checkpoint(state, path):
    try:
        with atomic_write(path, "wb") as f:
            torch.save(state, f)
    except (DiskFull, RuntimeError) as e:  # torch's zip writer reports a failed write as its own RuntimeError
        if not isinstance(e, DiskFull) and not any(s in str(e) for s in ("PytorchStreamWriter", "inline_container")):
            raise
        failed = e if isinstance(e, DiskFull) else (f"cannot write {path}: torch's writer stopped part-way (is the "
                                                    f"disk full? {run_folder.gb(run_folder.free_bytes(path))} free)")
        kept = f"{path} still holds the previous checkpoint" if os.path.exists(path) else "nothing was written"
        raise DiskFull(f"{failed}; {kept}") from None


def not_an_archive(path):
    """Another file given for a checkpoint (empty is truncated)."""
    with open(path, "rb") as f:
        return os.path.getsize(path) > 0 and f.read(4) != b"PK\x03\x04"


def load_checkpoint(path, key="ckpt"):
    """A missing, foreign or damaged file is one line naming the flag `key` and the intact checkpoints beside it."""
    if not os.path.isfile(path):
        what = "is a folder" if os.path.isdir(path) else "does not exist"
        if training := (None if os.path.isdir(path) else run_folder.training_in(os.path.dirname(path) or ".")):
            raise UserError(f"checkpoint {path} does not exist yet: a training run writes into "
                            f"{os.path.dirname(path) or '.'} ({training}) and has not saved yet: wait for its first "
                            f"save (after its first evaluation), then run this again")
        raise UserError(f"checkpoint {path} {what}" + (run_folder.missing_file_hint(path, f"--{key}")
                                                          or f": train first, or pass --{key}=<a best.pt or ckpt.pt>"))
    if not_an_archive(path):
        raise UserError(f"{path} is not a checkpoint (train.py writes best.pt and ckpt.pt as torch.save "
                        f"archives): pass --{key}=<a best.pt or ckpt.pt>")
    if not zipfile.is_zipfile(path):  # a truncated zip lacks the directory at its end
        raise UserError(f"checkpoint {path} is corrupted ({os.path.getsize(path):,} bytes, not a complete "
                        f"torch.save archive: truncated by a full disk or an interrupted copy?); "
                        + intact_neighbours(path))
    try:
        # mmap: ranks loading the same file share its pages, and tensors are read when used
        ckpt = torch.load(path, map_location="cpu", weights_only=True, mmap=True)
    except Exception as e:
        why = first_line(e) or type(e).__name__
        raise UserError(f"cannot load checkpoint {path} safely (weights_only): {why}") from None
    if not isinstance(ckpt, dict) or "model" not in ckpt or "model_args" not in ckpt:
        raise UserError(f"{path} is not a checkpoint written by train.py")
    return upgraded(ckpt, path)


def intact_neighbours(path):
    folder = os.path.dirname(os.path.abspath(path))
    if not (intact := intact_in(folder, besides=path)):
        return f"no other checkpoint in {folder} is intact"
    use = ("start from its weights with --init_from=<that file>" if os.path.basename(path) == "ckpt.pt"
           else "score one with --ckpt=<that file>")
    return f"intact: {', '.join(intact)}; {use}"


def intact_in(folder, besides=None):
    intact = []
    for path in sorted(glob.glob(os.path.join(glob.escape(folder), "*.pt"))):
        if besides and os.path.samefile(path, besides):
            continue
        try:
            ckpt = torch.load(path, map_location="cpu", weights_only=True, mmap=True)
            intact.append(f"{path} (iter {ckpt['iter_num']})")
        except Exception:
            continue
    return intact
