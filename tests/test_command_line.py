"""command_line.py: a command line's words (presets in their order, then --key=value or --key value flags, which
beat any preset whatever the order), preset files read without running them, and what --help prints; each
mistake is one line that names the file, the line or the key."""
import importlib
import re
import subprocess
import sys

import pytest

from config import FIELDS, Decoding, keys, load_config
from conftest import HANG, REPO, changed_settings, config_error, one_error_line

SCRIPTS = ("train", "evaluate", "predict", "export")


def help_of(capsys, script):
    """What `python <script>.py --help` prints."""
    with pytest.raises(SystemExit) as info:
        importlib.import_module(script).main(["--help"])
    assert info.value.code == 0
    return capsys.readouterr().out


def test_py_preset_is_read_not_executed_and_flags_win(tmp_path):
    preset = tmp_path / "p.py"
    preset.write_text('"""A preset."""\n# comment\nbatch_size = 64\nmicro_batch_size = 4\ndropout = 0\n'
                      'init_from = "scratch"\n')
    cfg = load_config([str(preset), "--micro_batch_size=8"])
    assert (cfg.batch_size, cfg.micro_batch_size, cfg.dropout, cfg.init_from) == (64, 8, 0.0, "scratch")
    assert load_config(["--batch_size=32", str(preset)]).batch_size == 32  # a flag before the preset too


@pytest.mark.parametrize("body, expected", [
    ("batch_size = 64\nimport os\n", "line 2: only `name = <literal>`"),
    ("batch_size = 8 * 32\n", "line 1: '8 * 32' is not a literal"),
    ("open('x', 'w')\n", "line 1"),
    ("batch_size = 64\nlerning_rate = 1e-3\n", "line 2: did you mean 'learning_rate'?"),
    ("compile = 2\n", "compile expects bool or str"),
    ("batch_size = (\n", "syntax error"),
])
def test_bad_py_preset(tmp_path, body, expected):
    preset = tmp_path / "bad.py"
    preset.write_text(body)
    message = config_error([str(preset)])
    assert str(preset) in message and expected in message


@pytest.mark.parametrize("text, expected", [
    ("[1, 2]", "JSON object"), ("{", "not valid JSON"), ('{"n_layers": 3}', "did you mean 'n_layer'?"),
    ('{"n_layer": "3"}', "n_layer expects int"),
])
def test_bad_json_preset(tmp_path, text, expected):
    preset = tmp_path / "p.json"
    preset.write_text(text)
    assert expected in config_error([str(preset)])


def test_missing_preset_and_other_extensions(tmp_path):
    assert "nope.py: no such preset; pass an existing .py or .json file" in config_error([str(tmp_path / "nope.py")])
    (tmp_path / "p.yaml").write_text("a: 1\n")
    assert ".py or .json" in config_error([str(tmp_path / "p.yaml")])


def test_each_scripts_help_lists_the_keys_it_reads_and_together_every_key(capsys):
    listed = {script: set(re.findall(r"^--(\w+)=", help_of(capsys, script), re.M)) for script in SCRIPTS}
    assert set().union(*listed.values()) == set(FIELDS)
    assert {"test_csv", "ckpt", "num_beams", "gen_batch_size", "device"} <= listed["predict"]
    assert not {"fsdp_reduce_once", "nccl_ib_disable", "learning_rate", "sweep", "export_dir",
                "init_from"} & listed["predict"]
    assert {"sweep", "compare", "validation_csv"} <= listed["evaluate"] and "test_csv" not in listed["evaluate"]
    assert listed["export"] == {"out_dir", "ckpt", "export_dir", "overwrite", *keys(Decoding)}
    assert {"ckpt", "baseline", "sweep", "compare", "export_dir"}.isdisjoint(listed["train"])


