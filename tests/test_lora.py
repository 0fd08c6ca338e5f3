import copy

import pytest
import torch
from peft.tuners.lora import LoraLayer

import lora
from config import load_config
from model import GPT, GPTConfig

ADAPTED = ("attn.c_attn.weight", "attn.c_proj.weight", "mlp.c_fc.weight", "mlp.c_proj.weight")


@pytest.fixture
def trained_adapter_model():
    """A tiny GPT with rank-2 adapters whose B is no longer zero (as after training), and the base state dict."""
    torch.manual_seed(0)
    model = GPT(GPTConfig(block_size=32, vocab_size=96, n_layer=2, n_head=2, n_embd=32))
    base = copy.deepcopy(model.state_dict())
    cfg = load_config(["--lora_rank=2", "--lora_alpha=8", "--lora_dropout=0.1"])
    lora.add_adapters(model, cfg)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if ".lora_B." in name:
                p.normal_(std=0.1)
    return model.eval(), base, cfg


def test_only_adapters_train_and_the_base_is_untouched(trained_adapter_model):
    model, base, _ = trained_adapter_model
    trainable = [n for n, p in model.named_parameters() if p.requires_grad]
    assert trainable and all(".lora_A." in n or ".lora_B." in n for n in trainable)
    assert len(trainable) == 2 * 4 * model.config.n_layer
    assert model.lm_head.weight is model.transformer.wte.weight


def test_merged_weights_are_base_plus_low_rank_update(trained_adapter_model):
    model, base, cfg = trained_adapter_model
    merged = lora.merged_state_dict(model.state_dict(), cfg.lora_rank, cfg.lora_alpha)
    assert list(merged) == list(base)  # the keys (and order) of a plain GPT: loadable with no adapters
    peft_merged = copy.deepcopy(model)  # the reference: peft's own in-place merge
    for module in peft_merged.modules():
        if isinstance(module, LoraLayer):
            module.merge()
    peft_weights = {n.replace(".base_layer", ""): p for n, p in peft_merged.state_dict().items() if ".lora_" not in n}
    for name, tensor in base.items():
        if name.endswith(ADAPTED):
            change = merged[name] - tensor
            assert torch.equal(merged[name], peft_weights[name]), name
            assert 0 < torch.linalg.matrix_rank(change) <= cfg.lora_rank, name
        else:
            assert torch.equal(merged[name], tensor), name


def test_merged_model_logits_equal_the_adapter_model(trained_adapter_model):
    model, _, cfg = trained_adapter_model
    plain = GPT(model.config)
    plain.load_state_dict(lora.merged_state_dict(model.state_dict(), cfg.lora_rank, cfg.lora_alpha))
    x = torch.randint(0, 96, (3, 32))
    with torch.no_grad():
        expected, _ = model(x)
        got, _ = plain.eval()(x)
        base_logits, _ = GPT(model.config).eval()(x)
    assert (got - expected).abs().max().item() <= 1e-5
    assert (expected - base_logits).abs().max().item() > 1e-2  # the adapters do change the model


def test_lora_targets_choose_the_layers():
    torch.manual_seed(0)
    model = GPT(GPTConfig(block_size=32, vocab_size=96, n_layer=2, n_head=2, n_embd=32))
    lora.add_adapters(model, load_config(["--lora_rank=4", "--lora_targets=attn.c_proj,mlp.c_fc"]))
    adapted = sorted({n.split(".lora_")[0] for n, p in model.named_parameters() if p.requires_grad})
    assert adapted == [f"transformer.h.{i}.{t}" for i in range(2) for t in ("attn.c_proj", "mlp.c_fc")]
