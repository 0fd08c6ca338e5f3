"""The start of a distributed run: the ranks meet and run one collective within dist_start_timeout, else every rank
that started stops in one line naming what to change; for NCCL, the next setting to try (the user's own NCCL_*
variables win: only a setting they do not have is named)."""
import glob
import os
import subprocess
import sys

import pytest

from config import load_config
from conftest import HANG, REPO, free_port, run, tiny
from summarizer.backends import NCCL_SETTINGS, nccl_flags, nccl_in_effect, next_nccl_setting


@pytest.mark.parametrize("preset", sorted(glob.glob(os.path.join(REPO, "config", "kaggle_t4x2*.py"))),
                         ids=os.path.basename)
def test_a_kaggle_preset_starts_nccl_as_t4s_need_and_names_shared_memory_off_next(preset):
    """No peer-to-peer path and no cuMem host buffers (NCCL >= 2.24 fails its first collective with them on GPUs
    without peer access, NVIDIA/nccl#1838) from the start; should that fail, the line names the next setting."""
    flags = nccl_flags(load_config([preset]))
    assert flags == {"NCCL_P2P_DISABLE": "1", "NCCL_CUMEM_HOST_ENABLE": "0"}
    assert next_nccl_setting(flags) == {"NCCL_SHM_DISABLE": "1"}


@pytest.mark.parametrize("environ, expected", [
    ({"NCCL_P2P_DISABLE": "1"}, {"NCCL_CUMEM_HOST_ENABLE": "0"}),  # the Kaggle preset's: the cuMem host path next
    ({"NCCL_P2P_DISABLE": "1", "NCCL_CUMEM_HOST_ENABLE": "0"}, {"NCCL_SHM_DISABLE": "1"}),
    ({"NCCL_CUMEM_HOST_ENABLE": "1"}, {"NCCL_CUMEM_HOST_ENABLE": "0"}),  # the user's value is theirs: named, not set
    ({"NCCL_CUMEM_HOST_ENABLE": "0", "NCCL_SHM_DISABLE": "1"}, None),  # nothing left: the docs and the preflight
])
def test_the_next_nccl_setting_is_the_first_one_not_in_effect(environ, expected):
    assert next_nccl_setting(environ) == expected
    assert next_nccl_setting({}) == NCCL_SETTINGS[0]


def test_the_nccl_variables_in_effect_are_named():
    assert nccl_in_effect({"NCCL_P2P_DISABLE": "1", "PATH": "/bin"}) == "NCCL_P2P_DISABLE=1"
    assert nccl_in_effect({}) == "NCCL's defaults"


@pytest.mark.slow
@pytest.mark.parametrize("bound", ["--dist_start_timeout=5", "--dist_timeout=5"])
def test_a_rank_that_never_joins_ends_the_run_in_one_line_within_the_start_timeout(bound, write_csv, tmp_path):
    """Rank 0 of 2 starts alone (rank 1 never comes): with dist_start_timeout=5 (dist_timeout keeps its 30
    minutes), or a dist_timeout below the start's 120 s, it stops after about 5 s, before any work, in one line
    naming the setting that bounded the wait; without the bound it would wait 30 minutes."""
    env = dict(RANK="0", WORLD_SIZE="2", LOCAL_RANK="0", LOCAL_WORLD_SIZE="2", MASTER_ADDR="127.0.0.1",
               MASTER_PORT=str(free_port()))
    argv = [sys.executable, "train.py", *tiny(), f"--train_csv={write_csv('train.csv', 20)}",
            f"--out_dir={tmp_path / 'out'}", bound]
    try:
        result = run(argv, env=env, timeout=HANG)
    except subprocess.TimeoutExpired:
        pytest.fail("rank 0 waited past the start's timeout")
    lines = [line for line in result.stderr.splitlines() if line.strip()]
    assert result.returncode == 2 and len(lines) == 1, lines
    assert lines[0].startswith(f"error (rank 0): the 2 processes did not all start and meet within {bound[2:]} s (")
    assert "1/2" in lines[0] and not (tmp_path / "out" / "ckpt.pt").exists()
