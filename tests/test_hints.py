"""Every hint leads to a command that works when followed literally: the flags an error line names, given as it
names them (a placeholder `<...>` filled in), run."""
import re
import shlex

import pandas as pd
import pytest

import evaluate
import predict
import train
from conftest import ONE_STEP, held_by_another_process, one_error_line, save_csv, synthetic_rows, tiny
from summarizer import run_folder
from summarizer.checkpoint import load_checkpoint


@pytest.fixture(scope="module")
def trained(tmp_path_factory):
    """A one-step tiny run; (its folder, the arguments that trained it, but out_dir)."""
    folder = tmp_path_factory.mktemp("hints")
    save_csv(folder / "train.csv", synthetic_rows(24, seed=0))
    args = [*tiny(), *ONE_STEP, f"--train_csv={folder / 'train.csv'}", f"--data_cache_dir={folder / 'cache'}"]
    train.main([*args, f"--out_dir={folder / 'out'}"])
    return folder, args


@pytest.fixture
def read_only_out(trained, monkeypatch):
    """The trained run's out/ refuses new files (root ignores a folder's permissions)."""
    out, real_open = str(trained[0] / "out"), open

    def read_only(path, *rest, **kwargs):
        if str(path).startswith(out) and ".write-test" in str(path):
            raise PermissionError(13, "Permission denied", path)
        return real_open(path, *rest, **kwargs)
    monkeypatch.setattr(run_folder, "open", read_only, raising=False)


def test_a_runs_folder_as_init_from_names_the_checkpoint_to_start_from(trained, tmp_path, capsys):
    folder, args = trained
    err = one_error_line(capsys, train.main, [*args, f"--init_from={folder / 'out'}", f"--out_dir={tmp_path}"])
    hinted = re.search(r"name its checkpoint, (--init_from=\S+)", err)[1]
    train.main([*args, hinted, f"--out_dir={tmp_path}"])
    assert load_checkpoint(str(tmp_path / "ckpt.pt"))["iter_num"] == 1


def test_an_unwritable_out_dir_names_the_checkpoint_read_from_it(trained, read_only_out, tmp_path, capsys):
    folder, args = trained
    scoring = [*tiny(init_from=None), f"--data_cache_dir={folder / 'cache'}"]
    for main in (evaluate.main, predict.main):
        err = one_error_line(capsys, main, [*scoring, f"--out_dir={folder / 'out'}"])
        hinted = re.search(r"choose another with --out_dir=<a writable folder> and keep reading \S+ with (--ckpt=\S+)",
                           err)[1]
        test = save_csv(tmp_path / "test.csv", synthetic_rows(3, seed=5), test=True)
        main([*scoring, f"--out_dir={tmp_path / 'scored'}", hinted, f"--test_csv={test}", "--sample_submission_csv="])
    assert (tmp_path / "scored" / "eval_metrics.json").is_file() and (tmp_path / "scored" / "submission.csv").is_file()


def test_a_folder_as_test_csv_names_the_csv_in_it(trained, tmp_path, capsys):
    folder, _ = trained
    data = tmp_path / "kaggle-input"
    data.mkdir()
    save_csv(data / "test.csv", synthetic_rows(3, seed=6), test=True)
    scoring = [*tiny(init_from=None), f"--ckpt={folder / 'out' / 'best.pt'}", f"--out_dir={tmp_path / 'out'}",
               "--sample_submission_csv="]
    err = one_error_line(capsys, predict.main, [*scoring, f"--test_csv={data}"])
    hinted = re.search(r"name the CSV inside it, e\.g\. (--test_csv=\S+)", err)[1]
    predict.main([*scoring, hinted])
    assert len(pd.read_csv(tmp_path / "out" / "submission.csv")) == 3


def test_a_key_with_one_dash_is_hinted_with_two(trained, tmp_path, capsys):
    folder, args = trained
    err = one_error_line(capsys, train.main, [*args, "-max_iters=2", f"--out_dir={tmp_path}"])
    hinted = re.search(r"to set a key, write (\S+)$", err)[1]
    assert hinted == "--max_iters=2"
    train.main([*args, hinted, "--eval_interval=2", f"--out_dir={tmp_path}"])
    assert load_checkpoint(str(tmp_path / "ckpt.pt"))["iter_num"] == 2


def test_a_value_split_by_a_space_is_named_as_the_keys_value(trained, tmp_path, capsys):
    """`--max_time 1h 30m` in a shell is three words; the hint is one, as the shell passes `--max_time='1h 30m'`."""
    folder, args = trained
    err = one_error_line(capsys, train.main, [*args, "--max_time", "1h", "30m", f"--out_dir={tmp_path}"])
    assert err == "error: '30m' follows --max_time 1h: a value with a space must be one word: --max_time='1h 30m'"
    train.main([*args, "--max_time=1h 30m", f"--out_dir={tmp_path}"])  # the hint, as the shell hands it over
    assert load_checkpoint(str(tmp_path / "ckpt.pt"))["config"]["max_time"] == 5400


