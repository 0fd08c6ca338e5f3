"""Decoding in the spirit of gpt-fast's generate.py, token ids in and out: greedy (on static shapes, its steps
replayable as CUDA graphs), sampling, transformers' beam search and logits processors, MBR's candidates."""
import copy
import itertools
import sys
import time
import traceback
from typing import NamedTuple

import numpy as np
import torch
from torch.nn import functional as F

from model import KVCache, SharedPromptCache, attention_mask, prompt_slots


class Sequence(NamedTuple):
    """One generated continuation: its tokens (cut before EOS) and how many were generated, EOS included."""
    tokens: list
    length: int


@torch.inference_mode()
def generate(model, prompts, decoding, eos_token_id=50256, seed=None, num_return_sequences=1, mbr_pick=None,
             graphs=None, compact_below=0.5):
    """num_return_sequences continuations of each prompt as `decoding` says, cut before EOS: greedy, beam search
    (transformers', early_stopping=False; n-best best first), seeded samples (in the order they end), or one of N
    samples (and the greedy/beam result with mbr_include_beam) that mbr_pick(token lists, metric) -> index picks.
    graphs: a StepGraphs replaying greedy's steps; compact_below: running rows at most this fraction of the batch
    are copied into a smaller one."""
    d = decoding
    check_arguments(model, prompts, d, num_return_sequences, mbr_pick)
    if not prompts:
        return []
    prompts = [list(p) for p in prompts]
    device = model.lm_head.weight.device
    processors = LogitsProcessors(d, eos_token_id)
    if plain_greedy(d):
        # a graph reads autocast's cast weights from a cache that is gone at the context's end: eager under it
        graphed = graphs is not None and not torch.is_autocast_enabled(device.type)
        return greedy(model, prompts, d.max_new_tokens, processors, graphs if graphed else None, compact_below)
    state = DecodeState(prompts, d.max_new_tokens, device)
    per_prompt = max(d.num_beams, d.mbr_samples, num_return_sequences)  # rows: max_new slots each after the prompt
    slots = max(map(prompt_slots, state.lengths)) + per_prompt * d.max_new_tokens
    kv_caches = [SharedPromptCache(slots) for _ in model.transformer.h]
    logits = model.prefill(prompts, kv_caches)
    run = Decoder(model, processors, eos_token_id, compact_below)

    def deterministic(state, kv_caches):
        if d.num_beams > 1:
            return run.beam_search(logits, state, kv_caches, d.num_beams, d.length_penalty, num_return_sequences)
        return run.decode_rows(logits, state, kv_caches, None, 1)

    if d.temperature == 0:
        results = deterministic(state, kv_caches)
    else:
        # one random stream per prompt, from the seed and the prompt itself: a prompt's samples are the same
        # whichever batch it is decoded in (a memory budget may split batches) and however rows end
        entropy = np.random.SeedSequence().entropy if seed is None else seed
        streams = [np.random.default_rng([entropy, *prompt]) for prompt in prompts]
        if d.mbr_samples:  # beam_search and decode_rows change neither the state nor the prompts' slots
            best = deterministic(state, kv_caches) if d.mbr_include_beam else [[] for _ in prompts]
            samples = run.decode_rows(logits, state, kv_caches, streams, d.mbr_samples)
            results = [[mbr_choice(b[:1], s, mbr_pick, d.mbr_metric)] for b, s in zip(best, samples, strict=True)]
        else:
            results = run.decode_rows(logits, state, kv_caches, streams, num_return_sequences)
    return [s.tokens for row in results for s in row]


def plain_greedy(d):
    """Whether `d` (a Decoding) is plain greedy (no beams, sampling or processors): greedy() on static shapes."""
    return d.temperature == 0 and d.num_beams == 1 and d.repetition_penalty == 1.0 and not d.no_repeat_ngram_size


