"""A run without validation rows: refused in one line before any work when it needs them (best_metric rougeL or
val_loss, evaluate_after), whether the settings say so (val_fraction=0, no validation_csv) or the data does (a
validation CSV with no usable row); trained with best_metric=last, which keeps the last save as best.pt; and no
figure is computed over zero rows (evaluate.py on such a run is one line)."""
import pytest

import evaluate
import train
from conftest import ONE_STEP, metrics, one_error_line, tiny
from summarizer.checkpoint import load_checkpoint


@pytest.fixture
def args(write_csv, tmp_path):
    return [*tiny(), *ONE_STEP, f"--train_csv={write_csv('train.csv', 16)}", f"--out_dir={tmp_path / 'out'}",
            f"--data_cache_dir={tmp_path / 'cache'}"]


@pytest.mark.parametrize("extra, named", [(["--best_metric=val_loss"], "best_metric='val_loss'"),
                                          (["--best_metric=rougeL", "--rouge_samples=4"], "best_metric='rougeL'"),
                                          (["--best_metric=last", "--evaluate_after=True"], "evaluate_after=True")])
def test_val_fraction_0_without_a_validation_csv_is_one_line_before_any_work(args, tmp_path, capsys, extra, named):
    err = one_error_line(capsys, train.main, [*args, "--val_fraction=0", *extra])
    assert "val_fraction=0 of train_csv leaves no validation rows" in err and named in err
    assert "--validation_csv=<a CSV>" in err
    assert not (tmp_path / "out").exists() and not (tmp_path / "cache").exists()


def test_a_validation_csv_without_a_usable_row_is_one_line(args, tmp_path, capsys):
    long = " ".join(["words"] * 200)  # a summary alone longer than block_size: the row cannot be an example
    (tmp_path / "long.csv").write_text(f'id,dialogue,summary\n1,"A: hi","{long}"\n')
    err = one_error_line(capsys, train.main, [*args, f"--validation_csv={tmp_path / 'long.csv'}"])
    assert f"validation_csv={tmp_path / 'long.csv'} leaves no validation rows" in err
    assert not (tmp_path / "out" / "ckpt.pt").exists()


def test_best_metric_last_trains_without_validation_and_evaluate_says_there_is_nothing_to_score(args, tmp_path,
                                                                                                capsys):
    train.main([*args, "--val_fraction=0", "--best_metric=last", "--max_iters=2", "--eval_interval=1",
                "--log_interval=1"])
    assert all("val_loss" not in row for row in metrics(tmp_path / "out"))  # no loss of zero rows
    assert load_checkpoint(str(tmp_path / "out" / "best.pt"))["iter_num"] == 2  # the last save
    err = one_error_line(capsys, evaluate.main, [*tiny(init_from=None), f"--out_dir={tmp_path / 'out'}",
                                                  f"--data_cache_dir={tmp_path / 'cache'}"])
    assert "no validation rows to score" in err and "--validation_csv=" in err
