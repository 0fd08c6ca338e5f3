"""A script (train.py, evaluate.py, predict.py) under torchrun, that reports on stderr each DDP module as it is built
and, when its process group is destroyed, what is alive after a garbage collection (the DDP modules, FSDP-sharded
modules and GPTs) and its NCCL variables (tests/test_train.py's launcher-parity runs). With --hang, the group's
destruction never returns instead, and the teardown's bound is 2 s (tests/test_teardown.py).

    torchrun --nproc_per_node=2 --standalone tests/teardown_probe.py [--hang] SCRIPT [its arguments]
"""
import gc
import os
import runpy
import sys
import warnings

import torch.distributed as dist
import torch.distributed.fsdp
from torch.nn.parallel import DistributedDataParallel

from model import GPT
from summarizer import backends

destroy = dist.destroy_process_group


def say(line):
    os.write(2, f"{line}\n".encode())  # one write: the other rank's lines cannot come between its parts


class ReportedDDP(DistributedDataParallel):
    """DistributedDataParallel, ours (summarizer/backends.py) and Accelerate's alike."""

    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        say(f"ddp built: gradient_as_bucket_view={self.gradient_as_bucket_view}")


def alive_at_teardown(*args, **kwargs):
    gc.collect()
    with warnings.catch_warnings():  # isinstance on torch.distributed's deprecated module attributes warns
        warnings.simplefilter("ignore")
        objects = gc.get_objects()
        counts = {"ddp": sum(isinstance(o, DistributedDataParallel) for o in objects),
                  "fsdp": sum(isinstance(o, torch.distributed.fsdp.FSDPModule) for o in objects),
                  "gpt": sum(isinstance(o, GPT) for o in objects)}
    say(f"alive at teardown: {' '.join(f'{k}={v}' for k, v in counts.items())}")
    say(f"nccl at teardown: {backends.nccl_in_effect(os.environ)}")
    return destroy(*args, **kwargs)


def hang(*args, **kwargs):
    while True:
        pass


if __name__ == "__main__":
    hung = sys.argv[1] == "--hang"
    script, *argv = sys.argv[2:] if hung else sys.argv[1:]
    dist.destroy_process_group = hang if hung else alive_at_teardown
    torch.nn.parallel.DistributedDataParallel = backends.DistributedDataParallel = ReportedDDP
    if hung:
        backends.TEARDOWN_SECONDS = 2
    sys.argv = [script, *argv]
    runpy.run_path(script, run_name="__main__")
