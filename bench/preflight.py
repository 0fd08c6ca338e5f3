"""The hardware preflight: what a user runs first on a new machine (the Kaggle notebook's first training cell), a few
minutes before the GPU hours. It checks, with the run's own settings (a preset and --key=value flags):
versions (Python, torch, CUDA, NCCL, Triton, the driver, the libraries); the GPUs and whether they reach each other;
/dev/shm; the disk and the output quota against the run's checkpoints; a collective between the processes under a
short timeout, trying the NCCL settings in turn (the run's, NCCL_CUMEM_HOST_ENABLE=0, NCCL_SHM_DISABLE=1); a few
compiled training steps at the run's shapes (random weights: nothing is downloaded) through an evaluation with its
compiled decoding and a save, with their compile seconds and peak memory; fp16 against fp32 losses; the run's
decoding at gen_batch_size prompts of the longest length, compiled, with its compile seconds. It ends in one
verdict line, exits 1 on a no-go, and writes a JSON report. On a CPU the same code runs with gloo and a tiny model,
and the GPU checks say `not run`.

    python -m bench.preflight config/kaggle_t4x2.py [--key=value ...] [--report=PATH] [--steps=N]
    python -m bench.preflight --device=cpu --report=preflight.json
"""
import argparse
import contextlib
import importlib.metadata
import json
import math
import os
import platform
import shutil
import subprocess
import sys
import tempfile
import time

import torch

import data
from bench import ROOT, child_environ
from config import load_config, settings_given
from model import GPT, GPTConfig
from summarizer import compiling, run_folder
from summarizer.backends import NCCL_SETTINGS, nccl_flags, nccl_in_effect
from summarizer.errors import UserError
from summarizer.files import atomic_write
from summarizer.launch import one_line_errors
from summarizer.loading import trained_shape
from summarizer.runtime import choose_precision

TINY = dict(n_layer=1, n_head=2, n_embd=32, block_size=128)  # a CPU's stand-in for the run's model ...
TINY_DECODING = ["--max_new_tokens=16"]  # ... and its summaries
DEMO_CSV = os.path.join(ROOT, "data", "demo", "train.csv")
DEMO_TEST_CSV = os.path.join(ROOT, "data", "demo", "test.csv")
WARM_BATCHES = 4  # decoded after the first (compiling) batch, for the warm rate
SHM_BYTES = 512 * 2**20  # below this, NCCL's shared-memory transport can fail to set up (Docker's default: 64 MB)
FP16_TOLERANCE = 0.02  # relative: fp16 autocast's losses over a few steps against fp32's
NOT_RUN = "not run"


def check(status, detail, **figures):
    return dict(status=status, detail=detail, **figures)


def version_of(package):
    try:
        return importlib.metadata.version(package)
    except importlib.metadata.PackageNotFoundError:
        return None


def versions():
    found = dict(python=platform.python_version(), torch=torch.__version__, cuda=torch.version.cuda,
                 nccl=".".join(map(str, torch.cuda.nccl.version())) if torch.cuda.is_available() else None,
                 triton=version_of("triton"), driver=None,
                 **{name: version_of(name) for name in ("transformers", "accelerate", "peft", "numpy", "pandas")})
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
    listed = [dict(name=torch.cuda.get_device_name(i),
                   capability=".".join(map(str, torch.cuda.get_device_capability(i))),
                   memory_gib=round(torch.cuda.get_device_properties(i).total_memory / 2**30, 1))
              for i in range(count)]
    peer = {f"{i}->{j}": torch.cuda.can_device_access_peer(i, j) for i in range(count) for j in range(count) if i != j}
    reach = ("no peer access between them: NCCL goes through host memory (/dev/shm)" if peer and not any(peer.values())
             else "peer access" if peer else "one GPU")
    return check("ok", f"{count} x {listed[0]['name']} ({listed[0]['memory_gib']} GiB); {reach}", gpus=listed,
                 peer_access=peer)


