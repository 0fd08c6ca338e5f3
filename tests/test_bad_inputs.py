"""Hostile inputs to train.py, evaluate.py and predict.py: each run ends in one `error: ...` line and exit code 2,
or succeeds and says how many rows it skipped or cut.

The matrix calls each script's main() in this process, since a subprocess spends ~4 s importing torch per case:
an exception other than SystemExit escaping main() is exactly what a user would see as a traceback, and fails
the test. test_the_scripts_as_processes runs three cases as real processes.
"""
import importlib
import os
import pickle
import re
import subprocess
import sys
import time

import pandas as pd
import pytest
import torch
from transformers import GPT2Config, GPT2LMHeadModel

import data
import evaluate
import predict
import train
from command_line import UserError
from conftest import HANG, ONE_STEP, REPO, TINY, free_port, one_error_line, save_csv, synthetic_rows, tiny
from summarizer.checkpoint import load_checkpoint


def csv_bytes(rows, sep=",", newline="\n", encoding="utf-8"):
    frame = pd.DataFrame(rows)
    if len(sep) == 1:
        return frame.to_csv(index=False, sep=sep, lineterminator=newline).encode(encoding)
    quoted = [[f'"{value}"' for value in row] for row in frame.astype(str).values.tolist()]
    return newline.join(sep.join(cells) for cells in [list(frame.columns)] + quoted).encode(encoding)


def rows_to_summarize(changes=None):
    """Three rows of a test.csv (id, dialogue) with `changes` = {row: {column: value}} applied."""
    rows = [{"id": row["id"], "dialogue": row["dialogue"]} for row in synthetic_rows(3, seed=1)]
    for i, values in (changes or {}).items():
        rows[i].update(values)
    return rows


@pytest.fixture(scope="module")
def trained(tmp_path_factory):
    """A one-step tiny model: out/best.pt and out/ckpt.pt, trained on train.csv (40 rows, 2 held out)."""
    folder = tmp_path_factory.mktemp("trained")
    save_csv(folder / "train.csv", synthetic_rows(40, seed=0))
    train.main([*TINY, *ONE_STEP, f"--train_csv={folder / 'train.csv'}", f"--data_cache_dir={folder / 'cache'}",
                f"--out_dir={folder / 'out'}"])
    return folder


