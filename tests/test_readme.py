"""The README stays true to the code: its config table is config.markdown_reference(), the --key=value flags its
commands pass to train.py/evaluate.py/predict.py/export.py are real config keys, the files it names exist, and
its test command is the one CI runs."""
import os
import re

import pytest

import config

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
README = os.path.join(ROOT, "README.md")
START, END = "<!-- config-reference:start -->", "<!-- config-reference:end -->"
REGENERATE = ("python -c \"import re,config as c;p='README.md';t=open(p).read();open(p,'w').write(re.sub("
              "r'(<!-- config-reference:start -->\\n).*?(<!-- config-reference:end -->)',"
              "lambda m:m[1]+c.markdown_reference()+'\\n'+m[2],t,flags=re.S))\"")
# a command line that runs one of the config-driven scripts (possibly behind torchrun / accelerate launch)
SCRIPT = re.compile(r"(?:^|\s)(?:\S*/)?(?:train|evaluate|predict|export)\.py(?=\s|$)")
# a repo-relative file a command names
PATH = re.compile(r"(?<![\w./<-])(?:[\w-]+/)*[\w-]+\.(?:py|sh)(?![\w/])")
TEST_COMMAND = "python -m pytest -q"


def read(path):
    with open(path, encoding="utf-8") as f:
        return f.read()


def code_lines(markdown):
    """The lines of the fenced code blocks, with backslash continuations joined and comments dropped."""
    lines = []
    for block in re.findall(r"^```[^\n]*\n(.*?)^```", markdown, flags=re.S | re.M):
        block = re.sub(r"\s*\\\n\s*", " ", block)
        for line in block.splitlines():
            line = re.sub(r"(^|\s)#.*", "", line).strip()
            if line:
                lines.append(line)
    return lines


def script_keys(line):
    """The --key= names a line passes to train.py/evaluate.py/predict.py: only what follows the script name, so a
    launcher's own flags before it (--nproc_per_node=2, --rdzv_backend=c10d, ...) are not counted."""
    match = SCRIPT.search(line)
    if not match:
        return []
    return re.findall(r"--([a-z_]+)=", line[match.end():])


@pytest.fixture(scope="module")
def readme():
    return read(README)


@pytest.fixture
def off_kaggle(monkeypatch):
    """Defaults as on any machine but Kaggle (where train_csv/test_csv default to the competition's files)."""
    monkeypatch.setattr(config, "competition_file", lambda name, fallback: fallback)


def test_config_reference_is_generated(readme, off_kaggle):
    assert readme.count(START) == 1 and readme.count(END) == 1, f"README.md needs one {START} and one {END}"
    table = readme.split(START, 1)[1].split(END, 1)[0]
    assert table.strip("\n") == config.markdown_reference(), (
        f"README.md's config reference is out of date with config.py; regenerate it with:\n{REGENERATE}")


def test_command_keys_are_config_fields(readme):
    commands = [line for line in code_lines(readme) if SCRIPT.search(line)]
    assert len(commands) >= 5, f"expected the README's train/evaluate/predict commands, found {commands}"
    unknown = {(key, line) for line in commands for key in script_keys(line) if key not in config.FIELDS}
    assert not unknown, f"README commands pass keys that are not Config fields: {sorted(unknown)}"


def test_command_paths_exist(readme):
    named = {path for line in code_lines(readme) for path in PATH.findall(line)}
    for required in ("config/demo.py", "config/kaggle_t4x2.py", "bench/gpu_check.sh",
                     "train.py", "evaluate.py", "predict.py", "export.py"):
        assert required in named, f"README's commands do not mention {required}"
    in_prose = {"data/make_demo.py", "notebooks/kaggle_t4x2.ipynb"}
    assert all(path in readme for path in in_prose)
    missing = sorted(p for p in named | in_prose if not os.path.isfile(os.path.join(ROOT, p)))
    assert not missing, f"README names files that do not exist: {missing}"


def test_test_command_is_what_ci_runs(readme):
    pytest_lines = [line for line in code_lines(readme) if "pytest" in line]
    assert pytest_lines == [TEST_COMMAND], f"README's test command should be exactly {TEST_COMMAND!r}: {pytest_lines}"
    ci = [line.strip() for line in read(os.path.join(ROOT, ".ci", "run")).splitlines()]
    assert TEST_COMMAND in ci, f".ci/run does not run {TEST_COMMAND!r}"
