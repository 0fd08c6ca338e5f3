"""The run folder (out_dir): its file names, the lock that gives it to one training run at a time, an earlier run's
files moved aside, a killed save's temp files removed, the disk its checkpoints take, and the missing-file hints."""
import contextlib
import datetime
import fcntl
import glob
import json
import os
import re
import shutil
import socket
import sys
from dataclasses import dataclass

import torch
from torch.utils._pytree import tree_leaves

from command_line import UserError, repository_copy_hint

CKPT, BEST, CONFIG, METRICS, PLOT = "ckpt.pt", "best.pt", "config.json", "metrics.jsonl", "metrics.png"
EVAL_PREDICTIONS, EVAL_METRICS, EVAL_REPORT = "eval_predictions.csv", "eval_metrics.json", "eval_report.html"
SUBMISSION, SWEEP_CSV, SWEEP_MD = "submission.csv", "sweep.csv", "sweep.md"
SUBMISSION_RECORD = "submission.json"  # what made submission.csv: weights, test_csv, decoding (Kaggle's has no room)
ERROR_LOG = "error.log"  # the tracebacks of errors no handler names, each named by its one line
LOCK = ".lock"  # flock'ed by the training run that writes into the folder; holds who that is
EVAL_FILES = (EVAL_PREDICTIONS, EVAL_METRICS, EVAL_REPORT)
PREFLIGHT = "preflight_report.json"  # bench/preflight.py's report, beside the run it checked (not one of its files)
# What a training run (and evaluate.py/predict.py after it) writes; a fresh run moves an earlier run's aside.
RUN_FILES = (CKPT, BEST, CONFIG, METRICS, PLOT, *EVAL_FILES, SUBMISSION, SUBMISSION_RECORD, SWEEP_CSV, SWEEP_MD,
             ERROR_LOG, "tensorboard", "wandb")
EARLIER_RUN = "previous-run"  # the prefix of the folders earlier runs' files are moved into


def make(path, reads=None):
    """Create the folder and write a file there, before any work whose results would be lost."""
    try:
        os.makedirs(path, exist_ok=True)
        probe = os.path.join(path, f".write-test{os.getpid()}")
        open(probe, "w").close()
        os.remove(probe)
    except OSError as e:
        keep = f" and keep reading {reads.partition('=')[2]} with {reads}" if reads else ""
        raise UserError(f"out_dir {path} is not writable ({e.strerror}): choose another with --out_dir=<a writable "
                        f"folder>{keep}") from None
    if removed := remove_left_temp_files(path):
        print(removed)


def left_by_a_dead_process(name):
    """The file an atomic_write temp `name` was to become, when its writer is gone; else None."""
    if match := re.fullmatch(r"(.+)\.tmp(\d+)", name):
        try:
            os.kill(int(match[2]), 0)  # signal 0 only asks whether the process exists
        except ProcessLookupError:
            return match[1]
        except (PermissionError, OverflowError, ValueError):  # another user's process; a number no pid is
            pass
    return None


def remove_left_temp_files(folder):
    """The line that says which temp files a killed save left (a checkpoint's are gigabytes) were removed, or None."""
    removed, freed = [], 0
    for name in sorted(os.listdir(folder)):
        path = os.path.join(folder, name)
        if left_by_a_dead_process(name) in (*RUN_FILES, PREFLIGHT) and os.path.isfile(path):
            with contextlib.suppress(OSError):
                size = os.path.getsize(path)
                os.remove(path)
                removed.append(name)
                freed += size
    if not removed:
        return None
    return (f"removed {len(removed)} file(s) that a process killed while saving left in {folder}: "
            f"{', '.join(removed)} ({freed:,} bytes)")


@contextlib.contextmanager
def claimed(out_dir, is_main, stop_if, reads=None):
    """Rank 0 makes out_dir and flocks it until the body ends; a folder another run holds stops every rank."""
    handle, problem = None, None
    with no_empty_folder_left(out_dir if is_main else None):
        if is_main:
            make(out_dir, reads)
            if (handle := lock(out_dir)) is None:
                problem = in_use(out_dir, training_in(out_dir) or describe_holder(None))  # None: it ended since
        try:
            stop_if(problem)
            yield
        finally:
            if handle:
                with contextlib.suppress(OSError):
                    os.remove(os.path.join(out_dir, LOCK))  # while still holding it: see lock()
                handle.close()


