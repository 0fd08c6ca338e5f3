"""The code paths that real users run on CUDA (Kaggle's T4: compute capability 7.5, fp16 + GradScaler, no bf16),
proven on CPU: precision from faked device properties, torch.compile (inductor) against eager, the compile
fallback, MFU's peak table, the notebook launcher's refusals, bench/gpu_check (its sections, the report after each;
fp16 against fp32). fp16's GradScaler: tests/test_fp16.py."""
import argparse
import functools
import json
import math
import os
import socket
import subprocess
import sys
import warnings

import pytest
import torch
from torch.nn.attention import SDPBackend, sdpa_kernel
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils.flop_counter import FlopCounterMode

import train
from command_line import UserError
from config import load_config
from conftest import REPO, metrics, save_csv, synthetic_rows, tiny, tiny_gpt
from generate import generate
from summarizer import preparation
from summarizer.backends import use_compile
from summarizer.checkpoint import load_checkpoint
from summarizer.loading import build_model
from summarizer.process import Process, choose_precision
from summarizer.tracking import peak_flops

# dtype and compile are each test's own; block_size=64 cuts every long dialogue (one compiled shape)
RUN = [*tiny(block_size=64, dtype=None, compile=None), "--log_interval=1", "--warmup_iters=2",
       "--learning_rate=3e-3", "--batch_size=8", "--micro_batch_size=4", "--rouge_samples=0",
       "--best_metric=val_loss", "--dropout=0.0"]


# ---- precision, compile and peak FLOPS from the device's properties -------------------------------------------

@pytest.mark.parametrize("requested, device_type, capability, expected", [
    ("auto", "cuda", (7, 5), ("float16", True)),  # T4
    ("auto", "cuda", (7, 0), ("float16", True)),  # V100
    ("auto", "cuda", (8, 0), ("bfloat16", False)),  # A100
    ("auto", "cuda", (8, 9), ("bfloat16", False)),  # L4
    ("auto", "cuda", (9, 0), ("bfloat16", False)),  # H100
    ("auto", "cpu", None, ("float32", False)),
    ("bfloat16", "cpu", None, ("bfloat16", False)),
    ("float16", "cpu", None, ("float16", True)),
    ("float32", "cuda", (7, 5), ("float32", False)),
    ("float16", "cuda", (9, 0), ("float16", True)),
])
def test_precision_is_a_function_of_the_device_properties(requested, device_type, capability, expected):
    assert choose_precision(requested, device_type, capability) == expected


def test_bfloat16_on_a_t4_is_one_clear_error():
    with pytest.raises(UserError) as info:
        choose_precision("bfloat16", "cuda", (7, 5))
    assert "\n" not in str(info.value)
    assert "compute capability >= 8.0" in str(info.value) and "7.5" in str(info.value)
    assert "--dtype=float16" in str(info.value)


@pytest.fixture
def fake_gpu(monkeypatch):
    """fake_gpu(name, capability): torch.cuda reports one such GPU (nothing runs on it); returns the allocator
    settings applied to it, in order."""
    def install(name, capability):
        monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
        monkeypatch.setattr(torch.cuda, "get_device_capability", lambda device=None: capability)
        monkeypatch.setattr(torch.cuda, "get_device_name", lambda device=None: name)
        applied = []
        monkeypatch.setattr(torch.cuda.memory, "_set_allocator_settings", applied.append)
        return applied
    return install


@pytest.mark.parametrize("name, capability, dtype, scaler, peak", [
    ("Tesla T4", (7, 5), "float16", True, 65e12),
    ("Tesla V100-SXM2-16GB", (7, 0), "float16", True, 125e12),
    ("NVIDIA A100-SXM4-40GB", (8, 0), "bfloat16", False, 312e12),
])
def test_runtime_reads_precision_compile_and_peak_from_the_gpu(fake_gpu, name, capability, dtype, scaler, peak):
    fake_gpu(name, capability)
    proc = Process(load_config(["--device=cuda", "--backend=none"]))
    assert (proc.device.type, proc.dtype, proc.use_scaler, proc.compile) == ("cuda", dtype, scaler, True)
    assert peak_flops(proc.device_name, proc.dtype) == peak


