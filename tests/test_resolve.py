"""A later command's settings (config.resolve): every setting's scope (config.SCOPES) decides what a resume, a new run
from a checkpoint's weights, evaluate/predict and export take from the run's record. A resume with no flags
continues the run, in place or into another folder; a flag changes what may change and is printed as a change;
a flag that contradicts what training fixed stops in one line naming it and the run's value; a message never names
a flag that was not given."""
import json
import re

import pytest
import torch

import export
import train
from command_line import UserError
from config import FIELDS, SCOPES, USES, flags_given, load_config, resolve, takes
from conftest import ONE_STEP, one_error_line, save_csv, synthetic_rows, tiny
from summarizer.checkpoint import load_checkpoint
from summarizer.inference import open_summary_model

TEMPLATE = "Chat:\n{dialogue}\nSummary:"


@pytest.fixture(scope="module")
def run(tmp_path_factory):
    """A two-step run trained with its own CSVs, template, shape and decoding; (folder, its out_dir, the cache
    flag that later commands pass so as not to write into the working directory)."""
    folder = tmp_path_factory.mktemp("resolve")
    save_csv(folder / "train.csv", synthetic_rows(24, seed=0))
    save_csv(folder / "validation.csv", synthetic_rows(4, seed=1))
    cache = f"--data_cache_dir={folder / 'cache'}"
    train.main([*tiny(block_size=64), *ONE_STEP, "--max_iters=2", "--eval_interval=2", "--num_beams=2",
                "--learning_rate=1e-3", "--seed=7", "--gen_batch_size=5", "--warmup_iters=3",
                f"--prompt_template={TEMPLATE!r}", f"--train_csv={folder / 'train.csv'}",
                f"--validation_csv={folder / 'validation.csv'}", f"--out_dir={folder / 'out'}", cache])
    return folder, folder / "out", cache


def test_a_resume_with_no_flags_but_max_iters_continues_the_run_in_place(run, tmp_path, capsys):
    folder, out, cache = run
    copy = tmp_path / "out"
    copy.mkdir()
    (copy / "ckpt.pt").write_bytes((out / "ckpt.pt").read_bytes())
    capsys.readouterr()
    train.main(["--init_from=resume", f"--out_dir={copy}", "--max_iters=3", cache])
    printed = capsys.readouterr().out
    assert "changed from the run's by the command line: max_iters=2 -> 3" in printed
    saved = json.loads((copy / "config.json").read_text())
    assert (saved["train_csv"], saved["n_layer"], saved["block_size"], saved["prompt_template"], saved["num_beams"]) \
        == (str(folder / "train.csv"), 1, 64, TEMPLATE, 2)
    assert load_checkpoint(str(copy / "ckpt.pt"))["iter_num"] == 3


def test_a_resume_into_another_folder_names_no_flag_it_was_not_given(run, tmp_path, capsys):
    _, out, cache = run
    capsys.readouterr()
    train.main([f"--resume_from={out / 'ckpt.pt'}", f"--out_dir={tmp_path / 'next'}", "--max_iters=3",
                "--learning_rate=5e-4", cache])
    printed = capsys.readouterr()
    assert "max_iters=2 -> 3 learning_rate=0.001 -> 0.0005" in printed.out
    assert "--n_layer" not in printed.out + printed.err and "n_layer=12" not in printed.out + printed.err
    assert load_checkpoint(str(tmp_path / "next" / "ckpt.pt"))["config"]["learning_rate"] == 5e-4


@pytest.mark.parametrize("flag, value", [("--n_layer=2", "n_layer=1"), ("--block_size=128", "block_size=64"),
                                         ("--warmup_iters=5", "warmup_iters=3"), ("--lora_rank=4", "lora_rank=0")])
def test_a_flag_that_contradicts_what_training_fixed_is_one_line_naming_it_and_the_runs_value(run, tmp_path,
                                                                                               capsys, flag, value):
    _, out, cache = run
    err = one_error_line(capsys, train.main, [f"--resume_from={out / 'ckpt.pt'}", f"--out_dir={tmp_path}",
                                              "--max_iters=3", flag, cache])
    assert err.startswith(f"error: {flag} contradicts {out / 'ckpt.pt'}: it was trained with {value}")
    assert not (tmp_path / "ckpt.pt").exists()


