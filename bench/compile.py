"""python -m bench --section=compile: what a GPU run would waste, counted on the CPU: graph breaks and compilations,
the host's waits for the device, weight casts, KV-cache bytes copied against read. Under torchrun, train_counts'
worker."""
import collections
import contextlib
import dataclasses
import json
import os
import sys
import tempfile
from unittest import mock

import torch
from torch.overrides import TorchFunctionMode
from torch.utils._python_dispatch import TorchDispatchMode

import data
import model as model_module
from bench import SAMSUM_CSV, child_environ, demo_arguments, torchrun, train_quietly, training_csv
from config import Decoding, part
from generate import READ_EVERY, LogitsProcessors, generate
from summarizer import inference, mbr, memory

aten = torch.ops.aten


class CompileCounter:
    """A torch.compile backend per compiled function that counts the graphs it is given (those with any
    operation: dynamo may hand over an empty one) and runs them as they are."""

    def __init__(self):
        self.compilations = collections.Counter()

    def backend(self, name):
        def count(gm, example_inputs):
            if any(node.op.startswith("call") for node in gm.graph.nodes):
                self.compilations[name] += 1
            return gm.forward
        return count


def fresh_compiles():  # what follows is counted from its first compilation
    torch._dynamo.reset()
    torch._dynamo.utils.counters.clear()


def graph_breaks():  # since fresh_compiles()
    return sum(torch._dynamo.utils.counters["graph_break"].values())


def graphs_compiled():  # since fresh_compiles(), on the real backend
    return torch._dynamo.utils.counters["stats"]["unique_graphs"]


@contextlib.contextmanager
def counted_compiles():
    """torch.compile, while inside, compiles with a CompileCounter backend: training's model under 'train', the
    decode step under 'decode'. Yields (counter, graph breaks so far: a function)."""
    counter, real = CompileCounter(), torch.compile
    fresh_compiles()

    def compile(fn, **options):
        options.pop("backend", None)
        return real(fn, backend=counter.backend("train" if isinstance(fn, torch.nn.Module) else "decode"), **options)
    with mock.patch.object(torch, "compile", compile):
        yield counter, graph_breaks


# ---- host syncs, weight casts, KV-cache bytes --------------------------------------------------------------------

HOST_READS = {"tolist", "numpy"}  # read tensor values without dispatching an op
VALUE_SHAPED = {aten._local_scalar_dense.default, aten.nonzero.default, aten.equal.default, aten._unique2.default,
                aten.unique_dim.default, aten.unique_consecutive.default, aten.masked_select.default,
                aten.repeat_interleave.Tensor}


class Waits(TorchFunctionMode):
    """Counts the host's waits for the device: a read of tensor values (.tolist, .item, bool, int) or an op whose
    output shape depends on them (nonzero, unique, boolean-mask indexing), each a device-to-host sync on a GPU;
    and casts of `weights` (tensors whose storage is a parameter's) to another dtype."""

    def __init__(self, weights=()):
        super().__init__()
        self.syncs = self.weight_casts = 0
        self.dispatch = _WaitsDispatch(self, {w.untyped_storage().data_ptr() for w in weights})

    def __torch_function__(self, func, types, args=(), kwargs=None):
        if getattr(func, "__name__", "") in HOST_READS:
            self.syncs += 1
        return func(*args, **(kwargs or {}))

    def __enter__(self):
        super().__enter__()
        self.dispatch.__enter__()
        return self

    def __exit__(self, *exc):
        self.dispatch.__exit__(*exc)
        return super().__exit__(*exc)


class _WaitsDispatch(TorchDispatchMode):
    def __init__(self, waits, weight_ptrs):
        super().__init__()
        self.waits, self.weight_ptrs = waits, weight_ptrs

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if func in VALUE_SHAPED and not (func is aten.repeat_interleave.Tensor and kwargs.get("output_size")):
            self.waits.syncs += 1
        elif func is aten.index.Tensor and any(i is not None and i.dtype == torch.bool for i in args[1]):
            self.waits.syncs += 1
        out = func(*args, **kwargs)
        if (func.overloadpacket in (aten.to, aten._to_copy) and out.dtype != args[0].dtype
                and args[0].untyped_storage().data_ptr() in self.weight_ptrs):
            self.waits.weight_casts += 1
        return out


