"""python -m bench --section=compile: what a GPU run would waste, counted on the CPU: graph breaks and compilations,
the host's waits for the device, weight casts, KV-cache bytes copied against read."""
import collections
import contextlib
import dataclasses
import json
import os
import sys
import tempfile
import types
from unittest import mock

import torch
from torch.utils._python_dispatch import TorchDispatchMode

import data
import model as model_module
from bench import SAMSUM_CSV, child_environ, demo_arguments, torchrun, train_quietly, training_csv
from config import Decoding, part
from generate import READ_EVERY, LogitsProcessors, generate
from summarizer import inference, memory

aten = torch.ops.aten


def fresh_compiles():  # what follows is counted from its first compilation
    torch._dynamo.reset()
    torch._dynamo.utils.counters.clear()


def graph_breaks():  # since fresh_compiles()
    return sum(torch._dynamo.utils.counters["graph_break"].values())


@contextlib.contextmanager
def counted_compiles():
    """torch.compile counting the graphs with an operation: a model's under 'train', a function's under 'decode'."""
    counter, real = types.SimpleNamespace(compilations=collections.Counter()), torch.compile
    fresh_compiles()

    def compile(fn, **options):
        name = "train" if isinstance(fn, torch.nn.Module) else "decode"

        def backend(gm, example_inputs):
            if any(node.op.startswith("call") for node in gm.graph.nodes):
                counter.compilations[name] += 1
            return gm.forward
        options.pop("backend", None)
        return real(fn, backend=backend, **options)
    with mock.patch.object(torch, "compile", compile):
        yield counter, graph_breaks


HOST_READS = ("tolist", "numpy")  # read tensor values without dispatching an op
VALUE_SHAPED = {aten._local_scalar_dense.default, aten.nonzero.default, aten.equal.default, aten._unique2.default,
                aten.unique_dim.default, aten.unique_consecutive.default, aten.masked_select.default,
                aten.repeat_interleave.Tensor}


class Waits(TorchDispatchMode):
    """Counts the host's waits for the device (values read, or shaping an output) and casts of `weights`."""

    def __init__(self, weights=()):
        super().__init__()
        self.syncs = self.weight_casts = 0
        self.weight_ptrs, self.reads = {w.untyped_storage().data_ptr() for w in weights}, contextlib.ExitStack()

    def __enter__(self):
        for name in HOST_READS:
            self.reads.enter_context(counting(torch.Tensor, name, self.host_read))
        return super().__enter__()

    def __exit__(self, *exc):
        self.reads.close()
        return super().__exit__(*exc)

    def host_read(self, *_):
        self.syncs += 1

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if func in VALUE_SHAPED and not (func is aten.repeat_interleave.Tensor and kwargs.get("output_size")):
            self.syncs += 1
        elif func is aten.index.Tensor and any(i is not None and i.dtype == torch.bool for i in args[1]):
            self.syncs += 1
        out = func(*args, **kwargs)
        if (func.overloadpacket in (aten.to, aten._to_copy) and out.dtype != args[0].dtype
                and args[0].untyped_storage().data_ptr() in self.weight_ptrs):
            self.weight_casts += 1
        return out


class Launches(TorchDispatchMode):
    """Counts the ATen operators that launch work: neither a view nor one that hands back its input (eval dropout)."""

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
    """{operator: launches a step} of greedy at GPT-2-small's shape: READ_EVERY more steps' launches, per step."""
    torch.manual_seed(0)
    model = model_module.GPT(model_module.GPTConfig()).eval()
    prompts = torch.randint(0, model.config.vocab_size, (rows, prompt_len)).tolist()
    counted = []
    for steps in (READ_EVERY, 2 * READ_EVERY):
        with Launches() as launches:
            generate(model, prompts, Decoding(1 + steps), eos_token_id=-1)
        counted.append(launches.ops)
    return {op: n / READ_EVERY for op, n in (counted[1] - counted[0]).most_common()}


def counting(cls, name, count):
    """cls.name patched to call count(self, its output, its arguments) after each call."""
    method = getattr(cls, name)

    def counted(self, *args, **kwargs):
        out = method(self, *args, **kwargs)
        count(self, out, *args)
        return out
    return mock.patch.object(cls, name, counted)


