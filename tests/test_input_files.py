"""The files train.py is given as CSVs (issues 37, 56): a file that is not a CSV (JSON, Parquet, Excel, an archive
of several files...) is one line saying what its first bytes mean and how to make a CSV of it (the package that
needs, where it is missing; a CSV name no file has); a compressed CSV (gzip, a zip of one CSV) is read as the CSV
inside; validation rows that repeat training rows (evaluate.py's rule: same dialogue, or same id), ids on more than
one row and fewer rows than a batch are noted at start-up."""
import gzip
import importlib.util
import io
import json
import re
import types
import zipfile

import pandas as pd
import pytest

import data
import train
from config import load_config
from conftest import ONE_STEP, TINY, one_error_line, save_csv, synthetic_rows
from summarizer import preparation

ROWS = synthetic_rows(7, seed=2)  # 6 training rows and 1 held out
CSV = pd.DataFrame(ROWS).to_csv(index=False).encode()


def zipped(members, method=zipfile.ZIP_DEFLATED):
    buffer = io.BytesIO()
    with zipfile.ZipFile(buffer, "w", method) as archive:
        for name, content in members.items():
            archive.writestr(name, content)
    return buffer.getvalue()


def train_args(tmp_path, csv, *extra):
    return [*TINY, *ONE_STEP, f"--train_csv={csv}", f"--data_cache_dir={tmp_path / 'cache'}",
            f"--out_dir={tmp_path / 'out'}", *extra]


def write(tmp_path, name, content):
    path = tmp_path / name
    path.write_bytes(content)
    return str(path)


# ---- 1. what is not a CSV is one line; a compressed CSV is read -------------------------------------------------

NOT_CSVS = [
    ("train.zip", zipped({"train.csv": CSV, "test.csv": CSV}),
     r"is a zip archive of 2 files \(train\.csv, test\.csv\), not a CSV: unzip it \(unzip -d \S+ \S+train\.zip\)"),
    ("train.json", json.dumps(ROWS).encode(),
     r"is JSON, not a CSV: convert it: python -c \"import pandas; pandas\.read_json\('\S+train\.json'\)\.to_csv\("
     r"'\S+train\.csv', index=False\)\", then pass --train_csv=\S+train\.csv"),
    ("train.jsonl", "\n".join(map(json.dumps, ROWS)).encode(), r"is JSON, not a CSV: .*lines=True for one record"),
    ("train.parquet", b"PAR1" + bytes(64) + b"PAR1",
     r"is a Parquet file, not a CSV: (pip install pyarrow, then )?convert it: python -c \"import pandas; "
     r"pandas\.read_parquet"),
    ("train.xlsx", zipped({"[Content_Types].xml": "<Types/>", "xl/workbook.xml": "<workbook/>"}),
     r"is an Excel workbook \(\.xlsx\), not a CSV: (pip install openpyxl, then )?convert it: python -c "
     r"\"import pandas; pandas\.read_excel"),
    ("train.csv", b"<!DOCTYPE html>\n<html><body>Sign in</body></html>",
     r"is not a CSV of rows: its first line '<!DOCTYPE html>' reads as one column: pass --train_csv=<a CSV with a "
     r"header row, e.g. id,dialogue,summary>$"),
    ("train.csv", b"\x89PNG\r\n\x1a\n" + bytes(8) + b"IHDR",
     r"is binary data, not a CSV: it starts with bytes 89 50 4e 47 0d 0a 1a 0a \(\.PNG\.\.\.\.\); save its rows as a "
     r"CSV with a header row and pass --train_csv=<it>$"),
    ("train.json.gz", gzip.compress(json.dumps(ROWS).encode()),
     r"is a gzip-compressed file holding JSON, not a CSV: convert it: python -c \"import pandas; "
     r"pandas\.read_json\('\S+train\.json\.gz'\)\.to_csv\('\S+train\.csv'"),
    ("train.csv.gz", gzip.compress(CSV)[:-8],
     r"is a compressed file that cannot be unpacked \(.+\): unpack it yourself"),
    ("train.tar.gz", gzip.compress(b"train.csv".ljust(257, b"\0") + b"ustar" + bytes(250)),
     r"is a gzip-compressed file holding binary data, not a CSV: it starts with bytes 74 72 61 69 6e 2e 63 73"),
]


