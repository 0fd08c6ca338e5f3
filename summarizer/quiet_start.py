"""Ctrl-C while a command starts: its imports take seconds (torch), and a KeyboardInterrupt inside them would end
in a traceback of import machinery. This module imports only the standard library, so a script imports it first."""
import os
import signal
import sys


def interrupted(signum, frame):
    print("interrupted", file=sys.stderr, flush=True)
    os._exit(128 + signum)  # inside an import, nothing is written yet that an exit could leave half done


def until_imported(name):
    """From a script's first import (its module `name` is __main__) to imported(): Ctrl-C ends it in one line."""
    if name == "__main__":
        signal.signal(signal.SIGINT, interrupted)


def imported(name):
    """The script's imports are done: Ctrl-C raises KeyboardInterrupt again, which its one-line errors end."""
    if name == "__main__":
        signal.signal(signal.SIGINT, signal.default_int_handler)
