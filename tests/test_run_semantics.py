"""The run does what it says: precision under Accelerate, the LR schedule, hyperparameters and best_metric across a
resume, fresh runs into a used out_dir, which weights evaluate.py/predict.py score, slim best.pt, the gradient
norm, the next step's micro-batches built while a step computes."""
import copy
import json
import math
import os
import sys

import pytest
import torch

import data
import evaluate
import predict
import train
from command_line import UserError
from config import load_config
from conftest import metrics, one_error_line, run, tiny
from model import GPT
from summarizer import backends
from summarizer.backends import use_compile
from summarizer.checkpoint import load_checkpoint
from summarizer.clock import describe_schedule, learning_rate, lr_schedule
from summarizer.preparation import prepare
from summarizer.process import Process, choose_precision
from summarizer.state import TrainingState

# no --dtype: the precision tests decide it (auto, or Accelerate's mixed precision)
RUN = [*tiny(dtype=None), "--log_interval=1", "--warmup_iters=2", "--learning_rate=3e-3", "--batch_size=8",
       "--micro_batch_size=4", "--rouge_samples=0", "--best_metric=val_loss", "--sample_submission_csv="]


@pytest.fixture
def args(write_csv, tmp_path):
    csv = write_csv("train.csv", 40)
    return [*RUN, f"--train_csv={csv}", f"--test_csv={write_csv('test.csv', 5, seed=7, test=True)}",
            f"--data_cache_dir={tmp_path / 'cache'}", f"--out_dir={tmp_path / 'out'}"]


# ---- precision and compile under Accelerate -----------------------------------------------------------------

@pytest.mark.parametrize("requested, device, capability, accelerate, expected", [
    ("auto", "cuda", (7, 5), "no", ("float16", True)),  # a plain `accelerate launch` on a T4 keeps fp16
    ("auto", "cuda", (7, 5), "fp16", ("float16", True)),  # adopted, with a GradScaler
    ("auto", "cuda", (8, 0), "fp16", ("float16", True)),
    ("auto", "cuda", (8, 0), "bf16", ("bfloat16", False)),
    ("auto", "cpu", None, "bf16", ("bfloat16", False)),
    ("bfloat16", "cuda", (9, 0), "bf16", ("bfloat16", False)),  # both say the same
    ("float32", "cuda", (9, 0), "no", ("float32", False)),
])
def test_accelerates_mixed_precision_is_adopted_or_deferred_to(requested, device, capability, accelerate, expected):
    assert choose_precision(requested, device, capability, accelerate) == expected


@pytest.mark.parametrize("requested, device, capability, accelerate, message", [
    ("float32", "cpu", None, "bf16", "--dtype=float32 .*mixed_precision=bf16"),
    ("float16", "cuda", (8, 0), "bf16", "--dtype=float16 .*mixed_precision=bf16"),
    ("auto", "cuda", (7, 5), "bf16", "compute capability >= 8.0"),  # bf16 is refused on a T4 whoever asks
    ("auto", "cuda", (9, 0), "fp8", "mixed_precision='fp8'"),
])
def test_a_disagreement_with_accelerate_is_one_error_line(requested, device, capability, accelerate, message):
    with pytest.raises(UserError, match=message) as info:
        choose_precision(requested, device, capability, accelerate)
    assert "\n" not in str(info.value)


@pytest.mark.parametrize("requested, device, dynamo, expected", [
    ("auto", "cpu", "inductor", True), (True, "cpu", "inductor", True), ("auto", "cpu", "no", False),
    (False, "cuda", "no", False), ("auto", "cuda", "no", True)])
def test_accelerates_dynamo_backend_decides_compile_with_ours(requested, device, dynamo, expected):
    assert use_compile(requested, device, dynamo) is expected


@pytest.mark.parametrize("requested, dynamo, message", [
    (False, "inductor", "--compile=False .*dynamo_backend=inductor"),
    ("auto", "aot_eager", "dynamo_backend=aot_eager")])
def test_accelerates_dynamo_backend_against_compile_is_one_error_line(requested, dynamo, message):
    with pytest.raises(UserError, match=message):
        use_compile(requested, "cpu", dynamo)


