"""Every checkpoint of format 3 on still works. tests/fixtures/checkpoints/<date>/ holds a ckpt.pt and a best.pt
written by the last commit of that day with its own train.py (make.sh remakes them; command.txt says how): each is
upgraded step by step to today's format, and predict, evaluate, export and resume take it. A file of a retired
format (1 and 2, the first two days'), of a newer format, or one that cannot be upgraded, is one line that says
which version wrote it and what to do. A run of the calibration stage (retired after 605acfc) is read as any other,
and its resume is one line."""
import json
import os

import pandas as pd
import pytest
import torch

import data
import evaluate
import predict
import train
from command_line import UserError
from config import FIELDS, LORA_TARGETS, Config
from conftest import REPO, assert_export_matches, one_error_line
from summarizer import checkpoint
from summarizer.checkpoint import FORMAT, format_of, load_checkpoint, save_checkpoint

FIXTURES = os.path.join(REPO, "tests", "fixtures", "checkpoints")
FORMATS = {"2026-11-25": 3, "2026-11-26": 4}  # the format each day's files have
DEMO = "data/demo"  # the fixtures' runs name their CSVs relative to the repository, as they were trained


@pytest.fixture(params=sorted(FORMATS))
def written(request, monkeypatch):
    """(the date, the folder of its ckpt.pt and best.pt); the working directory is the repository's."""
    monkeypatch.chdir(REPO)
    return request.param, os.path.join(FIXTURES, request.param)


@pytest.fixture(scope="module")
def cache(tmp_path_factory):
    return f"--data_cache_dir={tmp_path_factory.mktemp('cache')}"


def test_each_file_is_told_by_its_keys_and_read_in_todays_format(written):
    date, folder = written
    for name in ("ckpt.pt", "best.pt"):
        path = os.path.join(folder, name)
        assert format_of(torch.load(path, weights_only=True, map_location="cpu")) == FORMATS[date]
        ckpt = load_checkpoint(path)
        # what a later command reads of a run
        taken = {key for key, f in FIELDS.items() if f.metadata["scope"] != "command"}
        assert ckpt["format"] == FORMAT and taken <= set(ckpt["config"]) <= set(FIELDS)
        saved = Config(**ckpt["config"])  # every setting there, typed and within its rules
        assert (saved.n_layer, saved.n_embd, saved.block_size, saved.num_beams) == (1, 4, 64, 2)
        assert saved.max_time is None and saved.lora_targets == LORA_TARGETS and saved.sweep == {}
        assert ckpt["tokenizer"] == data.TOKENIZER_ID
        assert ckpt["best_metric"] == "val_loss" and ckpt["best_score"] == pytest.approx(ckpt["metrics"]["val_loss"])


def test_a_new_setting_needs_no_new_format_only_the_value_it_replaces(written, monkeypatch, tmp_path):
    """A setting added after a file was written takes, as the file loads, the value that was in effect then
    (checkpoint.ABSENT, one entry per key); a file that has the key keeps its own."""
    monkeypatch.setitem(checkpoint.ABSENT, "new_setting", 7)
    _, folder = written
    for name in ("ckpt.pt", "best.pt"):
        ckpt = load_checkpoint(os.path.join(folder, name))
        assert ckpt["format"] == FORMAT and ckpt["config"]["new_setting"] == 7
        save_checkpoint({**ckpt, "config": {**ckpt["config"], "new_setting": 3}}, str(tmp_path / name))
        assert load_checkpoint(str(tmp_path / name))["config"]["new_setting"] == 3


def test_predict_writes_the_submission_with_the_runs_decoding(written, cache, tmp_path, capsys):
    date, folder = written
    predict.main([f"--ckpt={folder}/best.pt", f"--out_dir={tmp_path}", f"--test_csv={DEMO}/test.csv",
                  f"--sample_submission_csv={DEMO}/sample_submission.csv", cache])
    first = capsys.readouterr().out.splitlines()[0]
    assert "decoding: beam search: max_new_tokens=16 num_beams=2 (the run's)" in first
    submission, test = pd.read_csv(tmp_path / "submission.csv"), pd.read_csv(f"{DEMO}/test.csv")
    assert list(submission["id"]) == list(test["id"])


def test_evaluate_scores_the_runs_validation_split(written, cache, tmp_path, capsys):
    _, folder = written
    evaluate.main([f"--ckpt={folder}/ckpt.pt", f"--out_dir={tmp_path}", cache])
    out = capsys.readouterr().out
    report = json.loads((tmp_path / "eval_metrics.json").read_text())
    assert report["n"] == len(pd.read_csv(f"{DEMO}/validation.csv")) and report["step"] == 2
    assert f"validation {DEMO}/validation.csv" in out.splitlines()[0]


def test_export_writes_a_transformers_folder_that_computes_our_logits(written, tmp_path):
    _, folder = written
    assert_export_matches(os.path.join(folder, "best.pt"), str(tmp_path / "export"))


