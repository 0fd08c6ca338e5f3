import collections
import copy
import itertools
import random
from dataclasses import replace
from unittest import mock

import pytest
import torch
from rouge_score import rouge_scorer
from torch.utils._python_dispatch import TorchDispatchMode

import generate as generate_module
from config import Decoding
from conftest import mid_way_eos
from data import summary_text
from generate import generate
from model import GPT, KVCache, prompt_slots
from summarizer.inference import agreement, mbr_pick, mbr_select

MAX_NEW = 24


@pytest.fixture(scope="module")
def prompts():
    g = torch.Generator().manual_seed(3)
    lengths = torch.randint(1, 60, (18,), generator=g).tolist()
    return [torch.randint(0, 50257, (n,), generator=g).tolist() for n in lengths]


def cut(tokens, eos):
    return tokens[:tokens.index(eos)] if eos in tokens else tokens


def hf_generate(hf, prompt, eos, **kwargs):
    out = hf.generate(torch.tensor([prompt]), attention_mask=torch.ones(1, len(prompt), dtype=torch.long),
                      max_new_tokens=MAX_NEW, do_sample=False, pad_token_id=eos, eos_token_id=eos, **kwargs)
    return cut(out[0, len(prompt):].tolist(), eos)


def naive_greedy(model, prompt, eos):
    """No cache, one prompt at a time: the whole sequence is re-run for every new token."""
    seq = list(prompt)
    for _ in range(MAX_NEW):
        logits, _ = model(torch.tensor([seq]))
        token = int(logits[0, -1].argmax())
        if token == eos:
            break
        seq.append(token)
    return seq[len(prompt):]


@pytest.fixture(scope="module")
def eos(ours, prompts):
    return mid_way_eos(ours, prompts, MAX_NEW, 1)


@pytest.mark.slow
def test_greedy_matches_transformers_and_naive_loop(ours, tiny_hf, prompts, eos):
    got = generate(ours, prompts, Decoding(max_new_tokens=MAX_NEW), eos_token_id=eos)
    assert any(len(g) < MAX_NEW for g in got) and any(len(g) == MAX_NEW for g in got)
    with torch.no_grad():
        for prompt, row in zip(prompts, got, strict=True):
            assert row == hf_generate(tiny_hf, prompt, eos)
            assert row == naive_greedy(ours, prompt, eos)


def test_batched_equals_one_at_a_time(ours, prompts, eos):
    batched = generate(ours, prompts, Decoding(max_new_tokens=MAX_NEW), eos_token_id=eos)
    assert batched == [generate(ours, [p], Decoding(max_new_tokens=MAX_NEW), eos_token_id=eos)[0] for p in prompts]


@pytest.mark.parametrize("compact_below", [0.0, 0.5, 1.0])
def test_ended_rows_in_place_or_dropped_give_the_same_greedy_summaries(ours, prompts, eos, compact_below):
    """Ended rows kept in the batch (0.0: until every row ends), dropped at half (a GPU's rule) or at each EOS
    (the CPU's): the same summaries as one prompt at a time."""
    got = generate(ours, prompts, Decoding(max_new_tokens=MAX_NEW), eos_token_id=eos, compact_below=compact_below)
    alone = [generate(ours, [p], Decoding(max_new_tokens=MAX_NEW), eos_token_id=eos)[0] for p in prompts]
    assert got == alone


def test_eos_stops_only_its_row(ours, prompts, eos):
    free = generate(ours, prompts, Decoding(max_new_tokens=MAX_NEW), eos_token_id=-1)
    stopped = generate(ours, prompts, Decoding(max_new_tokens=MAX_NEW), eos_token_id=eos)
    for f, s in zip(free, stopped, strict=True):
        assert s == cut(f, eos)
        assert eos not in s


class OperatorCount(TorchDispatchMode):
    """The ATen operators run, by name (views, which launch nothing, aside)."""
    def __init__(self):
        super().__init__()
        self.counts = collections.Counter()

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        self.counts[func.overloadpacket.__name__] += not func.is_view
        return func(*args, **(kwargs or {}))


