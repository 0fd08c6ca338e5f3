"""Greedy's steps as CUDA graphs (generate.StepGraphs, generate.capture_graph), on the CPU with CUDA faked where a GPU
would fail: a graph records the step's ATen operators once, at its capture, and a replay runs the recording again
on the buffers it was captured on, so a step that reads the host fails its capture as on a GPU. Replayed steps
decode as eager generate, through row buckets, EOS and compaction, one graph per (model, rows, slots), captured once
a summarizing call on one side stream, the allocator's cache kept; a capture that fails, or a first replay beyond the
dtype's tolerance, decodes eagerly from then on, with one line, the stream and the memory as they were; summarizing
says after the fact which way the steps ran."""
import contextlib
import copy
import re
import threading
import types
import weakref

import pytest
import torch
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_leaves

import generate as generate_module
from command_line import error_line
from config import Decoding, load_config
from conftest import mid_way_eos, tiny_gpt
from generate import GreedyBatch, StepGraphs, capture_graph, generate, static_step
from model import KVCache, attention_mask
from summarizer import inference
from summarizer.inference import SummaryModel, summarize_batches
from summarizer.process import Process

MAX_NEW = 24
HOST_READ = "CUDA error: operation not permitted when stream is capturing"


class Recording(TorchDispatchMode):
    """A capture: each operator is run and kept with its arguments and output; a read of a value on the host
    (.item(), int(), float()) fails, and fails the capture, as its synchronization does on a GPU. (.tolist() of a CPU
    tensor reads its memory without an operator.)"""

    def __init__(self, graph):
        super().__init__()
        self.graph = graph

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        if func in (torch.ops.aten.item.default, torch.ops.aten._local_scalar_dense.default):
            self.graph.invalidated = True
            raise RuntimeError(HOST_READ)
        output = func(*args, **(kwargs or {}))
        self.graph.ops.append((func, args, kwargs or {}, output))
        self.graph.allocated += [weakref.ref(t) for t in tree_leaves(output) if isinstance(t, torch.Tensor)]
        return output


class RecordedGraph:
    """torch.cuda.CUDAGraph's stand-in: capture_begin/capture_end record the operators in between (Recording), and
    replay() runs them again, each writing into the output it wrote at the capture (a view or an in-place
    operator's output is already there)."""
    made = []

    def __init__(self):
        self.ops, self.invalidated, self.allocated = [], False, []
        RecordedGraph.made.append(self)

    def capture_begin(self, *pool, capture_error_mode="global", **options):
        if torch.cuda.current_stream() is torch.cuda.default_stream():
            raise RuntimeError("CUDA error: operation not permitted on the legacy stream")  # CUDA captures on no other
        self.recording, self.mode, self.capturing = Recording(self), capture_error_mode, True
        self.stream = torch.cuda.current_stream()
        self.recording.__enter__()

    def capture_end(self):
        self.recording.__exit__(None, None, None)
        self.capturing = False
        if self.invalidated:
            raise RuntimeError("CUDA error: operation failed due to a previous error during capture")

    def replay(self):
        for func, args, kwargs, output in self.ops:
            for held, now in zip(tree_leaves(output), tree_leaves(func(*args, **kwargs)), strict=True):
                if isinstance(held, torch.Tensor) and held.untyped_storage().data_ptr() != now.untyped_storage(
                        ).data_ptr():
                    held.copy_(now)

    def reset(self):
        self.ops = []


def watchdog_query():
    """The NCCL watchdog's event query (torchrun), made from its own thread: it invalidates a capture begun in the
    global mode, which prohibits such calls from any thread (cudaStreamCaptureModeGlobal)."""
    for graph in RecordedGraph.made:
        graph.invalidated |= getattr(graph, "capturing", False) and graph.mode == "global"


