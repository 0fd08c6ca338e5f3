"""The GPU check: sections, each a command within its time, the JSON report written after each. --quick (8 minutes):
greedy's CUDA graphs, the preflight, the README's path on SAMSum, bench's train and generate; without it also every
bench section, the matrix (dtypes x compile) and the presets' peak memory. Exit status 1 if a section fails or a
REQUIRED figure misses its target.

    bash bench/gpu_check.sh --quick [--samsum_csv=PATH] [--report=PATH]
    python -m bench.gpu_check --part=matrix --device=cpu --model=tiny --dtypes=float32 --iters=3      one part
"""
import argparse
import contextlib
import gc
import io
import json
import math
import os
import shutil
import signal
import statistics
import subprocess
import sys
import tempfile
import time

import torch
from torch.autograd import DeviceType
from torch.profiler import ProfilerActivity, profile

import generate as generate_module
import train
from bench import GIB, MODELS, PRESETS, ROOT, SAMSUM_CSV, child_environ, synchronize, timed, training_csv
from bench import compile as bench_compile
from bench import memory as bench_memory
from bench.preflight import NOT_RUN, check
from command_line import UserError, atomic_write, error_line
from config import Decoding, load_config, read_preset
from model import GPT, PRETRAINED, GPTConfig
from summarizer import memory
from summarizer.preparation import prepare
from summarizer.process import Process, choose_precision

PRESET = "config/kaggle_t4x2.py"
REPORT = os.path.join(ROOT, "out-gpu-check", "gpu_check_report.json")  # git-ignored (out*/): never in the tree unasked
# --quick's sections and their seconds: 450, within 8 minutes with the start
QUICK = {"graphs": 25, "preflight": 35, "train": 240, "evaluate": 30, "predict": 40, "bench train": 40,
         "bench generate": 40}
# train.py's budget: its start-up compiles every size range of step 1 cold (on an H200 76 s reached the first, 112 s
# the second, and step 1 paid a third: 40 s) and its last save fits the section's rest
QUICK_MAX_TIME = 210
# (what, the section it is read from or None for any bench row, figure or key, target): issue 66's, H100/H200
FIGURES = [("decode steps as CUDA graphs", None, "graphed", "==", True),
           ("why decode steps ran eagerly", None, "eager_why", None, None),
           ("decode ms a step", None, "decode_ms_per_step", "<=", 2),
           ("bandwidth floor ms a step", None, "bandwidth_floor_ms_per_step", None, None),
           ("graph capture s", None, "graph_capture_s", None, None),
           ("generate: ours / transformers", None, "eos:speedup_vs_transformers", ">=", 4),
           ("cut micro-batches / one uncut, real tokens/s", None, "cut_speedup_vs_uncut", ">=", 1.3),
           ("padded fraction, micro_batch_size=256", None, "padded_fraction_micro_batch_256", "<=", 0.10),
           ("padded fraction, micro_batch_size=16", None, "padded_fraction_micro_batch_16", "<=", 0.05),
           ("predict.py s, start to submission.csv", "predict", "seconds", "<=", 15),
           ("operators per greedy step (CPU)", None, "operators_per_greedy_step", "<=", 148)]
REQUIRED = {"decode steps as CUDA graphs"}  # a figure that fails the check where it misses its target
LIMITS = {"train_graph_breaks": 0, "train_compilations": 2}
# the ledger leaves out the allocator's rounding and fragmentation: a quarter more than predicted is still the
# prediction working, not a new memory cost.
MEMORY_TOLERANCE = 1.25
FP16_TOLERANCE = 0.02  # relative: 16-bit autocast's losses over the same steps against float32's


# ---- the sections ------------------------------------------------------------------------------------------------

