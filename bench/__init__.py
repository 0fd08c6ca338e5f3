"""Benchmarks (python -m bench) and the GPU check (bash bench/gpu_check.sh)."""
import os

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
SAMSUM_CSV = os.path.join(ROOT, "..", "shared", "data", "samsum-validation.csv")  # --samsum_csv's default


def child_environ(environ=None, **extra):
    """The environment of a child process that runs this repository's code: the caller's (os.environ), ROOT put
    first on its PYTHONPATH, never replacing it (a package found through it must stay found), and `extra`."""
    environ = dict(os.environ if environ is None else environ)
    path = environ.get("PYTHONPATH")
    return {**environ, "PYTHONPATH": ROOT + (os.pathsep + path if path else ""), **extra}
