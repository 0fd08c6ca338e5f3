"""config.py (the settings, their scopes and rules, the values a command line gives them) and what a command prints
of them: defaults, typed --key=value overrides and preset values, sweeps, and
one-line errors that name the bad key or value."""
import dataclasses
import glob
import json

import pytest

import config
from command_line import UserError
from config import (
    SETTINGS_WIDTH,
    Config,
    Decoding,
    config_json,
    describe_duration,
    load_config,
    markdown_reference,
    parse_duration,
    parse_sweep,
    rows_per_rank,
    settings_report,
    sweep_settings,
)
from conftest import changed_settings, config_error, one_error_line, tiny


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
    ("--compile=maybe", "compile='maybe' is not one of auto, True, False (True and False also as true/false"),
    ("--compile=2", "compile expects bool or str"),
    ("--learning_rate=fast", "learning_rate expects float"),
    ("--lerning_rate=1e-3", "did you mean 'learning_rate'?"),
    ("--micro_batchsize=4", "did you mean 'micro_batch_size'?"),
    ("--zzzz=1", "--help"),
    ("batch_size=4", "batch_size=4"),
    ("--compile", "--key=value"),
])
def test_bad_overrides_are_one_line_naming_the_key(arg, expected):
    assert expected in config_error([arg])


def test_json_preset_and_config_json_round_trip(tmp_path):
    preset = tmp_path / "p.json"
    preset.write_text(json.dumps({"n_layer": 3, "learning_rate": 1, "device": "cpu"}))
    cfg = load_config([str(preset)])
    assert (cfg.n_layer, cfg.learning_rate, cfg.device) == (3, 1.0, "cpu")
    (tmp_path / "config.json").write_text(config_json(cfg))
    assert load_config([str(tmp_path / "config.json")]) == cfg


@pytest.mark.parametrize("argv, expected", [
    (["--n_embd=100", "--n_head=12"], "n_embd=100 is not a multiple of n_head=12"),
    (["--max_iters=0"], "max_iters=0 must be > 0"),
    (["--dtype=fp16"], "dtype='fp16' is not one of auto, float32, bfloat16, float16"),
    (["--backend=horovod"], "backend='horovod'"),
    (["--device=gpu"], "device='gpu'"),
    (["--block_size=100", "--init_from=scratch"], "multiple of 8"),
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
    (["--micro_batch_size=0"], "micro_batch_size=0 must be a number > 0 or auto"),
    # a key that takes a word or a count: any other text is its one line, not a TypeError of a group's rule
    (["--micro_batch_size=abc"], "micro_batch_size='abc' must be a number > 0 or auto"),
    (["--micro_batch_size="], "micro_batch_size='' must be a number > 0 or auto"),
    (["--micro_batch_size", "eight"], "micro_batch_size='eight' must be a number > 0 or auto"),
])
def test_values_that_cannot_work_are_rejected(argv, expected):
    assert expected in config_error(argv)


def test_decoding_contradictions_are_the_decoding_group_s_own_rule():
    """Config and generate() refuse the same settings with the same line: Decoding.contradiction."""
    cases = [(["--num_beams=4", "--temperature=0.7"], Decoding(num_beams=4, temperature=0.7)),
             (["--mbr_samples=8"], Decoding(mbr_samples=8)), (["--min_new_tokens=129"], Decoding(min_new_tokens=129))]
    for argv, decoding in cases:
        assert config_error(argv) == decoding.contradiction()
    assert Decoding().contradiction() == ""


def test_mbr_with_a_beam_candidate_may_sample_and_search_beams():
    cfg = load_config(["--num_beams=4", "--temperature=0.7", "--mbr_samples=8"])
    assert (cfg.num_beams, cfg.mbr_samples, cfg.mbr_include_beam) == (4, 8, True)


def test_sweep_is_every_combination_typed_by_field():
    sweep = parse_sweep("num_beams=1,4 length_penalty=0.8,1 mbr_metric=rouge1")
    assert sweep == {"num_beams": (1, 4), "length_penalty": (0.8, 1.0), "mbr_metric": ("rouge1",)}
    assert sweep_settings(sweep) == [
        {"num_beams": n, "length_penalty": p, "mbr_metric": "rouge1"} for n in (1, 4) for p in (0.8, 1.0)]
    assert parse_sweep("") == {} and sweep_settings({}) == []
    assert load_config(["--sweep=num_beams=1,4"]).sweep == {"num_beams": (1, 4)}


