"""Training metrics to TensorBoard and/or Weights & Biases, as `log_to` asks: every row train.py writes to
metrics.jsonl goes there too (rank 0 only), and the run's config goes along as its hyperparameters."""
import importlib
import os
from dataclasses import asdict

from config import UserError

HPARAM_METRICS = ("val_loss", "rouge1", "rouge2", "rougeL")  # the columns TensorBoard's HPARAMS tab shows


def require(module, purpose):
    """Import `module`, or UserError saying how to install it."""
    try:
        return importlib.import_module(module)
    except ImportError:
        package = module.split(".")[0]
        raise UserError(f"{purpose} needs the {package} package: pip install {package} (or leave {package} "
                        f"out of --log_to)") from None


class Tracker:
    """Writers for the run's `log_to` destinations; does nothing on ranks other than 0 or with log_to=''.
    Created before training starts, so that a missing package or wandb login stops the run before any work."""

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
        """One metrics.jsonl row ({"iter": step, name: number, ...}) as scalars at step row["iter"]."""
        if not self.destinations:
            return
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
                                                   name=self.cfg.wandb_run_name or None, config=asdict(self.cfg))
            self.wandb.log(scalars, step=step)

    def open_tensorboard(self, first_step):
        """A writer into out_dir/tensorboard whose first step hides (purges) whatever an earlier run logged from
        that step on, so a resumed run's curves do not double back."""
        from torch.utils.tensorboard.summary import hparams

        writer = self.summary_writer(os.path.join(self.cfg.out_dir, "tensorboard"), purge_step=first_step)
        experiment, start, self.hparams_end = hparams(asdict(self.cfg), dict.fromkeys(HPARAM_METRICS))
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
