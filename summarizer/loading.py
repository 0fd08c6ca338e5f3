"""Where a model comes from: the one function that builds it (scratch, GPT-2 from the Hub or a folder, a checkpoint),
the Hub probe that keeps an offline machine from waiting, the model a training run trains, and LoRA: its adapters,
their merged weights, and a run's frozen base, kept by where it came from and its hash instead of its weights."""
import contextlib
import difflib
import hashlib
import json
import math
import os
import socket
import threading
import urllib.parse

import torch

from command_line import UserError, first_line
from config import Lora, ModelShape, keys
from data import TOKENIZER_ID
from model import GPT, PRETRAINED, GPTConfig
from summarizer import run_folder
from summarizer.checkpoint import load_checkpoint

GPT2_POSITIONS = 1024


def is_checkpoint(source):
    return os.path.isfile(source) or source.endswith(".pt")


def build_model(source, cfg=None, keep_adapters=False, key="init_from", lora_base=None, ckpt=None):
    """(model, checkpoint or None) from `source`: scratch, a GPT-2 name or transformers folder (cut to cfg.block_size),
    or a checkpoint (`ckpt` if loaded already; LoRA adapters merged unless keep_adapters). Errors name `key`."""
    if is_checkpoint(source):
        ckpt = load_checkpoint(source, key) if ckpt is None else ckpt
        model = model_from_checkpoint(ckpt, source, keep_adapters, lora_base)
        if cfg:
            model.set_dropout(cfg.dropout)
        return model, ckpt
    if source == "scratch":
        return GPT(GPTConfig(block_size=cfg.block_size, n_layer=cfg.n_layer, n_head=cfg.n_head, n_embd=cfg.n_embd,
                             dropout=cfg.dropout, bias=cfg.bias)), None
    check_shape(cfg, (), source, key)
    offline = from_hub_cache(source, key)
    try:
        model = GPT.from_pretrained(source, dropout=cfg.dropout if cfg else 0.0, local_files_only=offline)
    except FileNotFoundError as e:
        raise UserError(f"{key}={e}") from None
    if cfg and cfg.block_size < model.config.block_size:
        model.crop_block_size(cfg.block_size)
    return model, None


def source_shape(source, ckpt=None):
    """The ModelShape keys and block_size `source` fixes, read without its weights; None for scratch or nothing."""
    if ckpt is not None:
        return dict(ckpt["model_args"])
    if source in PRETRAINED:
        return {**PRETRAINED[source], "bias": True, "block_size": GPT2_POSITIONS}
    if os.path.isfile(source):
        try:
            return dict(load_checkpoint(source)["model_args"])
        except (UserError, KeyError, TypeError):
            return None
    try:
        with open(os.path.join(source, "config.json")) as f:
            hf = json.load(f)
        return {"n_layer": hf["n_layer"], "n_head": hf["n_head"], "n_embd": hf["n_embd"], "bias": True,
                "block_size": hf["n_positions"]}
    except (OSError, ValueError, KeyError, TypeError):
        return None


def resume_path(cfg):
    return cfg.resume_from or os.path.join(cfg.out_dir, run_folder.CKPT)


def trained_shape(cfg, start_ckpt):
    """The ModelShape keys and block_size of the model a run of `cfg` trains (`start_ckpt`: its checkpoint)."""
    shape = source_shape(cfg.init_from, start_ckpt) or {key: getattr(cfg, key) for key in keys(ModelShape)}
    return {**{key: shape[key] for key in keys(ModelShape)}, "block_size": min(cfg.block_size,
                                                                               shape.get("block_size", math.inf))}


def check_folder(source, key):
    """A run's out_dir (its config.json is ours) names its checkpoint instead."""
    if not os.path.isdir(source) or any(os.path.isfile(os.path.join(source, weights))
                                        for weights in ("model.safetensors", "pytorch_model.bin")):
        return
    if checkpoints := [name for name in ("best.pt", "ckpt.pt") if os.path.isfile(os.path.join(source, name))]:
        raise UserError(f"{key}={source} is a run's folder, not a model: name its checkpoint, "
                        f"--{key}={os.path.join(source, checkpoints[0])} (its weights; continuing the run is "
                        f"--init_from=resume --resume_from={os.path.join(source, 'ckpt.pt')})")
    if not os.path.isfile(os.path.join(source, "config.json")):
        raise UserError(f"{key}={source} is a folder without config.json: pass a transformers model folder "
                        f"(config.json and model.safetensors, as save_pretrained writes them), a checkpoint file, "
                        f"a GPT-2 name or scratch")


