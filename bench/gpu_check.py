"""The CUDA-only code paths on a real GPU, asserted, in one table and one JSON report to attach to an issue. For each
precision (fp32, fp16 + GradScaler, bf16) with torch.compile off and on: the real Trainer's tokens/s, MFU and peak
memory; the batched generator's greedy tokens/s and MBR-16 summaries/s with rows ending at an EOS, and whether
compiled greedy output equals eager; inductor's graph breaks and compilations in training and in decoding, and
decoding's host syncs per step. Then the run's trials: each 16-bit row's losses against float32's, and the Kaggle
preset's decoding of real dialogues, compiled. Then, for the Kaggle presets that run in one process and fit the GPU,
the peak torch.cuda.max_memory_allocated of two Trainer steps of the run prepare() builds next to python -m bench
--section=memory's prediction. Random weights; SAMSum's validation dialogues when ../shared has them, else random
ones: nothing to download. Exit status 1 if any check fails.

    bash bench/gpu_check.sh                           GPT-2 (124M) shapes on the first GPU
    python -m bench.gpu_check --device=cpu --model=tiny --dtypes=float32 --compile=False,True --iters=3
"""
import argparse
import contextlib
import functools
import gc
import io
import json
import math
import os
import random
import statistics
import sys
import tempfile
from dataclasses import replace

import torch

import data
import train
from bench import GIB, MODELS, PRESETS, ROOT, SAMSUM_CSV, synchronize, timed, training_csv
from bench import compile as bench_compile
from bench import memory as bench_memory
from bench.preflight import NOT_RUN, check
from config import Decoding, load_config, read_preset
from generate import generate
from model import GPT, PRETRAINED, GPTConfig
from summarizer import inference, mbr
from summarizer.compiling import StepGraphs
from summarizer.errors import UserError
from summarizer.files import atomic_write
from summarizer.loading import trained_shape
from summarizer.preparation import prepare
from summarizer.runtime import Runtime, choose_precision

MBR16 = dict(mbr_samples=16, temperature=0.7, top_k=50, epsilon=0.02, mbr_include_beam=True)
LIMITS = {"train_graph_breaks": 0, "train_compilations": 2, "decode_graph_breaks": 0, "decode_compilations": 2,
          "decode_host_syncs_per_step": 1}
# A random model's top two logits are often closer than 16-bit rounding, which fused kernels do in another order: a
# few rows may take the other token at such a near-tie and go on differently. A wrong compiled step (a cache slot,
# the mask) changes nearly every row.
GREEDY_AGREEMENT = {"float32": 1.0, "float16": 0.75, "bfloat16": 0.75}
# bench_memory leaves out backward's transient buffers (a block's gradients in flight, the loss's) and the
# allocator's rounding: a quarter more than predicted is still the prediction working, not a new memory cost.
MEMORY_TOLERANCE = 1.25
FP16_TOLERANCE = 0.02  # relative: 16-bit autocast's losses over the same steps against float32's
WARM_BATCHES = 4  # decoded after the first (compiling) batch, for the warm rate
DEMO_TEST_CSV = os.path.join(ROOT, "data", "demo", "test.csv")