def test_a_new_run_from_a_checkpoints_weights_takes_its_template_and_decoding(run, tmp_path):
    """init_from=<best.pt> takes the row format, decoding and data of the run; a flag changes any of them but the
    shape."""
    folder, out, cache = run
    train.main([f"--init_from={out / 'best.pt'}", f"--out_dir={tmp_path}", "--max_iters=1", "--num_beams=1", cache])
    saved = json.loads((tmp_path / "config.json").read_text())
    assert (saved["prompt_template"], saved["block_size"], saved["num_beams"], saved["validation_csv"]) == \
        (TEMPLATE, 64, 1, str(folder / "validation.csv"))


# ---- the scope table, cell by cell, through each command's own start ---------------------------------------------

# A key of each scope: (the run's value, another, the default), the run's set by the `run` fixture.
KEYS = {"shape": ("n_layer", 1, 2, 12), "trained": ("warmup_iters", 3, 5, 20),
        "training": ("learning_rate", 1e-3, 3e-4, 2e-4), "run": ("seed", 7, 9, 1337),
        "decoding": ("num_beams", 2, 3, 1), "command": ("gen_batch_size", 5, 6, 32)}
OWN, RUN_OR_GIVEN, FIXED = "own", "the run's unless given", "the run's, a flag against it refused"
# What each command takes from the run (the specification config.SCOPES implements)
SPEC = {"shape": dict(resume=FIXED, weights=FIXED, inference=FIXED, export=FIXED),
        "trained": dict(resume=FIXED, weights=RUN_OR_GIVEN, inference=FIXED, export=FIXED),
        "training": dict(resume=RUN_OR_GIVEN, weights=RUN_OR_GIVEN, inference=OWN, export=FIXED),
        "run": dict(resume=RUN_OR_GIVEN, weights=RUN_OR_GIVEN, inference=RUN_OR_GIVEN, export=FIXED),
        "decoding": dict(resume=RUN_OR_GIVEN, weights=RUN_OR_GIVEN, inference=RUN_OR_GIVEN, export=RUN_OR_GIVEN),
        "command": dict(resume=OWN, weights=OWN, inference=OWN, export=OWN)}


def settings_taken(use, out, cache, argv):
    """The Config a command that uses the run in `out` so starts with: train.py's for a resume or a new run from
    best.pt, evaluate.py's and predict.py's (inference), export.py's."""
    if use in ("resume", "weights"):
        start = ["--init_from=resume", f"--out_dir={out}"] if use == "resume" else \
            [f"--init_from={out / 'best.pt'}", f"--out_dir={out}-new"]
        return train.read_settings([*start, cache, *argv])[0]
    args = [f"--ckpt={out / 'best.pt'}", f"--out_dir={out}", *argv]
    return open_summary_model(load_config(args), flags_given(args), use).cfg


@pytest.mark.parametrize("scope, use", [(scope, use) for scope in SPEC for use in SPEC[scope]])
def test_each_scope_and_use_takes_what_the_table_says(run, scope, use):
    _, out, cache = run
    key, theirs, other, default = KEYS[scope]
    unflagged = getattr(settings_taken(use, out, cache, []), key)
    assert unflagged == (default if SPEC[scope][use] == OWN else theirs)
    if SPEC[scope][use] == FIXED:
        path = out / ("ckpt.pt" if use == "resume" else "best.pt")
        with pytest.raises(UserError, match=rf"^--{key}={other!r} contradicts {re.escape(str(path))}: it was trained "
                                            rf"with {key}={theirs!r}"):
            settings_taken(use, out, cache, [f"--{key}={other}"])
    else:
        assert getattr(settings_taken(use, out, cache, [f"--{key}={other}"]), key) == other


def test_the_table_is_the_one_the_code_reads():
    assert {scope: {use: takes(KEYS[scope][0], use) for use in USES} for scope in SCOPES} == {
        scope: {use: {OWN: "own", RUN_OR_GIVEN: "given", FIXED: "run"}[take] for use, take in uses.items()}
        for scope, uses in SPEC.items()}


