"""The objective contract: what a training step minimizes. The loop (train.py) asks an objective for the batches of
a step, the module a step calls, a micro-batch on the device and its losses; TokenLoss is the fine-tuning one,
summarizer/ranking.py's Ranking the calibration stage's."""
import torch

import data
from model import Targets


class TokenLoss:
    """What a step minimizes: the cross-entropy of the summary tokens, summed over a micro-batch (the loop divides
    it by the global batch's targets). A stage built on this loop replaces it with an objective of its own that
    offers the same six things; `extra_loss` is its second term, summed over a micro-batch's dialogues."""
    checkpoint_keys = {}  # what this objective adds to ckpt.pt
    extra_loss = None  # the metrics.jsonl name of a second loss term, if any

    @staticmethod
    def problem(cfg):
        """Why the run's settings cannot train this objective (asked before any work), else None."""
        return None

    def __init__(self, cfg, rt, train_set, model, ckpt):
        self.batches = data.TrainBatches(train_set, cfg, rt.rank, rt.world_size)

    def module(self, model):
        """What a step calls (compiled and wrapped by the backend)."""
        return model

    def on_device(self, batch, device):
        x, y = batch
        return x.to(device, non_blocking=True), Targets.of(y).to(device)

    def losses(self, module, batch):
        """(token loss summed over the micro-batch's targets, a second term already weighed, its unweighed sum)."""
        x, found = batch
        _, loss = module(x, found)
        zero = torch.zeros((), device=x.device)
        return loss * len(found.index), zero, zero
