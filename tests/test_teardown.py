"""A finished multi-process run exits: a teardown that hangs anyway ends in one line, and many short runs in a row
all exit. The cause, that nothing holds the process group when it is destroyed (the order that cannot deadlock,
summarizer/backends.py's part), is checked on every backend by the launcher-parity runs of tests/test_train.py, each
through the probe tests/teardown_probe.py."""
import concurrent.futures
import subprocess

import pytest

from conftest import HANG, ONE_STEP, TINY, run, save_csv, synthetic_rows, torchrun

TWO = ("--nproc_per_node=2", "--standalone")
TEARDOWN_WARNING = "the process group's teardown did not end within"


@pytest.fixture(scope="module")
def csvs(tmp_path_factory):
    folder = tmp_path_factory.mktemp("teardown")
    return (save_csv(folder / "train.csv", synthetic_rows(40, seed=1)),
            save_csv(folder / "test.csv", synthetic_rows(6, seed=2), test=True))


def args(csvs, out, *more):
    return [*TINY, *ONE_STEP, f"--train_csv={csvs[0]}", f"--test_csv={csvs[1]}", f"--out_dir={out}",
            f"--data_cache_dir={out.parent / 'cache'}", "--micro_batch_size=2", *more]


@pytest.mark.slow
def test_a_teardown_that_hangs_ends_in_one_line_with_the_outputs_complete(csvs, tmp_path):
    out = tmp_path / "out"
    result = run(torchrun(*TWO, "tests/teardown_probe.py", "--hang", "train.py", *args(csvs, out)))
    # the first rank to end makes torchrun stop the other, whose watchdog may not have spoken yet
    warnings = [line for line in result.stderr.splitlines() if TEARDOWN_WARNING in line]
    assert warnings and set(warnings) <= {f"warning (rank {rank}): the process group's teardown did not end within 2 "
                                          f"s of the ranks' last collective; the outputs are complete: ending the "
                                          f"process" for rank in (0, 1)}, result.stderr[-3000:]
    assert len(set(warnings)) == len(warnings)
    assert (out / "ckpt.pt").is_file() and (out / "best.pt").is_file()


# The cause (a holder of the group at its teardown) is checked on every backend by the launcher-parity runs, each
# time; this one shows the consequence under the suite's own load, in two pairs of runs (ten were a minute of CI).
RUNS = 4


@pytest.mark.slow
@pytest.mark.minutes
def test_many_two_process_runs_in_parallel_pairs_all_exit(csvs, tmp_path):
    """The suite's kind of torchrun job, started RUNS times two at a time: every one exits 0 on its own, its teardown
    within the bound (no watchdog line). Without the teardown order, some hang forever after their last line
    (the watchdog, or here HANG, ends them)."""
    def one(i):
        command = torchrun(*TWO, "train.py", *args(csvs, tmp_path / f"run{i}"))
        try:
            result = run(command)
        except subprocess.TimeoutExpired:
            return f"run {i}: still alive after {HANG} s"
        if result.returncode or TEARDOWN_WARNING in result.stderr:
            return f"run {i}: exit {result.returncode}: {result.stderr[-1000:]}"
        return None

    with concurrent.futures.ThreadPoolExecutor(2) as pool:
        failures = [f for f in pool.map(one, range(RUNS)) if f]
    assert not failures, f"{len(failures)} of {RUNS}:\n" + "\n".join(failures)