class Inputs:
    """Files and arguments for one case, in the case's own tmp_path."""

    def __init__(self, tmp_path, trained):
        self.tmp, self.trained = tmp_path, trained
        self.best = str(trained / "out" / "best.pt")

    def file(self, name, content):
        path = self.tmp / name
        path.write_bytes(content)
        return str(path)

    def checkpoint(self, change):
        """A copy of the trained best.pt with change(ckpt) applied."""
        ckpt = torch.load(self.best, weights_only=True)
        change(ckpt)
        torch.save(ckpt, self.tmp / "changed.pt")
        return str(self.tmp / "changed.pt")

    def unwritable_dir(self):
        """A directory that cannot be written; as root, where permissions do not stop writes, a path under a file."""
        path = self.tmp / "read-only"
        path.mkdir()
        path.chmod(0o500)
        if os.access(path, os.W_OK):
            (self.tmp / "a-file").write_text("")
            return str(self.tmp / "a-file" / "out")
        return str(path)

    def gpt2_folder(self, positions):
        """A transformers GPT-2 folder (save_pretrained) of TINY's shape with `positions` positions."""
        path = self.tmp / "gpt2-folder"
        config = GPT2Config(vocab_size=50257, n_positions=positions, n_layer=1, n_head=2, n_embd=32)
        GPT2LMHeadModel(config).save_pretrained(path)
        return str(path)

    def train(self, csv, *extra):
        return [*TINY, *ONE_STEP, f"--train_csv={csv}", f"--data_cache_dir={self.tmp / 'cache'}",
                f"--out_dir={self.tmp / 'out'}", *extra]

    def train_rows(self, rows, *extra, **csv_options):
        return self.train(self.file("train.csv", csv_bytes(rows, **csv_options)), *extra)

    def resume(self, *extra):
        """train.py --init_from=resume from a copy of the trained ckpt.pt."""
        out = self.tmp / "out"
        out.mkdir()
        (out / "ckpt.pt").write_bytes((self.trained / "out" / "ckpt.pt").read_bytes())
        return self.train(str(self.trained / "train.csv"), "--max_iters=2", "--init_from=resume", *extra)

    def damaged(self, name):
        """out/ with a copy of the trained run whose `name` (ckpt.pt or best.pt) lost its second half."""
        out = self.tmp / "out"
        out.mkdir()
        for kept in ("ckpt.pt", "best.pt"):
            content = (self.trained / "out" / kept).read_bytes()
            (out / kept).write_bytes(content[:len(content) // 2] if kept == name else content)
        return out

    def evaluate(self, *extra):
        return [*tiny(init_from=None), f"--train_csv={self.trained / 'train.csv'}",
                f"--data_cache_dir={self.trained / 'cache'}", f"--ckpt={self.best}", f"--out_dir={self.tmp / 'out'}",
                *extra]

    def predict(self, *extra, rows=None, content=None):
        csv = self.file("test.csv", content if content is not None else csv_bytes(rows or rows_to_summarize()))
        return [*tiny(init_from=None), f"--test_csv={csv}", f"--ckpt={self.best}", f"--out_dir={self.tmp / 'out'}",
                "--sample_submission_csv=", *extra]


GOOD = synthetic_rows(7, seed=2)  # 6 training rows and 1 held out
LONG_DIALOGUE = " ".join(f"Tom: point number {i} of a very long story." for i in range(60))
ERROR, OK = 2, 0

# (case, script, arguments, exit code, regex: of the single error line, or of stdout when the run succeeds)
CASES = [
    ("missing file", "train", lambda f: f.train(str(f.tmp / "nope.csv")), ERROR,
     r"train_csv \S*nope\.csv does not exist"),
    ("empty file", "train", lambda f: f.train(f.file("train.csv", b"")), ERROR, r"is empty"),
    ("header only", "train", lambda f: f.train(f.file("train.csv", b"id,dialogue,summary\r\n")), ERROR,
     r"has a header but no data rows"),
    ("renamed column", "train", lambda f: f.train_rows([{"id": r["id"], "dialogue": r["dialogue"], "gist": r["summary"]}
                                                        for r in GOOD]), ERROR,
     r"has no summary column .*columns found: 'id', 'dialogue', 'gist'.* --summary_column="),
    ("';;' separators", "train", lambda f: f.train_rows(GOOD, sep=";;"), ERROR, r"is not comma-separated"),
    ("unclosed quote", "train", lambda f: f.train(f.file("train.csv", b'id,dialogue,summary\n1,"A: hi,x\n2,B: y,z\n')),
     ERROR, r"is not a readable CSV"),
    ("NaN and empty fields", "train",
     lambda f: f.train_rows(GOOD + [{"id": "a", "dialogue": None, "summary": "s"},
                                    {"id": "b", "dialogue": "Tom: hi", "summary": float("nan")},
                                    {"id": "c", "dialogue": " \r\n ", "summary": "s"}]), OK,
     r"skipped 3 row\(s\) with an empty dialogue or summary"),
    ("every row empty", "train", lambda f: f.train(f.file("train.csv", b"id,dialogue,summary\n1,,\n2, ,x\n")), ERROR,
     r"every row has an empty dialogue or summary"),
    ("non-UTF-8 bytes", "train", lambda f: f.train_rows([{**r, "dialogue": r["dialogue"] + " Café?"} for r in GOOD],
                                                        encoding="cp1252"), OK,
     r"^6 training and 1 validation examples"),
    ("CRLF", "train", lambda f: f.train_rows(GOOD, newline="\r\n"), OK, r"^6 training and 1 validation examples"),
    ("dialogue far longer than block_size", "train",
     lambda f: f.train_rows(GOOD + [{"id": "long", "dialogue": LONG_DIALOGUE, "summary": "Tom talks."}]), OK,
     r"cut the end of 1 dialogue\(s\) to fit block_size=128"),
    ("summary longer than block_size", "train",
     lambda f: f.train_rows(GOOD + [{"id": "long", "dialogue": "Tom: hi", "summary": LONG_DIALOGUE}]), OK,
     r"skipped 1 example\(s\) whose summary alone does not fit block_size=128"),
    ("unknown config key", "train", lambda f: f.train(str(f.trained / "train.csv"), "--lerning_rate=1e-3"), ERROR,
     r"unknown config key 'lerning_rate' .*did you mean 'learning_rate'\?"),
    ("init_from path does not exist", "train",
     lambda f: f.train(str(f.trained / "train.csv"), f"--init_from={f.tmp / 'no-model'}"), ERROR,
     r"init_from='\S*no-model' is none of resume, scratch, gpt2, .* nor a transformers model folder"),
    ("a GPT-2 folder with fewer positions than block_size", "train",
     lambda f: f.train(str(f.trained / "train.csv"), f"--init_from={f.gpt2_folder(64)}"), ERROR,
     r"block_size=128 is longer than the 64 positions of init_from=\S+gpt2-folder: pass --block_size=64 or less"),
    ("a shape flag that contradicts a GPT-2 folder", "train",
     lambda f: f.train(str(f.trained / "train.csv"), f"--init_from={f.gpt2_folder(128)}", "--n_layer=6"), ERROR,
     r"--n_layer=6 contradicts init_from=\S+gpt2-folder: that model has n_layer=1: drop the flag"),
    ("a block_size longer than GPT-2's", "train", lambda f: f.train(str(f.trained / "train.csv"), "--init_from=gpt2",
                                                                   "--block_size=2048", "--n_layer=12",
                                                                   "--n_head=12", "--n_embd=768"), ERROR,
     r"block_size=2048 is longer than the 1024 positions of init_from=gpt2: pass --block_size=1024 or less"),
    ("resume without ckpt.pt", "train", lambda f: f.train(str(f.trained / "train.csv"), "--init_from=resume"), ERROR,
     r"ckpt\.pt does not exist: nothing to resume; .*--resume_from="),
    ("resume with another block_size", "train", lambda f: f.resume("--block_size=256"), ERROR,
     r"trained with block_size=128, not 256: resume with --block_size=128"),
    ("resume with another batch_size", "train", lambda f: f.resume("--batch_size=8"), ERROR,
     r"trained with batch_size=4, not 8: resume with --batch_size=4 \(the rows of each step cannot change"),
    ("resume with another train_csv", "train",
     lambda f: f.resume(f"--train_csv={f.file('other.csv', csv_bytes(GOOD))}"), ERROR,
     r"train_csv=\S+other\.csv holds other rows than \S+ckpt\.pt was trained on \(from \S+train\.csv\): "
            r"resume with that CSV, or .* --init_from=\S+ckpt\.pt --out_dir=<a new folder>"),
    ("out_dir not writable", "train",
     lambda f: f.train(str(f.trained / "train.csv"), f"--out_dir={f.unwritable_dir()}"),
     ERROR, r"out_dir \S+ is not writable"),
    ("wrong value type", "evaluate", lambda f: f.evaluate("--max_new_tokens=lots"), ERROR,
     r"max_new_tokens expects int, got 'lots'"),
    ("baseline path does not exist", "evaluate", lambda f: f.evaluate(f"--baseline={f.tmp / 'no-model'}"), ERROR,
     r"baseline='\S*no-model' is none of first_line, lead3, longest3, scratch, gpt2"),
    ("checkpoint does not exist", "evaluate", lambda f: f.evaluate(f"--ckpt={f.tmp / 'nope.pt'}"), ERROR,
     r"nope\.pt does not exist: train first"),
    ("checkpoint of another model shape", "evaluate",
     lambda f: f.evaluate(f"--ckpt={f.checkpoint(lambda c: c['model_args'].update(n_embd=64))}"), ERROR,
     r"changed\.pt does not fit model"),
    ("a shape flag that contradicts the checkpoint", "evaluate", lambda f: f.evaluate("--n_embd=64"), ERROR,
     r"--n_embd=64 contradicts \S+best\.pt: it was trained with n_embd=32, not 64: drop the flag"),
    ("out_dir not writable", "evaluate", lambda f: f.evaluate(f"--out_dir={f.unwritable_dir()}"), ERROR,
     r"out_dir \S+ is not writable"),
    ("truncated checkpoint", "predict",
     lambda f: f.predict(f"--ckpt={f.file('half.pt', open(f.best, 'rb').read()[:100_000])}"), ERROR,
     r"checkpoint \S*half\.pt is corrupted \(100,000 bytes, not a complete torch\.save archive.*no other "
     r"checkpoint in \S+ is intact"),
    ("truncated ckpt.pt", "train",
     lambda f: f.damaged("ckpt.pt") and f.train(str(f.trained / "train.csv"), "--max_iters=2", "--init_from=resume"),
     ERROR,
     r"ckpt\.pt is corrupted .*; intact: \S+best\.pt \(iter 1\); start from its weights with --init_from="),
    ("truncated best.pt", "evaluate", lambda f: f.evaluate(f"--ckpt={f.damaged('best.pt') / 'best.pt'}"), ERROR,
     r"best\.pt is corrupted .*; intact: \S+ckpt\.pt \(iter 1\); score one with --ckpt="),
    ("predict_after with a missing test_csv", "train",
     lambda f: f.train(str(f.trained / "train.csv"), "--predict_after=True", f"--test_csv={f.tmp / 'no-test.csv'}"),
     ERROR, r"test_csv \S*no-test\.csv does not exist"),
    ("predict_after with a missing sample submission", "train",
     lambda f: f.train(str(f.trained / "train.csv"), "--predict_after=True",
                       f"--test_csv={f.file('test.csv', csv_bytes(rows_to_summarize()))}",
                       f"--sample_submission_csv={f.tmp / 'no-sample.csv'}"),
     ERROR, r"sample_submission_csv \S*no-sample\.csv does not exist"),
    ("checkpoint from another model.py", "predict",
     lambda f: f.predict(f"--ckpt={f.checkpoint(lambda c: c['model_args'].update(n_kv_head=1))}"), ERROR,
     r"changed\.pt has model_args .* that this model.py cannot build"),
    ("duplicate test ids", "predict", lambda f: f.predict(rows=rows_to_summarize({2: {"id": "d1-0"}})), ERROR,
     r"test_csv \S+ has 1 duplicated id\(s\), e\.g\. d1-0"),
    ("empty test ids", "predict", lambda f: f.predict(rows=rows_to_summarize({0: {"id": ""}, 2: {"id": " "}})), ERROR,
     r"test_csv \S+ has 2 row\(s\) with no id \(line 2, 8\): each row needs its id"),  # 3 lines a dialogue
    ("test.csv without id column", "predict",
     lambda f: f.predict(rows=[{"key": r["id"], "dialogue": r["dialogue"]} for r in rows_to_summarize()]), ERROR,
     r"test_csv \S+ has no id column"),
    ("NaN and empty test dialogues", "predict",
     lambda f: f.predict(rows=rows_to_summarize({0: {"dialogue": None}, 1: {"dialogue": ""}})), OK,
     r"^2 test dialogue\(s\) are empty(.|\n)*wrote 3 summaries"),
    ("BOM, CRLF and non-UTF-8 bytes in test.csv", "predict",
     lambda f: f.predict(
         content=b"\xef\xbb\xbf" + csv_bytes(rows_to_summarize(), newline="\r\n").replace(b"Hi", b"H\xe9")),
     OK, r"^wrote 3 summaries"),
    ("a shape flag that contradicts the checkpoint", "predict", lambda f: f.predict("--n_layer=4"), ERROR,
     r"--n_layer=4 contradicts \S+best\.pt: it was trained with n_layer=1, not 4: drop the flag"),
    ("out_dir not writable", "predict", lambda f: f.predict(f"--out_dir={f.unwritable_dir()}"), ERROR,
     r"out_dir \S+ is not writable"),
    ("unknown key in a preset", "predict",
     lambda f: f.predict(f.file("preset.json", b'{"batch_size": 8, "temprature": 0.5}')),
     ERROR, r"unknown config key 'temprature' in \S+preset\.json: did you mean 'temperature'\?"),
    # issue 43: first contact, round 3
    ("a run's folder as init_from", "train", lambda f: f.train(str(f.trained / "train.csv"),
                                                               f"--init_from={f.trained / 'out'}"), ERROR,
     r"init_from=\S+out is a run's folder, not a model: name its checkpoint, --init_from=\S+out/best\.pt"),
    ("a missing checkpoint as init_from", "train", lambda f: f.train(str(f.trained / "train.csv"),
                                                                     f"--init_from={f.tmp / 'nope.pt'}"), ERROR,
     r"nope\.pt does not exist: train first, or pass --init_from=<a best\.pt or ckpt\.pt>"),
    ("a relative path from another folder", "train", lambda f: f.train("data/nope/train.csv"), ERROR,
     r"train_csv data/nope/train\.csv does not exist \(relative to the current folder /\S*\)"),
    ("a folder as test_csv", "predict", lambda f: f.predict(f"--test_csv={f.trained}"), ERROR,
     r"test_csv \S+ is a folder \(it holds train\.csv\): name the CSV inside it, e\.g\. --test_csv=\S+train\.csv"),
    ("not a checkpoint as --ckpt", "evaluate",
     lambda f: f.evaluate(f"--ckpt={f.file('metrics.jsonl', b'{}')}"), ERROR,
     r"metrics\.jsonl is not a checkpoint \(train\.py writes best\.pt and ckpt\.pt as torch\.save archives\)"),
    ("float test ids against integer sample ids", "predict",
     lambda f: f.predict("--sample_submission_csv=" + f.file("sample.csv", b"id,summary\n0,x\n1,x\n2,x\n"),
                         rows=rows_to_summarize({i: {"id": f"{i}.0"} for i in range(3)})), ERROR,
     r"e\.g\. the sample's \['0', '1', '2'\]; e\.g\. test_csv's \['0\.0', '1\.0', '2\.0'\]"),
    ("max_new_tokens in a sweep", "evaluate", lambda f: f.evaluate("--sweep=max_new_tokens=32,64"), ERROR,
     r"max_new_tokens cannot be swept: .* --max_new_tokens=N"),
]


def error_line(err):
    """The one `error: ...` line that must end stderr, after nothing but progress bars and warnings."""
    assert "Traceback" not in err
    lines = err.strip().splitlines()
    assert lines and lines[-1].startswith("error: "), err[-2000:]
    assert [line for line in lines if line.startswith("error")] == lines[-1:], err[-2000:]
    return lines[-1]


def run_main(script, args):
    """Exit code of script.main(args) in this process: 0 when it returns, else its SystemExit code."""
    try:
        importlib.import_module(script).main(args)
    except SystemExit as e:
        return e.code or 0
    return 0


@pytest.mark.parametrize("case, script, make_args, expected_exit, pattern", CASES,
                         ids=[f"{script}: {case}" for case, script, *_ in CASES])
def test_bad_input(case, script, make_args, expected_exit, pattern, trained, tmp_path, capsys):
    args = make_args(Inputs(tmp_path, trained))
    capsys.readouterr()
    code = run_main(script, args)
    out, err = capsys.readouterr()
    assert code == expected_exit, err[-2000:]
    if expected_exit == ERROR:
        assert re.search(pattern, error_line(err))
    else:
        assert "Traceback" not in err and re.search(pattern, out, re.MULTILINE), out[-2000:]


@pytest.mark.slow
def test_the_scripts_as_processes(trained, tmp_path):
    """The real command lines, one case per script, run side by side: exit code 2 and exactly one stderr line."""
    chosen = {"train": "header only", "evaluate": "checkpoint of another model shape", "predict": "duplicate test ids"}
    env = dict(os.environ, PYTHONPATH=REPO, OMP_NUM_THREADS="1")
    processes = {}
    for case, script, make_args, _, pattern in CASES:
        if chosen.get(script) == case:
            (tmp_path / script).mkdir()
            args = make_args(Inputs(tmp_path / script, trained))
            processes[script, pattern] = subprocess.Popen([sys.executable, f"{script}.py", *args], cwd=REPO, env=env,
                                                         stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
    assert len(processes) == 3
    for (script, pattern), process in processes.items():
        _, err = process.communicate(timeout=HANG)
        assert process.returncode == ERROR, (script, err)
        assert err.count("\n") == 1 and err.startswith("error: ") and re.search(pattern, err), (script, err)


class RunsCode:
    """Unpickling this runs a shell command that creates `marker`."""

    def __init__(self, marker):
        self.marker = marker

    def __reduce__(self):
        return os.system, (f"touch {self.marker}",)


@pytest.mark.parametrize("script", ["predict", "train", "evaluate"])
def test_checkpoint_whose_pickle_runs_code_is_refused(script, trained, tmp_path, capsys):
    """load_checkpoint refuses it (weights_only), and so do predict.py, train.py resuming from it and evaluate.py, in
    one line; the code never runs."""
    marker = tmp_path / "pwned"
    out = tmp_path / "out"
    out.mkdir()
    ckpt = torch.load(trained / "out" / "best.pt", weights_only=True)
    torch.save({**ckpt, "payload": RunsCode(marker)}, out / "ckpt.pt", pickle_module=pickle)
    with pytest.raises(UserError, match="weights_only"):
        load_checkpoint(str(out / "ckpt.pt"))
    assert not marker.exists()
    f = Inputs(tmp_path, trained)
    if script == "evaluate":
        args = [f"--ckpt={out / 'ckpt.pt'}", f"--out_dir={tmp_path}", "--device=cpu"]
    elif script == "predict":
        args = f.predict(f"--ckpt={out / 'ckpt.pt'}")
    else:
        args = f.train(str(trained / "train.csv"), "--init_from=resume")
    capsys.readouterr()
    assert run_main(script, args) == ERROR
    err = capsys.readouterr().err
    line = error_line(err)
    if script == "evaluate":
        assert err.strip().count("\n") == 0
    assert re.search(r"\S+ckpt\.pt .*weights_only", line)
    assert not marker.exists()


def test_a_failed_command_leaves_no_empty_out_dir(tmp_path, capsys):
    for main in (train.main, evaluate.main, predict.main):
        one_error_line(capsys, main, [*TINY, *ONE_STEP, "--sample_submission_csv=",
                                      f"--train_csv={tmp_path / 'missing.csv'}", f"--ckpt={tmp_path / 'missing.pt'}",
                                      f"--out_dir={tmp_path / 'new'}"])
        assert not (tmp_path / "new").exists()
    (tmp_path / "kept").mkdir()
    one_error_line(capsys, train.main,
                   [*TINY, *ONE_STEP, f"--train_csv={tmp_path / 'missing.csv'}", f"--out_dir={tmp_path / 'kept'}"])
    assert (tmp_path / "kept").is_dir()  # a folder that was there stays


def test_tokenizer_file_with_another_hash_is_one_error_line(trained, tmp_path, monkeypatch, capsys):
    encoder_json, vocab_bpe = data.bpe_files()
    tampered = tmp_path / "vocab.bpe"
    tampered.write_bytes(open(vocab_bpe, "rb").read().replace(b"\nh e\n", b"\ne h\n", 1))
    monkeypatch.setattr(data, "bpe_files", lambda: (encoder_json, str(tampered)))
    data.get_tokenizer.cache_clear()
    try:
        args = Inputs(tmp_path, trained).train(str(trained / "train.csv"))  # a new data cache: it must tokenize
        capsys.readouterr()
        assert run_main("train", args) == ERROR
    finally:
        data.get_tokenizer.cache_clear()
    assert re.search(r"\S+vocab\.bpe .*sha256", error_line(capsys.readouterr().err))


@pytest.mark.slow
def test_a_gpt2_name_without_network_is_one_line_within_seconds(trained, tmp_path):
    """No internet (the hub's address refuses connections, nothing cached): one line naming both ways out, long
    before transformers' retries would give up."""
    env = {k: v for k, v in os.environ.items() if k not in ("HF_HUB_OFFLINE", "TRANSFORMERS_OFFLINE")}
    env.update(HF_ENDPOINT=f"http://127.0.0.1:{free_port()}", HF_HOME=str(tmp_path / "hf"), OMP_NUM_THREADS="1")
    start = time.monotonic()
    gpt2 = tiny(init_from="gpt2", n_layer=None, n_head=None, n_embd=None)  # GPT-2 brings its shape
    result = subprocess.run([sys.executable, "train.py", *gpt2, *ONE_STEP,
                             f"--train_csv={trained / 'train.csv'}", f"--data_cache_dir={trained / 'cache'}",
                             f"--out_dir={tmp_path / 'out'}"], cwd=REPO, env=env, capture_output=True, text=True,
                            timeout=HANG)
    # 8 to 9 s on a quiet 2-core machine (imports, tokenizing, the Hub probe's 3 s); transformers' own retries would
    # take a minute or more: 45 s tells them apart on a loaded machine too (at least 3x the quiet figure)
    assert result.returncode == ERROR and time.monotonic() - start < 45
    line = error_line(result.stderr)
    assert "init_from=gpt2" in line and "http://127.0.0.1:" in line
    assert "--init_from=/kaggle/input/<folder>" in line and "--init_from=scratch" in line
