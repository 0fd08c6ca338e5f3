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
from conftest import HANG, REPO, one_error_line
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
    assert list(said["checks"]) == ["versions", "gpus", "shared_memory", "train.py", "disk", "collective"]
    assert said["checks"]["train.py"]["detail"].startswith("1600 training and 100 validation examples")
    assert said["checks"]["versions"]["torch"] and said["checks"]["disk"]["status"] == "ok"


@pytest.mark.parametrize("case", ["a sample submission of other ids", "GPT-2's weights out of reach",
                                  "a misspelled CSV"])
def test_what_train_py_refuses_before_its_model_is_a_no_go_in_train_pys_own_line(tmp_path, monkeypatch, capsys,
                                                                                 case):
    """The same code as train.py's start (preparation.checked_start), so the same line: a sample_submission_csv
    whose ids are not test_csv's, init_from=gpt2 where the hub cannot be reached and the weights were never
    downloaded (an internet-off Kaggle session), a CSV that is not there."""
    sample = tmp_path / "sample_submission.csv"
    sample.write_text("id,summary\ntest-0000,x\n")
    argv = ["config/demo.py", f"--out_dir={tmp_path / 'out'}", f"--data_cache_dir={tmp_path / 'cache'}",
            {"a sample submission of other ids": f"--sample_submission_csv={sample}",
             "GPT-2's weights out of reach": "--init_from=gpt2",
             "a misspelled CSV": "--train_csv=data/demo/trian.csv"}[case]]
    monkeypatch.setattr(loading, "hub_reachable", lambda: False)
    monkeypatch.setattr(loading, "in_hub_cache", lambda name: False)
    refused = one_error_line(capsys, train.main, argv).removeprefix("error: ")
    assert preflight.main(argv) == 1
    assert report(tmp_path / "out")["verdict"] == f"no-go: train.py: {refused}"


def test_the_batch_is_split_over_the_processes_the_run_is_launched_with(tmp_path):
    """--nproc_per_node: the run's processes (here two where the demo's batch of 32 takes micro-batches of 32 on
    one), checked as train.py checks them under torchrun."""
    argv = ["config/demo.py", f"--out_dir={tmp_path / 'out'}", f"--data_cache_dir={tmp_path / 'cache'}"]
    assert preflight.main([*argv, "--nproc_per_node=2"]) == 1
    said = report(tmp_path / "out")
    assert said["processes"] == 2 and said["checks"]["collective"]["status"] == "not run"  # no start, no collective
    assert said["verdict"].startswith("no-go: train.py: batch_size=32 is not a multiple of micro_batch_size * "
                                      "world_size = 32 * 2 = 64")


@pytest.mark.slow
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


def test_a_disk_that_cannot_take_the_runs_checkpoints_is_a_no_go(tmp_path):
    cfg = load_config([f"--out_dir={tmp_path / 'out'}", f"--output_quota_dir={tmp_path}", "--output_quota_gb=0.01"])
    disk = preflight.disk(cfg, train_rows=0)
    assert disk["status"] == "failed" and "output quota" in disk["detail"]
    line = preflight.verdict({"versions": preflight.check("ok", ""), "disk": disk,
                              "gpus": preflight.check("not run", "no CUDA GPU")})
    assert line.startswith("no-go: disk: out_dir ") and "--out_dir" in line


def test_a_wrong_setting_is_one_line(capsys):
    err = one_error_line(capsys, preflight.main, ["--device=cpu", "--max_itres=3"])
    assert "unknown config key 'max_itres'" in err and "max_iters" in err


def test_a_cuda_preset_without_a_gpu_is_a_no_go_that_says_how_to_get_one(tmp_path, monkeypatch):
    """The Kaggle preset on a machine without a GPU (an accelerator left at None) is a no-go with the line that
    fixes it, as train.py would stop at once; the disk line is the run's model's: GPT-2's (123.7M parameters as
    num_params counts them, the position table aside)."""
    monkeypatch.setattr(loading, "hub_reachable", lambda: False)  # no wait for a network this test does not need
    argv = ["config/kaggle_t4x2.py", f"--out_dir={tmp_path / 'out'}", f"--output_quota_dir={tmp_path / 'quota'}"]
    assert preflight.main(argv) == 1
    said = report(tmp_path / "out")
    assert said["verdict"].startswith("no-go: gpus: device=cuda but no CUDA GPU is visible: on Kaggle, set the "
                                      "notebook's accelerator to GPU T4 x2"), said
    assert said["checks"]["disk"]["parameters_m"] == 123.7 and said["checks"]["disk"]["peak_gb"] > 2, said