def train_case(args, dtype, compile, folder, csv):
    """Median tokens/s, MFU, ms/iter and peak memory over args.iters Trainer steps, the first third not counted
    (the allocator's warm-up); with compile, the graph breaks and graphs of the whole run."""
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
    with Runtime(cfg) as rt, contextlib.redirect_stdout(io.StringIO()), contextlib.redirect_stderr(io.StringIO()):
        trainer = train.Trainer(prepare(cfg, rt), rt)
        trainer.fit()
    breaks, graphs = bench_compile.graph_breaks(), bench_compile.graphs_compiled()
    with open(os.path.join(cfg.out_dir, "metrics.jsonl")) as f:
        logged = [json.loads(line) for line in f]
    steps = logged[args.iters // 3:]
    row = {f"train_{key}": statistics.median(s[key] for s in steps) if key in steps[0] else None
           for key in ("tokens_per_s", "mfu", "ms_per_iter", "peak_mem_gb")}
    row.update(loss=steps[-1]["loss"], losses=[s["loss"] for s in logged],
               train_compiled=trainer.run.module is not trainer.model)
    return dict(row, train_graph_breaks=breaks, train_compilations=graphs) if compile else row


@contextlib.contextmanager
def host_syncs(counts):
    """Adds to counts["syncs"] the host's waits for the device inside, as bench_compile counts them: value reads
    and value-shaped ops, seen by Python modes on any device, eager code only (CUDA's set_sync_debug_mode would
    also flag every blocking copy of an index list to the device, which waits for no result); to counts["steps"]
    the decoding steps (bench_compile.decoding_steps)."""
    with bench_compile.decoding_steps() as steps, bench_compile.Waits() as waits:
        yield
    counts["syncs"] += waits.syncs
    counts["steps"] += len(steps)


def generate_case(args, dtype, compile, device, prompts, eager):
    """Greedy tokens/s and MBR-16 summaries/s of batched generate() with a real EOS pattern, each timed after a
    warm-up call. Compiled: the decode step's graph breaks and graphs over all calls (calibration, every batch
    size, rows ending) and how many greedy outputs equal the eager ones. Eager: host syncs per decoding step."""
    torch.manual_seed(0)
    model = GPT(GPTConfig(**MODELS[args.model])).to(device).eval()
    bench_compile.fresh_compiles()
    step = StepGraphs() if compile and device.type == "cuda" else None
    greedy_decoding = Decoding(max_new_tokens=args.max_new_tokens)
    with torch.autocast(device.type, dtype=getattr(torch, dtype), enabled=dtype != "float32"):
        if dtype not in eager:
            eager[dtype] = {"eos": bench_compile.summary_end_token(model, prompts, args.max_new_tokens)}
        eos, counts = eager[dtype]["eos"], dict(syncs=0, steps=0)
        greedy_call = functools.partial(generate, model, prompts, greedy_decoding, eos_token_id=eos,
                                        greedy_steps=step)
        mbr_call = functools.partial(generate, model, prompts, replace(greedy_decoding, **MBR16), eos_token_id=eos,
                                     seed=0, mbr_pick=mbr.pick, greedy_steps=step)
        for call in (greedy_call, mbr_call):  # the first call compiles and warms up; eager, its host syncs counted
            with contextlib.nullcontext() if compile else host_syncs(counts):
                call()
        greedy, greedy_s = timed(greedy_call, device)
        _, mbr_s = timed(mbr_call, device)
    row = dict(eos_token_id=eos, greedy_tokens_per_s=sum(map(len, greedy)) / greedy_s,
               mbr16_summaries_per_s=len(prompts) / mbr_s, decode_compiled=not (step is None or step.failed))
    if not compile:
        eager[dtype]["greedy"] = greedy
        return dict(row, decode_host_syncs_per_step=counts["syncs"] / counts["steps"])
    row.update(decode_graph_breaks=bench_compile.graph_breaks(), decode_compilations=bench_compile.graphs_compiled())
    if "greedy" in eager[dtype]:
        row["greedy_same"] = sum(a == b for a, b in zip(greedy, eager[dtype]["greedy"], strict=True))
    return row


def failed(e):
    return f"{type(e).__name__}: {str(e).strip()[:200]}"


def case(args, dtype, compile, device, capability, folder, csv, prompts, eager):
    """One table row: the training and generation figures of (dtype, compile), or why they could not be had."""
    row = dict(dtype=dtype, compile=compile, gen_prompts=len(prompts))
    try:
        _, use_scaler = choose_precision(dtype, device.type, capability)
        row.update(train_case(args, dtype, compile, folder, csv))
        row.update(generate_case(args, dtype, compile, device, prompts, eager))
    except UserError as e:
        return dict(row, note=f"not run: {e}")
    except Exception as e:  # e.g. out of memory: the other cases still run
        return dict(row, error=failed(e), note=f"failed: {failed(e)}")
    finally:
        gc.collect()
        if device.type == "cuda":
            torch.cuda.empty_cache()
    notes = (["GradScaler"] * use_scaler
             + ["training compile failed, ran eagerly"] * (compile and not row["train_compiled"])
             + ["decode compile failed, ran eagerly"] * (compile and not row["decode_compiled"]))
    return dict(row, note=", ".join(notes))


# ---- the presets' memory ----------------------------------------------------------------------------------------

def predicted_gib(name, mode, x, y):
    """python -m bench --section=memory's GiB per GPU of model `name` training in `mode`, for micro-batch (x, y)."""
    preset = load_config([os.path.join(ROOT, PRESETS["gpt2"])])
    plan, _ = bench_memory.mode_plan(name, mode, x, y, preset, preset.block_size - preset.max_new_tokens)
    return plan.training / GIB


def widest_step(batches, steps):
    """(the step among `steps` whose global batch holds the widest micro-batch, that micro-batch (x, y))."""
    widest = {step: max(batches(step).micro_batches, key=lambda xy: xy[0].shape[1]) for step in range(steps)}
    step = max(widest, key=lambda s: widest[s][0].shape[1])
    return step, widest[step]


def preset_row(name, device, total_gib, folder, csv):
    """A preset's mode, predicted GiB per GPU and measured peak GiB, or why it was not measured: the run prepared
    as train.py prepares it (random weights of its model, eager as bench_memory predicts, two micro-batches a
    step), then two Trainer steps over the epoch's widest micro-batch, counted from what was allocated before."""
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
        with Runtime(cfg) as rt, contextlib.redirect_stdout(io.StringIO()), contextlib.redirect_stderr(io.StringIO()):
            trainer = train.Trainer(prepare(cfg, rt), rt)
            batches = trainer.run.batches
            step, (x, y) = widest_step(batches, len(batches.examples) // cfg.batch_size)
            row.update(width=x.shape[1], predicted_gib=predicted_gib(name, mode, x, y))
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


# ---- the run's trials: fp16 against fp32, the run's decoding ---------------------------------------------------

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
                              f"{dtype} with: raise --iters", **figures)
    worst = max(abs((run_losses[0] - a) - m) for a, m in zip(run_losses, moved, strict=True)) / scale
    figures["max_relative_difference"] = worst
    if worst > FP16_TOLERANCE:
        return check("failed", f"{dtype} training moved the loss differently from float32 by up to "
                               f"{100 * worst:.1f}% of float32's change (more than {100 * FP16_TOLERANCE:g}%): train "
                               f"with --dtype=float32 and report it", **figures)
    return check("ok", f"{dtype} training moved the loss within {100 * worst:.2f}% of float32's change", **figures)


def decoding(cfg, shape, dtype, device):
    """The run's decoding as predict.py runs it: prompts of real dialogues (test_csv, else the demo's) in the batches
    generation_batches makes, through inference.summarize with a compiled decode step, random weights in the run's
    dtype. The first batch pays the compile; WARM_BATCHES more give the warm summaries/s and count the graphs new
    prompt lengths and batch sizes compile. Random weights never end a summary early: every one runs to
    max_new_tokens, an upper bound on what trained weights take."""
    if not os.path.isfile(cfg.test_csv):
        cfg = replace(cfg, test_csv=DEMO_TEST_CSV)
    bench_compile.fresh_compiles()
    with device:
        model = GPT(GPTConfig(**shape, vocab_size=50304)).to(getattr(torch, dtype)).eval()
    prompts, _ = inference.Summarizer(model, cfg).prompts(data.read_test(cfg).dialogues)
    first, rest = prompts[:cfg.gen_batch_size], prompts[cfg.gen_batch_size:cfg.gen_batch_size * (1 + WARM_BATCHES)]
    step, seconds, graphs = StepGraphs() if device.type == "cuda" else None, [], []
    try:
        for batch in (first, rest):
            compiled = bench_compile.graphs_compiled()
            seconds.append(timed(functools.partial(inference.summarize, model, batch, cfg, contextlib.nullcontext(),
                                                   greedy_steps=step), device)[1])
            graphs.append(bench_compile.graphs_compiled() - compiled)
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
                   graphs_warm_batches=graphs[1], graphed=bool(step and not step.failed))
    said = (f"{figures['prompts']} real dialogues ({lengths[0]}-{lengths[-1]} prompt tokens, up to "
            f"{cfg.max_new_tokens} new): compiled in {figures['compile_seconds']:.0f} s ({graphs[0]} graph(s)), then "
            f"{figures['summaries_per_s']} summaries/s with {graphs[1]} more graph(s) as lengths varied (random "
            f"weights run every summary to max_new_tokens: an upper bound)")
    if step and step.failed:
        return check("failed", f"{said}; CUDA graphs fell back to eager (its warning above): decoding works, "
                               f"slower", **figures)
    return check("ok", said, **figures)


