"""The preflight, seconds before the GPU hours (the Kaggle notebook's training cell runs it first): train.py's verdict
before step 1 by train.py's own code, each refusal in its line (settings, out_dir, inputs, disk, model, and max_time
by the run's rule on a step, compiled as the run's, and a batch of summaries timed); then versions, GPUs, /dev/shm,
and a collective between the run's processes, trying the NCCL settings in turn. One verdict line, exit 1 on a no-go,
a JSON report.

    python -m bench.preflight <preset.py> [--key=value ...] [--report=PATH] [--nproc_per_node=N]
"""
import argparse
import contextlib
import gc
import importlib.metadata
import json
import os
import platform
import shutil
import subprocess
import sys
import time
import types
from dataclasses import replace

import torch

import data
import train
from bench import child_environ, torchrun
from command_line import UserError, atomic_write, first_line
from config import Config, flags_given, load_config, settings_given
from model import GPT, GPTConfig
from summarizer import run_folder
from summarizer.backends import NCCL_SETTINGS, end_process_group, meet, nccl_flags, nccl_in_effect
from summarizer.launch import one_line_errors, process_age
from summarizer.loading import add_adapters, lora_settings, resuming, trained_shape
from summarizer.preparation import check_before_model, prepare, read_settings
from summarizer.process import Process, choose_precision

SHM_BYTES = 512 * 2**20  # below this, NCCL's shared-memory transport can fail to set up (Docker's default: 64 MB)
NOT_RUN = "not run"


def check(status, detail, **figures):
    return dict(status=status, detail=detail, **figures)


def versions():
    installed = {d.metadata["Name"].lower(): d.version for d in importlib.metadata.distributions()}
    found = dict(python=platform.python_version(), torch=torch.__version__, cuda=torch.version.cuda,
                 nccl=".".join(map(str, torch.cuda.nccl.version())) if torch.cuda.is_available() else None,
                 triton=installed.get("triton"), driver=None,
                 **{name: installed.get(name) for name in ("transformers", "accelerate", "peft", "numpy", "pandas")})
    if shutil.which("nvidia-smi"):
        smi = subprocess.run(["nvidia-smi", "--query-gpu=driver_version", "--format=csv,noheader"],
                             capture_output=True, text=True, timeout=60)
        found["driver"] = smi.stdout.strip().splitlines()[0] if smi.returncode == 0 and smi.stdout.strip() else None
    return check("ok", " ".join(f"{k} {v}" for k, v in found.items() if v), **found)


def gpus(cfg):
    if not torch.cuda.is_available():
        if cfg.device.startswith("cuda"):  # train.py stops at once: so does the notebook, here
            return check("failed", f"device={cfg.device} but no CUDA GPU is visible: on Kaggle, set the notebook's "
                                   f"accelerator to GPU T4 x2 (Settings > Accelerator) and run again; on a machine "
                                   f"without a GPU, add --device=cpu")
        return check(NOT_RUN, "no CUDA GPU")
    count = torch.cuda.device_count()
    listed = [dict(name=p.name, capability=f"{p.major}.{p.minor}", memory_gib=round(p.total_memory / 2**30, 1))
              for p in map(torch.cuda.get_device_properties, range(count))]
    peer = {f"{i}->{j}": torch.cuda.can_device_access_peer(i, j) for i in range(count) for j in range(count) if i != j}
    reach = ("no peer access between them: NCCL goes through host memory (/dev/shm)" if peer and not any(peer.values())
             else "peer access" if peer else "one GPU")
    return check("ok", f"{count} x {listed[0]['name']} ({listed[0]['memory_gib']} GiB); {reach}", gpus=listed,
                 peer_access=peer)


def shared_memory():
    if not os.path.isdir("/dev/shm"):
        return check(NOT_RUN, "no /dev/shm")
    usage = shutil.disk_usage("/dev/shm")
    free, figures = usage.free // 2**20, dict(total_mib=usage.total // 2**20, free_mib=usage.free // 2**20)
    return (check("warning", f"/dev/shm has {free} MiB free: NCCL's shared-memory transport may fail; "
                             f"NCCL_SHM_DISABLE=1 avoids it", **figures) if usage.free < SHM_BYTES
            else check("ok", f"/dev/shm {free} MiB free", **figures))