def check_arguments(model, prompts, d, num_return_sequences, mbr_pick):
    """ValueError for settings generate cannot follow, and for prompts that leave no room for max_new_tokens."""
    block_size = model.config.block_size
    if not 0 < d.max_new_tokens < block_size:
        raise ValueError(f"max_new_tokens must be in [1, block_size={block_size}), got {d.max_new_tokens}")
    if problem := d.contradiction():
        raise ValueError(problem)
    if d.mbr_samples and (num_return_sequences != 1 or mbr_pick is None):
        raise ValueError("MBR returns one sequence per prompt, the one mbr_pick chooses: use "
                         "num_return_sequences=1 and an mbr_pick")
    if not d.mbr_samples and not 0 < num_return_sequences <= (d.num_beams if d.temperature == 0 else float("inf")):
        raise ValueError(f"num_return_sequences={num_return_sequences} needs sampling (temperature > 0) or "
                         f"num_beams >= num_return_sequences")
    room = block_size - d.max_new_tokens
    if not all(0 < len(p) <= room for p in prompts):
        raise ValueError(f"every prompt needs 1 to block_size - max_new_tokens = {room} tokens, got lengths "
                         f"{sorted({len(p) for p in prompts})}")


def mbr_choice(best, samples, mbr_pick, metric):
    """Identical samples each a candidate (they agree); ties go to `best` (greedy/beam), then to earlier samples."""
    candidates = best + samples
    return candidates[mbr_pick([s.tokens for s in candidates], metric)]


