"""python -m bench --section=compile: FSDP's bytes per rank per optimizer step of each Kaggle preset, counted on two
gloo ranks with a tiny GPT of the preset's settings, scaled per FSDP unit to the preset's model."""
import json
import math
import os
import socket
import subprocess
import sys
import tempfile
from unittest import mock

import torch
import torch.distributed.fsdp
from torch.distributed.tensor import DTensor
from torch.utils import _pytree as pytree
from torch.utils._python_dispatch import TorchDispatchMode

import train
from bench import GIB, PRESETS, ROOT, child_environ, training_csv
from bench.memory import T4_USABLE_GIB, build, t4_micro_batch
from config import Config, load_config, read_preset
from model import PRETRAINED
from summarizer.memory import reduce_once_bytes
from summarizer.preparation import prepare
from summarizer.process import Process, choose_precision

RANKS = 2
TINY = ["--init_from=scratch", "--n_layer=2", "--n_head=2", "--n_embd=32", "--block_size=64", "--max_new_tokens=16",
        "--device=cpu", "--compile=False", "--backend=fsdp", "--micro_batch_size=1", "--max_iters=1",
        "--rouge_samples=0", "--best_metric=val_loss", "--sample_submission_csv=", "--dropout=0.0",
        "--lora_dropout=0.0"]
KINDS = {"all_gather": ("allgather", "all_gather"), "reduce_scatter": ("reduce_scatter",),
         "all_reduce": ("allreduce", "all_reduce")}
RING = {"all_gather": (RANKS - 1) / RANKS, "reduce_scatter": (RANKS - 1) / RANKS,
        "all_reduce": 2 * (RANKS - 1) / RANKS}
NOT_COMMUNICATION = ("wait_tensor", "_wrap_tensor_autograd")


class CollectiveBytes(TorchDispatchMode):
    """Each collective as {kind, numel, itemsize} of the buffer it moves whole (an all-gather's output)."""

    def __init__(self):
        super().__init__()
        self.ops = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        if any(t is DTensor for t in types):
            return NotImplemented  # DTensor runs first and issues its collectives on plain tensors, seen then
        out = func(*args, **(kwargs or {}))
        namespace, _, name = func.name().partition("::")
        kind = next((k for k, words in KINDS.items() if any(w in name for w in words)), name)
        if namespace in ("c10d", "_c10d_functional") and name not in NOT_COMMUNICATION:
            inputs = [t for t in pytree.tree_leaves((args, kwargs)) if isinstance(t, torch.Tensor)]
            everything = inputs + [t for t in pytree.tree_leaves(out) if isinstance(t, torch.Tensor)]
            whole = [max(everything, key=torch.Tensor.numel)] if kind in ("all_gather", "reduce_scatter") else inputs
            self.ops.append({"kind": kind, "numel": sum(t.numel() for t in whole),
                             "itemsize": whole[0].element_size()})
        return out