def test_runtime_refuses_bfloat16_on_a_t4(fake_gpu):
    fake_gpu("Tesla T4", (7, 5))
    with pytest.raises(UserError, match="compute capability >= 8.0"):
        Process(load_config(["--device=cuda", "--dtype=bfloat16"]))


def test_cpu_is_float32_and_not_compiled_unless_asked():
    proc = Process(load_config(["--device=cpu"]))
    assert (proc.dtype, proc.use_scaler, proc.compile) == ("float32", False, False)
    proc = Process(load_config(["--device=cpu", "--dtype=bfloat16", "--compile=True"]))
    assert (proc.dtype, proc.use_scaler, proc.compile) == ("bfloat16", False, True)


@pytest.mark.parametrize("preset", ["kaggle_t4x2", "kaggle_t4x2_gpt2-medium", "kaggle_t4x2_gpt2-large",
                                    "kaggle_t4x2_gpt2-xl"])
def test_a_kaggle_preset_tried_on_a_cpu_trains_in_float32_and_chooses_float16_on_a_t4(preset, capsys):
    path = os.path.join(REPO, "config", f"{preset}.py")
    proc = Process(load_config([path, "--device=cpu", "--backend=none"]))
    assert (proc.dtype, proc.use_scaler, proc.compile) == ("float32", False, False)
    cfg = load_config([path])
    assert choose_precision(cfg.dtype, "cuda", (7, 5)) == ("float16", True) and cfg.compile == "auto"
    assert "float16" not in capsys.readouterr().err


def test_float16_asked_for_on_a_cpu_says_in_one_line_that_it_is_emulated(capsys):
    proc = Process(load_config(["--device=cpu", "--dtype=float16"]))
    assert proc.dtype == "float16"
    lines = capsys.readouterr().err.strip().splitlines()
    assert len(lines) == 1 and "float16" in lines[0] and "emulated" in lines[0] and "--dtype=float32" in lines[0]


@pytest.mark.parametrize("requested, device_type, expected", [
    ("auto", "cuda", True), ("auto", "cpu", False), (True, "cpu", True), (False, "cuda", False)])
def test_compile_auto_means_on_cuda_only(requested, device_type, expected):
    assert use_compile(requested, device_type) is expected


ALLOC_CONF = ("PYTORCH_ALLOC_CONF", "PYTORCH_CUDA_ALLOC_CONF")


def test_the_cuda_allocator_uses_expandable_segments_unless_the_user_configured_it(fake_gpu, monkeypatch):
    """Through torch's own setter, with no variable: torch 2.8-2.11 warn that PYTORCH_CUDA_ALLOC_CONF is deprecated
    (every rank of every command would), and some ignore PYTORCH_ALLOC_CONF's expandable_segments (pytorch#183387).
    The user's variable, by either name, wins."""
    for name in ALLOC_CONF:
        monkeypatch.delenv(name, raising=False)
    applied = fake_gpu("Tesla T4", (7, 5))
    Process(load_config(["--device=cpu"]))
    assert applied == []
    Process(load_config(["--device=cuda", "--backend=none"]))
    assert applied == ["expandable_segments:True"] and not set(ALLOC_CONF) & os.environ.keys()
    for name in ALLOC_CONF:
        with monkeypatch.context() as patched:
            patched.setenv(name, "max_split_size_mb:128")
            Process(load_config(["--device=cuda", "--backend=none"]))
            assert applied == ["expandable_segments:True"] and os.environ[name] == "max_split_size_mb:128"


def test_the_allocator_setting_warns_on_no_release(fake_gpu, monkeypatch, recwarn):
    """torch 2.13 deprecates the setter's name for torch._C's (2.7 has no such): the release's own setter is called,
    its FutureWarning, as 2.13 words it, silenced."""
    applied = fake_gpu("Tesla T4", (7, 5))

    def deprecated(settings):
        warnings.warn("torch.cuda._set_allocator_settings is deprecated. Use "
                      "torch._C._accelerator_setAllocatorSettings instead.", FutureWarning, stacklevel=2)
        applied.append(settings)
    monkeypatch.setattr(torch.cuda.memory, "_set_allocator_settings", deprecated)
    for name in ALLOC_CONF:
        monkeypatch.delenv(name, raising=False)
    Process(load_config(["--device=cuda", "--backend=none"]))
    assert applied == ["expandable_segments:True"] and not recwarn.list


