"""The ROUGE-calibrated fine-tuning stage (BRIO, Liu et al. 2022): the model writes k candidate summaries of
every training dialogue, each scored by ROUGE against the reference; training then adds to the token loss a
ranking loss that asks the model to give the better candidates the higher length-normalised log-probability.

candidates.pt holds them (make_candidates: generated once, sharded across ranks, saved as it goes, keyed to the
weights and the training rows); RankedBatches packs each training row with its candidates (prompt once, then
the reference and every candidate, each attending to the prompt and to itself); Ranking is the objective that
calibrate.py gives train.py's loop: a micro-batch's summed token loss and ranking loss from one forward of
PackedScorer."""
import hashlib
import os
import time
from dataclasses import dataclass, replace
from typing import NamedTuple

import numpy as np
import torch
from torch.nn import functional as F
from tqdm import tqdm

import data
from config import Decoding
from generate import generate
from summarizer import lora
from summarizer.checkpoint import not_an_archive
from summarizer.errors import UserError
from summarizer.files import atomic_write
from summarizer.loading import weights_digest
from summarizer.memory import generation_batches, generation_memory
from summarizer.metrics import rouge_per_example

QUALITY = ("rouge1", "rouge2", "rougeL")  # a candidate's quality: the mean of these F1 against the reference
SAVE_EVERY = 512  # dialogues between two saves of candidates.pt while generating (what a crash can lose)


def candidates_path(cfg):
    return cfg.candidates_file or os.path.join(cfg.out_dir, "candidates.pt")


def rows_digest(examples):
    """sha256 of the training rows as tokens (the CSV, the split, the template and the truncation all show)."""
    digest = hashlib.sha256()
    for array in (examples.tokens, examples.offsets, examples.prompt_lens):
        digest.update(np.ascontiguousarray(array).tobytes())
    return digest.hexdigest()


def candidates_key(model, examples, cfg):
    """What candidates.pt is valid for: the weights that wrote it, the training rows, how they were drawn."""
    return {"weights": weights_digest(lora.base_state_dict(model.state_dict())), "rows": rows_digest(examples),
            "decoding": cfg.rank_decoding, "candidates": cfg.rank_candidates, "max_new_tokens": cfg.max_new_tokens,
            "seed": cfg.seed}


@dataclass
class Candidates:
    """Per training row (in the order of the training examples): its candidate summaries as token lists (EOS not
    included) and their quality; `done` rows so far."""
    key: dict
    tokens: list
    quality: list
    done: int = 0

    def state(self):
        lengths = [len(t) for row in self.tokens for t in row]
        return {"key": self.key, "done": self.done,
                "tokens": torch.tensor([x for row in self.tokens for t in row for x in t], dtype=torch.int32),
                "lengths": torch.tensor(lengths, dtype=torch.int32),
                "counts": torch.tensor([len(row) for row in self.tokens], dtype=torch.int32),
                "quality": torch.tensor([q for row in self.quality for q in row], dtype=torch.float32)}

    @classmethod
    def from_state(cls, state):
        flat, lengths = state["tokens"].tolist(), state["lengths"].tolist()
        starts = np.concatenate([[0], np.cumsum(lengths)]).tolist()
        sequences = [flat[a:b] for a, b in zip(starts[:-1], starts[1:], strict=True)]
        quality, tokens, quality_rows, at = state["quality"].tolist(), [], [], 0
        for count in state["counts"].tolist():
            tokens.append(sequences[at:at + count])
            quality_rows.append(quality[at:at + count])
            at += count
        return cls(state["key"], tokens, quality_rows, state["done"])

    def save(self, path):
        with atomic_write(path, "wb") as f:
            torch.save(self.state(), f)


