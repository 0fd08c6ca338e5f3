"""Out of memory, a GPU's or the host's (on a CPU or in host RAM, torch's CPU allocator raises a RuntimeError):
never taken for a failed torch.compile (in training's compiled step it propagates with the hint to lower
--micro_batch_size and ends train.py in one error line; in a CUDA graph's capture it propagates, with no eager
retry); under micro_batch_size=auto before step 1 (its check runs the compiled step where the run compiles), and in
any generation batch, it lowers the batch on every rank
and the run goes on as the smaller batch would have from the start; a micro_batch_size the user set stays and its
one line names what to lower."""
import dataclasses
import json
import os
import re

import pytest
import torch
from torch._subclasses.fake_tensor import FakeTensor

import evaluate
import generate
import predict
import train
from config import Decoding, keys
from conftest import REPO, metrics, one_error_line, run, tiny, torchrun
from model import GPT, GPTConfig
from summarizer import memory
from summarizer.checkpoint import load_checkpoint


@pytest.fixture
def args(write_csv, tmp_path):
    """One step on micro-batches of 8, compiled, with no ROUGE."""
    return [*tiny(), f"--train_csv={write_csv('train.csv', 48)}", f"--data_cache_dir={tmp_path / 'c'}",
            f"--out_dir={tmp_path / 'out'}", "--batch_size=8", "--micro_batch_size=8", "--sample_submission_csv=",
            "--max_iters=1", "--compile=True", "--rouge_samples=0", "--best_metric=val_loss"]


def test_an_out_of_memory_in_the_compiled_step_propagates(args, monkeypatch, capfd):
    def out_of_memory(*args, **kwargs):
        raise torch.OutOfMemoryError("CUDA out of memory. Tried to allocate 2.00 GiB")
    monkeypatch.setattr(torch, "compile", lambda model, **kwargs: out_of_memory)
    with pytest.raises(SystemExit) as exit:
        train.main(args)
    err = capfd.readouterr().err
    assert exit.value.code == 1 and "torch.compile failed" not in err and "Traceback" not in err
    assert err.strip().splitlines()[-1].startswith("error: out of memory while training on micro-batches of 8")


def test_auto_checks_the_compiled_step_and_lowers_the_micro_batch_it_runs_out_of_memory_in(run_args, tmp_path,
                                                                                            monkeypatch, capsys):
    """A compiled, checkpointed step may peak above the eager one (pytorch#120381): micro_batch_size=auto's check
    runs the compiled step, so where it runs out of memory above 2 rows (eager fits 8) the run lowers to 2, says so in
    its line, and trains compiled at 2 to its end."""
    def compiled(model, **kwargs):
        def step(x, targets):
            if len(x) > 2:
                run_out_of_memory("GPU")
            return model(x, targets)
        return step
    monkeypatch.setattr(torch, "compile", compiled)
    train.main(run_args(tmp_path / "out", "--micro_batch_size=auto", "--compile=True"))
    lowered = [line for line in capsys.readouterr().out.splitlines() if line.startswith("micro_batch_size=auto:")]
    assert len(lowered) == 1 and lowered[0].endswith(f"; out of memory at 8 and 4 (rank 0: {says('GPU')}): lowered "
                                                     f"to 2")
    assert trained_weights(tmp_path / "out")[1]["micro_batch_size"] == 2
    assert [r["iter"] for r in metrics(tmp_path / "out") if "loss" in r] == [1, 2, 3]


def test_an_out_of_memory_in_a_graph_capture_propagates(tiny_hf_dir, capfd):
    model = GPT.from_pretrained(tiny_hf_dir).eval()

    def out_of_memory(step):
        raise torch.OutOfMemoryError("CUDA out of memory.")
    graphs = generate.StepGraphs(capture=out_of_memory)
    with pytest.raises(torch.OutOfMemoryError):
        generate.generate(model, [[1, 2, 3]], Decoding(4), graphs=graphs)
    assert graphs.eager_why is None and "CUDA graph" not in capfd.readouterr().err  # no eager retry


# ---- an out-of-memory error that a smaller batch avoids -----------------------------------------------------------

# What runs out of memory: a GPU (torch.OutOfMemoryError, its message's first line: the tests raise it on a CPU where a
# GPU would) or the host, on a CPU or in host RAM (the CPU allocator's own RuntimeError, for a tensor no machine holds).
GPU_SAYS = ("CUDA out of memory. Tried to allocate 2.00 GiB. GPU 0 has a total capacity of 14.74 GiB of which 1.12 GiB "
            "is free.")
KINDS = ["GPU", "host"]


def run_out_of_memory(kind):
    if kind == "GPU":
        raise torch.OutOfMemoryError(GPU_SAYS)
    torch.empty(1 << 50, dtype=torch.uint8)


