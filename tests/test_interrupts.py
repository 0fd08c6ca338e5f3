"""A run that is stopped (Ctrl-C, a notebook's stop button, the end of a session) finishes its step on every rank,
writes ckpt.pt, prints the command that continues it and ends without a traceback; continuing gives the losses of
one uninterrupted run, each step logged once."""
import ast
import json
import os
import shlex
import signal
import subprocess
import sys
import time

import pytest

from conftest import HANG, REPO, free_port, metrics, tiny, torchrun
from summarizer.checkpoint import load_checkpoint

STEPS = 30
ARGS = [*tiny(n_embd=64), "--batch_size=16", "--micro_batch_size=8", "--rouge_samples=0", "--best_metric=val_loss",
        "--eval_val_batches=1", "--log_interval=1", f"--max_iters={STEPS}", "--eval_interval=25",
        "--sample_submission_csv="]


def start(launcher, args, log):
    """train.py ARGS in the background, its output into the file `log`: a pipe that nobody reads while the test
    waits fills up and stops the run."""
    env = {k: v for k, v in os.environ.items() if not k.startswith("ACCELERATE_")}
    with open(log, "w") as output:
        return subprocess.Popen([*launcher, "train.py", *args], cwd=REPO, env=dict(env, OMP_NUM_THREADS="1"),
                                stdout=output, stderr=subprocess.STDOUT)


def logged_iters(out):
    path = out / "metrics.jsonl"
    if not path.is_file():
        return []
    return [json.loads(line)["iter"] for line in path.read_text().splitlines() if line.endswith("}")]


def stop_during_training(process, log, out, pids, sig, after_iter):
    """Send `sig` to `pids()` once the run has logged step `after_iter` (between two evaluations), so during the
    next step; its output."""
    deadline = time.monotonic() + HANG
    while max(logged_iters(out), default=0) < after_iter:
        assert process.poll() is None, log.read_text()
        assert time.monotonic() < deadline, "the run did not reach the iteration to stop at"
        time.sleep(0.01)
    for pid in pids():
        os.kill(pid, sig)
    process.wait(timeout=HANG)
    return log.read_text()


def ranks_of(launcher):
    """The training processes torchrun started (its children)."""
    found = subprocess.run(["pgrep", "-P", str(launcher.pid)], capture_output=True, text=True).stdout.split()
    assert len(found) == 2, found
    return [int(pid) for pid in found]


@pytest.mark.slow
@pytest.mark.parametrize("how", ["one process, SIGINT", "torchrun, 2 ranks, SIGTERM"])
def test_a_stopped_run_saves_its_step_and_continues_as_one_uninterrupted_run(how, write_csv, tmp_path):
    data = [f"--train_csv={write_csv('train.csv', 96)}", f"--data_cache_dir={tmp_path / 'cache'}"]
    if how.startswith("torchrun"):
        launcher, sig = torchrun("--nproc_per_node=2", f"--master_port={free_port()}"), signal.SIGTERM
        code, expected_code = "torchrun --nproc_per_node=2 --standalone train.py", 0
    else:
        launcher, sig = [sys.executable], signal.SIGINT
        code, expected_code = "python train.py", 128 + signal.SIGINT
    stopped, whole = tmp_path / "stopped", tmp_path / "whole"
    args = [*ARGS, *data, f"--out_dir={stopped}"]

    log = tmp_path / "stopped.log"
    process = start(launcher, args, log)
    pids = (lambda: ranks_of(process)) if how.startswith("torchrun") else (lambda: [process.pid])
    output = stop_during_training(process, log, stopped, pids, sig, after_iter=10)
    assert process.returncode == expected_code and "Traceback" not in output, output
    reached = max(logged_iters(stopped))
    assert reached == 11  # the signal came during step 11 (step 10 was logged): that step ends, no other runs
    assert f"{sig.name}: stopping after iter 11, then saving {stopped / 'ckpt.pt'}" in output
    assert f"stopped by {sig.name} after iter {reached}: {stopped / 'ckpt.pt'} holds it; continue with:" in output
    assert load_checkpoint(str(stopped / "ckpt.pt"))["iter_num"] == reached
    command = output.split("continue with:\n", 1)[1].splitlines()[0].strip()
    assert command.startswith(code) and command.endswith("--init_from=resume")

    continued = subprocess.run([*launcher, "train.py", *args, "--init_from=resume"], cwd=REPO,
                               env=dict(os.environ, OMP_NUM_THREADS="1"), capture_output=True, text=True, timeout=HANG)
    assert continued.returncode == 0, continued.stderr
    finished = subprocess.run([*launcher, "train.py", *ARGS, *data, f"--out_dir={whole}"], cwd=REPO,
                              env=dict(os.environ, OMP_NUM_THREADS="1"), capture_output=True, text=True, timeout=HANG)
    assert finished.returncode == 0, finished.stderr
    assert logged_iters(stopped) == sorted(set(logged_iters(stopped))) == list(range(1, STEPS + 1))
    losses = {r["iter"]: r["loss"] for r in metrics(stopped)}
    assert losses == pytest.approx({r["iter"]: r["loss"] for r in metrics(whole)}, rel=1e-6, abs=0)


