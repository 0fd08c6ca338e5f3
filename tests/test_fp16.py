"""fp16 with a GradScaler (a T4's precision), on CPU autocast: a step whose gradients overflow is skipped and leaves
the weights as they were, metrics.jsonl counts the skipped steps, many of them warn once, training goes on; ckpt.pt
carries the scaler's state into a resumed run. Under FSDP: tests/test_fsdp.py."""
import math
import os

import pytest
import torch

import train
from config import load_config
from conftest import metrics, tiny
from summarizer.checkpoint import load_checkpoint
from summarizer.preparation import prepare
from summarizer.process import Process

# fp16 is emulated on a CPU, and slow: one micro-batch of 4 per step, one validation batch
RUN = [*tiny(dtype="float16"), "--log_interval=1", "--warmup_iters=2", "--learning_rate=3e-3", "--batch_size=4",
       "--micro_batch_size=4", "--rouge_samples=0", "--best_metric=val_loss", "--eval_val_batches=1",
       "--dropout=0.0", "--sample_submission_csv="]


@pytest.fixture
def args(write_csv, tmp_path):
    return [*RUN, f"--train_csv={write_csv('train.csv', 40)}", f"--data_cache_dir={tmp_path / 'cache'}",
            f"--out_dir={tmp_path / 'out'}"]


def test_overflowing_steps_are_skipped_counted_and_warned_and_training_goes_on(args, tmp_path, capsys):
    cfg = load_config([*args, "--max_iters=8", "--eval_interval=8"])
    proc = Process(cfg)
    trainer = train.Trainer(prepare(cfg, proc), proc)
    scaler = trainer.setup.state.scaler
    assert proc.use_scaler and scaler.is_enabled()
    with proc.autocast():
        assert trainer.model.lm_head(torch.zeros(1, 32)).dtype == torch.float16
    # One step: a scale of 2**40 overflows fp16 gradients; backing off by 2**-30 makes the next step's scale 2**10.
    scaler.load_state_dict(dict(scaler.state_dict(), scale=2.0**40, backoff_factor=2.0**-30))
    before = {k: v.clone() for k, v in trainer.model.state_dict().items()}
    done = trainer.train_step(0)
    loss, grad_norm, skipped = done.loss, done.grad_norm, done.skipped
    assert math.isfinite(loss) and scaler.get_scale() == 2.0**10 and skipped and not math.isfinite(grad_norm)
    assert all(torch.equal(v, before[k]) for k, v in trainer.model.state_dict().items())
    done = trainer.train_step(1)
    loss, grad_norm, skipped = done.loss, done.grad_norm, done.skipped
    assert math.isfinite(loss) and scaler.get_scale() == 2.0**10 and not skipped and math.isfinite(grad_norm)
    assert not torch.equal(trainer.model.lm_head.weight, before["lm_head.weight"])
    # A run: a scale this large overflows every fp16 gradient; backing off slowly keeps it overflowing.
    scaler.load_state_dict(dict(scaler.state_dict(), scale=2.0**40, backoff_factor=0.99))
    trainer.fit()
    rows = metrics(tmp_path / "out")
    assert [r["skipped_steps"] for r in rows] == list(range(1, 9))
    assert all(math.isfinite(r["loss"]) and r["loss_scale"] < 2.0**40 for r in rows)
    warnings = [line for line in capsys.readouterr().err.splitlines() if line.startswith("warning: the fp16")]
    assert len(warnings) == 1 and "skipped 6 of the last 20 steps" in warnings[0]
    scaler.load_state_dict(dict(scaler.state_dict(), scale=1.0, backoff_factor=0.5))
    done = trainer.train_step(8)
    grad_norm, skipped = done.grad_norm, done.skipped
    assert not skipped and math.isfinite(grad_norm)


def test_checkpoint_carries_the_scaler_state_into_a_resumed_run(args):
    cfg = load_config([*args, "--max_iters=2"])
    proc = Process(cfg)
    trainer = train.Trainer(prepare(cfg, proc), proc)
    scaler = trainer.setup.state.scaler
    scaler.load_state_dict(dict(scaler.state_dict(), scale=2.0**7, growth_interval=11))
    trainer.fit()
    saved = load_checkpoint(os.path.join(cfg.out_dir, "ckpt.pt"))["scaler"]
    assert (saved["scale"], saved["growth_interval"]) == (2.0**7, 11)
    resumed_cfg = load_config([*args, "--init_from=resume", "--max_iters=3"])
    resumed = train.Trainer(prepare(resumed_cfg, proc), proc)
    assert resumed.setup.state.scaler.state_dict() == scaler.state_dict()
