"""What a session allows a run (Kaggle: 20 GB kept in /kaggle/working, about 12 hours), planned before the first
step and checked as it goes: the disk its checkpoints take in out_dir at their peak, and the time left to finish
cleanly under max_time."""
import collections
import glob
import os
import shutil
import time

import torch

from config import parse_duration

GB = 1e9
ZIP_BYTES_PER_TENSOR = 1024  # torch.save's zip record, alignment and pickle per tensor, rounded up
ZIP_BYTES_FIXED = 2**20  # the rest of a checkpoint: config, RNG states, LR schedule
ROW_BYTES = 16  # the training rows' fingerprints in a checkpoint: two int64 hashes per row


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


def tensors_bytes(tensors):
    """Bytes of distinct tensors (tied weights count once), as a checkpoint stores them."""
    seen, total = set(), 0
    for t in tensors:
        key = (t.untyped_storage().data_ptr(), t.storage_offset(), t.nbytes) if t.device.type != "meta" else id(t)
        if key not in seen:
            seen.add(key)
            total += t.nbytes + ZIP_BYTES_PER_TENSOR
    return total


class DiskPlan:
    """The files a training run keeps in out_dir, sized from the model's real tensors: ckpt.pt (the trained
    weights, of a LoRA run with small_lora only its adapters, and AdamW's two moments of each), best.pt (the
    merged weights), both with the train_rows' fingerprints, and the second copy of the larger one while an
    atomic save replaces it; plus the export when export_dir is set."""

    def __init__(self, model, cfg, small_lora=False, train_rows=0):
        params = dict(model.named_parameters())  # tied weights once
        trained = [p for p in params.values() if p.requires_grad]
        base = [p for name, p in params.items() if ".lora_" not in name]
        fixed = ZIP_BYTES_FIXED + ROW_BYTES * train_rows
        self.best = tensors_bytes(base) + fixed
        kept = trained if small_lora else list(params.values())
        self.ckpt = tensors_bytes(kept) + 2 * tensors_bytes(trained) + fixed
        self.export = tensors_bytes(base) if cfg.export_dir else 0
        self.cfg = cfg

    @property
    def peak(self):
        return self.ckpt + self.best + max(self.ckpt, self.best) + self.export

    def describe(self):
        parts = [f"ckpt.pt {gb(self.ckpt)}", f"best.pt {gb(self.best)}",
                 f"{gb(max(self.ckpt, self.best))} while a save replaces one"]
        if self.export:
            parts.append(f"export {gb(self.export)}")
        return f"{gb(self.peak)} ({' + '.join(parts)})"

    def problem(self):
        """None if out_dir's filesystem can take the run's peak, else the one line that says what to change."""
        out_dir = self.cfg.out_dir
        here = sum(file_bytes(os.path.join(out_dir, name)) for name in ("ckpt.pt", "best.pt"))
        need, free = self.peak - here, free_bytes(out_dir)
        if need <= free:
            return None
        name = os.path.basename(os.path.abspath(out_dir))
        fixes = [f"train into a larger folder (e.g. --out_dir=/kaggle/temp/{name}, not kept after the session)"]
        earlier = sorted(glob.glob(os.path.join(glob.escape(out_dir), "previous-run-*")))
        if earlier:
            fixes.append("delete earlier runs kept there: " + ", ".join(f"{p} ({gb(file_bytes(p))})" for p in earlier))
        if not self.cfg.lora_rank:
            fixes.append("fine-tune LoRA adapters (--lora_rank=8: ckpt.pt holds only the adapters)")
        return (f"out_dir {out_dir} needs {gb(need)} more at its peak, {self.describe()}, and its filesystem has "
                f"{gb(free)} free: " + "; or ".join(fixes))


def state_bytes(state):
    """Bytes of a checkpoint holding `state` (nested dicts and lists of tensors and plain values), rounded up."""
    tensors = []

    def collect(obj):
        if isinstance(obj, torch.Tensor):
            tensors.append(obj)
        elif isinstance(obj, dict):
            for value in obj.values():
                collect(value)
        elif isinstance(obj, (list, tuple)):
            for value in obj:
                collect(value)
    collect(state)
    return tensors_bytes(tensors) + ZIP_BYTES_FIXED


def save_problem(writes, iter_num):
    """None if the (path, state) checkpoints can be written one after the other, each beside the file it replaces
    until it is complete; else the line that says which cannot and what is kept. Nothing is written or removed."""
    free = free_bytes(writes[0][0])
    for path, state in writes:
        need = state_bytes(state)
        if need > free:
            folder = os.path.dirname(os.path.abspath(path))
            kept = [name for name in ("ckpt.pt", "best.pt") if os.path.exists(os.path.join(folder, name))]
            return (f"cannot save {path} at iter {iter_num}: it needs {gb(need)} and {gb(free)} is free there; "
                    f"{' and '.join(kept) + ' kept as they were' if kept else 'nothing was written'}: free some space "
                    f"and continue (--init_from=resume), or continue in a larger folder (--resume_from=<the ckpt.pt> "
                    f"--out_dir=...)")
        free -= need - file_bytes(path)  # the old file goes when the new one replaces it
    return None


def process_age():
    """Seconds since this process started (Linux's /proc), or 0 where that cannot be read."""
    try:
        with open("/proc/self/stat") as f:
            ticks = int(f.read().rpartition(")")[2].split()[19])  # field 22: start, in clock ticks after boot
        with open("/proc/uptime") as f:
            uptime = float(f.read().split()[0])
    except (OSError, ValueError, IndexError):
        return 0.0
    return max(0.0, uptime - ticks / os.sysconf("SC_CLK_TCK"))


class TimeBudget:
    """max_time of a run: from the measured seconds of its steps, of its evaluations with their checkpoint saves,
    and of a summary (the evaluations' ROUGE) times the dialogues evaluate_after/predict_after will summarize,
    whether there is time for the step about to start, one more, and everything that ends the run."""

    def __init__(self, cfg, after_summaries, started):
        self.seconds = parse_duration(cfg.max_time)
        self.started = started  # time.monotonic() when the run began
        self.after_summaries = after_summaries
        self.after_commands = int(cfg.evaluate_after) + int(cfg.predict_after)  # each loads, scores and writes
        self.steps = collections.deque(maxlen=20)  # seconds of the recent steps
        self.finish = None  # seconds of the last evaluation with its checkpoint save
        self.per_summary = 0.0

    def step_done(self, seconds):
        self.steps.append(seconds)

    def evaluation_done(self, seconds):
        self.finish = seconds

    def summarized(self, summaries, seconds):
        if summaries:
            self.per_summary = seconds / summaries

    def stop_now(self):
        """Whether the run must stop after the step about to start: before an evaluation is measured, 5% of the
        budget stands for it; evaluate_after and predict_after take an evaluation's time each beside their
        summaries (loading the checkpoint, scoring, writing)."""
        if self.seconds is None or not self.steps:
            return False
        finish = 1.5 * self.finish if self.finish is not None else 0.05 * self.seconds
        after = self.per_summary * self.after_summaries + finish * self.after_commands
        left = self.seconds - (time.monotonic() - self.started)
        return 2 * max(self.steps) + finish + after > left
