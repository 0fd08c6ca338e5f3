"""The machinery that train.py, evaluate.py, predict.py and export.py share. Ctrl-C while a script imports (torch
takes seconds) would end in a traceback of import machinery: this file, the package's first code to run, imports the
standard library alone, so a script calls until_imported before its other imports and imported after them."""
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
    """Ctrl-C raises KeyboardInterrupt again, which the script's one-line errors end."""
    if name == "__main__":
        signal.signal(signal.SIGINT, signal.default_int_handler)
