"""What a Kaggle session allows a run: out_dir's disk planned before the first step and checked before each save,
torch's writer failing on a full disk, max_time with resume_from continuing a run in another folder, and
generation batches sized by a KV-cache budget."""
import contextlib
import dataclasses
import errno
import os
import random
import re
import resource
import shutil
import signal
import subprocess
import sys

import pytest
import torch

import train
from command_line import UserError, disk_full
from config import Decoding, load_config, parse_duration, part
from conftest import REPO, TINY, metrics, one_error_line
from model import GPT
from summarizer import inference, loading, memory, run_folder
from summarizer.checkpoint import load_checkpoint, save_checkpoint
from summarizer.state import TrainingState


@contextlib.contextmanager
def small_filesystem(folder, megabytes, monkeypatch):
    """`folder` on a filesystem with `megabytes` of room: a size-limited tmpfs when this runs as root, else
    run_folder.free_bytes reporting that room less what the folder holds."""
    folder.mkdir()
    mounted = os.geteuid() == 0 and subprocess.run(
        ["mount", "-t", "tmpfs", "-o", f"size={megabytes}m", "tmpfs", str(folder)], capture_output=True).returncode == 0
    if not mounted:
        monkeypatch.setattr(run_folder, "free_bytes",
                            lambda path: megabytes * 2**20 - run_folder.file_bytes(str(folder)))
    try:
        yield folder
    finally:
        if mounted:
            subprocess.run(["umount", "-l", str(folder)], check=True)


def fill(folder, leave_bytes):
    """Write a file into `folder` that leaves about `leave_bytes` free on its filesystem."""
    with open(folder / "filler.bin", "wb") as f:
        f.write(b"\0" * max(0, run_folder.free_bytes(str(folder)) - leave_bytes))


@pytest.fixture
def args(write_csv, tmp_path):
    return [*TINY, f"--train_csv={write_csv('train.csv', 40)}", f"--data_cache_dir={tmp_path / 'cache'}",
            "--batch_size=8", "--micro_batch_size=4", "--rouge_samples=0", "--best_metric=val_loss",
            "--sample_submission_csv=", "--log_interval=1"]


def error_lines(capsys):
    """stderr's lines but progress bars."""
    return [line for line in capsys.readouterr().err.splitlines() if line.strip() and "%|" not in line]


def test_out_dir_too_small_for_the_run_is_one_line_before_the_first_step(args, tmp_path, monkeypatch, capsys):
    # the TINY model's checkpoints: ckpt.pt ~20 MB (weights and AdamW moments), best.pt ~7 MB, at their peak ~48 MB
    with small_filesystem(tmp_path / "small", 30, monkeypatch) as small:
        with pytest.raises(SystemExit) as stopped:
            train.main([*args, f"--out_dir={small / 'out'}", "--max_iters=4", "--eval_interval=2"])
        assert stopped.value.code == 2
        lines = error_lines(capsys)
        assert len(lines) == 1 and lines[0].startswith(f"error: out_dir {small / 'out'} needs"), lines
        assert "free" in lines[0] and "--out_dir=/kaggle/temp/out" in lines[0] and "--lora_rank" in lines[0]
        assert not (small / "out" / "metrics.jsonl").exists() and not (small / "out" / "ckpt.pt").exists()


def test_the_plan_names_earlier_runs_and_counts_the_checkpoints_it_replaces(args, tmp_path, monkeypatch, capsys):
    with small_filesystem(tmp_path / "small", 80, monkeypatch) as small:
        out = small / "out"
        train.main([*args, f"--out_dir={out}", "--max_iters=2", "--eval_interval=2"])
        model, _ = loading.model_to_train(load_config([*args, f"--out_dir={out}"]))
        plan = run_folder.DiskPlan(model, load_config(args))
        on_disk = os.path.getsize(out / "ckpt.pt") + os.path.getsize(out / "best.pt")
        assert on_disk <= plan.ckpt + plan.best <= on_disk + 2 * 2**20 + 2 * run_folder.ZIP_BYTES_FIXED
        # resuming replaces ckpt.pt and best.pt: their bytes count as room
        fill(small, plan.peak - on_disk + 2**20)
        train.main([*args, f"--out_dir={out}", "--max_iters=4", "--eval_interval=2", "--init_from=resume"])
        assert load_checkpoint(str(out / "ckpt.pt"))["iter_num"] == 4
        # a fresh run keeps the earlier one in previous-run-*: too little room, and the line names it
        with pytest.raises(SystemExit):
            train.main([*args, f"--out_dir={out}", "--max_iters=2", "--eval_interval=2"])
        lines = error_lines(capsys)
        assert len(lines) == 1 and "delete earlier runs kept there: " in lines[0] and "previous-run-" in lines[0]