def test_nccl_variables_are_set_only_when_asked(monkeypatch):
    """nccl_p2p_disable (every Kaggle preset's): no peer-to-peer path, and no cuMem host buffers for the shared-memory
    transport (NCCL >= 2.24 fails its first collective with them on GPUs without peer access, NVIDIA/nccl#1838)."""
    for name in ("NCCL_P2P_DISABLE", "NCCL_CUMEM_HOST_ENABLE", "NCCL_IB_DISABLE"):
        monkeypatch.setenv(name, "")  # restored as they were after the test, Process's setting included
        monkeypatch.delenv(name)
    Process(load_config(["--device=cpu"]))
    assert not {"NCCL_P2P_DISABLE", "NCCL_CUMEM_HOST_ENABLE", "NCCL_IB_DISABLE"} & os.environ.keys()
    Process(load_config(["--device=cpu", "--nccl_p2p_disable=True"]))
    assert (os.environ["NCCL_P2P_DISABLE"], os.environ["NCCL_CUMEM_HOST_ENABLE"]) == ("1", "0")
    assert "NCCL_IB_DISABLE" not in os.environ  # across nodes: InfiniBand
    Process(load_config(["--device=cpu", "--nccl_ib_disable=True"]))
    assert os.environ["NCCL_IB_DISABLE"] == "1"
    monkeypatch.setenv("NCCL_P2P_DISABLE", "0")  # the user's own environment wins
    monkeypatch.setenv("NCCL_CUMEM_HOST_ENABLE", "1")
    Process(load_config(["--device=cpu", "--nccl_p2p_disable=True"]))
    assert (os.environ["NCCL_P2P_DISABLE"], os.environ["NCCL_CUMEM_HOST_ENABLE"]) == ("0", "1")


@pytest.mark.parametrize("name, dtype, tflops", [
    ("Tesla T4", "float16", 65), ("Tesla T4", "float32", 8.1), ("Tesla T4", "bfloat16", None),
    ("Tesla V100-PCIE-16GB", "float16", 125), ("Tesla V100-SXM2-32GB", "bfloat16", None),
    ("NVIDIA A10", "bfloat16", 125), ("NVIDIA L4", "float16", 121),
    ("NVIDIA A100-SXM4-80GB", "bfloat16", 312), ("NVIDIA A100 80GB PCIe", "float32", 19.5),
    ("NVIDIA H100 80GB HBM3", "bfloat16", 989), ("NVIDIA H100 PCIe", "bfloat16", 756),
    ("NVIDIA H200", "float16", 989),
    ("NVIDIA L40S", "bfloat16", None), ("NVIDIA A10G", "float16", None), ("NVIDIA GeForce RTX 4090", "float16", None),
    ("cpu", "float32", None),
])
def test_peak_flops_by_device_name_and_dtype(name, dtype, tflops):
    assert peak_flops(name, dtype) == (None if tflops is None else pytest.approx(tflops * 1e12))


def test_training_flops_match_pytorchs_flop_counter():
    """MFU's numerator: the matmul FLOPs of forward + backward, lm_head at the targets only."""
    torch.manual_seed(0)
    model = tiny_gpt(block_size=64, vocab_size=256, bias=False)
    x = torch.randint(0, 256, (3, 48))
    y = torch.full_like(x, -1)
    y[:, -10:] = x[:, -10:]
    with sdpa_kernel(SDPBackend.MATH), FlopCounterMode(display=False) as count:
        _, loss = model(x, y)
        loss.backward()
    # LayerNorm weights count as 6 FLOPs per token in the formula but are no matmul: 0.6% here.
    assert model.training_flops(tokens=3 * 48, targets=3 * 10, attended=3 * 48**2) == \
        pytest.approx(count.get_total_flops(), rel=0.01)


# ---- torch.compile on CPU (inductor) ------------------------------------------------------------------------

@pytest.fixture(scope="module")
def long_dialogues(tmp_path_factory):
    """Dialogues longer than block_size, so every training row is cut to it: one shape, one compilation."""
    folder = tmp_path_factory.mktemp("compile")
    rows = [dict(row, dialogue="\n".join([row["dialogue"]] * 3)) for row in synthetic_rows(48, seed=2)]
    save_csv(folder / "train.csv", rows)
    return folder


