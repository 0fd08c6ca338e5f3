"""GPU paths without waste, counted on the CPU: one graph and at most two compilations for the training step (one
process and DDP), one compilation of the decode step (any batch sizes and EOS pattern; none after training), one
wait for the device per decode step, no weight casts per step, and few KV-cache bytes copied; LoRA with gradient
checkpointing compiles, as eager."""
import contextlib
import dataclasses
import random

import pytest
import torch

import train
from bench import compile as bench_compile
from bench.compile import Waits, counted_compiles, decode_counts
from config import Decoding, load_config
from conftest import tiny_gpt
from generate import generate
from model import GPT, GPTConfig, Targets
from summarizer import compiling, inference, lora, mbr, runtime
from summarizer.compiling import CompiledModule, compile_model

MAX_NEW = 20


def test_waits_counts_reads_of_device_values():
    x = torch.arange(-3, 5)
    with Waits() as waits:
        x.tolist()
        bool(x.any())
        x[x > 0].sum()
        (x * 2).argmax(dim=0, keepdim=True)
    assert waits.syncs == 3


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
        x, y = batch(64)
        compiled = compile_model(model, lambda m: m(x, Targets.of(y))[1], contextlib.nullcontext())
        for width in (72, 24, 200, 8, 136, 256, 40, 96):
            x, y = batch(width)
            _, loss = compiled(x, Targets.of(y))
            _, expected = model(x, y)
            assert loss.item() == pytest.approx(expected.item(), rel=1e-5)
    assert compiled is not model and breaks() == 0 and counter.compilations["train"] <= 2


@pytest.mark.slow
def test_ddp_training_compiles_at_most_twice_without_graph_breaks(tmp_path):
    counts, _ = bench_compile.train_counts(str(tmp_path), steps=12)
    for rank, c in counts.items():
        assert c["graph_breaks"] == 0 and 1 <= c["compilations"]["train"] <= 2, (rank, c)


@pytest.fixture(scope="module")
def model(tiny_hf_dir):
    return GPT.from_pretrained(tiny_hf_dir).eval()


@pytest.fixture(scope="module")
def prompts():
    rng = random.Random(5)
    return [[rng.randrange(50257) for _ in range(rng.randint(1, 80))] for _ in range(64)]


@pytest.fixture(scope="module")
def eos(model, prompts):
    """A token the model emits mid-way in some rows and not in others: the EOS pattern varies across rows."""
    counts = {}
    for row in generate(model, prompts, Decoding(max_new_tokens=MAX_NEW), eos_token_id=-1):
        for token in set(row[1:MAX_NEW - 2]):
            counts[token] = counts.get(token, 0) + 1
    token = max(counts, key=counts.get)
    assert 4 < counts[token] < len(prompts) - 4
    return token


@pytest.mark.slow
def test_decode_compiles_once_whatever_the_batch_sizes_and_eos(model, prompts, eos):
    """Greedy (ended rows dropped at each EOS, or at half), beam and MBR over one batch of 64 and over batches of
    1, 2, 17, 3 and 41 prompts, compiled (a counting backend) as evaluate.py compiles them: the eager summaries,
    each graph compiled once (a batch never shrinks to the one row a compiled step would specialize)."""
    mbr4 = dict(seed=1, mbr_pick=mbr.pick)
    settings = [(Decoding(MAX_NEW), {}), (Decoding(MAX_NEW), dict(compact_below=0.5)),
                (Decoding(MAX_NEW, num_beams=3), {}),
                (Decoding(MAX_NEW, temperature=0.8, top_k=20, mbr_samples=4), mbr4)]
    starts = [0, 1, 3, 20, 23, 64]
    batches = [prompts] + [prompts[a:b] for a, b in zip(starts, starts[1:], strict=False)]
    cases = [(batch, decoding, options, generate(model, batch, decoding, eos, **options))
             for decoding, options in settings for batch in batches]
    with counted_compiles() as (counter, breaks):
        step = compiling.CompiledDecodeStep()
        for batch, decoding, options, expected in cases:
            assert generate(model, batch, decoding, eos, decode_step=step, **options) == expected
    # two graphs: one row per prompt (greedy's, whose rows and prompts are one size) and several (beams, samples)
    assert not step.failed and breaks() == 0 and counter.compilations["decode"] == 2


