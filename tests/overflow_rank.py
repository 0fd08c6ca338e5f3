"""train.py under torchrun, with an inf put into one gradient shard of rank 1 only, in the first optimizer step,
after backward (tests/test_fsdp.py): under FSDP the other rank's shards are finite, so its GradScaler sees the
overflow only if the ranks share their found-inf.

    torchrun --nproc_per_node=2 --standalone tests/overflow_rank.py [train.py arguments]
"""
import sys

import torch

import train

original_init = train.Trainer.__init__


def init_with_overflow(self, run, proc, *args):
    original_init(self, run, proc, *args)
    unscale = self.setup.state.scaler.unscale_

    def unscale_with_overflow(optimizer):
        if proc.rank == 1 and self.setup.state.step == 0:
            grad = next(p.grad for p in self.model.parameters() if p.grad is not None)
            grad.to_local().view(-1)[0] = torch.inf
        return unscale(optimizer)

    self.setup.state.scaler.unscale_ = unscale_with_overflow


train.Trainer.__init__ = init_with_overflow

if __name__ == "__main__":
    train.main(sys.argv[1:])