def load_candidates(path):
    """candidates.pt as Candidates, None if there is none; a file that is not one (a CSV given as candidates_file)
    or a damaged one is one line."""
    if not os.path.exists(path):
        return None
    if not_an_archive(path):
        raise UserError(f"candidates_file={path} is not a candidates file (calibrate.py writes one as a torch.save "
                        f"archive): pass --candidates_file=<a new path> for calibrate.py to write, or "
                        f"--candidates_file='' for out_dir/candidates.pt")
    try:
        return Candidates.from_state(torch.load(path, map_location="cpu", weights_only=True))
    except Exception as e:
        raise UserError(f"cannot read {path} ({str(e).strip().splitlines()[0] if str(e).strip() else e!r}): "
                        f"delete it to generate the candidates again") from None


def stale_reason(found, key):
    """Why candidates with key `found` cannot serve `key`, or None."""
    if found["weights"] != key["weights"]:
        return "another checkpoint's weights"
    if found["rows"] != key["rows"]:
        return "other training rows (another train_csv, split, prompt_template or block_size)"
    changed = [f"{name}={found[name]!r}" for name in ("decoding", "candidates", "max_new_tokens", "seed")
               if found[name] != key[name]]
    return f"other settings ({', '.join(changed)})" if changed else None


def make_candidates(model, examples, cfg, rt, key, may_generate=True, progress=True):
    """The Candidates for every training row: read from candidates_path(cfg) when it was made for `key` (and
    finished), else generated with `model` from where a matching unfinished file stopped; a file made for
    another key is refused in one line, and so is a missing or unfinished one when not may_generate (`model` is
    not the one that made them). Every rank generates its share of each SAVE_EVERY rows (as predict
    shards), rank 0 saves after each. Returns the Candidates on every rank."""
    path, found, problem = candidates_path(cfg), None, None
    if rt.is_main:  # the others wait in stop_if, and then take what rank 0 read
        try:
            found = load_candidates(path)
        except UserError as e:
            problem = str(e)
        reason = found and stale_reason(found.key, key)
        problem = problem or reason and (f"{path} was generated from {reason}, not this run's: delete it to "
                                         f"generate new candidates, or pass --candidates_file=<another path>")
    rt.stop_if(problem)
    found = rt.all_gather_objects(found)[0]
    candidates = found or Candidates(key, [], [])
    if candidates.done == len(examples):
        return candidates
    rt.stop_if(None if may_generate else (
        f"{path} is {'unfinished' if found else 'missing'}: the calibration stage being resumed trained on it, and "
        f"the weights that made it are not these; restore it, or start the stage again from its first checkpoint"))
    was_training = model.training
    model.eval()
    with tqdm(total=len(examples), initial=candidates.done, disable=not (progress and rt.is_main),
              desc=f"candidates ({cfg.rank_candidates} per dialogue, {cfg.rank_decoding})", unit="dialogue",
              dynamic_ncols=True) as bar:
        draw = CandidateDraw(model, examples, cfg, rt, bar)
        while candidates.done < len(examples):
            start, first = time.perf_counter(), candidates.done
            chunk = list(range(first, min(first + SAVE_EVERY, len(examples))))
            merged = {i: row for shard in rt.all_gather_objects(draw.rows(chunk)) for i, row in shard.items()}
            for i in chunk:
                candidates.tokens.append(merged[i][0])
                candidates.quality.append(merged[i][1])
            candidates.done = bar.n = chunk[-1] + 1
            bar.set_postfix(dialogues_per_s=f"{(candidates.done - first) / (time.perf_counter() - start):.1f}")
            if rt.is_main:
                candidates.save(path)
    model.train(was_training)
    rt.barrier()
    return candidates


