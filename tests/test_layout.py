"""The layout shows the architecture: at most 10 Python files at the root, the machinery in summarizer/, the
benchmarks in bench/; units that fit a screen; imports that run one way (model needs torch alone, generate the
model alone). `python tests/test_layout.py` prints the largest units."""
import ast
import os
import subprocess
import sys

import pytest

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
LIMITS = {"class": 200, "function": 60}  # lines, decorators and docstrings included


def project_files():
    """The project's Python files (tests aside), relative to the repository."""
    for folder, dirs, files in os.walk(REPO):
        dirs[:] = [d for d in dirs if not d.startswith(".") and d not in ("tests", "__pycache__")]
        for name in files:
            if name.endswith(".py"):
                yield os.path.relpath(os.path.join(folder, name), REPO)


def units():
    """(lines, kind, 'path:line name') of every class and function of the project, largest first."""
    found = []
    for path in project_files():
        with open(os.path.join(REPO, path), encoding="utf-8") as f:
            tree = ast.parse(f.read())
        for node in ast.walk(tree):
            if isinstance(node, (ast.ClassDef, ast.FunctionDef, ast.AsyncFunctionDef)):
                first = min([node.lineno, *(d.lineno for d in node.decorator_list)])
                kind = "class" if isinstance(node, ast.ClassDef) else "function"
                found.append((node.end_lineno - first + 1, kind, f"{path}:{node.lineno} {node.name}"))
    return sorted(found, reverse=True)


def added_by(statement, first="import torch"):
    """Top-level module names (the standard library's too) that `statement` loads in a fresh interpreter that has run
    `first`."""
    code = (f"import sys; {first}; before = {{m.split('.')[0] for m in sys.modules}}; {statement}; "
            "print(' '.join(sorted({m.split('.')[0] for m in sys.modules} - before)))")
    out = subprocess.run([sys.executable, "-c", code], cwd=REPO, capture_output=True, text=True, check=True).stdout
    return set(out.split())


def test_the_root_holds_what_a_user_runs_or_reads_first():
    root = sorted(name for name in os.listdir(REPO) if name.endswith(".py"))
    assert len(root) <= 10, root
    for name in ("config.py", "model.py", "data.py", "generate.py", "train.py", "evaluate.py", "predict.py",
                 "export.py"):
        assert name in root
    for folder in ("summarizer", "bench", "docs", "config", "tests"):
        assert os.path.isdir(os.path.join(REPO, folder)), folder
    assert not any(name.startswith("bench") for name in root)


def test_no_unit_is_longer_than_a_screen():
    too_long = [(n, kind, where) for n, kind, where in units() if n > LIMITS[kind]]
    assert not too_long, f"over {LIMITS}: {too_long}"


@pytest.mark.slow
def test_model_needs_torch_alone_and_generate_the_model_alone():
    """After torch, `import model` loads nothing but model (not even a module of the standard library), and
    `import generate` nothing but model and generate beyond the standard library: no data or metric library."""
    model, generate = added_by("import model"), added_by("import generate")
    assert model == {"model"}  # torch itself loads tqdm (torch.hub); model adds nothing
    assert generate - set(sys.stdlib_module_names) == {"model", "generate"}
    assert not {"rouge_score", "nltk", "rapidfuzz", "pandas", "tiktoken"} & (model | generate)


if __name__ == "__main__":
    for n, kind, where in units()[:10]:
        print(f"{n:4d} lines  {kind:<8}  {where}")
