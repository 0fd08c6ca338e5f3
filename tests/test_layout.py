"""The layout shows the architecture: at most 10 Python files at the root, the machinery in summarizer/, the
benchmarks in bench/; each concept one owner (no module named like another plus a suffix, the trainer taken by no
function outside train.py); one training step runs code in at most six project files; imports run one way (model
needs torch alone, generate the model alone)."""
import ast
import os
import subprocess
import sys

import pytest

from summarizer.preparation import prepare

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
STEP_FILES = 6  # project files one training step may run code in (nanochat's: about 5)
LONGEST = 65  # lines of the program's longest function: a longer one does two jobs


def project_files():
    """The project's Python files (tests aside), relative to the repository."""
    for folder, dirs, files in os.walk(REPO):
        dirs[:] = [d for d in dirs if not d.startswith(".") and d not in ("tests", "__pycache__")]
        for name in files:
            if name.endswith(".py"):
                yield os.path.relpath(os.path.join(folder, name), REPO)


def parsed():
    """(path, ast) of every project file."""
    for path in project_files():
        with open(os.path.join(REPO, path), encoding="utf-8") as f:
            yield path, ast.parse(f.read())


def added_by(*statements, first="import torch"):
    """For each statement in turn, in one fresh interpreter that has run `first`: the top-level module names (the
    standard library's too) loaded since `first`."""
    code = (f"import sys; {first}; before = {{m.split('.')[0] for m in sys.modules}}\n"
            + "".join(f"{statement}; print(' '.join(sorted({{m.split('.')[0] for m in sys.modules}} - before)))\n"
                      for statement in statements))
    out = subprocess.run([sys.executable, "-c", code], cwd=REPO, capture_output=True, text=True, check=True).stdout
    return [set(line.split()) for line in out.splitlines()]


def test_the_root_holds_what_a_user_runs_or_reads_first():
    root = sorted(name for name in os.listdir(REPO) if name.endswith(".py"))
    assert len(root) <= 10, root
    for name in ("config.py", "model.py", "data.py", "generate.py", "train.py", "evaluate.py", "predict.py",
                 "export.py"):
        assert name in root
    for folder in ("summarizer", "bench", "docs", "config", "tests"):
        assert os.path.isdir(os.path.join(REPO, folder)), folder
    assert not any(name.startswith("bench") for name in root)


def test_no_function_of_the_program_is_over_65_lines():
    """The program: every .py file outside tests/, bench/ and data/make_demo.py."""
    long = [(f"{path}:{node.lineno} {node.name}", node.end_lineno - node.lineno + 1) for path, tree in parsed()
            if not path.startswith("bench" + os.sep) and path != os.path.join("data", "make_demo.py")
            for node in ast.walk(tree) if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef))
            and node.end_lineno - node.lineno + 1 > LONGEST]
    assert not long, long


def test_no_module_is_named_like_another_plus_a_suffix():
    stems = {os.path.splitext(os.path.basename(p))[0] for p in project_files() if not p.startswith("config" + os.sep)}
    stems -= {"__init__", "__main__"}
    clashes = [(a, b) for a in stems for b in stems if a != b and b.startswith(a) and len(a) >= 4]
    assert not clashes, clashes


def test_no_function_outside_train_py_takes_the_trainer():
    takers = [f"{path}:{node.lineno} {node.name}" for path, tree in parsed() if path != "train.py"
              for node in ast.walk(tree) if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef))
              for arg in node.args.args + node.args.kwonlyargs if arg.arg == "trainer"]
    assert not takers, takers