@pytest.mark.slow
def test_a_resumed_run_drops_the_rows_logged_after_its_checkpoint(write_csv, tmp_path):
    import train
    out = tmp_path / "out"
    args = [*ARGS, f"--train_csv={write_csv('train.csv', 48)}", f"--data_cache_dir={tmp_path / 'cache'}",
            f"--out_dir={out}", "--eval_interval=5", "--n_layer=1", "--n_embd=32"]
    train.main([*args, "--max_iters=5"])
    # as if killed at iter 8, after its checkpoint at 5, in the middle of writing a row
    last = json.loads((out / "metrics.jsonl").read_text().splitlines()[-1])
    later = [json.dumps(dict(last, iter=i)) for i in (6, 7, 8)]
    with open(out / "metrics.jsonl", "a") as f:
        f.write("\n".join(later) + "\n" + later[-1][:15])
    train.main([*args, "--max_iters=10", "--init_from=resume"])
    assert logged_iters(out) == list(range(1, 11))


@pytest.mark.slow
def test_a_killed_rank_leaves_one_line_naming_the_intact_checkpoint_and_a_command_that_continues(write_csv, tmp_path):
    """SIGKILL of one torchrun rank mid-run (an out-of-memory kill, a crashed host): the rank left cannot save
    (its collectives have no peer), so it ends in one line with the checkpoint still intact and the command that
    continues the run; that command, run as printed, finishes it."""
    out = tmp_path / "out"
    args = [*ARGS, f"--train_csv={write_csv('train.csv', 96)}", f"--data_cache_dir={tmp_path / 'cache'}",
            f"--out_dir={out}", "--eval_interval=5", "--dist_timeout=60"]
    log = tmp_path / "run.log"
    process = start(torchrun("--nproc_per_node=2", f"--master_port={free_port()}"), args, log)
    output = stop_during_training(process, log, out, lambda: ranks_of(process)[-1:], signal.SIGKILL, after_iter=7)
    lines = [line for line in output.splitlines() if "another rank of this run is gone" in line]
    assert len(lines) == 1 and lines[0].startswith("error (rank "), output[-3000:]
    assert "; intact: " in lines[0] and f"{out / 'ckpt.pt'} (iter 5)" in lines[0], lines[0]
    assert 'train.py", line' not in output, output[-3000:]  # no traceback of ours, only the launcher's report
    command = lines[0].split("continue with: ", 1)[1]
    assert command.startswith("torchrun --nproc_per_node=2 --standalone train.py ")
    assert command.endswith("--init_from=resume")
    continued = subprocess.run([*torchrun(), *shlex.split(command)[1:]], cwd=REPO,
                               env=dict(os.environ, OMP_NUM_THREADS="1"), capture_output=True, text=True,
                               timeout=HANG)
    assert continued.returncode == 0, continued.stderr[-3000:]
    assert load_checkpoint(str(out / "ckpt.pt"))["iter_num"] == STEPS


