"""The README and docs/ stay true to the code: docs/config.md's config table is markdown_reference(), the
--key=value flags their commands pass to train.py/evaluate.py/predict.py/export.py are real config keys, the files
they name exist, the bench sections they run exist, their links lead somewhere, the README stays short and links
every docs page, and the test commands are the one CI runs and its fast tier."""
import glob
import os
import re

import pytest

import config
from config import markdown_reference

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
README = os.path.join(ROOT, "README.md")
DOCS = os.path.join(ROOT, "docs")
CONFIG_DOC = os.path.join(DOCS, "config.md")
README_MAX_LINES = 250
START, END = "<!-- config-reference:start -->", "<!-- config-reference:end -->"
REGENERATE = ("python -c \"import re,config as c;p='docs/config.md';t=open(p).read();"
              "open(p,'w').write(re.sub("
              "r'(<!-- config-reference:start -->\\n).*?(<!-- config-reference:end -->)',"
              "lambda m:m[1]+c.markdown_reference()+'\\n'+m[2],t,flags=re.S))\"")
# a command line that runs one of the config-driven scripts (possibly behind torchrun / accelerate launch)
SCRIPT = re.compile(r"(?:^|\s)(?:\S*/)?(?:train|evaluate|predict|export)\.py(?=\s|$)")
# a repo-relative file a command names
PATH = re.compile(r"(?<![\w./<-])(?:[\w-]+/)*[\w-]+\.(?:py|sh)(?![\w/])")
# a benchmark command and the section it asks for
BENCH = re.compile(r"python -m bench\b(.*)")
SECTION = re.compile(r"--section[= ]([\w|]+)")
# a relative Markdown link: ](target) or ](target#anchor), not http(s) or mailto
LINK = re.compile(r"\]\((?!https?:|mailto:|#)([^)#\s]+)(?:#[^)\s]*)?\)")
TEST_COMMAND = "python -m pytest -q"
FAST_TEST_COMMAND = 'python -m pytest -q -m "not slow"'  # the working loop: the tests not marked slow


def read(path):
    with open(path, encoding="utf-8") as f:
        return f.read()


def doc_paths():
    """docs/*.md, sorted."""
    return sorted(glob.glob(os.path.join(DOCS, "*.md")))


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


def bench_sections():
    """The keys of bench/__main__.py's SECTIONS dict, read from its text (importing it loads torch and more),
    plus 'all'."""
    text = read(os.path.join(ROOT, "bench", "__main__.py"))
    body = re.search(r"^SECTIONS = \{(.*?)\}$", text, flags=re.S | re.M)
    assert body, "bench/__main__.py has no SECTIONS = {...}"
    return {"all", *re.findall(r"\"(\w+)\":", body.group(1))}


def named_sections(text):
    """The sections that the `python -m bench` commands in a text ask for (each of a|b|c)."""
    return [name for line in text.splitlines() for match in BENCH.finditer(line)
            for arg in SECTION.findall(match.group(1)) for name in arg.split("|")]


@pytest.fixture(scope="module")
def readme():
    return read(README)


@pytest.fixture(scope="module")
def pages():
    """README.md and every docs/*.md, as {path relative to the repository: text}."""
    return {os.path.relpath(path, ROOT): read(path) for path in [README, *doc_paths()]}


@pytest.fixture(scope="module")
def commands(pages):
    return [line for text in pages.values() for line in code_lines(text)]


@pytest.fixture
def off_kaggle(monkeypatch):
    """Defaults as on any machine but Kaggle (where train_csv/test_csv default to the competition's files)."""
    monkeypatch.setattr(config, "competition_file", lambda name, fallback: fallback)


def test_config_reference_is_generated(pages, off_kaggle):
    for path, text in pages.items():
        if path != os.path.join("docs", "config.md"):
            assert START not in text and END not in text, f"{path} has config-reference markers: only docs/config.md"
    doc = read(CONFIG_DOC)
    assert doc.count(START) == 1 and doc.count(END) == 1, f"docs/config.md needs one {START} and one {END}"
    table = doc.split(START, 1)[1].split(END, 1)[0]
    assert table.strip("\n") == markdown_reference(), (
        f"docs/config.md's config reference is out of date with config.py; regenerate it with:\n{REGENERATE}")




def test_command_keys_are_config_fields(commands):
    scripts = [line for line in commands if SCRIPT.search(line)]
    assert len(scripts) >= 5, f"expected the README's and docs' train/evaluate/predict commands, found {scripts}"
    unknown = {(key, line) for line in scripts for key in script_keys(line) if key not in config.FIELDS}
    assert not unknown, f"README/docs commands pass keys that are not Config fields: {sorted(unknown)}"