def test_a_batch_splits_over_the_processes_whatever_the_micro_batch():
    """batch_size's one rule: each process takes as many of a step's rows. micro_batch_size is a micro-batch's
    memory, not a count that must divide the batch."""
    assert [rows_per_rank(256, n) for n in (1, 2, 4)] == [256, 128, 64]
    with pytest.raises(UserError, match=r"^batch_size=15 does not split over the 2 processes .* e.g. 16$"):
        rows_per_rank(15, 2)
    assert load_config(["--batch_size=100", "--micro_batch_size=8"]).batch_size == 100


@pytest.mark.parametrize("preset", sorted(glob.glob("config/*.py")))
def test_shipped_presets_load(preset):
    cfg = load_config([preset])
    if "t4x2" in preset:  # the GPU's memory plan chooses the micro-batch
        assert cfg.micro_batch_size == "auto" and rows_per_rank(cfg.batch_size, 2)
    if preset == "config/demo.py":
        assert (cfg.init_from, cfg.n_layer, cfg.n_head, cfg.n_embd, cfg.block_size, cfg.device) == \
            ("scratch", 2, 2, 64, 128, "cpu")
        assert (cfg.train_csv, cfg.test_csv, cfg.out_dir, cfg.batch_size, cfg.micro_batch_size) == \
            ("data/demo/train.csv", "data/demo/test.csv", "out-demo", 32, 32)


def test_the_reference_documents_every_key():
    table = markdown_reference()
    for f in dataclasses.fields(Config):
        assert f.metadata["help"] and f"| `{f.name}` |" in table


def test_start_up_names_the_changed_keys_and_where_they_came_from(tmp_path):
    preset = tmp_path / "p.py"
    preset.write_text("batch_size = 64\nmicro_batch_size = 8\nmax_iters = 300\n")  # max_iters: the default
    line = changed_settings([str(preset), "--max_iters=5", "--micro_batch_size=4"])
    assert f"batch_size=64 ({preset})" in line and "max_iters=5 (command line)" in line
    assert "micro_batch_size=4 (command line)" in line and line.count("=") == 3



def test_a_flag_back_to_the_default_over_a_presets_value_is_shown(tmp_path):
    """--init_from=gpt2 (the default) over a preset's scratch decides the run: the settings block shows it."""
    preset = tmp_path / "p.py"
    preset.write_text("init_from = 'scratch'\n")
    assert changed_settings([str(preset), "--init_from=gpt2"]) == "init_from='gpt2' (command line)"

# ---- issue 37: durations, yes/no values, flags before presets, missing presets, the settings block --------------


@pytest.mark.parametrize("text, seconds", [("5400", 5400), ("5400s", 5400), ("11h30m", 41400), ("45m", 2700),
                                           ("1.5h", 5400), ("1h30m15s", 5415), (" 1h 30m ", 5400), ("90.5", 90.5)])
def test_max_time_takes_the_documented_forms(text, seconds):
    assert parse_duration(text) == seconds
    assert load_config([f"--max_time={text}"]).max_time == seconds


@pytest.mark.parametrize("text, meant", [("1h30", "write 1h30m (or 1h30s)"), ("45m30", "write 45m30s"),
                                         ("1h30m15", "write 1h30m15s")])
def test_a_number_without_its_unit_after_another_is_ambiguous(capsys, text, meant):
    import train
    err = one_error_line(capsys, train.main, [*tiny(), f"--max_time={text}"])
    assert f"max_time={text!r} is ambiguous: {meant}" in err


@pytest.mark.parametrize("text", ["30m1h", "1h1h", "1s30", "1.5.5h", "1d"])
def test_units_out_of_order_or_unknown_are_not_durations(text):
    assert f"max_time={text!r} is not a positive duration" in config_error([f"--max_time={text}"])


