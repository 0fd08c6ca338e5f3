"""Side-by-side benchmarks: ours vs transformers vs the naive approach, same weights, same process; and ROUGE
against speed of the decoding methods.

python -m bench [--section=train|generate|decode|memory|compile|all] [--model=small|gpt2] [--json]
"""
import argparse
import contextlib
import copy
import ctypes
import dataclasses
import functools
import gc
import json
import os
import statistics
import tempfile
import types
from unittest import mock

import numpy as np
import torch

import data
import generate as generate_module
from bench import MODELS, ROOT, SAMSUM_CSV, demo_arguments, progress, synchronize, timed, train_quietly
from bench import compile as bench_compile
from bench import memory as bench_memory
from bench.compile import Waits, decoding_steps, summary_end_token
from command_line import error_line
from config import PROMPT_TEMPLATE, Config, Decoding, load_config
from data import EOT_ID
from generate import generate
from model import GPT, SharedPromptCache
from summarizer import inference
from summarizer.inference import open_summary_model, rouge, summarize_batches
from summarizer.memory import kv_cache_bytes


def samsum_examples(n, samsum_csv, seed=0):
    """((prompt tokens, summary tokens) pairs, "samsum"), or random tokens of SAMSum's lengths, "synthetic"."""
    rng = np.random.default_rng(seed)
    if os.path.exists(samsum_csv):
        import pandas as pd
        frame = pd.read_csv(samsum_csv).dropna()
        picked = rng.choice(len(frame), size=min(n, len(frame)), replace=False)
        enc = data.get_tokenizer()
        fmt = data.prompt_format(PROMPT_TEMPLATE, 1024, 80)
        return [(fmt.encode(frame["dialogue"].iloc[i])[0],
                 enc.encode_ordinary(frame["summary"].iloc[i])) for i in picked], "samsum"
    prompt_lengths = np.clip(rng.lognormal(np.log(130), 0.6, size=n), 16, 760).astype(int)
    summary_lengths = np.clip(rng.lognormal(np.log(22), 0.5, size=n), 3, 76).astype(int)
    return [(rng.integers(0, EOT_ID, size=p).tolist(), rng.integers(0, EOT_ID, size=k).tolist())
            for p, k in zip(prompt_lengths, summary_lengths, strict=True)], "synthetic"


def make_models(name, device):
    """A random-weight GPT2LMHeadModel and our GPT loaded from it through the real from_pretrained path.
    initializer_range 0.1 keeps logits apart so greedy comparisons are not decided by float ties."""
    from transformers import GPT2Config, GPT2LMHeadModel
    torch.manual_seed(0)
    shape = dict(MODELS[name])
    config = GPT2Config(n_positions=shape.pop("block_size"), initializer_range=0.1, **shape)
    hf = GPT2LMHeadModel(config).eval()
    with tempfile.TemporaryDirectory() as tmp:
        hf.save_pretrained(tmp)
        ours = GPT.from_pretrained(tmp).eval()
    return hf.to(device), ours.to(device)


def status_mb(key):
    with open("/proc/self/status") as f:
        return int(next(line for line in f if line.startswith(key)).split()[1]) / 1024


@contextlib.contextmanager
def peak_memory(device):
    """Yields an object whose peak_mb, after the block, is its peak MiB above its start: CUDA max_memory_allocated,
    or on a CPU the process's peak RSS (VmHWM, reset first, after freed heap is handed back to the OS, so that
    memory an earlier figure freed is not reused unseen)."""
    found = types.SimpleNamespace(peak_mb=0.0)
    synchronize(device)
    if device.type == "cuda":
        torch.cuda.reset_peak_memory_stats()
        base = torch.cuda.memory_allocated() / 2**20
    else:
        gc.collect()
        ctypes.CDLL(None).malloc_trim(0)  # glibc; Linux is where this benchmark runs
        with open("/proc/self/clear_refs", "w") as f:
            f.write("5")  # VmHWM := VmRSS
        base = status_mb("VmRSS:")
    yield found
    synchronize(device)
    found.peak_mb = (torch.cuda.max_memory_allocated() / 2**20 if device.type == "cuda" else status_mb("VmHWM:")) - base


