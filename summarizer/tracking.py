"""Training metrics: metrics.jsonl, its plot, and the `log_to` destinations (TensorBoard, W&B), rank 0's."""
import importlib
import json
import math
import os
import re
from dataclasses import asdict

from command_line import UserError, atomic_write, disk_full
from config import config_json, describe_duration
from summarizer.run_folder import METRICS

HPARAM_METRICS = ("val_loss", "rouge1", "rouge2", "rougeL")  # the columns TensorBoard's HPARAMS tab shows


def require(module, purpose):
    try:
        return importlib.import_module(module)
    except ImportError:
        package = module.split(".")[0]
        raise UserError(f"{purpose} needs the {package} package: pip install {package} (or leave {package} "
                        f"out of --log_to)") from None


class Tracker:
    """Made before training starts, so that a missing package or wandb login stops the run before any work."""

    def __init__(self, cfg, is_main):
        self.cfg = cfg
        self.destinations = [d for d in cfg.log_to.split(",") if d] if is_main else []
        self.tensorboard = self.wandb = None
        if "tensorboard" in self.destinations:
            self.summary_writer = require("torch.utils.tensorboard", "log_to=tensorboard").SummaryWriter
        if "wandb" in self.destinations:
            self.wandb_module = require("wandb", "log_to=wandb")
            offline = os.environ.get("WANDB_MODE") in ("offline", "disabled")
            if not offline and not self.wandb_module.login(prompt=False, verify=False):  # no network call
                raise UserError("log_to=wandb but wandb has no API key: run `wandb login`, set WANDB_API_KEY "
                                "(on Kaggle from a secret), or set WANDB_MODE=offline to log locally")

    def log(self, row):
        step = row["iter"]
        scalars = {k: v for k, v in row.items() if k != "iter" and isinstance(v, (int, float))}
        if "tensorboard" in self.destinations:
            if self.tensorboard is None:
                self.tensorboard = self.open_tensorboard(step)
            for name, value in scalars.items():
                self.tensorboard.add_scalar(name, value, step)
            self.tensorboard.flush()  # a crashed or killed run keeps what it logged
        if "wandb" in self.destinations:
            if self.wandb is None:
                self.wandb = self.wandb_module.init(project=self.cfg.wandb_project, dir=self.cfg.out_dir,
                                                   name=self.cfg.wandb_run_name or None,
                                                   config=json.loads(config_json(self.cfg)))
            self.wandb.log(scalars, step=step)

    def open_tensorboard(self, first_step):
        """purge_step hides what an earlier run logged from `first_step` on: a resumed curve does not double back."""
        from torch.utils.tensorboard.summary import hparams

        writer = self.summary_writer(os.path.join(self.cfg.out_dir, "tensorboard"), purge_step=first_step)
        # TensorBoard's hparams take numbers, text and yes/no: a duration's None, a tuple or a sweep as text
        settings = {k: v if isinstance(v, (int, float, str, bool)) else str(v) for k, v in asdict(self.cfg).items()}
        experiment, start, self.hparams_end = hparams(settings, dict.fromkeys(HPARAM_METRICS))
        writer.file_writer.add_summary(experiment)
        writer.file_writer.add_summary(start)
        return writer

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        if self.tensorboard is not None:
            if exc[0] is None:  # the HPARAMS tab marks the run finished
                self.tensorboard.file_writer.add_summary(self.hparams_end)
            self.tensorboard.close()
        if self.wandb is not None:
            self.wandb.finish(exit_code=0 if exc[0] is None else 1)


def step_of(row):
    try:
        return json.loads(row)["iter"]
    except (ValueError, KeyError, TypeError):  # a row a kill cut short
        return math.inf


def resumed_history(ckpt_path, out_dir, step):
    """metrics.jsonl to `step`, in another folder first copied from ckpt_path's; the note saying so, or None."""
    path, earlier = os.path.join(out_dir, METRICS), os.path.join(os.path.dirname(os.path.abspath(ckpt_path)), METRICS)
    source = path if os.path.isfile(path) or os.path.abspath(path) == earlier else earlier
    if not os.path.isfile(source):
        return None if source == path else (
            f"note: no {METRICS} beside {ckpt_path}: this folder's {METRICS}, metrics.png and report start at iter "
            f"{step + 1}; the history of the steps before is where those sessions wrote it")
    with open(source, encoding="utf-8") as f:
        lines = [line for line in f if line.strip()]
    rows = [line.rstrip("\n") + "\n" for line in lines if step_of(line) <= step]  # a resumed run logs them again
    if source != path or len(rows) < len(lines):
        with atomic_write(path) as f:
            f.writelines(rows)
    if source != path:
        return f"{METRICS}: the earlier sessions' {len(rows)} row(s), to iter {step}, carried over from {earlier}"
    return (f"{METRICS}: {len(lines) - len(rows)} row(s) logged after iter {step} were dropped; those steps run and "
            f"are logged again") if len(rows) < len(lines) else None


