"""The run folder (summarizer/run_folder.py): one training run at a time holds out_dir; a fresh run moves an earlier
run aside only once its inputs are checked; commands that miss a file name the earlier run's copy; evaluate.py on
a folder a training run holds says so; what a process killed while saving left goes at the next command."""
import dataclasses
import json
import os
import signal
import subprocess
import sys
import time

import pytest
import torch

import command_line
import data
import predict
import train
from bench import memory as bench_memory
from bench import preflight
from command_line import UserError
from config import load_config
from conftest import (
    HANG,
    REPO,
    held_by_another_process,
    metrics,
    one_error_line,
    save_csv,
    synthetic_rows,
    tiny,
    torchrun,
)
from model import PRETRAINED
from summarizer import run_folder
from summarizer.clock import Clock


@pytest.fixture(scope="module")
def csvs(tmp_path_factory):
    folder = tmp_path_factory.mktemp("csvs")
    return (save_csv(folder / "train.csv", synthetic_rows(48, 0)), save_csv(folder / "test.csv", synthetic_rows(4, 1),
                                                                            test=True))


def args(csvs, out, *more):
    return [*tiny(), f"--train_csv={csvs[0]}", f"--test_csv={csvs[1]}", "--val_fraction=0.2", "--batch_size=4",
            "--micro_batch_size=4", "--rouge_samples=2", "--eval_interval=4", "--log_interval=1", f"--out_dir={out}",
            "--evaluate_after=False", "--predict_after=False", *more]


def start(launcher, argv, log):
    """train.py ARGV in the background, its output into the file `log`: a pipe that nobody reads while the test
    waits fills up and stops the run."""
    env = {k: v for k, v in os.environ.items() if not k.startswith("ACCELERATE_")}
    with open(log, "w") as output:
        return subprocess.Popen([*launcher, "train.py", *argv], cwd=REPO, env=dict(env, OMP_NUM_THREADS="1"),
                                stdout=output, stderr=subprocess.STDOUT)


@pytest.mark.slow
@pytest.mark.parametrize("launcher", ["python", "torchrun"])
def test_a_second_run_into_a_folder_in_use_stops_at_once_and_the_first_is_untouched(csvs, tmp_path, launcher):
    out = tmp_path / "out"
    command = [sys.executable] if launcher == "python" else torchrun("--nproc_per_node=2", "--standalone")
    first = start(command, args(csvs, out, "--max_iters=100000", "--micro_batch_size=2"), tmp_path / "first.log")
    try:
        deadline = time.monotonic() + HANG
        while not (out / "metrics.jsonl").exists():  # the first run is training
            assert first.poll() is None and time.monotonic() < deadline, (tmp_path / "first.log").read_text()
            time.sleep(0.2)
        second = start(command, args(csvs, out, "--max_iters=3", "--micro_batch_size=2"), tmp_path / "second.log")
        second.wait(timeout=HANG)
        err = (tmp_path / "second.log").read_text()
        assert second.returncode != 0
        errors = [line for line in err.splitlines() if line.startswith(("error: ", "error (rank 0): "))]
        assert len(errors) == 1 and f"out_dir {out} is in use by another training run (pid " in errors[0], err
        if launcher == "python":  # under torchrun rank 0, a child of the launcher, holds the lock; the launcher
            # itself reports a failed job with a traceback of its own
            assert f"(pid {first.pid} on host " in errors[0] and "Traceback" not in err
        assert first.poll() is None  # the second did not wait for the first to end
        first.send_signal(signal.SIGINT)
        first.wait(timeout=HANG)
    finally:
        first.kill()
    rows = metrics(out)
    assert [r["iter"] for r in rows] == list(range(1, len(rows) + 1))  # one run's rows, in order, once each
    assert json.load(open(out / "config.json"))["max_iters"] == 100000


def test_a_rerun_that_fails_on_its_input_leaves_the_earlier_run_where_it_was(csvs, tmp_path, capsys):
    out = tmp_path / "out"
    train.main(args(csvs, out, "--max_iters=4"))
    (out / "submission.csv").write_text("id,summary\n")
    before = {name: (out / name).read_bytes() for name in ("best.pt", "ckpt.pt", "submission.csv", "metrics.jsonl")}
    for bad in ("--train_csv=" + str(tmp_path / "missing.csv"), "--n_embd=33"):
        err = one_error_line(capsys, train.main, args(csvs, out, "--max_iters=4", bad))
        assert "missing.csv" in err or "n_embd" in err
        assert {name: (out / name).read_bytes() for name in before} == before
        assert not list(out.glob("previous-run-*"))
    assert not os.path.exists(out / run_folder.LOCK) or run_folder.training_in(str(out)) is None


