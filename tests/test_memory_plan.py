"""The T4 ledger and micro_batch_size=auto (summarizer/memory.py): before step 1, the largest micro-batch, up to a
rank's rows per step, whose ledger (every phase of the run, counted on fake tensors) fits its GPU; the run then trains
as the same explicit micro-batch would. A batch the processes cannot split stops the run before the model is built."""
import glob
import json
import os
import resource
import sys
from collections import deque
from dataclasses import replace
from pathlib import Path
from types import SimpleNamespace

import numpy as np
import pytest
import torch

import data
import train
from command_line import UserError
from config import load_config
from conftest import REPO, metrics, run, tiny, tiny_gpt
from model import GPT, GPTConfig, Targets
from summarizer import loading, memory, preparation

PRESETS = sorted(glob.glob(os.path.join(REPO, "config", "kaggle_t4x2*.py")))
RANKS = 2  # Kaggle's two T4s


SMALL = dict(n_layer=2, n_head=4, n_embd=128, block_size=256)  # GPT-2's structure and vocabulary, small


def small_run(preset, **changes):
    """(the Workload of Kaggle preset `preset`'s settings on RANKS ranks in fp16 at the SMALL shape, its config)."""
    cfg = load_config([preset, *(f"--{k}={v}" for k, v in changes.items())])
    model = GPT(GPTConfig(**SMALL))
    model.gradient_checkpointing = cfg.gradient_checkpointing
    if cfg.lora_rank:
        loading.add_adapters(model, **loading.lora_settings(cfg))
    fsdp = cfg.backend == "fsdp"
    return memory.Workload(model, cfg, "fsdp" if fsdp else "ddp", RANKS, torch.float16, longest_row=256,
                           most_targets=60, longest_prompt=190, reduce_once=fsdp), cfg


@pytest.mark.parametrize("preset", PRESETS, ids=os.path.basename)
def test_the_choice_is_the_most_rows_that_fit_the_ledger(preset):
    """Each Kaggle preset's settings on a budget that fits 4 rows and not 5: the chosen rows fit every phase, one
    more does not."""
    run, cfg = small_run(preset, batch_size=32)
    budget = (memory.ledger(run, 4, 2**40).peak + memory.ledger(run, 5, 2**40).peak) / 2
    rows, chosen = memory.largest_micro_batch(run, budget)
    assert rows == 4 and chosen.peak <= budget < memory.ledger(run, 5, budget).peak
    assert set(chosen.phases) == {"train", "validation", "rouge_build", "rouge_decode", "save", "after"}


def test_a_batch_the_processes_cannot_split_stops_before_the_model_is_built(write_csv, tmp_path, monkeypatch):
    """Two processes, batch_size=15, micro_batch_size=auto: one line naming batch_size and the 2 processes, before
    the model is built (before: the plan chose 7, and only then was batch_size=15 refused for it)."""
    monkeypatch.setattr(preparation, "model_to_train", lambda *args: pytest.fail("the model was built"))
    cfg = load_config([*tiny(), f"--train_csv={write_csv('train.csv', 24)}", "--batch_size=15",
                       "--micro_batch_size=auto", f"--data_cache_dir={tmp_path / 'cache'}", f"--out_dir={tmp_path}"])
    two = SimpleNamespace(world_size=2, rank=0, is_main=True, barrier=data.no_op)
    with pytest.raises(UserError, match=r"^batch_size=15 does not split over the 2 processes "):
        preparation.prepare(cfg, two)


def test_ddp_holds_one_copy_of_the_gradients_its_buckets():
    """DDP is built with gradient_as_bucket_view=True (summarizer/backends.py): its buckets are the gradients."""
    model = tiny_gpt()
    assert memory.parameter_bytes(model, "ddp", RANKS) == memory.parameter_bytes(model, "none", 1)
    assert memory.parameter_bytes(model, "accelerate", RANKS)[1] == memory.nbytes(model.parameters())