def test_a_greedy_step_writes_keys_and_values_by_one_copy_a_layer_and_opens_its_mask_by_one_write(ours, prompts):
    # a step replayed as a CUDA graph costs its kernel count: per layer 4 linear, 2 layer_norm, one index_copy_ (keys
    # and values together), SDPA, gelu and 2 adds; then one write to the kept mask, the embeddings, ln_f and lm_head
    steps, static_step = [], generate_module.static_step

    def counted(model, batch):
        with OperatorCount() as ops:
            logits = static_step(model, batch)
        steps.append(ops.counts)
        return logits
    with mock.patch.object(generate_module, "static_step", counted):
        generate(ours, prompts[:8], Decoding(max_new_tokens=4), eos_token_id=-1)
    ops, layers = steps[-1], ours.config.n_layer
    ops.pop("dropout")  # in eval, its input itself
    assert ops["index_copy_"] == layers and ops["index_fill_"] == 1
    assert sum(ops.values()) == 11 * layers + 6, ops


@pytest.mark.slow
def test_beam_search_matches_transformers(ours, tiny_hf, prompts, eos):
    got = generate(ours, prompts, Decoding(max_new_tokens=MAX_NEW, num_beams=4), eos_token_id=eos)
    greedy = generate(ours, prompts, Decoding(max_new_tokens=MAX_NEW), eos_token_id=eos)
    assert got != greedy
    with torch.no_grad():
        for prompt, row in zip(prompts, got, strict=True):
            assert row == hf_generate(tiny_hf, prompt, eos, num_beams=4)


@pytest.mark.parametrize("kwargs", [dict(repetition_penalty=1.3), dict(no_repeat_ngram_size=2),
                                    dict(num_beams=3, length_penalty=0.6, no_repeat_ngram_size=3)])
def test_processors_match_transformers(ours, tiny_hf, prompts, eos, kwargs):
    got = generate(ours, prompts[:8], Decoding(max_new_tokens=MAX_NEW, **kwargs), eos_token_id=eos)
    with torch.no_grad():
        for prompt, row in zip(prompts[:8], got, strict=True):
            assert row == hf_generate(tiny_hf, prompt, eos, **kwargs)


def test_sampling_is_reproducible_with_seed(ours, prompts):
    a = generate(ours, prompts, Decoding(max_new_tokens=MAX_NEW, temperature=1.0, top_k=50, top_p=0.9), seed=7)
    b = generate(ours, prompts, Decoding(max_new_tokens=MAX_NEW, temperature=1.0, top_k=50, top_p=0.9), seed=7)
    c = generate(ours, prompts, Decoding(max_new_tokens=MAX_NEW, temperature=1.0, top_k=50, top_p=0.9), seed=8)
    assert a == b and a != c


def test_top_k_one_sampling_is_greedy(ours, prompts, eos):
    sampled = generate(ours, prompts, Decoding(max_new_tokens=MAX_NEW, temperature=0.7, top_k=1), eos_token_id=eos,
                       seed=0)
    assert sampled == generate(ours, prompts, Decoding(max_new_tokens=MAX_NEW), eos_token_id=eos)


def test_bad_arguments_are_clear_errors(ours):
    block = ours.config.block_size
    with pytest.raises(ValueError, match="max_new_tokens"):
        generate(ours, [[1, 2]], Decoding(max_new_tokens=block))
    with pytest.raises(ValueError, match="1 to block_size - max_new_tokens"):
        generate(ours, [[1, 2], []], Decoding(max_new_tokens=4))
    with pytest.raises(ValueError, match=f"1 to block_size - max_new_tokens = {block - 8} tokens"):
        # never cut silently: inference.py cuts dialogues
        generate(ours, [list(range(block - 7))], Decoding(max_new_tokens=8))
    assert len(generate(ours, [list(range(block - 8))], Decoding(max_new_tokens=8), eos_token_id=-1)[0]) == 8
    assert generate(ours, [], Decoding(max_new_tokens=4)) == []


# ---- n-best, min_new_tokens, sampling with shared samples, MBR ------------------------------------------------

