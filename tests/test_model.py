import pytest
import torch
from torch.nn import functional as F

from model import GPT, GPTConfig


@pytest.fixture(scope="module")
def ours(tiny_hf_dir):
    return GPT.from_pretrained(tiny_hf_dir).eval()


def test_logits_match_transformers_with_padding(ours, tiny_hf):
    torch.manual_seed(1)
    lengths = [37, 12, 1, 25]
    x = torch.randint(0, 50257, (len(lengths), max(lengths)))
    attention_mask = (torch.arange(max(lengths))[None, :] < torch.tensor(lengths)[:, None]).long()
    x = x.masked_fill(attention_mask == 0, 50256)  # right padding, as in training batches
    with torch.no_grad():
        ref = tiny_hf(x, attention_mask=attention_mask).logits
        got, loss = ours(x)
    assert loss is None
    real = attention_mask.bool()
    assert (got[real] - ref[real]).abs().max().item() <= 1e-4
    assert ref.abs().max().item() > 1.0  # the comparison is not between two near-zero tensors


def test_left_padded_prefill_matches_unpadded(ours):
    # The generator's prefill over a left-padded batch must equal each prompt run alone.
    from model import DecodeState, KVCache
    prompts = [[5, 6, 7, 8, 9, 10], [11, 12], [13]]
    state = DecodeState(prompts, 4, torch.device("cpu"))
    caches = [KVCache(state.max_len) for _ in ours.transformer.h]
    with torch.no_grad():
        last = ours.forward_cached(state.tokens, state.positions, state.input_pos, caches, state.prefill_mask())
        for row, p in enumerate(prompts):
            alone, _ = ours(torch.tensor([p]))
            assert torch.allclose(last[row], alone[0, -1], atol=1e-5)


def test_loss_ignores_minus_one_and_matches_full_logits(ours):
    torch.manual_seed(2)
    x = torch.randint(0, 50257, (3, 16))
    y = torch.randint(0, 50257, (3, 16))
    y[:, :10] = -1
    y[2, 12:] = -1
    with torch.no_grad():
        logits, _ = ours(x)
        _, loss = ours(x, y)
    expected = F.cross_entropy(logits.view(-1, logits.size(-1)), y.view(-1), ignore_index=-1)
    assert torch.allclose(loss, expected, atol=1e-5)


def test_sequence_longer_than_block_size_is_refused():
    model = GPT(GPTConfig(block_size=8, vocab_size=32, n_layer=1, n_head=2, n_embd=16))
    with pytest.raises(ValueError, match="block_size"):
        model(torch.zeros(1, 9, dtype=torch.long))


@pytest.mark.parametrize("name", ["gpt2-tiny", "/no/such/dir"])
def test_unknown_pretrained_name_is_one_clear_error(name):
    with pytest.raises(FileNotFoundError) as excinfo:
        GPT.from_pretrained(name)
    message = str(excinfo.value)
    assert name in message and "\n" not in message and "gpt2-medium" in message


def test_weights_are_tied_and_training_step_runs():
    model = GPT(GPTConfig(block_size=16, vocab_size=64, n_layer=2, n_head=2, n_embd=32, dropout=0.1))
    assert model.lm_head.weight is model.transformer.wte.weight
    x = torch.randint(0, 64, (2, 16))
    _, loss = model(x, x)
    loss.backward()
    assert model.lm_head.weight.grad is not None and torch.isfinite(loss)