@contextlib.contextmanager
def kv_cache_traffic():
    """KV-cache bytes read by attention (a SharedPromptCache's row once for its prompt's rows: the slots its masks
    cover) and copied by row selection."""
    traffic, full, shared = collections.Counter(), model_module.KVCache, model_module.SharedPromptCache
    with (counting(full, "update", lambda _, out, *args: traffic.update(read=out[0].nbytes + out[1].nbytes)),
          counting(full, "select_rows", lambda _, out, *args: traffic.update(copied=out.kv.nbytes)),
          counting(shared, "attend", lambda cache, _, q, slots, kv, masks: traffic.update(
              read=sum(cache.kv[:m.size(0), :, :, :m.size(-1)].nbytes for m in masks)))):
        yield traffic


@contextlib.contextmanager
def decoding_steps():
    """Decoding steps as no_early_eos calls: MBR's candidates share a prefill, forward passes would undercount."""
    steps = []
    with counting(LogitsProcessors, "no_early_eos", lambda *_: steps.append(1)):
        yield steps


def decode_counts(model, prompts, cfg, compact_below=0.5):
    """(host syncs a step, weight casts a step, KV bytes copied / read) of `prompts` in evaluate.py's batches."""
    weight, decoding = model.lm_head.weight, part(cfg, Decoding)
    room = memory.generation_memory(cfg, weight.device)
    with decoding_steps() as steps, kv_cache_traffic() as traffic, Waits(list(model.parameters())) as waits:
        for batch in memory.generation_batches(prompts, decoding, cfg.gen_batch_size, model.config, room, weight.dtype):
            generate(model, [prompts[i] for i in batch], decoding, eos_token_id=data.EOT_ID, seed=cfg.seed,
                     mbr_pick=inference.mbr_pick, compact_below=compact_below)
    return waits.syncs / len(steps), waits.weight_casts / len(steps), traffic["copied"] / traffic["read"]


def train_counts(folder, steps, samsum_csv=SAMSUM_CSV, nproc=2):
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
    from bench import fsdp as bench_fsdp
    with tempfile.TemporaryDirectory() as folder:
        counts, source = train_counts(folder, args.compile_steps, args.samsum_csv)
        # a demo model trained briefly: it ends its summaries with a real <|endoftext|>
        cfg = train_quietly([*demo_arguments(folder), f"--out_dir={folder}/demo", "--max_iters=60",
                             "--eval_interval=60", "--rouge_samples=0", "--best_metric=val_loss"])
        summary_model = inference.open_summary_model(dataclasses.replace(cfg, ckpt=""))
        prompts, _ = summary_model.prompts(data.load_splits(summary_model.cfg).val.dialogues)
        syncs, casts, kv = decode_counts(summary_model.model.eval(), prompts,
                                         dataclasses.replace(summary_model.cfg, gen_batch_size=64))
    compilations = max(c["compilations"].get("train", 0) for c in counts.values())
    return [dict(figure="train:graph_breaks", value=max(c["graph_breaks"] for c in counts.values()), target="0"),
            dict(figure="train:compilations", value=compilations, target="<= 2"),
            dict(figure="decode:host_syncs_per_step", value=syncs, target="<= 1/8"),
            dict(figure="decode:weight_casts_per_step", value=casts, target="0"),
            dict(figure="decode:kv_bytes_copied_vs_read", value=kv, target="<= 0.25"),
            *bench_fsdp.bench_fsdp(args),
            dict(figure="setup", value=f"train: {args.compile_steps} steps of {source} batches on 2 gloo ranks (DDP, "
                 f"2 layers x 32, 4 rows per micro-batch); decode: the demo model ({len(prompts)} validation "
                 f"dialogues, gen_batch_size 64, its own <|endoftext|>), greedy")]


def worker(out, argv):
    import train
    with counted_compiles() as (counter, breaks):
        train.main(argv)
    with open(f"{out}.{os.environ['RANK']}", "w") as f:
        json.dump({"compilations": dict(counter.compilations), "graph_breaks": breaks()}, f)


if __name__ == "__main__":
    worker(sys.argv[1], sys.argv[2:])


def summary_end_token(model, prompts, max_new):
    """The token a random model emits most after a few: as EOS, rows end at varied lengths, as summaries do."""
    rows = generate(model, prompts[:16], Decoding(max_new_tokens=max_new), eos_token_id=-1)
    counts = collections.Counter(token for row in rows for token in set(row[4:]))
    return max(counts, key=counts.get)