@pytest.mark.parametrize("variable", ["ACCELERATE_USE_FSDP", "ACCELERATE_USE_DEEPSPEED"])
def test_an_accelerate_config_for_fsdp_or_deepspeed_is_refused(args, variable, monkeypatch, capsys):
    monkeypatch.setenv(variable, "true")  # as `accelerate launch` passes its config
    err = one_error_line(capsys, train.main, [*args, "--max_iters=1"])
    assert err.startswith("error: the Accelerate config asks for")


def test_accelerate_bf16_with_dtype_float32_stops_with_one_line(args, monkeypatch, capsys):
    monkeypatch.setenv("ACCELERATE_MIXED_PRECISION", "bf16")
    err = one_error_line(capsys, train.main, [*args, "--max_iters=1", "--dtype=float32"])
    assert "--dtype=float32" in err and "mixed_precision=bf16" in err


@pytest.mark.slow
def test_accelerate_bf16_with_dtype_auto_trains_exactly_like_our_bfloat16(args, tmp_path, capsys):
    """Accelerate's bf16 is adopted as our bf16 autocast, and Accelerate adds no autocast of its own."""
    common = [*args, "--max_iters=3", "--eval_interval=3"]
    under = run([sys.executable, "train.py", *common, "--dtype=auto", f"--out_dir={tmp_path / 'acc'}"],
                env={"ACCELERATE_MIXED_PRECISION": "bf16"})
    assert under.returncode == 0, under.stderr[-2000:]
    capsys.readouterr()
    train.main([*common, "--dtype=bfloat16", f"--out_dir={tmp_path / 'plain'}"])
    assert "bfloat16 on cpu, eager, backend accelerate (following Accelerate's mixed_precision=bf16)" in under.stdout
    assert "bfloat16 on cpu, eager, backend none" in capsys.readouterr().out
    got, expected = metrics(tmp_path / "acc"), metrics(tmp_path / "plain")
    assert [r["loss"] for r in got] == [r["loss"] for r in expected]
    assert got[-1]["val_loss"] == expected[-1]["val_loss"]
    train.main([*common, "--dtype=float32", f"--out_dir={tmp_path / 'fp32'}"])
    assert metrics(tmp_path / "fp32")[0]["loss"] != got[0]["loss"]  # bf16 did run


# ---- resuming: the LR schedule, changed hyperparameters, another best_metric -------------------------------

def test_a_fresh_schedule_is_warmup_then_cosine_to_min_lr():
    schedule = lr_schedule({"warmup_iters": 2, "learning_rate": 1e-3, "min_lr": 1e-4, "lr_decay_iters": 0,
                                  "max_iters": 10})
    lrs = [learning_rate(it, schedule) for it in range(12)]
    assert lrs[:2] == pytest.approx([1e-3 / 3, 2e-3 / 3])
    assert lrs[2] == pytest.approx(1e-3) and lrs[10:] == [1e-4, 1e-4]
    assert lrs[6] == pytest.approx(1e-4 + 0.5 * (1 + math.cos(math.pi * 4 / 8)) * 9e-4)
    assert all(a >= b for a, b in zip(lrs[2:], lrs[3:], strict=False))


def test_resume_with_a_larger_max_iters_never_raises_the_lr(args, tmp_path, capsys):
    train.main([*args, "--max_iters=6", "--eval_interval=6"])
    capsys.readouterr()
    # as the continue command gives it: without --learning_rate, which would decay from that peak again
    continued = [arg for arg in args if not arg.startswith("--learning_rate=")]
    train.main([*continued, "--max_iters=12", "--eval_interval=6", "--init_from=resume"])
    out = capsys.readouterr().out
    lrs = [r["lr"] for r in metrics(tmp_path / "out")]
    assert len(lrs) == 12 and lrs[6] <= lrs[5] and max(lrs[6:]) <= lrs[5]
    assert lrs[6:] == [2e-5] * 6  # the 6-step run's decay had ended at min_lr: it stays there
    assert f"learning rate at iter 7: {lrs[6]:.2e}; stays at min_lr" in out and "until iter 12" in out