def test_resume_into_another_folder_continues_with_the_runs_settings(written, cache, tmp_path, capsys):
    _, folder = written
    train.main([f"--resume_from={folder}/ckpt.pt", f"--out_dir={tmp_path}", "--max_iters=3", cache])
    out = capsys.readouterr()
    ckpt = load_checkpoint(str(tmp_path / "ckpt.pt"))
    assert ckpt["iter_num"] == 3 and ckpt["format"] == FORMAT
    assert ckpt["config"]["train_csv"] == f"{DEMO}/train.csv" and ckpt["model_args"]["n_embd"] == 4
    assert "changed from the run's by the command line: max_iters=2 -> 3" in out.out
    assert "--n_layer" not in out.out + out.err  # no shape flag was given, and none is named


def test_a_file_from_a_newer_version_is_one_line(tmp_path, capsys):
    ckpt = load_checkpoint(os.path.join(FIXTURES, "2026-11-25", "best.pt"))
    save_checkpoint({**ckpt, "format": FORMAT + 1}, str(tmp_path / "best.pt"))
    err = one_error_line(capsys, predict.main, [f"--ckpt={tmp_path / 'best.pt'}", f"--out_dir={tmp_path}"])
    assert f"checkpoint of format {FORMAT + 1}, written by a newer version" in err and "update the code" in err


def test_a_file_that_cannot_be_upgraded_says_which_version_wrote_it(tmp_path):
    raw = torch.load(os.path.join(FIXTURES, "2026-11-25", "best.pt"), weights_only=True, map_location="cpu")
    raw["config"]["max_time"] = "soon"
    save_checkpoint(raw, str(tmp_path / "best.pt"))
    with pytest.raises(UserError, match=r"format 3 \(the version of 2026-11-25\) that cannot be upgraded"):
        load_checkpoint(str(tmp_path / "best.pt"))


@pytest.mark.parametrize("version, written_on", [(1, "2026-11-23"), (2, "2026-11-24")])
def test_a_retired_format_is_one_line_naming_the_last_commit_that_reads_it(version, written_on, tmp_path, capsys):
    """Formats 1 and 2 (the first two days', before any release) are told by the keys they lack."""
    raw = torch.load(os.path.join(FIXTURES, "2026-11-25", "best.pt"), weights_only=True, map_location="cpu")
    del raw["best_val_loss"]  # added by format 3
    if version == 1:
        del raw["tokenizer"]  # added by format 2
    save_checkpoint(raw, str(tmp_path / "best.pt"))
    err = one_error_line(capsys, predict.main, [f"--ckpt={tmp_path / 'best.pt'}", f"--out_dir={tmp_path}"])
    assert f"checkpoint of format {version}, written on {written_on}" in err and "commit 103baa6" in err
    assert "train anew, or predict with that commit" in err


# ---- a run of the calibration stage, retired after 605acfc ----------------------------------------------------

@pytest.fixture
def calibrated(tmp_path, monkeypatch):
    """The folder of ckpt.pt and best.pt as 605acfc's calibrate.py wrote them (format 5, whose contents the
    2026-11-26 files have: checked against a file that commit wrote): its settings, rank_* and candidates_file
    among them, and in ckpt.pt the key of its candidate summaries. Built here: a real one is 3 MB."""
    monkeypatch.chdir(REPO)
    folder = tmp_path / "out-calibrated"
    folder.mkdir()
    for name in ("ckpt.pt", "best.pt"):
        raw = torch.load(os.path.join(FIXTURES, "2026-11-26", name), weights_only=True, map_location="cpu")
        raw["format"] = 5
        raw["config"].update(init_from="out/best.pt", rank_weight=1.0, rank_candidates=2, candidates_file="")
        if name == "ckpt.pt":
            raw["candidates"] = {"weights": "54e6490f", "rows": "88085fa1", "decoding": "beam", "candidates": 2,
                                 "max_new_tokens": 16, "seed": 1337}
        save_checkpoint(raw, str(folder / name))
    return folder


def test_a_calibration_run_predicts_evaluates_and_exports(calibrated, cache, tmp_path):
    predict.main([f"--ckpt={calibrated}/best.pt", f"--out_dir={tmp_path}", f"--test_csv={DEMO}/test.csv",
                  f"--sample_submission_csv={DEMO}/sample_submission.csv", cache])
    assert list(pd.read_csv(tmp_path / "submission.csv")["id"]) == list(pd.read_csv(f"{DEMO}/test.csv")["id"])
    evaluate.main([f"--ckpt={calibrated}/ckpt.pt", f"--out_dir={tmp_path}", cache])
    assert json.loads((tmp_path / "eval_metrics.json").read_text())["step"] == 2
    assert_export_matches(str(calibrated / "best.pt"), str(tmp_path / "export"))


def test_a_calibration_runs_resume_is_one_line_that_says_what_still_works(calibrated, cache, tmp_path, capsys):
    err = one_error_line(capsys, train.main, [f"--resume_from={calibrated}/ckpt.pt", f"--out_dir={tmp_path}", cache])
    assert f"{calibrated}/ckpt.pt is a run of the calibration stage, which was retired after commit 605acfc" in err
    assert "evaluate.py, predict.py and export.py read it" in err
    assert f"--init_from={calibrated}/best.pt --out_dir=<a new folder>" in err
    train.main([f"--init_from={calibrated}/best.pt", f"--out_dir={tmp_path / 'new'}", cache])  # as the line says
    assert load_checkpoint(str(tmp_path / "new" / "ckpt.pt"))["iter_num"] == 2