def compile_args(folder):
    return [*RUN, f"--train_csv={folder / 'train.csv'}", f"--data_cache_dir={folder / 'cache'}", "--eval_interval=2",
            "--lr_decay_iters=6"]  # the same schedule however many steps a run stops after


@pytest.fixture(scope="module")
def eager_run(long_dialogues):
    out = long_dialogues / "eager"
    train.main([*compile_args(long_dialogues), "--compile=False", "--max_iters=6", f"--out_dir={out}"])
    return metrics(out)


@pytest.fixture(scope="module")
def compiled_then_eager_then_compiled(long_dialogues):
    """Six steps: two compiled, two eager resumed from the compiled run's checkpoint, two compiled resumed from
    the eager run's checkpoint. Returns the metrics and the CompiledModules the runs made."""
    out = long_dialogues / "mixed"
    returned = []
    real_compiled_module = preparation.CompiledModule
    preparation.CompiledModule = lambda module: returned.append(real_compiled_module(module)) or returned[-1]
    try:
        for compile, iters, init in [(True, 2, "scratch"), (False, 4, "resume"), (True, 6, "resume")]:
            train.main([*compile_args(long_dialogues), f"--compile={compile}", f"--max_iters={iters}",
                        f"--init_from={init}", f"--out_dir={out}"])
    finally:
        preparation.CompiledModule = real_compiled_module
    return metrics(out), returned, out


@pytest.mark.slow
def test_compiled_training_matches_eager_across_checkpoints(eager_run, compiled_then_eager_then_compiled):
    mixed, returned, _ = compiled_then_eager_then_compiled
    assert len(returned) == 2 and not any(m.why for m in returned)
    assert [r["iter"] for r in mixed] == [r["iter"] for r in eager_run] == [1, 2, 3, 4, 5, 6]
    for got, expected in zip(mixed, eager_run, strict=True):
        for key in ("loss", "val_loss"):
            if key in expected:
                assert got[key] == pytest.approx(expected[key], abs=1e-4), (key, got["iter"])


def test_cpu_logs_tokens_per_second_and_no_mfu(eager_run):
    assert all(r["tokens_per_s"] > 0 and "mfu" not in r for r in eager_run)


@pytest.mark.slow
def test_checkpoint_of_a_compiled_model_loads_into_an_eager_one(compiled_then_eager_then_compiled):
    _, _, out = compiled_then_eager_then_compiled
    ckpt = load_checkpoint(str(out / "ckpt.pt"))  # written by the last, compiled, run
    assert ckpt["iter_num"] == 6 and ckpt["config"]["compile"] is True
    assert not any(k.startswith(("_orig_mod.", "module.")) for k in ckpt["model"])
    model, _ = build_model(str(out / "ckpt.pt"))  # strict load_state_dict
    assert all(torch.equal(v, ckpt["model"][k]) for k, v in model.state_dict().items())


# ---- a compile that fails falls back to eager (placed last: it fakes torch.compile) ----------------------------

@pytest.fixture
def broken_compiler(monkeypatch):
    """torch.compile as it fails on a machine without a working compiler: lazily, at the first call."""
    def crash(graph_module, example_inputs):
        raise RuntimeError("simulated compiler crash")
    real_compile = torch.compile
    monkeypatch.setattr(torch, "compile", lambda fn, **kwargs: real_compile(fn, **kwargs, backend=crash))


def warnings_in(err):
    return [line for line in err.splitlines() if "torch.compile failed" in line]


def test_failed_training_compile_warns_once_and_trains_eagerly(long_dialogues, eager_run, broken_compiler, capfd):
    out = long_dialogues / "fallback"
    train.main([*compile_args(long_dialogues), "--compile=True", "--max_iters=2", f"--out_dir={out}"])
    assert warnings_in(capfd.readouterr().err) == [
        "warning: torch.compile failed (RuntimeError: simulated compiler crash); training eagerly from now on "
        "(tokens_per_s and mfu are eager's)"]
    for got, expected in zip(metrics(out), eager_run[:2], strict=True):
        assert got["loss"] == expected["loss"]


# ---- Kaggle notebook ----------------------------------------------------------------------------------------

NOTEBOOK_ARGS = ["--device=cpu", "--init_from=scratch"]