def test_a_save_that_meets_a_full_disk_keeps_the_previous_checkpoints(args, tmp_path, monkeypatch, capsys):
    with small_filesystem(tmp_path / "small", 80, monkeypatch) as small:
        out = small / "out"
        save = TrainingState.save

        def save_then_fill(state, cfg, proc, metrics, best):
            save(state, cfg, proc, metrics, best)
            if state.step == 2:
                fill(small, 2**20)
        monkeypatch.setattr(TrainingState, "save", save_then_fill)
        with pytest.raises(SystemExit) as stopped:
            train.main([*args, f"--out_dir={out}", "--max_iters=6", "--eval_interval=2"])
        assert stopped.value.code == 2
        lines = error_lines(capsys)
        assert len(lines) == 1 and f"{out / 'ckpt.pt'}" in lines[0] and "iter 4" in lines[0], lines
        assert load_checkpoint(str(out / "ckpt.pt"))["iter_num"] == 2
        assert load_checkpoint(str(out / "best.pt"))["iter_num"] == 2
        assert sorted(os.listdir(out)) == sorted(["ckpt.pt", "best.pt", "config.json", "metrics.jsonl", "metrics.png"])


def test_a_disk_that_fills_mid_run_ends_in_one_line_and_leaves_ckpt_pt_loadable(args, tmp_path, monkeypatch, capsys):
    """Another process fills the disk after the first checkpoint: the plot that follows is skipped with a warning,
    the next write of metrics.jsonl ends the run."""
    with small_filesystem(tmp_path / "small", 80, monkeypatch) as small:
        if not os.path.ismount(small):
            pytest.skip("needs a size-limited tmpfs, which only root can mount")
        out, save = small / "out", TrainingState.save

        def save_then_fill(state, cfg, proc, metrics, best):
            save(state, cfg, proc, metrics, best)
            fill(small, 0)
        monkeypatch.setattr(TrainingState, "save", save_then_fill)
        with pytest.raises(SystemExit) as stopped:
            train.main([*args, f"--out_dir={out}", "--max_iters=60", "--eval_interval=30"])
        assert stopped.value.code == 2
        lines = error_lines(capsys)
        assert len(lines) == 2 and "Traceback" not in "".join(lines), lines
        assert lines[0].startswith(f"warning: cannot write {out / 'metrics.png'}: No space left on device (")
        assert lines[1].startswith(f"error: cannot write {out / 'metrics.jsonl'}: No space left on device ("), lines
        assert lines[1].endswith(f"intact: {out / 'best.pt'} (iter 30), {out / 'ckpt.pt'} (iter 30): free some space "
                                 f"and continue (--init_from=resume), or continue in a larger folder (--resume_from="
                                 f"<the ckpt.pt> --out_dir=...)"), lines
        assert load_checkpoint(str(out / "ckpt.pt"))["iter_num"] == 30