def test_resume_with_a_new_lr_decay_iters_decays_from_the_current_lr(args, tmp_path, capsys):
    train.main([*args, "--max_iters=6", "--eval_interval=6", "--lr_decay_iters=10"])
    train.main([*args, "--max_iters=12", "--eval_interval=6", "--lr_decay_iters=12", "--init_from=resume"])
    lrs = [r["lr"] for r in metrics(tmp_path / "out")]
    old = lr_schedule({"warmup_iters": 2, "learning_rate": 3e-3, "min_lr": 2e-5, "lr_decay_iters": 10,
                             "max_iters": 6})
    assert lrs[6] == pytest.approx(learning_rate(6, old))  # continues from where the run was
    assert all(a > b for a, b in zip(lrs[5:12], lrs[6:12], strict=False))  # and decays to min_lr at the new horizon
    assert lrs[11] > 2e-5 and f"cosine decay to {lrs[11]:.2e} at iter 12 (it would reach min_lr 2.00e-05 at iter 13)" \
        in capsys.readouterr().out


def test_a_decay_whose_last_step_shows_min_lr_says_one_end():
    """max_iters=300 decays to min_lr at iter 301, one after the last, whose LR already reads as min_lr: the line
    names that one end, not two that read alike."""
    schedule = lr_schedule({"warmup_iters": 10, "learning_rate": 6e-4, "min_lr": 3e-4, "lr_decay_iters": 0,
                            "max_iters": 300})
    assert describe_schedule(schedule, 150, 300, 6e-4).endswith("; cosine decay to 3.00e-04 at iter 300")


def test_a_resume_under_max_time_promises_no_iter_the_budget_may_not_reach():
    """A resume at iter 150 of max_iters=300 whose budget may end sooner: its line says the decay's end by max_iters
    may come sooner, at min_lr; the max_time line names the iter (at the pace measured)."""
    from summarizer.clock import Clock
    schedule = lr_schedule({"warmup_iters": 10, "learning_rate": 1e-2, "min_lr": 1e-3, "lr_decay_iters": 0,
                            "max_iters": 300})
    assert describe_schedule(schedule, 150, 300, 1e-2, by_clock=True).endswith(
        "; cosine decay to 1.00e-03 at iter 300; or sooner, to min_lr at the last step max_time leaves (the max_time "
        "line says which)")
    clock = Clock(50, started=0.0, now=lambda: 0.0)
    clock.prime(1.0, tokens=1)  # a step a second: 50 steps, to iter 200
    assert clock.budget_line(150, 300, False, 1, 1).endswith(
        "cools down over the last 20% of them to min_lr at the last (iter 200 at this pace), by the clock")


@pytest.mark.slow
def test_resuming_inside_the_warmup_prints_the_logged_learning_rate(args, tmp_path, capsys):
    out, args = tmp_path / "out", [*args, "--learning_rate=1e-2"]
    train.main([*args, "--max_iters=3", "--eval_interval=3", "--warmup_iters=10"])
    capsys.readouterr()
    train.main([*args, "--max_iters=20", "--eval_interval=20", "--warmup_iters=10", "--init_from=resume"])
    printed = capsys.readouterr().out
    rows = {r["iter"]: r["lr"] for r in metrics(out)}
    assert f"learning rate at iter 4: {rows[4]:.2e}; warmup: rises to 1.00e-02 at iter 11, then cosine decay " \
           f"to min_lr 2.00e-05 at iter 21" in printed or \
           f"learning rate at iter 4: {rows[4]:.2e}; warmup: rises to 1.00e-02 at iter 11, then cosine decay to " \
           f"{rows[20]:.2e} at iter 20" in printed
    assert rows[4] > rows[3] and max(rows.values()) == pytest.approx(1e-2) and rows[20] < rows[11]
    err = one_error_line(capsys, train.main, [*args, "--max_iters=20", "--warmup_iters=10", "--init_from=resume"])
    assert "iter 20" in err and "max_iters=20" in err