def plan(args, folder):
    """[(name, argv, seconds it may take or None, a JSON-lines file of its figures or None)], in order."""
    py, csv = sys.executable, args.samsum_csv
    run = [f"--out_dir={folder}/run", f"--device={args.device}"]
    trains = [PRESET, "--init_from=scratch", f"--train_csv={csv}", f"--data_cache_dir={folder}/cache", *run]
    predicts = [f"--test_csv={csv}", "--sample_submission_csv="]
    bench = [py, "-m", "bench", "--model=gpt2", f"--device={args.device}", f"--samsum_csv={csv}", "--json"]
    part = [py, "-m", "bench.gpu_check", *(f"--{k}={getattr(args, k)}" for k in (
        "model", "device", "samsum_csv", "dtypes", "compile", "iters", "micro_batch_size", "presets"))]
    sections = [("graphs", [*part, "--part=graphs"]),
                ("preflight", [py, "-m", "bench.preflight", *trains, *predicts, f"--report={preflight_report(args)}"]),
                ("train", [py, "train.py", *trains, *predicts, f"--max_time={QUICK_MAX_TIME}"]),
                ("evaluate", [py, "evaluate.py", PRESET, *run]),
                ("predict", [py, "predict.py", PRESET, *run, *predicts])]
    sections += ([(f"bench {s}", [*bench, f"--section={s}", "--repeats=2"]) for s in ("train", "generate")]
                 if args.quick else [("bench", [*bench, "--section=all"]), ("matrix", [*part, "--part=matrix"]),
                                     ("presets", [*part, "--part=presets"])])
    return [(name, argv, QUICK[name] if args.quick else None, f"{folder}/run/metrics.jsonl" * (name == "train") or None)
            for name, argv in sections]


def preflight_report(args):
    return os.path.join(os.path.dirname(args.report), "preflight_report.json")


def run_section(argv, limit, jsonl=None):
    """{status, seconds, command, rows: the JSON objects it printed, then `jsonl`'s, output: its last lines}."""
    start = time.monotonic()
    with subprocess.Popen(argv, cwd=ROOT, env=child_environ(), stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                          text=True, start_new_session=True) as process:
        try:
            output, status = process.communicate(timeout=limit)[0], None
        except subprocess.TimeoutExpired:
            os.killpg(process.pid, signal.SIGKILL)  # the section's own session: every process it started
            output, status = process.communicate()[0], f"timed out after {limit} s"
        except BaseException:  # the check is stopped (Ctrl-C, SIGTERM): so is every process of the section
            os.killpg(process.pid, signal.SIGKILL)
            raise
    status = status or ("ok" if process.returncode == 0 else f"failed (exit status {process.returncode})")
    rows = []
    for line in output.splitlines():
        with contextlib.suppress(ValueError):
            rows += [json.loads(line)] if line.startswith("{") else []
    if jsonl and os.path.isfile(jsonl):
        with open(jsonl) as f:
            rows += [json.loads(line) for line in f]
    return dict(status=status, seconds=round(time.monotonic() - start, 1), command=" ".join(argv), rows=rows,
                output=output[-3000:])


def figures(sections):
    """FIGURES' values (a section's own only if it ran to its end) and whether each meets its target."""
    found, rows = [], [row for s in sections.values() for row in s.get("rows", [])]
    for what, section, key, op, target in FIGURES:
        if section:
            value = sections[section][key] if sections.get(section, {}).get("status") == "ok" else None
        else:  # a bench figure, or a key of a row
            value = next((row.get("value") if row.get("figure") == key else row[key] for row in rows
                          if key in (row.get("figure"), *row)), None)
        met = None if value is None or op is None else {"<=": value <= target, ">=": value >= target}.get(
            op, value == target)
        found.append(dict(figure=what, value=value, target=f"{op} {target}" if op else None, met=met))
    return found


def run_check(sections, report_path, header):
    report = dict(header, sections={}, passed=True)
    for name, argv, limit, jsonl in sections:
        print(f"{name}: {' '.join(argv)}", flush=True)
        result = report["sections"][name] = run_section(argv, limit, jsonl)
        found = figures(report["sections"])
        report.update(figures=found, passed=report["passed"] and result["status"] == "ok" and not any(
            f["met"] is False for f in found if f["figure"] in REQUIRED))
        with atomic_write(report_path) as f:
            json.dump(report, f, indent=1)
        print(f"{name}: {result['status']} in {result['seconds']:.0f} s ({len(result['rows'])} figures)", flush=True)
    return report