def check_named(source, key, others=()):
    """One line for a source that names nothing, every choice listed, the closest first."""
    choices = [*others, "scratch", *PRETRAINED]
    if source in choices or os.path.exists(source):
        return
    close = difflib.get_close_matches(source, choices, n=1)
    raise UserError(f"{key}={source!r} is none of {', '.join(choices)}, nor a transformers model folder or a "
                    f"checkpoint" + (f": did you mean --{key}={close[0]}?" if close else ""))


def check_shape(cfg, explicit, source, key="init_from", ckpt=None):
    """One line, before any work, when cfg asks `source` for what it cannot be (more positions, another shape)."""
    if source != "scratch":
        check_named(source, key, ("resume",) if key == "init_from" else ())
        check_folder(source, key)
    shape = source_shape(source, ckpt) if cfg else None
    if shape is None:
        return
    if cfg.block_size > shape["block_size"]:
        raise UserError(f"block_size={cfg.block_size} is longer than the {shape['block_size']} positions of "
                        f"{key}={source}: pass --block_size={shape['block_size']} or less (prompt and summary must "
                        f"fit the positions the model has)")
    for name in keys(ModelShape):
        if name in explicit and getattr(cfg, name) != shape[name]:
            raise UserError(f"--{name}={getattr(cfg, name)!r} contradicts {key}={source}: that model has "
                            f"{name}={shape[name]!r}: drop the flag (shape flags are for init_from=scratch)")


def from_hub_cache(source, key="init_from"):
    """Whether GPT-2 `source` loads from the hub's cache alone (offline); one line when it is not there either."""
    offline = source in PRETRAINED and not hub_reachable()
    if offline and not in_hub_cache(source):
        raise UserError(f"{key}={source} needs GPT-2's weights from {hub_endpoint()}, which cannot be reached (no "
                        f"internet; on Kaggle: Settings > Internet): attach the weights as a folder, e.g. a Kaggle "
                        f"dataset, and pass --{key}=/kaggle/input/<folder> (config.json and model.safetensors as "
                        f"save_pretrained writes them), or train from --{key}=scratch")
    return offline


def hub_endpoint():
    return os.environ.get("HF_ENDPOINT", "https://huggingface.co").rstrip("/")


def hub_reachable(timeout=3.0):
    """Without this, an offline machine spends about a minute in transformers' retries before its error."""
    if os.environ.get("HF_HUB_OFFLINE", "0").lower() in ("1", "true", "yes", "on"):
        return False
    url = urllib.parse.urlparse(hub_endpoint())
    address = (url.hostname, url.port or (443 if url.scheme == "https" else 80))
    answered = []

    def connect():  # in a thread: a name lookup has no timeout of its own
        with contextlib.suppress(OSError):
            socket.create_connection(address, timeout=timeout).close()
            answered.append(True)
    thread = threading.Thread(target=connect, daemon=True)
    thread.start()
    thread.join(timeout)
    return bool(answered)


def in_hub_cache(name):
    from huggingface_hub import try_to_load_from_cache
    config, *weights = (isinstance(try_to_load_from_cache(name, file), str)
                        for file in ("config.json", "model.safetensors", "pytorch_model.bin"))
    return config and any(weights)


def model_from_checkpoint(ckpt, path, keep_adapters=False, lora_base=None):
    if ckpt["tokenizer"] != TOKENIZER_ID:
        raise UserError(f"{path} was trained with tokenizer {ckpt['tokenizer']}, this version has {TOKENIZER_ID}: "
                        f"its token ids would mean other text")
    state = own_copies(ckpt["model"])
    adapters = any(f".lora_A.{ADAPTER}." in key for key in state)
    try:
        model = GPT.on_meta(GPTConfig(**ckpt["model_args"]))  # no memory until the weights are assigned
    except (TypeError, AssertionError) as e:  # model_args from another version of model.py, or inconsistent
        raise UserError(f"{path} has model_args {ckpt['model_args']} that this model.py cannot build: "
                        f"{first_line(e) or type(e).__name__}") from None
    if "lora_base" in ckpt:  # adapters only: the base comes from where the run took it
        state = {**base_weights(ckpt, path, lora_base, model, keep_adapters), **state}
    if adapters and keep_adapters:
        add_adapters(model, **lora_settings(ckpt["config"]))
    elif adapters:
        state = dict(merged_weights(state, **lora_settings(ckpt["config"])))
    try:
        model.load_state_dict(state, assign=True)
    except RuntimeError as e:
        raise UserError(f"{path} does not fit model {ckpt['model_args']}: {first_line(e)}") from None
    model.tie_weights()
    return model