def test_beam_n_best_matches_transformers_num_return_sequences(ours, tiny_hf, prompts, eos):
    k, beams, penalty = 3, 4, 0.8
    decoding = Decoding(max_new_tokens=MAX_NEW, num_beams=beams, length_penalty=penalty)
    got = generate(ours, prompts[:8], decoding, eos_token_id=eos, num_return_sequences=k)
    assert len(got) == 8 * k
    plain = generate(ours, prompts[:8], decoding, eos_token_id=eos)
    assert got[::k] == plain  # the first of each n-best list is beam search's answer
    ended_early = 0
    with torch.no_grad():
        for i, prompt in enumerate(prompts[:8]):
            out = tiny_hf.generate(torch.tensor([prompt]), attention_mask=torch.ones(1, len(prompt), dtype=torch.long),
                                   max_new_tokens=MAX_NEW, do_sample=False, pad_token_id=eos, eos_token_id=eos,
                                   num_beams=beams, length_penalty=penalty, num_return_sequences=k,
                                   return_dict_in_generate=True)
            mine = got[i * k:(i + 1) * k]  # in transformers' order: best score first
            assert mine == [cut(row[len(prompt):], eos) for row in out.sequences.tolist()]
            ended_early += sum(len(tokens) < MAX_NEW for tokens in mine)
    assert ended_early > 0  # some hypotheses finished at EOS, so lengths and scores are not all alike


@pytest.mark.parametrize("kwargs", [dict(), dict(num_beams=3)])
def test_min_new_tokens_matches_transformers(ours, tiny_hf, prompts, eos, kwargs):
    free = generate(ours, prompts[8:16], Decoding(max_new_tokens=MAX_NEW, **kwargs), eos_token_id=eos)
    got = generate(ours, prompts[8:16], Decoding(max_new_tokens=MAX_NEW, min_new_tokens=10, **kwargs), eos_token_id=eos)
    assert any(len(row) < 10 for row in free) and all(len(row) >= 10 for row in got)
    with torch.no_grad():
        for prompt, row in zip(prompts[8:16], got, strict=True):
            assert row == hf_generate(tiny_hf, prompt, eos, min_new_tokens=10, **kwargs)


def test_n_samples_are_reproducible_with_seed(ours, prompts, eos):
    def draw(seed):
        return generate(ours, prompts[:6], Decoding(max_new_tokens=MAX_NEW, temperature=1.5, top_k=4),
                        eos_token_id=eos, num_return_sequences=5, seed=seed)
    a = draw(7)
    assert len(a) == 30 and a == draw(7) and a != draw(8)
    alone = generate(ours, prompts[2:3], Decoding(max_new_tokens=MAX_NEW, temperature=1.5, top_k=4), eos_token_id=eos,
                     num_return_sequences=5, seed=7)
    assert alone == a[10:15]  # a prompt's samples depend on the seed and the prompt alone, not on its batch
    assert all(len({tuple(row) for row in a[i:i + 5]}) > 1 for i in range(0, 30, 5))  # samples, not copies


def test_samples_follow_the_model_distribution(ours):
    # N samples of a prompt, one row each over the prompt's shared keys and values, each drawn by inverse CDF from
    # the prompt's stream: the frequencies of all 9 two-token continuations (top_k=3) must match p(a) * p(b | a).
    prompt, temperature, n = [5, 17, 300, 9000], 3.0, 8000

    def top3(seq):
        with torch.no_grad():
            logits = ours(torch.tensor([seq]))[0][0, -1] / temperature
        values, ids = logits.topk(3)
        return dict(zip(ids.tolist(), values.softmax(-1).tolist(), strict=True))

    exact = {(a, b): pa * pb for a, pa in top3(prompt).items() for b, pb in top3(prompt + [a]).items()}
    assert min(exact.values()) > 0.01
    rows = generate(ours, [prompt], Decoding(max_new_tokens=2, temperature=temperature, top_k=3), eos_token_id=-1,
                    num_return_sequences=n, seed=0)
    counts = {}
    for row in rows:
        counts[tuple(row)] = counts.get(tuple(row), 0) + 1
    assert set(counts) <= set(exact) and sum(counts.values()) == n
    for sequence, p in exact.items():
        assert abs(counts.get(sequence, 0) / n - p) < 4.5 * (p * (1 - p) / n) ** 0.5, sequence