def test_a_signal_says_what_happens_at_that_moment(tmp_path, capsys):
    """During start-up a signal stops at once (nothing is saved yet); in training it stops after the step the loop
    names, which it announces; after training (an error ended the loop) it announces no save that cannot come."""
    from summarizer.launch import StopSignals
    signals = StopSignals(str(tmp_path), is_main=True, distributed=False)
    with pytest.raises(KeyboardInterrupt):
        signals.handle(signal.SIGINT, None)
    assert signals.received is None and capsys.readouterr().err == ""
    with signals.training(lambda: 3):
        signals.handle(signal.SIGTERM, None)
        assert signals.received == signal.SIGTERM and signals.stop_after == 3
        assert f"SIGTERM: stopping after iter 3, then saving {tmp_path / 'ckpt.pt'}" in capsys.readouterr().err
    ended = StopSignals(str(tmp_path), is_main=True, distributed=True)
    with ended.training(lambda: 1):
        pass
    ended.handle(signal.SIGTERM, None)
    assert ended.received == signal.SIGTERM and capsys.readouterr().err == ""


def test_a_signal_after_a_steps_stop_check_announces_and_saves_the_next_step(write_csv, tmp_path, monkeypatch,
                                                                             capsys):
    """A SIGINT during step 3's update, after the ranks agreed not to stop: the run announces iter 4, and trains and
    saves iter 4."""
    import torch

    import train
    clip, calls = torch.nn.utils.clip_grad_norm_, []

    def clip_then_signal(*args, **kwargs):  # the update, after the step's one reduction
        calls.append(len(calls))
        if len(calls) == 3:
            os.kill(os.getpid(), signal.SIGINT)
        return clip(*args, **kwargs)
    monkeypatch.setattr(torch.nn.utils, "clip_grad_norm_", clip_then_signal)
    out = tmp_path / "out"
    with pytest.raises(SystemExit) as exit:
        train.main([*ARGS, f"--train_csv={write_csv('train.csv', 48)}", f"--data_cache_dir={tmp_path / 'cache'}",
                    f"--out_dir={out}", "--n_layer=1", "--n_embd=32"])
    assert exit.value.code == 128 + signal.SIGINT
    assert f"SIGINT: stopping after iter 4, then saving {out / 'ckpt.pt'}" in capsys.readouterr().err
    assert load_checkpoint(str(out / "ckpt.pt"))["iter_num"] == max(logged_iters(out)) == 4


BUSY = """import hashlib, sys
import train
from model import GPT
forward, steps = GPT.forward, []


def busy(model, *args, **kwargs):  # step 3 spends a minute in one C call, as a long backward or save would
    steps.append(model.training)
    if sum(steps) == 3 * 2:  # 2 micro-batches a step
        print("busy", flush=True)
        hashlib.pbkdf2_hmac("sha256", b"x", b"y", 10**8)
        print("busy no more", flush=True)
    return forward(model, *args, **kwargs)


GPT.forward = busy
train.main(sys.argv[2:])  # after start()'s train.py
"""


@pytest.mark.slow
def test_a_second_ctrl_c_ends_the_run_at_once_whatever_it_does_in_one_line(write_csv, tmp_path):
    """Two Ctrl-C 0.3 s apart while the run is in one long C call (Python runs no handler there): the process ends
    before that call returns, in one line naming the intact checkpoints."""
    out, log = tmp_path / "out", tmp_path / "run.log"
    args = [*ARGS, f"--train_csv={write_csv('train.csv', 48)}", f"--data_cache_dir={tmp_path / 'cache'}",
            f"--out_dir={out}", "--eval_interval=2"]
    process = start([sys.executable, "-c", BUSY], args, log)
    deadline = time.monotonic() + HANG
    while "busy" not in log.read_text():
        assert process.poll() is None and time.monotonic() < deadline, log.read_text()
        time.sleep(0.01)
    for _ in range(2):
        process.send_signal(signal.SIGINT)
        time.sleep(0.3)
    process.wait(timeout=HANG)
    output = log.read_text()
    assert process.returncode == 128 + signal.SIGINT and "busy no more" not in output, output[-3000:]
    intact = f"intact: {out / 'best.pt'} (iter 2), {out / 'ckpt.pt'} (iter 2)"  # the line loads them to say so
    assert output.rstrip().endswith(f"second Ctrl-C: stopping at once; {intact}") and "Traceback" not in output