@pytest.mark.slow  # a real bf16 step of a GPT-2-sized model: half a minute
@pytest.mark.parametrize("lora_rank", [0, 8])
def test_the_ledger_agrees_with_torchs_memory_tracker_on_real_tensors(lora_rank):
    """The ledger counts fake tensors; torch's MemTracker counts a real step of the same model on the CPU (its
    weights, AdamW's moments, and a bf16-autocast forward and backward, flash attention's O(T) state): within 10%,
    as validation's forward and a LoRA run's merged weights for best.pt (the save)."""
    from torch.distributed._tools.mem_tracker import MemTracker
    torch.manual_seed(0)
    run, cfg = small_run(PRESETS[0], lora_rank=lora_rank, gradient_checkpointing=lora_rank > 0, micro_batch_size=4,
                         batch_size=8)
    run = replace(run, backend="none", world_size=1, dtype=torch.bfloat16)
    model = run.model
    optimizer = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad])
    x = torch.randint(0, 50000, (4, 256))
    y = x.clone()
    y[:, :-60] = -1

    def peak(fn):
        tracker = MemTracker()
        tracker.track_external(model, optimizer)
        with tracker:
            fn()
        return tracker.get_tracker_snapshot("peak")[torch.device("cpu")]["Total"]

    def step():
        with torch.autocast("cpu", dtype=torch.bfloat16):
            model(x, Targets.of(y))[1].backward()
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
    if lora_rank:  # MemTracker's module hooks cannot take frozen weights: the merge for best.pt, no module run
        merged = loading.merged_weights(model.state_dict(), **loading.lora_settings(cfg))
        measured = {"save": peak(lambda: deque(merged, 0))}
    else:
        step()  # AdamW's moments exist from the first step on
        measured = {"train": peak(step)}
        model.eval()
        with torch.no_grad(), torch.autocast("cpu", dtype=torch.bfloat16):
            measured["validation"] = peak(lambda: model(x, Targets.of(y)))
    counted = memory.ledger(run, 4, 2**40).phases
    for phase, size in measured.items():
        assert counted[phase] == pytest.approx(size, rel=0.1), (phase, counted[phase] / 2**20, size / 2**20)


class OneRow(SimpleNamespace):
    def __len__(self):
        return 1


def test_reduce_once_is_decided_before_the_micro_batch_and_counted_in_it(monkeypatch, capsys):
    """fsdp_reduce_once=auto: on where the ledger of one row with it (every weight gathered, the fp32 gradients
    unsharded) fits, off where it does not (one line says so), decided before the micro-batch plan, which counts
    what it holds."""
    run, cfg = small_run(PRESETS[0], backend="fsdp", batch_size=32)
    off, on = (memory.ledger(replace(run, reduce_once=once), 1, 2**40) for once in (False, True))
    assert on.phases["train"] != off.phases["train"] and on.peak == on.phases["train"]
    train_set = SimpleNamespace(lengths=np.array([256]), target_counts=lambda _: np.array([60]))
    for budget, decided in ((on.peak + 2**20, True), (on.peak - 2**20, False)):
        # a T4 rank: the model is on the CPU until the run moves it, so `budget` is all the GPU leaves
        proc = SimpleNamespace(backend="fsdp", world_size=RANKS, dtype="float16", device=torch.device("cuda"),
                             is_main=True, all_gather_objects=lambda mine: [mine] * RANKS,
                             parallel=SimpleNamespace(reduce_once="auto"))
        monkeypatch.setattr(memory, "device_memory", lambda device, budget=budget: int(budget))
        planned, _ = memory.workload(cfg, proc, run.model, train_set, OneRow(prompt_lens=np.array([190])))
        assert planned.reduce_once is decided and proc.parallel.reduce_once is decided
        assert ("reducing once per optimizer step would need" in capsys.readouterr().out) is not decided


def test_auto_trains_as_the_same_explicit_micro_batch(write_csv, tmp_path, monkeypatch, capsys):
    """A device whose memory fits micro-batches of 2 rows and not 3 (batch 4): the run chooses 2, says so and
    trains with the losses of --micro_batch_size=2."""
    chosen = memory.largest_micro_batch

    def two_fit(run, budget):
        between = (memory.ledger(run, 2, budget).peak + memory.ledger(run, 3, budget).peak) / 2
        return chosen(run, between)
    monkeypatch.setattr(memory, "largest_micro_batch", two_fit)
    args = [*tiny(), f"--train_csv={write_csv('train.csv', 24)}", "--val_fraction=0.25", "--batch_size=4",
            "--max_iters=3", "--eval_interval=3", "--rouge_samples=0", "--best_metric=val_loss", "--log_interval=1",
            "--eval_val_batches=1", f"--data_cache_dir={tmp_path / 'cache'}"]
    train.main([*args, "--micro_batch_size=auto", f"--out_dir={tmp_path / 'auto'}"])
    assert "micro_batch_size=auto: 2 (the plan's peak" in capsys.readouterr().out
    assert json.loads((tmp_path / "auto" / "config.json").read_text())["micro_batch_size"] == 2
    train.main([*args, "--micro_batch_size=2", f"--out_dir={tmp_path / 'explicit'}"])
    losses = [[row["loss"] for row in metrics(tmp_path / name) if "loss" in row] for name in ("auto", "explicit")]
    assert len(losses[0]) == 3 and losses[0] == losses[1]


