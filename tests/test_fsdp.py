"""FSDP (backend=fsdp under torchrun, 2 gloo ranks on CPU): exact resume, a best.pt that one process scores the
same, LoRA on FSDP, gradient accumulation with one gradient reduction per optimizer step (losses and counted
communication), and an fp16 overflow in one rank's shard skipping the step on every rank."""
import json
import os
import subprocess

import pytest
import torch

import evaluate
import train
from bench import fsdp as bench_fsdp
from conftest import HANG, REPO, assert_export_matches, tiny, torchrun
from model import GPT, PRETRAINED, GPTConfig
from summarizer.checkpoint import load_checkpoint
from summarizer.memory import reduce_once_bytes

RUN = [*tiny(n_layer=2), "--log_interval=1", "--warmup_iters=2", "--learning_rate=3e-3", "--batch_size=16",
       "--micro_batch_size=4", "--eval_interval=3", "--lr_decay_iters=6", "--dropout=0.1",
       "--gradient_checkpointing=True", "--sample_submission_csv="]


def run(cmd):
    env = {k: v for k, v in os.environ.items() if not k.startswith("ACCELERATE_")}
    result = subprocess.run(cmd, cwd=REPO, env=dict(env, OMP_NUM_THREADS="1", PYTHONPATH=REPO),
                            capture_output=True, text=True, timeout=HANG)
    assert result.returncode == 0, result.stderr[-3000:]
    return result


def fsdp(args):
    return run(torchrun("--nproc_per_node=2", "--standalone", "train.py", *args, "--backend=fsdp"))


def losses(out_dir):
    with open(out_dir / "metrics.jsonl") as f:
        return [json.loads(line)["loss"] for line in f]


@pytest.fixture
def args(write_csv, tmp_path):
    # 80 rows: 4 held out for validation, all of them summarized for ROUGE while training
    return [*RUN, f"--train_csv={write_csv('train.csv', 80)}", f"--data_cache_dir={tmp_path / 'cache'}",
            "--rouge_samples=4", "--best_metric=val_loss"]


@pytest.mark.slow
def test_fsdp_resume_is_bit_identical_and_best_pt_scores_the_same_on_one_process(args, tmp_path):
    straight, resumed = tmp_path / "straight", tmp_path / "resumed"
    fsdp([*args, "--max_iters=6", f"--out_dir={straight}"])
    fsdp([*args, "--max_iters=3", f"--out_dir={resumed}"])
    fsdp([*args, "--max_iters=6", f"--out_dir={resumed}", "--init_from=resume"])
    a, b = load_checkpoint(str(straight / "ckpt.pt")), load_checkpoint(str(resumed / "ckpt.pt"))
    assert a["iter_num"] == b["iter_num"] == 6
    for name, tensor in a["model"].items():
        assert type(tensor) is torch.Tensor and torch.equal(tensor, b["model"][name]), name
    for name, state in a["optimizer"]["state"].items():
        assert all(torch.equal(value, b["optimizer"]["state"][name][key]) for key, value in state.items()), name
    assert losses(resumed) == losses(straight)
    # best.pt: one file, plain tensors, that evaluate.py scores on one process as the FSDP run did
    best = load_checkpoint(str(straight / "best.pt"))
    assert set(best["model"]) == set(GPT(GPTConfig(**best["model_args"])).state_dict())
    evaluate.main([*args, f"--out_dir={straight}"])
    with open(straight / "eval_metrics.json") as f:
        report = json.load(f)
    assert report["n"] == 4
    for key in ("rouge1", "rouge2", "rougeL"):
        assert report[key]["mean"] == pytest.approx(best["metrics"][key], abs=1e-9), key
    assert_export_matches(straight / "best.pt", tmp_path / "exported")


@pytest.mark.slow
def test_lora_on_fsdp_trains_like_lora_on_one_process(args, tmp_path):
    lora_args = [*args, "--lora_rank=4", "--max_iters=3", "--eval_interval=3", "--dropout=0.0", "--lora_dropout=0.0"]
    fsdp([*lora_args, f"--out_dir={tmp_path / 'fsdp'}"])
    train.main([*lora_args, f"--out_dir={tmp_path / 'single'}"])
    assert losses(tmp_path / "fsdp") == pytest.approx(losses(tmp_path / "single"), rel=1e-4)
    fsdp_best, single_best = (load_checkpoint(str(tmp_path / d / "best.pt"))["model"] for d in ("fsdp", "single"))
    for name, tensor in single_best.items():
        assert torch.allclose(fsdp_best[name], tensor, atol=1e-6), name


