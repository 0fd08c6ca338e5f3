"""Checkpoint files: written atomically by rank 0, read back with weights_only so a file cannot run code; and
the check that out_dir can take them."""
import contextlib
import os

import torch

from config import UserError
from model import GPT, GPTConfig


def make_out_dir(path):
    """Create out_dir and check that a file can be written there, before any work whose results would be lost."""
    try:
        os.makedirs(path, exist_ok=True)
        probe = os.path.join(path, f".write-test{os.getpid()}")
        open(probe, "w").close()
        os.remove(probe)
    except OSError as e:
        raise UserError(f"out_dir {path} is not writable ({e.strerror}): choose another with --out_dir=...") from None


def save_checkpoint(state, path):
    """Write to a temp file in the same directory, fsync, then atomically rename over `path`, so a crash or a
    full disk leaves the previous checkpoint intact."""
    tmp = f"{path}.tmp{os.getpid()}"
    try:
        with open(tmp, "wb") as f:
            torch.save(state, f)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
    except BaseException as e:
        with contextlib.suppress(OSError):
            os.remove(tmp)
        if isinstance(e, OSError):  # e.g. a full disk: the user's to fix, and nothing was lost
            kept = f"{path} still holds the previous checkpoint" if os.path.exists(path) else "nothing was written"
            raise UserError(f"cannot write {path} ({e.strerror or e}): {kept}; free some space or choose another "
                            f"--out_dir") from None
        raise


def load_checkpoint(path):
    """A checkpoint written by save_checkpoint; refuses anything that is not plain tensors and containers."""
    if not os.path.isfile(path):
        raise UserError(f"checkpoint {path} does not exist: train first, or pass --ckpt=<path>")
    try:
        ckpt = torch.load(path, map_location="cpu", weights_only=True)
    except Exception as e:
        first_line = str(e).strip().splitlines()[0] if str(e).strip() else type(e).__name__
        raise UserError(f"cannot load checkpoint {path} safely (weights_only): {first_line}") from None
    if not isinstance(ckpt, dict) or "model" not in ckpt or "model_args" not in ckpt:
        raise UserError(f"{path} is not a checkpoint written by train.py")
    return ckpt


def model_from_checkpoint(ckpt, path):
    try:
        model = GPT(GPTConfig(**ckpt["model_args"]))
    except (TypeError, AssertionError) as e:  # model_args from another version of model.py, or inconsistent
        raise UserError(f"{path} has model_args {ckpt['model_args']} that this model.py cannot build: "
                        f"{str(e) or type(e).__name__}") from None
    try:
        model.load_state_dict(ckpt["model"])
    except RuntimeError as e:
        raise UserError(f"{path} does not fit model {ckpt['model_args']}: {str(e).splitlines()[0]}") from None
    return model
