"""model.py's GPT: transformers' logits with padding and packing, the masked loss, block_size refused, tied
weights, and gradient checkpointing with the same losses and gradients."""
import pytest
import torch
from torch.nn import functional as F
from torch.utils._pytree import tree_map

from conftest import tiny_gpt
from generate import DecodeState
from model import GPT, SharedPromptCache, prompt_slots


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


def beams_over_shared_prompts(lengths, n, steps, H, D, g):
    """Keys and values (2, H, L, D) of prompts of `lengths` and `steps` decode steps of n rows a prompt: each step
    the rows' parents (beams reordered within their prompt), queries (rows, H, 1, D) and new keys and values (rows,
    2, H, 1, D), a list a prompt."""
    prompts = [torch.randn(2, H, length, D, generator=g).mul(3) for length in lengths]
    return prompts, [([torch.randint(0, n, (n,), generator=g) for _ in lengths],
                      [torch.randn(n, H, 1, D, generator=g).mul(3) for _ in lengths],
                      [torch.randn(n, 2, H, 1, D, generator=g).mul(3) for _ in lengths]) for _ in range(steps)]


def shared_prompt_attention(prompts, steps, n, dtype):
    """Each step's attention of the rows over a SharedPromptCache of `prompts`, laid out as DecodeState says."""
    state = DecodeState([[0] * p.size(2) for p in prompts], len(steps), "cpu").share(n, dtype)
    cache = SharedPromptCache(max(prompt_slots(p.size(2)) for p in prompts) + n * len(steps))
    cache.write_prompts(torch.cat(prompts, 2)[None].to(dtype), [p.size(2) for p in prompts])
    outputs = []
    for parents, q, kv in steps:
        state = state.select_rows(torch.cat([i * n + rows for i, rows in enumerate(parents)]))
        state.append(torch.zeros(len(prompts) * n, dtype=torch.long))
        outputs.append(cache.attend(torch.cat(q).to(dtype), state.input_pos, torch.cat(kv).to(dtype), state.masks))
    return outputs


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16])
def test_shared_prompt_attention_is_full_cache_attention_as_precise_as_sdpa(dtype):
    # MBR's samples and beam search's beams read their prompt's slots once (SharedPromptCache), in its dtype: the
    # same attention as each row holding a copy of its prompt and of its own tokens (a beam's: its ancestors'); against
    # a float64 reference, as precise as SDPA over that full cache in the same dtype (within 3x), float32 within 1e-5
    g = torch.Generator().manual_seed(0)
    worst = {"ours": 0.0, "sdpa": 0.0}
    for _ in range(40):
        prompts, n, H, D, steps = (int(torch.randint(1, k, (1,), generator=g)) for k in (5, 9, 5, 65, 17))
        lengths = torch.randint(1, 70, (prompts,), generator=g).tolist()
        # the inputs rounded to dtype, so what differs is the computation alone
        prompts, steps = tree_map(lambda t: t.to(dtype).float() if t.is_floating_point() else t,
                                  beams_over_shared_prompts(lengths, n, steps, H, D, g))
        got = shared_prompt_attention(prompts, steps, n, dtype)[-1]
        own = [[] for _ in range(len(prompts) * n)]  # each row's keys and values so far
        for parents, _, kv in steps:
            own = [own[i * n + int(parent)] + [new] for i, rows in enumerate(parents)
                   for parent, new in zip(rows, kv[i], strict=True)]
        q = torch.cat(steps[-1][1])
        for row, (mine, q_row) in enumerate(zip(own, q, strict=True)):
            full_k, full_v = torch.cat((prompts[row // n], *mine), dim=2).unbind(0)
            expected = F.scaled_dot_product_attention(q_row.double(), full_k.double(), full_v.double())
            sdpa = F.scaled_dot_product_attention(q_row.to(dtype), full_k.to(dtype), full_v.to(dtype))
            assert got.dtype == dtype and got[row].shape == expected.shape
            scale = expected.abs().max().item()
            worst["ours"] = max(worst["ours"], (got[row].double() - expected).abs().max().item() / scale)
            worst["sdpa"] = max(worst["sdpa"], (sdpa.double() - expected).abs().max().item() / scale)
    assert worst["ours"] <= (1e-5 if dtype is torch.float32 else 3 * worst["sdpa"]), worst


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_shared_prompt_attention_of_a_prompt_is_the_same_whatever_its_batch(dtype):
    # a memory budget splits generate's batches: each prompt's attention, to the bit, as in one batch with the others
    # (prompts of 3 to 61 tokens: several runs of prompt slots, and a batch's longest prompt that changes)
    g = torch.Generator().manual_seed(0)
    lengths = [3, 9, 17, 30, 31, 33, 48, 61]
    prompts, steps = beams_over_shared_prompts(lengths, 4, 10, 3, 16, g)
    whole = shared_prompt_attention(prompts, steps, 4, dtype)
    for first, last in ((0, 1), (1, 4), (4, 5), (5, 8), (3, 6)):
        part = [tuple(x[first:last] for x in step) for step in steps]
        split = shared_prompt_attention(prompts[first:last], part, 4, dtype)
        assert all(torch.equal(a, b[first * 4:last * 4]) for a, b in zip(split, whole, strict=True)), (first, last)