@contextlib.contextmanager
def no_empty_folder_left(*paths):
    """If the body fails, those of `paths` it created that are still empty go."""
    new = [path for path in paths if path and not os.path.exists(path)]
    try:
        yield
    except BaseException:
        for path in sorted(new, key=len, reverse=True):
            with contextlib.suppress(OSError):
                os.rmdir(path)
        raise


def in_use(out_dir, who):
    return (f"out_dir {out_dir} is in use by another training run ({who}): wait for it to end, or train into another "
            f"folder with --out_dir=...")


def lock(out_dir):
    """The open lock file of out_dir, flock'ed by this process and naming it, or None when another holds it."""
    path = os.path.join(out_dir, LOCK)
    while True:
        handle = open(path, "a+")
        try:
            fcntl.flock(handle, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            handle.close()
            return None
        with contextlib.suppress(FileNotFoundError):  # a file removed between our open and flock is no lock
            if os.fstat(handle.fileno()).st_ino == os.stat(path).st_ino:
                break
        handle.close()
    handle.truncate(0)  # "a+" writes at the end, wherever the position
    handle.write(json.dumps({"pid": os.getpid(), "host": socket.gethostname(),
                             "since": datetime.datetime.now().isoformat(timespec="seconds"),
                             "command": " ".join(sys.argv)}))
    handle.flush()
    return handle


def describe_holder(who):  # a lock file's contents
    try:
        return f"pid {who['pid']} on host {who['host']} since {who['since']}"
    except (KeyError, TypeError):
        return "its lock file names no holder"


def training_in(out_dir):
    """Who holds out_dir's lock when a training run other than this process does, else None."""
    try:
        with open(os.path.join(out_dir, LOCK), encoding="utf-8") as f:
            with contextlib.suppress(BlockingIOError):
                fcntl.flock(f, fcntl.LOCK_SH | fcntl.LOCK_NB)
                return None
            who = json.loads(f.read() or "{}")
    except (OSError, ValueError):
        return None
    if isinstance(who, dict) and who.get("pid") == os.getpid():
        return None  # this process trains: evaluate_after and predict_after
    return describe_holder(who)


def set_aside_earlier_run(out_dir):
    """An earlier run's files moved into out_dir/previous-run-<its time>/ once every check passed: a line, or None."""
    best = sorted(os.path.basename(p) for p in glob.glob(os.path.join(glob.escape(out_dir), "best-*.pt")))
    found, folder = move_aside(out_dir, [*RUN_FILES, *best], EARLIER_RUN)
    if not found:
        return None
    return (f"{out_dir} held an earlier run: moved its {', '.join(found)} to {folder} (continue a run with "
            f"--init_from=resume instead)")


def set_aside_other_output(out, record, names, prefix, made_by):
    """Move `names` of `out` aside, saying so, unless the JSON `record` among them says `made_by` made them."""
    try:
        with open(os.path.join(out, record), encoding="utf-8") as f:
            made = dict(json.load(f))
    except (OSError, ValueError, TypeError):
        made = {}
    other = [key for key in made_by if made.get(key) != made_by[key]]
    found, folder = move_aside(out, list(names), prefix) if other else ([], None)
    if found:
        was = "; ".join(str(made.get(key, "unrecorded")) for key in other)
        print(f"{out} held the output of other {' and '.join(other)} ({was}): moved its {', '.join(found)} to {folder}")


def free_path(path, suffix=""):
    candidate, n = path + suffix, 1
    while os.path.exists(candidate):
        n += 1
        candidate = f"{path}-{n}{suffix}"
    return candidate


def move_aside(out_dir, names, prefix):
    """(those of `names` moved into out_dir/<prefix>-<time of the newest>/, the folder), or ([], None)."""
    if not (found := [name for name in names if os.path.exists(os.path.join(out_dir, name))]):
        return [], None
    newest = max(os.path.getmtime(os.path.join(out_dir, name)) for name in found)
    stamp = datetime.datetime.fromtimestamp(newest).strftime("%Y%m%d-%H%M%S")
    folder = free_path(os.path.join(out_dir, f"{prefix}-{stamp}"))
    os.makedirs(folder)
    for name in found:
        os.replace(os.path.join(out_dir, name), os.path.join(folder, name))
    return found, folder


def keep_best_of_metric(out_dir, metric):
    """best.pt moved to best-<metric>.pt (its path, or None): a run now best by another metric loses nothing."""
    best = os.path.join(out_dir, BEST)
    if not os.path.exists(best):
        return None
    kept = free_path(os.path.join(out_dir, f"best-{metric}"), ".pt")
    os.replace(best, kept)
    return kept


def missing_file_hint(path, use):
    """A 'does not exist' line's end: the repository's or an earlier run's copy and the flag `use` that takes it."""
    if repository := repository_copy_hint(path, use):
        return repository
    folder, name = os.path.split(os.path.abspath(path))
    earlier = max(glob.glob(os.path.join(glob.escape(folder), f"{EARLIER_RUN}-*", name)), key=os.path.getmtime,
                  default=None)
    if not earlier:
        return ""
    return f"; an earlier run's is {earlier} (a fresh run moved it there): use it with {use}={earlier}"


# ---- the disk a run's checkpoints take -------------------------------------------------------------------

GB = 1e9
ZIP_BYTES_PER_TENSOR = 1024  # torch.save's zip record, alignment and pickle per tensor, rounded up
ZIP_BYTES_FIXED = 2**20  # the rest of a checkpoint: config, RNG states, LR schedule
ROW_BYTES = 16  # the training rows' fingerprints in a checkpoint: two int64 hashes per row


@dataclass(frozen=True)
class Quota:
    """A folder that keeps at most `gb` GB, whatever its free space (/kaggle/working: 20 GB at "Save Version")."""
    folder: str
    gb: float

    @classmethod
    def of(cls, cfg):
        return cls(cfg.output_quota_dir, cfg.output_quota_gb)


def room(path, quota):
    """(bytes a write into `path` may take, what limits them: its filesystem or the quota)."""
    free = free_bytes(path)
    if quota.folder and os.path.isdir(quota.folder) and os.path.commonpath(
            [os.path.realpath(quota.folder), os.path.realpath(path)]) == os.path.realpath(quota.folder):
        held = file_bytes(quota.folder)
        left = max(int(quota.gb * GB) - held, 0)
        if left < free:
            return left, f"left of the {quota.gb:g} GB output quota of {quota.folder} ({gb(held)} held there)"
    return free, "free on its filesystem"


def free_bytes(path):
    path = os.path.abspath(path)
    while not os.path.exists(path):
        path = os.path.dirname(path)
    return shutil.disk_usage(path).free


def file_bytes(path):
    if os.path.isfile(path):
        return os.path.getsize(path)
    return sum(os.path.getsize(os.path.join(root, name)) for root, _, names in os.walk(path) for name in names)


def gb(n):
    return f"{n / GB:.1f} GB" if n >= GB else f"{n / 1e6:.0f} MB"


def nbytes(tensors, per_tensor=0):
    """Bytes of distinct tensors (a tied weight once), plus `per_tensor` each: the one count, memory's plan's too."""
    seen, total = set(), 0
    for t in tensors:
        key = (t.untyped_storage().data_ptr(), t.storage_offset(), t.nbytes) if t.device.type != "meta" else id(t)
        if key not in seen:
            seen.add(key)
            total += t.nbytes + per_tensor
    return total


def checkpoint_bytes(state):
    tensors = [leaf for leaf in tree_leaves(state) if isinstance(leaf, torch.Tensor)]
    return nbytes(tensors, ZIP_BYTES_PER_TENSOR) + ZIP_BYTES_FIXED


class DiskPlan:
    """ckpt.pt, best.pt and a save's second copy (which no output quota counts), sized from the model's tensors."""

    def __init__(self, model, cfg, small_lora=False, train_rows=0):
        params = dict(model.named_parameters())  # tied weights once
        trained = [p for p in params.values() if p.requires_grad]
        base = [p for name, p in params.items() if ".lora_" not in name]
        fixed = ZIP_BYTES_FIXED + ROW_BYTES * train_rows
        weights = sum(4 * p.numel() + ZIP_BYTES_PER_TENSOR for p in base)  # float32, as best.pt keeps a LoRA base
        self.best = weights + fixed
        kept = trained if small_lora else list(params.values())
        self.ckpt = nbytes(kept, ZIP_BYTES_PER_TENSOR) + 2 * nbytes(trained, ZIP_BYTES_PER_TENSOR) + fixed
        self.export = weights if cfg.export_dir else 0
        self.cfg = cfg
        self.space = room(cfg.out_dir, Quota.of(cfg))  # (bytes, what limits them): the quota's folder walked once

    @property
    def kept(self):
        """What out_dir holds between saves."""
        return self.ckpt + self.best + self.export

    @property
    def peak(self):
        return self.kept + max(self.ckpt, self.best)

    def describe(self):
        parts = [f"ckpt.pt {gb(self.ckpt)}", f"best.pt {gb(self.best)}",
                 f"{gb(max(self.ckpt, self.best))} while a save replaces one"]
        if self.export:
            parts.append(f"export {gb(self.export)}")
        return f"{gb(self.peak)} ({' + '.join(parts)})"

    def room(self):
        """'51 GB free on its filesystem', or what an output quota leaves."""
        left, limit = self.space
        return f"{gb(left)} {limit}"

    def problem(self, resuming):
        """None, or the line that says what to change (a resumed run replaces ckpt.pt and best.pt, a fresh one not)."""
        out_dir = self.cfg.out_dir
        here = sum(file_bytes(os.path.join(out_dir, name)) for name in (CKPT, BEST)) if resuming else 0
        (free, limit), disk = self.space, free_bytes(out_dir)
        if self.peak - here <= disk and self.kept - here <= free:
            return None
        over_quota = self.kept - here > free
        name = os.path.basename(os.path.abspath(out_dir))
        fixes = [f"train into a larger folder (e.g. --out_dir=/kaggle/temp/{name}, not kept after the session)"]
        earlier = [f"{p} ({gb(file_bytes(p))})"
                   for p in sorted(glob.glob(os.path.join(glob.escape(out_dir), f"{EARLIER_RUN}-*")))]
        if not resuming and any(os.path.exists(os.path.join(out_dir, n)) for n in (CKPT, BEST)):
            earlier.append(f"{out_dir}/{CKPT} and {BEST} (this fresh run would keep them in {EARLIER_RUN}-<time>/)")
        if earlier:
            fixes.append("delete earlier runs kept there: " + ", ".join(earlier))
        if not self.cfg.lora_rank:
            fixes.append("fine-tune LoRA adapters (--lora_rank=8: ckpt.pt holds only the adapters)")
        short, room = ((self.kept - here - free, f"{gb(free)} {limit}: it keeps {gb(self.kept)}") if over_quota else
                       (self.peak - here - disk, f"{gb(disk)} free on its filesystem: its peak is {self.describe()}"))
        return f"out_dir {out_dir} needs {gb(short)} more than the {room}: " + "; or ".join(fixes)


GO_ON = ("free some space and continue (--init_from=resume), or continue in a larger folder (--resume_from=<the "
         "ckpt.pt> --out_dir=...)")  # what a run that met a full disk does next


def save_problem(writes, iter_num, quota):
    """None if the (path, state) checkpoints fit, each written beside the file it replaces; else the one line."""
    (free, limit), disk = room(writes[0][0], quota), free_bytes(writes[0][0])
    for path, state in writes:
        need = checkpoint_bytes(state)
        if need > disk or need - file_bytes(path) > free:
            free, limit = (disk, "free on its filesystem") if need > disk else (free, limit)
            folder = os.path.dirname(os.path.abspath(path))
            kept = [name for name in (CKPT, BEST) if os.path.exists(os.path.join(folder, name))]
            return (f"cannot save {path} at iter {iter_num}: it needs {gb(need)} and {gb(free)} is {limit}; "
                    f"{' and '.join(kept) + ' kept as they were' if kept else 'nothing was written'}: {GO_ON}")
        disk, free = disk - need + file_bytes(path), free - need + file_bytes(path)  # the old file goes
    return None
