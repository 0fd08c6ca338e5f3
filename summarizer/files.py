"""The one way this project writes a file: into a temp file next to it, fsync'd, then renamed over it, so a crash
or a full disk never leaves a half-written file under the real name (and a temp file a killed process left is told
by its name); and a failed command's empty folders."""
import contextlib
import errno
import os
import re
import shutil

from summarizer.errors import DiskFull


def disk_full(path, error):
    """The DiskFull that an OSError from writing `path` is when the disk is full (a quota, a file size limit): one
    line that names the file and the space left, instead of a traceback; None for another error."""
    if error.errno not in (errno.ENOSPC, errno.EDQUOT, errno.EFBIG):
        return None
    folder = os.path.dirname(os.path.abspath(path))
    free = shutil.disk_usage(folder).free if os.path.isdir(folder) else 0
    return DiskFull(f"cannot write {path}: {error.strerror} ({free / 1e6:.0f} MB free in {folder})")


@contextlib.contextmanager
def atomic_write(path, mode="w"):
    """`with atomic_write(path) as f:` writes f to `path` atomically; on any error the temp file is removed and
    `path` keeps what it held. Text mode is UTF-8 with newlines written as given (CSV writers pick their own)."""
    tmp = f"{path}.tmp{os.getpid()}"  # the writer's pid: see left_by_a_dead_process
    text = {} if "b" in mode else {"encoding": "utf-8", "newline": ""}
    try:
        with open(tmp, mode, **text) as f:
            yield f
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
    except BaseException as e:
        with contextlib.suppress(OSError):
            os.remove(tmp)
        if full := isinstance(e, OSError) and disk_full(path, e):
            raise full from None
        raise


def left_by_a_dead_process(name):
    """The file an atomic_write temp file named `name` was to become, when the process that wrote it is gone (killed
    while saving: nothing will rename or remove it); None for any other name, or a live process's temp file."""
    if not (match := re.fullmatch(r"(.+)\.tmp(\d+)", name)):
        return None
    try:
        os.kill(int(match[2]), 0)  # signal 0 only asks whether the process exists
    except ProcessLookupError:
        return match[1]
    except (PermissionError, OverflowError, ValueError):  # another user's process; a number no pid is
        return None
    return None


@contextlib.contextmanager
def no_empty_folder_left(*paths):
    """Run the body; if it fails, remove those of `paths` (deepest first) that did not exist before and are empty
    now, so a failed command leaves no empty out_dir behind. A folder with anything in it is never removed."""
    new = [path for path in paths if path and not os.path.exists(path)]
    try:
        yield
    except BaseException:
        for path in sorted(new, key=len, reverse=True):
            with contextlib.suppress(OSError):
                os.rmdir(path)
        raise
