"""The calibration stage (calibrate.py, summarizer/ranking.py): the ranking loss against a hand computation, packed
rows against transformers scoring each candidate alone, candidates.pt (stale files refused, interrupted generation
resumed, sharded generation equal to one process), and stage 2 training: resumed bit-exactly, the same under
DDP/FSDP."""
import math
import sys

import numpy as np
import pytest
import torch
from torch.nn import functional as F

import calibrate
import data
import train
from config import load_config
from conftest import metrics, run, save_csv, synthetic_rows, torchrun
from model import GPT
from summarizer import ranking
from summarizer.checkpoint import load_checkpoint
from summarizer.runtime import Runtime
from test_train import RUN, assert_same_losses

STAGE1 = [*RUN, "--batch_size=8", "--micro_batch_size=4", "--max_iters=30", "--eval_interval=30",
          "--rouge_samples=0", "--best_metric=val_loss", "--learning_rate=1e-2"]
STAGE2 = [*RUN, "--batch_size=8", "--micro_batch_size=4", "--eval_interval=2", "--rouge_samples=2",
          "--rank_weight=1.0", "--rank_candidates=3", "--dropout=0.1", "--lr_decay_iters=4"]


def test_ranking_loss_equals_hand_computation():
    # dialogue 0: three candidates, ROUGE order 0 > 1 > 2; dialogue 1: two candidates of equal quality (no pair)
    # and one worse
    logprob_sums = torch.tensor([-4.0, -1.5, -6.0, -2.0, -3.0, -1.0])
    lengths = torch.tensor([4.0, 3.0, 2.0, 2.0, 2.0, 1.0])
    quality = torch.tensor([0.5, 0.3, 0.1, 0.4, 0.4, 0.2])
    dialogue = torch.tensor([0, 0, 0, 1, 1, 1])
    owner = torch.arange(6).repeat_interleave(2)
    per_token = (logprob_sums / 2).repeat_interleave(2)  # two tokens each, summing to logprob_sums
    scores = ranking.sequence_scores(per_token, owner, lengths, exponent=2.0)
    expected_scores = [-4 / 16, -1.5 / 9, -6 / 4, -2 / 4, -3 / 4, -1 / 1]
    assert scores.tolist() == pytest.approx(expected_scores)
    margin = 0.1
    s = expected_scores
    # dialogue 0: pairs (0,1) gap 1, (0,2) gap 2, (1,2) gap 1
    d0 = (max(0, s[1] - s[0] + margin) + max(0, s[2] - s[0] + 2 * margin) + max(0, s[2] - s[1] + margin)) / 3
    # dialogue 1: candidates 3 and 4 share rank 0, candidate 5 has rank 2: pairs (3,5), (4,5), both gap 2
    d1 = (max(0, s[5] - s[3] + 2 * margin) + max(0, s[5] - s[4] + 2 * margin)) / 2
    loss = ranking.ranking_loss(scores, quality, dialogue, margin)
    assert loss.item() == pytest.approx(d0 + d1)
    assert d0 > 0 and d1 == 0  # the example exercises an active and an inactive hinge
    # no pair at all (one candidate, or all equal): zero
    assert ranking.ranking_loss(scores[:2], torch.tensor([0.3, 0.3]), dialogue[:2], margin).item() == 0


def examples_of(pairs):
    sequences = [p + s + [data.EOT_ID] for p, s in pairs]
    lengths = np.array([len(q) for q in sequences])
    return data.Examples(np.concatenate(sequences).astype(np.uint16), np.concatenate([[0], np.cumsum(lengths)]),
                         np.array([len(p) for p, _ in pairs]), [], [], [])


