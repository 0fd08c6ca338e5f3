"""notebooks/kaggle_t4x2.ipynb runs end to end: its parameters cell swapped for a tiny CPU run of config/demo.py,
executed with nbclient in a python3 kernel of this interpreter, its training cell through torchrun with two
processes as on Kaggle's two T4s."""
import os

import nbformat
import pandas as pd
import pytest
from nbclient import NotebookClient

from conftest import HANG, REPO

NOTEBOOK = os.path.join(REPO, "notebooks", "kaggle_t4x2.ipynb")


def test_notebook_is_committed_without_outputs():
    nb = nbformat.read(NOTEBOOK, as_version=4)
    nbformat.validate(nb)
    code = [cell for cell in nb.cells if cell.cell_type == "code"]
    assert all(not cell.outputs and cell.execution_count is None for cell in code)
    assert [cell for cell in nb.cells if "parameters" in cell.metadata.get("tags", [])] == [code[0]]
    assert all(nb.cells[i - 1].cell_type == "markdown" for i, cell in enumerate(nb.cells) if cell in code), \
        "each step needs its line of explanation"


def test_the_parameters_cell_holds_the_competitions_data_paths():
    nb = nbformat.read(NOTEBOOK, as_version=4)
    (parameters,) = [cell for cell in nb.cells if "parameters" in cell.metadata.get("tags", [])]
    assert "\nTRAIN_CSV = " in parameters.source and "\nTEST_CSV = " in parameters.source
    assert "csv" not in parameters.source.split("OVERRIDES = ", 1)[1].partition("\n")[0]


@pytest.mark.slow
def test_notebook_runs_end_to_end(tmp_path, monkeypatch):
    nb = nbformat.read(NOTEBOOK, as_version=4)
    (parameters,) = [cell for cell in nb.cells if "parameters" in cell.metadata.get("tags", [])]
    overrides = ["--max_iters=4", "--eval_interval=4", "--rouge_samples=4", "--micro_batch_size=16",
                 "--max_new_tokens=8", "--evaluate_after=False", "--predict_after=False", "--log_to=tensorboard"]
    parameters.source = "\n".join([
        f"REPO_SOURCE = {REPO!r}",  # the copy-an-attached-folder path, as with a Kaggle dataset
        f"REPO_DIR = {str(tmp_path / 'repo')!r}",
        'PRESET = "config/demo.py"',
        f"TRAIN_CSV = {os.path.join(REPO, 'data', 'demo', 'train.csv')!r}",  # the data paths: here, not in OVERRIDES
        'TEST_CSV = ""',  # the preset's
        f"OVERRIDES = {overrides!r}",
        "NUM_PROCESSES = 2",
        f"EXPORT_DIR = {str(tmp_path / 'model')!r}",
        f"SUBMISSION = {str(tmp_path / 'submission.csv')!r}",
        "INSTALL = False",  # the test environment has requirements.txt installed; a test must not install
        'WHEELS = ""',
    ])
    monkeypatch.setenv("OMP_NUM_THREADS", "1")
    NotebookClient(nb, kernel_name="python3", timeout=HANG, resources={"metadata": {"path": str(tmp_path)}}).execute()

    out = tmp_path / "repo" / "out-demo"
    assert (out / "best.pt").is_file() and len(list((out / "tensorboard").iterdir())) == 1  # rank 0 only
    submission = pd.read_csv(tmp_path / "submission.csv", dtype=str, keep_default_na=False)
    sample = pd.read_csv(os.path.join(REPO, "data", "demo", "sample_submission.csv"), dtype=str)
    assert list(submission["id"]) == list(pd.read_csv(os.path.join(REPO, "data", "demo", "test.csv"), dtype=str)["id"])
    assert set(submission["id"]) == set(sample["id"])
    assert (tmp_path / "model" / "model.safetensors").is_file()
    outputs = [cell.outputs for cell in nb.cells if cell.cell_type == "code"]
    trained = "".join(o.get("text", "") for o in outputs[4])
    assert "over 2 process(es)" in trained and "Traceback" not in trained  # torchrun, two ranks
    # one progress bar updated in place ("\r"), not a line per refresh
    assert "\r" in trained and sum("training:" in line for line in trained.split("\n")) <= 3
    assert any(o.get("output_type") == "display_data" and "image/png" in o.get("data", {}) for o in outputs[5])
    assert "ROUGE F1 on 100 validation dialogues" in "".join(o.get("text", "") for o in outputs[6])
    shown = [o["data"]["text/html"] for o in outputs[7] if "text/html" in o.get("data", {})]  # the report, inline
    assert len(shown) == 1 and shown[0].startswith("<iframe srcdoc=") and "Evaluation report" in shown[0]
    assert "->" in "".join(o.get("text", "") for o in outputs[-1])