# ---- the matrix: precision and compile ------------------------------------------------------------------------

def train_case(args, dtype, compile, folder, csv):
    """Medians over args.iters Trainer steps but the first third (the allocator's warm-up); compile's counts."""
    argv = [f"--train_csv={csv}", f"--out_dir={folder}/{dtype}-{compile}", f"--data_cache_dir={folder}/cache",
            "--init_from=scratch", *(f"--{k}={v}" for k, v in MODELS[args.model].items()), f"--device={args.device}",
            f"--dtype={dtype}", f"--compile={compile}", f"--batch_size={args.micro_batch_size}",
            f"--micro_batch_size={args.micro_batch_size}", f"--max_iters={args.iters}",
            f"--eval_interval={args.iters}", "--eval_val_batches=1", "--rouge_samples=0", "--best_metric=val_loss",
            "--log_interval=1", "--warmup_iters=2", f"--max_new_tokens={args.max_new_tokens}"]
    cfg = load_config(argv)
    if torch.device(args.device).type == "cuda":
        torch.cuda.reset_peak_memory_stats()
    bench_compile.fresh_compiles()
    # The Trainer's printout and progress bar would bury the table; a compile fallback shows in the row's note.
    with Process(cfg) as proc, contextlib.redirect_stdout(io.StringIO()), contextlib.redirect_stderr(io.StringIO()):
        trainer = train.Trainer(prepare(cfg, proc), proc)
        trainer.fit()
    breaks, graphs = bench_compile.graph_breaks(), torch._dynamo.utils.counters["stats"]["unique_graphs"]
    with open(os.path.join(cfg.out_dir, "metrics.jsonl")) as f:
        logged = [json.loads(line) for line in f]
    steps = logged[args.iters // 3:]
    row = {f"train_{key}": statistics.median(s[key] for s in steps) if key in steps[0] else None
           for key in ("tokens_per_s", "mfu", "ms_per_iter", "peak_mem_gb")}
    row.update(loss=steps[-1]["loss"], losses=[s["loss"] for s in logged],
               train_compiled=trainer.setup.module is not trainer.model)
    return dict(row, train_graph_breaks=breaks, train_compilations=graphs) if compile else row


def failed(e):
    return f"{type(e).__name__}: {str(e).strip()[:200]}"


def case(args, dtype, compile, device, capability, folder, csv):
    row = dict(figure=f"{dtype} {'compiled' if compile else 'eager'}", dtype=dtype, compile=compile)
    try:
        _, use_scaler = choose_precision(dtype, device.type, capability)
        row.update(train_case(args, dtype, compile, folder, csv))
    except UserError as e:
        return dict(row, note=f"not run: {e}")
    except Exception as e:  # e.g. out of memory: the other cases still run
        return dict(row, error=failed(e), note=f"failed: {failed(e)}")
    finally:
        gc.collect()
        torch.cuda.empty_cache()  # a no-op without CUDA
    return dict(row, note=", ".join(["GradScaler"] * use_scaler + ["training compile failed, ran eagerly"] * (
        compile and not row["train_compiled"])))


def precision(run_losses, reference_losses, dtype):
    """Each step's loss moved from the first (random weights make it ln(vocab)) against float32's move."""
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
                              f"{dtype} with: raise --iters", **figures)
    worst = max(abs((run_losses[0] - a) - m) for a, m in zip(run_losses, moved, strict=True)) / scale
    figures["max_relative_difference"] = worst
    if worst > FP16_TOLERANCE:
        return check("failed", f"{dtype} training moved the loss differently from float32 by up to "
                               f"{100 * worst:.1f}% of float32's change (more than {100 * FP16_TOLERANCE:g}%): train "
                               f"with --dtype=float32 and report it", **figures)
    return check("ok", f"{dtype} training moved the loss within {100 * worst:.2f}% of float32's change", **figures)