@pytest.mark.parametrize("train_on_prompt", [False, True])
def test_packed_rows_score_every_candidate_as_transformers_scores_it_alone(tiny_hf, tiny_hf_dir, train_on_prompt):
    rng = np.random.default_rng(0)
    pairs = [(rng.integers(0, 50256, rng.integers(2, 30)).tolist(), rng.integers(0, 50256, rng.integers(1, 9)).tolist())
             for _ in range(3)]
    examples = examples_of(pairs)
    counts = (3, 1, 4)
    candidates = ranking.Candidates({}, [[rng.integers(0, 50256, rng.integers(0, 7)).tolist() for _ in range(k)]
                                           for k in counts], [rng.random(k).tolist() for k in counts], 3)
    ours = GPT.from_pretrained(tiny_hf_dir).eval()
    batch = ranking.pack(examples, [0, 1, 2], candidates, train_on_prompt)
    with torch.no_grad():
        logprobs = ranking.PackedScorer(ours)(batch.x, batch.packed)
        expected = []  # transformers, one sequence at a time: the references' targets, then every candidate's
        for (prompt, summary), first in zip(pairs, [0 if train_on_prompt else None] * 3, strict=True):
            sequence = prompt + summary + [data.EOT_ID]
            start = len(prompt) - 1 if first is None else 0
            log_softmax = F.log_softmax(tiny_hf(torch.tensor([sequence[:-1]])).logits[0], -1)
            expected += log_softmax[torch.arange(start, len(sequence) - 1), torch.tensor(sequence[start + 1:])].tolist()
        assert batch.references == len(expected)
        for (prompt, _), row in zip(pairs, candidates.tokens, strict=True):
            for candidate in row:
                sequence = prompt + candidate + [data.EOT_ID]
                log_softmax = F.log_softmax(tiny_hf(torch.tensor([sequence[:-1]])).logits[0], -1)
                expected += log_softmax[torch.arange(len(prompt) - 1, len(sequence) - 1),
                                        torch.tensor(sequence[len(prompt):])].tolist()
    np.testing.assert_allclose(logprobs.numpy(), expected, rtol=1e-4, atol=1e-4)
    assert batch.lengths.tolist() == [len(c) + 1 for row in candidates.tokens for c in row]
    assert batch.dialogue.tolist() == [row for row, k in enumerate(counts) for _ in range(k)]


@pytest.fixture(scope="module")
def stage1(tmp_path_factory):
    """A token-trained run (best.pt) on 40 synthetic rows, and a second CSV."""
    folder = tmp_path_factory.mktemp("stage1")
    save_csv(folder / "train.csv", synthetic_rows(40, seed=3))
    save_csv(folder / "other.csv", synthetic_rows(40, seed=4))
    for name, seed in (("run", 1337), ("other-run", 7)):
        train.main([*STAGE1, f"--train_csv={folder / 'train.csv'}", f"--data_cache_dir={folder / 'cache'}",
                    f"--out_dir={folder / name}", f"--seed={seed}"])
    return folder


def stage2_args(stage1, out, *extra):
    return [*STAGE2, f"--train_csv={stage1 / 'train.csv'}", f"--data_cache_dir={stage1 / 'cache'}",
            f"--init_from={stage1 / 'run' / 'best.pt'}", f"--out_dir={out}", *extra]


@pytest.mark.slow
@pytest.mark.parametrize("mode", [[], ["--lora_rank=4", "--gradient_checkpointing=True"]], ids=["full", "lora"])
def test_stage2_trains_on_its_candidates_and_resumes_bit_exactly(stage1, tmp_path, mode):
    calibrate.main(stage2_args(stage1, tmp_path / "straight", "--max_iters=4", *mode))
    calibrate.main(stage2_args(stage1, tmp_path / "resumed", "--max_iters=2", *mode))
    calibrate.main(stage2_args(stage1, tmp_path / "resumed", "--max_iters=4", "--init_from=resume", *mode))
    straight = load_checkpoint(str(tmp_path / "straight" / "ckpt.pt"))
    resumed = load_checkpoint(str(tmp_path / "resumed" / "ckpt.pt"))
    assert straight["iter_num"] == resumed["iter_num"] == 4
    for name, tensor in straight["model"].items():
        assert torch.equal(tensor, resumed["model"][name]), name
    rows, again = metrics(tmp_path / "straight"), metrics(tmp_path / "resumed")
    assert [(r["loss"], r["rank_loss"]) for r in again] == [(r["loss"], r["rank_loss"]) for r in rows]
    assert any(r["rank_loss"] > 0 for r in rows)  # the ranking loss is there, and it is trained on
    candidates = ranking.load_candidates(str(tmp_path / "straight" / "candidates.pt"))
    assert candidates.done == len(candidates.tokens) == 38 and straight["candidates"] == candidates.key
    for row, qualities in zip(candidates.tokens, candidates.quality, strict=True):
        assert 1 <= len(row) <= 3 and len({tuple(c) for c in row}) == len(row) and all(0 <= q <= 1 for q in qualities)