def test_a_rouge_tie_goes_to_the_evaluation_with_the_lower_validation_loss():
    """improved() is a question: asked twice it answers alike and changes nothing; the loop records the best."""
    state, best = TrainingState(None, None, None, {}, {}, ""), []
    evaluations = [(0.0, 3.0), (0.0, 2.5), (0.0, 2.7), (0.1, 2.9), (0.1, 2.95), (0.1, 2.8), (0.05, 1.0)]
    for rouge, loss in evaluations:
        stats, before = {"rougeL": rouge, "val_loss": loss}, (state.best_score, state.best_val_loss)
        best.append(state.improved(stats, "rougeL"))
        assert state.improved(stats, "rougeL") == best[-1] and (state.best_score, state.best_val_loss) == before
        if best[-1]:  # as train.Trainer.save records it
            state.best_score, state.best_val_loss = rouge, loss
    assert best == [True, True, False, True, False, True, False]


def test_resume_with_another_best_metric_tracks_it_and_keeps_the_old_best(args, tmp_path, capsys):
    out = tmp_path / "out"
    train.main([*args, "--max_iters=2", "--eval_interval=2", "--rouge_samples=4", "--best_metric=val_loss"])
    old_best = (out / "best.pt").read_bytes()
    capsys.readouterr()
    train.main([*args, "--max_iters=6", "--eval_interval=2", "--rouge_samples=4", "--best_metric=rougeL",
                "--init_from=resume"])
    assert f"best.pt follows rougeL from the next evaluation on; the best by val_loss is kept as " \
           f"{out / 'best-val_loss.pt'}" in capsys.readouterr().out
    assert (out / "best-val_loss.pt").read_bytes() == old_best
    best = load_checkpoint(str(out / "best.pt"))
    evals = [r for r in metrics(out) if "rougeL" in r and r["iter"] > 2]
    first_best = max(evals, key=lambda r: (r["rougeL"], -r["val_loss"]))  # a tie goes to the lower val_loss
    assert best["best_metric"] == "rougeL" and best["iter_num"] == first_best["iter"]


def test_hyperparameters_given_to_a_resumed_run_take_effect(args, tmp_path, capsys):
    train.main([*args, "--max_iters=3", "--eval_interval=3"])
    before = load_checkpoint(str(tmp_path / "out" / "ckpt.pt"))["optimizer"]["state"]
    resume = [*args, "--max_iters=4", "--eval_interval=4", "--init_from=resume"]
    cfg = load_config([*resume, "--weight_decay=0", "--grad_clip=0.5", "--beta2=0.9", "--dropout=0.25"])
    trainer = train.Trainer(prepare(cfg, proc := Process(cfg)), proc)
    assert "changed since the checkpoint, applied from iter 3: weight_decay 0.1 -> 0.0, beta2 0.95 -> 0.9, " \
           "dropout 0.0 -> 0.25, grad_clip 1.0 -> 0.5" in capsys.readouterr().out
    trainer.fit()
    after = load_checkpoint(str(tmp_path / "out" / "ckpt.pt"))["optimizer"]
    # AdamW's first moment took the clipped gradient: exp_avg = beta1 * exp_avg_before + (1 - beta1) * gradient
    applied = torch.stack([((after["state"][i]["exp_avg"] - 0.9 * before[i]["exp_avg"]) / 0.1).norm()
                           for i in before]).norm().item()
    grad_norm = metrics(tmp_path / "out")[-1]["grad_norm"]
    assert grad_norm > 0.5 and applied == pytest.approx(0.5, rel=1e-3)
    groups = after["param_groups"]
    assert [g["weight_decay"] for g in groups] == [0.0, 0.0] and groups[0]["betas"] == (0.9, 0.9)
    drops = [m.p for m in trainer.model.modules() if isinstance(m, torch.nn.Dropout)]
    assert drops and set(drops) == {0.25} and trainer.model.transformer.h[0].attn.dropout == 0.25


@pytest.mark.parametrize("change, message", [
    ("--n_layer=2", "n_layer=1, not 2"),
    ("--warmup_iters=5", "warmup_iters"),
    ("--lora_rank=4", "lora_rank=0, not 4"),
])
def test_what_a_resumed_run_cannot_change_stops_it_with_one_line(args, change, message):
    train.main([*args, "--max_iters=2", "--eval_interval=2"])
    with pytest.raises(UserError, match=message):  # the settings are resolved against the run once, before any work
        train.read_settings([*args, "--max_iters=4", "--init_from=resume", change])