def test_the_budget_is_shown_in_hours_minutes_and_seconds():
    assert [describe_duration(s) for s in (5400, 5415, 90, 41400, 0.5, 1.1 * 3600)] == \
        ["1h 30m", "1h 30m 15s", "1m 30s", "11h 30m", "0.5s", "1h 6m"]
    assert "max_time=5400.0 [1h 30m = 5400 s] (command line)" in changed_settings(["--max_time=1.5h"])
    assert "max_time=5400.0 [1h 30m = 5400 s]" in settings_report(["--max_time=1.5h"], "out/config.json")


YES_NO = [("true", True), ("True", True), ("TRUE", True), ("yes", True), ("Yes", True), ("on", True), ("ON", True),
          ("1", True), ("false", False), ("False", False), ("FALSE", False), ("no", False), ("NO", False),
          ("off", False), ("Off", False), ("0", False)]


@pytest.mark.parametrize("word, value", YES_NO)
def test_yes_no_keys_take_the_usual_words_on_the_command_line(word, value):
    cfg = load_config([f"--evaluate_after={word}", f"--train_on_prompt={word}", f"--compile={word}",
                       f"--fsdp_reduce_once={word}", f"--mbr_include_beam={word}"])
    assert (cfg.evaluate_after, cfg.train_on_prompt, cfg.compile, cfg.fsdp_reduce_once, cfg.mbr_include_beam) == \
        (value,) * 5
    assert all(type(v) is bool for v in (cfg.evaluate_after, cfg.compile))


def test_yes_no_words_in_presets_and_sweeps(tmp_path):
    py, js = tmp_path / "p.py", tmp_path / "p.json"
    py.write_text('evaluate_after = "yes"\npredict_after = "On"\nbias = 0\ncompile = "off"\n')
    js.write_text(json.dumps({"evaluate_after": "TRUE", "predict_after": 1, "bias": "no", "compile": "auto"}))
    for preset, compile in ((py, False), (js, "auto")):
        cfg = load_config([str(preset)])
        assert (cfg.evaluate_after, cfg.predict_after, cfg.bias, cfg.compile) == (True, True, False, compile)
    assert parse_sweep("mbr_include_beam=true,No") == {"mbr_include_beam": (True, False)}


@pytest.mark.parametrize("word", ["maybe", "2", "1.0", "y", "'maybe'"])
def test_a_bad_yes_no_value_is_one_line_naming_key_value_and_forms(capsys, word):
    import train
    err = one_error_line(capsys, train.main, [*tiny(), f"--evaluate_after={word}"])
    assert "evaluate_after=" in err and word.strip("'") in err
    assert "true/false, yes/no, on/off or 1/0, in any case" in err


def report_sections(report):
    """{source: its text} of a settings block, continuation lines joined."""
    sections = {}
    for line in report.splitlines()[1:]:
        if line.startswith("    "):
            sections[list(sections)[-1]] += " " + line.strip()
        else:
            source, _, text = line.strip().partition(": ")
            sections[source] = text
    return sections


def test_the_settings_block_is_grouped_wrapped_and_says_where_each_value_came_from(tmp_path):
    out = tmp_path / "a-long-folder-name-for-the-outputs-of-this-run" / "out"
    argv = ["--max_time=11h30m", "--log_to=tensorboard", "config/kaggle_t4x2.py", f"--out_dir={out}",
            "--evaluate_after=true", "--prompt_template='" + "p" * 120 + "{dialogue}'"]
    report = settings_report(argv, f"{out}/config.json")
    lines = report.splitlines()
    assert lines[0] == f"settings (changed from the defaults; every key in {out}/config.json before step 1):"
    assert all(len(line) <= SETTINGS_WIDTH or line.count("=") == 1 for line in lines[1:]), report  # or one key
    assert len(lines) <= 7, report
    sections = report_sections(report)
    assert list(sections) == ["config/kaggle_t4x2.py", "command line"]
    assert sections["config/kaggle_t4x2.py"] == ("Training: micro_batch_size='auto' | System: device='cuda' "
                                                 "nccl_p2p_disable=True Summarizing: gen_batch_size=64")
    command_line = sections["command line"]
    for text in ("RowFormat: prompt_template=", f"Paths: out_dir='{out}'",
                 "Training: max_time=41400.0 [11h 30m = 41400 s]",
                 "Evaluation: evaluate_after=True log_to='tensorboard'"):
        assert text in command_line
    assert command_line.index("RowFormat:") < command_line.index("Paths:") < command_line.index("Training:")
    assert settings_report([], "out/config.json") == ("settings: the defaults; every key in out/config.json before "
                                                      "step 1")


