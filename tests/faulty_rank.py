"""train.py under torchrun, with rank 1 failing in its third optimizer step (tests/test_crash_safety.py).

    torchrun --nproc_per_node=2 --standalone tests/faulty_rank.py [train.py arguments]
"""
import sys

import train

FAILING_RANK, FAILING_STEP = 1, 2
original_step = train.Trainer.train_step


def faulty_step(self, step):
    if self.proc.rank == FAILING_RANK and step == FAILING_STEP:
        raise RuntimeError(f"injected fault in step {step}")
    return original_step(self, step)


train.Trainer.train_step = faulty_step

if __name__ == "__main__":
    train.main(sys.argv[1:])