def test_command_paths_exist(pages, commands):
    named = {path for line in commands for path in PATH.findall(line)}
    for required in ("config/demo.py", "config/kaggle_t4x2.py", "bench/gpu_check.sh",
                     "train.py", "evaluate.py", "predict.py", "export.py"):
        assert required in named, f"the README's and docs' commands do not mention {required}"
    in_prose = {"data/make_demo.py", "notebooks/kaggle_t4x2.ipynb"}
    everything = "\n".join(pages.values())
    assert all(path in everything for path in in_prose)
    missing = sorted(p for p in named | in_prose if not os.path.isfile(os.path.join(ROOT, p)))
    assert not missing, f"README/docs name files that do not exist: {missing}"


def test_bench_sections_exist(pages):
    known = bench_sections()
    for path, text in pages.items():
        unknown = sorted(set(named_sections(text)) - known)
        assert not unknown, (f"{path} runs python -m bench with sections it does not have: {unknown} "
                             f"(has {sorted(known)})")


def test_readme_is_short(readme):
    lines = readme.count("\n") + (not readme.endswith("\n"))
    assert lines <= README_MAX_LINES, (f"README.md has {lines} lines; move detail into docs/ "
                                       f"(at most {README_MAX_LINES})")


def test_readme_links_every_docs_page(readme):
    assert doc_paths(), "docs/ has no pages"
    linked = {os.path.normpath(target) for target in LINK.findall(readme)}
    unlinked = sorted(os.path.relpath(p, ROOT) for p in doc_paths() if os.path.relpath(p, ROOT) not in linked)
    assert not unlinked, f"README.md does not link these docs pages: {unlinked}"


def test_links_lead_somewhere(pages):
    broken = sorted((path, target) for path, text in pages.items() for target in LINK.findall(text)
                    if not os.path.exists(os.path.join(ROOT, os.path.dirname(path), target)))
    assert not broken, f"links to files that do not exist (page, target): {broken}"


def test_test_command_is_what_ci_runs(pages):
    pytest_lines = [line for text in pages.values() for line in code_lines(text) if "pytest" in line]
    assert pytest_lines == [TEST_COMMAND, FAST_TEST_COMMAND], (
        f"README and docs should hold two test commands, exactly {TEST_COMMAND!r} (what CI runs) and then "
        f"{FAST_TEST_COMMAND!r}: {pytest_lines}")
    assert code_lines(read(README)).count(TEST_COMMAND) == 1, f"the test command {TEST_COMMAND!r} belongs in README.md"
    assert FAST_TEST_COMMAND in code_lines(read(README)), f"the fast tier {FAST_TEST_COMMAND!r} belongs in README.md"
    assert re.search(r'^\s*"slow: ', read(os.path.join(ROOT, "pyproject.toml")), re.M), \
        "pyproject.toml's [tool.pytest.ini_options] markers should register the slow marker"
    ci = [line.strip() for line in read(os.path.join(ROOT, ".ci", "run")).splitlines()]
    assert TEST_COMMAND in ci, f".ci/run does not run {TEST_COMMAND!r}"


def test_the_readme_quotes_requirements_txts_torch_floor(readme):
    """A version floor is stated once, in requirements.txt; the README's set-up paragraph quotes it."""
    with open(os.path.join(ROOT, "requirements.txt")) as f:
        floor = next(line.strip() for line in f if line.startswith("torch>="))
    assert re.findall(r"`(torch>=[\d.]+)`", readme) == [floor]


def test_the_offline_wheels_recipe_is_for_kaggles_python():
    """docs/kaggle.md downloads wheels for the Python that tests/versions/kaggle.txt says Kaggle's image runs."""
    with open(os.path.join(ROOT, "tests", "versions", "kaggle.txt")) as f:
        python = re.search(r"[Pp]ython (3\.\d+)", f.read())[1]
    with open(os.path.join(DOCS, "kaggle.md")) as f:
        assert re.findall(r"--python-version (3\.\d+)", f.read()) == [python]


def test_requirements_txt_asks_for_the_torch_install_the_readme_runs(readme):
    """Its header names the command the README's set-up runs, not another pin."""
    with open(os.path.join(ROOT, "requirements.txt")) as f:
        header = "".join(line for line in f if line.startswith("#"))
    asked = re.findall(r"`(pip install torch[^`]*)`", header)
    assert asked and all(command in readme for command in asked), asked


def test_ci_lists_the_slowest_tests_of_the_readmes_command():
    """.ci/run runs the README's command and then lists the 25 slowest tests, so the next cut is measured."""
    ci = read(os.path.join(ROOT, ".ci", "run"))
    assert re.search(r'^export PYTEST_ADDOPTS="--durations=25"', ci, re.M), ci
    assert ci.index("PYTEST_ADDOPTS") < ci.index(f"\n{TEST_COMMAND}\n")
    assert "`--durations=25`" in read(README)