def test_a_folder_as_train_csv_names_the_csv_with_dialogues_and_summaries(trained, tmp_path, capsys):
    """A competition's folder: the first CSV by name (sample_submission.csv) has no dialogues; train.csv has both."""
    folder, args = trained
    competition = tmp_path / "input"
    competition.mkdir()
    save_csv(competition / "train.csv", synthetic_rows(24, seed=0))
    save_csv(competition / "test.csv", synthetic_rows(4, seed=1), test=True)
    pd.DataFrame({"id": ["a"], "summary": [""]}).to_csv(competition / "sample_submission.csv", index=False)
    err = one_error_line(capsys, train.main, [*args, f"--train_csv={competition}", f"--out_dir={tmp_path / 'out'}"])
    hinted = re.search(r"e\.g\. (--train_csv=\S+)$", err)[1]
    assert hinted == f"--train_csv={competition / 'train.csv'}"
    train.main([*args, hinted, f"--out_dir={tmp_path / 'out'}"])
    assert load_checkpoint(str(tmp_path / "out" / "ckpt.pt"))["iter_num"] == 1


def test_a_resume_into_an_unwritable_out_dir_names_the_checkpoint_it_reads(trained, read_only_out, tmp_path, capsys):
    folder, args = trained
    resume = [*args, "--init_from=resume", "--max_iters=2", "--eval_interval=2"]
    err = one_error_line(capsys, train.main, [*resume, f"--out_dir={folder / 'out'}"])
    hinted = re.search(r"choose another with --out_dir=<a writable folder> and keep reading \S+ with "
                       r"(--resume_from=\S+)", err)[1]
    assert hinted == f"--resume_from={folder / 'out' / 'ckpt.pt'}"
    train.main([*resume, f"--out_dir={tmp_path / 'out'}", hinted])
    assert load_checkpoint(str(tmp_path / "out" / "ckpt.pt"))["iter_num"] == 2


@pytest.mark.slow  # held_by_another_process starts a process
def test_a_resume_into_a_folder_whose_run_has_not_saved_yet_names_that_run(trained, tmp_path, capsys):
    folder, args = trained
    out = tmp_path / "out"
    out.mkdir()
    with held_by_another_process(out) as pid:  # a training run holds the folder and has written no ckpt.pt yet
        err = one_error_line(capsys, train.main, [*args, "--init_from=resume", f"--out_dir={out}"])
    assert f"out_dir {out} is in use by a training run that has not saved a checkpoint (pid {pid} " in err
    assert "wait for its first save" in err


@pytest.mark.parametrize("role, renamed", [("dialogue", {"dialogue": "conversation"}), ("id", {"id": "key"})])
def test_a_test_csv_whose_columns_differ_from_train_csvs_names_a_setting_of_its_own(role, renamed, trained, tmp_path,
                                                                                    capsys):
    """--dialogue_column (--id_column) would rename train.csv's column too: with predict_after, train.py could not
    follow it; test_csv's own setting leaves train.csv's alone."""
    folder, args = trained
    rows = pd.DataFrame(synthetic_rows(3, seed=7)).drop(columns="summary").rename(columns=renamed)
    test = save_csv(tmp_path / "test.csv", rows)
    run = [*args, "--predict_after=True", f"--test_csv={test}", "--sample_submission_csv=", f"--out_dir={tmp_path}"]
    err = one_error_line(capsys, train.main, run)
    hinted = re.search(r"rename the column or pass (--\w+)=NAME$", err)[1] + f"={renamed[role]}"
    assert hinted == f"--test_{role}_column={renamed[role]}"
    train.main([*run, hinted])
    assert len(pd.read_csv(tmp_path / "submission.csv")) == 3
    (tmp_path / "submission.csv").unlink()
    predict.main([*tiny(init_from=None), f"--out_dir={tmp_path}", f"--test_csv={test}", "--sample_submission_csv=",
                  hinted])  # the run's own checkpoint, as predict.py reads it later
    assert len(pd.read_csv(tmp_path / "submission.csv")) == 3


def test_a_validation_csv_whose_dialogue_column_differs_is_told_to_rename_it(trained, tmp_path, capsys):
    """--dialogue_column would rename train.csv's column too: the way out is the validation CSV's own column."""
    folder, args = trained
    val = tmp_path / "val.csv"
    pd.DataFrame(synthetic_rows(4, seed=8)).rename(columns={"dialogue": "conversation"}).to_csv(val, index=False)
    run = [*args, f"--validation_csv={val}", f"--out_dir={tmp_path / 'out'}"]
    err = one_error_line(capsys, train.main, run)
    column = re.search(r"rename its dialogue column to one of (\w+)", err)[1]
    pd.read_csv(val).rename(columns={"conversation": column}).to_csv(val, index=False)
    train.main(run)
    assert load_checkpoint(str(tmp_path / "out" / "ckpt.pt"))["iter_num"] == 1