def one_error_line(capsys, exit_info):
    assert exit_info.value.code == 2
    err = capsys.readouterr().err.strip()
    assert err.startswith("error: ") and "\n" not in err
    return err


def test_notebook_refuses_when_cuda_was_initialised_before_launching(monkeypatch, capsys):
    import accelerate
    monkeypatch.setattr(torch.cuda, "is_initialized", lambda: True)
    monkeypatch.setattr(accelerate, "notebook_launcher", lambda *a, **k: pytest.fail("launched anyway"))
    with pytest.raises(SystemExit) as exit_info:
        train.notebook_main(NOTEBOOK_ARGS)
    err = one_error_line(capsys, exit_info)
    assert "CUDA was already initialised" in err and "restart the kernel" in err


def test_notebook_surfaces_accelerates_own_check_in_one_line(monkeypatch, capsys):
    from accelerate.state import AcceleratorState
    monkeypatch.setattr(AcceleratorState, "_shared_state", {"initialized": True})  # an Accelerator made in a cell
    with pytest.raises(SystemExit) as exit_info:
        train.notebook_main(NOTEBOOK_ARGS)
    err = one_error_line(capsys, exit_info)
    assert "Accelerator" in err and "restart the kernel" in err


def test_notebook_explains_a_port_in_use(capsys):
    with socket.socket() as taken:
        taken.bind(("", 0))
        taken.listen()
        port = taken.getsockname()[1]
        with pytest.raises(SystemExit) as exit_info:
            train.notebook_main(NOTEBOOK_ARGS, port=port)
    err = one_error_line(capsys, exit_info)
    assert f"port {port} is in use" in err


def test_notebook_checks_the_arguments_before_launching(monkeypatch, capsys):
    import accelerate
    monkeypatch.setattr(accelerate, "notebook_launcher", lambda *a, **k: pytest.fail("launched anyway"))
    with pytest.raises(SystemExit) as exit_info:
        train.notebook_main(["--lerning_rate=1e-3"])
    assert "did you mean 'learning_rate'?" in one_error_line(capsys, exit_info)


def test_notebook_worker_failures_add_no_launcher_traceback(monkeypatch, capsys):
    import accelerate
    from torch.distributed.elastic.multiprocessing.errors import ChildFailedError, ProcessFailure

    def failing(exitcode):
        def launcher(*args, **kwargs):
            raise ChildFailedError("train.main", {rank: ProcessFailure(rank, 100 + rank, exitcode, "")
                                                  for rank in (0, 1)})
        return launcher
    monkeypatch.setattr(accelerate, "notebook_launcher", failing(2))  # the workers printed their user error
    with pytest.raises(SystemExit) as exit_info:
        train.notebook_main(NOTEBOOK_ARGS)
    assert exit_info.value.code == 2 and capsys.readouterr().err == ""
    monkeypatch.setattr(accelerate, "notebook_launcher", failing(1))
    with pytest.raises(SystemExit) as exit_info:
        train.notebook_main(NOTEBOOK_ARGS)
    assert "rank(s) 0, 1" in one_error_line(capsys, exit_info)


def test_a_forked_worker_that_cannot_use_cuda_says_to_use_torchrun(monkeypatch, capsys):
    def forked(*args):
        raise RuntimeError("Cannot re-initialize CUDA in forked subprocess. To use CUDA with multiprocessing, ...")
    monkeypatch.setattr(train, "prepare", forked)
    monkeypatch.setenv("RANK", "1")
    with pytest.raises(SystemExit) as exit_info:
        train.main(NOTEBOOK_ARGS)
    err = capsys.readouterr().err
    assert exit_info.value.code == 1 and "Traceback" not in err and err.count("\n") == 1
    assert err.startswith("error (rank 1): ") and "CUDA" in err and "torchrun" in err


# ---- bench/gpu_check ----------------------------------------------------------------------------------------