@pytest.mark.parametrize("name, content, pattern", NOT_CSVS, ids=[f"{name}: {p[3:20]}" for name, _, p in NOT_CSVS])
def test_a_file_that_is_not_a_csv_is_one_line_saying_what_it_is(name, content, pattern, tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)  # where a conversion hint's CSV goes
    path = write(tmp_path, name, content)
    with pytest.raises(data.UserError) as info:
        data.read_table(path, "train_csv", load_config([f"--train_csv={path}"]))
    message = str(info.value)
    assert "\n" not in message and message.startswith(f"train_csv {path} ") and re.search(pattern, message), message


@pytest.mark.parametrize("magic, what, hint, package", data.NOT_CSV, ids=[kind[1] for kind in data.NOT_CSV])
def test_every_kind_the_table_of_first_bytes_names_is_one_line(magic, what, hint, package, tmp_path):
    path = write(tmp_path, "train.csv", b"\n " + magic + b"id,dialogue,summary\n1,a,b\n")  # blank space first
    with pytest.raises(data.UserError) as info:
        data.read_table(path, "train_csv", load_config([]))
    assert str(info.value).startswith(f"train_csv {path} is {what}, not a CSV: ") and "\n" not in str(info.value)


@pytest.mark.parametrize("name, content, package", [
    ("train.xlsx", zipped({"[Content_Types].xml": "<Types/>", "xl/workbook.xml": "<workbook/>"}), "openpyxl"),
    ("train.parquet", b"PAR1" + bytes(64) + b"PAR1", "pyarrow")])
@pytest.mark.parametrize("installed", [False, True])
def test_a_conversion_hint_names_the_package_it_needs_where_missing_and_a_free_csv_name(name, content, package,
                                                                                       installed, tmp_path,
                                                                                       monkeypatch):
    """The hint's CSV goes to the working folder (the input's may be read-only, as /kaggle/input is), under a name
    no file has there (train.csv is another file), so following it overwrites nothing."""
    real = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec",
                        lambda module, *rest: (real("json") if installed else None) if module == package
                        else real(module, *rest))
    (tmp_path / "input").mkdir()
    path, sibling = write(tmp_path / "input", name, content), write(tmp_path, "train.csv", CSV)
    monkeypatch.chdir(tmp_path)
    with pytest.raises(data.UserError) as info:
        data.read_table(path, "train_csv", load_config([]))
    message = str(info.value)
    assert (f"not a CSV: pip install {package}, then convert it" in message) == (not installed), message
    assert f".to_csv({str(tmp_path / 'train-2.csv')!r}, index=False)" in message and sibling not in message


COMPRESSED = {
    "train.csv.gz": gzip.compress(CSV),
    "train.zip": zipped({"train.csv": CSV, "__MACOSX/._train.csv": b"\0"}),
    "stored.zip": zipped({"train.csv": CSV}, zipfile.ZIP_STORED),  # was read as text: ids lost, no error
    "zip-named.csv": zipped({"data/train.csv": CSV}),
    "gzip-named.csv": gzip.compress(CSV),
    "utf16.csv": CSV.decode().encode("utf-16"),  # Excel's "Unicode text", with a BOM
}


@pytest.mark.parametrize("name", COMPRESSED)
def test_a_compressed_csv_reads_as_the_csv_inside(name, tmp_path):
    plain = data.read_table(write(tmp_path, "plain.csv", CSV), "train_csv", load_config([]))
    table = data.read_table(write(tmp_path, name, COMPRESSED[name]), "train_csv", load_config([]))
    assert (table.ids, table.dialogues, table.summaries) == (plain.ids, plain.dialogues, plain.summaries)
    if name != "utf16.csv":
        assert table.digest == plain.digest  # the CSV's bytes: its token cache and checkpoint fingerprints alike