@pytest.mark.parametrize("settings", [dict(num_beams=4), dict(temperature=1.0, top_k=3, mbr_samples=6)])
def test_beams_and_samples_read_their_prompts_keys_and_values_once(ours, prompts, eos, settings):
    # every decode step attends each prompt's cache row once for all of its rows (the prompt's slots, then its rows'
    # tokens so far); beam search reorders its beams without copying a cache
    steps = []

    def record(module, args):
        x, cache, masks, lengths = args[0], args[1], args[3], args[4]
        if lengths is None:
            steps.append((x.size(0), cache.kv.size(0), [tuple(mask.shape) for mask in masks]))

    hooks = [block.attn.register_forward_pre_hook(record) for block in ours.transformer.h]
    try:
        with mock.patch.object(KVCache, "select_rows", side_effect=AssertionError("a cache copied")):
            generate(ours, prompts, Decoding(max_new_tokens=MAX_NEW, mbr_include_beam=False, **settings),
                     eos_token_id=eos, seed=0, mbr_pick=mbr_pick, compact_below=0.0)
    finally:
        for hook in hooks:
            hook.remove()
    # one SDPA call a run of prompts of the same prompt_slots: its rows over those slots and the t + 1 tokens of each
    n, layers = settings.get("num_beams", settings.get("mbr_samples")), len(ours.transformer.h)
    runs = [(slots, len(list(run))) for slots, run in itertools.groupby(prompt_slots(len(p)) for p in prompts)]
    assert len(steps) > layers and len(runs) > 1
    for i, (rows, cached, masks) in enumerate(steps):
        assert rows == cached * n == len(prompts) * n
        assert masks == [(count, 1, n, slots + (i // layers + 1) * n) for slots, count in runs]


class CastBytes(TorchDispatchMode):
    """The bytes that operators write converting tensors to another dtype (under inference_mode .to() reaches
    dispatch as aten.to, else as aten._to_copy)."""
    def __init__(self):
        super().__init__()
        self.bytes = 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        source = args[1] if func.overloadpacket is torch.ops.aten.copy_ else args[0]
        if func.overloadpacket in (torch.ops.aten.to, torch.ops.aten._to_copy, torch.ops.aten.copy_) and (
                source.dtype != out.dtype):
            self.bytes += out.nbytes
        return out


@pytest.mark.parametrize("settings", [dict(num_beams=4),
                                      dict(temperature=1.0, top_k=3, mbr_samples=8, mbr_include_beam=False)])
def test_beams_and_samples_read_their_caches_in_bfloat16_casting_none(ours, prompts, eos, settings):
    # a T4 decodes at its memory's bandwidth: a decode step in bfloat16 reads the caches in their own dtype, casting
    # at most a quarter of the prompts' caches' bytes (a float32 copy of every cache: 2.9x with 4 beams, 6x with 8)
    model, casts = copy.deepcopy(ours).to(torch.bfloat16), []

    def counted(*args, **kwargs):
        with CastBytes() as cast:
            logits = GPT.next_logits(model, *args, **kwargs)
        casts.append(cast.bytes)
        return logits
    model.next_logits = counted
    generate(model, prompts, Decoding(max_new_tokens=MAX_NEW, **settings), eos_token_id=eos, seed=0, mbr_pick=mbr_pick)
    prompt_caches = model.config.n_layer * len(prompts) * max(map(len, prompts)) * 2 * model.config.n_embd * 2
    assert len(casts) > 1 and max(casts) <= 0.25 * prompt_caches, max(casts) / prompt_caches


def test_samples_that_agree_so_far_go_through_lm_head_once(ours, prompts, eos):
    # top_k=1: a prompt's 6 samples agree at every step, so lm_head (and ln_f before it) sees one row a prompt, as
    # when one sample is drawn; the blocks still run every sample's row
    def head_rows(decoding):
        rows = []
        hook = ours.transformer.ln_f.register_forward_hook(lambda module, args, out: rows.append(out.size(0)))
        try:
            generate(ours, prompts, decoding, eos_token_id=eos, seed=0, mbr_pick=mbr_pick)
        finally:
            hook.remove()
        return rows
    one = Decoding(max_new_tokens=MAX_NEW, temperature=1.0, top_k=1)
    assert head_rows(replace(one, mbr_samples=6, mbr_include_beam=False)) == head_rows(one)


def test_mbr_of_identical_candidates_is_that_candidate(ours, prompts, eos):
    greedy = generate(ours, prompts, Decoding(max_new_tokens=MAX_NEW), eos_token_id=eos)
    for include_beam in (False, True):  # top_k=1 samples are all the greedy summary
        decoding = Decoding(max_new_tokens=MAX_NEW, temperature=1.0, top_k=1, mbr_samples=6,
                            mbr_include_beam=include_beam)
        assert generate(ours, prompts, decoding, eos_token_id=eos, seed=0, mbr_pick=mbr_pick) == greedy


def test_mbr_select_picks_the_consensus():
    candidates = ["tom and ann will meet at noon", "ann will meet tom at noon", "tom and ann will meet",
                  "the weather is bad today", "tom will cook dinner"]
    assert mbr_select(candidates) == 0
    assert mbr_select(candidates + [candidates[3]] * 5) == 3  # six samples said the same thing
    assert mbr_select(["x", "y z", "y z", "y z"]) == 1 and mbr_select(["x", "x", "x", "y z"]) == 0
    assert mbr_select(["tom will come", "tom will come"]) == 0
    assert mbr_select(["a b", "a c", "c d"], metric="rouge1") == 1


@pytest.mark.parametrize("metric", ["rouge1", "rouge2", "rougeL", "rougeLsum"])
def test_agreement_is_rouge_score_of_every_pair(metric):
    rng = random.Random(0)
    words = ["Tom", "Ann", "meeting", "meets", "met", "will", "won't", "cooking", "cooked", "the", "at", "noon",
             "tomorrow's", "3pm", "!", ",", "\n", "...", ""]
    texts = ["", "  ", "!!"] + [" ".join(rng.choice(words) for _ in range(rng.randint(1, 25))) for _ in range(40)]
    scorer = rouge_scorer.RougeScorer([metric], use_stemmer=True)
    expected = [[scorer.score(reference, prediction)[metric].fmeasure for reference in texts]
                for prediction in texts]
    assert agreement(texts, metric) == expected  # exactly: the same tokens, LCS lengths and F1 arithmetic
    assert any(0 < x < 1 for row in expected for x in row)


def test_batched_mbr_equals_an_unbatched_reference(ours, prompts, eos):
    n, few = 8, prompts[:8]
    sampling = Decoding(max_new_tokens=12, temperature=1.0, top_k=3)
    picked = generate(ours, few, replace(sampling, mbr_samples=n, mbr_include_beam=True), eos_token_id=eos, seed=11,
                      mbr_pick=mbr_pick)
    samples = generate(ours, few, sampling, eos_token_id=eos, seed=11, num_return_sequences=n)  # the same draws
    greedy = generate(ours, few, Decoding(max_new_tokens=12), eos_token_id=eos)
    scorer = rouge_scorer.RougeScorer(["rougeL"], use_stemmer=True)
    unique_best = 0
    for i in range(len(few)):
        texts = [summary_text(t) for t in [greedy[i], *samples[i * n:(i + 1) * n]]]
        utility = [sum(scorer.score(texts[j], texts[c])["rougeL"].fmeasure for j in range(len(texts)) if j != c)
                   / (len(texts) - 1) for c in range(len(texts))]
        best = max(utility)
        assert utility[texts.index(summary_text(picked[i]))] == pytest.approx(best, abs=1e-12)
        if sum(u == pytest.approx(best, abs=1e-12) for u in utility) == texts.count(texts[utility.index(best)]):
            unique_best += 1
            assert summary_text(picked[i]) == texts[utility.index(best)]
    assert unique_best >= 6 and picked != greedy[:len(few)]


@pytest.mark.parametrize("settings", [dict(temperature=0.7, top_k=50), dict(temperature=1.3, top_p=0.8),
                                      dict(temperature=0.7, top_k=50, top_p=0.9, epsilon=0.02),
                                      dict(temperature=1.0, epsilon=0.05)])
def test_sampling_warpers_match_transformers(settings):
    from transformers import EpsilonLogitsWarper, TemperatureLogitsWarper, TopKLogitsWarper, TopPLogitsWarper

    from generate import LogitsProcessors
    scores = torch.randn(6, 500, generator=torch.Generator().manual_seed(0)) * 3
    expected = TemperatureLogitsWarper(settings["temperature"])(None, scores)
    if settings.get("top_k"):
        expected = TopKLogitsWarper(settings["top_k"])(None, expected)
    if settings.get("top_p"):
        expected = TopPLogitsWarper(settings["top_p"])(None, expected)
    if settings.get("epsilon"):
        expected = EpsilonLogitsWarper(settings["epsilon"])(None, expected)
    processors = LogitsProcessors(Decoding(**settings), eos_token_id=0)
    logits, ids = processors.warp(scores)
    got = logits if ids is None else torch.full_like(scores, -float("inf")).scatter(1, ids, logits)
    assert torch.equal(torch.isinf(got), torch.isinf(expected))
    assert 1 < (~torch.isinf(got)).sum(1).min() and (~torch.isinf(got)).sum(1).max() < 500  # warped, not all/one
    assert torch.allclose(got.softmax(-1), expected.softmax(-1), atol=1e-6)