@pytest.mark.slow
def test_fsdp_fp16_accumulation_reducing_once_trains_like_one_process(args, tmp_path):
    """fp16 under FSDP: weights all-gathered in fp16, 4 micro-steps per rank whose gradients accumulate unsharded
    and are reduce-scattered in fp32 once per step (fsdp_reduce_once='auto' on the CPU), GradScaler: the losses of
    one process accumulating 8 micro-steps."""
    fp16_args = [*args, "--dtype=float16", "--micro_batch_size=2", "--max_iters=3", "--dropout=0.0",
                 "--rouge_samples=0"]
    fsdp([*fp16_args, f"--out_dir={tmp_path / 'fsdp'}"])
    train.main([*fp16_args, f"--out_dir={tmp_path / 'single'}"])
    assert losses(tmp_path / "fsdp") == pytest.approx(losses(tmp_path / "single"), rel=1e-4)


@pytest.mark.slow
def test_fsdp_communicates_once_per_optimizer_step(write_csv, tmp_path):
    """The collectives of one fp16 optimizer step of 4 micro-steps per rank, counted (bench_fsdp): each FSDP unit
    is all-gathered once in fp16 and reduce-scattered once in fp32, within a bound from the model's parameters;
    FSDP as it was moves an fp32 all-gather and a reduce-scatter of every unit in each micro-step, and more."""
    steps, world = 4, bench_fsdp.RANKS
    run = [*bench_fsdp.TINY, f"--batch_size={steps * world}", "--dtype=float16", "--gradient_checkpointing=True",
           f"--train_csv={write_csv('train.csv', 40)}", f"--data_cache_dir={tmp_path / 'cache'}"]
    now, before = bench_fsdp.run_ranks([{"args": [*run, f"--out_dir={tmp_path / 'now'}"], "before": False},
                                        {"args": [*run, f"--out_dir={tmp_path / 'before'}"], "before": True}],
                                       str(tmp_path))
    assert now["reduce_once"] and not before["reduce_once"]
    fp16, fp32 = 2, 4
    assert bench_fsdp.per_unit(now)[0] == {(unit, kind): (1, size) for unit in ("root", "block")
                                           for kind, size in (("all_gather", fp16), ("reduce_scatter", fp32))}
    assert bench_fsdp.per_unit(before)[0] == {
        ("root", "all_gather"): (steps, fp32), ("block", "all_gather"): (2 * steps, fp32),
        ("root", "reduce_scatter"): (steps, fp32), ("block", "reduce_scatter"): (steps, fp32)}

    def per_rank(counted):
        return sum(op["numel"] * op["itemsize"] * bench_fsdp.RING[op["kind"]] for op in counted["ops"])
    params = list(GPT(GPTConfig(n_layer=2, n_head=2, n_embd=32, block_size=64)).parameters())
    numel = sum(p.numel() for p in params)
    padding = sum((world - 1) * p.numel() // p.shape[0] for p in params)  # dim 0 up to a multiple of world
    scalars = 1024  # loss, gradient norm, found-inf
    assert per_rank(now) <= (world - 1) / world * (numel + padding) * (fp16 + fp32) + scalars
    assert per_rank(before) >= steps * (world - 1) / world * numel * (fp32 + fp32)


def test_reduce_once_memory_on_t4s():
    """What fsdp_reduce_once holds per GPU on 2 ranks beside FSDP's shards and AdamW state: gpt2-large's fp16
    weights and fp32 gradients fit a T4 (15 GiB), gpt2-xl's do not (its preset trains LoRA adapters)."""
    for name, fits in (("gpt2-large", True), ("gpt2-xl", False)):
        with torch.device("meta"):
            model = GPT(GPTConfig(**PRETRAINED[name]))
        numel = sum(p.numel() for p in model.parameters())
        held, kept = reduce_once_bytes(model, 2, torch.float16)
        assert (held, kept) == (numel * (2 + 4), numel * 4 * 4 / 2)
        assert (held + kept <= 15 * 2**30) == fits, name


@pytest.mark.slow
def test_fp16_overflow_in_one_ranks_shard_skips_the_step_on_every_rank(args, tmp_path):
    """fp16 with GradScaler under FSDP: an inf in rank 1's gradient shard alone (rank 0's are finite) skips the
    update on both ranks and halves the scale, as one process would."""
    out = tmp_path / "out"
    run(torchrun("--nproc_per_node=2", "--standalone", "tests/overflow_rank.py", *args, "--backend=fsdp",
                 "--dtype=float16", "--max_iters=2", "--eval_interval=2", f"--out_dir={out}"))
    with open(out / "metrics.jsonl") as f:
        rows = [json.loads(line) for line in f]  # written by rank 0
    assert [r["skipped_steps"] for r in rows] == [1, 1]
    assert rows[1]["loss_scale"] == rows[0]["loss_scale"] == 2.0**15
