"""A later command's settings (summarizer.checkpoint.resolve): every setting's scope decides what a resume, a new run
from a checkpoint's weights, evaluate/predict and export take from the run's record. A resume with no flags
continues the run, in place or into another folder; a flag changes what may change and is printed as a change;
a flag that contradicts what training fixed stops in one line naming it and the run's value; a message never names
a flag that was not given."""
import dataclasses
import json

import pytest

import train
from config import FIELDS, Config, Scope, load_config
from conftest import ONE_STEP, one_error_line, save_csv, synthetic_rows, tiny
from summarizer.checkpoint import Use, load_checkpoint, resolve
from summarizer.errors import UserError

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
                "--learning_rate=1e-3", cache])
    printed = capsys.readouterr()
    assert "max_iters=2 -> 3 learning_rate=0.0002 -> 0.001" in printed.out
    assert "--n_layer" not in printed.out + printed.err and "n_layer=12" not in printed.out + printed.err
    assert load_checkpoint(str(tmp_path / "next" / "ckpt.pt"))["config"]["learning_rate"] == 1e-3


@pytest.mark.parametrize("flag, value", [("--n_layer=2", "n_layer=1"), ("--block_size=128", "block_size=64"),
                                         ("--warmup_iters=5", "warmup_iters=20"), ("--lora_rank=4", "lora_rank=0")])
def test_a_flag_that_contradicts_what_training_fixed_is_one_line_naming_it_and_the_runs_value(run, tmp_path,
                                                                                               capsys, flag, value):
    _, out, cache = run
    err = one_error_line(capsys, train.main, [f"--resume_from={out / 'ckpt.pt'}", f"--out_dir={tmp_path}",
                                              "--max_iters=3", flag, cache])
    assert err.startswith(f"error: {flag} contradicts {out / 'ckpt.pt'}: it was trained with {value}")
    assert not (tmp_path / "ckpt.pt").exists()


def test_a_new_run_from_a_checkpoints_weights_takes_its_template_and_decoding(run, tmp_path):
    """init_from=<best.pt> (calibrate.py's start) takes the row format, decoding and data of the run; a flag
    changes any of them but the shape."""
    folder, out, cache = run
    train.main([f"--init_from={out / 'best.pt'}", f"--out_dir={tmp_path}", "--max_iters=1", "--num_beams=1", cache])
    saved = json.loads((tmp_path / "config.json").read_text())
    assert (saved["prompt_template"], saved["block_size"], saved["num_beams"], saved["validation_csv"]) == \
        (TEMPLATE, 64, 1, str(folder / "validation.csv"))


RUN_VALUES = dict(n_layer=1, n_head=2, n_embd=32, block_size=64, prompt_template=TEMPLATE, batch_size=4,
                  micro_batch_size=4, learning_rate=1e-3, max_iters=2, num_beams=2, train_csv="run.csv",
                  test_csv="run-test.csv", device="cpu", out_dir="run-out", rouge_samples=8)
COMMAND_VALUES = dict(n_layer=2, n_head=2, n_embd=64, block_size=128, prompt_template="{dialogue}", batch_size=8,
                      micro_batch_size=2, learning_rate=3e-4, max_iters=9, num_beams=3, train_csv="mine.csv",
                      test_csv="mine-test.csv", device="auto", out_dir="mine", rouge_samples=4)


@pytest.mark.parametrize("use, flags, expected", [
    # no flag: the run's settings, but for what the command decides itself
    (Use.RESUME, {}, dict(n_embd=32, learning_rate=1e-3, num_beams=2, train_csv="run.csv", test_csv="run-test.csv",
                          out_dir="mine", device="auto")),
    (Use.INFERENCE, {}, dict(n_embd=32, prompt_template=TEMPLATE, num_beams=2, train_csv="run.csv",
                             learning_rate=3e-4, test_csv="mine-test.csv", out_dir="mine")),
    (Use.WEIGHTS, {}, dict(n_embd=32, block_size=64, num_beams=2, batch_size=4, learning_rate=3e-4)),
    # flags change what their scope lets them change
    (Use.RESUME, {"learning_rate", "micro_batch_size", "num_beams", "test_csv"},
     dict(learning_rate=3e-4, micro_batch_size=2, num_beams=3, test_csv="mine-test.csv")),
    (Use.INFERENCE, {"num_beams", "train_csv"}, dict(num_beams=3, train_csv="mine.csv")),
    (Use.WEIGHTS, {"prompt_template", "block_size", "batch_size"},
     dict(prompt_template="{dialogue}", block_size=128, batch_size=8)),
    (Use.EXPORT, {"num_beams"}, dict(num_beams=3, train_csv="run.csv")),
])
def test_each_scope_decides_what_a_command_takes_from_the_run(use, flags, expected):
    cfg, ckpt = Config(**COMMAND_VALUES), {"config": dataclasses.asdict(Config(**RUN_VALUES))}
    resolved, changed = resolve(cfg, flags, ckpt, "run.pt", use)
    assert {key: getattr(resolved, key) for key in expected} == expected
    assert {key for key, _, _ in changed} == set(flags)  # each flag here differs from the run's value


@pytest.mark.parametrize("use, flag", [(Use.RESUME, "n_layer"), (Use.RESUME, "prompt_template"),
                                       (Use.INFERENCE, "block_size"), (Use.WEIGHTS, "n_embd"),
                                       (Use.EXPORT, "train_csv"), (Use.EXPORT, "rouge_samples")])
def test_what_a_command_may_not_change_is_refused_naming_the_flag(use, flag):
    cfg, ckpt = Config(**COMMAND_VALUES), {"config": dataclasses.asdict(Config(**RUN_VALUES))}
    with pytest.raises(UserError, match=rf"^--{flag}=.* contradicts run.pt: it was trained with {flag}="):
        resolve(cfg, {flag}, ckpt, "run.pt", use)


def test_a_flag_that_repeats_the_runs_value_is_no_change():
    ckpt = {"config": dataclasses.asdict(Config(**RUN_VALUES))}
    resolved, changed = resolve(load_config(["--n_layer=1", "--max_iters=2"]), {"n_layer", "max_iters"}, ckpt, "run.pt",
                                Use.RESUME)
    assert changed == [] and resolved.n_layer == 1


def test_every_setting_has_a_scope():
    assert all(isinstance(f.metadata["scope"], Scope) for f in FIELDS.values())
    assert {f.metadata["scope"] for f in FIELDS.values()} == set(Scope)
