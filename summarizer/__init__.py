"""The machinery the scripts share. A script calls until_imported first (this file imports the standard library
alone) and imported after its imports: Ctrl-C during seconds of torch's import is one line, no traceback."""
import os
import signal
import sys


def interrupted(signum, frame):
    print("interrupted", file=sys.stderr, flush=True)
    os._exit(128 + signum)  # inside an import, nothing is written yet that an exit could leave half done


def until_imported(name):
    if name == "__main__":
        signal.signal(signal.SIGINT, interrupted)


def imported(name):
    if name == "__main__":
        signal.signal(signal.SIGINT, signal.default_int_handler)
