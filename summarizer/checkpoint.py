"""Models and their checkpoint files: the one function that builds a model (untrained, pretrained GPT-2, or a
checkpoint's); checkpoints written atomically by rank 0 and read back with weights_only so a file cannot run code;
the check that out_dir can take them, and moving an earlier run's files (or an earlier best.pt) aside."""
import datetime
import glob
import hashlib
import os
import socket
import threading
import urllib.parse
import zipfile

import torch

from data import TOKENIZER_ID
from model import GPT, PRETRAINED, GPTConfig
from summarizer import lora
from summarizer.errors import UserError
from summarizer.files import atomic_write

# What a training run (and evaluate.py/predict.py after it) writes into out_dir.
RUN_FILES = ("ckpt.pt", "best.pt", "config.json", "metrics.jsonl", "metrics.png", "eval_predictions.csv",
             "eval_metrics.json", "submission.csv", "sweep.csv", "sweep.md", "tensorboard", "wandb")


def make_out_dir(path):
    """Create out_dir and check that a file can be written there, before any work whose results would be lost."""
    try:
        os.makedirs(path, exist_ok=True)
        probe = os.path.join(path, f".write-test{os.getpid()}")
        open(probe, "w").close()
        os.remove(probe)
    except OSError as e:
        raise UserError(f"out_dir {path} is not writable ({e.strerror}): choose another with --out_dir=...") from None


def archive_previous_run(out_dir):
    """Move the files of an earlier run in out_dir (RUN_FILES, and best-<metric>.pt files) into
    out_dir/previous-run-<its time>/, so a fresh run neither appends to its metrics nor overwrites its checkpoints.
    Returns a line saying so, or None."""
    best = sorted(os.path.basename(p) for p in glob.glob(os.path.join(glob.escape(out_dir), "best-*.pt")))
    found, folder = move_aside(out_dir, [*RUN_FILES, *best], "previous-run")
    if not found:
        return None
    return (f"{out_dir} held an earlier run: moved its {', '.join(found)} to {folder} (continue a run with "
            f"--init_from=resume instead)")


def move_aside(out_dir, names, prefix):
    """Move those of `names` that exist in out_dir into out_dir/<prefix>-<time of the newest>/. Returns (the names
    moved, the folder), or ([], None)."""
    found = [name for name in names if os.path.exists(os.path.join(out_dir, name))]
    if not found:
        return [], None
    newest = max(os.path.getmtime(os.path.join(out_dir, name)) for name in found)
    stamp = datetime.datetime.fromtimestamp(newest).strftime("%Y%m%d-%H%M%S")
    folder, n = os.path.join(out_dir, f"{prefix}-{stamp}"), 1
    while os.path.exists(folder):
        n += 1
        folder = os.path.join(out_dir, f"{prefix}-{stamp}-{n}")
    os.makedirs(folder)
    for name in found:
        os.replace(os.path.join(out_dir, name), os.path.join(folder, name))
    return found, folder


def keep_best_of_metric(out_dir, metric):
    """Rename out_dir/best.pt, the best by `metric`, to best-<metric>.pt (best-<metric>-2.pt, ... if taken), so a
    run that now picks its best by another metric loses nothing. Returns the new path, or None without best.pt."""
    best = os.path.join(out_dir, "best.pt")
    if not os.path.exists(best):
        return None
    kept, n = os.path.join(out_dir, f"best-{metric}.pt"), 1
    while os.path.exists(kept):
        n += 1
        kept = os.path.join(out_dir, f"best-{metric}-{n}.pt")
    os.replace(best, kept)
    return kept


def save_checkpoint(state, path):
    """torch.save(state) atomically, so a crash or a full disk leaves the previous checkpoint intact."""
    try:
        with atomic_write(path, "wb") as f:
            torch.save(state, f)
    except (OSError, RuntimeError) as e:  # e.g. a full disk: the user's to fix, and nothing was lost
        if isinstance(e, RuntimeError) and not any(s in str(e) for s in ("PytorchStreamWriter", "inline_container")):
            raise  # not torch's zip writer failing to write
        reason = e.strerror if isinstance(e, OSError) else "torch's writer stopped part-way: is the disk full?"
        kept = f"{path} still holds the previous checkpoint" if os.path.exists(path) else "nothing was written"
        raise UserError(f"cannot write {path} ({reason}): {kept}; free some space or choose another "
                        f"--out_dir") from None