def test_a_rerun_its_budget_refuses_before_step_1_leaves_the_folder_as_it_found_it(csvs, tmp_path, capsys,
                                                                                  monkeypatch):
    """The budget is the last check before step 1 (here its rule made to refuse): nothing is moved aside and no
    config.json written before it passes, so the next resume finds ckpt.pt; the preflight leaves only its report."""
    out = tmp_path / "out"
    train.main(args(csvs, out, "--max_iters=4"))
    before = {path.name: path.read_bytes() for path in out.iterdir()}
    monkeypatch.setattr(Clock, "start_up_problem", lambda clock: f"max_time={clock.budget:g} leaves no step")
    err = one_error_line(capsys, train.main, args(csvs, out, "--max_iters=8", "--max_time=15"))
    assert err == "error: max_time=15 leaves no step"
    assert {path.name: path.read_bytes() for path in out.iterdir()} == before
    assert preflight.main(args(csvs, out, "--max_iters=8", "--max_time=15")) == 1  # its verdict, the same way
    assert {path.name: path.read_bytes() for path in out.iterdir() if path.name != run_folder.PREFLIGHT} == before


def test_commands_that_miss_a_checkpoint_name_the_earlier_runs_copy(csvs, tmp_path, capsys):
    out = tmp_path / "out"
    train.main(args(csvs, out, "--max_iters=4"))
    assert run_folder.set_aside_earlier_run(str(out))  # as a fresh run does before its first save
    (earlier,) = out.glob("previous-run-*")
    err = one_error_line(capsys, predict.main, args(csvs, out))
    assert str(earlier / "best.pt") in err and "--ckpt=" in err
    err = one_error_line(capsys, train.main, args(csvs, out, "--max_iters=8", "--init_from=resume"))
    assert str(earlier / "ckpt.pt") in err and "--resume_from=" in err


def test_what_a_process_killed_while_saving_left_goes_at_the_next_command(csvs, tmp_path, capsys):
    """<file>.tmp<pid> (a ckpt.pt's can be gigabytes) is removed by the next command in the folder when its process
    is gone; a live process's temp file and a file that is not the run's stay."""
    out = tmp_path / "out"
    out.mkdir()
    dead = subprocess.run([sys.executable, "-c", "import os; print(os.getpid())"], capture_output=True,
                          text=True).stdout.strip()
    (out / f"ckpt.pt.tmp{dead}").write_bytes(bytes(1000))
    (out / f"metrics.png.tmp{dead}").write_bytes(b"")
    kept = [f"best.pt.tmp{os.getppid()}", f"notes.txt.tmp{dead}"]  # a live process's; not a file of the run's
    for name in kept:
        (out / name).write_bytes(b"x")
    train.main(args(csvs, out, "--max_iters=1"))
    assert (f"removed 2 file(s) that a process killed while saving left in {out}: ckpt.pt.tmp{dead}, "
            f"metrics.png.tmp{dead} (1,000 bytes)") in capsys.readouterr().out.splitlines()
    assert sorted(path.name for path in out.glob("*.tmp*")) == kept
    (out / f"submission.csv.tmp{dead}").write_bytes(b"id,summary\n")
    predict.main(args(csvs, out))
    assert f"removed 1 file(s) that a process killed while saving left in {out}: submission.csv.tmp{dead} (11 bytes)" \
        in capsys.readouterr().out.splitlines()
    assert sorted(path.name for path in out.glob("*.tmp*")) == kept


@pytest.mark.slow
def test_evaluate_on_a_folder_a_training_run_holds_says_so(csvs, tmp_path, capsys):
    import evaluate

    out = tmp_path / "out"
    train.main(args(csvs, out, "--max_iters=4"))
    holder = subprocess.Popen([sys.executable, "-c", "import sys, time; from summarizer import run_folder\n"
                               f"with run_folder.claimed({str(out)!r}, True, lambda p: None):\n"
                               "    print('held', flush=True); time.sleep(60)"],
                              cwd=REPO, stdout=subprocess.PIPE, text=True)
    try:
        assert holder.stdout.readline().strip() == "held"
        capsys.readouterr()
        evaluate.main(args(csvs, out))
        printed = capsys.readouterr().out
        assert f"a training run holds {out} (pid {holder.pid} on host" in printed
        assert (out / "eval_metrics.json").exists()
    finally:
        holder.kill()


@pytest.mark.slow  # held_by_another_process starts a process
@pytest.mark.parametrize("command", ["evaluate", "predict"])
def test_a_command_on_a_folder_whose_training_has_not_saved_yet_says_to_wait(csvs, tmp_path, capsys, command):
    """A training run holds out_dir (its lock) and has not written best.pt yet: not 'train first' but who trains
    there and to wait for its first save."""
    import evaluate
    out = tmp_path / "out"
    out.mkdir()
    with held_by_another_process(out) as pid:
        main = evaluate.main if command == "evaluate" else predict.main
        err = one_error_line(capsys, main, args(csvs, out))
    assert f"checkpoint {out / 'best.pt'} does not exist yet: a training run writes into {out} (pid " \
           f"{pid} on host " in err and "wait for its first save" in err, err