def test_the_settings_block_of_the_demo_is_short():
    argv = ["config/demo.py", "--max_iters=1", f"--out_dir={'/tmp/' + 'x' * 60}/out"]
    report = settings_report(argv, "out-demo/config.json")
    assert len(report.splitlines()) <= 10 and max(map(len, report.splitlines())) <= SETTINGS_WIDTH, report
    changed = changed_settings(argv).split(", ")
    sections = report_sections(report)
    for item in changed:
        setting, source = item.rsplit(" (", 1)
        assert setting in sections[source.rstrip(")")]


# ---- issue 41: settings typed once, every problem at once, no import of summarizer/ ------------------------------


def test_config_imports_nothing_from_the_summarizer_package():
    import ast
    tree = ast.parse(open(config.__file__, encoding="utf-8").read())
    imported = [alias.name for node in ast.walk(tree) if isinstance(node, ast.Import) for alias in node.names]
    imported += [node.module or "" for node in ast.walk(tree) if isinstance(node, ast.ImportFrom)]
    assert imported and not [name for name in imported if name.split(".")[0] == "summarizer"], imported


def test_every_problem_of_a_command_is_in_its_one_line():
    message = config_error(["--n_layer=0", "--dtype=fp16", "--top_p=2", "--rouge_samples=0"])
    for problem in ("n_layer=0 must be > 0", "dtype='fp16' is not one of", "top_p=2.0 must be in (0, 1]",
                    "best_metric='rougeL' needs rouge_samples > 0"):
        assert problem in message
    message = config_error(["--n_embd=100", "--n_head=12", "--block_size=100", "--rouge_samples=0"])
    for problem in ("n_embd=100 is not a multiple of n_head=12", "block_size=100 must be a multiple of 8",
                    "best_metric='rougeL' needs rouge_samples > 0"):
        assert problem in message
    # flags that cannot be read at all (unknown key, a word for a number, a yes/no that is neither): each named too
    message = config_error(["--max_iter=5", "--batch_size=abc", "--evaluate_after=maybe"])
    for problem in ("'max_iter'", "batch_size expects int, got 'abc'", "evaluate_after='maybe'"):
        assert problem in message


def test_a_path_with_a_tilde_is_expanded_from_every_source(tmp_path, monkeypatch):
    """As a shell would expand it: the notebook passes its OVERRIDES with no shell, and a preset is read as text
    (before: a folder named '~' in the working directory, while the settings header printed '~/runs/...')."""
    monkeypatch.setenv("HOME", str(tmp_path))
    (tmp_path / "p.py").write_text('out_dir = "~/from_py"\n')
    (tmp_path / "p.json").write_text('{"train_csv": "~/data/train.csv"}')
    assert load_config(["--out_dir=~/runs"]).out_dir == str(tmp_path / "runs")
    assert load_config(["--out_dir", "~/runs", "--ckpt=~/best.pt"]).ckpt == str(tmp_path / "best.pt")
    assert load_config([str(tmp_path / "p.py")]).out_dir == str(tmp_path / "from_py")
    assert load_config([str(tmp_path / "p.json")]).train_csv == str(tmp_path / "data" / "train.csv")
    assert load_config(["--init_from=gpt2", "--dialogue_column=~x"]).dialogue_column == "~x"  # not a path


def test_values_are_typed_once_as_given():
    cfg = load_config(["--max_time=1h30m", "--lora_targets=attn.c_attn,mlp.c_fc", "--sweep=num_beams=1,4"])
    assert (cfg.max_time, cfg.lora_targets, cfg.sweep) == (5400.0, ("attn.c_attn", "mlp.c_fc"), {"num_beams": (1, 4)})
    assert load_config(["--max_time="]).max_time is None and load_config(["--max_time=90"]).max_time == 90.0


def test_sweeping_max_new_tokens_says_why_it_cannot_be_swept():
    message = config_error(["--sweep=max_new_tokens=32,64"])
    assert "max_new_tokens cannot be swept" in message and "--max_new_tokens=N" in message