def load_checkpoint(path):
    """A checkpoint written by save_checkpoint; refuses anything that is not plain tensors and containers. A
    truncated or damaged file is one line that says so and which other checkpoints beside it are intact."""
    if not os.path.isfile(path):
        raise UserError(f"checkpoint {path} does not exist: train first, or pass --ckpt=<path>")
    if not complete_archive(path):
        raise UserError(f"checkpoint {path} is corrupted ({os.path.getsize(path):,} bytes, not a complete "
                        f"torch.save archive: truncated by a full disk or an interrupted copy?); "
                        + intact_neighbours(path))
    try:
        # mmap: ranks loading the same file share its pages, and tensors are read when used
        ckpt = torch.load(path, map_location="cpu", weights_only=True, mmap=True)
    except Exception as e:
        first_line = str(e).strip().splitlines()[0] if str(e).strip() else type(e).__name__
        raise UserError(f"cannot load checkpoint {path} safely (weights_only): {first_line}") from None
    if not isinstance(ckpt, dict) or "model" not in ckpt or "model_args" not in ckpt:
        raise UserError(f"{path} is not a checkpoint written by train.py")
    return ckpt


def complete_archive(path):
    """Whether `path` is a whole zip archive, torch.save's format: its directory is at the end, so a truncated
    file has none."""
    try:
        with zipfile.ZipFile(path):
            return True
    except (OSError, zipfile.BadZipFile):
        return False


def intact_neighbours(path):
    """Which of the other checkpoints in `path`'s folder load, as the clause that ends a corrupted-file error."""
    folder = os.path.dirname(os.path.abspath(path))
    others = [p for p in sorted(glob.glob(os.path.join(glob.escape(folder), "*.pt"))) if not os.path.samefile(p, path)]
    intact = []
    for other in others:
        try:
            ckpt = torch.load(other, map_location="cpu", weights_only=True, mmap=True)
            intact.append(f"{other} (iter {ckpt['iter_num']})")
        except Exception:
            continue
    if not intact:
        return f"no other checkpoint in {folder} is intact"
    use = ("start from its weights with --init_from=<that file>" if os.path.basename(path) == "ckpt.pt"
           else "score one with --ckpt=<that file>")
    return f"intact: {', '.join(intact)}; {use}"


def build_model(source, cfg=None, keep_adapters=False, key="init_from", lora_base=None):
    """The one place a model is built: (model, checkpoint dict or None) from `source`, which is
    - 'scratch': an untrained model of cfg's shape (n_layer, n_head, n_embd, block_size, bias), from torch's RNG;
    - a GPT-2 name (gpt2 .. gpt2-xl) or a local transformers directory: its weights, the context cut to
      cfg.block_size when that is shorter;
    - a checkpoint file (.pt) written by train.py: its weights. A LoRA run's ckpt.pt holds the adapters and a
      reference to its base (rebuilt from lora_base, else from where the run took it, and checked by hash):
      merged into a plain GPT (as in best.pt), or with keep_adapters (to resume) kept as they are.
    cfg.dropout applies to all three (without cfg, a checkpoint's model has the dropout it was saved with).
    Errors name the config key the source came from."""
    if os.path.isfile(source) or source.endswith(".pt"):
        ckpt = load_checkpoint(source)
        model = model_from_checkpoint(ckpt, source, keep_adapters, lora_base)
        if cfg:
            model.set_dropout(cfg.dropout)
        return model, ckpt
    if source == "scratch":
        return GPT(GPTConfig(block_size=cfg.block_size, n_layer=cfg.n_layer, n_head=cfg.n_head, n_embd=cfg.n_embd,
                             dropout=cfg.dropout, bias=cfg.bias)), None
    offline = source in PRETRAINED and not hub_reachable()
    if offline and not in_hub_cache(source):
        raise UserError(f"{key}={source} needs GPT-2's weights from {hub_endpoint()}, which cannot be reached (no "
                        f"internet; on Kaggle: Settings > Internet): attach the weights as a folder, e.g. a Kaggle "
                        f"dataset, and pass --{key}=/kaggle/input/<folder> (config.json and model.safetensors as "
                        f"save_pretrained writes them), or train from --{key}=scratch")
    try:
        model = GPT.from_pretrained(source, dropout=cfg.dropout if cfg else 0.0, local_files_only=offline)
    except FileNotFoundError as e:
        raise UserError(f"{key}={e}") from None
    if cfg and cfg.block_size < model.config.block_size:
        model.crop_block_size(cfg.block_size)
    return model, None


def hub_endpoint():
    return os.environ.get("HF_ENDPOINT", "https://huggingface.co").rstrip("/")


def hub_reachable(timeout=3.0):
    """Whether the Hugging Face Hub (HF_ENDPOINT) accepts a connection within `timeout` seconds. Without this,
    an offline machine spends about a minute in transformers' retries before its error."""
    if os.environ.get("HF_HUB_OFFLINE", "0").lower() in ("1", "true", "yes", "on"):
        return False
    url = urllib.parse.urlparse(hub_endpoint())
    address = (url.hostname, url.port or (443 if url.scheme == "https" else 80))
    answered = []

    def connect():  # in a thread: a name lookup has no timeout of its own
        try:
            socket.create_connection(address, timeout=timeout).close()
            answered.append(True)
        except OSError:
            pass
    thread = threading.Thread(target=connect, daemon=True)
    thread.start()
    thread.join(timeout)
    return bool(answered)