# ---- out_dir: a fresh run never loses or mixes with an earlier one ----------------------------------------

def test_a_second_fresh_run_moves_the_first_aside(args, tmp_path, capsys):
    out = tmp_path / "out"
    train.main([*args, "--max_iters=2", "--eval_interval=2"])
    predict.main([*args])
    first = {name: (out / name).read_bytes() for name in os.listdir(out) if (out / name).is_file()}
    assert {"ckpt.pt", "best.pt", "metrics.jsonl", "config.json", "submission.csv"} <= set(first)
    capsys.readouterr()
    train.main([*args, "--max_iters=3", "--eval_interval=3", "--learning_rate=1e-3"])
    moved_line = next(line for line in capsys.readouterr().out.splitlines() if "held an earlier run" in line)
    previous = [p for p in out.iterdir() if p.name.startswith("previous-run-")]
    assert len(previous) == 1 and str(previous[0]) in moved_line
    assert {name: (previous[0] / name).read_bytes() for name in os.listdir(previous[0])} == first
    assert [r["iter"] for r in metrics(out)] == [1, 2, 3]  # nothing of the first run's rows
    assert not (out / "submission.csv").exists()
    train.main([*args, "--max_iters=1", "--eval_interval=1"])  # a third run: a second folder, nothing overwritten
    assert len([p for p in out.iterdir() if p.name.startswith("previous-run-")]) == 2


# ---- which weights evaluate.py and predict.py score ---------------------------------------------------------

@pytest.mark.slow
def test_evaluate_with_the_training_flags_scores_and_names_the_checkpoint(args, write_csv, tmp_path, capsys):
    val = write_csv("val.csv", 6, seed=5)
    flags = [*args, f"--validation_csv={val}", "--max_iters=30", "--eval_interval=30", "--rouge_samples=6",
             "--best_metric=rougeL", "--learning_rate=1e-2"]
    train.main(flags)
    best = load_checkpoint(str(tmp_path / "out" / "best.pt"))
    capsys.readouterr()
    evaluate.main(flags)
    report = json.loads((tmp_path / "out" / "eval_metrics.json").read_text())
    printed = capsys.readouterr().out
    assert printed.startswith(f"weights: {tmp_path / 'out' / 'best.pt'} (iter 30, best rougeL ")
    assert report["rougeL"]["mean"] == pytest.approx(best["metrics"]["rougeL"], abs=1e-12)
    assert report["rougeL"]["mean"] > 0
    checkpoint_predictions = (tmp_path / "out" / "eval_predictions.csv").read_bytes()
    evaluate.main([*flags, "--baseline=scratch"])
    assert "weights: baseline=scratch (untrained" in capsys.readouterr().out
    baseline = json.loads((tmp_path / "out" / "baseline-scratch" / "eval_metrics.json").read_text())
    assert baseline["rougeL"]["mean"] < report["rougeL"]["mean"]
    assert (tmp_path / "out" / "eval_predictions.csv").read_bytes() == checkpoint_predictions


def test_best_pt_is_weights_only_less_than_half_of_ckpt_pt_and_predict_loads_it(args, tmp_path, capsys):
    train.main([*args, "--max_iters=2", "--eval_interval=2"])
    out = tmp_path / "out"
    best, ckpt = load_checkpoint(str(out / "best.pt")), load_checkpoint(str(out / "ckpt.pt"))
    assert set(best) == {"format", "model", "model_args", "config", "metrics", "iter_num", "best_metric", "best_score",
                         "best_val_loss", "tokenizer", "train_rows", "validation_digest"}
    assert {"optimizer", "scaler", "rng", "schedule"} <= set(ckpt)
    assert os.path.getsize(out / "best.pt") < os.path.getsize(out / "ckpt.pt") / 2
    capsys.readouterr()
    predict.main(args)
    assert capsys.readouterr().out.startswith(f"weights: {out / 'best.pt'} (iter 2, best val_loss ")
    assert len((out / "submission.csv").read_text().splitlines()) == 6
    os.replace(out / "best.pt", out / "ckpt.pt")
    cfg = load_config([*args, "--max_iters=3", "--init_from=resume"])
    with pytest.raises(UserError, match="holds weights only .*: resume from the run's ckpt.pt, or train on from "
                                        f"these weights in a new run: --init_from={out / 'ckpt.pt'} --out_dir="):
        train.Trainer(prepare(cfg, proc := Process(cfg)), proc)