def test_the_second_ctrl_c_line_starts_a_line_of_its_own(tmp_path, monkeypatch, capsys):
    """A progress bar leaves the cursor at its end: the second Ctrl-C's line begins on a new line, not glued to it."""
    from summarizer.launch import StopSignals
    read, write = os.pipe()
    os.write(write, bytes([signal.SIGINT, signal.SIGINT]))
    os.close(write)
    monkeypatch.setattr(os, "_exit", sys.exit)
    with pytest.raises(SystemExit):
        StopSignals(str(tmp_path)).second_ctrl_c(read)
    assert capsys.readouterr().err == f"\nsecond Ctrl-C: stopping at once; nothing is saved in {tmp_path} yet\n"


def test_a_launchers_sigterm_after_another_rank_failed_cannot_end_a_rank_before_its_error_line():
    """Under torchrun an error leaving the run's signals keeps them caught (quietly) until the process ends: the
    launcher's SIGTERM, sent as another rank fails, would otherwise kill this rank before its one line is printed."""
    from summarizer.launch import StopSignals
    before = signal.getsignal(signal.SIGTERM)
    try:
        with pytest.raises(RuntimeError), StopSignals(distributed=True) as signals:
            with signals.training(lambda: 1):
                raise RuntimeError("connection closed by peer")
        assert signal.getsignal(signal.SIGTERM) == signals.handle
        signals.handle(signal.SIGTERM, None)  # taken quietly: the error's line comes next
        with StopSignals() as alone:
            pass
        assert signal.getsignal(signal.SIGTERM) == signals.handle != alone.handle  # one process: restored as found
    finally:
        signal.signal(signal.SIGTERM, before)


def test_the_docs_say_what_a_stop_does_before_the_first_step_and_after_a_killed_rank():
    """What the tests above show, as the docs tell it: a signal in start-up stops at once with `interrupted`; a
    killed rank's line comes before torchrun's own ChildFailedError report."""
    def section(page, title):
        with open(os.path.join(REPO, "docs", page), encoding="utf-8") as f:
            return f.read().split(title, 1)[1].split("\n#", 1)[0]
    stopping = section("kaggle.md", "## Stopping and continuing")
    assert "`interrupted`" in stopping and "after the first step" not in stopping, stopping
    killed = section("troubleshooting.md", "### A killed run")
    assert "ChildFailedError" in killed and "`error (rank N)` line above it is the one to act on" in killed, killed


def test_every_script_hands_ctrl_c_to_the_package_around_its_imports():
    """The test below shows train.py's imports end in one line; each script holds it: summarizer's two calls
    enclose every import after its own."""
    for script in ("train.py", "evaluate.py", "predict.py", "export.py"):
        with open(os.path.join(REPO, script), encoding="utf-8") as f:
            lines = [ast.unparse(node) for node in ast.parse(f.read()).body]
        imports = [i for i, line in enumerate(lines) if line.startswith(("import ", "from "))]
        until, imported = lines.index("summarizer.until_imported(__name__)"), lines.index(
            "summarizer.imported(__name__)")
        assert lines[imports[0]] == "import summarizer" and imports[0] + 1 == until, script
        assert until < imports[1] and imports[-1] < imported, script


@pytest.mark.slow
def test_ctrl_c_while_a_script_imports_is_one_line():
    """SIGINT a moment after train.py starts, while torch is imported: one line, exit 130, no traceback."""
    process = subprocess.Popen([sys.executable, "train.py", "--device=cpu"], cwd=REPO, stdout=subprocess.PIPE,
                               stderr=subprocess.PIPE, text=True, env=dict(os.environ, OMP_NUM_THREADS="1"))
    time.sleep(0.3)
    process.send_signal(signal.SIGINT)
    _, err = process.communicate(timeout=HANG)
    assert process.returncode == 128 + signal.SIGINT and err.strip() == "interrupted", err[-2000:]
