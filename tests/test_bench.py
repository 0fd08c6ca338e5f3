"""python -m bench's own behaviour (its figures are benchmarks, not tests): a line on stderr as each stage of a
section starts, and whether greedy's steps ran as CUDA graphs, said beside decode_ms_per_step."""
import os
import types

import torch

from bench import __main__ as bench_main
from bench import memory as bench_memory
from config import load_config
from conftest import REPO


def test_timed_stages_say_so_on_stderr_and_keep_stdout_for_figures(capsys):
    bench_main.interleaved({"ours": lambda: 1, "transformers": lambda: 2}, torch.device("cpu"), repeats=2)
    out, err = capsys.readouterr()
    assert out == "" and err.splitlines() == ["bench: ours: warm-up", "bench: transformers: warm-up",
                                              "bench: ours, transformers: round 1 of 2",
                                              "bench: ours, transformers: round 2 of 2"]


def test_decode_figures_say_whether_steps_were_graphed_and_why_not():
    assert bench_main.graph_figures(None, torch.device("cpu")) == (
        dict(graphed=False, eager_why="CUDA graphs need a GPU: cpu steps run eagerly"), None)
    graphs = types.SimpleNamespace(eager_why=None, capture_seconds={(8, 64): 0.5, (16, 128): 0.75})
    assert bench_main.graph_figures(graphs, torch.device("cuda")) == (
        dict(graphed=True, eager_why=None), {"8x64": 0.5, "16x128": 0.75})
    graphs.eager_why = "capture failed (RuntimeError: operation not permitted when stream is capturing)"
    assert bench_main.graph_figures(graphs, torch.device("cuda"))[0] == dict(graphed=False, eager_why=graphs.eager_why)


def test_the_gpu_check_and_the_memory_section_count_the_workload_a_run_builds():
    """bench/gpu_check.py's predicted training peak and the memory section's ledger come from one builder
    (bench.memory.preset_run), which builds a preset's model as train.py's prepare does: the LoRA preset's frozen
    base Linear weights in fp16, its adapters in float32 (gpu_check counted them in float32)."""
    cfg = load_config([os.path.join(REPO, "config", "kaggle_t4x2_gpt2-xl.py")])
    run = bench_memory.preset_run("gpt2-xl", cfg, (256, 60, 190), ranks=1)
    frozen = {p.dtype for n, p in run.model.transformer.h.named_parameters() if n.endswith("base_layer.weight")}
    assert frozen == {torch.float16} and {p.dtype for p in run.model.parameters() if p.requires_grad} == {torch.float32}
    assert (run.backend, run.world_size, run.longest_row) == ("none", 1, 256)