@pytest.fixture
def cuda(monkeypatch):
    """torch.cuda's streams and graphs faked (torch.cuda.graph itself is torch's): `cuda.current` is the current
    stream, `cuda.default` the one the process starts on, `cuda.streams` those made since, `cuda.emptied` the calls
    that empty the allocators' caches."""
    def new_stream():
        fake.streams.append(types.SimpleNamespace(wait_stream=lambda other: None))
        return fake.streams[-1]
    fake = types.SimpleNamespace(streams=[], emptied=[])
    fake.default = fake.current = new_stream()
    fake.streams.clear()

    @contextlib.contextmanager
    def stream(to):
        before, fake.current = fake.current, to
        yield
        fake.current = before

    RecordedGraph.made = []
    for name, value in dict(Stream=new_stream, stream=stream,
                            current_stream=lambda device=None: fake.current, CUDAGraph=RecordedGraph,
                            set_stream=lambda to: setattr(fake, "current", to), synchronize=lambda device=None: None,
                            default_stream=lambda device=None: fake.default,
                            empty_cache=lambda: fake.emptied.append("empty_cache")).items():
        monkeypatch.setattr(torch.cuda, name, value)
    monkeypatch.setattr(torch._C, "_host_emptyCache", lambda: fake.emptied.append("host"), raising=False)
    monkeypatch.setattr(torch.cuda.graph, "default_capture_stream", None)  # torch's side stream: made afresh
    return fake


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
def test_replayed_steps_decode_as_eager_through_buckets_eos_and_compaction(model, prompts, eos, cuda, compact_below):
    """Two batches of 20 prompts (one bucket reused with other prompts: its buffers are refilled), ended rows
    dropped (at half, or as the host sees them) into buckets of 16 or 8 padded with copies of running rows: the
    eager summaries, each bucket captured once, on the stream it was captured from."""
    graphs = StepGraphs()
    for batch in (prompts, prompts[::-1]):
        for decoding in (Decoding(MAX_NEW), Decoding(MAX_NEW, min_new_tokens=10)):
            eager = generate(model, batch, decoding, eos_token_id=eos, compact_below=compact_below)
            assert generate(model, batch, decoding, eos_token_id=eos, compact_below=compact_below,
                            graphs=graphs) == eager
    assert any(len(row) < MAX_NEW for row in eager) and any(len(row) == MAX_NEW for row in eager)
    buckets = {rows for _, rows, _ in graphs.graphs}
    assert graphs.eager_why is None and buckets >= ({20, 16} if compact_below == 1 else {20})
    assert len(RecordedGraph.made) == len(graphs.graphs) == len(graphs.capture_seconds)  # each at its first use
    assert cuda.current is cuda.default
    assert re.fullmatch(r"greedy steps replayed as CUDA graphs \(buckets (\d+x\d+(, )?)+\)", graphs.describe())


def test_a_summarizing_call_captures_each_bucket_once_on_one_stream_keeping_the_allocators_cache(cuda, monkeypatch):
    """Length-sorted batches (gen_batch_size 4; prompts of 1 to 280 tokens: 64 to 320 slots; EOS mid-way: rows
    dropped into smaller buckets): the eager summaries; each (rows, slots) bucket captured once, the graphs' storage
    sized for the call's largest batch first; one capture stream; nothing empties the allocator's cache (a training
    run's)."""
    torch.manual_seed(0)
    model = tiny_gpt(block_size=320).eval()
    with torch.no_grad():
        for p in model.parameters():
            p.mul_(3)  # sharper, so one token ends most rows at different steps
    g = torch.Generator().manual_seed(3)
    prompts = [torch.randint(0, 64, (int(n),), generator=g).tolist() for n in torch.randint(1, 280, (40,), generator=g)]
    eos = mid_way_eos(model, prompts, MAX_NEW, 4)
    monkeypatch.setattr(inference, "generate", lambda *args, **kw: generate(*args, **dict(kw, eos_token_id=eos)))
    cfg = load_config(["--device=cpu", "--dtype=float32", f"--max_new_tokens={MAX_NEW}", "--gen_batch_size=16"])
    eager = summarize_batches(model, prompts, cfg, contextlib.nullcontext())
    graphs, storages, hold = StepGraphs(), [], StepGraphs.hold
    monkeypatch.setattr(StepGraphs, "hold", lambda self, *args: (hold(self, *args), storages.append(self.storage))[0])
    assert summarize_batches(model, prompts, cfg, contextlib.nullcontext(), graphs=graphs) == eager
    assert all(storage is storages[0] for storage in storages)  # never released, so no graph is captured again
    buckets = set(graphs.capture_seconds)
    assert len({slots for _, slots in buckets}) >= 3 and len({rows for rows, _ in buckets}) >= 2, buckets
    assert len(RecordedGraph.made) == len(buckets) and graphs.eager_why is None
    assert len(cuda.streams) == 1 and all(graph.stream is cuda.streams[0] for graph in RecordedGraph.made)
    assert not cuda.emptied and cuda.current is cuda.default


