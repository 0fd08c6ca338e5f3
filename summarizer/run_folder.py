"""The run folder (out_dir): the names of the files a run keeps there, the lock that gives the folder to one
training run at a time, moving an earlier run's files aside, the disk its checkpoints take, and what the commands
say about the folder when a file they need is not there."""
import contextlib
import datetime
import fcntl
import glob
import json
import os
import shutil
import socket
import sys
from dataclasses import dataclass

import torch

from command_line import UserError, repository_copy_hint
from summarizer.files import left_by_a_dead_process, nbytes

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
    """Create the folder and check that a file can be written there, before any work whose results would be lost.
    `reads`: the flag naming the checkpoint the command takes from out_dir, which another out_dir must then give."""
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


def remove_left_temp_files(folder):
    """Remove the temp files a process killed while saving left (a half-written checkpoint of gigabytes: Kaggle
    keeps 20 GB); a live process's are its own. The line that says what went, or None."""
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
    """Rank 0 makes out_dir and holds its lock (flock: a crashed run leaves none) until the body ends; a folder
    another run holds stops every rank before any write. A folder this run made goes if it failed empty."""
    created = not os.path.exists(out_dir)
    handle, problem = None, None
    if is_main:
        make(out_dir, reads)
        handle = lock(out_dir)
        if handle is None:
            problem = in_use(out_dir, training_in(out_dir) or describe_holder(None))  # None: it ended since
    failed = True
    try:
        stop_if(problem)
        yield
        failed = False
    finally:
        if handle:
            with contextlib.suppress(OSError):
                os.remove(os.path.join(out_dir, LOCK))  # while still holding it: see lock()
            handle.close()
            if created and failed:
                with contextlib.suppress(OSError):
                    os.rmdir(out_dir)  # only if empty


def in_use(out_dir, who):
    return (f"out_dir {out_dir} is in use by another training run ({who}): wait for it to end, or train into another "
            f"folder with --out_dir=...")