def test_train_py_names_a_zip_of_several_csvs_and_trains_on_a_zip_of_one(tmp_path, capsys):
    several = write(tmp_path, "data.zip", zipped({"train.csv": CSV, "validation.csv": CSV}))
    line = one_error_line(capsys, train.main, train_args(tmp_path, several))
    assert re.search(r"^error: train_csv \S+data\.zip is a zip archive of 2 files \(train\.csv, validation\.csv\), "
                     r"not a CSV: unzip it \(unzip -d \S+ \S+data\.zip\) and pass the \.csv you mean as "
                     r"--train_csv=<it>$", line), line
    json_file = write(tmp_path, "train.json", json.dumps(ROWS).encode())
    assert "is JSON, not a CSV" in one_error_line(capsys, train.main, train_args(tmp_path, json_file))
    train.main(train_args(tmp_path, write(tmp_path, "one.zip", zipped({"train.csv": CSV}, zipfile.ZIP_STORED))))
    assert re.search(r"^6 training and 1 validation examples", capsys.readouterr().out, re.MULTILINE)


# ---- 2. validation rows that repeat training rows --------------------------------------------------------------

def start_up_notes(tmp_path, capsys, csv, *extra):
    """The lines train.py prints that start with `note:`, and the line that counts the examples."""
    capsys.readouterr()
    train.main(train_args(tmp_path, csv, *extra))
    lines = capsys.readouterr().out.splitlines()
    return ([line for line in lines if line.startswith("note:")],
            next(line for line in lines if re.match(r"\d+ training and \d+ validation examples", line)))


def test_validation_csv_that_is_the_training_csv_is_noted(tmp_path, capsys):
    csv = save_csv(tmp_path / "train.csv", ROWS)
    notes, _ = start_up_notes(tmp_path, capsys, csv, f"--validation_csv={csv}")
    assert len(notes) == 1 and notes[0].startswith(
        "note: 7 of 7 validation rows repeat training rows (same dialogue or id, e.g. id d2-0): validation loss and "
        f"ROUGE will be inflated; validation_csv is train_csv ({csv}): pass a CSV the run does not train on"), notes
    assert start_up_notes(tmp_path, capsys, csv)[0] == []  # its own hold-out split: disjoint


def test_repeated_rows_the_split_puts_on_both_sides_are_noted(tmp_path, capsys):
    twice = save_csv(tmp_path / "twice.csv", ROWS + [{**row, "id": f"copy-{row['id']}"} for row in ROWS])
    notes, _ = start_up_notes(tmp_path, capsys, twice)  # 13 training rows, 1 held out: its copy is in training
    assert len(notes) == 1 and re.match(
        r"note: 1 of 1 validation rows repeat training rows \(same dialogue or id, e.g. id \S+\): validation loss "
        r"and ROUGE will be inflated; train_csv \S+twice\.csv has repeated rows .*hold-out split", notes[0]), notes


def test_the_note_counts_as_evaluate_does(tmp_path):
    """Same dialogue (whitespace aside) or same id, where both CSVs have ids; the run's own split is disjoint."""
    csv = save_csv(tmp_path / "train.csv", synthetic_rows(10, seed=0))
    other = synthetic_rows(4, seed=5)
    other[0]["dialogue"] = "  " + synthetic_rows(10, seed=0)[3]["dialogue"].replace(" ", "  ")
    other[1]["id"] = "d0-7"
    val = save_csv(tmp_path / "val.csv", other)
    proc = types.SimpleNamespace(is_main=True, barrier=data.no_op)
    splits, _ = preparation.read_inputs(load_config([f"--train_csv={csv}", f"--validation_csv={val}",
                                            f"--data_cache_dir={tmp_path / 'cache'}"]), proc)
    assert data.repeated_rows(splits.val, splits.train.fingerprints()).tolist() == [True, True, False, False]
    assert [note for note in splits.notes if "2 of 4 validation rows repeat training rows" in note
            and f"validation_csv {val} shares rows with train_csv {csv}" in note]
    pd.DataFrame([{"dialogue": r["dialogue"], "summary": r["summary"]} for r in other[1:]]).to_csv(val, index=False)
    splits, _ = preparation.read_inputs(load_config([f"--train_csv={csv}", f"--validation_csv={val}",
                                            f"--data_cache_dir={tmp_path / 'cache'}"]), proc)
    assert not [note for note in splits.notes if "repeat" in note]  # ids count only where both CSVs have them