def start(cfg, start_ckpt, nproc):
    """train.py's checks before it builds its model, in its order and lines, as rank 0 of `nproc` processes meets
    them: the precision, out_dir made (one it cannot write is not the disk's), check_before_model, the disk plan."""
    rank_0, figures = types.SimpleNamespace(world_size=nproc, is_main=True, barrier=data.no_op), {}
    try:
        cuda = cfg.device != "cpu" and torch.cuda.is_available()
        choose_precision(cfg.dtype, "cuda" if cuda else "cpu", torch.cuda.get_device_capability() if cuda else None)
        run_folder.make(cfg.out_dir)
        if who := run_folder.training_in(cfg.out_dir):
            raise UserError(run_folder.in_use(cfg.out_dir, who))
        _, splits, after = check_before_model(cfg, rank_0)
        with torch.device("meta"):  # the run's model, its tensors' sizes alone
            model = GPT(GPTConfig(**trained_shape(cfg, start_ckpt), vocab_size=50304))
        model = add_adapters(model, **lora_settings(cfg)) if cfg.lora_rank else model
        plan = run_folder.DiskPlan(model, cfg, small_lora=bool(cfg.lora_rank) and cfg.init_from != "scratch",
                                   train_rows=len(splits.train))
        figures = dict(peak_gb=round(plan.peak / 1e9, 2), parameters_m=round(model.num_params() / 1e6, 1))
        if problem := plan.problem(resuming(cfg)):
            raise UserError(problem)
    except UserError as e:
        return check("failed", str(e), **figures)
    return check("ok", f"{len(splits.train)} training and {len(splits.val)} validation examples, {sum(after.values())} "
                       f"dialogues to summarize after training; {cfg.batch_size} sequences per step over {nproc} "
                       f"process(es); init_from={cfg.init_from}; out_dir {cfg.out_dir}: {plan.describe()} at the "
                       f"peak for the run's {model.num_params() / 1e6:.0f}M-parameter model; {plan.room()}", **figures)


def judged(cfg, start_ckpt, given, started):
    """train.py's start up to its verdict before step 1 (prepare, verdict_only: out_dir as it was), in this process;
    with max_time under its start-up budget, a step and summaries timed. (What max_time buys, or ''; the line of a
    thin margin, or None.)"""
    # Under a budget the step compiles as the run's does: a compile is most of a start-up (76 s, cold, on an H200),
    # which an eager preflight would promise as steps; the compile it caches makes train.py's start sooner, not later.
    cfg = replace(cfg, backend="none", compile=cfg.compile if cfg.max_time is not None else False)
    with Process(cfg) as proc:
        setup = prepare(cfg, proc, start_ckpt, started, given, verdict_only=True)
        timed = "in one process" + ", its compile included" * proc.compile_training
    clock = setup.clock
    steps, thin = clock and 1 + clock.steps_left(setup.state.step), clock and clock.thin_margin()
    setup = None
    gc.collect()  # what the run held on GPU 0, which the collective's processes share
    torch.cuda.empty_cache()
    return (f"; max_time={cfg.max_time:g}: about {steps} steps fit (timed {timed})" if steps else "", thin)


def collective(cfg, nproc, device, timeout):
    """One all-reduce of 64 MB (NCCL's shared-memory and network transports both set up) between nproc processes
    under torchrun, for each NCCL setting in turn until one works."""
    base = {**(nccl_flags(cfg) if device == "cuda" else {}), **child_environ()}  # as Process: the user's own wins
    tries, tried = [base, *({**base, **setting} for setting in NCCL_SETTINGS  # those not in effect already
                            if device == "cuda" and setting.items() - base.items())], []
    for env in tries:
        code, output = torchrun(["-m", "bench.preflight", "--collective", f"--device={device}",
                                 f"--dist_start_timeout={timeout}"], nproc, env, timeout + 60)
        nccl = nccl_in_effect(env) if device == "cuda" else "gloo"
        said = [line for line in output.splitlines() if line.startswith(("error", "warning"))]  # else its last line
        tried.append(dict(setting=nccl, ok=code == 0, error=None if code == 0 else "no answer" if code is None else
                          (said or output.strip().splitlines() or [""])[-1][:300]))
        if code == 0:
            first = env is tries[0]
            detail = (f"{nproc} processes all-reduced 64 MB with {nccl}" +
                      ("" if first or device != "cuda" else f" (the run's own settings failed: set "
                       f"{' '.join(f'{k}={v}' for k, v in env.items() if k.startswith('NCCL_') and base.get(k) != v)}"
                       f" in the environment)"))
            return check("ok" if first else "failed", detail, tried=tried, use=nccl)
    return check("failed", f"no setting worked ({'; '.join(t['setting'] + ': ' + t['error'] for t in tried)}): see "
                           f"docs/troubleshooting.md (NCCL)", tried=tried)


def run_collective(argv):
    """--collective: this rank's part of collective() (under torchrun)."""
    cfg = load_config(argv)
    device = torch.device(f"cuda:{int(os.environ.get('LOCAL_RANK', 0))}" if cfg.device == "cuda" else "cpu")
    if device.type == "cuda":
        torch.cuda.set_device(device)
    meet(cfg, device, int(os.environ["WORLD_SIZE"]))
    data = torch.ones(16 * 2**20, device=device)  # 64 MB of float32
    torch.distributed.all_reduce(data)
    assert data[0].item() == int(os.environ["WORLD_SIZE"])
    end_process_group(device, clean=True, rank=int(os.environ["RANK"]))


