"""Crashes: SIGKILL at random moments never leaves an unloadable checkpoint and resuming goes on from it; a full
disk while saving keeps the previous checkpoint byte for byte; one rank of a torchrun job failing ends the job; an
error of the run's own is its own line, its traceback in out_dir, never taken for a lost peer."""
import errno
import io
import multiprocessing
import os
import random
import re
import subprocess
import time

import pytest
import torch

import train
from conftest import HANG, REPO, TINY, one_error_line, torchrun
from model import GPT
from summarizer.checkpoint import load_checkpoint
from summarizer.launch import one_line_errors
from summarizer.loading import model_from_checkpoint

RUN = [*TINY, "--batch_size=4", "--micro_batch_size=4", "--rouge_samples=0", "--best_metric=val_loss",
       "--eval_val_batches=1"]
KILLS = 8  # each of the four moments (kill % 4) twice


def train_logged(args, log):
    """Body of a forked trainer: train.main(args), printing into `log`."""
    fd = os.open(log, os.O_WRONLY | os.O_CREAT | os.O_APPEND)
    os.dup2(fd, 1)
    os.dup2(fd, 2)
    train.main(args)


def wait_for(condition, proc, what, timeout=HANG):
    deadline = time.monotonic() + timeout
    while not condition():
        assert proc.exitcode is None, f"the trainer exited ({proc.exitcode}) before {what}"
        assert time.monotonic() < deadline, f"timed out waiting for {what}"
        time.sleep(0.001)


def file_version(path):
    """Changes whenever `path` is replaced by a new file."""
    try:
        stat = os.stat(path)
    except FileNotFoundError:
        return None
    return stat.st_ino, stat.st_mtime_ns


@pytest.mark.slow
def test_sigkill_at_random_moments_never_loses_the_checkpoint(write_csv, tmp_path):
    """KILLS times: start (or resume) training with a checkpoint every step, wait until it has written a newer
    ckpt.pt, then SIGKILL it after a random delay or, every other time, while it writes a checkpoint (half of those
    times ckpt.pt itself); ckpt.pt and best.pt must load, and the next resume must carry on past ckpt.pt's
    iteration."""
    write_csv("train.csv", 40)
    out = tmp_path / "out"
    ckpt_path = str(out / "ckpt.pt")
    args = [*RUN, f"--train_csv={tmp_path / 'train.csv'}", f"--data_cache_dir={tmp_path / 'cache'}",
            f"--out_dir={out}", "--max_iters=100000", "--eval_interval=1"]
    # Forked from a server that has imported train already: a fresh interpreter would spend seconds on imports.
    context = multiprocessing.get_context("forkserver")
    context.set_forkserver_preload(["train", "matplotlib.figure"])
    rng = random.Random(0)
    last_iter, moments = 0, []
    for kill in range(KILLS):
        before = file_version(ckpt_path)
        proc = context.Process(target=train_logged, args=([*args, f"--init_from={'resume' if kill else 'scratch'}"],
                                                          str(tmp_path / "train.log")))
        proc.start()
        wait_for(lambda before=before: file_version(ckpt_path) not in (None, before), proc, "a new ckpt.pt")
        if kill % 2:
            writing = (f"ckpt.pt.tmp{proc.pid}",) + ((f"best.pt.tmp{proc.pid}",) if kill % 4 == 3 else ())
            wait_for(lambda writing=writing: any(name in writing for name in os.listdir(out)), proc,
                     "a checkpoint write")
            moments.append("while writing")
        else:
            time.sleep(rng.uniform(0, 0.5))
        proc.kill()
        proc.join()
        ckpt = load_checkpoint(ckpt_path)
        model_from_checkpoint(ckpt, ckpt_path)
        model_from_checkpoint(load_checkpoint(str(out / "best.pt")), str(out / "best.pt"))
        assert ckpt["iter_num"] > last_iter, f"kill {kill}: resume did not go past iter {last_iter}"
        last_iter = ckpt["iter_num"]
    assert len(moments) == KILLS // 2
    train.main([*args, "--init_from=resume", f"--max_iters={last_iter + 1}"])
    assert load_checkpoint(ckpt_path)["iter_num"] == last_iter + 1