# ---- 3. ids on more than one row ---------------------------------------------------------------------------------

def test_duplicate_ids_are_noted_and_every_row_is_kept(tmp_path, capsys):
    rows = [{**row, "id": "13728094" if i in (1, 3) else "42" if i in (2, 5) else row["id"]}
            for i, row in enumerate(synthetic_rows(20, seed=3))]
    csv = save_csv(tmp_path / "train.csv", rows)
    notes, examples = start_up_notes(tmp_path, capsys, csv)
    assert notes[0] == (f"note: train_csv {csv} has 2 duplicate id(s) (e.g. id 13728094, on 2 rows): every row is "
                        f"kept, since ids only identify rows (a validation row that shares its id with a training "
                        f"row counts as a repeat of it)"), notes
    assert examples.startswith("19 training and 1 validation examples")
    assert start_up_notes(tmp_path, capsys, save_csv(tmp_path / "unique.csv", synthetic_rows(20, seed=3)))[0] == []


def test_rows_with_no_id_are_named_alike_in_training_and_test_data(tmp_path, capsys):
    """By the line of the file each row starts on (every dialogue here spans 3); in training data they are kept and
    are no id's duplicates or repeats, in test data they stop the command."""
    rows = [{**row, "id": "" if i in (1, 3) else row["id"]} for i, row in enumerate(synthetic_rows(20, seed=3))]
    csv = save_csv(tmp_path / "train.csv", rows)
    no_id = [{**row, "id": ""} for row in synthetic_rows(2, seed=4)]
    notes, examples = start_up_notes(tmp_path, capsys, csv, f"--validation_csv={save_csv(tmp_path / 'val.csv', no_id)}")
    assert notes[0] == (f"note: train_csv {csv} has 2 row(s) with no id (line 5, 11): every row is kept, since ids "
                        f"only identify rows"), notes
    assert not [note for note in notes if "duplicate" in note or "repeat training rows" in note], notes
    assert examples.startswith("20 training and 2 validation examples")
    test = save_csv(tmp_path / "test.csv", rows, test=True)
    with pytest.raises(data.UserError, match=re.escape(f"test_csv {test} has 2 row(s) with no id (line 5, 11): each "
                                                       f"row needs its id")):
        data.read_test(load_config([f"--test_csv={test}"]))


@pytest.mark.parametrize("column", ["dialogue", "id"])
def test_a_summary_column_that_is_the_dialogue_or_id_column_is_one_line(column, tmp_path, capsys):
    """The model would learn to copy the dialogue, or to write the id."""
    csv = save_csv(tmp_path / "train.csv", ROWS)
    err = one_error_line(capsys, train.main, train_args(tmp_path, csv, f"--summary_column={column}"))
    assert f"the summary column '{column}' is also the {column} column: pass --summary_column=" in err
    assert not (tmp_path / "out" / "ckpt.pt").exists()


def test_fewer_training_rows_than_a_batch_are_noted(tmp_path):
    """A 5-row train_csv at batch_size=16: every step repeats rows, which a note says (the run goes on)."""
    cfg = load_config([f"--train_csv={save_csv(tmp_path / 'train.csv', synthetic_rows(5, seed=0))}",
                       f"--validation_csv={save_csv(tmp_path / 'val.csv', synthetic_rows(2, seed=1))}",
                       "--batch_size=16", f"--data_cache_dir={tmp_path / 'cache'}"])
    splits, _ = preparation.read_inputs(cfg, types.SimpleNamespace(is_main=True, barrier=data.no_op))
    assert splits.notes == ["note: 5 training rows for batch_size=16: each step trains on some rows more than once; "
                            "lower batch_size or bring more rows"]