def test_a_flag_that_repeats_the_runs_value_is_no_change(run):
    _, out, _ = run
    saved = load_checkpoint(str(out / "ckpt.pt"))["config"]
    resolved, changed = resolve(load_config(["--n_layer=1", "--max_iters=2"]), {"n_layer", "max_iters"}, saved,
                                "run.pt", "resume")
    assert changed == [] and resolved.n_layer == 1


def test_every_setting_has_a_scope():
    assert {f.metadata["scope"] for f in FIELDS.values()} == set(SCOPES)


def test_a_damaged_ckpt_pts_hint_followed_literally_trains_on_with_the_runs_settings(run, tmp_path, capsys):
    """The hint names best.pt and --init_from=<that file>: the new run it starts takes the run's learning rate,
    intervals and seed (no preset nor flag changed them), and its settings block says so."""
    _, out, cache = run
    copy = tmp_path / "out"
    copy.mkdir()
    (copy / "best.pt").write_bytes((out / "best.pt").read_bytes())
    (copy / "ckpt.pt").write_bytes((out / "ckpt.pt").read_bytes()[:100])
    err = one_error_line(capsys, train.main, ["--init_from=resume", f"--out_dir={copy}", "--max_iters=3", cache])
    hinted = re.search(r"intact: (\S+) \(iter 2\); start from its weights with --init_from=<that file>$", err)
    train.main([f"--init_from={hinted[1]}", f"--out_dir={copy}", cache])
    printed = capsys.readouterr().out
    assert f"settings (the run's, from {hinted[1]}" in printed and "changed from the run's: none" in printed
    saved, trained = json.loads((copy / "config.json").read_text()), json.loads((out / "config.json").read_text())
    assert {key: saved[key] for key in ("learning_rate", "eval_interval", "seed", "max_iters", "num_beams")} == \
        {key: trained[key] for key in ("learning_rate", "eval_interval", "seed", "max_iters", "num_beams")} == \
        dict(learning_rate=1e-3, eval_interval=2, seed=7, max_iters=2, num_beams=2)


def test_a_new_run_from_the_weights_takes_a_presets_values_and_names_them(run, tmp_path, capsys):
    """A preset changes a new run from the weights (a recipe run again), not a resume (the same run)."""
    _, out, cache = run
    preset = tmp_path / "recipe.py"
    preset.write_text("learning_rate = 5e-4\n")
    capsys.readouterr()
    cfg, _, _ = train.read_settings([str(preset), f"--init_from={out / 'best.pt'}", f"--out_dir={tmp_path}", cache])
    resumed, _, _ = train.read_settings([str(preset), "--init_from=resume", f"--out_dir={out}", cache])
    assert (cfg.learning_rate, resumed.learning_rate) == (5e-4, 1e-3)
    train.main([str(preset), f"--init_from={out / 'best.pt'}", f"--out_dir={tmp_path / 'new'}", cache])
    assert f"changed from the run's by {preset}: learning_rate=0.001 -> 0.0005" in capsys.readouterr().out


def test_a_resumed_runs_checkpoint_keeps_its_base_which_the_exports_card_names(run, tmp_path):
    _, out, cache = run
    train.main([f"--resume_from={out / 'ckpt.pt'}", f"--out_dir={tmp_path / 'next'}", "--max_iters=3", cache])
    assert load_checkpoint(str(tmp_path / "next" / "ckpt.pt"))["config"]["init_from"] == "scratch"
    export.main([f"--ckpt={tmp_path / 'next' / 'best.pt'}", f"--export_dir={tmp_path / 'hf'}"])
    assert "| base model | scratch (init_from) |" in (tmp_path / "hf" / "README.md").read_text()


@pytest.mark.parametrize("start", ["weights", "resume"])
def test_trains_start_reads_its_start_checkpoint_once(run, tmp_path, monkeypatch, start):
    _, out, cache = run
    path = out / ("best.pt" if start == "weights" else "ckpt.pt")
    argv = ([f"--init_from={path}", f"--out_dir={tmp_path / 'new'}"] if start == "weights" else
            [f"--resume_from={path}", "--init_from=resume", f"--out_dir={tmp_path / 'next'}"])
    reads, load = [], torch.load
    monkeypatch.setattr(torch, "load", lambda f, *a, **k: reads.append(str(f)) or load(f, *a, **k))
    train.main([*argv, "--max_iters=3", cache])
    assert reads.count(str(path)) == 1
