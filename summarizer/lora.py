"""LoRA fine-tuning with peft: adapters on the blocks' Linear layers, base weights frozen; and the merged weights,
a plain GPT state dict (same keys as a full fine-tune), that evaluate.py and predict.py load with no base model."""
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


def merged_state_dict(state_dict, lora_rank, lora_alpha, **_):
    """A full state dict of a model with adapters (e.g. gathered from FSDP shards) -> the plain GPT state dict
    whose adapted weights are W + B @ A * lora_alpha / lora_rank (peft's merge for nn.Linear), the rest as is."""
    scaling = lora_alpha / lora_rank
    merged = {}
    for key, value in state_dict.items():
        if ".lora_" in key:
            continue
        if ".base_layer." in key:
            layer, _, kind = key.partition(".base_layer.")
            if kind == "weight":
                a, b = state_dict[f"{layer}.lora_A.{ADAPTER}.weight"], state_dict[f"{layer}.lora_B.{ADAPTER}.weight"]
                value = value + b @ a * scaling
            key = f"{layer}.{kind}"
        merged[key] = value
    return merged


def base_state_dict(state_dict):
    """The frozen base of a state dict with adapters, under a plain GPT's keys."""
    return {key.replace(".base_layer.", "."): value for key, value in state_dict.items() if ".lora_" not in key}


def adapter_state_dict(state_dict):
    """The adapters alone: what a LoRA run trains, and all of the weights its ckpt.pt keeps."""
    return {key: value for key, value in state_dict.items() if ".lora_" in key}