def own_copies(state):
    """Copies, once each: a tensor that keeps a checkpoint's mmap keeps its disk space after a save replaces it."""
    copies, owned = {}, {}
    for key, tensor in state.items():
        storage = (tensor.untyped_storage().data_ptr(), tensor.storage_offset(), tensor.shape)
        if storage not in copies:
            copies[storage] = tensor.clone()
        owned[key] = copies[storage]
    return owned


def weights_digest(state_dict):
    """sha256 of a state dict's names, dtypes, shapes and bytes: the identity of a LoRA run's frozen base."""
    digest = hashlib.sha256()
    for name, tensor in state_dict.items():
        tensor = tensor.detach().cpu().contiguous()
        digest.update(f"{name}:{tensor.dtype}:{tuple(tensor.shape)};".encode())
        digest.update(tensor.reshape(-1).view(torch.uint8).numpy().data)
    return digest.hexdigest()


def base_weights(ckpt, path, source, model, resuming):
    """A LoRA ckpt.pt's frozen base, rebuilt from `source` (else where the run took it) and checked by its hash."""
    reference = ckpt["lora_base"]
    source = source or reference["init_from"]
    go_on = (f"continue with --resume_from={path} --init_from=<where the base is now: a GPT-2 "
             f"name or folder>" if resuming else
             f"score the run's best.pt instead (the merged weights, no base needed): --ckpt="
             f"{os.path.join(os.path.dirname(path), 'best.pt')}")
    try:
        base, _ = build_model(source)
    except UserError as e:
        raise UserError(f"{path} holds LoRA adapters, not the base model they were trained on, which cannot be "
                        f"loaded from {source} ({e}): {go_on}") from None
    if base.config.block_size > model.config.block_size:
        base.crop_block_size(model.config.block_size)
    if weights_digest(base.state_dict()) != reference["sha256"]:
        raise UserError(f"{path} holds LoRA adapters trained on another base model than {source} (its weights' "
                        f"sha256 differs): {go_on.replace('where the base is now', 'the base they were trained on')}")
    adapted = {key.rsplit(".lora_A.", 1)[0] for key in ckpt["model"] if ".lora_A." in key}
    return {(f"{layer}.base_layer.{kind}" if layer in adapted else key): value
            for key, value in base.state_dict().items() for layer, _, kind in [key.rpartition(".")]}


# ---- the model a training run trains ------------------------------------------------------------------------

def resuming(cfg):
    return cfg.init_from == "resume" or bool(cfg.resume_from)


def start_checkpoint(cfg):
    """(path, Checkpoint) of the checkpoint the run continues or starts from, else (None, None)."""
    if resuming(cfg):
        path = resume_path(cfg)
        if not os.path.isfile(path):
            if not cfg.resume_from and (running := run_folder.training_in(cfg.out_dir)):
                raise UserError(f"{path} does not exist yet: out_dir {cfg.out_dir} is in use by a training run that "
                                f"has not saved a checkpoint ({running}): wait for its first save (every "
                                f"eval_interval steps) or its end, or train into another folder with --out_dir=...")
            raise UserError(f"{path} does not exist: nothing to resume; continue another run's with "
                            f"--resume_from=<its ckpt.pt>, or start afresh without --init_from=resume"
                            + run_folder.missing_file_hint(path, "--resume_from"))
    elif is_checkpoint(cfg.init_from):
        path = cfg.init_from
    else:
        return None, None
    ckpt = load_checkpoint(path, "resume_from" if resuming(cfg) else "init_from")
    if resuming(cfg) and "candidates" in ckpt:
        raise UserError(f"{path} is a run of the calibration stage, which was retired after commit 605acfc: it "
                        f"cannot be resumed; evaluate.py, predict.py and export.py read it, and a new run trains on "
                        f"from its weights: --init_from={os.path.join(os.path.dirname(path), run_folder.BEST)} "
                        f"--out_dir=<a new folder>")
    return path, ckpt


