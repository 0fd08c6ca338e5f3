"""bench/preflight.py, the check a user runs first: on this CPU it runs the same code with gloo and a tiny model
(versions, /dev/shm, disk, a two-process collective, training through an evaluation and a save) and says which
checks need a GPU; a failed check is a no-go verdict and exit status 1."""
import json
import math
import os
import subprocess
import sys

import pytest
import torch

from bench import preflight
from config import load_config
from conftest import HANG, REPO, one_error_line


def test_on_a_cpu_the_preflight_runs_with_gloo_and_reports_the_gpu_checks_as_not_run(tmp_path):
    """Run as a user runs it, with a PYTHONPATH of the user's own: every child process (the collective's ranks, the
    training's launcher and ranks) keeps it (a site folder that records each process that starts with it); the
    report goes to out_dir, the repository stays clean."""
    report, site = tmp_path / "out" / "preflight_report.json", tmp_path / "site"  # beside the run's outputs
    site.mkdir()
    seen = str(site / "seen")
    (site / "sitecustomize.py").write_text(f"import os\nopen({seen!r}, 'a').write(f'{{os.getpid()}}\\n')\n")
    result = subprocess.run([sys.executable, "-m", "bench.preflight", "--device=cpu", f"--out_dir={tmp_path / 'out'}",
                             "--steps=2", "--rouge_samples=2"], cwd=REPO, capture_output=True, text=True, timeout=HANG,
                            env={**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": str(site)})
    assert result.returncode == 0, result.stdout + result.stderr
    assert len(set((site / "seen").read_text().split())) >= 6  # preflight, 2 collective ranks, torchrun, 2 ranks
    assert not os.path.exists(os.path.join(REPO, "preflight_report.json"))
    said = json.loads(report.read_text())
    checks = said["checks"]
    assert said["go"] is True and said["device"] == "cpu" and said["processes"] == 2
    assert said["verdict"] == "go: every check that ran passed (gpus, precision, decoding not run)"
    assert result.stdout.splitlines()[-2] == said["verdict"]  # the verdict is the last line before the report's path
    assert [checks[name]["status"] for name in ("gpus", "precision", "decoding")] == ["not run"] * 3
    assert checks["collective"] == {**checks["collective"], "status": "ok", "use": "gloo"}
    assert checks["versions"]["torch"] and checks["disk"]["status"] == "ok"
    training = checks["training"]
    assert training["status"] == "ok" and len(training["losses"]) == 2 and training["val_loss"] > 0


def test_a_disk_that_cannot_take_the_runs_checkpoints_is_a_no_go(tmp_path):
    cfg = load_config([f"--out_dir={tmp_path / 'out'}", f"--output_quota_dir={tmp_path}", "--output_quota_gb=0.01"])
    disk = preflight.disk(cfg, dict(preflight.TINY, vocab_size=50304))
    assert disk["status"] == "failed" and "output quota" in disk["detail"]
    line = preflight.verdict({"versions": preflight.check("ok", ""), "disk": disk,
                              "gpus": preflight.check("not run", "no CUDA GPU")})
    assert line.startswith("no-go: disk: out_dir ") and "--out_dir" in line


def test_the_decoding_check_compiles_the_runs_decoding_at_its_shapes(fresh_dynamo):
    """What the GPU runs, here on the CPU at a tiny shape: real dialogues (the demo's test.csv) through predict.py's
    summarize, in generation_batches' batches; the first batch's compile apart from the warm rate."""
    cfg = load_config(["--block_size=256", "--max_new_tokens=8", "--gen_batch_size=3", "--device=cpu",
                       "--mbr_samples=2", "--temperature=0.7", "--test_csv=data/demo/test.csv"])  # MBR's choice too
    said = preflight.decoding(cfg, dict(preflight.TINY, block_size=256), "float32", torch.device("cpu"))
    assert said["status"] == "ok" and said["compiled"] and said["prompts"] == 3 * (1 + preflight.WARM_BATCHES), said
    low, high = said["prompt_tokens"]
    assert low < high <= 256 - 8  # real lengths, cut to fit block_size
    assert said["graphs_first_batch"] >= 1 and said["summaries_per_s"] > 0
    assert said["detail"].startswith(f"15 real dialogues ({low}-{high} prompt tokens, up to 8 new): compiled in ")


def test_a_wrong_setting_is_one_line(capsys):
    err = one_error_line(capsys, preflight.main, ["--device=cpu", "--max_itres=3"])
    assert "unknown config key 'max_itres'" in err and "max_iters" in err


def test_the_precision_check_fails_on_an_overflow_and_compares_what_training_changed():
    """fp16 losses that overflowed fail; losses compared by how far each moved from the first (what training did),
    not by their size, which random weights make ln(vocab) whatever the precision."""
    reference = [10.8, 10.2, 9.5, 8.9]
    assert preflight.precision([10.8, math.inf, math.nan, 8.9], reference, "float16")["status"] == "failed"
    assert preflight.precision([10.8, 10.2, 9.49, 8.91], reference, "float16")["status"] == "ok"
    moved_less = preflight.precision([10.8, 10.6, 10.4, 10.2], reference, "float16")
    assert moved_less["status"] == "failed" and "float16 training moved the loss" in moved_less["detail"]
    still = preflight.precision([10.83, 10.83, 10.83, 10.83], [10.83] * 4, "float16")
    assert still["status"] == "not run" and "--steps" in still["detail"]


@pytest.mark.parametrize("case", ["a CUDA preset without a GPU", "a misspelled CSV"])
def test_what_the_run_cannot_start_with_is_a_no_go_before_any_training(tmp_path, case):
    """The Kaggle preset on a machine without a GPU (an accelerator left at None) is a no-go with the line that
    fixes it, as train.py would stop at once; a CSV the command names that is not there is one too. Nothing trains
    (the notebook's preflight cell stops there), and the disk line is the run's model's: GPT-2's (123.7M
    parameters as num_params counts them, the position table aside)."""
    argv = ["config/kaggle_t4x2.py", f"--out_dir={tmp_path / 'out'}", f"--output_quota_dir={tmp_path / 'quota'}"]
    if case == "a misspelled CSV":
        argv = ["config/demo.py", "--device=cpu", f"--out_dir={tmp_path / 'out'}", "--train_csv=data/demo/trian.csv"]
    result = subprocess.run([sys.executable, "-m", "bench.preflight", *argv], cwd=REPO, capture_output=True,
                            text=True, timeout=HANG, env={**os.environ, "OMP_NUM_THREADS": "1"})
    assert result.returncode == 1, result.stdout + result.stderr
    said = json.loads((tmp_path / "out" / "preflight_report.json").read_text())
    assert said["go"] is False and "training" not in said["checks"], said
    if case == "a misspelled CSV":
        assert said["verdict"].startswith("no-go: inputs: train_csv data/demo/trian.csv does not exist"), said
    else:
        assert said["verdict"].startswith("no-go: gpus: device=cuda but no CUDA GPU is visible: on Kaggle, set the "
                                          "notebook's accelerator to GPU T4 x2"), said
        assert said["checks"]["disk"]["parameters_m"] == 123.7 and said["checks"]["disk"]["peak_gb"] > 2, said