def test_the_report_is_written_after_each_section_and_keeps_what_finished(tmp_path):
    """Each section is a command within its seconds: the report is on disk before the next one starts (the second
    reads it), a failing section and one out of time are said so, and the sections after them still run."""
    from bench import gpu_check
    report, python = tmp_path / "report.json", [sys.executable, "-c"]
    seen = ("import json, sys; sections = json.load(open(sys.argv[1]))['sections']; "
            "print(json.dumps({'figure': 'seen', 'value': list(sections)}))")
    sections = [("first", [*python, "print('{\"figure\": \"cut_speedup_vs_uncut\", \"value\": 1.5}')"], 60, None),
                ("second", [*python, seen, str(report)], 60, None),
                ("fails", [*python, "raise SystemExit(3)"], 60, None),
                ("hangs", [*python, "import time; print('started', flush=True); time.sleep(60)"], 2, None),
                ("after", [*python, "print('done')"], 60, None)]
    done = gpu_check.run_check(sections, str(report), dict(quick=True))
    assert done == json.loads(report.read_text()) and not done["passed"]
    found = done["sections"]
    assert list(found) == ["first", "second", "fails", "hangs", "after"]
    assert found["second"]["rows"] == [{"figure": "seen", "value": ["first"]}]
    assert [found[name]["status"] for name in found] == [
        "ok", "ok", "failed (exit status 3)", "timed out after 2 s", "ok"]
    assert "started" in found["hangs"]["output"] and found["hangs"]["seconds"] < 30
    figures = {f["figure"]: f for f in done["figures"]}
    assert figures["cut micro-batches / one uncut, real tokens/s"] == dict(
        figure="cut micro-batches / one uncut, real tokens/s", value=1.5, target=">= 1.3", met=True)
    assert figures["decode ms a step"]["value"] is None  # a figure no section gave


def test_the_quick_plan_fits_eight_minutes_and_runs_graphs_the_readmes_path_then_bench(tmp_path):
    from bench import gpu_check
    args = argparse.Namespace(quick=True, samsum_csv="/data/samsum.csv", device="cuda", report=str(tmp_path / "r.json"),
                              model="gpt2", dtypes="float32", compile="False", iters=3, micro_batch_size=8, presets="")
    sections = gpu_check.plan(args, "/tmp/run")
    assert [name for name, *_ in sections] == ["graphs", "preflight", "train", "evaluate", "predict", "bench train",
                                              "bench generate"]
    assert sum(limit for _, _, limit, _ in sections) <= 450  # with the start, within 8 minutes
    argv = {name: " ".join(argv) for name, argv, *_ in sections}
    assert "train.py config/kaggle_t4x2.py --init_from=scratch --train_csv=/data/samsum.csv" in argv["train"]
    assert f"--max_time={gpu_check.QUICK_MAX_TIME}" in argv["train"]
    assert gpu_check.QUICK_MAX_TIME < gpu_check.QUICK["train"]  # its start and its save fit the section's seconds
    assert "evaluate.py config/kaggle_t4x2.py --out_dir=/tmp/run/run" in argv["evaluate"]
    assert "predict.py config/kaggle_t4x2.py --out_dir=/tmp/run/run" in argv["predict"]
    assert "--test_csv=/data/samsum.csv" in argv["predict"]
    assert "bench.preflight config/kaggle_t4x2.py" in argv["preflight"]
    assert f"--report={tmp_path / 'preflight_report.json'}" in argv["preflight"]  # beside the check's own
    assert "bench.gpu_check" in argv["graphs"] and "--part=graphs" in argv["graphs"]
    assert all("--json" in argv[f"bench {s}"] and f"--section={s}" in argv[f"bench {s}"] for s in ("train", "generate"))
    assert sections[2][3] == "/tmp/run/run/metrics.jsonl"  # train.py's padded_fraction and micro_batches
    full = gpu_check.plan(argparse.Namespace(**dict(vars(args), quick=False)), "/tmp/run")
    assert [name for name, *_ in full][5:] == ["bench", "matrix", "presets"] and full[0][2] is None


@pytest.mark.slow
def test_gpu_check_script_parses_and_its_matrix_runs_on_cpu(capsys):
    assert subprocess.run(["bash", "-n", os.path.join(REPO, "bench", "gpu_check.sh")]).returncode == 0
    from bench import gpu_check
    assert gpu_check.main(["--part=matrix", "--device=cpu", "--model=tiny", "--dtypes=float32,float16",
                           "--compile=False", "--iters=2", "--max_new_tokens=8"]) == 0
    rows = [json.loads(line) for line in capsys.readouterr().out.splitlines()]
    cases = [row for row in rows if row["figure"] in ("float32 eager", "float16 eager")]
    assert [row["dtype"] for row in cases] == ["float32", "float16"]
    for row in cases:
        assert row["compile"] is False and row["train_tokens_per_s"] > 0 and row["train_mfu"] is None  # no MFU on CPU
        assert ("GradScaler" in row["note"]) == (row["dtype"] == "float16")
    assert any(row["figure"] == "check: float16 eager: losses against float32" for row in rows)


