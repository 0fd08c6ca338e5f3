"""bench/preflight.py, the check a user runs first: train.py's own checks through the same code (its lines), and what
only a preflight checks (versions, GPUs, /dev/shm, the collective), for the run as it will be launched; nothing
trains or decodes. A failed check is a no-go verdict and exit status 1."""
import json
import os
import subprocess
import sys

import pytest

import train
from bench import preflight
from config import load_config
from conftest import HANG, ONE_STEP, REPO, held_by_another_process, tiny
from summarizer import loading


def report(out):
    return json.loads((out / "preflight_report.json").read_text())


def test_the_readmes_demo_preset_on_a_cpu_is_a_go_for_one_process(tmp_path, capsys):
    out = tmp_path / "out"
    assert preflight.main(["config/demo.py", f"--out_dir={out}", f"--data_cache_dir={tmp_path / 'cache'}"]) == 0
    said = report(out)
    assert said["go"] is True and said["device"] == "cpu" and said["processes"] == 1
    assert said["verdict"] == "go: every check that ran passed (gpus, collective not run)"
    assert capsys.readouterr().out.splitlines()[-2] == said["verdict"]  # the last line before the report's path
    assert list(said["checks"]) == ["versions", "gpus", "shared_memory", "train.py", "collective"]
    assert said["checks"]["train.py"]["detail"].startswith("1600 training and 100 validation examples")
    assert said["checks"]["versions"]["torch"] and said["checks"]["train.py"]["parameters_m"] > 0


def train_verdict(capsys, argv):
    """train.py's verdict on argv, run in this process: 'go' when it trains, else 'no-go: train.py: <its line>'."""
    capsys.readouterr()
    try:
        train.main(argv)
    except SystemExit as e:
        err = capsys.readouterr().err
        assert e.code == 2 and "Traceback" not in err, err
        return "no-go: train.py: " + [line for line in err.splitlines() if line.startswith("error: ")][-1][7:]
    return "go"


def preflight_verdict(capsys, argv):
    """The preflight's verdict line on argv (the line before the report's), checked against its exit status."""
    capsys.readouterr()
    code = preflight.main(argv)
    out, err = capsys.readouterr()
    assert "Traceback" not in out + err and out.splitlines()[-1].startswith("report: "), out + err
    line = out.splitlines()[-2]
    assert code == (0 if line.startswith("go") else 1), out
    return line


def said(line):
    """What a verdict says: go, or the no-go's line (a budget's holds measured seconds: the key it names)."""
    return "go" if line.startswith("go") else line.split(" ")[2] if "train.py: max_time=" in line else line


def tiny_run(tmp_path, monkeypatch, write_csv):
    """The flags of a tiny run of one step in tmp_path (the working folder), on its CSVs."""
    monkeypatch.chdir(tmp_path)
    write_csv("train.csv", 16)
    write_csv("val.csv", 4, seed=1)
    write_csv("test.csv", 4, seed=2, test=True)
    return tiny(**{key[2:]: value for key, value in (flag.split("=") for flag in ONE_STEP)}, train_csv="train.csv",
                validation_csv="val.csv", test_csv="test.csv", out_dir="out", data_cache_dir="cache")


SITUATIONS = {  # the new user's table: each situation, as flags over a tiny run of one step (a str: in tmp_path)
    "a run that starts": [],
    "out_dir is a file": ["--out_dir=a-file"],
    "out_dir under /proc": ["--out_dir=/proc/out"],
    "out_dir under a file, which cannot be made": ["--out_dir=a-file/out"],
    "out_dir with its output quota full": ["--output_quota_dir=.", "--output_quota_gb=0.0001"],
    "a batch micro_batch_size does not divide": ["--batch_size=6", "--micro_batch_size=4"],
    "a block_size of no multiple of 8": ["--block_size=500"],
    "a misspelled key": ["--max_itres=3"],
    "a misspelled CSV": ["--train_csv=trian.csv"],
    "a sample submission of other ids": ["--predict_after=True", "--sample_submission_csv=sample.csv"],
    "GPT-2's weights out of reach": ["--init_from=gpt2"],
    "a resume with no ckpt.pt": ["--init_from=resume"],
    "a resume from a best.pt": ["--resume_from=trained/best.pt"],
    "a budget start-up spends": ["--max_time=0.001"],
    "a budget the summaries after the run take": ["--max_time=8", "--predict_after=True", "--gen_batch_size=1",
                                                  "--max_new_tokens=64", "--test_csv=many.csv"],
    "a budget with room for the run": ["--max_time=600"],
}