class DecodeState:
    """The rows decoded over SharedPromptCaches, n a prompt (share): left-padded token history, positions, which of
    its prompt's rows holds each token (owner); each step, the (prompt, slot) a token goes into and the masks."""

    def __init__(self, prompts, max_new_tokens, device):
        P = max(len(p) for p in prompts)
        self.prompt_len, self.max_new, self.lengths = P, max_new_tokens, [len(p) for p in prompts]
        # Left padding repeats each row's first token, so padding never adds a token the row does not have
        # (repetition penalty scatters over the history); pad slots are masked out of attention.
        history = [[p[0]] * (P - len(p)) + p + [0] * max_new_tokens for p in prompts]
        self.history = torch.tensor(history, dtype=torch.long, device=device)
        self.pad = torch.tensor([P - len(p) for p in prompts], device=device)
        self.positions = torch.tensor([[len(p) - 1] for p in prompts], device=device)  # append() moves them on
        # of each token generated, which of its prompt's rows holds it (a beam's earlier tokens: its ancestors')
        self.owner = torch.zeros(len(prompts), max_new_tokens, dtype=torch.long, device=device)
        self.generated = 0  # tokens generated so far

    def share(self, n, dtype):
        """The prompts continued by n rows each, masks in `dtype` (the caches')."""
        shared = self.select_rows(torch.arange(len(self.pad), device=self.pad.device).repeat_interleave(n))
        shared.n, shared.dtype = n, dtype
        return shared

    def append(self, next_tokens):
        """Record the next tokens; a mask a run of prompts alike: each row's prompt and the slots of its tokens."""
        P, n, t, device = self.prompt_len, self.n, self.generated, self.pad.device
        row = torch.arange(len(self.pad), device=device)
        self.history[:, P + t] = next_tokens
        self.positions = self.positions + 1
        self.owner[:, t] = row % n
        self.input_pos = (row // n, prompt_slots(P - self.pad) + t * n + row % n)
        own = (self.owner[:, :t + 1, None] == row[:n]).flatten(1)  # (rows, (t + 1) * n), as the slots run
        self.masks, first = [], 0
        for slots, run in itertools.groupby(map(prompt_slots, self.lengths)):
            rows = slice(first * n, (first := first + len(list(run))) * n)
            real = torch.arange(slots, device=device) >= slots - (P - self.pad[rows, None])
            allowed = torch.cat((real, own[rows]), dim=1)
            self.masks.append(attention_mask(allowed, self.dtype).view(-1, 1, n, allowed.size(1)))
        self.generated += 1

    def seen_tokens(self):
        return self.history[:, :self.prompt_len + self.generated]

    def select_rows(self, rows, prompts=None):
        """A copy of the rows `rows` (index tensor: kept, reordered or repeated); `prompts`: those kept."""
        selected = copy.copy(self)
        selected.lengths = self.lengths if prompts is None else [self.lengths[p] for p in prompts]
        selected.history, selected.pad, selected.positions, selected.owner = (
            self.history[rows], self.pad[rows], self.positions[rows], self.owner[rows])
        return selected


class LogitsProcessors:
    """transformers' logits processors, then (sampling) its warpers, in its order."""

    def __init__(self, decoding, eos_token_id):
        d = decoding
        self.repetition_penalty, self.no_repeat_ngram_size = d.repetition_penalty, d.no_repeat_ngram_size
        self.min_new_tokens, self.eos_token_id = d.min_new_tokens, eos_token_id
        self.temperature, self.top_k, self.top_p, self.epsilon = d.temperature, d.top_k, d.top_p, d.epsilon

    def penalize(self, scores, state, rows=slice(None)):
        """The processed scores of `state`'s `rows` (else all): `scores` itself is never changed."""
        if self.repetition_penalty != 1.0:
            seen = state.seen_tokens()[rows]
            s = scores.gather(1, seen)
            scores = scores.scatter(1, seen, torch.where(s < 0, s * self.repetition_penalty,
                                                         s / self.repetition_penalty))
        if self.no_repeat_ngram_size > 0:
            n, banned = self.no_repeat_ngram_size, []
            for row, (seq, pad) in enumerate(zip(state.seen_tokens()[rows].tolist(), state.pad[rows].tolist(),
                                                 strict=True)):
                seq = seq[pad:]
                prefix = tuple(seq[len(seq) - n + 1:])
                banned += [(row, seq[i + n - 1]) for i in range(len(seq) - n + 1) if tuple(seq[i:i + n - 1]) == prefix]
            if banned:
                scores = scores.index_put(tuple(torch.tensor(banned, device=scores.device).t()),
                                          torch.tensor(-float("inf"), device=scores.device))
        return self.no_early_eos(scores, state.generated)

    def no_early_eos(self, scores, generated):
        if generated < self.min_new_tokens and 0 <= self.eos_token_id < scores.size(-1):
            scores = scores.clone()
            scores[:, self.eos_token_id] = -float("inf")
        return scores

    def warp(self, scores):
        """(warped logits, their token ids): with top_k a (rows, k) slice, one topk pass instead of several over the
        vocabulary; else the whole vocabulary (ids None)."""
        ids = None
        if self.top_k:
            scores, ids = torch.topk(scores, min(self.top_k, scores.size(-1)))  # sorted, best first
        logits = scores / self.temperature
        if self.top_p is not None and self.top_p < 1.0:
            sorted_logits, order = (logits, None) if ids is not None else torch.sort(logits, descending=True)
            # drop the tokens after the smallest prefix that reaches top_p (the first one always stays)
            probs = sorted_logits.softmax(dim=-1)
            remove = probs.cumsum(dim=-1) - probs >= self.top_p
            logits = logits.masked_fill(remove if order is None else remove.scatter(1, order, remove), -float("inf"))
        if self.epsilon > 0:
            remove = (logits.softmax(dim=-1) < self.epsilon) & (logits < logits.max(dim=-1, keepdim=True).values)
            logits = logits.masked_fill(remove, -float("inf"))
        return logits, ids


class Decoder:

    def __init__(self, model, processors, eos_token_id, compact_below):
        self.model, self.processors, self.eos, self.compact_below = model, processors, eos_token_id, compact_below

    def decode_rows(self, logits, state, kv_caches, streams, per_prompt):
        """Each prompt's Sequences of per_prompt rows, greedy (streams None) or sampled by inverse CDF at its own
        stream's next numbers, in row order: a prompt's draws depend on its stream and itself alone."""
        n, max_new, device = per_prompt, state.max_new, logits.device
        state = state.share(n, kv_caches[0].kv.dtype)
        results = [[] for _ in range(logits.size(0))]
        rows = [(r, []) for r in range(len(results)) for _ in range(n)]  # (prompt, new tokens), None once ended
        # Running rows of one prompt with the same tokens so far share a distribution (class): lm_head and the
        # warpers run once a class (`heads`: its first row; the prefill's logits are one a prompt). Confident
        # models keep most samples alike for many steps; ended rows cost no lm_head.
        heads, alike = list(range(0, len(rows), n)), [i // n for i in range(len(rows))]
        for step in range(max_new):
            live = [i for i, row in enumerate(rows) if row is not None]
            of_row = torch.tensor([alike[i] for i in live], device=device)
            scores = self.processors.penalize(logits.float(), state, torch.tensor(heads, device=device))
            if streams is None:
                drawn = scores.argmax(dim=-1)[of_row]
            else:
                warped, ids = self.processors.warp(scores)
                u = torch.tensor([[streams[rows[i][0]].random()] for i in live], dtype=torch.float64)
                drawn = inverse_cdf(warped.softmax(dim=-1)[of_row], u)
                drawn = (drawn if ids is None else ids[of_row].gather(1, drawn))[:, 0]
            classes = {}
            for i, token in zip(live, drawn.tolist(), strict=True):  # the step's one wait for the device
                prompt, tokens = rows[i]
                if token == self.eos or step == max_new - 1:
                    results[prompt].append(Sequence(tokens + [token] * (token != self.eos), step + 1))
                    rows[i] = None
                else:
                    tokens.append(token)
                    alike[i] = classes.setdefault((alike[i], token), len(classes))
            if not classes:
                break
            every = torch.zeros(len(rows), dtype=torch.long, device=device).index_copy_(
                0, torch.tensor(live, device=device), drawn)
            running = [p for p in range(len(rows) // n) if any(rows[p * n:(p + 1) * n])]
            if len(running) * n < len(rows) and len(running) * n <= self.compact_below * len(rows):
                prompts = torch.tensor(running, device=device)
                kept = (prompts[:, None] * n + torch.arange(n, device=device)).view(-1)
                state, every = state.select_rows(kept, running), every[kept]
                kv_caches = [cache.select_rows(prompts) for cache in kv_caches]
                rows, alike = ([x[p * n + j] for p in running for j in range(n)] for x in (rows, alike))
            heads = [0] * len(classes)
            for i in reversed(range(len(rows))):
                if rows[i] is not None:
                    heads[alike[i]] = i
            state.append(every)
            logits = self.model.next_logits(every[:, None], state.positions, state.input_pos, kv_caches, state.masks,
                                            torch.tensor(heads, device=device))
        return results

    def beam_search(self, logits, state, kv_caches, num_beams, length_penalty, num_return_sequences):
        """transformers' beam search (early_stopping=False; finished hypotheses scored sum_logprob /
        new_len**length_penalty): each prompt's num_return_sequences best, best first."""
        B, V, K, max_new = logits.size(0), logits.size(-1), num_beams, state.max_new
        expand = torch.arange(B, device=logits.device).repeat_interleave(K)
        state = state.share(K, kv_caches[0].kv.dtype)
        logits = logits[expand]
        running_scores, running_seqs, finished_scores, finished_seqs, finished_lengths, is_finished, improvable = \
            beam_tensors(B, K, max_new, self.eos, logits.device)
        top_k_mask = torch.arange(2 * K, device=logits.device) < K
        batch_offset = torch.arange(B, device=logits.device)[:, None] * K
        for step in range(max_new):
            log_probs = self.processors.penalize(F.log_softmax(logits.float(), dim=-1), state)
            log_probs = (log_probs.view(B, K, V) + running_scores[:, :, None]).view(B, K * V)
            topk_scores, topk_ids = torch.topk(log_probs, 2 * K)
            source_beam, token = topk_ids // V, topk_ids % V
            topk_seqs = running_seqs.gather(1, source_beam[:, :, None].expand(-1, -1, max_new)).clone()
            topk_seqs[:, :, step] = token
            hits_stop = (token == self.eos) | (step + 1 == max_new)

            still_running = topk_scores - 1e9 * hits_stop.float()
            keep = torch.topk(still_running, K).indices
            running_seqs = topk_seqs.gather(1, keep[:, :, None].expand(-1, -1, max_new))
            running_scores = still_running.gather(1, keep)
            parent = source_beam.gather(1, keep)

            just_finished = hits_stop & top_k_mask
            candidate = topk_scores / ((step + 1) ** length_penalty)
            candidate = candidate - 1e9 * (~improvable).float() - 1e9 * (~just_finished).float()
            merged_scores = torch.cat((finished_scores, candidate), dim=1)
            best = torch.topk(merged_scores, K).indices
            finished_scores = merged_scores.gather(1, best)
            finished_seqs = torch.cat((finished_seqs, topk_seqs), 1).gather(1, best[:, :, None].expand(-1, -1, max_new))
            finished_lengths = torch.cat((finished_lengths, torch.full_like(token, step + 1)), 1).gather(1, best)
            is_finished = torch.cat((is_finished, just_finished), dim=1).gather(1, best)

            best_running = running_scores[:, :1] / ((step + 1) ** length_penalty)
            worst_finished = torch.where(is_finished, finished_scores.min(dim=1, keepdim=True).values, -1e9)
            improvable = improvable & (best_running > worst_finished).any(dim=-1, keepdim=True)
            if not (improvable.any() & ~hits_stop.all()).item():  # the step's one wait for the device
                break
            state = state.select_rows((batch_offset + parent).view(-1))  # the caches stay: `owner` follows the beams
            tokens = running_seqs[:, :, step].reshape(-1, 1)
            state.append(tokens[:, 0])
            logits = self.model.next_logits(tokens, state.positions, state.input_pos, kv_caches, state.masks)
        n = num_return_sequences
        return [[Sequence(cut_at_eos(seq, self.eos), length) for seq, length in zip(*row, strict=True)]
                for row in zip(finished_seqs[:, :n].tolist(), finished_lengths[:, :n].tolist(), strict=True)]


def beam_tensors(B, K, max_new, eos, device):
    running_scores = torch.full((B, K), -1e9, device=device)
    running_scores[:, 0] = 0.0
    running_seqs = torch.full((B, K, max_new), eos, dtype=torch.long, device=device)
    return (running_scores, running_seqs, torch.full((B, K), -1e9, device=device), running_seqs.clone(),
            torch.zeros(B, K, dtype=torch.long, device=device), torch.zeros(B, K, dtype=torch.bool, device=device),
            torch.ones(B, 1, dtype=torch.bool, device=device))


def inverse_cdf(probs, u):
    """Token indices drawn from probs (rows, V) at uniform u (rows, n), u * total kept below the total (which
    rounding could reach), so a token of probability 0 is never drawn."""
    cdf = probs.cumsum(dim=-1)
    total = cdf[:, -1:]
    at = torch.minimum(u.to(cdf.device, cdf.dtype) * total, total.nextafter(torch.zeros_like(total)))
    return torch.searchsorted(cdf, at.contiguous(), right=True)


def cut_at_eos(tokens, eos_token_id):
    return tokens[:tokens.index(eos_token_id)] if eos_token_id in tokens else tokens


# ---- greedy on static shapes -----------------------------------------------------------------------------------

SLOTS_BUCKET = 64  # the cache slots a step attends, rounded up to a multiple of this: one shape for many lengths
READ_EVERY = 8  # greedy steps between the host's reads of the tokens (which rows ended)


class GreedyBatch(NamedTuple):
    """What greedy's static-shape step reads and updates in place, so that a CUDA graph of it can be replayed."""
    tokens: torch.Tensor
    positions: torch.Tensor
    slot: torch.Tensor
    mask: torch.Tensor
    caches: list

    def tensors(self):
        return [self.tokens, self.positions, self.slot, self.mask, *(c.kv for c in self.caches)]

    def select_rows(self, rows):
        return GreedyBatch(self.tokens[rows], self.positions[rows], self.slot.clone(), self.mask[rows],
                           [cache.select_rows(rows) for cache in self.caches])


def greedy_slots(prompt_len, max_new, block_size):
    """Greedy's static cache slots: the prompt and max_new up to a multiple of SLOTS_BUCKET, block_size at most."""
    return min(-(-(prompt_len + max_new) // SLOTS_BUCKET) * SLOTS_BUCKET, block_size)


def static_step(model, batch):
    """A greedy step's logits; its one write is the mask opening the step's slot."""
    batch.mask.index_fill_(3, batch.slot, 0)
    return model.next_logits(batch.tokens, batch.positions, batch.slot, batch.caches, batch.mask)


def greedy(model, prompts, max_new, processors, graphs, compact_below):
    """Greedy decoding on static shapes, EOS tracked on the device; every READ_EVERY steps the host reads the tokens
    and ends the batch or copies its running rows into a smaller one (padding rows copy a running row)."""
    device, eos = model.lm_head.weight.device, processors.eos_token_id
    P = max(len(p) for p in prompts)
    slots = greedy_slots(P, max_new, model.config.block_size)
    pad = torch.tensor([P - len(p) for p in prompts], device=device)
    every_slot = torch.arange(slots, device=device)
    mask = attention_mask((every_slot >= pad[:, None]) & (every_slot < P), model.lm_head.weight.dtype)
    # the prefill's caches are the batch's alone: a copy into graphs' buffers or a smaller batch frees them
    batch = GreedyBatch(torch.zeros_like(pad)[:, None], (P - 1 - pad)[:, None], torch.tensor([P - 1], device=device),
                        mask, [KVCache(slots) for _ in model.transformer.h])
    logits = model.prefill(prompts, batch.caches)
    batch = graphs.hold(model, batch) if graphs else batch
    out = torch.full((len(prompts), max_new), eos, device=device)
    done = torch.zeros(len(prompts), dtype=torch.bool, device=device)
    owners, results = list(range(len(prompts))), [None] * len(prompts)  # owners: a row's prompt, None: padding
    for step in range(max_new):
        tokens = processors.no_early_eos(logits.float(), step).argmax(dim=-1).masked_fill_(done, eos)
        out[:, step] = tokens
        done |= tokens == eos
        if step + 1 == max_new:
            break
        if (step + 1) % READ_EVERY == 0:
            running = ended_rows(out[:, :step + 1].tolist(), owners, results, eos)  # the host's one read
            if not running:
                return results
            rows = len(owners)
            # padded up to a power of two from 8 (at most the batch) where graphs replay: few shapes to capture
            smaller = min(rows, max(8, 1 << (len(running) - 1).bit_length())) if graphs else len(running)
            if smaller < rows and len(running) <= compact_below * rows:
                keep = torch.tensor(running + running[:1] * (smaller - len(running)), device=device)
                batch = graphs.hold(model, batch.select_rows(keep)) if graphs else batch.select_rows(keep)
                out, done, tokens = out[keep], done[keep], tokens[keep]
                owners = [owners[i] for i in running] + [None] * (smaller - len(running))
        batch.tokens.copy_(tokens[:, None])
        batch.positions.add_(1)
        batch.slot.add_(1)
        logits = graphs(model, batch) if graphs else static_step(model, batch)
    ended_rows(out.tolist(), owners, results, eos, last=True)
    return results


def ended_rows(tokens, owners, results, eos, last=False):
    """Record in results the rows that ended (all at the `last` step); return the indices of those running."""
    running = []
    for i, (row, owner) in enumerate(zip(tokens, owners, strict=True)):
        if owner is None or results[owner] is not None:
            continue
        if eos in row or last:
            results[owner] = cut_at_eos(row, eos)
        else:
            running.append(i)
    return running


def capture_graph(step, stream=None):
    """(graph, its output, step()'s eager output), captured on torch.cuda.graph's one side stream (cuBLAS keeps a
    workspace a stream) but not by torch.cuda.graph, which empties the allocator's cache (a training run's). A failed
    capture restores the stream, frees its memory and raises the step's own error."""
    graph, error = torch.cuda.CUDAGraph(), None
    current, stream = torch.cuda.current_stream(), stream or torch.cuda.graph(graph).capture_stream
    stream.wait_stream(current)
    with torch.cuda.stream(stream):
        for _ in range(3):
            expected = step()
    torch.cuda.synchronize()  # `expected` is ready after it
    try:
        with torch.cuda.stream(stream):
            # thread_local: another thread's CUDA calls (the NCCL watchdog's event queries under torchrun, which
            # torch before 2.8 makes in the global mode) cannot end it
            graph.capture_begin(capture_error_mode="thread_local")
            try:
                output = step()
            except Exception as e:  # raised once the capture has ended
                error = e
            graph.capture_end()
    except Exception as e:
        error = error or e
    finally:
        torch.cuda.set_stream(current)
    if error:
        graph.reset()  # its memory pool, and the step's frames, which hold what the capture allocated
        traceback.clear_frames(error.__traceback__)
        raise error
    return graph, output, expected


def replay_disagrees(replayed, eager):
    """In words, how far a first replay is from the eager step, where beyond the dtype's rounding at the logits'
    scale; else None."""
    # A graph's kernels may sum in another order (cuBLAS picks its algorithms under capture): a logit that cancels to
    # near zero differs then by the rounding of what it summed, which the logits' scale sets, not its own size (an
    # H200 in bfloat16: 0.0156, a step of a logit near 3, refused by an elementwise tolerance)
    rtol = {torch.bfloat16: 1.6e-2, torch.float16: 1e-3}.get(eager.dtype, 1.3e-6)  # torch.testing's own
    scale = eager.float().nan_to_num(posinf=0.0, neginf=0.0).abs().amax().item()  # an inf would pass any gap
    try:
        torch.testing.assert_close(replayed, eager, rtol=rtol, atol=rtol * scale, equal_nan=True)
    except AssertionError:
        return f"its first replay differs from the eager step by up to {(replayed - eager).abs().max().item():.3g}"


class StepGraphs:
    """A CUDA graph of greedy's step per (model, rows, slots), captured at first use, replayed over fixed buffers (one
    KV storage a layer). A failed capture or replay turns graphs off for good (both would recur), with one line.
    error_line: how that line names a failed capture's exception (the caller's one rule; this module needs the model
    alone)."""

    def __init__(self, capture=capture_graph, warn=None, error_line=lambda error: type(error).__name__):
        self.capture, self.error_line = capture, error_line
        self.warn = warn or (lambda line: print(line, file=sys.stderr))
        self.eager_why, self.capture_seconds = None, {}  # eager_why: None while the steps replay as graphs
        self.release()

    def release(self):
        self.graphs, self.inputs, self.storage = {}, {}, []

    def describe(self):
        if self.eager_why:
            return f"greedy steps eager: {self.eager_why}"
        buckets = ", ".join(f"{rows}x{slots}" for rows, slots in self.capture_seconds) or "captured at first use"
        return f"greedy steps replayed as CUDA graphs (buckets {buckets})"

    def hold(self, model, batch):
        """The batch copied into this bucket's fixed buffers (as it is once graphs are off)."""
        if self.eager_why:
            return batch
        first = batch.caches[0].kv
        if not self.storage or self.storage[0].numel() < first.numel() or self.storage[0].dtype != first.dtype:
            self.release()  # the graphs read the storage they were captured on: they go with it
            self.storage = [cache.kv.new_empty(first.numel()) for cache in batch.caches]
        key = (model, len(batch.tokens), batch.caches[0].slots)
        if key not in self.inputs:
            caches = [KVCache(batch.caches[0].slots, kv[:first.numel()].view(first.shape)) for kv in self.storage]
            self.inputs[key] = GreedyBatch(*(torch.empty_like(t) for t in batch[:4]), caches)
        held = self.inputs[key]
        for target, source in zip(held.tensors(), batch.tensors(), strict=True):
            target.copy_(source)
        return held

    def __call__(self, model, batch):
        """The step's logits: the bucket's graph replayed, captured and checked at its first use."""
        key, step = (model, len(batch.tokens), batch.caches[0].slots), lambda: static_step(model, batch)
        if self.eager_why:
            return step()
        if key in self.graphs:
            graph, logits = self.graphs[key]
            graph.replay()
            return logits
        cuda = model.lm_head.weight.is_cuda
        try:
            cuda and torch.cuda.synchronize()  # the capture's own seconds, not the work queued before it
            start = time.perf_counter()
            graph, logits, expected = self.capture(step)
            cuda and torch.cuda.synchronize()
            seconds = time.perf_counter() - start
            graph.replay()
            why = replay_disagrees(logits, expected)
        except torch.OutOfMemoryError:
            raise
        except Exception as e:  # the step's own errors meet the eager step again below
            why = f"capture failed ({self.error_line(e)})"
        if why:
            self.warn(f"warning: CUDA graph {why}; decoding eagerly from now on")
            self.eager_why = why
            self.release()
            return step()
        self.graphs[key], self.capture_seconds[key[1:]] = (graph, logits), seconds
        return logits