@pytest.mark.parametrize("limit", ["ulimit -v", "cgroup v2", "cgroup v1"])
def test_a_cpu_plan_fills_at_most_what_the_process_limits_leave(limit, tmp_path, monkeypatch):
    """The host's free memory is not all a process may take: RLIMIT_AS (`ulimit -v`) bounds its address space, and
    a container's cgroup (Kaggle's RAM) bounds what its processes use. Each limit, injected 1 GiB above what is in
    use, bounds the host's memory: a CPU plan fills at most CPU_SHARE of a cgroup's (shared), HEADROOM of an
    address space's (the process's own)."""
    page, real = os.sysconf("SC_PAGE_SIZE"), resource.getrlimit
    in_use = int(Path("/proc/self/statm").read_text().split()[0]) * page
    cgroup = [tmp_path / name for name in ("max", "current", "v1_limit", "v1_usage")]
    for path, content in zip(cgroup, ["max\n", "0\n", f"{2**63 - 4096}\n", "0\n"], strict=True):  # no limits
        path.write_text(content)
    if limit == "ulimit -v":
        monkeypatch.setattr(resource, "getrlimit", lambda which: (in_use + 2**30, resource.RLIM_INFINITY)
                            if which == resource.RLIMIT_AS else real(which))
    else:
        used = cgroup[1 if limit == "cgroup v2" else 3]
        used.write_text(f"{5 * 2**30}\n")
        cgroup[0 if limit == "cgroup v2" else 2].write_text(f"{6 * 2**30}\n")
    monkeypatch.setattr(memory, "CGROUP_FILES", ((cgroup[0], cgroup[1]), (cgroup[2], cgroup[3])))
    assert 0 < memory.host_memory() <= 2**30 + 2**20  # the address space in use may have shrunk a little
    share = memory.HEADROOM if limit == "ulimit -v" else memory.CPU_SHARE
    assert memory.device_memory(torch.device("cpu")) <= share * (2**30 + 2**20)


# train.py whose `ulimit -v` (RLIMIT_AS, set as the plan starts) leaves argv[1] x the ledger's peak of one row
UNDER_ULIMIT = """
import os, resource, sys
import train
from summarizer import memory, preparation

def under_ulimit(*args):
    run, budget = memory.workload(*args)
    in_use = int(open("/proc/self/statm").read().split()[0]) * os.sysconf("SC_PAGE_SIZE")
    left = int(float(sys.argv[1]) * memory.ledger(run, 1, budget).peak)
    resource.setrlimit(resource.RLIMIT_AS, (in_use + left, resource.getrlimit(resource.RLIMIT_AS)[1]))
    return memory.workload(*args)
preparation.workload = under_ulimit
train.main(sys.argv[2:])
"""


@pytest.mark.slow
@pytest.mark.parametrize("share, trains", [(1.5, True), (0.3, False)])
def test_under_ulimit_v_the_plan_warns_only_where_the_run_does_not_fit(share, trains, tmp_path):
    """`ulimit -v` bounds this process's own address space: the plan takes what it leaves, not a share (CPU_SHARE
    is of what the host has available, which others use too), and counts the weights the process holds already.
    Leaving 1.5x the ledger's peak of one row, the run trains with no warning (it said "even one row does not fit
    the plan" and trained); leaving 0.3x, it stops at one row in one line."""
    done = run([sys.executable, "-c", UNDER_ULIMIT, str(share), *tiny(n_layer=2, n_head=4, n_embd=768),
                "--train_csv=data/demo/train.csv", "--validation_csv=data/demo/validation.csv", "--test_csv=",
                "--batch_size=2", "--micro_batch_size=auto", "--max_iters=1", "--eval_interval=1",
                "--eval_val_batches=1", "--rouge_samples=0", "--best_metric=val_loss", "--evaluate_after=False",
                "--predict_after=False", f"--out_dir={tmp_path / 'out'}", f"--data_cache_dir={tmp_path / 'cache'}"])
    assert "does not fit" not in done.stdout + done.stderr
    assert (tmp_path / "out" / "ckpt.pt").exists() is trains, done.stdout + done.stderr
    if not trains:
        assert done.stderr.strip().splitlines()[-1].startswith(
            "error: out of memory while training on micro-batches of 1 sequence"), done.stderr
