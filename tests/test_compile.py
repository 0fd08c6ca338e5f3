"""GPU paths without waste, counted on the CPU: one graph and at most two compilations for the training step (one
process and DDP), nothing compiled after training, one wait for the device per 8 greedy steps, no weight casts per
step, few KV-cache bytes copied, and the operators a step launches counted; LoRA with gradient checkpointing
compiles, as eager."""
import contextlib
import dataclasses
import random

import pytest
import torch

import train
from bench import compile as bench_compile
from bench.compile import Waits, counted_compiles, decode_counts
from config import Decoding, load_config
from conftest import mid_way_eos, tiny, tiny_gpt
from generate import generate
from model import GPT, GPTConfig, Targets
from summarizer import inference, loading
from summarizer.backends import CompiledModule

MAX_NEW = 20


def test_waits_counts_reads_of_device_values():
    x = torch.arange(-3, 5)
    with Waits() as waits:
        x.tolist()
        bool(x.any())
        x[x > 0].sum()
        (x * 2).argmax(dim=0, keepdim=True)
    assert waits.syncs == 3


def test_launches_counts_operators_that_do_work_by_name():
    """What a greedy step launches (bench's operators_per_greedy_step): neither a view nor an operator that hands
    back its input untouched (dropout in eval) counts; an in-place write does."""
    x, w = torch.randn(4, 8), torch.randn(8, 8)
    with bench_compile.Launches() as launches:
        y = (x @ w).view(8, 4).t()
        torch.nn.functional.dropout(y, 0.1, training=False).add_(1)
        y[0] + 1
    assert launches.ops == {"mm": 1, "add_": 1, "add": 1}


@pytest.mark.slow
@pytest.mark.parametrize("checkpointing", [False, True])
def test_training_step_is_one_graph_over_varied_widths(checkpointing):
    torch.manual_seed(0)
    model = GPT(GPTConfig(block_size=256, vocab_size=512, n_layer=2, n_head=2, n_embd=32))
    model.gradient_checkpointing = checkpointing
    g = torch.Generator().manual_seed(0)

    def batch(width):
        x = torch.randint(0, 512, (4, width), generator=g)
        y = torch.randint(0, 512, (4, width), generator=g)
        y[torch.rand(4, width, generator=g) < 0.6] = -1  # prompts and padding: a varying number of targets
        return x, y
    with counted_compiles() as (counter, breaks):
        compiled = CompiledModule(model)
        for width in (64, 72, 24, 200, 8, 136, 256, 40, 96):
            x, y = batch(width)
            _, loss = compiled(x, Targets.of(y))
            _, expected = model(x, y)
            assert loss.item() == pytest.approx(expected.item(), rel=1e-5)
    assert compiled.why is None and breaks() == 0 and counter.compilations["train"] <= 2


def test_under_a_budget_step_1_meets_no_size_that_start_up_did_not_compile(write_csv, tmp_path, monkeypatch):
    """A compiler specializes on ranges of sizes: on an H200, step 1's micro-batches recompiled for 40 s that start-up
    had not timed, and the run ended 27 s past max_time. Every micro-batch shape of step 1 reaches the compiled step
    before the budget's verdict (recorded on a stand-in that runs the step eagerly)."""
    shapes = {"start-up": set(), "step 1": set(), "after": set()}
    phase = ["start-up"]

    def forward(module, x, targets):
        shapes[phase[0]].add(tuple(x.shape))
        return module.compiled._orig_mod(x, targets)

    def step(trainer, it):
        phase[0] = "step 1"
        try:
            return train_step(trainer, it)
        finally:
            phase[0] = "after"
    train_step = train.Trainer.train_step
    monkeypatch.setattr(CompiledModule, "forward", forward)
    monkeypatch.setattr(train.Trainer, "train_step", step)
    train.main([*tiny(), f"--train_csv={write_csv('train.csv', 40)}", "--val_fraction=0.25", "--batch_size=8",
                "--micro_batch_size=2", "--max_iters=1", "--compile=True", "--max_time=600", "--rouge_samples=2",
                f"--out_dir={tmp_path / 'out'}", f"--data_cache_dir={tmp_path / 'cache'}"])
    assert len(shapes["step 1"]) > 1 and shapes["step 1"] <= shapes["start-up"], shapes


@pytest.mark.slow
def test_ddp_training_compiles_at_most_twice_without_graph_breaks(tmp_path):
    counts, _ = bench_compile.train_counts(str(tmp_path), steps=12)
    for rank, c in counts.items():
        assert c["graph_breaks"] == 0 and 1 <= c["compilations"]["train"] <= 2, (rank, c)


@pytest.fixture(scope="module")
def model(ours):
    return ours


@pytest.fixture(scope="module")
def prompts():
    rng = random.Random(5)
    return [[rng.randrange(50257) for _ in range(rng.randint(1, 80))] for _ in range(64)]


@pytest.fixture(scope="module")
def eos(model, prompts):
    return mid_way_eos(model, prompts, MAX_NEW, 4)