def in_hub_cache(name):
    """Whether GPT-2 `name` was downloaded before (transformers can then load it offline)."""
    from huggingface_hub import try_to_load_from_cache

    def cached(filename):
        return isinstance(try_to_load_from_cache(name, filename), str)
    return cached("config.json") and (cached("model.safetensors") or cached("pytorch_model.bin"))


def model_from_checkpoint(ckpt, path, keep_adapters=False, lora_base=None):
    """The checkpoint's model (see build_model)."""
    if ckpt.get("tokenizer") != TOKENIZER_ID:
        raise UserError(f"{path} was trained with tokenizer {ckpt.get('tokenizer')}, this version has {TOKENIZER_ID}: "
                        f"its token ids would mean other text")
    try:
        model = GPT.on_meta(GPTConfig(**ckpt["model_args"]))  # no memory until the weights are assigned
    except (TypeError, AssertionError) as e:  # model_args from another version of model.py, or inconsistent
        raise UserError(f"{path} has model_args {ckpt['model_args']} that this model.py cannot build: "
                        f"{str(e) or type(e).__name__}") from None
    state = ckpt["model"]
    if "lora_base" in ckpt:  # adapters only: the base comes from where the run took it
        state = {**base_weights(ckpt, path, lora_base, model), **state}
    if lora.has_adapters(state) and keep_adapters:
        lora.add_adapters(model, **lora.settings(ckpt["config"]))
    elif lora.has_adapters(state):
        state = lora.merged_state_dict(state, **lora.settings(ckpt["config"]))
    try:
        model.load_state_dict(own_copies(state), assign=True)
    except RuntimeError as e:
        raise UserError(f"{path} does not fit model {ckpt['model_args']}: {str(e).splitlines()[0]}") from None
    model.tie_weights()
    return model


def own_copies(state):
    """The tensors of `state` (read from a checkpoint's mmap) copied into this process's memory once each: one
    copy of the weights in host memory, and no tensor that keeps the file mapped, whose disk space would stay
    in use after a save replaces it."""
    copies, owned = {}, {}
    for key, tensor in state.items():
        storage = (tensor.untyped_storage().data_ptr(), tensor.storage_offset(), tensor.shape)
        if storage not in copies:
            copies[storage] = tensor.clone()
        owned[key] = copies[storage]
    return owned


def weights_digest(state_dict):
    """sha256 of a state dict's tensors (names, dtypes, shapes, bytes), in key order: the identity of a LoRA
    run's frozen base."""
    digest = hashlib.sha256()
    for name, tensor in state_dict.items():
        tensor = tensor.detach().cpu().contiguous()
        digest.update(f"{name}:{tensor.dtype}:{tuple(tensor.shape)};".encode())
        digest.update(tensor.reshape(-1).view(torch.uint8).numpy().data)
    return digest.hexdigest()


def lora_base_reference(source, model):
    """What a LoRA ckpt.pt keeps of its frozen base instead of its weights: where it came from and their hash."""
    return {"init_from": source, "sha256": weights_digest(lora.base_state_dict(model.state_dict()))}


def base_weights(ckpt, path, source, model):
    """The frozen base of a LoRA ckpt.pt, rebuilt from `source` (else where the run took it) and checked against
    the hash it was trained with, as state dict keys of `model` with adapters (…base_layer.weight)."""
    reference = ckpt["lora_base"]
    source = source or reference["init_from"]
    try:
        base, _ = build_model(source)
    except UserError as e:
        raise UserError(f"{path} holds LoRA adapters, not the base model they were trained on, which cannot be "
                        f"loaded from {source} ({e}): pass the base with --init_from=<GPT-2 name or folder>") from None
    if base.config.block_size > model.config.block_size:
        base.crop_block_size(model.config.block_size)
    if weights_digest(base.state_dict()) != reference["sha256"]:
        raise UserError(f"{path} holds LoRA adapters trained on another base model than {source} (its weights' "
                        f"sha256 differs): pass the base they were trained on with --init_from=<GPT-2 name or folder>")
    adapted = {key.rsplit(".lora_A.", 1)[0] for key in ckpt["model"] if ".lora_A." in key}
    return {(f"{layer}.base_layer.{kind}" if layer in adapted else key): value
            for key, value in base.state_dict().items() for layer, _, kind in [key.rpartition(".")]}