def interleaved(candidates, device, repeats):
    """Run each candidate once to warm up, then `repeats` rounds in turn; median seconds and peak memory."""
    outputs, times, memory = {}, {name: [] for name in candidates}, {}
    for name, fn in candidates.items():
        progress(f"{name}: warm-up")
        with peak_memory(device) as mem:
            outputs[name] = fn()
        memory[name] = mem.peak_mb
    for i in range(repeats):
        progress(f"{', '.join(candidates)}: round {i + 1} of {repeats}")
        for name, fn in candidates.items():
            times[name].append(timed(fn, device)[1])
    return outputs, {name: statistics.median(t) for name, t in times.items()}, memory


def bench_generate(args, device):
    hf, ours = make_models(args.model, device)
    examples, source = samsum_examples(args.gen_prompts, args.samsum_csv)
    prompts = [prompt for prompt, _ in examples]
    order = sorted(range(len(prompts)), key=lambda i: len(prompts[i]))
    batches = [[prompts[i] for i in order[s:s + args.gen_batch]] for s in range(0, len(order), args.gen_batch)]
    max_new = args.max_new_tokens
    rows = []
    # The naive loop runs only where every row generates max_new tokens, so its small subset is representative.
    for scenario, eos in [("no_eos", EOT_ID), ("eos", summary_end_token(ours, prompts, max_new))]:
        rows += [dict(row, figure=f"{scenario}:{row['figure']}") for row in
                 compare_generate(hf, ours, batches, max_new, eos, args, device, with_naive=scenario == "no_eos")]
    rows += greedy_step_figures(ours, prompts, max_new, args, device)
    progress("operators launched per greedy step, GPT-2 small, batch 8, on the CPU")
    launches = bench_compile.launches_per_greedy_step()
    rows.append(dict(figure="operators_per_greedy_step", value=sum(launches.values()), target="<= 148",
                     by_operator=launches))
    rows += kv_reads(ours, batches[len(batches) // 2], max_new)
    rows.append(dict(figure="setup", value=f"{args.model} model, {len(prompts)} {source} prompts, batch "
                     f"{args.gen_batch}, max_new_tokens {max_new}, naive on {args.naive_prompts}, median of "
                     f"{args.repeats}, {device}"))
    return rows


def step_graphs(device):
    """How the benchmark runs greedy steps: as CUDA graphs on a GPU (generate.StepGraphs), eagerly on a CPU."""
    return generate_module.StepGraphs(error_line=error_line) if device.type == "cuda" else None


def graph_figures(graphs, device):
    """Whether greedy's steps ran as CUDA graphs and why not, and each bucket's capture seconds, keyed
    'rows x slots'."""
    why = graphs.eager_why if graphs else f"CUDA graphs need a GPU: {device.type} steps run eagerly"
    captures = {f"{rows}x{slots}": s for (rows, slots), s in graphs.capture_seconds.items()} if graphs else None
    return dict(graphed=why is None, eager_why=why), captures


def greedy_step_figures(model, prompts, max_new, args, device):
    """A greedy decode step at batch args.gen_batch (the longest prompts, no EOS): its ms (as graphs or eagerly,
    and why) against the floor of reading the weights and attended KV slots once at a copy's bandwidth; host
    reads; each bucket's graph capture seconds."""
    batch = sorted(prompts, key=len)[-args.gen_batch:]
    graphs = step_graphs(device)
    run = functools.partial(generate, model, batch, eos_token_id=-1, graphs=graphs)
    run(Decoding(max_new))  # captures the graphs and warms up
    one, full = (statistics.median(timed(functools.partial(run, Decoding(n)), device)[1] for _ in range(args.repeats))
                 for n in (1, max_new))
    graphed, captures = graph_figures(graphs, device)
    weight = model.lm_head.weight
    slots = generate_module.greedy_slots(max(map(len, batch)), max_new, model.config.block_size)
    kv = kv_cache_bytes(model.config, len(batch) * slots, weight.dtype)
    read = sum(p.numel() for p in model.parameters()) * weight.element_size() + kv
    with decoding_steps() as counted, Waits() as waits:
        run(Decoding(max_new))
    source = torch.empty(2**28, dtype=torch.uint8, device=device)  # the bandwidth a 256 MiB copy reaches
    copy_s = min(timed(functools.partial(torch.empty_like(source).copy_, source), device)[1] for _ in range(3))
    return [dict(figure="decode_ms_per_step", value=1000 * (full - one) / (max_new - 1), **graphed),
            dict(figure="bandwidth_floor_ms_per_step", value=1000 * read * copy_s / (2 * 2**28),
                 bytes_read_per_step=read),
            dict(figure="graph_capture_s", value=captures),
            dict(figure="host_reads_per_greedy_step", value=waits.syncs / len(counted), target="<= 1/8"),
            *predict_batch_parts(model, batch, max_new, args, device)]


def predict_batch_parts(model, prompts, max_new, args, device):
    """predict.py's batch (summarize_batches of gen_batch dialogues' text) timed whole, then as its parts in a second
    run: tokenizing, prefill, decode steps, greedy_bookkeeping (generate's rest), per_batch (summarize_batches'
    rest)."""
    dialogues = [data.get_tokenizer().decode(p[:400]) for p in prompts]
    cfg = load_config([f"--max_new_tokens={max_new}", f"--gen_batch_size={len(prompts)}", "--device=cpu"])
    summary_model = inference.SummaryModel(model, cfg)
    graphs = step_graphs(device)

    def batch():
        summarize_batches(model, summary_model.prompts(dialogues)[0], cfg, contextlib.nullcontext(), graphs=graphs)
    batch()  # warm-up (and captures)
    whole = statistics.median(timed(batch, device)[1] for _ in range(args.repeats))
    spent = dict.fromkeys(("tokenizing", "prefill", "decode_steps", "generate", "summarize"), 0.0)

    def clocked(part, fn):
        def run(*a, **kw):
            output, seconds = timed(lambda: fn(*a, **kw), device)
            spent[part] += seconds
            return output
        return run
    patches = [(summary_model, "prompts", "tokenizing"), (model, "prefill", "prefill"),
               (generate_module.StepGraphs, "__call__", "decode_steps") if graphs else
               (generate_module, "static_step", "decode_steps"),
               (inference, "generate", "generate")]
    with contextlib.ExitStack() as patched:
        for owner, name, part in patches:
            patched.enter_context(mock.patch.object(owner, name, clocked(part, getattr(owner, name))))
        clocked("summarize", batch)()
    parts = dict(tokenizing=spent["tokenizing"], prefill=spent["prefill"], decode_steps=spent["decode_steps"],
                 greedy_bookkeeping=spent["generate"] - spent["prefill"] - spent["decode_steps"],
                 per_batch=spent["summarize"] - spent["tokenizing"] - spent["generate"])
    return [*(dict(figure=f"predict_batch:{name}_ms", value=1000 * seconds) for name, seconds in parts.items()),
            dict(figure="predict_batch:whole_ms", value=1000 * whole),
            dict(figure="predict_batch:parts_sum_vs_whole", value=sum(parts.values()) / whole, target="0.9 to 1.1")]


@torch.inference_mode()
def hf_greedy(hf, batches, max_new, eos, device):
    """transformers' batched greedy generate, left-padded, cut at EOS."""
    rows = []
    for batch in batches:
        width = max(len(p) for p in batch)
        ids = torch.tensor([[eos] * (width - len(p)) + p for p in batch], device=device)
        mask = torch.tensor([[0] * (width - len(p)) + [1] * len(p) for p in batch], device=device)
        out = hf.generate(ids, attention_mask=mask, max_new_tokens=max_new, do_sample=False,
                          pad_token_id=eos, eos_token_id=eos)[:, width:].tolist()
        rows += [r[:r.index(eos)] if eos in r else r for r in out]
    return rows


@torch.inference_mode()
def naive_greedy(model, prompts, max_new, eos, device):
    """The reference notebook's decoding: one prompt at a time, the whole sequence run again for every token."""
    rows = []
    for prompt in prompts:
        seq = list(prompt)
        for _ in range(max_new):
            token = int(model(torch.tensor([seq], device=device))[0][0, -1].argmax())
            if token == eos:
                break
            seq.append(token)
        rows.append(seq[len(prompt):])
    return rows


def compare_generate(hf, ours, batches, max_new, eos, args, device, with_naive):
    """Summaries/s of our batched generator, transformers' batched generate and (optionally) a naive
    no-cache loop, one prompt at a time, on an evenly spread subset of the same length-sorted prompts."""
    flat = [p for batch in batches for p in batch]
    naive_picks = list(range(0, len(flat), max(1, len(flat) // args.naive_prompts)))[:args.naive_prompts]

    greedy = Decoding(max_new_tokens=max_new)
    graphs = step_graphs(device)
    candidates = {"ours": lambda: [row for batch in batches for row in generate(ours, batch, greedy, eos,
                                                                                  graphs=graphs)],
                  "transformers": lambda: hf_greedy(hf, batches, max_new, eos, device)}
    if with_naive:
        candidates["naive"] = lambda: naive_greedy(ours, [flat[i] for i in naive_picks], max_new, eos, device)
    outputs, seconds, memory = interleaved(candidates, device, args.repeats)
    n = len(flat)
    rate = {"ours": n / seconds["ours"], "transformers": n / seconds["transformers"]}
    matches = sum(a == b for a, b in zip(outputs["ours"], outputs["transformers"], strict=True))
    rows = [
        dict(figure="summaries_per_s_ours", value=rate["ours"], peak_mb=memory["ours"]),
        dict(figure="summaries_per_s_transformers", value=rate["transformers"], peak_mb=memory["transformers"]),
        dict(figure="speedup_vs_transformers", value=rate["ours"] / rate["transformers"], target=">= 1.5"),
        dict(figure="greedy_identical_to_transformers", value=f"{matches}/{n}", target=f"{n}/{n}"),
        dict(figure="mean_new_tokens", value=statistics.mean(map(len, outputs["ours"]))),
    ]
    if with_naive:
        naive_rate = len(naive_picks) / seconds["naive"]
        naive_matches = sum(outputs["ours"][i] == row for i, row in zip(naive_picks, outputs["naive"], strict=True))
        rows += [
            dict(figure="summaries_per_s_naive", value=naive_rate, peak_mb=memory["naive"]),
            dict(figure="speedup_vs_naive", value=rate["ours"] / naive_rate, target=">= 20"),
            dict(figure="greedy_identical_to_naive", value=f"{naive_matches}/{len(naive_picks)}",
                 target=f"{len(naive_picks)}/{len(naive_picks)}"),
        ]
    return rows


def kv_bytes_per_step(model, prompts, decoding):
    """(prompt slots', all slots') KV-cache bytes the attention reads per decode step and prompt in one generate()
    of `prompts` (no EOS): a shared prompt's (SharedPromptCache) once for all of its rows, else once per row."""
    read, calls = [0, 0], [0]

    def count(module, args):
        x, cache, mask, lengths = args[0], args[1], args[3], args[4]
        if lengths is None:
            calls[0] += module is model.transformer.h[0].attn
            slot = cache.kv[0, :, :, 0].numel() * cache.kv.element_size()
            if isinstance(cache, SharedPromptCache):  # a mask a run of prompts: their slots, then t + 1 a row
                every = sum(m.size(0) * m.size(-1) for m in mask)
                prompt = every - x.size(0) * calls[0]
            else:  # greedy: the padded prompt, then one a token
                prompt = cache.kv.size(0) * (mask.size(-1) - calls[0])
                every = prompt + x.size(0) * calls[0]
            read[0] += prompt * slot
            read[1] += every * slot

    hooks = [block.attn.register_forward_pre_hook(count) for block in model.transformer.h]
    generate(model, prompts, decoding, eos_token_id=-1, seed=0, mbr_pick=inference.mbr_pick)
    for hook in hooks:
        hook.remove()
    return [total / calls[0] / len(prompts) for total in read]


def kv_reads(model, prompts, max_new):
    """KV bytes read per decode step and prompt by greedy and by MBR-16's samples: of the prompt's slots, against
    the floor of each prompt's own tokens read once; and of all slots, the generated ones included (each sample
    reads its own: 16 of them cannot share theirs)."""
    floor = 2 * model.config.n_layer * model.config.n_embd * model.lm_head.weight.element_size() * statistics.mean(
        map(len, prompts))
    samples = dict(MBR_SAMPLING, mbr_samples=16, mbr_include_beam=False)  # the samples' decoding alone
    greedy = kv_bytes_per_step(model, prompts, Decoding(max_new_tokens=max_new))
    mbr16 = kv_bytes_per_step(model, prompts, Decoding(max_new_tokens=max_new, **samples))
    rows = [dict(figure="kv_prompt_bytes_per_step_floor", value=floor)]
    for name, (prompt, every) in (("greedy", greedy), ("mbr16", mbr16)):
        rows += [dict(figure=f"kv_prompt_bytes_per_step_{name}", value=prompt, vs_floor=prompt / floor),
                 dict(figure=f"kv_bytes_per_step_{name}", value=every)]
    return rows + [dict(figure="kv_prompt_bytes_per_step_mbr16_vs_greedy", value=mbr16[0] / greedy[0],
                        target="<= 1.3"),
                   dict(figure="kv_bytes_per_step_mbr16_vs_greedy", value=mbr16[1] / greedy[1])]


def training_examples(n, samsum_csv):
    """An Examples set (prompt + summary + EOS, prompt masked) of n SAMSum-length rows, as data.py builds it."""
    pairs, source = samsum_examples(n, samsum_csv)
    sequences = [p + s + [EOT_ID] for p, s in pairs]
    lengths = np.array([len(q) for q in sequences])
    return data.Examples(tokens=np.concatenate(sequences).astype(np.uint16),
                         offsets=np.concatenate([[0], np.cumsum(lengths)]),
                         prompt_lens=np.array([len(p) for p, _ in pairs]), ids=[], dialogues=[], summaries=[]), source


def bench_train(args, device):
    """Forward + backward throughput in real (non-pad) tokens/s on identical length-grouped micro-batches:
    ours; transformers' GPT2LMHeadModel (same weights, attention mask, labels); and the reference notebook's
    approach, every row padded to 1024 with logits at every position."""
    hf, ours = make_models(args.model, device)
    hf.train(), ours.train()
    examples, source = training_examples(args.train_batches * args.micro_batch, args.samsum_csv)
    by_length = np.argsort(examples.lengths, kind="stable").reshape(-1, args.micro_batch)
    batches = [tuple(t.to(device) for t in data.collate(examples, idx)) for idx in by_length]
    real_tokens = int((examples.lengths - 1).sum())
    F = torch.nn.functional
    # Padded to 1024, every micro-batch costs the same whatever its rows: time one, credit it the average
    # micro-batch's real tokens.
    x0, y0 = batches[0]
    padded = (F.pad(x0, (0, 1024 - x0.size(1)), value=EOT_ID), F.pad(y0, (0, 1024 - y0.size(1)), value=-1))

    def ours_step():
        for x, y in batches:
            _, loss = ours(x, y)
            loss.backward()
        ours.zero_grad(set_to_none=True)

    def hf_step():
        for x, y in batches:
            # HF shifts labels itself (labels[:, t + 1] is the target of position t): one extra pad column.
            ids = F.pad(x, (0, 1), value=EOT_ID)
            labels = F.pad(y.masked_fill(y == -1, -100), (1, 0), value=-100)
            hf(input_ids=ids, attention_mask=(ids != EOT_ID).long(), labels=labels).loss.backward()
        hf.zero_grad(set_to_none=True)

    def padded_1024_step():
        logits, _ = ours(padded[0])
        F.cross_entropy(logits.flatten(0, 1), padded[1].flatten(), ignore_index=-1).backward()
        ours.zero_grad(set_to_none=True)

    _, seconds, memory = interleaved({"ours": ours_step, "transformers": hf_step}, device, args.repeats)
    progress("one micro-batch padded to 1024")
    with peak_memory(device) as padded_memory:
        _, padded_seconds = timed(padded_1024_step, device)
    rate = {"ours": real_tokens / seconds["ours"], "transformers": real_tokens / seconds["transformers"],
            "padded_1024": real_tokens / len(batches) / padded_seconds}
    return cut_micro_batches(args, device, ours) + [
        dict(figure="real_tokens_per_s_ours", value=rate["ours"], peak_mb=memory["ours"]),
        dict(figure="real_tokens_per_s_transformers", value=rate["transformers"], peak_mb=memory["transformers"]),
        dict(figure="real_tokens_per_s_padded_1024", value=rate["padded_1024"], peak_mb=padded_memory.peak_mb),
        dict(figure="speedup_vs_transformers", value=rate["ours"] / rate["transformers"], target=">= 1.0"),
        dict(figure="speedup_vs_padded_1024", value=rate["ours"] / rate["padded_1024"], target=">= 5"),
        dict(figure="setup", value=f"{args.model} model, {len(batches)} micro-batches of {args.micro_batch} {source} "
             f"rows (fwd+bwd), padded-1024 timed on one, median of {args.repeats}, {device}"),
    ]


def cut_micro_batches(args, device, model):
    """Padded fraction over 16 global batches of 256 SAMSum rows at micro_batch_size 256 and 16, uncut against cut;
    then real tokens/s (fwd+bwd, the GPU's autocast) of GROUP_STEPS global batches of cut_rows rows, each as one
    uncut micro-batch against its cuts (micro_batch_size=cut_rows: the same peak memory)."""
    examples, source = training_examples(818, args.samsum_csv)
    rows = []
    for micro in (256, 16):
        batches, real, uncut, cut, count = data.TrainBatches(examples, Config(micro_batch_size=micro)), 0, 0, 0, 0
        for step in range(16):
            batch, inputs = batches(step), examples.lengths[batches.sampler.global_batch(step)] - 1
            uncut += sum(len(c) * int(data.padded_width(c.max())) for c in inputs.reshape(-1, micro))
            real, cut, count = real + batch.tokens, cut + batch.positions, count + len(batch.micro_batches)
        rows += [dict(figure=f"padded_fraction_micro_batch_{micro}", value=1 - real / cut,
                      uncut=1 - real / uncut, micro_batches=count / 16, target="<= 0.10" if micro > 16 else "<= 0.05")]
    big = device.type == "cuda" and torch.cuda.get_device_properties(device).total_memory >= 60 * 2**30  # H100/H200
    progress(f"cut micro-batches against uncut ones, {device}")
    cut_rows = args.cut_rows or (256 if big else 32 if device.type == "cuda" else 8)  # a T4 fits 32 rows of gpt2
    batches = data.TrainBatches(examples, Config(batch_size=cut_rows, micro_batch_size=cut_rows))
    cut = [xy for step in range(data.GROUP_STEPS) for xy in batches(step).micro_batches]
    uncut = [data.collate(examples, batches.sampler.global_batch(step)) for step in range(data.GROUP_STEPS)]
    t4 = device.type == "cuda" and torch.cuda.get_device_capability(device)[0] < 8  # no bfloat16 before Ampere
    autocast = torch.autocast(device.type, torch.float16 if t4 else torch.bfloat16, enabled=device.type == "cuda")

    def step(micro_batches):
        for x, y in micro_batches:
            with autocast:
                loss = model(x.to(device), y.to(device))[1]
            loss.backward()
        model.zero_grad(set_to_none=True)
    _, seconds, _ = interleaved({"cut": lambda: step(cut), "uncut": lambda: step(uncut)}, device, args.repeats)
    tokens = sum(batches(step).tokens for step in range(data.GROUP_STEPS))
    return rows + [dict(figure="real_tokens_per_s_cut", value=tokens / seconds["cut"],
                        micro_batches=len(cut) / data.GROUP_STEPS),
                   dict(figure="real_tokens_per_s_uncut", value=tokens / seconds["uncut"]),
                   dict(figure="cut_speedup_vs_uncut", value=seconds["uncut"] / seconds["cut"],
                        target=">= 1.3 (H100/H200)"),
                   dict(figure="cut_setup", value=f"{len(examples)} {source} rows; timed: {data.GROUP_STEPS} x "
                        f"{cut_rows} rows, {args.model} model, median of {args.repeats}, {device}")]


# MBR's candidates: samples at temperature 0.7 among the 50 most likely tokens, none below probability 0.02
# (epsilon sampling), plus the greedy summary
MBR_SAMPLING = dict(temperature=0.7, top_k=50, epsilon=0.02, mbr_include_beam=True)
DECODINGS = {"greedy": {}, "beam4": dict(num_beams=4), "mbr8": dict(mbr_samples=8, **MBR_SAMPLING),
             "mbr16": dict(mbr_samples=16, **MBR_SAMPLING)}

# A tiny model trained from scratch on the SAMSum rows that are not held out (val_fraction of them are)
SAMSUM_TINY = ["--init_from=scratch", "--val_fraction=0.25", "--validation_csv=", "--block_size=256",
               "--max_new_tokens=48", "--batch_size=16", "--micro_batch_size=16", "--max_iters=300",
               "--eval_interval=300", "--rouge_samples=0", "--best_metric=val_loss"]


def bench_decode(args, device):
    """ROUGE and summaries/s of DECODINGS and of greedy in 16 bits against float32: on the demo model (out-demo/
    best.pt, else trained here) and a tiny one trained on 75% of SAMSum's validation CSV, scored on the rest."""
    with tempfile.TemporaryDirectory() as tmp:
        demo = demo_arguments(tmp, device.type)
        demo_ckpt = os.path.join(ROOT, "out-demo", "best.pt")
        if os.path.exists(demo_ckpt):
            rows = compare_decodings("demo", load_config(demo), demo_ckpt, device, args.repeats)
            source = "out-demo/best.pt"
        else:
            rows = compare_decodings("demo", train_quietly([*demo, f"--out_dir={tmp}/demo"]), None, device,
                                     args.repeats)
            source = "trained here with config/demo.py"
        if os.path.exists(args.samsum_csv):
            cfg = train_quietly([*demo, f"--train_csv={args.samsum_csv}", *SAMSUM_TINY, f"--out_dir={tmp}/samsum"])
            rows += compare_decodings("samsum", cfg, None, device, args.repeats)
            source += (f"; samsum model: 2 layers, 64 wide, trained {cfg.max_iters} steps from scratch on "
                       f"{1 - cfg.val_fraction:.0%} of {os.path.basename(args.samsum_csv)}, scored on the rest")
        else:
            rows.append(dict(figure="samsum", value=f"skipped: {args.samsum_csv} not found"))
    rows.append(dict(figure="setup", value=f"demo model: {source}; MBR candidates: {MBR_SAMPLING}; median of "
                     f"{args.repeats} interleaved runs after a warm-up, {device}"))
    return rows


def compare_decodings(name, cfg, ckpt, device, repeats):
    summary_model = open_summary_model(dataclasses.replace(cfg, ckpt=ckpt or ""))
    model = summary_model.model.to(device).eval()
    val = data.load_splits(summary_model.cfg).val
    prompts, _ = summary_model.prompts(val.dialogues)
    # every prefill and decode step sends one hidden state per row through ln_f into lm_head: count them
    lm_head_rows, decoded = [], {}
    model.transformer.ln_f.register_forward_hook(lambda module, args, out: lm_head_rows.append(out.size(0)))
    # evaluate.py and predict.py hold the weights in the run's dtype (inference.load_summary_model): greedy in it
    # against float32. By compute capability: is_bf16_supported() is True on a T4, which only emulates bfloat16.
    half = (torch.bfloat16 if device.type == "cpu" or torch.cuda.get_device_capability(device) >= (8, 0)
            else torch.float16)
    half_greedy = f"greedy_{str(half).removeprefix('torch.')}"
    half_model = copy.deepcopy(model).to(half)  # the copy keeps the counting hook
    runs = {method: (model, dataclasses.replace(summary_model.cfg, **options)) for method, options in DECODINGS.items()}
    runs[half_greedy] = (half_model, summary_model.cfg)

    def decode(method):
        decoding_model, run_cfg = runs[method]
        lm_head_rows.clear()
        predictions = summarize_batches(decoding_model, prompts, run_cfg, contextlib.nullcontext())
        decoded[method] = sum(lm_head_rows)  # the same every run: sampling is seeded
        return predictions

    summaries, seconds, _ = interleaved({method: functools.partial(decode, method) for method in runs}, device, repeats)
    rows, scores = [], {}
    for method in runs:
        predictions = summaries[method]
        score = scores[method] = rouge(predictions, val.summaries)
        rate = len(predictions) / seconds[method]
        rows.append(dict(figure=f"{name}:{method}", **score, summaries_per_s=rate, lm_head_rows=decoded[method],
                         value=f"ROUGE-1 {score['rouge1']:.4f}  ROUGE-2 {score['rouge2']:.4f}  ROUGE-L "
                               f"{score['rougeL']:.4f}  {rate:.1f} summaries/s  {decoded[method]} lm_head rows"))
    rows += [dict(figure=f"{name}:mbr16_rougeL_gain_points",
                  value=100 * (scores["mbr16"]["rougeL"] - scores["greedy"]["rougeL"]), target=">= 1"),
             dict(figure=f"{name}:mbr16_time_vs_greedy", value=seconds["mbr16"] / seconds["greedy"], target="<= 4"),
             dict(figure=f"{name}:mbr16_lm_head_rows_vs_greedy", value=decoded["mbr16"] / decoded["greedy"]),
             dict(figure=f"{name}:{half_greedy}_rougeL_change_points",
                  value=100 * (scores[half_greedy]["rougeL"] - scores["greedy"]["rougeL"])),
             dict(figure=f"{name}:{half_greedy}_summaries_identical_to_float32",
                  value=f"{sum(map(str.__eq__, summaries[half_greedy], summaries['greedy']))}/{len(val.dialogues)}"),
             dict(figure=f"{name}:dialogues", value=len(val.dialogues))]
    return rows


# a row's keys the table shows beside its value
EXTRA = ("_gib", "fits_t4", "micro_batch_size", "uncut", "micro_batches", "by_operator")
SECTIONS = {"train": bench_train, "generate": bench_generate, "decode": bench_decode,
            "memory": lambda args, device: bench_memory.bench_memory(args, args.samsum_csv),
            "compile": bench_compile.bench_compile}


def main():
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--section", default="all", choices=["all", *SECTIONS])
    parser.add_argument("--model", default="small", choices=list(MODELS))
    parser.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    parser.add_argument("--samsum_csv", default=SAMSUM_CSV, help="SAMSum-style CSV (id, dialogue, summary) for the "
                        "SAMSum figures; without it they use random tokens of SAMSum's lengths, or are skipped")
    parser.add_argument("--json", action="store_true", help="one JSON object per figure instead of a table")
    for name, default in dict(repeats=3, gen_prompts=48, gen_batch=16, naive_prompts=3, max_new_tokens=32,
                              train_batches=2, micro_batch=4, compile_steps=50).items():
        parser.add_argument(f"--{name}", type=int, default=default)
    parser.add_argument("--cut_rows", type=int, help="rows of the global batches timed cut and "
                        "uncut (256 on a GPU of 60 GiB or more, 32 on a smaller one, 8 on a CPU)")
    args = parser.parse_args()
    device = torch.device(args.device)
    sections = SECTIONS if args.section == "all" else {args.section: SECTIONS[args.section]}
    for section, run in sections.items():
        progress(f"section {section}, {args.model} model, {device}")
        for row in ({"section": section, **row} for row in run(args, device)):  # a row of another owner has its own
            if args.json:
                print(json.dumps(row))
            else:
                value = f"{row['value']:.2f}" if isinstance(row["value"], float) else row["value"]
                extra = f"  (target {row['target']})" if "target" in row else ""
                extra += f"  peak {row['peak_mb']:.0f} MiB" if "peak_mb" in row else ""
                extra += "".join(f"  {key} {value:.2f}" if isinstance(value, float) else f"  {key} {value}"
                                 for key, value in row.items() if key.endswith(EXTRA))
                print(f"{row['section']:<9} {row['figure']:<44} {value}{extra}")


if __name__ == "__main__":
    main()
