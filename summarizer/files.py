"""The one way this project writes a file: a temp file beside it, fsync'd, renamed over it, so a crash or a full
disk never leaves a half-written file under the real name; a full disk's one line; a failed command's empty folders."""
import contextlib
import errno
import os
import re
import shutil

from command_line import UserError


class DiskFull(UserError):
    """No space left (or the quota used up): the user's to fix; what was saved is intact."""


def disk_full(path, error):
    """The one-line DiskFull an OSError from writing `path` is when the disk or quota is full, else None."""
    if error.errno not in (errno.ENOSPC, errno.EDQUOT, errno.EFBIG):
        return None
    folder = os.path.dirname(os.path.abspath(path))
    free = shutil.disk_usage(folder).free if os.path.isdir(folder) else 0
    return DiskFull(f"cannot write {path}: {error.strerror} ({free / 1e6:.0f} MB free in {folder})")


@contextlib.contextmanager
def atomic_write(path, mode="w"):
    """On any error the temp file goes and `path` keeps what it held. Text is UTF-8, newlines as written."""
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
    """The file an atomic_write temp `name` was to become, when its writer is gone (killed while saving);
    else None."""
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
    """If the body fails, remove those of `paths` it created that are still empty: no empty out_dir is left."""
    new = [path for path in paths if path and not os.path.exists(path)]
    try:
        yield
    except BaseException:
        for path in sorted(new, key=len, reverse=True):
            with contextlib.suppress(OSError):
                os.rmdir(path)
        raise


def nbytes(tensors, per_tensor=0):
    """Bytes of distinct tensors (a tied weight once), plus `per_tensor` for each (what a file adds to record one):
    the one count of tensor bytes, for the disk plan and the memory plan (here: below both)."""
    seen, total = set(), 0
    for t in tensors:
        key = (t.untyped_storage().data_ptr(), t.storage_offset(), t.nbytes) if t.device.type != "meta" else id(t)
        if key not in seen:
            seen.add(key)
            total += t.nbytes + per_tensor
    return total