@pytest.mark.parametrize("situation", SITUATIONS)
def test_the_preflights_verdict_is_train_pys(tmp_path, monkeypatch, capsys, write_csv, situation):
    """Every refusal train.py gives before step 1 is the preflight's `no-go: train.py: <the same line>` (exit 1, no
    traceback), and where train.py trains the preflight says go; both run here, train.py first (the preflight's
    report is a file in out_dir). A budget's line holds seconds measured twice: the key it names is compared."""
    monkeypatch.setattr(loading, "hub_reachable", lambda: False)
    monkeypatch.setattr(loading, "in_hub_cache", lambda name: False)
    (tmp_path / "a-file").write_text("")
    (tmp_path / "sample.csv").write_text("id,summary\ntest-0000,x\n")
    base = tiny_run(tmp_path, monkeypatch, write_csv)
    if situation == "a budget the summaries after the run take":
        write_csv("many.csv", 5000, seed=3, test=True)
    if situation == "a resume from a best.pt":
        train.main([*base, "--out_dir=trained"])
    argv = [*base, *SITUATIONS[situation]]
    refused = train_verdict(capsys, argv)
    assert said(preflight_verdict(capsys, argv)) == said(refused)
    assert (refused == "go") == (situation in ("a run that starts", "a batch micro_batch_size does not divide",
                                               "a budget with room for the run"))


@pytest.mark.slow
def test_an_out_dir_another_training_run_holds_is_train_pys_no_go(tmp_path, monkeypatch, capsys, write_csv):
    """The situation of the table that needs another process: a training run holding out_dir's lock."""
    argv = tiny_run(tmp_path, monkeypatch, write_csv)
    (tmp_path / "out").mkdir()
    with held_by_another_process(tmp_path / "out") as pid:
        refused = train_verdict(capsys, argv)
        assert preflight_verdict(capsys, argv) == refused
    assert f"is in use by another training run (pid {pid} " in refused


def test_an_out_dir_it_cannot_write_is_one_line_of_its_own_not_the_disks(tmp_path, capsys):
    """The report cannot go to an out_dir that is a file: one line says so, and the verdict names out_dir, not the
    disk's room."""
    (tmp_path / "out").write_text("")
    assert preflight.main(["config/demo.py", f"--out_dir={tmp_path / 'out'}"]) == 1
    verdict, where = capsys.readouterr().out.splitlines()[-2:]
    assert verdict.startswith(f"no-go: train.py: out_dir {tmp_path / 'out'} is not writable") and "free" not in verdict
    assert where == f"report: not written to {tmp_path / 'out' / 'preflight_report.json'} (File exists): give " \
                    f"--report=<a writable path>"


def test_a_wrong_setting_is_a_no_go_whose_report_goes_to_the_out_dir_the_command_line_gives(tmp_path, capsys):
    assert preflight.main(["config/demo.py", "--max_itres=3", f"--out_dir={tmp_path / 'out'}"]) == 1
    said = report(tmp_path / "out")
    assert said["verdict"].startswith("no-go: train.py: unknown config key 'max_itres'") and "max_iters" in \
        said["verdict"] and said["go"] is False


def test_help_shows_the_preset_and_the_settings(capsys):
    with pytest.raises(SystemExit):
        preflight.main(["--help"])
    out = capsys.readouterr().out
    assert out.startswith("usage: python -m bench.preflight <preset.py> [--key=value ...]") and "train.py's settings" \
        in out


def test_the_batch_is_split_over_the_processes_the_run_is_launched_with(tmp_path):
    """--nproc_per_node: the run's processes (here two, which a batch of 15 does not split into equal shares, whatever
    micro_batch_size), checked as train.py checks them under torchrun, before the model is built."""
    argv = ["config/demo.py", f"--out_dir={tmp_path / 'out'}", f"--data_cache_dir={tmp_path / 'cache'}",
            "--batch_size=15", "--micro_batch_size=auto"]
    assert preflight.main([*argv, "--nproc_per_node=2"]) == 1
    said = report(tmp_path / "out")
    assert said["processes"] == 2 and said["checks"]["collective"]["status"] == "not run"  # no start, no collective
    assert said["verdict"].startswith("no-go: train.py: batch_size=15 does not split over the 2 processes ")