def trials(rows, device, capability):
    """{name: check} of the run's trials on a GPU: each 16-bit row's losses against float32's (eager) over the
    same steps, and the decoding of the Kaggle preset, in the dtype it trains in on this GPU."""
    reference = next((row["losses"] for row in rows if row["dtype"] == "float32" and "losses" in row), [])
    found = {f"{row['dtype']} {'compiled' if row['compile'] else 'eager'}: losses against float32":
             precision(row.get("losses", []), reference, row["dtype"]) for row in rows if row["dtype"] != "float32"}
    cfg = load_config([os.path.join(ROOT, "config", "kaggle_t4x2.py"), f"--device={device.type}"])
    dtype, _ = choose_precision(cfg.dtype, device.type, capability)
    found["the Kaggle preset's decoding"] = decoding(cfg, trained_shape(cfg), dtype, device)
    return found


# ---- the checks, the tables, the report -------------------------------------------------------------------------

def checks(rows, presets, trials):
    """Every assertion as {check, value, target, passed}."""
    found = []

    def add(label, value, target, passed):
        found.append(dict(check=label, value=value, target=target, passed=bool(passed)))
    for row in rows:
        label = f"{row['dtype']} {'compiled' if row['compile'] else 'eager'}"
        if "error" in row:
            add(f"{label}: runs", row["error"], "no error", False)
        for key, limit in LIMITS.items():
            if key in row:
                add(f"{label}: {key}", row[key], f"{'==' if limit == 0 else '<='} {limit}", row[key] <= limit)
        for key in ("train_compiled", "decode_compiled"):
            if row["compile"] and key in row:
                add(f"{label}: {key}", row[key], True, row[key])
        if "greedy_same" in row:
            needed = math.ceil(GREEDY_AGREEMENT.get(row["dtype"], 1.0) * row["gen_prompts"])
            add(f"{label}: greedy rows equal to eager", row["greedy_same"], f">= {needed} of {row['gen_prompts']}",
                row["greedy_same"] >= needed)
    for p in presets:
        if "error" in p:
            add(f"{p['preset']}: trains", p["error"], "no error", False)
        if "peak_gib" in p:
            limit = MEMORY_TOLERANCE * p["predicted_gib"]
            add(f"{p['preset']}: peak GiB", round(p["peak_gib"], 2), f"<= {limit:.2f} (predicted x {MEMORY_TOLERANCE})",
                p["peak_gib"] <= limit)
    for name, trial in trials.items():
        add(name, f"{trial['status']}: {trial['detail']}", "not failed", trial["status"] != "failed")
    return found