def test_a_training_csv_all_held_out_names_a_validation_csv(trained, tmp_path, capsys):
    folder, args = trained
    run = [*args, f"--train_csv={save_csv(tmp_path / 'one.csv', synthetic_rows(1, seed=9))}",
           f"--out_dir={tmp_path / 'out'}"]
    err = one_error_line(capsys, train.main, run)
    hinted = re.search(r"or pass (--validation_csv=)<a CSV of validation rows>", err)[1]
    train.main([*run, hinted + save_csv(tmp_path / "val.csv", synthetic_rows(4, seed=8))])
    assert load_checkpoint(str(tmp_path / "out" / "ckpt.pt"))["iter_num"] == 1


@pytest.mark.parametrize("sample", [{"id": ["other"], "summary": [""]}, {"ID": ["d7-0"], "summary": [""]}])
def test_a_sample_submission_unlike_test_csv_names_the_way_to_skip_its_check(sample, trained, tmp_path, capsys):
    folder, _ = trained
    path = tmp_path / "sample_submission.csv"
    pd.DataFrame(sample).to_csv(path, index=False)
    scoring = [*tiny(init_from=None), f"--ckpt={folder / 'out' / 'best.pt'}", f"--out_dir={tmp_path / 'out'}",
               f"--test_csv={save_csv(tmp_path / 'test.csv', synthetic_rows(3, seed=7), test=True)}"]
    err = one_error_line(capsys, predict.main, [*scoring, f"--sample_submission_csv={path}"])
    hinted = re.search(r"\((--sample_submission_csv)='' skips the check\)$", err)[1] + "="  # '' as the shell passes it
    predict.main([*scoring, hinted])
    assert len(pd.read_csv(tmp_path / "out" / "submission.csv")) == 3


def test_a_json_train_csv_beside_a_csv_converts_to_a_free_name_and_trains(trained, tmp_path, capsys, monkeypatch):
    """The conversion hint, run as it is written from the working folder, writes a CSV no file had there (train.csv
    is kept) and the flag it names trains."""
    folder, args = trained
    monkeypatch.chdir(tmp_path)
    rows = synthetic_rows(24, seed=3)
    pd.DataFrame(rows).to_json(tmp_path / "train.json", orient="records")
    save_csv(tmp_path / "train.csv", synthetic_rows(24, seed=4))
    before = (tmp_path / "train.csv").read_bytes()
    err = one_error_line(capsys, train.main, [*args, f"--train_csv={tmp_path / 'train.json'}",
                                              f"--out_dir={tmp_path / 'out'}"])
    command, flag = re.search(r"convert it: (.+), then pass (--train_csv=\S+)$", err).groups()
    program, option, code = shlex.split(command)  # as a shell reads it
    assert (program, option) == ("python", "-c")
    exec(code, {})  # a fresh namespace, as python -c has
    assert (tmp_path / "train.csv").read_bytes() == before and flag == f"--train_csv={tmp_path / 'train-2.csv'}"
    train.main([*args, flag, f"--out_dir={tmp_path / 'out'}"])
    assert load_checkpoint(str(tmp_path / "out" / "ckpt.pt"))["iter_num"] == 1


def test_a_mistyped_baseline_lists_every_choice_and_the_closest_which_scores(trained, tmp_path, capsys):
    folder, _ = trained
    flags = [f"--train_csv={folder / 'train.csv'}", f"--data_cache_dir={folder / 'cache'}", "--device=cpu",
             f"--out_dir={tmp_path / 'out'}"]
    err = one_error_line(capsys, evaluate.main, [*flags, "--baseline=lead4"])
    assert all(name in err for name in ("first_line", "lead3", "longest3", "scratch", "gpt2", "gpt2-xl", "folder"))
    hinted = re.search(r"did you mean (--baseline=\S+)\?$", err)[1]
    assert hinted == "--baseline=lead3"
    evaluate.main([*flags, hinted])
    assert (tmp_path / "out" / "baseline-lead3" / "eval_metrics.json").is_file()


def test_a_resume_from_a_best_pt_names_the_new_run_that_trains_on_from_it(trained, tmp_path, capsys):
    folder, args = trained
    best = folder / "out" / "best.pt"
    err = one_error_line(capsys, train.main, [*args, f"--resume_from={best}", f"--out_dir={tmp_path / 'out'}",
                                              "--max_iters=2"])
    hinted = re.search(r"in a new run: (--init_from=\S+) --out_dir=<a new folder>$", err)[1]
    train.main([*args, hinted, f"--out_dir={tmp_path / 'new'}"])
    assert load_checkpoint(str(tmp_path / "new" / "ckpt.pt"))["iter_num"] == 1
