"""LoRA fine-tuning with peft: adapters on the blocks' Linear layers, base weights frozen; and the merged weights,
a plain GPT state dict (same keys as a full fine-tune), that evaluate.py and predict.py load with no base model."""
from peft import LoraConfig, inject_adapter_in_model

from config import lora_target_list

ADAPTER = "default"  # peft's adapter name: it appears in the state dict keys (...lora_A.default.weight)


def add_adapters(model, cfg):
    """Put rank-lora_rank adapters (A random, B zero: the model is unchanged until trained) on cfg.lora_targets
    of every block, in place; only the adapters require grad. Returns the model."""
    peft_config = LoraConfig(r=cfg.lora_rank, lora_alpha=cfg.lora_alpha, lora_dropout=cfg.lora_dropout,
                             target_modules=lora_target_list(cfg), bias="none")
    return inject_adapter_in_model(peft_config, model, adapter_name=ADAPTER)


def has_adapters(state_dict):
    return any(f".lora_A.{ADAPTER}." in key for key in state_dict)


def merged_state_dict(state_dict, lora_rank, lora_alpha):
    """A full state dict of a model with adapters (e.g. gathered from FSDP shards) -> the plain GPT state dict
    whose adapted weights are W + B @ A * lora_alpha / lora_rank (peft's merge for nn.Linear); every other
    tensor is passed through untouched."""
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