def cell(value, spec):
    return "-" if value is None else format(value, spec)


def print_table(columns, rows):
    """columns: (title, key, format spec); numbers right-aligned, text (spec "") left-aligned."""
    lines = [[title for title, _, _ in columns]] + [[cell(row.get(key), spec) for _, key, spec in columns]
                                                   for row in rows]
    widths = [max(len(line[i]) for line in lines) for i in range(len(columns))]
    for line in lines:
        print(" ".join(format(text, f"{'>' if spec else '<'}{w}")
                       for text, (_, _, spec), w in zip(line, columns, widths, strict=True)).rstrip())


CASE_COLUMNS = [("dtype", "dtype", ""), ("compile", "compile", ""), ("train tok/s", "train_tokens_per_s", ".0f"),
                ("MFU", "train_mfu", ".1%"), ("ms/iter", "train_ms_per_iter", ".0f"),
                ("peak GiB", "train_peak_mem_gb", ".2f"), ("loss", "loss", ".3f"),
                ("greedy tok/s", "greedy_tokens_per_s", ".0f"), ("MBR-16 sum/s", "mbr16_summaries_per_s", ".1f"),
                ("greedy=eager", "greedy_same", "d"), ("train graphs", "train_compilations", "d"),
                ("breaks", "train_graph_breaks", "d"), ("decode graphs", "decode_compilations", "d"),
                ("breaks", "decode_graph_breaks", "d"), ("syncs/step", "decode_host_syncs_per_step", ".2f"),
                ("note", "note", "")]
