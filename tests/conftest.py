import collections
import contextlib
import json
import os
import random
import socket
import subprocess
import sys

import pandas as pd
import pytest

# One thread per process, as in the processes run() starts: on a small shared CPU, torch's default of a thread per
# core makes a tiny model wait on its threads (tests/test_generate.py took 98 s instead of 12 s on 2 busy cores).
os.environ.setdefault("OMP_NUM_THREADS", "1")
# Inductor compiles in the process itself, here and in the processes tests start (they inherit it): its default pool
# of compile workers starts Pythons that import torch, seconds of CPU for each compiling process, while pytest-xdist
# keeps every core busy already. Set before torch is imported: inductor reads it once.
os.environ.setdefault("TORCHINDUCTOR_COMPILE_THREADS", "1")

import torch  # noqa: E402
from transformers import GPT2Config, GPT2LMHeadModel  # noqa: E402

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
torch.set_num_threads(int(os.environ["OMP_NUM_THREADS"]))
# A one-block model trained from scratch on the CPU in float32, eager: what most tests train; files add their keys.
TINY = ["--init_from=scratch", "--n_layer=1", "--n_head=2", "--n_embd=32", "--block_size=128", "--max_new_tokens=16",
        "--device=cpu", "--dtype=float32", "--compile=False"]
# Seconds after which a test gives up on a process it started: a guard against a hang, never a bound on the work
# (a test bounds its work by steps and rows; a loaded machine is slower, not stuck).
HANG = 1800
# One optimizer step of 4 sequences, then one evaluation by validation loss: the shortest run that writes checkpoints.
ONE_STEP = ["--batch_size=4", "--micro_batch_size=4", "--max_iters=1", "--eval_interval=1",
            "--rouge_samples=0", "--best_metric=val_loss", "--eval_val_batches=1"]


@pytest.hookimpl(tryfirst=True)  # before pytest-xdist's own hook, which reads the groups into the test ids
def pytest_collection_modifyitems(items):
    """The tests of a module with a module-scoped fixture (a trained model, a run) form one group that one worker
    runs (--dist=loadgroup in pyproject.toml), so the fixture is built once, not once per worker. Then the order in
    which pytest-xdist hands them out: `minutes` first, then the slow tests, then the groups: a long one started last
    would run alone while the other workers idle."""
    for item in items:
        scopes = {fixture.scope for fixtures in item._fixtureinfo.name2fixturedefs.values() for fixture in fixtures}
        if "module" in scopes:
            item.add_marker(pytest.mark.xdist_group(item.module.__name__))
    items.sort(key=lambda item: (item.get_closest_marker("minutes") is None, item.get_closest_marker("slow") is None,
                                 item.get_closest_marker("xdist_group") is None))


def tiny(**overrides):
    """TINY with keys replaced (key=value) or left out (key=None), in TINY's order; keys TINY lacks go last."""
    flags = dict(flag[2:].split("=", 1) for flag in TINY)
    flags.update(overrides)
    return [f"--{key}={value}" for key, value in flags.items() if value is not None]


def tiny_gpt(**overrides):
    """A randomly initialised GPT of two blocks, width 32, 64 tokens of vocabulary and context 32; keys override."""
    from model import GPT, GPTConfig
    return GPT(GPTConfig(**dict(dict(block_size=32, vocab_size=64, n_layer=2, n_head=2, n_embd=32), **overrides)))


def metrics(out_dir):
    """The rows of out_dir/metrics.jsonl."""
    with open(os.path.join(out_dir, "metrics.jsonl")) as f:
        return [json.loads(line) for line in f]


def run(cmd, env=None, timeout=None):
    """A command (a script, torchrun, python -c) in the repository as a user starts it: one thread per process,
    no Accelerate or NCCL settings of the surrounding shell (nor of a Process this process made). Returns the
    CompletedProcess."""
    env = {k: v for k, v in os.environ.items() if not k.startswith(("ACCELERATE_", "NCCL_"))} | dict(env or {})
    return subprocess.run(cmd, cwd=REPO, env=dict(env, OMP_NUM_THREADS="1", PYTHONPATH=REPO), capture_output=True,
                          text=True, timeout=timeout or HANG)


def torchrun(*args):
    """The argv of `torchrun ARGS`, run by this interpreter (`python -m torch.distributed.run`): a `torchrun` on
    PATH may belong to another Python, or be missing."""
    return [sys.executable, "-m", "torch.distributed.run", *args]


def one_error_line(capsys, main, argv, code=2):
    """main(argv) exits with `code` and writes one `error: ...` line to stderr (progress bars aside); that line."""
    capsys.readouterr()
    with pytest.raises(SystemExit) as exit:
        main(argv)
    err = capsys.readouterr().err
    assert exit.value.code == code and "Traceback" not in err, err
    lines = [line for line in err.split("\n")[:-1] if "\r" not in line]  # progress bars may come first
    assert len(lines) == 1 and lines[0].startswith("error: "), err
    return lines[0]


def changed_settings(argv):
    """'batch_size=32 (config/demo.py), max_iters=5 (command line)': what config.changed_values says of
    argv, the keys whose value differs from the default with the preset or command line whose value holds."""
    from config import changed_values, setting_text, settings_given
    return ", ".join(f"{setting_text(key, value)} ({source})" for key, value, source in
                     changed_values(settings_given(argv)))