@pytest.mark.parametrize("compact_below", [0.5, 1.0])
def test_greedy_waits_once_per_8_steps_and_copies_few_cache_bytes(model, prompts, eos, compact_below):
    """Greedy reads the device's tokens at most once per READ_EVERY=8 steps (ended rows dropped at half, a GPU's
    rule, or as soon as the host sees them, a CPU's)."""
    cfg = load_config(["--gen_batch_size=64", "--max_new_tokens=24"])
    syncs, casts, copied_vs_read = decode_counts(model, prompts, cfg, compact_below)
    lengths = [len(row) for row in generate(model, prompts, Decoding(max_new_tokens=24), eos)]
    assert min(lengths) < MAX_NEW // 2 and max(lengths) == 24  # rows end at different steps
    assert syncs <= 1 / 8 and casts == 0 and copied_vs_read <= 0.25


def test_inference_holds_weights_in_its_dtype_and_casts_none_per_step(model, prompts, tmp_path):
    """load_summary_model casts the weights once to the run's dtype (here bfloat16 on the CPU): no decode step casts a
    weight, where float32 weights under autocast are cast at every step."""
    cfg = load_config(["--gen_batch_size=16", "--max_new_tokens=8", "--dtype=bfloat16", "--device=cpu"])
    half = GPT(model.config)
    half.load_state_dict(model.state_dict())
    half = half.to(torch.bfloat16).eval()
    with Waits(list(half.parameters())) as held:
        inference.summarize_batches(half, prompts[:16], cfg, contextlib.nullcontext())
    with Waits(list(model.parameters())) as autocast:
        inference.summarize_batches(model, prompts[:16], cfg, torch.autocast("cpu", dtype=torch.bfloat16))
    assert held.weight_casts == 0 and autocast.weight_casts > 0


def test_load_summarizer_holds_the_weights_in_the_runtime_dtype(write_csv, tmp_path):
    from conftest import TINY
    from summarizer.process import Process
    out = tmp_path / "out"
    args = [*TINY, f"--train_csv={write_csv('train.csv', 40)}", f"--data_cache_dir={tmp_path / 'cache'}",
            "--max_iters=2", "--eval_interval=2", "--batch_size=4", "--micro_batch_size=4", "--rouge_samples=0",
            "--best_metric=val_loss", f"--out_dir={out}", "--sample_submission_csv="]
    train.main(args)
    cfg = load_config([*args, "--dtype=bfloat16"])
    with Process(cfg) as proc:
        summary_model = inference.load_summary_model(cfg, set(), proc, inference.describe_validation)
    assert {p.dtype for p in summary_model.model.parameters()} == {torch.bfloat16}
    assert dataclasses.asdict(summary_model.cfg)["dtype"] == "bfloat16"


@pytest.mark.slow
def test_gradient_checkpointing_with_lora_compiles_and_matches_eager():
    """torch.compile (inductor, on CPU) of a LoRA model with checkpointed blocks: compiled, not the eager
    fallback, with the eager loss and gradients."""
    torch.manual_seed(0)
    model = tiny_gpt()
    loading.add_adapters(model, **loading.lora_settings(load_config(["--lora_rank=2", "--lora_dropout=0.0"])))
    with torch.no_grad():
        for name, p in model.named_parameters():
            if ".lora_B." in name:
                p.normal_(std=0.1)
    model.gradient_checkpointing = True
    x = torch.randint(0, 64, (2, 32))
    y = torch.randint(0, 64, (2, 32))
    runs = []
    for compiled in (False, True):
        trained = CompiledModule(model) if compiled else model
        _, loss = trained(x, y)
        loss.backward()
        runs.append((trained, loss.item(), {n: p.grad.clone() for n, p in model.named_parameters() if p.requires_grad}))
        model.zero_grad(set_to_none=True)
    (_, loss, grads), (compiled_model, compiled_loss, compiled_grads) = runs
    assert isinstance(compiled_model, CompiledModule)
    assert compiled_loss == pytest.approx(loss, abs=1e-5)
    for name, grad in grads.items():
        assert torch.allclose(compiled_grads[name], grad, atol=1e-5), name


@pytest.mark.slow
def test_nothing_compiles_after_a_bf16_run_ends_its_training(write_csv, tmp_path, monkeypatch):
    """train.py --dtype=bfloat16 --compile=True with evaluate_after and predict_after: the after-run compiles
    nothing (decoding is not compiled)."""
    at_end = {}

    def after_training(command):
        def counted(*args):
            at_end.setdefault("compiles", dict(counter.compilations))
            return command(*args)
        return counted
    monkeypatch.setattr(train, "evaluate", after_training(train.evaluate))
    monkeypatch.setattr(train, "predict", after_training(train.predict))
    argv = [*tiny(), f"--train_csv={write_csv('train.csv', 40)}", f"--test_csv={write_csv('test.csv', 9, test=True)}",
            "--val_fraction=0.25", "--batch_size=4", "--micro_batch_size=2", "--max_iters=2", "--eval_interval=2",
            "--rouge_samples=6", "--gen_batch_size=4", "--dtype=bfloat16", "--compile=True", "--evaluate_after=True",
            "--predict_after=True", "--sample_submission_csv=", f"--out_dir={tmp_path / 'out'}",
            f"--data_cache_dir={tmp_path / 'cache'}"]
    with counted_compiles() as (counter, breaks):
        train.main(argv)
    assert at_end["compiles"]["train"] >= 1 and "decode" not in at_end["compiles"] and breaks() == 0
    assert dict(counter.compilations) == at_end["compiles"]
    assert (tmp_path / "out" / "submission.csv").exists() and (tmp_path / "out" / "eval_metrics.json").exists()