@pytest.mark.slow
def test_the_collective_tries_the_runs_nccl_settings_then_each_one_not_in_effect(monkeypatch):
    """The run's settings (a Kaggle preset's: no peer-to-peer path, no cuMem host buffers), then shared memory off:
    the order a failed start names them in (summarizer/backends.py), none tried twice."""
    for name in ("NCCL_P2P_DISABLE", "NCCL_CUMEM_HOST_ENABLE", "NCCL_SHM_DISABLE"):
        monkeypatch.delenv(name, raising=False)
    monkeypatch.setattr(preflight, "torchrun", lambda args, nproc, env, timeout: (1, "error: a failed collective"))
    said = preflight.collective(load_config([f"{REPO}/config/kaggle_t4x2.py"]), 2, "cuda", 5)
    assert said["status"] == "failed" and [t["setting"] for t in said["tried"]] == [
        "NCCL_CUMEM_HOST_ENABLE=0 NCCL_P2P_DISABLE=1", "NCCL_CUMEM_HOST_ENABLE=0 NCCL_P2P_DISABLE=1 NCCL_SHM_DISABLE=1"]


@pytest.mark.slow  # starts processes
def test_two_processes_on_a_cpu_meet_in_a_gloo_collective_that_keeps_the_users_pythonpath(tmp_path):
    """Run as a user runs it, with a PYTHONPATH of the user's own: every child process (the launcher and the
    collective's ranks) keeps it (a site folder that records each process that starts with it); the report goes to
    out_dir, the repository stays clean."""
    out, site = tmp_path / "out", tmp_path / "site"  # the report beside the run's outputs
    site.mkdir()
    seen = str(site / "seen")
    (site / "sitecustomize.py").write_text(f"import os\nopen({seen!r}, 'a').write(f'{{os.getpid()}}\\n')\n")
    result = subprocess.run([sys.executable, "-m", "bench.preflight", "config/demo.py", "--nproc_per_node=2",
                             "--micro_batch_size=16", f"--out_dir={out}", f"--data_cache_dir={tmp_path / 'cache'}"],
                            cwd=REPO, capture_output=True, text=True, timeout=HANG,
                            env={**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": str(site)})
    assert result.returncode == 0, result.stdout + result.stderr
    assert len(set((site / "seen").read_text().split())) >= 4  # preflight, torchrun, 2 collective ranks
    assert not os.path.exists(os.path.join(REPO, "preflight_report.json"))
    said = report(out)
    assert said["go"] is True and said["processes"] == 2
    assert said["verdict"] == "go: every check that ran passed (gpus not run)"
    assert said["checks"]["collective"] == {**said["checks"]["collective"], "status": "ok", "use": "gloo"}


def test_a_cuda_preset_without_a_gpu_is_a_no_go_that_says_how_to_get_one(tmp_path, monkeypatch):
    """The Kaggle preset on a machine without a GPU (an accelerator left at None) is a no-go with the line that
    fixes it, as train.py would stop at once; the disk line is the run's model's: GPT-2's (123.7M parameters as
    num_params counts them, the position table aside)."""
    monkeypatch.setattr(loading, "hub_reachable", lambda: False)  # no wait for a network this test does not need
    monkeypatch.setattr(loading, "in_hub_cache", lambda name: True)  # as where the weights were attached
    argv = ["config/kaggle_t4x2.py", f"--out_dir={tmp_path / 'out'}", f"--output_quota_dir={tmp_path / 'quota'}",
            *(f"--{key}=data/demo/{key.removesuffix('_csv')}.csv" for key in ("train_csv", "validation_csv",
                                                                              "test_csv", "sample_submission_csv"))]
    assert preflight.main(argv) == 1
    said = report(tmp_path / "out")
    assert said["verdict"] == ("no-go: gpus: device=cuda but no CUDA GPU is visible: on Kaggle, set the notebook's "
                               "accelerator to GPU T4 x2 (Settings > Accelerator) and run again; on a machine without "
                               "a GPU, add --device=cpu"), said  # what needs the GPU, not run
    assert said["checks"]["train.py"]["parameters_m"] == 123.7 and said["checks"]["train.py"]["peak_gb"] > 2, said