def config_error(argv):
    """The one line of the UserError that load_config(argv) raises."""
    from config import UserError, load_config
    with pytest.raises(UserError) as info:
        load_config(argv)
    message = str(info.value)
    assert "\n" not in message
    return message


@contextlib.contextmanager
def held_by_another_process(folder):
    """A training run's lock on `folder` (summarizer/run_folder.py's), held by another process until the block
    ends; that process's pid."""
    holder = subprocess.Popen([sys.executable, "-c", "import sys; from summarizer import run_folder; "
                               "handle = run_folder.lock(sys.argv[1]); print('held', flush=True); sys.stdin.read()",
                               str(folder)], cwd=REPO, stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True,
                              env=dict(os.environ, PYTHONPATH=REPO))
    try:
        assert holder.stdout.readline() == "held\n"
        yield holder.pid
    finally:
        holder.communicate("")


def free_port():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.fixture(scope="session")
def tiny_hf_dir(tmp_path_factory):
    """A tiny GPT2LMHeadModel saved with save_pretrained. The large initializer_range makes logits far apart,
    so greedy argmax never hinges on a floating-point tie between implementations."""
    torch.manual_seed(0)
    config = GPT2Config(vocab_size=50257, n_positions=128, n_embd=64, n_layer=2, n_head=4,
                        initializer_range=0.5, resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0)
    path = tmp_path_factory.mktemp("tiny-gpt2")
    GPT2LMHeadModel(config).save_pretrained(path)
    return str(path)


@pytest.fixture(scope="session")
def tiny_hf(tiny_hf_dir):
    return GPT2LMHeadModel.from_pretrained(tiny_hf_dir).eval()


@pytest.fixture(scope="module")
def ours(tiny_hf_dir):
    """Our GPT with tiny_hf's weights (a module's own: tests may change it)."""
    from model import GPT
    return GPT.from_pretrained(tiny_hf_dir).eval()


NAMES = ["Amanda", "Jerry", "Tom", "Lily", "Sam", "Kate", "Mike", "Anna", "Olivia", "Noah"]
PLANS = ["bake cookies", "watch a movie", "have dinner", "finish the report", "go to the party",
         "buy tickets", "grab coffee", "play tennis"]
DAYS = ["on Monday", "on Tuesday", "tonight", "tomorrow", "on Friday", "at the weekend"]


def synthetic_rows(n, seed):
    """Short two-person dialogues about a plan, each with a one-sentence summary a tiny model can learn."""
    rng = random.Random(seed)
    rows = []
    for i in range(n):
        a, b = rng.sample(NAMES, 2)
        plan, day = rng.choice(PLANS), rng.choice(DAYS)
        dialogue = f"{a}: Hi {b}, shall we {plan} {day}?\n{b}: Yes, let's {plan} {day}.\n{a}: Great, see you."
        rows.append({"id": f"d{seed}-{i}", "dialogue": dialogue, "summary": f"{a} and {b} will {plan} {day}."})
    return rows


def save_csv(path, rows, test=False):
    """Write rows (dicts or a DataFrame with id, dialogue, summary) as a plain CSV at path, without the summary
    column if test. Returns str(path)."""
    frame = pd.DataFrame(rows)
    (frame.drop(columns="summary") if test else frame).to_csv(path, index=False)
    return str(path)


@pytest.fixture
def fresh_dynamo():
    """Compiled code of earlier tests in this process is forgotten (its cache entries count toward dynamo's
    recompile limit), before and after the test."""
    torch._dynamo.reset()
    yield
    torch._dynamo.reset()


@pytest.fixture
def write_csv(tmp_path):
    """write_csv(name, n, seed=0, test=False) -> path of a CSV of synthetic dialogues in tmp_path (no summary if
    test). Module-scoped fixtures call save_csv(folder / name, synthetic_rows(n, seed)) instead."""
    def write(name, n, seed=0, test=False):
        return save_csv(tmp_path / name, synthetic_rows(n, seed), test)
    return write


def assert_export_matches(best_pt, export_dir):
    """export.py turns best_pt into a transformers folder whose logits are ours (1e-5)."""
    import export
    from summarizer.loading import build_model
    export.main([f"--ckpt={best_pt}", f"--export_dir={export_dir}"])
    ours = build_model(str(best_pt))[0].eval()
    hf = GPT2LMHeadModel.from_pretrained(export_dir).eval()
    idx = torch.randint(0, 50257, (2, 32), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        torch.testing.assert_close(hf(idx).logits, ours(idx)[0], atol=1e-5, rtol=1e-5)


def card_code(path):
    """The namespace of the model card's Python code, run as a transformers user would run it on this folder."""
    card = open(os.path.join(path, "README.md"), encoding="utf-8").read()
    code = card.split("## Use")[1].split("```python\n")[1].split("```")[0]
    code = code.replace(f'path = "{os.path.basename(path)}"', f"path = {path!r}", 1)
    namespace = {}
    exec(code, namespace)
    return namespace


def mid_way_eos(model, prompts, max_new, apart):
    """A token id the model emits mid-way (after 2 tokens, before the last 2) in more than `apart` rows but not in
    as many of the others: given as EOS, it ends rows at different steps (a random model's 50256 ends none)."""
    from config import Decoding
    from generate import generate
    counts = collections.Counter(token for row in generate(model, prompts, Decoding(max_new_tokens=max_new),
                                                           eos_token_id=-1) for token in set(row[2:max_new - 2]))
    token = max(counts, key=counts.get)
    assert apart < counts[token] < len(prompts) - apart
    return token