def test_the_precision_trial_fails_on_an_overflow_and_compares_what_training_changed():
    """fp16 losses that overflowed fail; losses compared by how far each moved from the first (what training did),
    not by their size, which random weights make ln(vocab) whatever the precision."""
    from bench import gpu_check
    reference = [10.8, 10.2, 9.5, 8.9]
    assert gpu_check.precision([10.8, math.inf, math.nan, 8.9], reference, "float16")["status"] == "failed"
    assert gpu_check.precision([10.8, 10.2, 9.49, 8.91], reference, "float16")["status"] == "ok"
    moved_less = gpu_check.precision([10.8, 10.6, 10.4, 10.2], reference, "float16")
    assert moved_less["status"] == "failed" and "float16 training moved the loss" in moved_less["detail"]
    still = gpu_check.precision([10.83, 10.83, 10.83, 10.83], [10.83] * 4, "float16")
    assert still["status"] == "not run" and "--iters" in still["detail"]


@pytest.mark.parametrize("graphed, why", [(True, None), (False, "capture failed (RuntimeError: operation not "
                                                           "permitted when stream is capturing)")])
def test_the_check_fails_where_greedy_steps_ran_eagerly_and_says_why(tmp_path, graphed, why):
    """bench generate's decode_ms_per_step says whether its steps ran as CUDA graphs: where they fell back to eager,
    every section passing does not pass the check, and the report says why."""
    from bench import gpu_check
    row = dict(figure="decode_ms_per_step", value=0.4 if graphed else 9.0, graphed=graphed, eager_why=why)
    sections = [("bench generate", [sys.executable, "-c", f"print({json.dumps(json.dumps(row))})"], 60, None)]
    done = gpu_check.run_check(sections, str(tmp_path / "report.json"), dict(quick=True))
    figures = {f["figure"]: f for f in done["figures"]}
    assert done["sections"]["bench generate"]["status"] == "ok" and done["passed"] is graphed
    assert figures["decode steps as CUDA graphs"] == dict(figure="decode steps as CUDA graphs", value=graphed,
                                                          target="== True", met=graphed)
    assert figures["why decode steps ran eagerly"]["value"] == why


@pytest.mark.slow
def test_without_a_gpu_the_check_says_so_in_one_line_and_writes_nothing(tmp_path):
    from bench import gpu_check

    def written():  # the repository's changed and untracked files, and the default reports'
        reports = [gpu_check.REPORT, os.path.join(os.path.dirname(gpu_check.REPORT), "preflight_report.json")]
        return subprocess.run(["git", "status", "--porcelain"], cwd=REPO, capture_output=True, text=True).stdout, [
            os.path.exists(path) and os.path.getmtime(path) for path in reports]
    before = written()
    done = subprocess.run(["bash", os.path.join(REPO, "bench", "gpu_check.sh"), "--quick"], cwd=tmp_path,
                          env=dict(os.environ, CUDA_VISIBLE_DEVICES=""), capture_output=True, text=True, timeout=60)
    assert done.returncode == 2 and done.stdout == "" and done.stderr == (
        "gpu_check: no CUDA GPU is visible (torch.cuda.is_available() is False): run it on a GPU machine\n")
    assert list(tmp_path.iterdir()) == [] and written() == before
    assert subprocess.run(["git", "check-ignore", "-q", gpu_check.REPORT], cwd=REPO).returncode == 0  # out*/


# ---- bench/gpu_check's graph part, on the CPU: generate's graph API faked -----------------------------------------

class Graph:
    """A CUDA graph's stand-in: recorded once under NoHostReads (a capture fails where the step reads the host),
    replay() writes into the recorded output what the step computes now."""

    def __init__(self, step):
        with NoHostReads():
            self.step, self.output = step, step()

    def replay(self):
        self.output.copy_(self.step())