def test_a_full_disk_skips_the_plot_with_a_warning_and_the_run_goes_on(args, tmp_path, monkeypatch, capsys):
    def full_disk(jsonl_path, png_path, title=""):
        raise disk_full(png_path, OSError(errno.ENOSPC, os.strerror(errno.ENOSPC)))
    monkeypatch.setattr(train, "plot_metrics", full_disk)
    train.main([*args, f"--out_dir={tmp_path / 'out'}", "--max_iters=2", "--eval_interval=2"])
    warnings = [line for line in error_lines(capsys) if line.startswith("warning: ")]
    # the free space is the disk's at the moment it is read: other processes change it
    assert [re.sub(r"\(\d+ MB free", "(N MB free", line) for line in warnings] == [
        f"warning: cannot write {tmp_path / 'out' / 'metrics.png'}: No space left on device (N MB free in "
        f"{tmp_path / 'out'}): metrics.png is not updated; training goes on"]
    assert load_checkpoint(str(tmp_path / "out" / "ckpt.pt"))["iter_num"] == 2


def test_torch_writer_failing_mid_file_is_one_line_and_keeps_the_old_file(tmp_path):
    """A file size limit makes torch's zip writer fail part-way, as a full disk does ('unexpected pos',
    'file write failed'): the old checkpoint stays, and the error is one line."""
    path = str(tmp_path / "ckpt.pt")
    save_checkpoint({"model": {"w": torch.ones(10)}, "iter_num": 1}, path)
    limits, handler = resource.getrlimit(resource.RLIMIT_FSIZE), signal.signal(signal.SIGXFSZ, signal.SIG_IGN)
    resource.setrlimit(resource.RLIMIT_FSIZE, (2**20, limits[1]))
    try:
        with pytest.raises(UserError) as error:
            save_checkpoint({"model": {"w": torch.ones(2**20)}, "iter_num": 2}, path)
    finally:
        resource.setrlimit(resource.RLIMIT_FSIZE, limits)
        signal.signal(signal.SIGXFSZ, handler)
    message = str(error.value)
    assert message.startswith(f"cannot write {path}: torch's writer stopped part-way (is the disk full? ")
    assert message.endswith(f"; {path} still holds the previous checkpoint")
    assert "\n" not in message
    assert torch.equal(torch.load(path, weights_only=True)["model"]["w"], torch.ones(10))
    assert os.listdir(tmp_path) == ["ckpt.pt"]


@pytest.mark.parametrize("text, seconds", [("41400", 41400), ("11h30m", 41400), ("45m", 2700), ("1.5h", 5400),
                                           ("90s", 90), ("1h2m3s", 3723), ("", None)])
def test_max_time_reads_seconds_and_durations(text, seconds):
    assert parse_duration(text) == seconds
    assert load_config([f"--max_time={text}"]).max_time == seconds


@pytest.mark.parametrize("text", ["soon", "0", "1d", "-5", "h"])
def test_a_bad_max_time_is_one_line(text):
    with pytest.raises(UserError, match="max_time="):
        load_config([f"--max_time={text}"])


@pytest.mark.slow
def test_a_process_knows_its_age():
    """What max_time counts from on the command line: the process's start, imports included."""
    code = "import time; time.sleep(1.5); from summarizer.launch import process_age; print(process_age())"
    result = subprocess.run([sys.executable, "-c", code], cwd=REPO, capture_output=True, text=True, check=True)
    assert 1.5 <= float(result.stdout) < 20


@pytest.mark.slow
def test_max_time_stops_in_time_and_another_folder_continues_exactly(args, tmp_path, capsys):
    """A run that cannot finish in max_time ends by itself (exit 0) with ckpt.pt at its last step and the command
    that continues it; a run planned over two sessions (no cooldown in the first), continued from a copy of that
    ckpt.pt in another folder (resume_from), logs the same losses as one uninterrupted run."""
    run = [*args, "--max_iters=300", "--eval_interval=1000", "--dropout=0.1"]
    train.main([*run, f"--out_dir={tmp_path / 'first'}", "--max_time=2", "--sessions=2"])
    out = capsys.readouterr().out
    first = metrics(tmp_path / "first")
    stopped_at = first[-1]["iter"]
    assert 1 <= stopped_at < 300 and "val_loss" in first[-1]
    assert load_checkpoint(str(tmp_path / "first" / "ckpt.pt"))["iter_num"] == stopped_at
    assert f"max_time=2: stopped after iter {stopped_at} of 300" in out
    assert f"--resume_from=<the attached copy of {tmp_path / 'first' / 'ckpt.pt'}>" in out
    attached = tmp_path / "input"
    attached.mkdir()
    shutil.copy(tmp_path / "first" / "ckpt.pt", attached / "ckpt.pt")
    shutil.rmtree(tmp_path / "first")
    train.main([*run, f"--out_dir={tmp_path / 'second'}", f"--resume_from={attached / 'ckpt.pt'}"])
    train.main([*run, f"--out_dir={tmp_path / 'whole'}"])
    continued = [row["loss"] for row in first + metrics(tmp_path / "second")]
    assert continued == [row["loss"] for row in metrics(tmp_path / "whole")]