def shared_memory():
    if not os.path.isdir("/dev/shm"):
        return check(NOT_RUN, "no /dev/shm")
    usage = shutil.disk_usage("/dev/shm")
    figures = dict(total_mib=usage.total // 2**20, free_mib=usage.free // 2**20)
    if usage.free < SHM_BYTES:
        return check("warning", f"/dev/shm has {usage.free // 2**20} MiB free: NCCL's shared-memory transport may "
                                f"fail; NCCL_SHM_DISABLE=1 avoids it", **figures)
    return check("ok", f"/dev/shm {usage.free // 2**20} MiB free", **figures)


def inputs(cfg, named):
    """The run's CSVs, read as the run reads them: missing or unreadable is a no-go where the command named the file
    (`named`: the keys a preset or flag set); a default path that is not there is a warning (the checks below train
    on the demo data instead)."""
    files = [("train_csv", False), ("validation_csv", False), ("test_csv", True)]
    said, failed, missing = [], [], []
    for key, test in files:
        path = getattr(cfg, key)
        if not path:
            continue
        try:
            table = data.read_table(path, key, cfg, test=test)
            said.append(f"{key} {path}: {len(table.ids)} rows")
        except UserError as e:
            (failed if key in named or os.path.exists(path) else missing).append(str(e))
    if failed:
        return check("failed", "; ".join(failed))
    if missing:
        return check("warning", "; ".join(missing) + " (a default path; the checks train on the demo data)")
    return check("ok", "; ".join(said))


def disk(cfg, shape):
    """The run's checkpoints at their peak against out_dir's room (the output quota counted), for a model of
    `shape`: the run's."""
    with torch.device("meta"):
        model = GPT(GPTConfig(**shape))
    plan = run_folder.DiskPlan(model, cfg)
    (room, limit), problem = plan.space, plan.problem(resuming=False)
    figures = dict(peak_gb=round(plan.peak / 1e9, 2), room_gb=round(room / 1e9, 2), limited_by=limit,
                   parameters_m=round(model.num_params() / 1e6, 1))
    if problem:
        return check("failed", problem, **figures)
    return check("ok", f"out_dir {cfg.out_dir}: {plan.describe()} at the peak for the run's "
                       f"{model.num_params() / 1e6:.0f}M-parameter model; {plan.room()}", **figures)


def launch(args, nproc, env, timeout, cwd=ROOT):
    """A command under torchrun (nproc > 1) or alone: (exit code or None if it ran past `timeout`, its output)."""
    argv = ([sys.executable, "-m", "torch.distributed.run", f"--nproc_per_node={nproc}", "--standalone", *args]
            if nproc > 1 else [sys.executable, *args])
    try:
        done = subprocess.run(argv, cwd=cwd, env=env, capture_output=True, text=True, timeout=timeout)
    except subprocess.TimeoutExpired as e:
        return None, (e.stdout or b"").decode() if isinstance(e.stdout, bytes) else (e.stdout or "")
    return done.returncode, done.stdout + done.stderr


def error_line(output):
    lines = [line for line in output.splitlines() if line.startswith(("error", "warning"))]
    return lines[-1] if lines else (output.strip().splitlines() or [""])[-1][:300]


def collective(cfg, nproc, device, timeout):
    """(the check, the environment the run will use): one all-reduce of 64 MB (NCCL's shared-memory and
    network transports both set up) between nproc processes, for each NCCL setting in turn until one works."""
    base = child_environ()
    if device == "cuda":
        base = {**nccl_flags(cfg), **base}  # as Runtime sets them: the user's own environment wins
        tries = [base, *({**base, **setting} for setting in NCCL_SETTINGS)]
    else:
        tries = [base]
    tried = []
    for env in tries:
        code, output = launch(["-m", "bench.preflight", "--collective", f"--device={device}",
                               f"--dist_start_timeout={timeout}"], nproc, env, timeout + 60)
        nccl = nccl_in_effect(env) if device == "cuda" else "gloo"
        tried.append(dict(setting=nccl, ok=code == 0,
                          error=None if code == 0 else ("no answer" if code is None else error_line(output))))
        if code == 0:
            first = env is tries[0]
            detail = (f"{nproc} processes all-reduced 64 MB with {nccl}" +
                      ("" if first or device != "cuda" else f" (the run's own settings failed: set "
                       f"{' '.join(f'{k}={v}' for k, v in env.items() if k.startswith('NCCL_') and base.get(k) != v)}"
                       f" in the environment)"))
            return check("ok" if first else "failed", detail, tried=tried, use=nccl), env
    return check("failed", f"no setting worked ({'; '.join(t['setting'] + ': ' + t['error'] for t in tried)}): see "
                           f"docs/troubleshooting.md (NCCL)", tried=tried), None


def run_collective(argv):
    """--collective: this rank's part of collective() (under torchrun)."""
    cfg = load_config(argv)
    device = torch.device(f"cuda:{int(os.environ.get('LOCAL_RANK', 0))}" if cfg.device == "cuda" else "cpu")
    if device.type == "cuda":
        torch.cuda.set_device(device)
    from summarizer.backends import end_process_group, meet
    meet(cfg, device, int(os.environ["WORLD_SIZE"]))
    data = torch.ones(16 * 2**20, device=device)  # 64 MB of float32
    torch.distributed.all_reduce(data)
    assert data[0].item() == int(os.environ["WORLD_SIZE"])
    end_process_group(device, clean=True, rank=int(os.environ["RANK"]))


def training(argv, shape, cfg, nproc, env, args, folder, dtype, compile):
    """A few steps of train.py at the run's shapes, with an evaluation (ROUGE decoding included) and a save at
    the last one: (the check, its losses)."""
    csv = cfg.train_csv if os.path.isfile(cfg.train_csv) else DEMO_CSV
    out = os.path.join(folder, f"{dtype}-{compile}")
    run = [*argv, "--init_from=scratch", *(f"--{k}={v}" for k, v in shape.items()), f"--train_csv={csv}",
           "--validation_csv=", "--val_fraction=0.1", f"--out_dir={out}", f"--data_cache_dir={folder}/cache",
           f"--max_iters={args.steps}", f"--eval_interval={args.steps}", "--eval_val_batches=2",
           f"--rouge_samples={args.rouge_samples}", "--log_interval=1", "--max_time=", "--evaluate_after=False",
           "--predict_after=False", "--log_to=", "--overwrite=True", f"--dtype={dtype}", f"--compile={compile}",
           f"--output_quota_dir={folder}"]
    start = time.perf_counter()
    code, output = launch(["train.py", *run], nproc, env, args.timeout)
    seconds = time.perf_counter() - start
    if code != 0:
        return check("failed", "ran past --timeout" if code is None else error_line(output), seconds=seconds), []
    with open(os.path.join(out, run_folder.METRICS), encoding="utf-8") as f:
        rows = [json.loads(line) for line in f]
    with open(os.path.join(out, run_folder.CONFIG), encoding="utf-8") as f:
        config = json.load(f)  # micro_batch_size=auto: the one the run chose
    compiled = rows[0].get("compile_s")  # what train.py writes of its compile: its seconds, a fallback's reason
    fallbacks = [row["compile_fallback"] for row in rows if "compile_fallback" in row][:1]
    figures = dict(seconds=round(seconds, 1), compile_seconds=None if compiled is None else round(compiled, 1),
                   ms_per_iter=rows[-1]["ms_per_iter"], tokens_per_s=rows[-1]["tokens_per_s"],
                   mfu=rows[-1].get("mfu"), micro_batch_size=config["micro_batch_size"],
                   peak_mem_gib=rows[-1].get("peak_mem_gb"), losses=[row["loss"] for row in rows],
                   val_loss=rows[-1].get("val_loss"), compile_fallbacks=fallbacks)
    said = (f"{len(rows)} steps of micro-batches of {config['micro_batch_size']}, an evaluation and a save in "
            f"{seconds:.0f} s"
            + (f" (compiled in {compiled:.0f} s)" if compiled is not None else " (eager: compiling is a GPU check)"
               if not compile
               else "")
            + f"; {figures['tokens_per_s']:.0f} tokens/s" + (f", MFU {figures['mfu']:.1%}" if figures["mfu"] else "")
            + (f"; peak memory {figures['peak_mem_gib']:.1f} GiB" if figures["peak_mem_gib"] else ""))
    if compile and (fallbacks or compiled is None):
        why = fallbacks[0] if fallbacks else "its first step ran eagerly"
        return check("failed", f"{said}; torch.compile fell back to eager ({why}): the run works, slower; "
                               f"--compile=False says so up front", **figures), figures["losses"]
    return check("ok", said, **figures), figures["losses"]


def decoding(cfg, shape, dtype, device):
    """The run's decoding as predict.py runs it: prompts of real dialogues (test_csv, else the demo's) in the batches
    generation_batches makes, through inference.summarize with a compiled decode step, random weights in the run's
    dtype. The first batch pays the compile; WARM_BATCHES more give the warm summaries/s and count the graphs new
    prompt lengths and batch sizes compile. Random weights never end a summary early: every one runs to
    max_new_tokens, an upper bound on what trained weights take."""
    import dataclasses

    import data
    from summarizer import inference
    if not os.path.isfile(cfg.test_csv):
        cfg = dataclasses.replace(cfg, test_csv=DEMO_TEST_CSV)
    with device:
        model = GPT(GPTConfig(**shape, vocab_size=50304)).to(getattr(torch, dtype)).eval()
    prompts, _ = inference.Summarizer(model, cfg).prompts(data.read_test(cfg).dialogues)
    first, rest = prompts[:cfg.gen_batch_size], prompts[cfg.gen_batch_size:cfg.gen_batch_size * (1 + WARM_BATCHES)]
    step, seconds, graphs = compiling.CompiledDecodeStep(), [], []
    try:
        for batch in (first, rest):
            compiled = torch._dynamo.utils.counters["stats"]["unique_graphs"]
            if device.type == "cuda":
                torch.cuda.synchronize(device)
            start = time.perf_counter()
            inference.summarize(model, batch, cfg, contextlib.nullcontext(), decode_step=step)
            if device.type == "cuda":
                torch.cuda.synchronize(device)
            seconds.append(time.perf_counter() - start)
            graphs.append(torch._dynamo.utils.counters["stats"]["unique_graphs"] - compiled)
    except torch.OutOfMemoryError as e:
        return check("failed", f"out of memory decoding {cfg.gen_batch_size} prompts: lower --gen_batch_size or "
                               f"--gen_memory_gb ({str(e).splitlines()[0]})")
    finally:
        del model
        if device.type == "cuda":
            torch.cuda.empty_cache()
    warm = seconds[1] / max(len(rest), 1)
    lengths = sorted(len(p) for p in first + rest)
    figures = dict(compile_seconds=round(max(seconds[0] - warm * len(first), 0.0), 1),
                   summaries_per_s=round(1 / warm, 1) if warm else None, prompts=len(first) + len(rest),
                   prompt_tokens=[lengths[0], lengths[-1]], graphs_first_batch=graphs[0],
                   graphs_warm_batches=graphs[1], compiled=not step.failed)
    said = (f"{figures['prompts']} real dialogues ({lengths[0]}-{lengths[-1]} prompt tokens, up to "
            f"{cfg.max_new_tokens} new): compiled in {figures['compile_seconds']:.0f} s ({graphs[0]} graph(s)), then "
            f"{figures['summaries_per_s']} summaries/s with {graphs[1]} more graph(s) as lengths varied (random "
            f"weights run every summary to max_new_tokens: an upper bound)")
    if step.failed:
        return check("failed", f"{said}; torch.compile fell back to eager (its warning above): decoding works, "
                               f"slower", **figures)
    return check("ok", said, **figures)


def precision(run_losses, reference_losses, dtype):
    """The run's dtype against float32 over the same steps: a non-finite loss fails (an fp16 overflow); else each
    step's loss is compared by how far it moved from the first step's (what training did), relative to how far
    float32's moved; random weights make every first loss about ln(vocab) in any dtype, so the sizes alone say
    nothing."""
    if not run_losses or not reference_losses:
        return check(NOT_RUN, "a training run failed")
    figures = dict(losses=run_losses, float32_losses=reference_losses)
    if not all(math.isfinite(loss) for loss in run_losses):
        return check("failed", f"{dtype} training gave a non-finite loss ({run_losses}) where float32's were "
                               f"finite: an overflow; train with --dtype=float32 (or bfloat16 on Ampere or newer)",
                     **figures)
    moved = [reference_losses[0] - loss for loss in reference_losses]
    scale = max(abs(m) for m in moved)
    if scale < 1e-3 * abs(reference_losses[0]):
        return check(NOT_RUN, f"float32's loss moved by {scale:.2g} in {len(moved)} steps, too little to compare "
                              f"{dtype} with: raise --steps", **figures)
    worst = max(abs((run_losses[0] - a) - m) for a, m in zip(run_losses, moved, strict=True)) / scale
    figures["max_relative_difference"] = worst
    if worst > FP16_TOLERANCE:
        return check("failed", f"{dtype} training moved the loss differently from float32 by up to "
                               f"{100 * worst:.1f}% of float32's change (more than {100 * FP16_TOLERANCE:g}%): train "
                               f"with --dtype=float32 and report it", **figures)
    return check("ok", f"{dtype} training moved the loss within {100 * worst:.2f}% of float32's change", **figures)


def say(name, checks):
    print(f"{name:<14}{checks[name]['status']}: {checks[name]['detail']}", flush=True)


def verdict(checks):
    failed = [(name, c) for name, c in checks.items() if c["status"] == "failed"]
    if not failed:
        return "go: every check that ran passed" + (
            f" ({', '.join(n for n, c in checks.items() if c['status'] == NOT_RUN)} not run)"
            if any(c["status"] == NOT_RUN for c in checks.values()) else "")
    return "no-go: " + "; ".join(f"{name}: {c['detail']}" for name, c in failed)


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.partition("\n\n")[0],
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--report", default="", help=f"where the JSON report goes (default: out_dir/"
                                                     f"{run_folder.PREFLIGHT}, beside the run's outputs)")
    parser.add_argument("--steps", type=int, default=4, help="training steps per run (the last evaluates and saves)")
    parser.add_argument("--rouge_samples", type=int, default=16, help="dialogues the evaluation decodes")
    parser.add_argument("--timeout", type=int, default=900, help="seconds each training run may take")
    parser.add_argument("--collective_timeout", type=int, default=60, help="seconds each collective try may take")
    parser.add_argument("--collective", action="store_true", help=argparse.SUPPRESS)
    args, settings = parser.parse_known_args(argv)
    if args.collective:
        with one_line_errors():
            return run_collective(settings)
    with one_line_errors():  # a wrong setting is one line, as in train.py
        cfg = load_config(settings)
        cuda = cfg.device != "cpu" and torch.cuda.is_available()
        # what the run will train in (bfloat16 on a T4 is refused here as there)
        run_dtype, _ = choose_precision(cfg.dtype, "cuda" if cuda else "cpu",
                                        torch.cuda.get_device_capability() if cuda else None)
    device = "cuda" if cuda else "cpu"
    nproc = max(torch.cuda.device_count(), 1) if cuda else 2
    run_shape = {key: value for key, value in trained_shape(cfg).items() if key != "bias"}
    shape = run_shape if cuda else TINY  # what the checks train: on a CPU, a stand-in
    named = {key for key, _, _ in settings_given(settings)}
    checks = dict(versions=versions(), gpus=gpus(cfg), inputs=inputs(cfg, named), shared_memory=shared_memory(),
                  disk=disk(cfg, {**run_shape, "vocab_size": 50304}))
    for name in checks:
        say(name, checks)
    if any(c["status"] == "failed" for c in checks.values()):  # what the run cannot start with: no GPU time spent
        return finish(args, cfg, checks, device, nproc)
    env = None
    if nproc > 1:
        checks["collective"], env = collective(cfg, nproc, device, args.collective_timeout)
    else:
        checks["collective"] = check(NOT_RUN, "one process: no collective between GPUs")
    say("collective", checks)
    with tempfile.TemporaryDirectory(prefix="preflight-") as folder:
        base = [*settings, f"--device={device}", *([] if cuda else TINY_DECODING)]
        # gloo on a CPU; where no NCCL setting worked, one process trains
        runs = nproc if env is not None else 1
        env = env or child_environ()
        checks["training"], losses = training(base, shape, cfg, runs, env, args, folder, run_dtype, compile=cuda)
        say("training", checks)
        if cuda and run_dtype != "float32":
            _, reference = training(base, shape, cfg, runs, env, args, folder, "float32", compile=False)
            checks["precision"] = precision(losses, reference, run_dtype)
        else:
            checks["precision"] = check(NOT_RUN, "no GPU: fp16 against fp32 is a GPU check" if not cuda
                                        else f"the run trains in {run_dtype}")
        say("precision", checks)
    checks["decoding"] = (decoding(cfg, shape, run_dtype, torch.device("cuda")) if cuda and cfg.compile is not False
                          else check(NOT_RUN, "no GPU: compiled decoding is a GPU check" if not cuda
                                     else "--compile=False"))
    say("decoding", checks)
    return finish(args, cfg, checks, device, nproc)


def finish(args, cfg, checks, device, nproc):
    """The verdict line, the report written, the exit status."""
    line = verdict(checks)
    report = dict(verdict=line, go=line.startswith("go"), device=device, processes=nproc, checks=checks)
    args.report = args.report or os.path.join(cfg.out_dir, run_folder.PREFLIGHT)
    os.makedirs(os.path.dirname(os.path.abspath(args.report)), exist_ok=True)
    with atomic_write(args.report) as f:
        json.dump(report, f, indent=2, default=str)
    print(line)
    print(f"report: {os.path.abspath(args.report)}")
    return 0 if report["go"] else 1


if __name__ == "__main__":
    sys.exit(main())