@pytest.mark.slow
def test_a_stale_candidates_file_is_refused_in_one_line(stage1, tmp_path):
    made = tmp_path / "candidates.pt"
    calibrate.main(stage2_args(stage1, tmp_path / "first", "--max_iters=1", f"--candidates_file={made}"))
    before = made.read_bytes()
    other_weights = run([sys.executable, "calibrate.py", *stage2_args(stage1, tmp_path / "second", "--max_iters=1",
                                                            f"--candidates_file={made}"),
                         f"--init_from={stage1 / 'other-run' / 'best.pt'}"])
    other_rows = run([sys.executable, "calibrate.py", *stage2_args(stage1, tmp_path / "third", "--max_iters=1",
                                                         f"--candidates_file={made}"),
                      f"--train_csv={stage1 / 'other.csv'}"])
    for result, reason in ((other_weights, "another checkpoint's weights"), (other_rows, "other training rows")):
        assert result.returncode == 2, result.stderr[-2000:]
        lines = [line for line in result.stderr.strip().splitlines() if "%|" not in line]  # not progress bars
        assert len(lines) == 1 and lines[0].startswith("error: ") and reason in lines[0], result.stderr
        assert "delete it" in lines[0]
    assert made.read_bytes() == before  # refused, not replaced


@pytest.mark.slow
def test_resuming_stage2_without_its_candidates_file_is_one_line(stage1, tmp_path, capsys):
    calibrate.main(stage2_args(stage1, tmp_path, "--max_iters=2"))
    (tmp_path / "candidates.pt").unlink()
    capsys.readouterr()
    with pytest.raises(SystemExit) as exit:
        calibrate.main(stage2_args(stage1, tmp_path, "--max_iters=4", "--init_from=resume"))
    lines = capsys.readouterr().err.strip().splitlines()
    assert exit.value.code == 2 and len(lines) == 1 and "candidates.pt is missing" in lines[0], lines


@pytest.mark.slow
def test_interrupted_candidate_generation_resumes_where_it_stopped(stage1, tmp_path, monkeypatch):
    cfg = load_config(stage2_args(stage1, tmp_path))
    examples = data.load_datasets(cfg).train
    from summarizer.loading import build_model
    model, _ = build_model(cfg.init_from)
    key = ranking.candidates_key(model, examples, cfg)
    monkeypatch.setattr(ranking, "SAVE_EVERY", 8)
    with Runtime(cfg) as rt:
        whole = ranking.make_candidates(model, examples, cfg, rt, key, progress=False)
        (tmp_path / "candidates.pt").rename(tmp_path / "whole.pt")
        calls, generate = [], ranking.generate

        def crash_on_third_batch(*args, **kwargs):
            calls.append(1)
            if len(calls) == 3:
                raise KeyboardInterrupt
            return generate(*args, **kwargs)
        monkeypatch.setattr(ranking, "generate", crash_on_third_batch)
        with pytest.raises(KeyboardInterrupt):
            ranking.make_candidates(model, examples, cfg, rt, key, progress=False)
        saved = ranking.load_candidates(str(tmp_path / "candidates.pt"))
        assert 0 < saved.done < len(examples) and saved.done % 8 == 0
        monkeypatch.setattr(ranking, "generate", generate)
        calls.clear()
        finished = ranking.make_candidates(model, examples, cfg, rt, key, progress=False)
    assert finished == whole == ranking.load_candidates(str(tmp_path / "candidates.pt"))
    assert finished.done == len(examples)


@pytest.mark.slow
@pytest.mark.parametrize("backend", ["ddp", "fsdp"])
def test_two_ranks_generate_the_same_candidates_and_train_the_same_stage2(stage1, tmp_path, backend):
    args = stage2_args(stage1, tmp_path / "single", "--max_iters=2", "--dropout=0.0")
    calibrate.main(args)
    result = run(torchrun("--nproc_per_node=2", "--standalone", "calibrate.py",
                          *stage2_args(stage1, tmp_path / backend, "--max_iters=2", "--dropout=0.0"),
                          f"--backend={backend}"))
    assert result.returncode == 0, result.stderr[-3000:]
    single = ranking.load_candidates(str(tmp_path / "single" / "candidates.pt"))
    assert ranking.load_candidates(str(tmp_path / backend / "candidates.pt")) == single
    assert_same_losses(metrics(tmp_path / backend), metrics(tmp_path / "single"))
    for got, expected in zip(metrics(tmp_path / backend), metrics(tmp_path / "single"), strict=True):
        assert math.isclose(got["rank_loss"], expected["rank_loss"], rel_tol=1e-4, abs_tol=1e-7)
