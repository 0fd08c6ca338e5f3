"""The layout shows the architecture: at most 10 Python files at the root, the machinery in summarizer/, the
benchmarks in bench/; each concept one owner (no module named like another plus a suffix, the trainer taken by no
function outside train.py); one training step runs code in at most six project files; imports run one way (model
needs torch alone, generate the model alone); a reader follows predict.py from a checkpoint's path to the model's
forward through few files, down once, and generate() to the attention through two."""
import ast
import collections
import functools
import inspect
import os
import subprocess
import sys

import pytest

from summarizer.preparation import prepare

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
STEP_FILES = 6  # project files one training step may run code in (nanochat's: about 5)
LONGEST = 65  # lines of the program's longest function: a longer one does two jobs
# Lines a reader opens (read()) from generate() to the attention (223 at 7468a17, eagerly, in 3 files; gpt-fast's
# whole decoding is 2 files and 217 lines)
TO_ATTENTION = 300


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


def test_an_exceptions_first_line_is_taken_in_one_place():
    """command_line.first_line; generate.py, which needs the model alone, is handed error_line by its caller."""
    def newline(node):
        return (isinstance(node, ast.Constant) and node.value == "\n" or isinstance(node, ast.Call)
                and getattr(node.func, "id", None) == "chr" and getattr(node.args[0], "value", None) == 10)
    takers = [f"{path}:{node.lineno}" for path, tree in parsed() for node in ast.walk(tree)
              if isinstance(node, ast.Subscript) and getattr(node.slice, "value", None) == 0
              and isinstance(node.value, ast.Call) and isinstance(node.value.func, ast.Attribute)
              and (node.value.func.attr in ("partition", "split") and node.value.args and newline(node.value.args[0])
                   or node.value.func.attr == "splitlines")
              and "str" in {getattr(n.func, "id", None) for n in ast.walk(node.value) if isinstance(n, ast.Call)}]
    assert takers == ["command_line.py:44"], takers


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
    from summarizer.process import Process

    argv = [*tiny(), f"--train_csv={write_csv('train.csv', 24)}", "--val_fraction=0.25", "--batch_size=2",
            "--micro_batch_size=2", "--max_iters=4", "--eval_interval=100", "--log_interval=1",
            "--rouge_samples=0", "--best_metric=val_loss", f"--out_dir={tmp_path / 'out'}"]
    cfg = load_config(argv)
    trainer = train.Trainer(prepare(cfg, proc := Process(cfg)), proc)
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
    assert not {name for name in graph["summarizer.process"] if name.startswith("summarizer.checkpoint")}
    assert not {name for name in graph["data"] if name.startswith("summarizer")}


def test_the_benchmarks_read_what_runs_write_not_their_printed_lines_through_regexes():
    """bench/ takes a run's figures from metrics.jsonl and JSON files: a regex over train.py's printed lines would
    break silently when a line's words change."""
    users = [path for path, tree in parsed() if path.startswith("bench" + os.sep) for node in ast.walk(tree)
             if isinstance(node, ast.Import) and any(alias.name == "re" for alias in node.names)]
    assert not users, users


# ---- what a reader opens --------------------------------------------------------------------------------------

@functools.cache
def function_lines(path):
    """{a function's first line (its def's, or its first decorator's, as code objects count): its lines}."""
    with open(os.path.join(REPO, path), encoding="utf-8") as f:
        tree = ast.parse(f.read())
    return {line: node.end_lineno - node.lineno + 1 for node in ast.walk(tree)
            if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef))
            for line in (node.lineno, *(d.lineno for d in node.decorator_list))}


class Reading(collections.namedtuple("Reading", "functions stack")):
    """The program's functions a reader opens, each once, in the order they first run ((file, first line, name);
    comprehensions and lambdas are read with their function), and the stack of those at the end."""

    def files(self):
        return {path for path, _, _ in self.functions}

    def lines(self):
        return sum(function_lines(path)[line] for path, line, _ in self.functions)

    def visits(self):
        """The files in reading order, a file read on in one go counted once: a return is a visit to a file read
        before (there are len(visits) - len(files) of them)."""
        paths = [path for path, _, _ in self.functions]
        return [path for i, path in enumerate(paths) if not i or paths[i - 1] != path]


