"""python -m bench --section=calibrate: does the calibration stage (calibrate.py) buy ROUGE? From one token-trained
checkpoint, continue the same steps on the same rows with (a) the token loss only and (b) the token loss plus the
ranking loss, then score the final weights of each, greedy and beam 4, on rows neither trained on: the demo model
(its validation CSV) and a tiny model trained here on part of SAMSum's validation CSV (scored on the rest)."""
import contextlib
import dataclasses
import os
import sys
import tempfile
import time

import data
import train
from bench import ROOT
from config import load_config
from summarizer.inference import open_run, summarize
from summarizer.metrics import rouge
from summarizer.preparation import prepare
from summarizer.ranking import Ranking
from summarizer.runtime import Runtime

# A tiny model trained from scratch on the SAMSum rows that are not held out (val_fraction of them are)
SAMSUM_TINY = ["--init_from=scratch", "--val_fraction=0.25", "--validation_csv=", "--block_size=256",
               "--max_new_tokens=48", "--batch_size=16", "--micro_batch_size=16", "--max_iters=300",
               "--eval_interval=300", "--rouge_samples=0", "--best_metric=val_loss"]
# stage 2, (a) and (b) alike: a short continuation at a tenth of the demo preset's peak learning rate, evaluated
# (and its ckpt.pt written) once, at the end; no ROUGE during training, so nothing is picked on the scored rows
CONTINUE = ["--warmup_iters=5", "--learning_rate=1e-3", "--min_lr=1e-4", "--rouge_samples=0",
            "--best_metric=val_loss"]
RANKING = ["--rank_weight=1.0"]
DECODINGS = {"greedy": {}, "beam4": dict(num_beams=4)}


def demo_arguments(tmp, device):
    """config/demo.py on its own CSVs, caching tokens in `tmp`, nothing run after training."""
    argv = [os.path.join(ROOT, "config", "demo.py"), f"--data_cache_dir={tmp}/cache", f"--device={device.type}",
            "--evaluate_after=False", "--predict_after=False", "--sample_submission_csv="]
    return argv + [f"--{split}_csv={os.path.join(ROOT, 'data', 'demo', split + '.csv')}"
                   for split in ("train", "validation", "test")]


def train_quietly(argv, objective=None):
    """Train as train.py (or with the Ranking objective, calibrate.py) would, its log on stderr so stdout stays
    the benchmark's; returns the config."""
    cfg = load_config(argv)
    with contextlib.redirect_stdout(sys.stderr), Runtime(cfg) as rt:
        train.Trainer(prepare(cfg, rt, objective), rt).fit()
    return cfg


def scores(cfg, ckpt):
    """{decoding: ROUGE} of checkpoint `ckpt` on the run's validation rows."""
    run = open_run(dataclasses.replace(cfg, ckpt=ckpt))
    run.model.eval()
    val = data.load_datasets(run.cfg).val
    prompts, _ = run.prompts(val.dialogues)
    return {name: rouge(summarize(run.model, prompts, dataclasses.replace(run.cfg, **options),
                                  contextlib.nullcontext()), val.summaries)
            for name, options in DECODINGS.items()}, len(prompts)


def compare(name, argv, steps, tmp, extra=()):
    """Train stage 1 with `argv`, then (a) and (b) for `steps` steps each from its best.pt; the figure rows."""
    first = train_quietly([*argv, f"--out_dir={tmp}/{name}"])
    start_from = os.path.join(first.out_dir, "best.pt")
    rows, results, seconds = [], {}, {}
    for stage, ranking in (("token", []), ("token+rank", [*RANKING, *extra])):
        out = f"{tmp}/{name}-{stage}"
        begin = time.perf_counter()
        cfg = train_quietly([*argv, *CONTINUE, f"--init_from={start_from}", f"--max_iters={steps}",
                             f"--eval_interval={steps}", f"--out_dir={out}", *ranking],
                            Ranking if ranking else None)
        seconds[stage] = time.perf_counter() - begin
        results[stage], dialogues = scores(cfg, os.path.join(out, "ckpt.pt"))
    for decoding in DECODINGS:
        a, b = results["token"][decoding]["rougeL"], results["token+rank"][decoding]["rougeL"]
        rows += [dict(section="calibrate", figure=f"calibrate:{name}:{decoding}:rougeL", token=a, token_rank=b,
                      value=f"token {a:.4f}  token+rank {b:.4f}"),
                 dict(section="calibrate", figure=f"calibrate:{name}:{decoding}:rougeL_gain_points",
                      value=100 * (b - a), target=">= 1.0" if decoding == "greedy" and name == "samsum" else ">= 0")]
    rows += [dict(section="calibrate", figure=f"calibrate:{name}:seconds", token=seconds["token"],
                  token_rank=seconds["token+rank"], value=f"token {seconds['token']:.0f}  token+rank "
                  f"{seconds['token+rank']:.0f} (candidates included)"),
             dict(section="calibrate", figure=f"calibrate:{name}:time_vs_token", target="stated",
                  value=seconds["token+rank"] / seconds["token"]),
             dict(section="calibrate", figure=f"calibrate:{name}:scored_dialogues", value=dialogues)]
    return rows


def bench_calibrate(args, device, samsum_csv):
    steps = args.calibrate_steps
    with tempfile.TemporaryDirectory() as tmp:
        demo = demo_arguments(tmp, device)
        rows = compare("demo", demo, steps, tmp)
        if os.path.exists(samsum_csv):
            rows += compare("samsum", [*demo, f"--train_csv={samsum_csv}", *SAMSUM_TINY], steps, tmp)
        else:
            rows.append(dict(section="calibrate", figure="samsum", value=f"skipped: {samsum_csv} not found"))
    rows.append(dict(section="calibrate", figure="setup", value=f"stage 2: {steps} steps from the same best.pt, "
                     f"{' '.join(CONTINUE)}; (b) adds {' '.join(RANKING)}; final weights scored; {device}"))
    return rows