class CandidateDraw:
    """Draws rank_candidates candidate summaries of training rows with `model`, this rank's share of each chunk,
    in batches whose KV cache fits the generation memory of every rank."""

    def __init__(self, model, examples, cfg, rt, bar):
        self.model, self.examples, self.cfg, self.rt, self.bar = model, examples, cfg, rt, bar
        self.prompts = [examples.sequence(i)[:examples.prompt_lens[i]].tolist() for i in range(len(examples))]
        self.decoding, self.cache_rows = candidate_decoding(cfg)
        self.memory = min(rt.all_gather_objects(generation_memory(cfg, model.lm_head.weight.device)))
        self.autocast = rt.autocast()
        self.dtype = (self.autocast.fast_dtype if isinstance(self.autocast, torch.autocast)
                      else model.lm_head.weight.dtype)

    def rows(self, chunk):
        """{row: (distinct candidates, their quality)} for this rank's share of training rows `chunk`."""
        k, mine = self.cfg.rank_candidates, {}
        batches = generation_batches([self.prompts[i] for i in chunk], self.cache_rows, self.cfg.gen_batch_size,
                                     self.model.config, self.memory, self.dtype, self.rt.rank, self.rt.world_size)
        for batch in batches:
            rows = [chunk[j] for j in batch]
            with self.autocast:
                drawn = generate(self.model, [self.prompts[i] for i in rows], self.decoding, eos_token_id=data.EOT_ID,
                                 seed=self.cfg.seed, num_return_sequences=k)
            for n, i in enumerate(rows):
                distinct = list({tuple(t): None for t in drawn[n * k:(n + 1) * k]})
                mine[i] = ([list(t) for t in distinct], quality(distinct, self.examples.summaries[i]))
            self.bar.update(len(rows) * self.rt.world_size)
        return mine


def candidate_decoding(cfg):
    """(how rank_candidates candidates are drawn: beam search's n-best list, or samples with MBR's settings in the
    benchmarks; a Decoding whose KV-cache rows per prompt are the draw's)."""
    k = cfg.rank_candidates
    if cfg.rank_decoding == "beam":
        drawn = Decoding(max_new_tokens=cfg.max_new_tokens, num_beams=k)
        return drawn, drawn
    drawn = Decoding(max_new_tokens=cfg.max_new_tokens, temperature=0.7, top_k=50, epsilon=0.02)
    return drawn, replace(drawn, mbr_samples=k, mbr_include_beam=False)  # k samples: the rows of k MBR samples


def quality(sequences, reference):
    """The mean of QUALITY's ROUGE F1 of each candidate (token lists) against the reference text, in float32 as
    candidates.pt keeps it."""
    scores = rouge_per_example([data.summary_text(list(s)) for s in sequences], [reference] * len(sequences))
    return np.float32([sum(scores[t][n] for t in QUALITY) / len(QUALITY) for n in range(len(sequences))]).tolist()


# ---- training on them ------------------------------------------------------------------------------------------

class Packed(NamedTuple):
    """Rows that each hold a prompt followed by several continuations of it (pack): every position's place in its
    sequence (B, T), which positions each one attends to (B, 1, T, T, boolean; a continuation sees the prompt and
    itself), and the tokens to score (N,) with the flattened position whose output predicts each (N,), so the
    prompt is run once for all of its continuations."""
    positions: torch.Tensor
    mask: torch.Tensor
    source: torch.Tensor
    tokens: torch.Tensor

    def to(self, device):
        return Packed(*(t.to(device, non_blocking=True) for t in self))


class PackedScorer(torch.nn.Module):
    """The model as the calibration stage trains it (what DDP, FSDP or Accelerate wrap, and torch.compile
    compiles): forward(x, packed) -> the log-probability of each packed token (N,)."""

    def __init__(self, model):
        super().__init__()
        self.model = model

    def forward(self, x, packed):
        hidden = self.model.hidden_states(x, packed.positions, packed.mask)
        logits = self.model.lm_head(hidden.flatten(0, 1).index_select(0, packed.source))
        return -F.cross_entropy(logits.float(), packed.tokens, reduction="none")