class NoHostReads(TorchDispatchMode):
    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        if func in (torch.ops.aten.item.default, torch.ops.aten._local_scalar_dense.default):
            raise RuntimeError("operation not permitted when stream is capturing")
        return func(*args, **(kwargs or {}))


class StepGraphs:
    """generate.StepGraphs' API, one bucket a call: the prompts' forward as the step, captured at its first use by
    `capture`; a capture that raises decodes eagerly from then on, eager_why says why."""

    def __init__(self, capture, error_line):
        self.capture, self.error_line, self.eager_why, self.capture_seconds = capture, error_line, None, {}

    def decode(self, model, prompts):
        bucket = (len(prompts), 64 * -(-len(prompts[0]) // 64))
        if self.eager_why is None and bucket not in self.capture_seconds:
            try:
                self.capture(lambda: model(torch.tensor(prompts))[0])
                self.capture_seconds[bucket] = 0.25
            except RuntimeError as e:
                self.eager_why = f"capture failed ({self.error_line(e)})"


@pytest.fixture
def graph_api(monkeypatch):
    """generate's graph API on a CPU (capture_graph, StepGraphs, generate(graphs=)) and the current stream; the
    capture a test sets as capture[0] (a capture that leaves the capture stream current: leaking=True)."""
    import generate as generate_module
    streams = ["default"]

    def capture_graph(step, stream=None, leaking=False):
        expected = step()
        try:
            graph = Graph(step)
        except RuntimeError:
            streams.append("capture") if leaking else None
            raise
        return graph, graph.output, expected

    def fake_generate(model, prompts, decoding, eos_token_id, graphs=None):
        graphs and graphs.decode(model, prompts)
        return generate(model, prompts, decoding, eos_token_id=eos_token_id)
    monkeypatch.setattr(torch.cuda, "current_stream", lambda device=None: streams[-1])
    monkeypatch.setattr(generate_module, "capture_graph", capture_graph, raising=False)
    monkeypatch.setattr(generate_module, "StepGraphs", StepGraphs, raising=False)
    monkeypatch.setattr(generate_module, "generate", fake_generate)
    return monkeypatch, generate_module, capture_graph


def graph_section():
    from bench import gpu_check
    torch.manual_seed(0)
    model = tiny_gpt(block_size=64).eval()
    batches = [torch.randint(0, 64, shape).tolist() for shape in ((8, 10), (4, 20))]
    rows, found = gpu_check.graph_checks(model, batches, torch.device("cpu"))
    return rows, {check["figure"].removeprefix("graphs: "): check for check in found}


def test_the_graph_section_proves_capture_fallback_stream_and_speed(graph_api):
    rows, checks = graph_section()
    assert all(check["passed"] for check in checks.values())
    assert checks["captured after it, every bucket"]["value"] == ["8x64", "4x64"]
    assert "operation not permitted when stream is capturing" in checks[
        "a capture that reads the host falls back, the stream kept"]["value"]
    assert [row["figure"] for row in rows] == ["graphs: 8x64", "graphs: 4x64"]
    for row in rows:
        assert row["capture_s"] == 0.25 and row["replay_ms"] > 0 and row["eager_ms"] > 0
        assert "aten::scaled_dot_product_attention" in row["replay_kernels"] == row["eager_kernels"]


def test_the_graph_section_fails_where_a_failed_capture_leaves_the_capture_stream(graph_api):
    monkeypatch, generate_module, capture_graph = graph_api
    monkeypatch.setattr(generate_module, "capture_graph", functools.partial(capture_graph, leaking=True))
    _, checks = graph_section()
    assert not checks["a capture that reads the host falls back, the stream kept"]["passed"]
    assert not checks["the stream after capture is the one before"]["passed"]


def test_the_graph_section_fails_and_says_why_where_every_capture_fails(graph_api):
    from bench import gpu_check
    monkeypatch, generate_module, capture_graph = graph_api
    monkeypatch.setattr(generate_module, "capture_graph",
                        lambda step, stream=None: capture_graph(gpu_check.reading_host(step)))
    rows, checks = graph_section()
    assert rows == [] and not checks["captured after it, every bucket"]["passed"]
    assert checks["captured after it, every bucket"]["value"].startswith("capture failed (RuntimeError: operation")