def error_line_of_training(tmp_path, out, capsys, *extra):
    """Train on tmp_path/train.csv into `out`; the run must end with exit code 2: its last stderr line."""
    with pytest.raises(SystemExit) as exit:
        train.main([*RUN, f"--train_csv={tmp_path / 'train.csv'}", f"--data_cache_dir={tmp_path / 'cache'}",
                    f"--out_dir={out}", *extra])
    assert exit.value.code == 2
    return capsys.readouterr().err.strip().splitlines()[-1]


def test_full_disk_while_saving_keeps_the_previous_checkpoint(write_csv, tmp_path, monkeypatch, capsys):
    write_csv("train.csv", 40)
    out = tmp_path / "out"
    real_save = torch.save
    previous = {}

    def save_until_the_disk_is_full(obj, f, *args, **kwargs):
        if not os.path.basename(f.name).startswith("ckpt.pt.tmp") or not (out / "ckpt.pt").exists():
            return real_save(obj, f, *args, **kwargs)
        previous["bytes"] = (out / "ckpt.pt").read_bytes()
        buffer = io.BytesIO()
        real_save(obj, buffer, *args, **kwargs)
        f.write(buffer.getvalue()[:buffer.tell() // 2])
        raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))

    monkeypatch.setattr(torch, "save", save_until_the_disk_is_full)
    last_line = error_line_of_training(tmp_path, out, capsys, "--max_iters=3", "--eval_interval=1")
    assert last_line.startswith(f"error: cannot write {out / 'ckpt.pt'}: No space left on device ("), last_line
    assert f"; {out / 'ckpt.pt'} still holds the previous checkpoint; intact: " in last_line
    assert last_line.endswith(f"{out / 'ckpt.pt'} (iter 1): free some space and continue (--init_from=resume), or "
                              f"continue in a larger folder (--resume_from=<the ckpt.pt> --out_dir=...)"), last_line
    assert (out / "ckpt.pt").read_bytes() == previous["bytes"]
    assert not [name for name in os.listdir(out) if ".tmp" in name]
    assert load_checkpoint(str(out / "ckpt.pt"))["iter_num"] == 1


@pytest.mark.slow
def test_a_rank_failing_mid_step_ends_the_torchrun_job_naming_it(write_csv, tmp_path):
    """tests/faulty_rank.py makes rank 1 raise in step 2; the job must end (not hang in a collective) with a
    non-zero exit and a last line from rank 1 that says what happened."""
    write_csv("train.csv", 40)
    env = dict(os.environ, OMP_NUM_THREADS="1", PYTHONPATH=REPO)
    result = subprocess.run(
        torchrun("--nproc_per_node=2", "--standalone", "tests/faulty_rank.py", *RUN, "--micro_batch_size=2",
                 f"--train_csv={tmp_path / 'train.csv'}", f"--data_cache_dir={tmp_path / 'cache'}",
                 f"--out_dir={tmp_path / 'out'}", "--max_iters=10", "--eval_interval=100", "--dist_timeout=30"),
        cwd=REPO, env=env, capture_output=True, text=True, timeout=HANG)
    assert result.returncode != 0
    assert re.search(r"^(\[rank1\]: )?error \(rank 1\): RuntimeError: injected fault in step 2 \(traceback in "
                     r"\S+error\.log\)$", result.stderr, re.MULTILINE), result.stderr[-3000:]
    assert "in faulty_step" in (tmp_path / "out" / "error.log").read_text()


def test_an_error_of_one_process_keeps_its_own_line_and_its_traceback(write_csv, tmp_path, monkeypatch, capsys):
    """A single-process run whose own forward raised a CUDA error that names NCCL: its own first line, naming
    out_dir/error.log, which holds its traceback (before: 'another rank of this run is gone (...); no checkpoint was
    written yet; continue with: ... --init_from=resume', with no other rank, no traceback and nothing to resume)."""
    def illegal_access(model, *args, **kwargs):
        raise RuntimeError("CUDA error: an illegal memory access was encountered\nCompile with TORCH_USE_CUDA_DSA to "
                           "enable device-side assertions.\nNCCL version 2.27.5")
    monkeypatch.setattr(GPT, "forward", illegal_access)
    out = tmp_path / "out"
    line = one_error_line(capsys, train.main, [*RUN, f"--train_csv={write_csv('train.csv', 24)}", f"--out_dir={out}",
                                               f"--data_cache_dir={tmp_path / 'cache'}", "--max_iters=2"], code=1)
    assert line == (f"error: RuntimeError: CUDA error: an illegal memory access was encountered (traceback in "
                    f"{out / 'error.log'})")
    log = (out / "error.log").read_text()
    assert "Traceback" in log and "in illegal_access" in log and "NCCL version 2.27.5" in log


