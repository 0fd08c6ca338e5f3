"""A run that is stopped (Ctrl-C, a notebook's stop button, the end of a session) finishes its step on every rank,
writes ckpt.pt, prints the command that continues it and ends without a traceback; continuing gives the losses of
one uninterrupted run, each step logged once."""
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
    """During start-up a signal stops at once (nothing is saved yet); in training it asks for a save after the
    step, and a second Ctrl-C names what is saved, or that nothing is; after training (an error ended the loop) it
    announces no save that cannot come."""
    from summarizer.launch import StopSignals
    from train import saved_so_far
    signals = StopSignals(lambda: "stopping after iter 3, then saving ckpt.pt", lambda: saved_so_far(str(tmp_path)),
                          distributed=False)
    with pytest.raises(KeyboardInterrupt):
        signals.handle(signal.SIGINT, None)
    assert signals.received is None and capsys.readouterr().err == ""
    with signals.training():
        signals.handle(signal.SIGTERM, None)
        assert signals.received == signal.SIGTERM
        assert "SIGTERM: stopping after iter 3, then saving ckpt.pt" in capsys.readouterr().err
        with pytest.raises(KeyboardInterrupt):
            signals.handle(signal.SIGINT, None)
        assert f"second Ctrl-C: stopping at once; nothing is saved in {tmp_path} yet" in capsys.readouterr().err
    ended = StopSignals(lambda: "stopping after iter 3, then saving ckpt.pt", lambda: "", distributed=True)
    with ended.training():
        pass
    ended.handle(signal.SIGTERM, None)
    assert ended.received == signal.SIGTERM and capsys.readouterr().err == ""


def test_a_launchers_sigterm_after_another_rank_failed_cannot_end_a_rank_before_its_error_line():
    """Under torchrun an error leaving the run's signals keeps them caught (quietly) until the process ends: the
    launcher's SIGTERM, sent as another rank fails, would otherwise kill this rank before its one line is printed."""
    from summarizer.launch import StopSignals
    before = signal.getsignal(signal.SIGTERM)
    try:
        with pytest.raises(RuntimeError), StopSignals(None, lambda: "", distributed=True) as signals:
            with signals.training():
                raise RuntimeError("connection closed by peer")
        assert signal.getsignal(signal.SIGTERM) == signals.handle
        signals.handle(signal.SIGTERM, None)  # taken quietly: the error's line comes next
        with StopSignals(None, lambda: "", distributed=False) as alone:
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


@pytest.mark.slow
@pytest.mark.parametrize("script, after", [("train.py", 0.3), ("predict.py", 0.3), ("evaluate.py", 0.3)])
def test_ctrl_c_while_a_script_imports_is_one_line(script, after):
    """SIGINT a moment after start, while torch is imported: one line, exit 130, no traceback."""
    process = subprocess.Popen([sys.executable, script, "--device=cpu"], cwd=REPO, stdout=subprocess.PIPE,
                               stderr=subprocess.PIPE, text=True, env=dict(os.environ, OMP_NUM_THREADS="1"))
    time.sleep(after)
    process.send_signal(signal.SIGINT)
    _, err = process.communicate(timeout=HANG)
    assert process.returncode == 128 + signal.SIGINT and err.strip() == "interrupted", err[-2000:]
