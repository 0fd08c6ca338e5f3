"""train.py under torchrun where rank 1 alone runs out of memory, raised where its GPU would raise it, on a training
forward of more than 2 rows and on a generation batch of more than 2 prompts (tests/test_out_of_memory.py): every
rank must lower alike, and none be left waiting for it.

    torchrun --nproc_per_node=2 --standalone tests/oom_rank.py [train.py arguments]
"""
import os
import sys

import torch
from torch._subclasses.fake_tensor import FakeTensor

import train
from model import GPT

LIMIT = 2


def limited(original, rows):
    """`original`, out of memory when rows(its arguments) is above LIMIT."""
    def method(model, *args, **kwargs):  # the memory ledger's fake tensors hold no memory to run out of
        if rows(*args) > LIMIT and not any(isinstance(a, FakeTensor) for a in args):
            raise torch.OutOfMemoryError("CUDA out of memory. Tried to allocate 2.00 GiB.")
        return original(model, *args, **kwargs)
    return method


if os.environ.get("RANK") == "1":
    GPT.forward = limited(GPT.forward, lambda idx, *rest: len(idx))
    GPT.prefill = limited(GPT.prefill, lambda prompts, *rest: len(prompts))

if __name__ == "__main__":
    train.main(sys.argv[1:])