class Launches(TorchDispatchMode):
    """Counts, by operator, the ATen operators that launch work on a device: neither a view nor one that hands
    back its input untouched (dropout in eval)."""

    def __init__(self):
        super().__init__()
        self.ops = collections.Counter()

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        writes = any(a.alias_info is not None and a.alias_info.is_write for a in func._schema.arguments)
        if not func.is_view and (writes or not any(out is a for a in args)):
            self.ops[func._schema.name.removeprefix("aten::")] += 1
        return out


def launches_per_greedy_step(rows=8, prompt_len=32):
    """{operator: launches a step} of greedy decoding at GPT-2-small's shape (random weights) on a CPU, over a
    steady run: what generate() launches for READ_EVERY more steps (one host read among them), per step."""
    torch.manual_seed(0)
    model = model_module.GPT(model_module.GPTConfig()).eval()
    prompts = torch.randint(0, model.config.vocab_size, (rows, prompt_len)).tolist()
    counted = []
    for steps in (READ_EVERY, 2 * READ_EVERY):
        with Launches() as launches:
            generate(model, prompts, Decoding(1 + steps), eos_token_id=-1)
        counted.append(launches.ops)
    return {op: n / READ_EVERY for op, n in (counted[1] - counted[0]).most_common()}


@contextlib.contextmanager
def kv_cache_traffic():
    """Counts KV-cache bytes: read by attention (the slots each decode step attends to; a SharedPromptCache's row
    once for its prompt's rows) and copied by row selection (rows dropped, reordered or repeated). Yields the
    running totals."""
    traffic = {"read": 0, "copied": 0}
    full, shared = model_module.KVCache, model_module.SharedPromptCache
    originals = [(full, "update"), (full, "select_rows"), (shared, "attend")]
    originals = [(cls, name, getattr(cls, name)) for cls, name in originals]

    def counted(name, method):
        def wrapper(self, *args):
            out = method(self, *args)
            if name == "update":
                traffic["read"] += out[0].nbytes + out[1].nbytes
            elif name == "attend":
                traffic["read"] += self.kv[:, :, :, :args[3].size(-1)].nbytes  # the slots its mask covers
            else:
                traffic["copied"] += out.kv.nbytes
            return out
        return wrapper
    with contextlib.ExitStack() as patched:
        for cls, name, method in originals:
            patched.enter_context(mock.patch.object(cls, name, counted(name, method)))
        yield traffic


@contextlib.contextmanager
def decoding_steps():
    """Counts decoding steps as LogitsProcessors.no_early_eos calls (MBR's candidates share a prefill: forward
    passes would undercount them). Yields a list whose length is the count."""
    steps, no_early_eos = [], LogitsProcessors.no_early_eos

    def counted(self, *args):
        steps.append(1)
        return no_early_eos(self, *args)
    with mock.patch.object(LogitsProcessors, "no_early_eos", counted):
        yield steps


def decode_counts(model, prompts, cfg, compact_below=0.5):
    """(host syncs per decoding step, weight casts per decoding step, KV bytes copied / read) of summarizing
    `prompts` in evaluate.py's batches, eagerly, with generate()'s GPU rule for dropping ended rows by default."""
    weight = model.lm_head.weight
    room = memory.generation_memory(cfg, weight.device)
    with decoding_steps() as steps, kv_cache_traffic() as traffic, Waits(list(model.parameters())) as waits:
        decoding = part(cfg, Decoding)
        for batch in memory.generation_batches(prompts, decoding, cfg.gen_batch_size, model.config, room,
                                               weight.dtype):
            generate(model, [prompts[i] for i in batch], decoding, eos_token_id=data.EOT_ID, seed=cfg.seed,
                     mbr_pick=mbr.pick, compact_below=compact_below)
    return waits.syncs / len(steps), waits.weight_casts / len(steps), traffic["copied"] / traffic["read"]


# ---- the figures ------------------------------------------------------------------------------------------------