def says(kind):
    """The first line of the error that running out of memory on `kind` raises."""
    with pytest.raises(RuntimeError) as error:
        run_out_of_memory(kind)
    return str(error.value).strip().partition("\n")[0]


def out_of_memory_above(monkeypatch, method, rows, limit, kind):
    """GPT.<method> runs out of memory on `kind` when rows(its arguments) is above `limit`."""
    original = getattr(GPT, method)

    def limited(model, *args, **kwargs):  # the memory ledger's fake tensors hold no memory to run out of
        if rows(*args) > limit and not any(isinstance(a, FakeTensor) for a in args):
            run_out_of_memory(kind)
        return original(model, *args, **kwargs)
    monkeypatch.setattr(GPT, method, limited)


def training_above(monkeypatch, limit, kind="GPU"):
    """A training forward of more than `limit` rows runs out of memory."""
    out_of_memory_above(monkeypatch, "forward", lambda idx, *rest: len(idx), limit, kind)


def generation_above(monkeypatch, limit, kind="GPU"):
    """A generation batch of more than `limit` prompts runs out of memory (at its prefill)."""
    out_of_memory_above(monkeypatch, "prefill", lambda prompts, *rest: len(prompts), limit, kind)


def test_an_out_of_memory_is_an_allocation_failure_and_no_other_error():
    """The GPU's and the host's are each tested where they are handled below; Python's too, and nothing else."""
    from summarizer.launch import out_of_memory
    assert out_of_memory(MemoryError()) and not out_of_memory(RuntimeError("shape '[2, 3]' is invalid for size 7"))


@pytest.fixture
def csvs(write_csv):
    """The flags of 48 training, 12 validation and 12 test dialogues."""
    return [f"--train_csv={write_csv('train.csv', 48)}", f"--validation_csv={write_csv('validation.csv', 12, seed=3)}",
            f"--test_csv={write_csv('test.csv', 12, seed=5, test=True)}"]


@pytest.fixture
def run_args(csvs, tmp_path):
    """run_args(out_dir, *flags): three steps of 8 sequences on `csvs`."""
    def made(out_dir, *flags):
        return [*tiny(), *csvs, f"--data_cache_dir={tmp_path / 'c'}", f"--out_dir={out_dir}", "--batch_size=8",
                "--sample_submission_csv=", "--max_iters=3", "--eval_interval=3", "--rouge_samples=0",
                "--best_metric=val_loss", "--dropout=0.1", "--log_interval=1", *flags]
    return made


def trained_weights(out_dir):
    ckpt = torch.load(os.path.join(out_dir, "ckpt.pt"), map_location="cpu", weights_only=False)
    return ckpt["model"], ckpt["config"]


@pytest.mark.parametrize("kind", KINDS)
def test_out_of_memory_under_auto_lowers_the_micro_batch_and_trains_as_the_smaller_one(kind, run_args, tmp_path,
                                                                                      monkeypatch, capsys):
    """micro_batch_size=auto chooses 8 on a CPU; where 8 and 4 rows run out of memory (the GPU's or the host's), the
    run trains at 2, as a run at 2 from the start trains, keeps 2 in ckpt.pt and says what it lowered and why in one
    line."""
    with monkeypatch.context() as patched:
        training_above(patched, 2, kind)
        train.main(run_args(tmp_path / "auto", "--micro_batch_size=auto"))
    out = capsys.readouterr().out
    train.main(run_args(tmp_path / "two", "--micro_batch_size=2"))
    lowered = [line for line in out.splitlines() if line.startswith("micro_batch_size=auto:")]
    assert len(lowered) == 1 and lowered[0].startswith("micro_batch_size=auto: 8 (the plan's peak ")
    assert lowered[0].endswith(f"; out of memory at 8 and 4 (rank 0: {says(kind)}): lowered to 2")
    assert "8 sequences per step over 1 process(es), cut by length into micro-batches of at most the positions of " \
           "micro_batch_size=2 of the longest rows" in out
    weights, config = trained_weights(tmp_path / "auto")
    expected, _ = trained_weights(tmp_path / "two")
    assert config["micro_batch_size"] == 2 and json.loads((tmp_path / "auto" / "config.json").read_text())[
        "micro_batch_size"] == 2
    assert [r["loss"] for r in metrics(tmp_path / "auto")] == [r["loss"] for r in metrics(tmp_path / "two")]
    for name, tensor in expected.items():
        assert torch.equal(weights[name], tensor), name