def verdict(checks):
    failed, not_run = ([name for name, c in checks.items() if c["status"] == status] for status in ("failed", NOT_RUN))
    if not failed:  # near the budget's edge, a go that says so
        thin = checks.get("train.py", {}).get("thin")
        return ("go: every check that ran passed" + (f" ({', '.join(not_run)} not run)" if not_run else "")
                + (f"; but {thin}" if thin else ""))
    return "no-go: " + "; ".join(f"{name}: {checks[name]['detail']}" for name in failed)


def main(argv=None):
    started = time.monotonic() - (process_age() if argv is None else 0.0)  # what max_time counts from, as train.py's
    parser = argparse.ArgumentParser(prog="python -m bench.preflight", usage=__doc__.split("\n\n")[1].strip(),
                                     description=__doc__.partition("\n\n")[0], epilog="--key=value: any of "
                                     "train.py's settings, over the preset's (python train.py --help lists them)")
    parser.add_argument("--report", default="", help=f"the JSON report (default: out_dir/{run_folder.PREFLIGHT})")
    parser.add_argument("--nproc_per_node", type=int, default=0, help="the run's processes (default: one per GPU)")
    parser.add_argument("--collective_timeout", type=int, default=60, help="seconds each collective try may take")
    parser.add_argument("--collective", action="store_true", help=argparse.SUPPRESS)
    args, settings = parser.parse_known_args(argv)
    if args.collective:
        with one_line_errors():
            return run_collective(settings)
    checks, cfg, nproc, cuda = dict(versions=versions()), None, 1, False
    try:  # a wrong setting or a resume with nothing to resume: train.py's line, as the verdict
        cfg, start_ckpt, _ = read_settings(settings, train.__doc__)
    except UserError as e:
        checks["train.py"] = check("failed", str(e))
    if cfg:
        cuda = cfg.device != "cpu" and torch.cuda.is_available()
        nproc = args.nproc_per_node or (torch.cuda.device_count() if cuda else 1)
        checks.update(gpus=gpus(cfg), shared_memory=shared_memory(), **{"train.py": start(cfg, start_ckpt, nproc)})
        try:  # only where every check passed: seconds of the GPU's
            if not any(c["status"] == "failed" for c in checks.values()):
                fit, checks["train.py"]["thin"] = judged(cfg, start_ckpt, flags_given(settings), started)
                checks["train.py"]["detail"] += fit
        except (UserError, torch.OutOfMemoryError) as e:
            checks["train.py"].update(status="failed", detail=first_line(e))
    print("\n".join(f"{name:<14}{c['status']}: {c['detail']}" for name, c in checks.items()), flush=True)
    failed = any(c["status"] == "failed" for c in checks.values())  # what the run cannot start with: no GPU time spent
    checks["collective"] = (check(NOT_RUN, "one process") if nproc == 1 else check(NOT_RUN, "the run cannot start")
                            if failed else collective(cfg, nproc, "cuda" if cuda else "cpu", args.collective_timeout))
    print(f"{'collective':<14}{checks['collective']['status']}: {checks['collective']['detail']}", flush=True)
    return finish(args.report or report_path(settings), checks, "cuda" if cuda else "cpu", nproc)


def report_path(settings):
    """out_dir/PREFLIGHT, out_dir as the presets and flags give it (a setting in error aside), else its default."""
    out_dir = Config().out_dir
    for arg in sorted(settings, key=lambda arg: arg.startswith("--")):  # the presets, then the flags, each alone
        with contextlib.suppress(UserError):
            out_dir = {key: value for key, value, _ in settings_given([arg])}.get("out_dir", out_dir)
    return os.path.join(out_dir, run_folder.PREFLIGHT)


def finish(path, checks, device, nproc):
    """The verdict line, the report written (where it cannot be, one line says so), the exit status."""
    line, path = verdict(checks), os.path.abspath(path)
    report = dict(verdict=line, go=line.startswith("go"), device=device, processes=nproc, checks=checks)
    try:
        os.makedirs(os.path.dirname(path), exist_ok=True)
        with atomic_write(path) as f:
            json.dump(report, f, indent=2, default=str)
        where = f"report: {path}"
    except (OSError, UserError) as e:  # DiskFull is one
        where = f"report: not written to {path} ({getattr(e, 'strerror', None) or e}): give --report=<a writable path>"
    print(f"{line}\n{where}")
    return 0 if report["go"] else 1


if __name__ == "__main__":
    sys.exit(main())
