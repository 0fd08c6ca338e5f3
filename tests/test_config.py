"""config.py and what reads and checks it (summarizer/command_line.py, summarizer/rules.py): defaults, typed
--key=value overrides, .py/.json presets read without running them, sweeps, and one-line errors that name the bad
key or value."""
import dataclasses
import glob
import json
import subprocess
import sys

import pytest

import config
from config import Config, Decoding, load_config
from conftest import REPO, one_error_line, tiny
from summarizer.command_line import changed_settings, markdown_reference, parse_sweep, save_config
from summarizer.errors import UserError
from summarizer.rules import grad_accum_steps


def error_of(argv):
    with pytest.raises(UserError) as info:
        load_config(argv)
    message = str(info.value)
    assert "\n" not in message
    return message


def test_defaults_reproduce_the_competition_setup():
    cfg = Config()
    assert (cfg.init_from, cfg.batch_size, cfg.dtype, cfg.compile) == ("gpt2", 256, "auto", "auto")
    assert cfg.prompt_template == "\n\n### DIALOGUE:\n{dialogue}\n\n### SUMMARY:\n"


def test_data_paths_prefer_the_kaggle_input(tmp_path, monkeypatch):
    monkeypatch.setattr(config, "KAGGLE_INPUT", str(tmp_path))
    assert (Config().train_csv, Config().test_csv) == ("data/train.csv", "data/test.csv")
    (tmp_path / "train.csv").write_text("id,dialogue,summary\n")
    assert Config().train_csv == str(tmp_path / "train.csv")
    assert Config().test_csv == "data/test.csv"


def test_overrides_are_literals_typed_by_field():
    cfg = load_config(["--batch_size=128", "--learning_rate=1", "--compile=False", "--init_from=gpt2-medium",
                       "--device=cuda:1", "--out_dir=123", "--prompt_template='A {dialogue} B'", "--top_p=0.9"])
    assert cfg.batch_size == 128 and type(cfg.learning_rate) is float and cfg.learning_rate == 1.0
    assert cfg.compile is False and cfg.init_from == "gpt2-medium" and cfg.device == "cuda:1"
    assert cfg.out_dir == "123" and cfg.prompt_template == "A {dialogue} B" and cfg.top_p == 0.9


@pytest.mark.parametrize("arg, expected", [
    ("--batch_size=8.5", "batch_size expects int"),
    ("--batch_size=True", "batch_size expects int"),
    ("--compile=yes", "compile='yes' is not one of auto, True, False"),
    ("--compile=1", "compile expects bool or str"),
    ("--learning_rate=fast", "learning_rate expects float"),
    ("--lerning_rate=1e-3", "did you mean 'learning_rate'?"),
    ("--micro_batchsize=4", "did you mean 'micro_batch_size'?"),
    ("--zzzz=1", "--help"),
    ("batch_size=4", "batch_size=4"),
    ("--compile", "--key=value"),
])
def test_bad_overrides_are_one_line_naming_the_key(arg, expected):
    assert expected in error_of([arg])


def test_py_preset_is_read_not_executed_and_later_arguments_win(tmp_path):
    preset = tmp_path / "p.py"
    preset.write_text('"""A preset."""\n# comment\nbatch_size = 64\nmicro_batch_size = 4\ndropout = 0\n'
                      'init_from = "scratch"\n')
    cfg = load_config([str(preset), "--micro_batch_size=8"])
    assert (cfg.batch_size, cfg.micro_batch_size, cfg.dropout, cfg.init_from) == (64, 8, 0.0, "scratch")
    assert load_config(["--batch_size=32", str(preset)]).batch_size == 64


@pytest.mark.parametrize("body, expected", [
    ("batch_size = 64\nimport os\n", "line 2: only `name = <literal>`"),
    ("batch_size = 8 * 32\n", "line 1: '8 * 32' is not a literal"),
    ("open('x', 'w')\n", "line 1"),
    ("batch_size = 64\nlerning_rate = 1e-3\n", "line 2: did you mean 'learning_rate'?"),
    ("compile = 1\n", "compile expects bool or str"),
    ("batch_size = (\n", "syntax error"),
])
def test_bad_py_preset(tmp_path, body, expected):
    preset = tmp_path / "bad.py"
    preset.write_text(body)
    message = error_of([str(preset)])
    assert str(preset) in message and expected in message


def test_json_preset_and_save_config_round_trip(tmp_path):
    preset = tmp_path / "p.json"
    preset.write_text(json.dumps({"n_layer": 3, "learning_rate": 1, "device": "cpu"}))
    cfg = load_config([str(preset)])
    assert (cfg.n_layer, cfg.learning_rate, cfg.device) == (3, 1.0, "cpu")
    save_config(cfg, str(tmp_path / "run" / "config.json"))
    assert load_config([str(tmp_path / "run" / "config.json")]) == cfg
    assert list(tmp_path.joinpath("run").iterdir()) == [tmp_path / "run" / "config.json"]


@pytest.mark.parametrize("text, expected", [
    ("[1, 2]", "JSON object"), ("{", "not valid JSON"), ('{"n_layers": 3}', "did you mean 'n_layer'?"),
    ('{"n_layer": "3"}', "n_layer expects int"),
])
def test_bad_json_preset(tmp_path, text, expected):
    preset = tmp_path / "p.json"
    preset.write_text(text)
    assert expected in error_of([str(preset)])


def test_missing_preset_and_other_extensions(tmp_path):
    assert "does not exist" in error_of([str(tmp_path / "nope.py")])
    (tmp_path / "p.yaml").write_text("a: 1\n")
    assert ".py or .json" in error_of([str(tmp_path / "p.yaml")])