def test_a_lost_peer_is_a_collectives_error_in_a_run_of_several_processes(tmp_path, capsys):
    """torch.distributed's error types (gloo's, untyped, by its transport's source location), and only where the run
    has other ranks: "NCCL" or "Broken pipe" in a message decide nothing. Before any save the line names no
    checkpoint to continue from."""
    def ending(error, distributed=True):
        with pytest.raises(SystemExit) as exit, one_line_errors(str(tmp_path), "torchrun ...", distributed):
            raise error
        return exit.value.code, capsys.readouterr().err
    gone = torch.distributed.DistBackendError("NCCL error: remote process exited or there was a network error")
    assert ending(gone) == (2, f"error: another rank of this run is gone (DistBackendError: {gone}); no checkpoint "
                               f"was written yet: start the run again\n")
    gloo = RuntimeError("[/pytorch/third_party/gloo/gloo/transport/tcp/pair.cc:553] Connection closed by peer")
    assert "error: another rank of this run is gone (RuntimeError: [/pytorch" in ending(gloo)[1]
    for error, distributed in ((gone, False), (RuntimeError("NCCL version 2.27.5: Broken pipe [gloo]"), True)):
        code, err = ending(error, distributed)
        assert code == 1 and "another rank" not in err and err.endswith(f"(traceback in {tmp_path / 'error.log'})\n")


def test_a_loss_that_stays_nan_stops_the_run_and_leaves_best_pt_untouched(write_csv, tmp_path, monkeypatch, capsys):
    """From the 5th training step on every loss is NaN: no update is applied, and after train.NAN_PATIENCE such
    steps the run ends with one error line; best.pt (written at iter 4) is byte for byte what it was."""
    write_csv("train.csv", 40)
    out = tmp_path / "out"
    real_forward = GPT.forward
    seen = {"steps": 0}

    def nan_from_step_5(model, idx, targets=None):
        logits, loss = real_forward(model, idx, targets)
        if model.training:
            seen["steps"] += 1
            if seen["steps"] == 5:
                seen["best.pt"] = (out / "best.pt").read_bytes()
            if seen["steps"] >= 5:
                seen.setdefault("weights", []).append({k: v.clone() for k, v in model.state_dict().items()})
                loss = loss * float("nan")
        return logits, loss

    monkeypatch.setattr(GPT, "forward", nan_from_step_5)
    last_line = error_line_of_training(tmp_path, out, capsys, "--max_iters=20", "--eval_interval=4")
    assert last_line.startswith("error: ") and re.search(
        rf"\bnan\b.*\b{train.NAN_PATIENCE}\b.*\(iter 7\).*\S+/best\.pt.*learning_rate", last_line), last_line
    assert seen["steps"] == 4 + train.NAN_PATIENCE
    assert (out / "best.pt").read_bytes() == seen["best.pt"]
    best = load_checkpoint(str(out / "best.pt"))
    assert best["iter_num"] == 4
    # the weights before each NaN step are those of iter 4: no NaN step changed them
    assert len(seen["weights"]) == train.NAN_PATIENCE
    assert all(torch.equal(best["model"][k], v) for weights in seen["weights"] for k, v in weights.items())


def test_a_nan_stop_before_any_save_says_nothing_is_saved_and_no_dtype_in_float32(write_csv, tmp_path, monkeypatch,
                                                                                    capsys):
    """Every loss NaN from step 1 in a float32 run: no checkpoint exists to be 'untouched', and float32 is already
    the dtype a float16 run would be told to use."""
    write_csv("train.csv", 40)
    out = tmp_path / "out"
    real_forward = GPT.forward

    def nan(model, idx, targets=None):
        logits, loss = real_forward(model, idx, targets)
        return logits, loss * float("nan") if model.training else loss
    monkeypatch.setattr(GPT, "forward", nan)
    last_line = error_line_of_training(tmp_path, out, capsys, "--max_iters=20", "--eval_interval=10")
    assert f"(iter {train.NAN_PATIENCE}); stopped: nothing is saved in {out} yet; lower learning_rate (now " \
           in last_line and "dtype" not in last_line, last_line