class RankBatch(NamedTuple):
    """A micro-batch of packed rows: input x (B, T), Packed targets whose first `references` tokens are the token
    loss's (the reference summaries) and the rest the candidates', `owner` the candidate of each of those; per
    candidate its length in tokens (EOS included), quality and row."""
    x: torch.Tensor
    packed: Packed
    references: int
    owner: torch.Tensor
    lengths: torch.Tensor
    quality: torch.Tensor
    dialogue: torch.Tensor

    def to(self, device):
        return RankBatch(self.x.to(device, non_blocking=True), self.packed.to(device), self.references,
                         *(t.to(device, non_blocking=True) for t in self[3:]))


def pack(examples, indices, candidates, train_on_prompt=False):
    """The RankBatch of training rows `indices`: each row is its training sequence (prompt + reference, as
    collate's x) followed by its candidates, whose positions continue from the prompt's end. The reference
    attends causally as in training; a candidate attends to the prompt and causally to itself; its first token
    is predicted from the prompt's last position, its EOS from its own last token."""
    rows, references, scored, lengths, quality, dialogue = [], [], [], [], [], []
    for row, i in enumerate(indices):
        sequence, prompt = examples.sequence(i).tolist(), int(examples.prompt_lens[i])
        tokens, positions, segment = sequence[:-1], list(range(len(sequence) - 1)), [0] * (len(sequence) - 1)
        first = 0 if train_on_prompt else prompt - 1
        references.append([(row, t, sequence[t + 1]) for t in range(first, len(sequence) - 1)])
        for c, (candidate, q) in enumerate(zip(candidates.tokens[i], candidates.quality[i], strict=True)):
            start = len(tokens)
            sources = [prompt - 1] + list(range(start, start + len(candidate)))
            scored += [(row, s, t, len(lengths)) for s, t in zip(sources, candidate + [data.EOT_ID], strict=True)]
            tokens += candidate
            positions += range(prompt, prompt + len(candidate))
            segment += [c + 1] * len(candidate)
            lengths.append(len(candidate) + 1)
            quality.append(q)
            dialogue.append(row)
        rows.append((tokens, positions, segment, prompt))
    width = -(-max(len(r[0]) for r in rows) // data.PAD_MULTIPLE) * data.PAD_MULTIPLE
    x = np.full((len(rows), width), data.EOT_ID, np.int64)
    pos = np.zeros((len(rows), width), np.int64)
    segment = np.full((len(rows), width), -1, np.int64)
    shared = np.zeros((len(rows), width), bool)
    for row, (tokens, positions, segments, prompt) in enumerate(rows):
        x[row, :len(tokens)], pos[row, :len(tokens)], segment[row, :len(tokens)] = tokens, positions, segments
        shared[row, :prompt] = True
    causal = np.tril(np.ones((width, width), bool))
    same = segment[:, :, None] == segment[:, None, :]
    # a pad sees itself
    mask = causal & (same & (segment[:, :, None] >= 0) | shared[:, None, :]) | np.eye(width, dtype=bool)
    targets = [t for row in references for t in row] + [t[:3] for t in scored]
    source = torch.tensor([r * width + s for r, s, _ in targets], dtype=torch.long)
    target_tokens = torch.tensor([t for _, _, t in targets], dtype=torch.long)
    return RankBatch(torch.from_numpy(x), Packed(torch.from_numpy(pos), torch.from_numpy(mask[:, None]), source,
                                                target_tokens),
                     sum(map(len, references)), torch.tensor([t[3] for t in scored], dtype=torch.long),
                     torch.tensor(lengths, dtype=torch.float32), torch.tensor(quality, dtype=torch.float32),
                     torch.tensor(dialogue, dtype=torch.long))


class RankedBatches(data.TrainBatches):
    """TrainBatches whose micro-batches are RankBatches: the same rows each step, packed with their candidates."""

    def __init__(self, examples, candidates, cfg, rank=0, world_size=1):
        super().__init__(examples, cfg, rank, world_size)
        self.candidates = candidates

    def collate(self, indices):
        return pack(self.examples, indices, self.candidates, self.train_on_prompt)


def sequence_scores(logprobs, owner, lengths, exponent):
    """Each candidate's summed token log-probability divided by its length ** exponent."""
    total = torch.zeros(len(lengths), dtype=logprobs.dtype, device=logprobs.device).index_add(0, owner, logprobs)
    return total / lengths ** exponent


def ranking_loss(scores, quality, dialogue, margin):
    """BRIO's pairwise margin loss, summed over dialogues: for each dialogue, the mean over its pairs of
    candidates (i better than j by quality) of max(0, score_j - score_i + margin * (rank_j - rank_i)), where a
    candidate's rank is the number of its dialogue's candidates of higher quality. Equal quality: no pair."""
    same = dialogue[:, None] == dialogue[None, :]
    better = same & (quality[:, None] > quality[None, :])  # better[i, j]: i outranks j
    rank = better.sum(0)  # candidates that outrank each one
    hinge = (scores[None, :] - scores[:, None] + margin * (rank[None, :] - rank[:, None])).clamp(min=0)
    pairs = torch.zeros(int(dialogue.max()) + 1 if len(dialogue) else 0, device=scores.device).index_add(
        0, dialogue, better.sum(1).float())
    return (hinge * better / pairs[dialogue].clamp(min=1)[:, None]).sum()


def describe(candidates):
    """'8,123 candidates for 1,024 dialogues (7.9 each, mean quality 0.312, best 0.401)'."""
    counts = [len(row) for row in candidates.tokens]
    flat = [q for row in candidates.quality for q in row]
    best = [max(row) for row in candidates.quality if row]
    return (f"{len(flat):,} candidates for {len(counts):,} dialogues ({len(flat) / max(1, len(counts)):.1f} each, "
            f"mean quality {np.mean(flat):.3f}, best-of-each {np.mean(best):.3f})")



class Ranking:
    """The calibration stage's objective for train.py's loop (calibrate.py): the token loss of the references plus,
    weighed by rank_weight, the ranking loss of their candidates, from one forward of PackedScorer. Its candidates
    are made by the starting weights, or on resuming are those that the checkpoint's stage trained on (the file
    must be there: the weights that made it are not)."""
    extra_loss = "rank_loss"

    @staticmethod
    def problem(cfg):
        if cfg.rank_weight <= 0:
            return ("calibrate.py needs --rank_weight > 0: the weight of the ranking loss beside the token loss (1.0 "
                    "is a start; docs/calibration.md)")
        return None

    def __init__(self, cfg, rt, train_set, model, ckpt):
        if ckpt is None:
            key = rt.all_gather_objects(candidates_key(model, train_set, cfg) if rt.is_main else None)[0]
        elif ckpt.get("candidates") is None:
            raise UserError("the checkpoint being resumed was trained without the ranking loss: start the "
                            "calibration stage from its weights in a new out_dir (--init_from=<its best.pt> "
                            "--out_dir=<new>), or resume it with train.py")
        else:
            key = ckpt["candidates"]
        candidates = make_candidates(model, train_set, cfg, rt, key, may_generate=ckpt is None)
        if rt.is_main:
            print(f"calibration: {describe(candidates)} in {candidates_path(cfg)}")
        self.checkpoint_keys = {"candidates": key}
        self.batches = RankedBatches(train_set, candidates, cfg, rt.rank, rt.world_size)
        self.cfg, self.weight = cfg, cfg.rank_weight * rt.world_size / cfg.batch_size  # a mean over dialogues

    def module(self, model):
        return PackedScorer(model)

    def on_device(self, batch, device):
        return batch.to(device)

    def losses(self, scorer, batch):
        """(summed token loss over the reference targets, the ranking loss weighed, summed over the rows)."""
        logprobs = scorer(batch.x, batch.packed)
        scores = sequence_scores(logprobs[batch.references:], batch.owner, batch.lengths, self.cfg.rank_length_exponent)
        rank_loss = ranking_loss(scores, batch.quality, batch.dialogue, self.cfg.rank_margin)
        return -logprobs[:batch.references].sum(), rank_loss * self.weight, rank_loss
