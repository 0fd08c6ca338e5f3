"""log_to (summarizer/tracking.py): TensorBoard's scalars and W&B's rows are metrics.jsonl's, with the run's config;
TensorBoard shows each step once across resumes and fresh runs; a W&B problem stops the run first, in one line."""
import json
import sys
import types

import pytest
from tensorboard.backend.event_processing.event_accumulator import EventAccumulator
from tensorboard.plugins.hparams.plugin_data_pb2 import HParamsPluginData

import train
from command_line import UserError
from config import load_config
from conftest import metrics, one_error_line, save_csv, synthetic_rows, tiny
from summarizer.tracking import Tracker

MODEL = [*tiny(n_embd=64), "--batch_size=16", "--micro_batch_size=16", "--warmup_iters=5", "--learning_rate=1e-2",
         "--log_interval=1"]


class FakeWandb(types.ModuleType):
    """Records what the tracker hands to wandb (init, log, finish)."""

    def __init__(self, logged_in=True):
        super().__init__("wandb")
        self.logged_in, self.inits, self.rows, self.exit_codes = logged_in, [], [], []

    def login(self, prompt=True, verify=True):
        assert not prompt and not verify, "the login check must not prompt or go to the network"
        return self.logged_in

    def init(self, **kwargs):
        self.inits.append(kwargs)
        return self

    def log(self, row, step):
        self.rows.append((step, row))

    def finish(self, exit_code=None):
        self.exit_codes.append(exit_code)


@pytest.fixture(scope="module")
def run(tmp_path_factory):
    """A tiny model trained 4 steps, evaluated (loss and ROUGE) every 2, logged to TensorBoard and a fake W&B."""
    folder = tmp_path_factory.mktemp("tracking")
    save_csv(folder / "train.csv", synthetic_rows(64, seed=0))
    save_csv(folder / "validation.csv", synthetic_rows(24, seed=3))
    args = [*MODEL, f"--train_csv={folder / 'train.csv'}", f"--validation_csv={folder / 'validation.csv'}",
            f"--data_cache_dir={folder / 'cache'}", f"--out_dir={folder / 'out'}"]
    wandb = FakeWandb()
    with pytest.MonkeyPatch.context() as patch:
        patch.setitem(sys.modules, "wandb", wandb)
        train.main([*args, "--max_iters=4", "--eval_interval=2", "--rouge_samples=4", "--log_to=tensorboard,wandb",
                    "--wandb_run_name=tiny"])
    return types.SimpleNamespace(out=folder / "out", wandb=wandb, cfg=load_config(args))


def test_tensorboard_scalars_equal_metrics_jsonl(run):
    rows = metrics(run.out)
    events = EventAccumulator(str(run.out / "tensorboard"))
    events.Reload()
    keys = {key for row in rows for key in row} - {"iter"}
    assert {"loss", "lr", "val_loss", "rougeL"} <= keys
    assert set(events.Tags()["scalars"]) == keys
    for key in keys:
        logged = [(e.step, e.value) for e in events.Scalars(key)]
        expected = [(row["iter"], row[key]) for row in rows if key in row]
        assert [s for s, _ in logged] == [s for s, _ in expected], key
        assert [v for _, v in logged] == pytest.approx([v for _, v in expected], rel=1e-6), key  # float32
    start = HParamsPluginData.FromString(events.PluginTagToContent("hparams")["_hparams_/session_start_info"])
    hparams = start.session_start_info.hparams
    assert hparams["learning_rate"].number_value == pytest.approx(1e-2)
    assert hparams["init_from"].string_value == "scratch" and hparams["n_embd"].number_value == 64


def test_wandb_gets_every_row_and_the_config(run):
    rows = metrics(run.out)
    (init,) = run.wandb.inits
    assert init["config"] == json.load(open(run.out / "config.json"))
    assert init["name"] == "tiny" and init["project"] == run.cfg.wandb_project
    assert run.wandb.rows == [(row["iter"], {k: v for k, v in row.items() if k != "iter"}) for row in rows]
    assert run.wandb.exit_codes == [0]