def train_counts(folder, steps, samsum_csv=SAMSUM_CSV, nproc=2):
    """{rank: counts} of train.py under torchrun on `nproc` gloo ranks, `steps` steps, compile=True counted."""
    csv, source = training_csv(folder, samsum_csv)
    out = os.path.join(folder, "train-counts.json")
    args = [f"--train_csv={csv}", "--validation_csv=", "--val_fraction=0.05", f"--out_dir={folder}/train",
            f"--data_cache_dir={folder}/cache", "--init_from=scratch", "--n_layer=2", "--n_head=2", "--n_embd=32",
            "--block_size=1024", "--max_new_tokens=80", "--device=cpu", "--dtype=float32", "--compile=True",
            "--batch_size=16", "--micro_batch_size=4", f"--max_iters={steps}", f"--eval_interval={steps}",
            "--eval_val_batches=1", "--rouge_samples=0", "--best_metric=val_loss", "--sample_submission_csv=",
            "--evaluate_after=False", "--predict_after=False"]
    env = child_environ({k: v for k, v in os.environ.items() if not k.startswith("ACCELERATE_")}, OMP_NUM_THREADS="1")
    code, output = torchrun(["-m", "bench.compile", out, *args], nproc, env, timeout=600)
    if code != 0:
        raise RuntimeError(f"training worker failed: {output[-2000:]}")
    return {rank: json.load(open(f"{out}.{rank}")) for rank in range(nproc)}, source


def bench_compile(args, device):
    rows = []
    with tempfile.TemporaryDirectory() as folder:
        counts, source = train_counts(folder, args.compile_steps, args.samsum_csv)
        rows += [dict(section="compile", figure="train:graph_breaks",
                      value=max(c["graph_breaks"] for c in counts.values()), target="0"),
                 dict(section="compile", figure="train:compilations",
                      value=max(c["compilations"].get("train", 0) for c in counts.values()), target="<= 2")]
        # a demo model trained briefly: it ends its summaries with a real <|endoftext|>
        cfg = train_quietly([*demo_arguments(folder), f"--out_dir={folder}/demo", "--max_iters=60",
                             "--eval_interval=60", "--rouge_samples=0", "--best_metric=val_loss"])
        summarizer = inference.open_summarizer(dataclasses.replace(cfg, ckpt=""))
        prompts, _ = summarizer.prompts(data.load_splits(summarizer.cfg).val.dialogues)
        syncs, casts, kv = decode_counts(summarizer.model.eval(), prompts,
                                         dataclasses.replace(summarizer.cfg, gen_batch_size=64))
        rows += [dict(section="compile", figure="decode:host_syncs_per_step", value=syncs, target="<= 1/8"),
                 dict(section="compile", figure="decode:weight_casts_per_step", value=casts, target="0"),
                 dict(section="compile", figure="decode:kv_bytes_copied_vs_read", value=kv, target="<= 0.25")]
    from bench import fsdp as bench_fsdp
    rows += bench_fsdp.bench_fsdp(args)
    rows.append(dict(section="compile", figure="setup", value=f"train: {args.compile_steps} steps of {source} "
                     f"batches on 2 gloo ranks (DDP, 2 layers x 32, 4 rows per micro-batch); decode: the demo model "
                     f"({len(prompts)} validation dialogues, gen_batch_size 64, its own <|endoftext|>), greedy"))
    return rows


def worker(out, argv):
    """One torchrun rank: train.main(argv) with compilation counted, then its counts in out.<rank>."""
    import train
    with counted_compiles() as (counter, breaks):
        train.main(argv)
    with open(f"{out}.{os.environ['RANK']}", "w") as f:
        json.dump({"compilations": dict(counter.compilations), "graph_breaks": breaks()}, f)


if __name__ == "__main__":
    worker(sys.argv[1], sys.argv[2:])


def summary_end_token(model, prompts, max_new):
    """The token this random-weight model emits most often after a few tokens: as EOS, rows end at varied lengths,
    as a fine-tuned model's summaries do (a random one never says <|endoftext|>)."""
    counts = {}
    for row in generate(model, prompts[:16], Decoding(max_new_tokens=max_new), eos_token_id=-1):
        for token in set(row[4:]):
            counts[token] = counts.get(token, 0) + 1
    return max(counts, key=counts.get)