@pytest.mark.parametrize("kind", KINDS)
def test_a_micro_batch_size_the_user_set_stays_and_out_of_memory_ends_the_run_in_one_line(kind, run_args, tmp_path,
                                                                                           monkeypatch, capsys):
    training_above(monkeypatch, 2, kind)
    line = one_error_line(capsys, train.main, run_args(tmp_path / "out", "--micro_batch_size=8"), code=1)
    assert line.startswith("error: out of memory while training on micro-batches of 8 sequences: lower "
                           "--micro_batch_size (now 8")


@pytest.mark.parametrize("checkpointing", [False, True])
def test_out_of_memory_at_one_row_names_what_is_left_to_lower(checkpointing, run_args, tmp_path, monkeypatch, capsys):
    """micro_batch_size=auto lowered to 1 row and still out of memory: not 'lower --micro_batch_size (now 1)', but
    block_size, the model's size, LoRA and, where it is off, gradient checkpointing."""
    monkeypatch.setattr(memory, "peak_step", lambda *args: run_out_of_memory("GPU"))  # at every micro-batch
    line = one_error_line(capsys, train.main, run_args(tmp_path / "out", "--micro_batch_size=auto",
                                                       f"--gradient_checkpointing={checkpointing}"), code=1)
    assert line.startswith("error: out of memory while training on micro-batches of 1 sequence: lower --block_size "
                           "(now 128) or the model's size (--n_layer, --n_embd) or set --lora_rank=8 (train adapters "
                           "only)" + ("" if checkpointing else " or set --gradient_checkpointing=True")
                           + " (rank 0: CUDA out")


def rouge(out_dir):
    """The ROUGE of the run's evaluations."""
    return [(r["rouge1"], r["rougeL"]) for r in metrics(out_dir) if "rougeL" in r]


def summarized_files(out_dir):
    return {name: (out_dir / name).read_text() for name in ("eval_predictions.csv", "submission.csv")
            if (out_dir / name).exists()}


def test_evaluations_and_the_after_run_lower_a_generation_batch_and_write_the_smaller_batchs_summaries(
        run_args, tmp_path, monkeypatch, capsys):
    """Prompts in batches of 8 run out of memory (4 fit): the run's evaluations, evaluate_after and predict_after
    summarize in batches of 4, as a run with gen_batch_size=4 does, and one line says so, once."""
    after = ["--micro_batch_size=4", "--rouge_samples=12", "--evaluate_after=True", "--predict_after=True"]
    with monkeypatch.context() as patched:
        generation_above(patched, 4)
        train.main(run_args(tmp_path / "eight", *after, "--gen_batch_size=8"))
    out = capsys.readouterr().out
    train.main(run_args(tmp_path / "four", *after, "--gen_batch_size=4"))
    assert [line for line in out.splitlines() if "out of memory" in line] == [
        f"out of memory while summarizing 8 dialogues at a time (rank 0: {GPU_SAYS}): went on in batches of at most "
        f"4 (gen_batch_size=4 from now on in this process)"]
    assert rouge(tmp_path / "eight") and rouge(tmp_path / "eight") == rouge(tmp_path / "four")
    written = summarized_files(tmp_path / "eight")
    assert len(written) == 2 and written == summarized_files(tmp_path / "four")


@pytest.mark.parametrize("command, kind", [(evaluate, "GPU"), (predict, "GPU"), (predict, "host")])
def test_evaluate_and_predict_lower_a_generation_batch_and_write_the_smaller_batchs_summaries(
        command, kind, csvs, run_args, tmp_path, monkeypatch, capsys):
    """evaluate.py and predict.py, where 8 prompts run out of memory (the GPU's or the host's) and 2 do not: the
    summaries of batches of 2."""
    train.main(run_args(tmp_path / "run", "--micro_batch_size=8"))
    ckpt = tmp_path / "run" / "best.pt"

    def summarize(out_dir, gen_batch_size):  # the run's decoding, read from its checkpoint
        command.main(["--device=cpu", "--dtype=float32", "--compile=False", *csvs, f"--ckpt={ckpt}",
                      f"--out_dir={out_dir}", f"--data_cache_dir={tmp_path / 'c'}", "--sample_submission_csv=",
                      f"--gen_batch_size={gen_batch_size}"])
    capsys.readouterr()
    with monkeypatch.context() as patched:
        generation_above(patched, 2, kind)
        summarize(tmp_path / "eight", 8)
    out = capsys.readouterr().out
    summarize(tmp_path / "two", 2)
    assert [line for line in out.splitlines() if "out of memory" in line] == [
        f"out of memory while summarizing 8 and then 4 dialogues at a time (rank 0: {says(kind)}): went on in "
        f"batches of at most 2 (gen_batch_size=2 from now on in this process)"]
    written = summarized_files(tmp_path / "eight")
    assert len(written) == 1 and written == summarized_files(tmp_path / "two")