def units(model, world_size=RANKS):
    """{unit: {kind: numel}} of Process.shard's FSDP units, dim 0 padded (a DTensor has the full shape); n_layer."""
    def padded(params):
        return sum(math.ceil(p.shape[0] / world_size) * world_size * (p.numel() // p.shape[0]) for p in params)

    def unit(params):
        return {"all_gather": padded(params), "reduce_scatter": padded(p for p in params if p.requires_grad)}
    blocks = model.transformer.h
    in_blocks = {id(p) for p in blocks.parameters()}
    return {"root": unit([p for p in model.parameters() if id(p) not in in_blocks]),
            "block": unit(list(blocks[0].parameters())), "n_layer": len(blocks)}


def count_step(args, before, port):
    os.environ["MASTER_PORT"] = str(port)  # a fresh store: one re-created on the same port races
    shard = torch.distributed.fsdp.fully_shard
    # before: Process.shard as it was, fp32 all-gathers
    with mock.patch.object(torch.distributed.fsdp, "fully_shard", (lambda module, mp_policy=None: shard(module))
                           if before else shard):
        cfg = load_config([*args, "--fsdp_reduce_once=False"] if before else args)
        with Process(cfg) as proc:
            trainer = train.Trainer(prepare(cfg, proc), proc)
            with CollectiveBytes() as counted:
                loss = trainer.train_step(0)[0]
            return {"ops": counted.ops, "units": units(trainer.model), "loss": loss,
                    "reduce_once": bool(proc.parallel.reduce_once),
                    "micro_steps": len(trainer.setup.batches(0).micro_batches)}


def worker(spec_path, out_path):
    with open(spec_path) as f:
        spec = json.load(f)
    results = [count_step(run["args"], run["before"], run["port"]) for run in spec]
    if os.environ["RANK"] == "0":
        with open(out_path, "w") as f:
            json.dump(results, f)


def free_port():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def run_ranks(runs, tmp, timeout=100):
    """count_step of each of `runs` ({"args": train.py arguments, "before": bool}) on RANKS processes, in turn."""
    spec, out = os.path.join(tmp, "spec.json"), os.path.join(tmp, "counted.json")
    with open(spec, "w") as f:
        json.dump([dict(run, port=free_port()) for run in runs], f)
    env = child_environ({k: v for k, v in os.environ.items() if not k.startswith("ACCELERATE_")},
                        MASTER_ADDR="127.0.0.1", WORLD_SIZE=str(RANKS), OMP_NUM_THREADS="1")
    env.setdefault("GLOO_SOCKET_IFNAME", "lo")
    logs = [open(os.path.join(tmp, f"rank{rank}.log"), "w+") for rank in range(RANKS)]
    ranks = [subprocess.Popen([sys.executable, "-m", "bench.fsdp", "--worker", spec, out], cwd=ROOT,
                              env=dict(env, RANK=str(rank), LOCAL_RANK=str(rank)), stdout=log,
                              stderr=subprocess.STDOUT) for rank, log in enumerate(logs)]
    try:
        codes = [p.wait(timeout=timeout) for p in ranks]
    except subprocess.TimeoutExpired:
        codes = None
    finally:
        for p in ranks:
            p.kill()  # a no-op for one that ended
            p.wait()
    if codes != [0] * RANKS:
        for log in logs:
            log.seek(0)
        output = "".join(f"--- rank {rank}\n{log.read()[-3000:]}" for rank, log in enumerate(logs))
        raise RuntimeError(f"counting ranks failed ({'timed out' if codes is None else codes}):\n{output}")
    with open(out) as f:
        return json.load(f)


def per_unit(counted):
    """{(unit, kind): (operations per unit instance, itemsize)}, each carrying one unit's numel; all-reduced bytes."""
    tiny = counted["units"]
    instances = {"root": 1, "block": tiny["n_layer"]}
    counts, scalars = {}, 0
    for op in counted["ops"]:
        if op["kind"] not in KINDS:
            raise RuntimeError(f"collective {op['kind']} is not counted here")
        if op["kind"] == "all_reduce":
            scalars += op["numel"] * op["itemsize"]
            continue
        matches = [u for u in instances if op["kind"] in tiny[u] and tiny[u][op["kind"]] == op["numel"]]
        if len(matches) != 1:
            raise RuntimeError(f"a {op['kind']} of {op['numel']} elements is no one FSDP unit's: {tiny}")
        n, itemsize = counts.get((matches[0], op["kind"]), (0, op["itemsize"]))
        assert itemsize == op["itemsize"], (op, itemsize)
        counts[(matches[0], op["kind"])] = (n + 1, itemsize)
    return {key: (n / instances[key[0]], itemsize) for key, (n, itemsize) in counts.items()}, scalars


def scaled_bytes(counted, shape_units):
    counts, scalars = per_unit(counted)
    instances = {"root": 1, "block": shape_units["n_layer"]}
    result = {"all_gather": 0.0, "reduce_scatter": 0.0, "all_reduce": scalars * RING["all_reduce"]}
    for (unit, kind), (n, itemsize) in counts.items():
        result[kind] += n * instances[unit] * shape_units[unit][kind] * itemsize * RING[kind]
    return result


def t4_dtype(preset):
    return choose_precision(preset.get("dtype", "auto"), "cuda", (7, 5))[0]


def tiny_args(name, preset, csv, folder):
    cfg = Config(**{**preset, "micro_batch_size": t4_micro_batch(name, preset)})
    steps = -(-cfg.batch_size // RANKS // cfg.micro_batch_size)  # a rank's micro-steps, its rows block_size long
    return [*TINY, f"--batch_size={steps * RANKS}", f"--dtype={t4_dtype(preset)}",
            f"--gradient_checkpointing={cfg.gradient_checkpointing}", f"--lora_rank={cfg.lora_rank}",
            f"--train_csv={csv}", f"--data_cache_dir={os.path.join(folder, 'cache')}"]


def bench_fsdp(args=None):
    """GiB per rank per optimizer step of each preset as if --backend=fsdp, and what fsdp_reduce_once holds."""
    presets = {name: read_preset(os.path.join(ROOT, path)) for name, path in PRESETS.items()}
    with tempfile.TemporaryDirectory() as tmp:
        csv, _ = training_csv(tmp, samsum_csv="", rows=48)  # random chats: what is counted does not depend on them
        index = {(name, before): (tuple(tiny_args(name, preset, csv, tmp)), before)
                 for name, preset in presets.items() for before in (False, True)}
        runs = list(dict.fromkeys(index.values()))  # presets alike run once
        counted = dict(zip(runs, run_ranks([{"args": [*args, f"--out_dir={tmp}/out{i}"], "before": before}
                                            for i, (args, before) in enumerate(runs)], tmp), strict=True))
    rows = []
    for name, preset in presets.items():
        model = build(PRETRAINED[name], "meta", Config(**preset))
        now, before = (scaled_bytes(counted[index[name, b]], units(model)) for b in (False, True))
        common = dict(preset=PRESETS[name], preset_backend=preset.get("backend", "ddp"),
                      dtype=t4_dtype(preset), lora_rank=preset.get("lora_rank", 0),
                      micro_steps=counted[index[name, False]]["micro_steps"])
        for when, sent in (("", now), ("_before", before)):
            rows.append(dict(common, figure=f"fsdp:{name}:comm_gib_per_step{when}", value=sum(sent.values()) / GIB,
                             **{f"{kind}_gib": b / GIB for kind, b in sent.items()}))
        rows.append(dict(common, figure=f"fsdp:{name}:comm_vs_before", value=sum(now.values()) / sum(before.values())))
        held, kept = reduce_once_bytes(model, RANKS, getattr(torch, t4_dtype(preset)))
        rows.append(dict(common, figure=f"fsdp:{name}:reduce_once_gib_per_rank", value=(held + kept) / GIB,
                         held_gib=held / GIB, kept_gib=kept / GIB, fits_t4=(held + kept) / GIB <= T4_USABLE_GIB))
    return rows


if __name__ == "__main__":  # a counting rank of run_ranks
    worker(*sys.argv[2:])