def test_one_training_step_runs_code_in_at_most_six_project_files(tmp_path, write_csv):
    """Profiled between the second and the third forward of a one-process run (eager, fp32): the files whose
    functions ran, logging a metrics.jsonl row and the progress bar included."""
    import train
    from config import load_config
    from conftest import tiny
    from model import GPT
    from summarizer.runtime import Runtime

    argv = [*tiny(), f"--train_csv={write_csv('train.csv', 24)}", "--val_fraction=0.25", "--batch_size=2",
            "--micro_batch_size=2", "--max_iters=4", "--eval_interval=100", "--log_interval=1",
            "--rouge_samples=0", "--best_metric=val_loss", f"--out_dir={tmp_path / 'out'}"]
    cfg = load_config(argv)
    trainer = train.Trainer(prepare(cfg, rt := Runtime(cfg)), rt)
    forwards, files = [], set()

    def profile(frame, event, arg):
        if event != "call":
            return
        if frame.f_code is GPT.forward.__code__:
            forwards.append(1)
        path = os.path.relpath(frame.f_code.co_filename, REPO)
        project = os.path.isfile(os.path.join(REPO, path)) and not path.startswith(("..", "tests"))
        if len(forwards) == 2 and project:  # from step 2's forward to step 3's
            files.add(path)
    sys.setprofile(profile)
    try:
        trainer.fit()
    finally:
        sys.setprofile(None)
    assert len(forwards) >= 4 and 3 <= len(files) <= STEP_FILES, sorted(files)


@pytest.mark.slow
def test_model_needs_torch_alone_and_generate_the_model_alone():
    """After torch, `import model` loads nothing but model (not even a module of the standard library), and
    `import generate` nothing but model and generate beyond the standard library: no data or metric library."""
    model, generate = added_by("import model", "import generate")  # generate's count includes model's
    assert model == {"model"}  # torch itself loads tqdm (torch.hub); model adds nothing
    assert generate - set(sys.stdlib_module_names) == {"model", "generate"}
    assert not {"rouge_score", "nltk", "rapidfuzz", "pandas", "tiktoken"} & (model | generate)



# The layers, lowest first: a module imports from its own layer or one below, never above
LAYERS = (("command_line", "config", "model", "data"), ("generate",), ("summarizer",),
          ("train", "evaluate", "predict", "export"), ("bench",))


def layer(module):
    return next(i for i, names in enumerate(LAYERS) if module.split(".")[0] in names)


def project_imports():
    """{module: the project modules it imports (at any depth of its code)}."""
    graph = {}
    for path, tree in parsed():
        if path.startswith(("config" + os.sep, "data" + os.sep, "notebooks")):
            continue  # presets, the demo data's script, notebooks: no module imports them
        module = path[:-3].replace(os.sep, ".").removesuffix(".__init__")
        names = set()
        for node in ast.walk(tree):
            if isinstance(node, ast.Import):
                names |= {alias.name for alias in node.names}
            elif isinstance(node, ast.ImportFrom) and node.level == 0:
                names |= {f"{node.module}.{alias.name}" for alias in node.names} | {node.module}
        graph[module] = {name for name in names if name.split(".")[0] in {n for ns in LAYERS for n in ns}}
    return graph


def test_no_module_imports_from_a_layer_above_its_own():
    upward = [f"{module} imports {name}" for module, names in project_imports().items() for name in names
              if layer(name) > layer(module)]
    assert not upward, upward


def test_no_circle_of_imports_between_modules():
    graph = project_imports()
    modules = set(graph)
    edges = {module: {name if name in modules else name.rsplit(".", 1)[0] for name in names} & modules - {module}
             for module, names in graph.items()}
    done, path = set(), []

    def visit(module):
        if module in path:
            return path[path.index(module):] + [module]
        if module in done:
            return None
        path.append(module)
        for name in sorted(edges[module]):
            circle = visit(name)
            if circle:
                return circle
        path.pop()
        done.add(module)
        return None

    circles = [c for c in map(visit, sorted(modules)) if c]
    assert not circles, " -> ".join(circles[0])


def test_runtime_needs_no_checkpoint_and_data_nothing_of_summarizer():
    graph = project_imports()
    assert not {name for name in graph["summarizer.runtime"] if name.startswith("summarizer.checkpoint")}
    assert not {name for name in graph["data"] if name.startswith("summarizer")}


def test_the_benchmarks_read_what_runs_write_not_their_printed_lines_through_regexes():
    """bench/ takes a run's figures from metrics.jsonl and JSON files: a regex over train.py's printed lines would
    break silently when a line's words change."""
    users = [path for path, tree in parsed() if path.startswith("bench" + os.sep) for node in ast.walk(tree)
             if isinstance(node, ast.Import) and any(alias.name == "re" for alias in node.names)]
    assert not users, users
