"""micro_batch_size=auto (summarizer/memory.py): before step 1, the largest micro-batch, up to a rank's rows per
step, that the run's memory plan fits on its GPU; the run then trains as the same explicit micro-batch would. A batch
the processes cannot split stops the run before the model is built."""
import glob
import json
import os
import resource
import types
from pathlib import Path

import pytest
import torch

import data
import train
from command_line import UserError
from config import load_config
from conftest import REPO, metrics, tiny, tiny_gpt
from model import GPT, PRETRAINED, GPTConfig
from summarizer import lora, memory, preparation

PRESETS = sorted(glob.glob(os.path.join(REPO, "config", "kaggle_t4x2*.py")))
RANKS = 2  # Kaggle's two T4s


@pytest.mark.parametrize("gib", [15, 80])
@pytest.mark.parametrize("preset", PRESETS, ids=os.path.basename)
def test_the_choice_is_the_most_rows_that_fit_the_plan(preset, gib):
    """Each Kaggle preset on a T4's 15 GiB and on 80 GiB, with rows as long as block_size (the worst a micro-batch
    can be) and summaries of max_new_tokens: the chosen rows fit, one more does not (or the chosen are a rank's
    rows of a step)."""
    cfg = load_config([preset])
    assert cfg.micro_batch_size == "auto"  # the presets' default
    with torch.device("meta"):
        model = GPT(GPTConfig(**PRETRAINED[cfg.init_from]))
    if cfg.lora_rank:
        lora.add_adapters(model, **lora.settings(cfg))
    run = memory.Workload(model, cfg, "fsdp" if cfg.backend == "fsdp" else "ddp", RANKS, torch.float16,
                     longest_row=cfg.block_size, most_targets=cfg.max_new_tokens,
                     longest_prompt=cfg.block_size - cfg.max_new_tokens)
    rates = memory.ActivationRates.measure(model.config, lora.settings(cfg), torch.float16)
    budget = gib * 2**30 * memory.HEADROOM
    rows, chosen = memory.largest_micro_batch(run, budget, rates)
    assert chosen == memory.plan(run, rows, rates, budget) and chosen.peak <= budget
    assert rows == cfg.batch_size // RANKS or memory.plan(run, rows + 1, rates, budget).peak > budget


def test_a_batch_the_processes_cannot_split_stops_before_the_model_is_built(write_csv, tmp_path, monkeypatch):
    """Two processes, batch_size=15, micro_batch_size=auto: one line naming batch_size and the 2 processes, before
    the model is built (before: the plan chose 7, and only then was batch_size=15 refused for it)."""
    monkeypatch.setattr(preparation, "model_to_train", lambda *args: pytest.fail("the model was built"))
    cfg = load_config([*tiny(), f"--train_csv={write_csv('train.csv', 24)}", "--batch_size=15",
                       "--micro_batch_size=auto", f"--data_cache_dir={tmp_path / 'cache'}", f"--out_dir={tmp_path}"])
    two = types.SimpleNamespace(world_size=2, rank=0, is_main=True, barrier=data.no_op)
    with pytest.raises(UserError, match=r"^batch_size=15 does not split over the 2 processes "):
        preparation.prepare(cfg, two)


def test_ddp_holds_one_copy_of_the_gradients_its_buckets():
    """DDP is built with gradient_as_bucket_view=True (summarizer/backends.py): its buckets are the gradients."""
    model = tiny_gpt()
    assert memory.parameter_bytes(model, "ddp", RANKS) == memory.parameter_bytes(model, "none", 1)
    assert memory.parameter_bytes(model, "accelerate", RANKS)[1] == memory.nbytes(model.parameters())


def test_activations_grow_with_rows_and_checkpointing_keeps_less():
    """gpt2 under fp16 autocast: each row adds the same bytes (scaled_dot_product_attention keeps O(T) state), the
    16-bit weight copies autocast keeps do not grow with rows, and a checkpointed model keeps far less."""
    config = GPTConfig(**PRETRAINED["gpt2"])
    rates = memory.ActivationRates.measure(config, lora.settings(load_config([])), torch.float16)
    full = [rates.bytes(rows, 512, rows * 60, config.n_layer, checkpointing=False) for rows in (1, 2, 4)]
    assert full[0] < full[1] < full[2] and full[2] - full[1] == pytest.approx(2 * (full[1] - full[0]))
    assert rates.rest_fixed == pytest.approx(config.vocab_size * config.n_embd * 2, rel=0.05)  # wte's fp16 copy
    assert rates.bytes(4, 512, 240, config.n_layer, checkpointing=True) < full[2] / 3


def test_auto_trains_as_the_same_explicit_micro_batch(write_csv, tmp_path, monkeypatch, capsys):
    """A device whose memory fits micro-batches of 2 rows and not 3 (batch 4): the run chooses 2, says so and
    trains with the losses of --micro_batch_size=2."""
    chosen = memory.largest_micro_batch

    def two_fit(run, budget, rates):
        between = (memory.plan(run, 2, rates, budget).peak + memory.plan(run, 3, rates, budget).peak) / 2
        return chosen(run, between, rates)
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
    use, bounds the host's memory, and a CPU plan fills at most CPU_SHARE of it."""
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
    assert memory.device_memory(torch.device("cpu")) <= memory.CPU_SHARE * (2**30 + 2**20)
