"""Out of memory is never taken for a failed torch.compile: in training's compile warm-up it propagates with the hint
to lower --micro_batch_size and ends train.py in one error line; in a compiled decode step it propagates, with no
eager retry."""
import pytest
import torch

import generate
import train
from config import Decoding, load_config
from conftest import tiny
from summarizer import compiling
from summarizer.preparation import prepare
from summarizer.runtime import Runtime


@pytest.fixture
def args(write_csv, tmp_path):
    """One step on micro-batches of 8, compiled, with no ROUGE."""
    return [*tiny(), f"--train_csv={write_csv('train.csv', 48)}", f"--data_cache_dir={tmp_path / 'c'}",
            f"--out_dir={tmp_path / 'out'}", "--batch_size=8", "--micro_batch_size=8", "--sample_submission_csv=",
            "--max_iters=1", "--compile=True", "--rouge_samples=0", "--best_metric=val_loss"]


def test_an_out_of_memory_in_the_compile_warm_up_propagates(args, monkeypatch, capfd):
    def out_of_memory(*args, **kwargs):
        raise torch.OutOfMemoryError("CUDA out of memory. Tried to allocate 2.00 GiB")
    monkeypatch.setattr(torch, "compile", lambda model, **kwargs: out_of_memory)
    cfg = load_config(args)
    with pytest.raises(torch.OutOfMemoryError, match="lower --micro_batch_size \\(now 8"):
        train.Trainer(prepare(cfg, rt := Runtime(cfg)), rt)
    capfd.readouterr()
    with pytest.raises(SystemExit) as exit:
        train.main(args)
    err = capfd.readouterr().err
    assert exit.value.code == 1 and "torch.compile failed" not in err and "Traceback" not in err
    assert err.strip().splitlines()[-1].startswith("error: out of memory while training on micro-batches of 8")


def test_an_out_of_memory_in_the_compiled_decode_step_propagates(tiny_hf_dir, capfd):
    from model import GPT
    model = GPT.from_pretrained(tiny_hf_dir).eval()
    step = compiling.CompiledDecodeStep()

    def out_of_memory(*args):
        raise torch.OutOfMemoryError("CUDA out of memory.")
    step.compiled = out_of_memory
    with pytest.raises(torch.OutOfMemoryError):
        generate.generate(model, [[1, 2, 3]], Decoding(4), decode_step=step)
    assert not step.failed and "torch.compile failed" not in capfd.readouterr().err  # no eager retry