def test_wandb_problems_stop_the_run_first_in_one_line(monkeypatch, capsys, tmp_path):
    argv = ["--log_to=wandb", f"--out_dir={tmp_path}", "--train_csv=does-not-exist.csv"]
    monkeypatch.setitem(sys.modules, "wandb", None)  # not installed
    assert "needs the wandb package: pip install wandb" in one_error_line(capsys, train.main, argv)
    Tracker(load_config(argv), is_main=False)  # other ranks never import it
    monkeypatch.setitem(sys.modules, "wandb", FakeWandb(logged_in=False))
    assert "wandb login" in one_error_line(capsys, train.main, argv)
    monkeypatch.setenv("WANDB_MODE", "offline")
    Tracker(load_config(argv), is_main=True)
    with pytest.raises(UserError, match="'tensorbord' is not one of"):
        load_config(["--log_to=tensorboard,tensorbord"])


def tensorboard_losses(folder):
    events = EventAccumulator(str(folder))
    events.Reload()
    return [(e.step, e.value) for e in events.Scalars("loss")]


def test_tensorboard_follows_resumes_and_fresh_runs(write_csv, tmp_path):
    """A run resumed from an earlier checkpoint hides the steps it redoes (TensorBoard shows each step once, as
    last trained); a fresh run moves the earlier run's events aside with its other files."""
    out = tmp_path / "out"
    args = [*MODEL, f"--train_csv={write_csv('train.csv', 32)}", f"--data_cache_dir={tmp_path / 'cache'}",
            f"--out_dir={out}", "--batch_size=8", "--micro_batch_size=8", "--eval_interval=2", "--rouge_samples=0",
            "--best_metric=val_loss", "--eval_val_batches=1", "--log_to=tensorboard"]
    train.main([*args, "--max_iters=2"])
    at_step_2 = (out / "ckpt.pt").read_bytes()
    train.main([*args, "--max_iters=4", "--init_from=resume", "--learning_rate=1e-3"])
    (out / "ckpt.pt").write_bytes(at_step_2)  # as if the run had crashed after step 4 but before its checkpoint
    train.main([*args, "--max_iters=4", "--init_from=resume"])
    last = {row["iter"]: row["loss"] for row in metrics(out)}  # later rows of a step win, as in TensorBoard
    logged = tensorboard_losses(out / "tensorboard")
    assert [step for step, _ in logged] == [1, 2, 3, 4]
    assert [value for _, value in logged] == pytest.approx([last[step] for step in (1, 2, 3, 4)], rel=1e-6)
    train.main([*args, "--max_iters=1"])
    assert [step for step, _ in tensorboard_losses(out / "tensorboard")] == [1]
    (previous,) = out.glob("previous-run-*")
    assert [step for step, _ in tensorboard_losses(previous / "tensorboard")] == [1, 2, 3, 4]


def test_a_run_continued_into_a_new_folder_carries_its_earlier_history_or_says_where_it_is(write_csv, tmp_path,
                                                                                            capsys):
    """The second Kaggle session continues the first's ckpt.pt into a new out_dir: its metrics.jsonl (so
    metrics.png and the report) starts with the first session's rows; a ckpt.pt without them is named."""
    args = [*MODEL, f"--train_csv={write_csv('train.csv', 32)}", f"--data_cache_dir={tmp_path / 'cache'}",
            "--batch_size=8", "--micro_batch_size=8", "--eval_interval=2", "--rouge_samples=0",
            "--best_metric=val_loss", "--eval_val_batches=1"]
    train.main([*args, "--max_iters=2", f"--out_dir={tmp_path / 'first'}"])
    first = metrics(tmp_path / "first")
    capsys.readouterr()
    train.main([*args, "--max_iters=4", f"--resume_from={tmp_path / 'first' / 'ckpt.pt'}",
                f"--out_dir={tmp_path / 'second'}"])
    assert f"carried over from {tmp_path / 'first' / 'metrics.jsonl'}" in capsys.readouterr().out
    second = metrics(tmp_path / "second")
    assert second[:len(first)] == first and sorted({row["iter"] for row in second}) == [1, 2, 3, 4]
    alone = tmp_path / "attached"
    alone.mkdir()
    (alone / "ckpt.pt").write_bytes((tmp_path / "first" / "ckpt.pt").read_bytes())
    train.main([*args, "--max_iters=3", f"--resume_from={alone / 'ckpt.pt'}", f"--out_dir={tmp_path / 'third'}"])
    assert f"note: no metrics.jsonl beside {alone / 'ckpt.pt'}: this folder's metrics.jsonl" in \
        capsys.readouterr().out
    assert sorted({row["iter"] for row in metrics(tmp_path / "third")}) == [3]