def read(run, until, within=None, nth=1):
    """The Reading of the program while run() runs: from the call of `within` (a function; None: from the start)
    until it returns, or until the nth call of a function in `until`."""
    start = within and inspect.unwrap(within).__code__  # generate's own code, not inference_mode's wrapper
    functions, stack, calls, on = {}, [], [], start is None
    ends = {f.__code__ for f in until}

    def profile(frame, event, arg):
        nonlocal on
        code = frame.f_code
        if event == "call" and code in ends and on:
            calls.append(code)
            if len(calls) == nth:
                stack.append(os.path.relpath(code.co_filename, REPO))
                return sys.setprofile(None)
        path = os.path.relpath(code.co_filename, REPO)
        if event == "call" and code is start:
            on = True
        elif event == "return" and code is start and on:
            return sys.setprofile(None)
        program = not path.startswith(("..", "tests")) and os.path.isfile(os.path.join(REPO, path))
        if on and program and not code.co_name.startswith("<"):
            if event == "call":
                functions.setdefault((path, code.co_firstlineno, code.co_name), None)
                stack.append(path)
            elif event == "return" and stack:
                stack.pop()
    sys.setprofile(profile)
    try:
        run()
    finally:
        sys.setprofile(None)
    return Reading(list(functions), stack)


@pytest.fixture(scope="module")
def best_pt(tmp_path_factory):
    """A tiny run's best.pt, and a test.csv for predict.py."""
    import train
    from conftest import ONE_STEP, save_csv, synthetic_rows, tiny
    folder = tmp_path_factory.mktemp("run")
    save_csv(folder / "train.csv", synthetic_rows(24, seed=0))
    train.main([*tiny(), *ONE_STEP, f"--train_csv={folder / 'train.csv'}", "--val_fraction=0.25",
                f"--out_dir={folder}", f"--data_cache_dir={folder / 'cache'}"])
    return folder / "best.pt", save_csv(folder / "test.csv", synthetic_rows(4, seed=1), test=True)


def predict_reading(best_pt, out_dir, within=None):
    """What a reader opens as predict.py writes a submission with best_pt, up to the model's first forward."""
    import predict
    from model import GPT
    path, test_csv = best_pt
    argv = ["--device=cpu", "--dtype=float32", "--compile=False", f"--ckpt={path}", f"--test_csv={test_csv}",
            "--sample_submission_csv=", f"--out_dir={out_dir}"]
    return read(lambda: predict.main(argv), (GPT.forward, GPT.next_logits, GPT.prefill), within)


def test_predict_goes_down_from_a_checkpoints_path_to_the_model_once(best_pt, tmp_path):
    """From the path to the model (inference.open_summary_model): each module entered at most twice, loading.py once
    (nothing returns to it); and on the way to the model's forward, loading.py read in one go."""
    from summarizer import inference
    loading = predict_reading(best_pt, tmp_path / "a", inference.open_summary_model).visits()
    assert max(collections.Counter(loading).values()) <= 2 and loading.count("summarizer/loading.py") == 1, loading
    assert predict_reading(best_pt, tmp_path / "b").visits().count("summarizer/loading.py") == 1


def generate_reading():
    """What a reader opens from generate() (plain greedy, eager) to the attention of the first decode step (the
    layers' attentions after the prefill's)."""
    from config import Decoding
    from conftest import tiny_gpt
    from generate import generate
    from model import CausalSelfAttention
    model = tiny_gpt().eval()
    return read(lambda: generate(model, [[1, 2, 3], [4, 5]], Decoding(4)), (CausalSelfAttention.forward,), generate,
                nth=model.config.n_layer + 1)


def test_generate_reaches_the_attention_through_two_files_and_300_lines():
    """Its hops (the call chain, as issue 69 counted them) in generate.py and model.py; every function entered on the
    way, the settings' own check (Decoding.contradiction) included, at most 300 lines."""
    reading = generate_reading()
    assert set(reading.stack) == {"generate.py", "model.py"}, reading.stack
    assert reading.lines() <= TO_ATTENTION, reading.functions
