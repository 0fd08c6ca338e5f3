import pytest
import torch
from transformers import GPT2Config, GPT2LMHeadModel


@pytest.fixture(scope="session")
def tiny_hf_dir(tmp_path_factory):
    """A tiny GPT2LMHeadModel saved with save_pretrained. The large initializer_range makes logits far apart,
    so greedy argmax never hinges on a floating-point tie between implementations."""
    torch.manual_seed(0)
    config = GPT2Config(vocab_size=50257, n_positions=128, n_embd=64, n_layer=2, n_head=4,
                        initializer_range=0.5, resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0)
    path = tmp_path_factory.mktemp("tiny-gpt2")
    GPT2LMHeadModel(config).save_pretrained(path)
    return str(path)


@pytest.fixture(scope="session")
def tiny_hf(tiny_hf_dir):
    return GPT2LMHeadModel.from_pretrained(tiny_hf_dir).eval()