@pytest.mark.parametrize("argv, expected", [
    (["--n_embd=100", "--n_head=12"], "n_embd=100 is not a multiple of n_head=12"),
    (["--max_iters=0"], "max_iters=0 must be > 0"),
    (["--dtype=fp16"], "dtype='fp16' is not one of auto, float32, bfloat16, float16"),
    (["--backend=horovod"], "backend='horovod'"),
    (["--device=gpu"], "device='gpu'"),
    (["--block_size=100", "--init_from=scratch"], "multiple of 8"),
    (["--block_size=2048"], "init_from='scratch'"),
    (["--batch_size=100"], "batch_size=100 is not a multiple of micro_batch_size=8"),
    (["--num_beams=4", "--temperature=0.7"], "temperature=0.0"),
    (["--num_beams=4", "--temperature=0.7", "--mbr_samples=8", "--mbr_include_beam=False"], "mbr_include_beam=True"),
    (["--mbr_samples=8"], "mbr_samples=8 samples its candidates: set temperature > 0"),
    (["--min_new_tokens=129"], "min_new_tokens=129 must be in [0, max_new_tokens=128]"),
    (["--mbr_metric=bleu"], "mbr_metric='bleu' is not one of rouge1, rouge2, rougeL, rougeLsum"),
    (["--epsilon=1.5"], "epsilon=1.5 must be in [0, 1)"),
    (["--sweep=num_beams"], "cannot read 'num_beams', write key=value1,value2"),
    (["--sweep=learning_rate=1e-3,1e-4"], "'learning_rate' is not a decoding setting"),
    (["--sweep=num_beams=1,four"], "sweep='num_beams=1,four': num_beams expects int"),
    (["--prompt_template=no placeholder"], "{dialogue}"),
    (["--prompt_template='{dialogue} {x}'"], "{dialogue}"),
    (["--val_fraction=1.0"], "val_fraction"),
    (["--rouge_samples=0"], "best_metric='val_loss'"),
    (["--micro_batch_size=0"], "micro_batch_size=0 must be > 0"),
])
def test_values_that_cannot_work_are_rejected(argv, expected):
    assert expected in error_of(argv)


def test_decoding_contradictions_are_the_decoding_group_s_own_rule():
    """Config and generate() refuse the same settings with the same line: Decoding.contradiction."""
    cases = [(["--num_beams=4", "--temperature=0.7"], Decoding(num_beams=4, temperature=0.7)),
             (["--mbr_samples=8"], Decoding(mbr_samples=8)), (["--min_new_tokens=129"], Decoding(min_new_tokens=129))]
    for argv, decoding in cases:
        assert error_of(argv) == decoding.contradiction()
    assert Decoding().contradiction() == ""


def test_mbr_with_a_beam_candidate_may_sample_and_search_beams():
    cfg = load_config(["--num_beams=4", "--temperature=0.7", "--mbr_samples=8"])
    assert (cfg.num_beams, cfg.mbr_samples, cfg.mbr_include_beam) == (4, 8, True)


def test_sweep_is_every_combination_typed_by_field():
    assert parse_sweep("num_beams=1,4 length_penalty=0.8,1 mbr_metric=rouge1") == [
        {"num_beams": n, "length_penalty": p, "mbr_metric": "rouge1"} for n in (1, 4) for p in (0.8, 1.0)]
    assert parse_sweep("") == []


def test_grad_accum_steps():
    cfg = Config(batch_size=256, micro_batch_size=8)
    assert [grad_accum_steps(cfg, n) for n in (1, 2, 4)] == [32, 16, 8]
    with pytest.raises(UserError, match=r"micro_batch_size \* world_size = 8 \* 3 = 24"):
        grad_accum_steps(cfg, 3)


@pytest.mark.parametrize("preset", sorted(glob.glob("config/*.py")))
def test_shipped_presets_load(preset):
    cfg = load_config([preset])
    grad_accum_steps(cfg, 2 if "t4x2" in preset else 1)
    if preset == "config/demo.py":
        assert (cfg.init_from, cfg.n_layer, cfg.n_head, cfg.n_embd, cfg.block_size, cfg.device) == \
            ("scratch", 2, 2, 64, 128, "cpu")
        assert (cfg.train_csv, cfg.test_csv, cfg.out_dir, cfg.batch_size, cfg.micro_batch_size) == \
            ("data/demo/train.csv", "data/demo/test.csv", "out-demo", 32, 32)


def test_help_and_reference_document_every_key(capsys):
    with pytest.raises(SystemExit) as info:
        load_config(["--help"])
    assert info.value.code == 0
    printed = capsys.readouterr().out
    table = markdown_reference()
    for f in dataclasses.fields(Config):
        assert f.metadata["help"] and f"--{f.name}=" in printed and f"| `{f.name}` |" in table


@pytest.mark.slow
def test_help_into_a_closed_pipe_is_not_an_error():
    result = subprocess.run(f"{sys.executable} train.py --help | head -1", shell=True, cwd=REPO,
                            capture_output=True, text=True, timeout=60)
    assert result.returncode == 0 and result.stdout.strip() and result.stderr == ""


def test_start_up_names_the_changed_keys_and_where_they_came_from(tmp_path):
    preset = tmp_path / "p.py"
    preset.write_text("batch_size = 64\nmicro_batch_size = 8\nmax_iters = 300\n")  # max_iters: the default
    line = changed_settings([str(preset), "--max_iters=5", "--micro_batch_size=4"])
    assert f"batch_size=64 ({preset})" in line and "max_iters=5 (command line)" in line
    assert "micro_batch_size=4 (command line)" in line and line.count("=") == 3


def test_a_key_only_another_command_reads_is_one_line(capsys):
    import train
    err = one_error_line(capsys, train.main, [*tiny(), "--rank_weight=1.0"])
    assert "--rank_weight" in err and "calibrate.py" in err