def test_a_relative_checkpoint_missing_here_names_the_one_in_the_repository(tmp_path, monkeypatch, capsys):
    """Relative paths resolve against the working folder (docs/config.md): `cd /tmp && python <repo>/evaluate.py
    <repo>/config/demo.py` misses <repo>/out-demo/best.pt. Not 'train first', but the one there and the flag."""
    import evaluate
    repo, elsewhere = tmp_path / "repo", tmp_path / "elsewhere"
    (repo / "out-demo").mkdir(parents=True)
    (repo / "out-demo" / "best.pt").write_bytes(b"")
    elsewhere.mkdir()
    monkeypatch.setattr(command_line, "REPO", str(repo))
    monkeypatch.chdir(elsewhere)
    err = one_error_line(capsys, evaluate.main, [os.path.join(REPO, "config", "demo.py")])
    there = repo / "out-demo" / "best.pt"
    assert err == (f"error: checkpoint out-demo/best.pt does not exist; relative paths resolve against the working "
                   f"folder ({elsewhere}), and {there} exists: use it with --ckpt={there}, or run from {repo}")


def test_a_relative_csv_missing_here_names_the_one_in_the_repository(tmp_path, monkeypatch):
    """The next step of the hint above: with --ckpt as printed, the preset's relative train_csv is missing too (it
    said only 'relative to the current folder')."""
    monkeypatch.chdir(tmp_path)
    there = os.path.join(REPO, "data", "demo", "train.csv")
    with pytest.raises(UserError) as info:
        data.read_frame(os.path.join("data", "demo", "train.csv"), "train_csv")
    assert str(info.value).endswith(f"{there} exists: use it with --train_csv={there}, or run from {REPO}")


def test_a_checkpoint_missing_in_out_dir_names_the_newest_that_a_fresh_run_moved_aside(tmp_path):
    for stamp in ("20260101-000000", "20260102-000000"):
        (tmp_path / f"previous-run-{stamp}").mkdir()
        (tmp_path / f"previous-run-{stamp}" / "best.pt").write_bytes(b"")
    newest = tmp_path / "previous-run-20260102-000000" / "best.pt"
    os.utime(tmp_path / "previous-run-20260101-000000" / "best.pt", (0, 0))
    assert run_folder.missing_file_hint(str(tmp_path / "best.pt"), "--ckpt") == (
        f"; an earlier run's is {newest} (a fresh run moved it there): use it with --ckpt={newest}")


def test_gpt2_large_two_sessions_fit_kaggles_20_gb_output_quota(tmp_path, monkeypatch):
    """gpt2-large's preset at its real shape (meta tensors): its ckpt.pt (9.3 GB) and best.pt (3.1 GB) fit the 20 GB
    that /kaggle/working keeps, so session 1 keeps there what session 2 resumes from; the second copy while a save
    replaces ckpt.pt (21.7 GB at the peak) is on the disk's free space, and goes as the save ends. Each of session
    1's saves fits as well, and a quota under what the folder keeps is still refused."""
    monkeypatch.setattr(run_folder, "free_bytes", lambda path: 60 * run_folder.GB)  # a Kaggle disk's free space
    working = tmp_path / "working"
    cfg = load_config([os.path.join(REPO, "config", "kaggle_t4x2_gpt2-large.py"), f"--out_dir={working / 'out'}",
                       f"--output_quota_dir={working}", "--output_quota_gb=20"])
    model = bench_memory.build(PRETRAINED["gpt2-large"], "meta", cfg)
    plan = run_folder.DiskPlan(model, cfg, train_rows=14_732)
    assert plan.peak > 20 * run_folder.GB > plan.kept and plan.problem(resuming=False) is None
    (working / "out").mkdir(parents=True)
    for name, size in ((run_folder.CKPT, plan.ckpt), (run_folder.BEST, plan.best)):  # session 1's last save
        with open(working / "out" / name, "wb") as f:
            f.truncate(size)
    state = {"model": {n: torch.empty(p.shape, device="meta") for n, p in model.named_parameters()},
             "optimizer": [torch.empty(2 * p.numel(), device="meta") for p in model.parameters()]}
    assert run_folder.save_problem([(str(working / "out" / run_folder.CKPT), state)], 100,
                                   run_folder.Quota.of(cfg)) is None
    problem = run_folder.DiskPlan(model, dataclasses.replace(cfg, output_quota_gb=12)).problem(resuming=False)
    assert "left of the 12 GB output quota" in problem and "it keeps 12.4 GB" in problem