@pytest.mark.slow
def test_one_rank_out_of_memory_lowers_every_rank_alike(run_args, tmp_path):
    """Under torchrun, rank 1 alone runs out of memory above 2 rows and 2 prompts (tests/oom_rank.py): both ranks
    lower the micro-batch (4 a rank under auto) and the generation batch, and the run finishes."""
    out = tmp_path / "out"
    done = run(torchrun("--nproc_per_node=2", "--standalone", "tests/oom_rank.py",
                        *run_args(out, "--micro_batch_size=auto", "--rouge_samples=12", "--gen_batch_size=8",
                                  "--predict_after=True")))
    assert done.returncode == 0, done.stderr
    said = "rank 1: CUDA out of memory. Tried to allocate 2.00 GiB."
    assert f"; out of memory at 4 ({said}): lowered to 2" in done.stdout
    assert (f"out of memory while summarizing 4 dialogues at a time ({said}): went on in batches of at most 2"
            in done.stdout)
    assert trained_weights(out)[1]["micro_batch_size"] == 2 and (out / "submission.csv").exists()


# ---- what no smaller batch avoids: one dialogue that does not fit -------------------------------------------------

FIXTURE = os.path.join(REPO, "tests", "fixtures", "checkpoints", "2026-11-26", "best.pt")  # a run on data/demo


@pytest.mark.parametrize("key, flags", [("mbr_samples", {"mbr_samples": 100000, "temperature": 0.7}),
                                        ("num_beams", {"num_beams": 100000})])
def test_one_dialogue_beyond_the_generation_memory_is_one_line_naming_what_fits(key, flags, tmp_path, monkeypatch,
                                                                                capsys):
    """MBR or beams too wide for one dialogue in gen_memory_gb: one line, before any allocation (no prefill), naming
    the setting and the largest value at which the longest prompt's KV cache and logits fit."""
    monkeypatch.chdir(REPO)
    monkeypatch.setattr(GPT, "prefill", lambda *args: pytest.fail("allocated before the check"))
    line = one_error_line(capsys, evaluate.main, [f"--ckpt={FIXTURE}", f"--out_dir={tmp_path}", "--gen_memory_gb=0.5",
                                                  f"--data_cache_dir={tmp_path / 'c'}",
                                                  *(f"--{k}={v}" for k, v in flags.items())])
    said = re.fullmatch(rf"error: {key}=100000 does not fit: one dialogue \((\d+) prompt tokens\) holds [\d.]+ GiB of "
                        rf"KV cache and logits, where a generate\(\) call may take 0\.5 GiB \(gen_memory_gb, at most "
                        rf"what the device has left\): the largest {key} that fits is (\d+)", line)
    ckpt = load_checkpoint(FIXTURE)
    run = Decoding(**{k: ckpt["config"][k] for k in keys(Decoding)})
    prompt, fits = int(said[1]), int(said[2])

    def needs(value):
        return sum(memory.dialogue_bytes(dataclasses.replace(run, **{**flags, key: value}), prompt,
                                         GPTConfig(**ckpt["model_args"]), torch.float32))
    assert 1 < fits < 100000 and needs(fits) <= 2**29 < needs(fits + 1)


def test_one_dialogue_that_fits_at_no_value_says_so_and_names_the_memory_it_needs(tmp_path, monkeypatch, capsys):
    """Where not even one sample fits gen_memory_gb, the line says so (not 'the largest ... is 0', which would turn
    MBR off) and names the memory one needs."""
    monkeypatch.chdir(REPO)
    line = one_error_line(capsys, evaluate.main, [f"--ckpt={FIXTURE}", f"--out_dir={tmp_path}",
                                                  "--gen_memory_gb=0.00001", f"--data_cache_dir={tmp_path / 'c'}",
                                                  "--mbr_samples=16", "--temperature=0.7"])
    assert re.search(r"\): not even mbr_samples=1 fits \([\d.e-]+ GiB\): give --gen_memory_gb above that$", line), line


def test_the_micro_batch_check_leaves_the_rng_as_it_found_it(write_csv, tmp_path):
    """peak_step runs dropout on the side (state.rng_restored): the run's own draws come as they would without it."""
    import data
    from config import load_config
    from summarizer.process import Process
    cfg = load_config([*tiny(dropout=0.5), f"--train_csv={write_csv('train.csv', 12)}", "--micro_batch_size=4",
                       f"--data_cache_dir={tmp_path / 'c'}", f"--out_dir={tmp_path / 'out'}"])
    model = GPT(GPTConfig(block_size=128, n_layer=1, n_head=2, n_embd=32, dropout=0.5)).train()
    before = torch.get_rng_state()
    memory.peak_step(cfg, Process(cfg), model, data.load_splits(cfg).train)
    assert torch.equal(torch.get_rng_state(), before)