def matrix(args, device, capability, folder, csv):
    rows = [case(args, dtype, compile == "True", device, capability, folder, csv)
            for dtype in args.dtypes.split(",") for compile in args.compile.split(",")]
    reference = next((row["losses"] for row in rows if row["dtype"] == "float32" and "losses" in row), [])
    trials = [dict(precision(row.get("losses", []), reference, row["dtype"]), figure=f"{row['figure']}: losses "
                   f"against float32") for row in rows if row["dtype"] != "float32"]
    found = [dict(figure=f"{row['figure']}: runs", value=row["error"], passed=False) for row in rows if "error" in row]
    found += [dict(figure=f"{row['figure']}: {key}", value=row[key], target=limit, passed=row[key] <= limit)
              for row in rows for key, limit in LIMITS.items() if key in row]
    found += [dict(figure=f"{row['figure']}: train_compiled", value=row["train_compiled"], passed=row["train_compiled"])
              for row in rows if row["compile"] and "train_compiled" in row]
    found += [dict(figure=t["figure"], value=t["detail"], passed=t["status"] != "failed") for t in trials]
    return rows + trials, found


# ---- the presets' memory ----------------------------------------------------------------------------------------

def preset_row(name, device, total_gib, folder, csv):
    """Peak GiB per GPU, planned (bench's memory section) and of two eager steps of the widest micro-batch."""
    path = os.path.join(ROOT, PRESETS[name])
    micro = bench_memory.t4_micro_batch(name, read_preset(path))
    cfg = load_config([path, "--init_from=scratch", *(f"--{k}={v}" for k, v in PRETRAINED[name].items()),
                       f"--device={device}", "--compile=False", f"--micro_batch_size={micro}",
                       f"--batch_size={2 * micro}", f"--train_csv={csv}", "--validation_csv=", "--val_fraction=0.05",
                       f"--out_dir={folder}/{name}", f"--data_cache_dir={folder}/cache", "--max_time=",
                       "--rouge_samples=0", "--best_metric=val_loss", "--evaluate_after=False", "--predict_after=False",
                       "--log_to="])
    mode = ("fsdp2" if cfg.backend == "fsdp" else "lora" if cfg.lora_rank else "full") + (
        "+checkpointing" if cfg.gradient_checkpointing else "")
    row = dict(preset=PRESETS[name], model=name, mode=mode, micro_batch_size=cfg.micro_batch_size, note="")
    if cfg.backend == "fsdp":
        return dict(row, note=f"needs 2 GPUs (torchrun --nproc_per_node=2 train.py {PRESETS[name]}): not measured")
    base = torch.cuda.memory_allocated(device)
    torch.cuda.reset_peak_memory_stats(device)
    try:
        with Process(cfg) as proc, contextlib.redirect_stdout(io.StringIO()), contextlib.redirect_stderr(io.StringIO()):
            trainer = train.Trainer(prepare(cfg, proc), proc)
            batches = trainer.setup.batches
            widest = {step: max(batches(step).micro_batches, key=lambda xy: xy[0].numel())
                      for step in range(len(batches.examples) // cfg.batch_size)}
            step = max(widest, key=lambda s: widest[s][0].numel())
            x, y = widest[step]
            run = bench_memory.preset_run(name, cfg, (x.shape[1], int((y >= 0).sum(1).max()), 0), ranks=1)
            row.update(width=x.shape[1], predicted_gib=memory.ledger(run, x.shape[0], 0).phases["train"] / GIB)
            if row["predicted_gib"] > total_gib:
                return dict(row, note=f"predicted above this GPU's {total_gib:.1f} GiB: not run")
            for _ in range(2):  # the second with AdamW's moments
                trainer.train_step(step)
            synchronize(device)
            return dict(row, peak_gib=(torch.cuda.max_memory_allocated(device) - base) / GIB)
    except Exception as e:
        return dict(row, error=failed(e), note=f"failed: {failed(e)}")
    finally:
        trainer = None
        gc.collect()
        torch.cuda.empty_cache()


def presets_memory(args, device, capability, folder, csv):
    if device.type != "cuda":
        return [], []
    total_gib = torch.cuda.get_device_properties(device).total_memory / GIB
    rows = [dict(preset_row(p, device, total_gib, folder, csv), figure=f"preset {p}") for p in args.presets.split(",")
            if p]
    found = [dict(figure=f"{p['preset']}: trains", value=p["error"], passed=False) for p in rows if "error" in p]
    found += [dict(figure=f"{p['preset']}: peak GiB", value=round(p["peak_gib"], 2), target=round(
        MEMORY_TOLERANCE * p["predicted_gib"], 2), passed=p["peak_gib"] <= MEMORY_TOLERANCE * p["predicted_gib"])
              for p in rows if "peak_gib" in p]
    return rows, found


# ---- the graph path on this GPU ---------------------------------------------------------------------------------

ATTENTION = ("attention", "attn", "fmha", "flash", "sdpa", "softmax")  # in the names of attention's kernels
GRAPH_BATCHES = ((8, 40), (4, 100))  # (prompts, tokens): two buckets (8 rows x 64 slots, 4 x 128)
GRAPH_STEPS = 16  # new tokens a summary, and steps timed


def reading_host(step):
    """`step` with a read of its output on the host, which a CUDA graph cannot capture."""
    def read():
        output = step()
        int(output.flatten()[0])
        return output
    return read


def recording(captured, streams, wrap=lambda step: step):
    """capture_graph of wrap(step) keeping (step, graph) in `captured`, and in `streams` whether it kept the stream."""
    def capture(step, *args, **kwargs):
        before = torch.cuda.current_stream()
        try:
            graph, output, expected = generate_module.capture_graph(wrap(step), *args, **kwargs)
            captured.append((step, graph))
            return graph, output, expected
        finally:
            streams.append(torch.cuda.current_stream() == before)
    return capture


def attention_kernels(fn, device):
    with profile(activities=[ProfilerActivity.CPU, *[ProfilerActivity.CUDA] * (device.type == "cuda")]) as prof:
        fn()
        synchronize(device)
    kind = DeviceType.CUDA if device.type == "cuda" else DeviceType.CPU
    return sorted({e.name for e in prof.events() if e.device_type == kind and any(
        word in e.name.lower() for word in ATTENTION)})


def per_step_ms(fn, device, steps=GRAPH_STEPS):
    return 1000 * timed(lambda: [fn() for _ in range(steps)], device)[1] / steps


@torch.inference_mode()  # the held buffers are inference tensors: an eager step outside it may not write them
def graph_checks(model, batches, device):
    """Greedy's CUDA graphs against eager steps: a capture that reads the host falls back, then all are captured."""
    def decode(graphs=None):
        return [generate_module.generate(model, prompts, Decoding(GRAPH_STEPS), eos_token_id=-1, graphs=graphs)
                for prompts in batches]
    eager, before = decode(), torch.cuda.current_stream()
    fallback_kept, kept, captured = [], [], []
    failing = generate_module.StepGraphs(capture=recording([], fallback_kept, reading_host), error_line=error_line)
    fell_back = decode(failing)
    found = [dict(figure="graphs: a capture that reads the host falls back, the stream kept", value=failing.eager_why,
                  passed=failing.eager_why is not None and fell_back == eager and all(fallback_kept) and
                  torch.cuda.current_stream() == before)]
    graphs = generate_module.StepGraphs(capture=recording(captured, kept), error_line=error_line)
    graphed = decode(graphs)
    buckets = [f"{rows}x{slots}" for rows, slots in graphs.capture_seconds]
    found += [dict(figure="graphs: captured after it, every bucket", value=graphs.eager_why or buckets,
                   passed=graphs.eager_why is None and len(buckets) == len(batches)),
              dict(figure="graphs: summaries equal to eager steps'", value=graphed == eager, passed=graphed == eager),
              dict(figure="graphs: the stream after capture is the one before", value=kept,
                   passed=all(kept) and torch.cuda.current_stream() == before)]
    rows = [dict(figure=f"graphs: {bucket}", capture_s=seconds, replay_ms=per_step_ms(graph.replay, device),
                 eager_ms=per_step_ms(step, device), replay_kernels=attention_kernels(graph.replay, device),
                 eager_kernels=attention_kernels(step, device))
            for bucket, seconds, (step, graph) in zip(buckets, graphs.capture_seconds.values(), captured, strict=True)]
    return rows, found


def part(args):
    device = torch.device(args.device)
    capability = torch.cuda.get_device_capability(device) if device.type == "cuda" else None
    if args.part == "graphs":  # GPT-2-small's shape, random weights, in the dtype evaluate.py decodes in here
        torch.manual_seed(0)
        with device:
            model = GPT(GPTConfig()).to(torch.bfloat16 if capability >= (8, 0) else torch.float16).eval()
        batches = [torch.randint(0, model.config.vocab_size, shape).tolist() for shape in GRAPH_BATCHES]
        rows, found = graph_checks(model, batches, device)
    else:
        with tempfile.TemporaryDirectory() as folder:
            csv, _ = training_csv(folder, args.samsum_csv)  # SAMSum validation, or random chats of its shape
            rows, found = (matrix if args.part == "matrix" else presets_memory)(args, device, capability, folder, csv)
    for row in rows + [dict(c, figure=f"check: {c['figure']}") for c in found]:
        print(json.dumps(row))
    return 0 if all(c["passed"] for c in found) else 1


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--quick", action="store_true", help="the sections that fit 8 minutes (QUICK)")
    parser.add_argument("--part", choices=["graphs", "matrix", "presets"], help="one part, in this process")
    parser.add_argument("--model", default="gpt2", choices=list(MODELS))
    parser.add_argument("--device", default="cuda")
    parser.add_argument("--samsum_csv", default=SAMSUM_CSV, help="SAMSum-style CSV (id, dialogue, summary)")
    parser.add_argument("--dtypes", default="float32,float16,bfloat16")
    parser.add_argument("--compile", default="False,True", help="False, True or both (eager first)")
    parser.add_argument("--iters", type=int, default=30, help="training steps per matrix case")
    parser.add_argument("--micro_batch_size", type=int, default=8)
    parser.add_argument("--max_new_tokens", type=int, default=64)
    parser.add_argument("--presets", default=",".join(PRESETS), help="presets whose peak memory is measured (CUDA)")
    parser.add_argument("--report", default=REPORT, help="where the JSON report is written (the preflight's beside it)")
    args = parser.parse_args(argv)
    if args.part:
        return part(args)
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(128 + signal.SIGTERM))  # a section's processes end with it
    args.report, args.samsum_csv = os.path.abspath(args.report), os.path.abspath(args.samsum_csv)
    if not os.path.isfile(args.samsum_csv):
        print(f"error: no SAMSum CSV at {args.samsum_csv}: pass --samsum_csv=<samsum-validation.csv>", file=sys.stderr)
        return 2
    smi = ["nvidia-smi", "--query-gpu=name,compute_cap,memory.total,driver_version", "--format=csv,noheader"]
    gpu = subprocess.run(smi, capture_output=True, text=True).stdout.strip() if shutil.which("nvidia-smi") else None
    os.makedirs(os.path.dirname(args.report), exist_ok=True)
    print(f"reports: {args.report} and {preflight_report(args)}", flush=True)
    with tempfile.TemporaryDirectory() as folder:
        report = run_check(plan(args, folder), args.report, dict(gpu=gpu, torch=torch.__version__, quick=args.quick,
                                                                  args=vars(args)))
    for f in report["figures"]:
        print(f"{f['figure']}: {f['value']}" + (f" (target {f['target']}: {'met' if f['met'] else 'not met'})"
                                                 if f["met"] is not None else ""))
    print(f"report: {args.report} (attach it to an issue)")
    return 0 if report["passed"] else 1


if __name__ == "__main__":
    sys.exit(main())
