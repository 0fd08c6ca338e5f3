"""torch.compile falls back to eager at any point of a run: a recompile limit or a compiler error in the training
step after its first compile is one warning line and the run finishes (decoding is not compiled; greedy's CUDA
graphs fall back on their own: tests/test_step_graphs.py); under FSDP the start line says the training step runs
eagerly."""

import pytest
import torch

import train
from conftest import metrics, run, tiny, torchrun
from summarizer import backends


@pytest.fixture
def args(write_csv, tmp_path):
    return [*tiny(compile=True), f"--train_csv={write_csv('train.csv', 40)}", f"--data_cache_dir={tmp_path / 'cache'}",
            f"--out_dir={tmp_path / 'out'}", "--batch_size=4", "--micro_batch_size=4", "--max_iters=3",
            "--eval_interval=1", "--eval_val_batches=1", "--val_fraction=0.2", "--rouge_samples=2", "--log_interval=1",
            "--sample_submission_csv="]


def warnings(capsys):
    return [line for line in capsys.readouterr().err.splitlines() if line.startswith("warning: torch.compile")]


def before_step(monkeypatch, at, change):
    """change(trainer) runs before 0-based step `at` (after the first evaluation, whose decoding compiled)."""
    step = train.Trainer.train_step

    def changed_step(trainer, it):
        if it == at:
            change(trainer)
        return step(trainer, it)
    monkeypatch.setattr(train.Trainer, "train_step", changed_step)


@pytest.mark.slow
def test_a_recompile_limit_after_step_1_trains_eagerly_to_the_end(args, tmp_path, capsys, monkeypatch, fresh_dynamo):
    """With a limit of one graph (torch._dynamo.config.recompile_limit), fullgraph raises FailOnRecompileLimitHit
    at the first recompile, after a value the compiled step guards on changed before step 2."""
    def flip(trainer):  # checkpointing is read by GPT.forward
        trainer.model.gradient_checkpointing = True
    before_step(monkeypatch, 1, flip)
    with torch._dynamo.config.patch(recompile_limit=1):
        train.main([*args, "--rouge_samples=3", "--gen_batch_size=2"])
    said = warnings(capsys)
    assert len(said) == 1 and "FailOnRecompileLimitHit" in said[0], said
    assert said[0].endswith("training eagerly from now on (tokens_per_s and mfu are eager's)")
    assert [row["iter"] for row in metrics(tmp_path / "out")] == [1, 2, 3]


@pytest.mark.slow
def test_a_compiler_error_after_step_1_trains_eagerly_to_the_end(args, tmp_path, capsys, monkeypatch, fresh_dynamo):
    """After step 1 the compiled code is dropped and inductor fails from then on (as a T4's Triton may at a new
    shape): training compiles again, fails, and goes on eagerly, with the losses eager gives."""
    import torch._inductor.compile_fx as compile_fx

    def failing(*args, **kwargs):
        raise RuntimeError("forced compiler error")

    def break_compiler(trainer):
        torch._dynamo.reset()
        monkeypatch.setattr(compile_fx, "compile_fx", failing)
    before_step(monkeypatch, 1, break_compiler)
    train.main(args)
    said = warnings(capsys)
    assert len(said) == 1 and "forced compiler error" in said[0] and "training eagerly from now on" in said[0], said
    compiled = metrics(tmp_path / "out")
    monkeypatch.undo()
    train.main([*args, "--compile=False", f"--out_dir={tmp_path / 'eager'}"])
    eager = metrics(tmp_path / "eager")
    assert [row["iter"] for row in compiled] == [1, 2, 3]
    assert [row["loss"] for row in compiled] == pytest.approx([row["loss"] for row in eager], abs=1e-4)


@pytest.mark.slow
def test_a_compiler_error_in_the_backward_graph_after_step_1_trains_eagerly_to_the_end(args, tmp_path, capsys,
                                                                                       monkeypatch, fresh_dynamo):
    """Inductor fails on backward graphs only, from step 2 on: AOTAutograd compiles the backward at the forward
    (not lazily at loss.backward(), past the fallback), so the failure is one warning and training goes on eagerly."""
    import torch._inductor.compile_fx as compile_fx
    real_compile_fx, real_inner = compile_fx.compile_fx, compile_fx.compile_fx_inner

    def failing_backward(*args, **kwargs):
        if kwargs.get("is_backward"):
            raise RuntimeError("forced backward compiler error")
        return real_inner(*args, **kwargs)

    def break_backward(trainer):
        torch._dynamo.reset()
        monkeypatch.setattr(compile_fx, "compile_fx",
                            lambda *a, **k: real_compile_fx(*a, **{**k, "inner_compile": failing_backward}))
    before_step(monkeypatch, 1, break_backward)
    # without inductor's and AOTAutograd's caches, which would hand step 2 step 1's graphs, compiled or not
    with torch._inductor.config.patch(fx_graph_cache=False), torch._functorch.config.patch(enable_autograd_cache=False):
        train.main([*args, "--rouge_samples=0", "--best_metric=val_loss"])
    said = warnings(capsys)
    assert len(said) == 1 and "forced backward compiler error" in said[0] and "training eagerly from now on" in said[0]
    assert [row["iter"] for row in metrics(tmp_path / "out")] == [1, 2, 3]


@pytest.mark.slow  # an inductor compile: half a minute on a busy 2-core CPU
def test_the_compiled_module_falls_back_to_its_own_weights(capsys, fresh_dynamo):
    """Called on 2 rows, then given 1 (a size dynamo specializes): the recompile hits a limit of one graph, and the
    module goes on eagerly with the same parameters, computing what the model computes."""
    from conftest import tiny_gpt
    from model import Targets
    model = tiny_gpt()
    x = torch.randint(0, 64, (2, 8))
    with torch._dynamo.config.patch(recompile_limit=1):
        compiled = backends.CompiledModule(model)
        compiled(x, Targets.of(x))
        assert compiled.why is None
        _, loss = compiled(x[:1], Targets.of(x[:1]))
    assert compiled.why and torch.equal(loss, model(x[:1], Targets.of(x[:1]))[1])
    assert list(compiled.parameters()) == list(model.parameters())
    assert "RecompileLimit" in capsys.readouterr().err


@pytest.mark.slow
def test_the_fsdp_start_line_says_the_training_step_runs_eagerly(args):
    result = run(torchrun("--nproc_per_node=2", "--standalone", "train.py", *args, "--backend=fsdp", "--max_iters=1",
                         "--micro_batch_size=2"))
    assert result.returncode == 0, [line for line in result.stderr.splitlines() if line.startswith("error")]
    assert "float32 on cpu, eager training (fsdp), backend fsdp" in result.stdout
    assert "warning: torch.compile" not in result.stderr
