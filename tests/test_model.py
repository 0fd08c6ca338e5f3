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
                assert torch.allclose(cache.kv[row, 0, :, end - len(p):end], alone_cache.kv[0, 0], atol=1e-5)
                assert torch.allclose(cache.kv[row, 1, :, end - len(p):end], alone_cache.kv[0, 1], atol=1e-5)


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
def test_shared_prompt_attention_is_full_cache_attention_as_precise_as_sdpa(dtype):
    # MBR's samples and beam search's beams read their prompt's cache row once (SharedPromptCache), in its dtype: the
    # same attention as each row holding a copy of that row, its prompt's real slots and its own tokens' (a beam's
    # earlier ones in other rows' slots) unmasked; against a float64 reference, as precise as SDPA over that full
    # cache in the same dtype (within 3x), float32 within 1e-5
    from model import SharedPromptCache, attention_mask
    g = torch.Generator().manual_seed(0)
    worst = {"ours": 0.0, "sdpa": 0.0}
    for _ in range(60):
        prompts, n, H, P, D, M, more = (int(torch.randint(1, k, (1,), generator=g)) for k in (4, 9, 5, 65, 65, 17, 3))
        S, row, t = P + n * M, torch.arange(prompts * n), int(torch.randint(0, M, (1,), generator=g))
        # the inputs rounded to dtype, so what differs is the computation alone; slots past S the mask leaves out
        kv = torch.randn(prompts, 2, H, S + more * M, D, generator=g).mul(3).to(dtype).float()
        q = torch.randn(len(row), H, 1, D, generator=g).mul(3).to(dtype).float()
        prompt, slot = row // n, P + M * (row % n) + t
        real = torch.arange(P) >= torch.randint(0, P, (prompts, 1), generator=g)[prompt]  # left padding
        owner = torch.randint(0, n, (len(row), M), generator=g)  # which row holds each of a row's tokens
        owner[:, t] = row % n
        own = (owner[:, None] == torch.arange(n)[:, None]) & (torch.arange(M) <= t)
        allowed = torch.cat((real, own.flatten(1)), dim=1)
        cache = SharedPromptCache(kv.size(3), kv.to(dtype))
        got = cache.attend(q.to(dtype), (prompt, slot), kv[prompt, :, :, slot].unsqueeze(3).to(dtype),
                           attention_mask(allowed, dtype).view(prompts, 1, n, S))

        full_k, full_v = kv[prompt, :, :, :S].unbind(1)
        mask = allowed[:, None, None]
        expected = F.scaled_dot_product_attention(q.double(), full_k.double(), full_v.double(), attn_mask=mask)
        sdpa = F.scaled_dot_product_attention(q.to(dtype), full_k.to(dtype), full_v.to(dtype), attn_mask=mask)
        assert got.dtype == dtype and got.shape == expected.shape
        scale = expected.abs().max().item()
        worst["ours"] = max(worst["ours"], (got.double() - expected).abs().max().item() / scale)
        worst["sdpa"] = max(worst["sdpa"], (sdpa.double() - expected).abs().max().item() / scale)
    assert worst["ours"] <= (1e-5 if dtype is torch.float32 else 3 * worst["sdpa"]), worst
