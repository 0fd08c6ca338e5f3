"""LoRA fine-tuning with peft: adapters on the blocks' Linear layers, base weights frozen; and the merged weights,
a plain GPT state dict (same keys as a full fine-tune), that evaluate.py and predict.py load with no base model."""
import torch

from config import Lora, keys

ADAPTER = "default"  # peft's adapter name: it appears in the state dict keys (...lora_A.default.weight)


def settings(config):
    """The Lora settings of a Config (or a Lora), or of a saved config dict (a checkpoint's), as keywords."""
    get = config.get if isinstance(config, dict) else lambda key: getattr(config, key)
    return {key: get(key) for key in keys(Lora)}


def add_adapters(model, lora_rank, lora_alpha, lora_dropout, lora_targets):
    """Put rank-lora_rank adapters (A random, B zero: the model is unchanged until trained) on the lora_targets
    of every block, in place; from then on only the adapters require grad. Returns the model."""
    from peft import LoraConfig, inject_adapter_in_model  # seconds to import: only for LoRA runs

    peft_config = LoraConfig(r=lora_rank, lora_alpha=lora_alpha, lora_dropout=lora_dropout,
                             target_modules=list(lora_targets), bias="none")
    return inject_adapter_in_model(peft_config, model, adapter_name=ADAPTER)


def has_adapters(state_dict):
    return any(f".lora_A.{ADAPTER}." in key for key in state_dict)


def merged_weights(state_dict, lora_rank, lora_alpha, **_):
    """(key, float32 tensor) of the plain GPT state dict of a state dict with adapters (e.g. gathered from FSDP
    shards), one weight at a time: an adapted weight is W + B @ A * lora_alpha / lora_rank (peft's merge for
    nn.Linear), made as it is asked for; the rest as they are."""
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
    """The blocks' frozen Linear layers (a LoRA run's base) in `dtype`, the run's compute dtype: a 16-bit run holds
    half their bytes and autocast uses them as they are, not casting them again at every forward and recompute. The
    adapters, embeddings and LayerNorms stay float32. Returns the model."""
    for module in model.transformer.h.modules():
        if isinstance(module, torch.nn.Linear) and not module.weight.requires_grad:
            module.to(dtype)
    return model


def base_state_dict(state_dict):
    """The frozen base of a state dict with adapters, under a plain GPT's keys."""
    return {key.replace(".base_layer.", "."): value for key, value in state_dict.items() if ".lora_" not in key}


def adapter_state_dict(state_dict):
    """The adapters alone: what a LoRA run trains, and all of the weights its ckpt.pt keeps."""
    return {key: value for key, value in state_dict.items() if ".lora_" in key}