@pytest.mark.slow
@pytest.mark.parametrize("options", [[], ["--num_beams=3"],
                                     ["--temperature=0.9", "--top_k=20", "--seed=3", "--mbr_samples=6"],
                                     ["--temperature=0.9", "--seed=4", "--mbr_samples=4", "--mbr_include_beam=False"]])
def test_a_generation_budget_that_splits_batches_changes_no_summary(tiny_hf_dir, options):
    """gen_memory_gb small enough for a few prompts per generate() call: the same summaries as one batch of 24
    (greedy, beam search, MBR with a seed: each prompt samples from its own seeded stream)."""
    model = GPT.from_pretrained(tiny_hf_dir).eval()
    rng = random.Random(0)
    prompts = [[rng.randrange(50257) for _ in range(rng.randint(3, 60))] for _ in range(24)]
    cfg = load_config(["--gen_batch_size=24", "--max_new_tokens=12", "--device=cpu", *options])
    decoding = part(cfg, Decoding)
    # room for 3 of the shortest prompts: fewer of the longer ones
    small = 3 * sum(memory.dialogue_bytes(decoding, 3, model.config, torch.float32))
    assert len(memory.generation_batches(prompts, decoding, 24, model.config, small, torch.float32)) >= 6
    assert len(memory.generation_batches(prompts, decoding, 24, model.config, 2**40, torch.float32)) == 1
    whole = inference.summarize_batches(model, prompts, cfg, contextlib.nullcontext(), memory=2**40)
    assert inference.summarize_batches(model, prompts, cfg, contextlib.nullcontext(), memory=small) == whole
    if "--seed=3" in options:  # the seed matters
        reseeded = dataclasses.replace(cfg, seed=5)
        assert inference.summarize_batches(model, prompts, reseeded, contextlib.nullcontext(), memory=small) != whole


def test_gen_memory_gb_sizes_the_batches(tiny_hf_dir):
    model = GPT.from_pretrained(tiny_hf_dir).eval()
    prompts = [[1] * 50] * 40
    # P = 50 prompt tokens, M = 20 new: greedy's static cache (70 slots, up to 128) and its copy; beams and samples
    # over the prefill's prompt (50), shared, with their 20 own slots each, and a copy of those
    for options, slots in (([], 2 * 128), (["--num_beams=4"], 2 * (50 + 4 * 20)),
                           (["--temperature=0.7", "--mbr_samples=16"], 2 * (50 + 16 * 20))):
        per_prompt = memory.kv_cache_bytes(model.config, slots, torch.float32)
        rows = int(options[-1].split("=")[1]) if options else 1  # beams or samples
        per_prompt += memory.LOGITS_COPIES * rows * 50257 * 4  # and their logits: float32 rows of the vocabulary
        cfg = load_config(["--gen_batch_size=64", "--max_new_tokens=20", f"--gen_memory_gb={10.5 * per_prompt / 2**30}",
                           *options])
        decoding = part(cfg, Decoding)
        assert memory.cache_slots_per_prompt(decoding, 50, model.config.block_size) == slots
        room = memory.generation_memory(cfg, torch.device("cpu"))
        sizes = [len(b) for b in memory.generation_batches(prompts, decoding, 64, model.config, room,
                                                           torch.float32)]
        assert sizes == [10, 10, 10, 10], (options, sizes)