def test_each_model_replays_its_own_graph(model, prompts, eos, cuda):
    twin = copy.deepcopy(model)
    with torch.no_grad():
        twin.transformer.h[1].mlp.c_proj.weight.mul_(-1.0)
    graphs = StepGraphs()
    ours, theirs = (generate(m, prompts, Decoding(MAX_NEW), eos_token_id=eos, graphs=graphs) for m in (model, twin))
    assert ours == generate(model, prompts, Decoding(MAX_NEW), eos_token_id=eos)
    assert theirs == generate(twin, prompts, Decoding(MAX_NEW), eos_token_id=eos) != ours


def host_reading_step(model, batch):
    """static_step with its slot read on the host: right on any step run eagerly, wrong in a graph (its replays
    would attend up to the captured step's slot)."""
    batch.mask[..., int(batch.slot[0])] = 0
    return model.next_logits(batch.tokens, batch.positions, batch.slot, batch.caches, batch.mask)


def test_a_step_that_reads_the_host_fails_its_capture_and_decodes_eagerly(model, prompts, eos, cuda, monkeypatch,
                                                                          capfd):
    """The capture raises inside torch.cuda.graph, whose exit then raises "previous error during capture" before it
    restores the stream: the stream is the one before, what the capture allocated is freed, the line names the
    first error, and decoding goes on eagerly with the same summaries."""
    monkeypatch.setattr(generate_module, "static_step", host_reading_step)
    eager = generate(model, prompts, Decoding(MAX_NEW), eos_token_id=eos)
    graphs = StepGraphs(error_line=error_line)
    assert generate(model, prompts, Decoding(MAX_NEW), eos_token_id=eos, graphs=graphs) == eager
    why = f"capture failed (RuntimeError: {HOST_READ})"
    assert capfd.readouterr().err.splitlines() == [f"warning: CUDA graph {why}; decoding eagerly from now on"]
    assert cuda.current is cuda.default
    [graph] = RecordedGraph.made
    assert graph.allocated and not graph.ops and all(ref() is None for ref in graph.allocated)
    assert graphs.eager_why == why and not graphs.graphs and not graphs.capture_seconds
    assert graphs.describe() == f"greedy steps eager: {why}"


def prefilled(model):
    """greedy()'s batch of two prompts (one padded) after its prefill, at the first step's slot, tokens written."""
    pad, slots = torch.tensor([1, 0]), torch.arange(64)
    mask = attention_mask((slots >= pad[:, None]) & (slots < 4), torch.float32)
    batch = GreedyBatch(torch.tensor([[7], [8]]), (4 - pad)[:, None], torch.tensor([4]), mask,
                        [KVCache(64) for _ in model.transformer.h])
    model.prefill([[1, 2, 3], [4, 5, 6, 7]], batch.caches)
    return batch


@pytest.mark.parametrize("step", [host_reading_step, static_step])
@torch.inference_mode()
def test_a_recorded_capture_fails_a_host_read_and_replays_todays_step_at_later_slots(model, cuda, step):
    """Captured at one step and replayed at the next (other tokens, positions and slot, in the same buffers): the
    step that reads its slot on the host fails its capture; today's step replays as it runs eagerly there."""
    batch = prefilled(model)
    if step is host_reading_step:
        with pytest.raises(RuntimeError, match=HOST_READ):
            capture_graph(lambda: step(model, batch))
        return
    graph, output, _ = capture_graph(lambda: step(model, batch))
    batch.tokens.copy_(torch.tensor([[9], [10]]))
    batch.positions.add_(1)
    batch.slot.add_(1)
    graph.replay()
    assert torch.equal(output, static_step(model, batch))


@torch.inference_mode()
def test_a_cuda_call_from_another_thread_during_a_capture_leaves_it_valid(model, cuda):
    """Under torchrun the NCCL watchdog queries events from its own thread, at any moment: the capture is
    thread-local, so such a call cannot end it."""
    batch = prefilled(model)

    def step_beside_the_watchdog():
        watchdog = threading.Thread(target=watchdog_query)
        watchdog.start()
        watchdog.join()
        return static_step(model, batch)
    graph, output, expected = capture_graph(step_beside_the_watchdog)
    graph.replay()
    assert torch.equal(output, expected)


def failing(step):
    raise RuntimeError("operation not permitted when stream is capturing\nmore detail")


def disagreeing(step):
    graph, output, expected = capture_graph(step)
    graph.replay = lambda: output.zero_()
    return graph, output, expected


@pytest.mark.parametrize("capture, why", [
    (failing, r"capture failed \(RuntimeError: operation not permitted when stream is capturing\)"),
    (disagreeing, r"its first replay differs from the eager step by up to [\d.]+")])