def log_row(out_dir, row, tracker):
    path = os.path.join(out_dir, METRICS)
    try:
        with open(path, "a") as f:
            f.write(json.dumps(row) + "\n")
    except OSError as e:
        if full := disk_full(path, e):
            raise full from None
        raise
    tracker.log(row)


def progress_postfix(stats, skipped=None, left=None):
    """`left`: (seconds, steps) as the clock re-measures them: the start line's estimate is not the only one."""
    postfix = {"loss": f"{stats['loss']:.4f}", "lr": f"{stats['lr']:.2e}", "tok/s": f"{stats['tokens_per_s']:.0f}",
               "ms/it": f"{stats['ms_per_iter']:.0f}"}
    if "mfu" in stats:
        postfix["mfu"] = f"{100 * stats['mfu']:.1f}%"
    if "peak_mem_gb" in stats:
        postfix["mem"] = f"{stats['peak_mem_gb']:.1f}G"
    if skipped is not None:
        postfix["skipped"] = skipped
    if left is not None:
        seconds, steps = left
        postfix["left"] = f"{describe_duration(round(max(0.0, seconds)))} ~{steps} it"
    return postfix


def plot_metrics(jsonl_path, png_path, title=""):
    from matplotlib.figure import Figure  # no pyplot: no global backend, no figure to close

    with open(jsonl_path) as f:
        rows = [json.loads(line) for line in f if line.strip()]
    evals = [r for r in rows if "val_loss" in r]
    fig = Figure(figsize=(11, 4))
    ax_loss, ax_rouge = fig.subplots(1, 2)
    ax_loss.plot([r["iter"] for r in rows], [r["loss"] for r in rows], label="train loss", alpha=0.7)
    ax_loss.plot([r["iter"] for r in evals], [r["val_loss"] for r in evals], "o-", label="val loss")
    ax_loss.set(xlabel="iter", ylabel="loss (cross-entropy per target token)", title="loss")
    ax_loss.legend()
    for key in ("rouge1", "rouge2", "rougeL"):
        if points := [(r["iter"], r[key]) for r in evals if key in r]:
            ax_rouge.plot(*zip(*points, strict=True), "o-", label=key)
            ax_rouge.legend()
    ax_rouge.set(xlabel="iter", ylabel="ROUGE F1", title="validation ROUGE")
    fig.suptitle(title or os.path.dirname(os.path.abspath(png_path)))
    fig.tight_layout()
    with atomic_write(png_path, "wb") as f:
        fig.savefig(f, format="png")


# Dense peak TFLOPS per GPU by dtype (vendor datasheets, no sparsity), the more specific names first.
PEAK_TFLOPS = {
    "H200": {"bfloat16": 989.0, "float16": 989.0, "float32": 67.0},
    "H100 PCIE": {"bfloat16": 756.0, "float16": 756.0, "float32": 51.0},
    "H100": {"bfloat16": 989.0, "float16": 989.0, "float32": 67.0},
    "A100": {"bfloat16": 312.0, "float16": 312.0, "float32": 19.5},
    "A10": {"bfloat16": 125.0, "float16": 125.0, "float32": 31.2},
    "L4": {"bfloat16": 121.0, "float16": 121.0, "float32": 30.3},
    "V100": {"float16": 125.0, "float32": 15.7},
    "T4": {"float16": 65.0, "float32": 8.1},
}


def peak_flops(device_name, dtype):
    """FLOP/s of a torch.cuda.get_device_name() for a dtype name, or None. Whole words: an L40S is not an L4."""
    peaks = next((peaks for key, peaks in PEAK_TFLOPS.items() if re.search(rf"\b{key}\b", device_name.upper())), {})
    return peaks[dtype] * 1e12 if dtype in peaks else None