PRESET_COLUMNS = [("preset", "preset", ""), ("mode", "mode", ""), ("micro-batch", "micro_batch_size", "d"),
                  ("width", "width", "d"), ("predicted GiB", "predicted_gib", ".2f"), ("peak GiB", "peak_gib", ".2f"),
                  ("note", "note", "")]


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", default="gpt2", choices=list(MODELS))
    parser.add_argument("--device", default="cuda")
    parser.add_argument("--samsum_csv", default=SAMSUM_CSV, help="SAMSum-style CSV; random dialogues without it")
    parser.add_argument("--dtypes", default="float32,float16,bfloat16")
    parser.add_argument("--compile", default="False,True", help="False, True or both (eager first)")
    parser.add_argument("--iters", type=int, default=30, help="training steps per case")
    parser.add_argument("--micro_batch_size", type=int, default=8)
    parser.add_argument("--gen_prompts", type=int, help="prompts per generation figure (32; 8 on CPU, whose MBR-16 "
                        "is slow)")
    parser.add_argument("--max_new_tokens", type=int, default=64, help="> 4: EOS is picked among later tokens")
    parser.add_argument("--presets", default=",".join(PRESETS),
                        help="the models whose Kaggle preset's peak training memory is measured, on CUDA only ('' "
                        "for none)")
    parser.add_argument("--report", default="gpu_check_report.json", help="where the JSON report is written")
    args = parser.parse_args(argv)
    device = torch.device(args.device)
    args.gen_prompts = args.gen_prompts or (32 if device.type == "cuda" else 8)
    capability = torch.cuda.get_device_capability(device) if device.type == "cuda" else None
    name = torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu"
    rng = random.Random(0)
    longest = MODELS[args.model]["block_size"] - args.max_new_tokens
    prompts = [[rng.randrange(50256) for _ in range(rng.randint(min(64, longest), min(256, longest)))]
               for _ in range(args.gen_prompts)]
    eager = {}  # per dtype: the EOS every row of that dtype uses, the eager greedy outputs
    presets, tried = [], {}
    with tempfile.TemporaryDirectory() as folder:
        csv, _ = training_csv(folder, args.samsum_csv)  # SAMSum validation, or random chats of its shape
        rows = [case(args, dtype, compile == "True", device, capability, folder, csv, prompts, eager)
                for dtype in args.dtypes.split(",") for compile in args.compile.split(",")]
        if device.type == "cuda":
            total_gib = torch.cuda.get_device_properties(device).total_memory / GIB
            presets = [preset_row(p, device, total_gib, folder, csv) for p in args.presets.split(",") if p]
            tried = trials(rows, device, capability)
    found = checks(rows, presets, tried)

    print(f"\n{args.model} shapes, micro-batch {args.micro_batch_size}, {args.iters} training steps per row; "
          f"generation {len(prompts)} prompts x up to {args.max_new_tokens} new tokens, greedy and MBR-16, EOS = "
          f"the token the model emits most (a random model never ends otherwise); {name}"
          f"{f' (compute capability {capability[0]}.{capability[1]})' if capability else ''}, "
          f"torch {torch.__version__}")
    print_table(CASE_COLUMNS, rows)
    if presets:
        print("\npeak training memory of the presets (random weights, widest SAMSum-like micro-batch, two per step, "
              "eager, through the Trainer) against python -m bench --section=memory's prediction")
        print_table(PRESET_COLUMNS, presets)
    for name, trial in tried.items():
        print(f"{name}: {trial['status']}: {trial['detail']}")
    print(f"\nchecks: {sum(c['passed'] for c in found)} of {len(found)} passed")
    for c in found:
        print(f"  {'ok  ' if c['passed'] else 'FAIL'} {c['check']}: {c['value']} (target {c['target']})")
    report = dict(device=name, capability=capability, torch=torch.__version__, cuda=torch.version.cuda,
                  args=vars(args), rows=rows, presets=presets, trials=tried, checks=found,
                  passed=all(c["passed"] for c in found))
    os.makedirs(os.path.dirname(os.path.abspath(args.report)), exist_ok=True)
    with atomic_write(args.report) as f:
        json.dump(report, f, indent=1)
    print(f"report: {os.path.abspath(args.report)}")
    return 0 if report["passed"] else 1


if __name__ == "__main__":
    sys.exit(main())