def lora_base_moved_to(cfg):
    """Where a resumed LoRA run's base is now, if the command says (init_from beside resume_from)."""
    return cfg.init_from if cfg.init_from != "resume" else None


def model_to_train(cfg, start_ckpt=None):
    """(model, ckpt.pt's Checkpoint when resuming, else None); `start_ckpt`: the checkpoint, if loaded already."""
    if not resuming(cfg):
        model, _ = build_model(cfg.init_from, cfg, ckpt=start_ckpt)
        if cfg.lora_rank:
            add_adapters(model, **lora_settings(cfg))
        return model, None
    path = resume_path(cfg)
    model, ckpt = build_model(path, cfg, keep_adapters=True, lora_base=lora_base_moved_to(cfg), ckpt=start_ckpt)
    if "optimizer" not in ckpt:
        raise UserError(f"{path} holds weights only (a best.pt?), not what resuming needs: resume from the run's "
                        f"ckpt.pt, or train on from these weights in a new run: --init_from={path} "
                        f"--out_dir=<a new folder>")
    return model, ckpt


def kept_lora_base(cfg, model, ckpt):
    """What ckpt.pt keeps of a LoRA run's base instead of its weights, or None where it keeps them (scratch)."""
    if not cfg.lora_rank:
        return None
    if ckpt is not None:
        reference = ckpt.get("lora_base")  # none: the adapters sit on a scratch base, which ckpt.pt holds
        return reference and {**reference, "init_from": lora_base_moved_to(cfg) or reference["init_from"]}
    if cfg.init_from == "scratch":
        return None
    base = {key.replace(".base_layer.", "."): value for key, value in model.state_dict().items() if ".lora_" not in key}
    return {"init_from": cfg.init_from, "sha256": weights_digest(base)}


# ---- LoRA: adapters on the blocks' Linear layers (peft), base frozen; merged, a plain GPT state dict ------------

ADAPTER = "default"  # peft's adapter name: it appears in the state dict keys (...lora_A.default.weight)


def lora_settings(config):
    get = config.get if isinstance(config, dict) else lambda key: getattr(config, key)
    return {key: get(key) for key in keys(Lora)}


def add_adapters(model, lora_rank, lora_alpha, lora_dropout, lora_targets):
    """Adapters (B zero: the model is unchanged until trained) on every block's lora_targets, in place."""
    from peft import LoraConfig, inject_adapter_in_model  # seconds to import: only for LoRA runs

    peft_config = LoraConfig(r=lora_rank, lora_alpha=lora_alpha, lora_dropout=lora_dropout,
                             target_modules=list(lora_targets), bias="none")
    return inject_adapter_in_model(peft_config, model, adapter_name=ADAPTER)


def merged_weights(state_dict, lora_rank, lora_alpha, **_):
    """(key, float32 tensor) of the plain GPT state dict, one weight at a time: W + B @ A * alpha / rank (peft's)."""
    scaling = lora_alpha / lora_rank
    for key, value in state_dict.items():
        if ".lora_" in key:
            continue
        layer, _, kind = key.partition(".base_layer.")
        if kind == "weight":
            a, b = state_dict[f"{layer}.lora_A.{ADAPTER}.weight"], state_dict[f"{layer}.lora_B.{ADAPTER}.weight"]
            value = value + b @ a * scaling
        yield (f"{layer}.{kind}" if kind else key), value.float()


def cast_base(model, dtype):
    """The frozen Linear layers in the compute dtype: half the bytes, and no cast at each forward; the rest float32."""
    for module in model.transformer.h.modules():
        if isinstance(module, torch.nn.Linear) and not module.weight.requires_grad:
            module.to(dtype)
    return model


def adapter_state_dict(state_dict):
    """All of the weights a LoRA run's ckpt.pt keeps."""
    return {key: value for key, value in state_dict.items() if ".lora_" in key}