def test_decode_waits_once_per_step_and_copies_few_cache_bytes(model, prompts, eos):
    cfg = load_config(["--gen_batch_size=64", "--max_new_tokens=20"])
    syncs, casts, copied_vs_read = decode_counts(model, prompts, cfg)
    lengths = [len(row) for row in generate(model, prompts, Decoding(max_new_tokens=MAX_NEW), eos)]
    assert min(lengths) < MAX_NEW // 2 and max(lengths) == MAX_NEW  # rows end at different steps
    assert syncs <= 1 and casts == 0 and copied_vs_read <= 0.25


def test_inference_holds_weights_in_its_dtype_and_casts_none_per_step(model, prompts, tmp_path):
    """load_run casts the weights once to the run's dtype (here bfloat16 on the CPU): no decode step casts a
    weight, where float32 weights under autocast are cast at every step."""
    cfg = load_config(["--gen_batch_size=16", "--max_new_tokens=8", "--dtype=bfloat16", "--device=cpu"])
    half = GPT(model.config)
    half.load_state_dict(model.state_dict())
    half = half.to(torch.bfloat16).eval()
    with Waits(list(half.parameters())) as held:
        inference.summarize(half, prompts[:16], cfg, contextlib.nullcontext())
    with Waits(list(model.parameters())) as autocast:
        inference.summarize(model, prompts[:16], cfg, torch.autocast("cpu", dtype=torch.bfloat16))
    assert held.weight_casts == 0 and autocast.weight_casts > 0


def test_load_run_holds_the_weights_in_the_runtime_dtype(write_csv, tmp_path):
    from conftest import TINY
    from summarizer.runtime import Runtime
    out = tmp_path / "out"
    args = [*TINY, f"--train_csv={write_csv('train.csv', 40)}", f"--data_cache_dir={tmp_path / 'cache'}",
            "--max_iters=2", "--eval_interval=2", "--batch_size=4", "--micro_batch_size=4", "--rouge_samples=0",
            "--best_metric=val_loss", f"--out_dir={out}", "--sample_submission_csv="]
    train.main(args)
    cfg = load_config([*args, "--dtype=bfloat16"])
    with Runtime(cfg) as rt:
        run = inference.load_run(cfg, set(), rt, inference.describe_validation)
    assert {p.dtype for p in run.model.parameters()} == {torch.bfloat16}
    assert dataclasses.asdict(run.cfg)["dtype"] == "bfloat16"


@pytest.mark.slow
def test_gradient_checkpointing_with_lora_compiles_and_matches_eager():
    """torch.compile (inductor, on CPU) of a LoRA model with checkpointed blocks: compiled, not the eager
    fallback, with the eager loss and gradients."""
    torch.manual_seed(0)
    model = tiny_gpt()
    lora.add_adapters(model, **lora.settings(load_config(["--lora_rank=2", "--lora_dropout=0.0"])))
    with torch.no_grad():
        for name, p in model.named_parameters():
            if ".lora_B." in name:
                p.normal_(std=0.1)
    model.gradient_checkpointing = True
    x = torch.randint(0, 64, (2, 32))
    y = torch.randint(0, 64, (2, 32))
    runs = []
    for compiled in (False, True):
        trained = (compile_model(model, lambda m: m(x, Targets.of(y))[1], contextlib.nullcontext()) if compiled
                   else model)
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
    """train.py --dtype=bfloat16 --compile=True with evaluate_after and predict_after: the after-run decodes with
    the graphs training's ROUGE decoding compiled (one process, one decode step, one weight dtype and layout)."""
    from conftest import tiny
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
    assert at_end["compiles"]["decode"] >= 1 and breaks() == 0
    assert dict(counter.compilations) == at_end["compiles"]
    assert (tmp_path / "out" / "submission.csv").exists() and (tmp_path / "out" / "eval_metrics.json").exists()


@pytest.mark.parametrize("dialogues, compiled_work, compiles", [(41, False, False), (819, False, False),
                                                                 (20000, False, True), (4000, True, True)])
