"""Greedy's steps as CUDA graphs (compiling.StepGraphs), on the CPU with the capture faked: a graph emulated by a
replay that recomputes the step from the held buffers decodes as eager generate, through row buckets, EOS and
compaction, one graph per (model, rows, slots); a capture that fails or disagrees decodes eagerly from then on,
with one line."""
import copy

import pytest
import torch

from config import Decoding
from conftest import mid_way_eos
from generate import generate
from summarizer.compiling import StepGraphs

MAX_NEW = 24


class Replay:
    """A CUDA graph's stand-in: replay() writes into the output of the first call what the step computes now,
    from the buffers it was captured on."""

    def __init__(self, step):
        self.step, self.output = step, step()

    def replay(self):
        self.output.copy_(self.step())


def emulated(step, captured=None):
    graph = Replay(step)
    if captured is not None:
        captured.append(graph)
    return graph, graph.output, step()


@pytest.fixture(scope="module")
def model(ours):
    return ours


@pytest.fixture(scope="module")
def prompts():
    g = torch.Generator().manual_seed(11)
    return [torch.randint(0, 50257, (int(n),), generator=g).tolist() for n in torch.randint(1, 70, (20,), generator=g)]


@pytest.fixture(scope="module")
def eos(model, prompts):
    return mid_way_eos(model, prompts, MAX_NEW, 2)


@pytest.mark.parametrize("compact_below", [0.5, 1.0])
def test_replayed_steps_decode_as_eager_through_buckets_eos_and_compaction(model, prompts, eos, compact_below):
    """Two batches of 20 prompts (one bucket reused with other prompts: its buffers are refilled), ended rows
    dropped (at half, or as the host sees them) into buckets of 16 or 8 padded with copies of running rows: the
    eager summaries, each bucket captured once."""
    captured = []
    graphs = StepGraphs(capture=lambda step: emulated(step, captured))
    for batch in (prompts, prompts[::-1]):
        for decoding in (Decoding(MAX_NEW), Decoding(MAX_NEW, min_new_tokens=10)):
            eager = generate(model, batch, decoding, eos_token_id=eos, compact_below=compact_below)
            assert generate(model, batch, decoding, eos_token_id=eos, compact_below=compact_below,
                            greedy_steps=graphs) == eager
    assert any(len(row) < MAX_NEW for row in eager) and any(len(row) == MAX_NEW for row in eager)
    assert not graphs.failed and {rows for _, rows, _ in graphs.graphs} >= ({20, 16} if compact_below == 1 else {20})
    assert len(captured) == len(graphs.graphs)  # a bucket is captured at its first use only


def test_each_model_replays_its_own_graph(model, prompts, eos):
    twin = copy.deepcopy(model)
    with torch.no_grad():
        twin.transformer.h[1].mlp.c_proj.weight.mul_(-1.0)
    graphs = StepGraphs(capture=emulated)
    ours, theirs = (generate(m, prompts, Decoding(MAX_NEW), eos_token_id=eos, greedy_steps=graphs)
                    for m in (model, twin))
    assert ours == generate(model, prompts, Decoding(MAX_NEW), eos_token_id=eos)
    assert theirs == generate(twin, prompts, Decoding(MAX_NEW), eos_token_id=eos) != ours


def failing(step):
    raise RuntimeError("operation not permitted when stream is capturing\nmore detail")


def disagreeing(step):
    graph, output, expected = emulated(step)
    graph.step = lambda: torch.zeros_like(output)
    return graph, output, expected


@pytest.mark.parametrize("capture, why", [
    (failing, "capture failed (RuntimeError: operation not permitted when stream is capturing)"),
    (disagreeing, "its first replay disagreed with the eager step")])
def test_a_failed_or_disagreeing_capture_decodes_eagerly_from_then_on_with_one_line(model, prompts, eos, capfd,
                                                                                   capture, why):
    graphs = StepGraphs(capture=capture)
    eager = generate(model, prompts, Decoding(MAX_NEW), eos_token_id=eos)
    for _ in range(2):
        assert generate(model, prompts, Decoding(MAX_NEW), eos_token_id=eos, greedy_steps=graphs) == eager
    assert graphs.failed and not graphs.graphs
    assert capfd.readouterr().err.splitlines() == [f"warning: CUDA graph {why}; decoding eagerly from now on"]


def test_greedy_under_autocast_is_not_replayed(model, prompts, eos):
    """autocast's cast weights live in a cache its context frees: a graph would read freed memory."""
    graphs = StepGraphs(capture=failing)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        generate(model, prompts[:4], Decoding(8), eos_token_id=eos, greedy_steps=graphs)
    assert not graphs.failed and not graphs.inputs