def test_a_failed_or_disagreeing_capture_decodes_eagerly_from_then_on_with_one_line(model, prompts, eos, capfd,
                                                                                   cuda, capture, why):
    graphs = StepGraphs(capture=capture, error_line=error_line)
    eager = generate(model, prompts, Decoding(MAX_NEW), eos_token_id=eos)
    for _ in range(2):
        assert generate(model, prompts, Decoding(MAX_NEW), eos_token_id=eos, graphs=graphs) == eager
    assert re.fullmatch(why, graphs.eager_why) and not graphs.graphs
    assert capfd.readouterr().err.splitlines() == [f"warning: CUDA graph {graphs.eager_why}; decoding eagerly "
                                                   f"from now on"]


@pytest.mark.parametrize("dtype, graphed", [(torch.bfloat16, True), (torch.float16, True), (torch.float32, False)])
def test_a_logit_near_zero_off_by_the_rounding_of_the_logits_scale_keeps_the_graphs(model, dtype, graphed):
    """An H200 in bfloat16 replayed a step 0.0156 from the eager one, a step of a logit near 3 but far beyond an
    elementwise tolerance for a logit near 0, and decoded eagerly from then on; a T4's float16 rounds at 1/1024."""
    eager = torch.tensor([[3.0, 0.0]], dtype=dtype)
    replayed = eager + torch.tensor([[0.0, 0.0156 if dtype == torch.bfloat16 else 0.002]], dtype=dtype)

    def cancelled(step):
        return types.SimpleNamespace(replay=lambda: None), replayed, eager
    graphs = StepGraphs(capture=cancelled, warn=lambda line: None)
    with torch.inference_mode():
        assert (graphs(model, prefilled(model)) is replayed) == graphed and (graphs.eager_why is None) == graphed


def test_an_infinite_logit_sets_no_scale_for_the_others(model):
    """The logits' scale is their largest finite size: an overflowed logit (float16 past 65504) would else pass any
    gap in the rest."""
    eager = torch.tensor([[float("inf"), 3.0, 0.0]], dtype=torch.float16)
    replayed = torch.tensor([[float("inf"), 3.0, 5.0]], dtype=torch.float16)

    def overflowed(step):
        return types.SimpleNamespace(replay=lambda: None), replayed, eager
    graphs = StepGraphs(capture=overflowed, warn=lambda line: None)
    with torch.inference_mode():
        graphs(model, prefilled(model))
    assert graphs.eager_why.startswith("its first replay differs from the eager step by up to")


@pytest.mark.parametrize("dtype, graphed", [(torch.bfloat16, True), (torch.float32, False)])
def test_a_near_tie_within_the_dtypes_tolerance_keeps_the_graphs(model, dtype, graphed):
    """Replayed logits one bfloat16 step (1/128) from the eager step's, their argmax flipped: bfloat16 rounding, so
    the graph replays; in float32 the same gap is a disagreement."""
    replayed = torch.tensor([[1.0, 1.0078125]], dtype=dtype)

    def near_tie(step):
        return types.SimpleNamespace(replay=lambda: None), replayed, replayed.flip(-1)
    graphs = StepGraphs(capture=near_tie, warn=lambda line: None)
    with torch.inference_mode():
        assert (graphs(model, prefilled(model)) is replayed) == graphed and (graphs.eager_why is None) == graphed


def test_greedy_under_autocast_is_not_replayed(model, prompts, eos):
    """autocast's cast weights live in a cache its context frees: a graph would read freed memory."""
    graphs = StepGraphs(capture=failing)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        generate(model, prompts[:4], Decoding(8), eos_token_id=eos, graphs=graphs)
    assert graphs.eager_why is None and not graphs.inputs


@pytest.mark.parametrize("capture, said", [
    (capture_graph, r"greedy steps replayed as CUDA graphs \(buckets (\d+x\d+(, )?)+\)"),
    (failing, r"greedy steps eager: capture failed \(RuntimeError: operation not permitted when stream is "
              r"capturing\)")])
def test_summarizing_says_after_the_fact_how_greedy_steps_ran(model, prompts, cuda, capfd, capture, said):
    cfg = load_config(["--device=cpu", "--dtype=float32", "--max_new_tokens=8"])
    with Process(cfg) as proc:
        proc.graphs = StepGraphs(capture=capture, error_line=error_line)
        SummaryModel(model, cfg).summarize(prompts, proc)
    out = capfd.readouterr().out.splitlines()
    assert out[0] == "summarizing 20 dialogues" and re.fullmatch(f"summarized 20 dialogues: {said}", out[-1])