def test_compile_auto_decodes_eagerly_where_the_compile_would_not_repay_itself(monkeypatch, dialogues,
                                                                               compiled_work, compiles):
    """The rule on given costs (compiling.DECODE_COMPILE_S, CACHED_COMPILE_S, SAVED_PER_BLOCK_S), on a 12-block
    model at gen_batch_size 64 and 128 new tokens: a validation set's or a test set's decoding is too small to
    repay a cold compile; a long job repays it, and so does a mid-sized one where the run's compiled work loads.
    The words say which and why; the process keeps its first choice."""
    monkeypatch.setattr(runtime, "use_compile", lambda *args: True)  # as on a GPU
    cfg = load_config(["--device=cpu", "--gen_batch_size=64", "--max_new_tokens=128"])
    rt = runtime.Runtime(cfg)
    rt.compiled_work = compiled_work
    steps = inference.decode_steps(dialogues, cfg, world_size=1)
    pays, _ = compiling.decode_compile_pays(steps, 12, compiling.CACHED_COMPILE_S if compiled_work
                                          else compiling.DECODE_COMPILE_S)
    step, words = rt.decoding(steps, 12)
    assert pays is compiles and isinstance(step, compiling.CompiledDecodeStep) is compiles
    assert words.startswith(f"{'torch.compile' if compiles else 'eager'} decoding (compile=auto: {steps} decode steps")
    assert ("more than" if compiles else "less than") in words
    assert rt.decoding(1, 12) == (step, words)


@pytest.mark.slow
def test_a_later_process_reuses_the_runs_compiled_work_where_it_was_made(write_csv, tmp_path):
    """evaluate.py --compile=True in a new process, with an empty inductor cache (a new Kaggle session): the first
    saves its compiled work beside best.pt, the second loads it and hits inductor's cache instead of compiling;
    work made by another torch is named in one line and not loaded (what a process then does is the first's: it
    compiles afresh)."""
    import json
    import sys

    from conftest import run, tiny
    out = tmp_path / "out"
    train.main([*tiny(), f"--train_csv={write_csv('train.csv', 24)}", "--val_fraction=0.25", "--batch_size=2",
                "--micro_batch_size=2", "--max_iters=1", "--eval_interval=1", "--rouge_samples=0",
                "--best_metric=val_loss", "--eval_val_batches=1", f"--out_dir={out}",
                f"--data_cache_dir={tmp_path / 'cache'}"])

    def evaluate(cache):
        code = ("import json, sys, torch, evaluate; evaluate.main(sys.argv[1:]); "
                "print(json.dumps(dict(torch._dynamo.utils.counters['inductor'])))")
        done = run([sys.executable, "-c", code, f"--out_dir={out}", "--compile=True", "--gen_batch_size=4",
                    f"--data_cache_dir={tmp_path / 'cache'}"], env=dict(TORCHINDUCTOR_CACHE_DIR=str(cache)))
        assert done.returncode == 0, done.stderr
        return done.stdout, json.loads(done.stdout.strip().splitlines()[-1])
    printed, counts = evaluate(tmp_path / "inductor-1")
    assert (out / "compile_cache.bin").exists() and counts.get("fxgraph_cache_miss", 0) >= 1
    printed, counts = evaluate(tmp_path / "inductor-2")
    assert "compiled work: " in printed and f"from {out / 'compile_cache.bin'}" in printed
    assert counts.get("fxgraph_cache_hit", 0) >= 1 and counts.get("fxgraph_cache_miss", 0) == 0
    header, artifacts = (out / "compile_cache.bin").read_bytes().split(b"\n", 1)
    (out / "compile_cache.bin").write_bytes(json.dumps({**json.loads(header), "torch": "2.0.0"}).encode() + b"\n"
                                            + artifacts)
    loaded, line = compiling.load_compile_cache(str(out), "cpu")  # what a third process would read
    assert not loaded and line == (f"{out / 'compile_cache.bin'} was compiled for another torch 2.0.0 "
                                   f"(here {torch.__version__}): compiling afresh")


def test_a_damaged_compile_cache_costs_a_compile_not_the_run(tmp_path):
    (tmp_path / "compile_cache.bin").write_bytes(b"\x00\x01 not a header\nnor artifacts")
    loaded, line = compiling.load_compile_cache(str(tmp_path), "cpu")
    assert not loaded and line.startswith(f"{tmp_path / 'compile_cache.bin'} cannot be read (")
    assert line.endswith("): compiling afresh")