def lock(out_dir):
    """The open lock file of out_dir, flock'ed by this process and naming it, or None when another holds it. A
    file another run removed between our open and our flock is not the lock any more: open it again."""
    path = os.path.join(out_dir, LOCK)
    while True:
        handle = open(path, "a+")
        try:
            fcntl.flock(handle, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            handle.close()
            return None
        with contextlib.suppress(FileNotFoundError):
            if os.fstat(handle.fileno()).st_ino == os.stat(path).st_ino:
                break
        handle.close()
    handle.seek(0)
    handle.truncate()
    handle.write(json.dumps({"pid": os.getpid(), "host": socket.gethostname(),
                             "since": datetime.datetime.now().isoformat(timespec="seconds"),
                             "command": " ".join(sys.argv)}))
    handle.flush()
    return handle


def describe_holder(who):
    """'pid 123 on host h since 2026-11-25T10:00:00' from a lock file's contents."""
    try:
        return f"pid {who['pid']} on host {who['host']} since {who['since']}"
    except (KeyError, TypeError):
        return "its lock file names no holder"


def training_in(out_dir):
    """The holder of out_dir's lock when a training run other than this process holds it, else None: evaluate,
    predict and export then read the last complete save (saves replace files whole, never in place)."""
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
    """Move an earlier run's files into out_dir/previous-run-<its time>/, so a fresh run neither appends to its
    metrics nor overwrites its checkpoints; a line saying so, or None. Call it once every check has passed."""
    best = sorted(os.path.basename(p) for p in glob.glob(os.path.join(glob.escape(out_dir), "best-*.pt")))
    found, folder = move_aside(out_dir, [*RUN_FILES, *best], EARLIER_RUN)
    if not found:
        return None
    return (f"{out_dir} held an earlier run: moved its {', '.join(found)} to {folder} (continue a run with "
            f"--init_from=resume instead)")


def set_aside_other_output(out, record, names, prefix, made_by):
    """Move `names` of folder `out` into out/<prefix>-<time>/, saying so in one line, unless every key of `made_by`
    matches what the JSON file `record` among them says made them (no record: moved too)."""
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
    """`path + suffix`, or the first of path-2, path-3, ... (before the suffix) that does not exist."""
    candidate, n = path + suffix, 1
    while os.path.exists(candidate):
        n += 1
        candidate = f"{path}-{n}{suffix}"
    return candidate


def move_aside(out_dir, names, prefix):
    """Move those of `names` that exist in out_dir into out_dir/<prefix>-<time of the newest>/. Returns (the names
    moved, the folder), or ([], None)."""
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
    """Rename out_dir/best.pt, the best by `metric`, to best-<metric>.pt (best-<metric>-2.pt, ... if taken), so a
    run that now picks its best by another metric loses nothing. Returns the new path, or None without best.pt."""
    best = os.path.join(out_dir, BEST)
    if not os.path.exists(best):
        return None
    kept = free_path(os.path.join(out_dir, f"best-{metric}"), ".pt")
    os.replace(best, kept)
    return kept


def missing_file_hint(path, use):
    """The clause that ends a 'does not exist' line: where the file is found, and the flag `use` that takes it; ''
    where it is not. Relative paths resolve against the working folder, so a command run from another folder misses
    the repository's file; a fresh run moves an earlier run's into previous-run-*/ beside it (the newest is named)."""
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
    """A folder that keeps at most `gb` GB as output, whatever its filesystem's free space (Kaggle's
    /kaggle/working keeps 20 GB: what is beyond is lost at "Save Version", after the GPU hours are spent)."""
    folder: str
    gb: float

    @classmethod
    def of(cls, cfg):
        return cls(cfg.output_quota_dir, cfg.output_quota_gb)


def room(path, quota):
    """(bytes a write into `path` may take, what limits them): the free space of its filesystem or, for a path
    under the quota's folder where that is less, what the quota leaves after what the folder holds already."""
    free = free_bytes(path)
    if quota.folder and os.path.isdir(quota.folder) and os.path.commonpath(
            [os.path.realpath(quota.folder), os.path.realpath(path)]) == os.path.realpath(quota.folder):
        held = file_bytes(quota.folder)
        left = max(int(quota.gb * GB) - held, 0)
        if left < free:
            return left, f"left of the {quota.gb:g} GB output quota of {quota.folder} ({gb(held)} held there)"
    return free, "free on its filesystem"


def free_bytes(path):
    """Free bytes on the filesystem that holds `path` (or its nearest existing parent)."""
    path = os.path.abspath(path)
    while not os.path.exists(path):
        path = os.path.dirname(path)
    return shutil.disk_usage(path).free


def file_bytes(path):
    """Bytes of a file, or of everything under a folder; 0 for nothing."""
    if os.path.isfile(path):
        return os.path.getsize(path)
    return sum(os.path.getsize(os.path.join(root, name)) for root, _, names in os.walk(path) for name in names)


def gb(n):
    return f"{n / GB:.1f} GB" if n >= GB else f"{n / 1e6:.0f} MB"


def checkpoint_bytes(state):
    """Bytes of a checkpoint holding `state` (nested dicts and lists of tensors and plain values), rounded up."""
    return nbytes(tensors_in(state), ZIP_BYTES_PER_TENSOR) + ZIP_BYTES_FIXED


def tensors_in(obj):
    if isinstance(obj, torch.Tensor):
        yield obj
    elif isinstance(obj, (dict, list, tuple)):
        for value in obj.values() if isinstance(obj, dict) else obj:
            yield from tensors_in(value)


class DiskPlan:
    """The files a training run keeps in out_dir, sized from the model's real tensors: ckpt.pt (with small_lora the
    adapters alone, and AdamW's moments), best.pt, and a second copy of the larger one while a save replaces it (on
    the disk's free space: an output quota counts what the folder keeps, and an atomic save keeps one copy)."""

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
        """What out_dir holds between saves, all an output quota keeps: a save's second copy goes as it ends."""
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
        """'51 GB free on its filesystem', or what an output quota leaves: the room out_dir's checkpoints have."""
        left, limit = self.space
        return f"{gb(left)} {limit}"

    def problem(self, resuming):
        """None if out_dir's filesystem and output quota can take the run's peak, else the one line that says what
        to change. A resumed run replaces the ckpt.pt and best.pt there; a fresh one keeps them, moved aside."""
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
    """None if the (path, state) checkpoints can be written one after the other, each beside the file it replaces,
    within the free space, and what the folder keeps then within the output `quota`; else the line that says which
    cannot and what is kept."""
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