# ---- the gradient norm -----------------------------------------------------------------------------------

def test_grad_norm_is_the_norm_before_clipping(args):
    cfg = load_config([*args, "--max_iters=1", "--grad_clip=1e-3", "--dtype=float32"])
    trainer = train.Trainer(prepare(cfg, proc := Process(cfg)), proc)
    reference = copy.deepcopy(trainer.model)
    batch = trainer.setup.batches(0)
    scale = 1 / batch.targets
    for x, y in batch.micro_batches:
        _, loss = reference(x, y)
        (loss * (y != -1).sum() * scale).backward()
    expected = torch.linalg.vector_norm(torch.stack([p.grad.norm() for p in reference.parameters()])).item()
    done = trainer.train_step(0)
    grad_norm, skipped = done.grad_norm, done.skipped
    assert grad_norm == pytest.approx(expected, rel=1e-5) and expected > 1e-3 and not skipped


# ---- micro-batches cut where padding is least -------------------------------------------------------------

def test_the_next_steps_micro_batches_are_built_while_a_step_computes(args, monkeypatch):
    """Step k + 1's batch is built before step k's one reduction, which the host waits for, and the steps train on
    TrainBatches' batches in their order, as when each was built at its step."""
    events, built, trained = [], {}, []
    call, reduce, forward = data.TrainBatches.__call__, backends.SingleProcess.all_reduce_sum, GPT.forward

    def batch(batches, step):
        events.append(f"batch {step}")
        built[step] = call(batches, step)
        return built[step]

    def forward_of(model, x, targets=None):
        if model.training:
            trained.append(x)
        return forward(model, x, targets)
    monkeypatch.setattr(data.TrainBatches, "__call__", batch)
    monkeypatch.setattr(backends.SingleProcess, "all_reduce_sum", lambda proc, t: events.append("reduce") or
                        reduce(proc, t))
    monkeypatch.setattr(GPT, "forward", forward_of)
    train.main([*args, "--max_iters=3", "--eval_interval=3", "--micro_batch_size=2"])
    assert events[:6] == ["batch 0", "batch 1", "reduce", "batch 2", "reduce", "reduce"]
    expected = [x for step in range(3) for x, _ in built[step].micro_batches]
    assert len(trained) == len(expected) > 3 and all(torch.equal(a, b) for a, b in zip(trained, expected, strict=True))


def test_the_first_steps_loss_is_one_row_micro_batches_and_metrics_say_how_it_was_cut(args, tmp_path, capsys):
    """The cuts change how a global batch is split, never the step: its loss is divided by the global batch's
    targets, so micro_batch_size=8 (cut where padding is least) gives micro_batch_size=1's loss. The start line
    says the cut, not a count of accumulation steps the cut does not keep."""
    rows = {}
    for micro in (1, 8):
        out = tmp_path / f"micro{micro}"
        train.main([*args, "--max_iters=1", "--dtype=float32", f"--micro_batch_size={micro}", f"--out_dir={out}"])
        rows[micro] = metrics(out)[0]
        assert (f"8 sequences per step over 1 process(es), cut by length into micro-batches of at most the positions "
                f"of micro_batch_size={micro} of the longest rows; ") in capsys.readouterr().out
    assert rows[8]["loss"] == pytest.approx(rows[1]["loss"], abs=1e-5)
    assert 1 <= rows[8]["micro_batches"] < 8 and 0 <= rows[8]["padded_fraction"] < 0.2
    assert rows[1]["micro_batches"] <= 8  # rows short enough share a micro-batch within 1 x the longest row