def test_generation_memory_of_every_kaggle_preset_fits_a_t4(tmp_path):
    """bench.py --section=memory's <model>:generate:<decoding>:gib, at each preset's settings and the longest
    prompt a preset allows (no SAMSum file here): weights, KV cache and logits within a T4's 15 GiB."""
    from bench import memory as bench_memory
    rows = bench_memory.generation_rows(str(tmp_path / "missing.csv"))
    names = {row["figure"] for row in rows}
    assert names == {f"{model}:generate:{decoding}:gib" for model in ("gpt2", "gpt2-medium", "gpt2-large", "gpt2-xl")
                     for decoding in ("greedy", "beam4", "mbr16")}
    for row in rows:
        preset = next(path for path in bench_memory.PRESETS.values() if os.path.basename(path) == row["preset"])
        cfg = dataclasses.replace(load_config([os.path.join(REPO, preset)]),
                                  **bench_memory.DECODINGS[row["figure"].split(":")[2]])
        assert row["prompt_tokens"] == cfg.block_size - cfg.max_new_tokens
        assert 1 <= row["prompts_per_batch"] <= cfg.gen_batch_size
        assert row["value"] == pytest.approx(row["weights_gib"] + row["kv_cache_gib"] + row["logits_gib"])
        assert row["value"] <= 15.0 and row["fits_t4"], row


# ---- issue 43: a budget that finishes its schedule ------------------------------------------------------------


def test_a_budget_spent_before_the_first_step_is_one_line(args, tmp_path, capsys):
    err = one_error_line(capsys, train.main, [*args, f"--out_dir={tmp_path / 'out'}", "--max_time=0.001"])
    assert "max_time=0.001 is used up before the first step: start-up took" in err and "--max_time=60" in err
    assert not (tmp_path / "out" / "ckpt.pt").exists()


# ---- issue 42: the output quota counts ----------------------------------------------------------------------


def test_an_output_quota_not_the_free_space_stops_a_run_that_would_not_fit(args, tmp_path, capsys):
    """/kaggle/working keeps 20 GB whatever its disk's free space: a run under --output_quota_dir plans against
    what the quota leaves after what the folder holds, and says which limit it used."""
    working = tmp_path / "working"
    working.mkdir()
    (working / "earlier.bin").write_bytes(b"\0" * 10_000_000)  # an earlier run's files count against the quota
    err = one_error_line(capsys, train.main, [*args, f"--out_dir={working / 'out'}", "--max_iters=2",
                                              f"--output_quota_dir={working}", "--output_quota_gb=0.02"])
    short, left, kept = map(int, re.match(
        rf"error: out_dir {re.escape(str(working / 'out'))} needs (\d+) MB more than the (\d+) MB left of the 0.02 GB "
        rf"output quota of {re.escape(str(working))} \(10 MB held there\): it keeps (\d+) MB", err).groups())
    assert left == 10 and abs(short - (kept - left)) <= 1, err  # the shortfall of what it keeps, not the peak
    assert not (working / "out" / "ckpt.pt").exists()
    train.main([*args, f"--out_dir={working / 'out'}", "--max_iters=2", f"--output_quota_dir={working}",
                "--output_quota_gb=1"])  # a quota that leaves room: trains, and the start line says what is left
    assert "left of the 1 GB output quota of" in capsys.readouterr().out


def test_a_save_beyond_the_output_quota_is_refused_before_anything_is_written(tmp_path):
    path = tmp_path / "ckpt.pt"
    state = {"model": {"w": torch.zeros(1_000_000)}}  # 4 MB
    problem = run_folder.save_problem([(str(path), state)], 7, run_folder.Quota(str(tmp_path), 0.002))
    assert problem.startswith(f"cannot save {path} at iter 7: it needs ") and not path.exists()
    assert f"and 2 MB is left of the 0.002 GB output quota of {tmp_path} (0 MB held there)" in problem
    assert run_folder.save_problem([(str(path), state)], 7, run_folder.Quota(str(tmp_path / "elsewhere"), 0.002)) \
        is None  # a folder outside the quota's: its free space alone counts