@pytest.mark.parametrize("script", SCRIPTS)
def test_help_is_written_for_users_not_developers(capsys, script):
    printed = help_of(capsys, script)
    for note in ("imports nothing", "summarizer", "inference.py", "resolve", "report.py", "Reads top to bottom"):
        assert note not in printed, f"{script}.py --help: {note!r}"


@pytest.mark.slow
def test_help_into_a_closed_pipe_is_not_an_error():
    result = subprocess.run(f"{sys.executable} train.py --help | head -1", shell=True, cwd=REPO,
                            capture_output=True, text=True, timeout=HANG)
    assert result.returncode == 0 and result.stdout.strip() and result.stderr == ""


def test_a_flag_beats_a_preset_whatever_the_order(tmp_path):
    preset = "config/kaggle_t4x2.py"
    for argv in (["--device=cpu", preset], [preset, "--device=cpu"]):
        cfg = load_config(argv)
        assert (cfg.device, cfg.nccl_p2p_disable) == ("cpu", True)
        assert changed_settings(argv) == (f"micro_batch_size='auto' ({preset}), device='cpu' (command line), "
                                          f"nccl_p2p_disable=True ({preset}), gen_batch_size=64 ({preset})")
    second = tmp_path / "second.py"
    second.write_text("gen_batch_size = 16\n")
    argv = ["--gen_batch_size=8", str(second), preset, "--device=cpu"]  # presets in their order, then the flags
    assert load_config(argv).gen_batch_size == 8 and "gen_batch_size=8 (command line)" in changed_settings(argv)
    assert load_config([preset, str(second)]).gen_batch_size == 16
    assert f"gen_batch_size=16 ({second})" in changed_settings([preset, str(second)])
    assert f"gen_batch_size=64 ({preset})" in changed_settings([str(second), preset])


def test_help_says_flags_beat_presets_in_any_order(capsys):
    with pytest.raises(SystemExit):
        load_config(["--help"])
    printed = " ".join(capsys.readouterr().out.split())
    assert "a flag beats any preset, whether it comes before or after it" in printed
    assert "true/false, yes/no, on/off or 1/0 in any case" in printed and "1h30m15s" in printed


@pytest.mark.parametrize("given, near", [("config/kaggle_t4x2", "config/kaggle_t4x2.py"),
                                         ("config/kagle_t4x2.py", "config/kaggle_t4x2.py"),
                                         ("kaggle_t4x2.py", "config/kaggle_t4x2.py"),
                                         ("config/dmo.py", "config/demo.py"),
                                         ("config/kaggle_t4x2_gpt2-larg.py", "config/kaggle_t4x2_gpt2-large.py")])
def test_a_missing_preset_suggests_the_near_one(capsys, given, near):
    import train
    err = one_error_line(capsys, train.main, [given, "--device=cpu"])
    assert err.endswith(f"{given}: no such preset; did you mean {near}?")


def test_a_preset_beside_the_path_is_suggested(tmp_path):
    (tmp_path / "mine.json").write_text("{}")
    assert config_error([str(tmp_path / "mine")]).endswith(f"did you mean {tmp_path / 'mine.json'}?")
    assert config_error([str(tmp_path / "mien.json")]).endswith(f"did you mean {tmp_path / 'mine.json'}?")
    assert "to set a key, write --batch_size=4" in config_error(["batch_size=4"])


def test_a_flag_and_its_value_may_be_two_words():
    """`--max_iters 5` is `--max_iters=5`; the word after a key is its value even where it looks like a preset."""
    cfg = load_config(["--max_iters", "5", "config/demo.py", "--out_dir", "config/kaggle_t4x2.py"])
    assert (cfg.max_iters, cfg.out_dir, cfg.n_layer, cfg.nccl_p2p_disable) == (5, "config/kaggle_t4x2.py", 2, False)
    assert load_config(["--min_lr", "-1"] + ["--min_lr=0"]).min_lr == 0  # a negative number is a value too
    assert "--key value" in config_error(["--compile"])
