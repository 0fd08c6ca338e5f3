"""model.py's GPT: transformers' logits with padding and packing, the masked loss, block_size refused, tied
weights, and gradient checkpointing with the same losses and gradients."""
import pytest
import torch
from torch.nn import functional as F

from conftest import tiny_gpt
from model import GPT


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


def test_packed_prefill_matches_each_prompt_alone(ours):
    # The generator's prefill runs the prompts back to back in one sequence: each prompt's last logits and
    # its cache row (right-aligned, the left-padded layout decoding continues) must equal the prompt run alone.
    from model import KVCache
    prompts = [[5, 6, 7, 8, 9, 10], [11, 12], [13]]
    caches = [KVCache(len(prompts[0]) + 4) for _ in ours.transformer.h]
    with torch.no_grad():
        last = ours.prefill(prompts, caches)
        for row, p in enumerate(prompts):
            alone_caches = [KVCache(len(p)) for _ in ours.transformer.h]
            alone = ours.prefill([p], alone_caches)
            assert torch.allclose(last[row], alone[0], atol=1e-5)
            full, _ = ours(torch.tensor([p]))
            assert torch.allclose(last[row], full[0, -1], atol=1e-5)
            end = len(prompts[0])
            for cache, alone_cache in zip(caches, alone_caches, strict=True):
                assert torch.allclose(cache.k[row, :, end - len(p):end], alone_cache.k[0], atol=1e-5)
                assert torch.allclose(cache.v[row, :, end - len(p):end], alone_cache.v[0], atol=1e-5)


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
    model = tiny_gpt(block_size=8, vocab_size=32, n_layer=1, n_embd=16)
    with pytest.raises(ValueError, match="block_size"):
        model(torch.zeros(1, 9, dtype=torch.long))


@pytest.mark.parametrize("name", ["gpt2-tiny", "/no/such/dir"])
def test_unknown_pretrained_name_is_one_clear_error(name):
    with pytest.raises(FileNotFoundError) as excinfo:
        GPT.from_pretrained(name)
    message = str(excinfo.value)
    assert name in message and "\n" not in message and "gpt2-medium" in message


def test_weights_are_tied_and_training_step_runs():
    model = tiny_gpt(block_size=16, dropout=0.1)
    assert model.lm_head.weight is model.transformer.wte.weight
    x = torch.randint(0, 64, (2, 16))
    _, loss = model(x, x)
    loss.backward()
    assert model.lm_head.weight.grad is not None and torch.isfinite(loss)


def saved_bytes(fn):
    """Bytes of the distinct tensor storages autograd keeps for backward while fn() runs, and fn()'s result."""
    storages = {}

    def pack(t):
        storages[t.untyped_storage().data_ptr()] = t.untyped_storage().nbytes()
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        out = fn()
    return sum(storages.values()), out


@pytest.mark.parametrize("dropout", [0.0, 0.1])
def test_gradient_checkpointing_same_losses_and_gradients(dropout):
    """Recomputing each block in backward gives the forward's loss and gradients (dropout masks included, as
    checkpoint restores the RNG), leaves the RNG where training without it would, and keeps fewer bytes."""
    torch.manual_seed(0)
    model = tiny_gpt(n_layer=3, dropout=dropout)
    x = torch.randint(0, 64, (4, 32))
    y = torch.randint(0, 64, (4, 32))
    y[:, :12] = -1
    runs = []
    for checkpointing in (False, True):
        model.gradient_checkpointing = checkpointing
        model.zero_grad(set_to_none=True)
        torch.manual_seed(1)
        kept, (_, loss) = saved_bytes(lambda: model(x, y))
        loss.backward()
        runs.append((kept, loss.item(), {n: p.grad.clone() for n, p in model.named_parameters()},
                     torch.get_rng_state()))
    (kept, loss, grads, rng), (kept_ckpt, loss_ckpt, grads_ckpt, rng_ckpt) = runs
    assert loss_ckpt == pytest.approx(loss, abs=1e-6)
    for name, grad in grads.items():
        assert torch.allclose(grads_ckpt[name], grad, atol=1e-6, rtol=0), name
    assert torch.equal(rng_ckpt, rng)
    assert kept_ckpt < kept / 2
    if dropout:  # the masks matter: without dropout the loss differs
        with torch.no_grad():
            assert model.eval()(x, y)[1].item() != pytest.approx(loss, abs=1e-3)


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16])
def test_shared_prompt_attention_equals_full_cache_attention(dtype):
    # MBR's samples and beam search's beams read their prompt's keys and values once (SharedPromptCache): the
    # same attention as each row holding a copy of its prompt's slots, pad slots masked, then its own slots
    from model import SharedPromptCache, shared_prompt_attention
    g = torch.Generator().manual_seed(0)
    prompts, per_prompt, H, P, D, generated, max_new = 3, 4, 2, 7, 8, 5, 6
    pad = torch.tensor([0, 3, 6])  # left padding: the last prompt has one real slot
    # the inputs rounded to dtype, so what differs is the computation alone
    k, v = (torch.randn(prompts, H, P, D, generator=g).mul(3).to(dtype).float() for _ in range(2))
    own_k, own_v = (torch.randn(prompts * per_prompt, H, generated, D, generator=g).mul(3).to(dtype).float()
                    for _ in range(2))
    q = torch.randn(prompts * per_prompt, H, 1, D, generator=g).mul(3).to(dtype).float()
    real = torch.arange(P)[None, :] >= pad[:, None]
    cache = SharedPromptCache(k.to(dtype), v.to(dtype), real, per_prompt, max_new)
    cache.k[:, :, :generated], cache.v[:, :, :generated] = own_k.to(dtype), own_v.to(dtype)
    got = shared_prompt_attention(q.to(dtype), cache.k, cache.v, cache, torch.tensor([P + generated - 1]))

    rows = torch.arange(prompts).repeat_interleave(per_prompt)
    mask = torch.cat((real[rows], torch.ones(len(rows), generated, dtype=torch.bool)), dim=1)[:, None, None]
    expected = F.scaled_dot_product_attention(q.double(), torch.cat((k[rows], own_k), 2).double(),
                                              torch.cat((v[rows], own_v), 2).double(), attn_mask=mask)
    assert got.dtype == dtype and got.shape == expected.shape
    tolerance = {torch.float32: 1e-5, torch.float16: 1e-2, torch.bfloat16: 5e-2}[dtype]
    assert (got.double() - expected).abs().max().item() <= tolerance
    assert expected.abs().max().item() > 1.0
