"""max_time's clock (summarizer/clock.py) through train.py, on a virtual clock where the first call of each kind of
work (the training step's forward and backward, an evaluation, a decoding) costs COLD times a warm call, as a compile
does: the learning rate cools down to min_lr exactly at the last step whatever the pace, evaluations and resumes do;
a run over two sessions cools down in the second only; the estimates before step 1 are the warm ones."""
import math
import re
import signal

import pandas as pd
import pytest

import conftest
import train
from bench import preflight
from config import load_config
from conftest import metrics, one_error_line, tiny
from model import GPT
from summarizer import backends, preparation
from summarizer.checkpoint import load_checkpoint
from summarizer.clock import (
    COOLDOWN,
    Clock,
    Rate,
    advance,
    cut_short,
    decayed,
    learning_rate,
    lr_schedule,
    resumed_schedule,
)

COLD = 20  # a first call's cost, in warm calls
MIN_LR, WARMUP, GEN_BATCH = 5e-4, 5, 4
SCHEDULE = {"warmup_iters": WARMUP, "learning_rate": 1e-3, "min_lr": MIN_LR, "lr_decay_iters": 0, "max_iters": 100000}


class VirtualClock:
    """train.py's time.monotonic and time.perf_counter, advanced by the work alone: a micro-batch's forward and
    backward costs `micro` seconds (times `slow` from step `slow_from` on, times pace(step); with `per_token`, times
    its padded tokens over per_token), an evaluation and its save `evaluation`, a summary `summary` (times
    summary_pace(seconds since the start)); the first call of each costs COLD times as much."""

    def __init__(self, micro=0.1, evaluation=0.5, summary=0.02, slow_from=None, slow=1.0, pace=None, per_token=None,
                 evaluation_pace=None, summary_pace=None):
        self.now, self.micro, self.evaluation, self.summary = 100.0, micro, evaluation, summary
        self.slow_from, self.slow, self.pace, self.per_token = slow_from, slow, pace, per_token
        self.evaluation_pace = evaluation_pace  # seconds since the start -> a factor on an evaluation's cost
        self.summary_pace = summary_pace  # likewise, on a summary's
        self.first = {"micro": True, "evaluation": True, "summary": True}
        self.step = 0  # the loop's step in progress (0-based)
        self.trained = None  # the time the last step ended

    def cost(self, kind, seconds, call=None):
        """`seconds` of work, whose first call (`call` seconds of it warm: a decoding's batch) costs COLD times."""
        cold, self.first[kind] = self.first[kind], False
        self.now += seconds + ((COLD - 1) * (seconds if call is None else call) if cold else 0)

    def monotonic(self):
        return self.now

    perf_counter = monotonic


@pytest.fixture
def virtual(monkeypatch):
    """virtual(**costs) -> a VirtualClock that train.py runs on from now on; stop_at=N stops the run with a SIGINT
    received in step N (0-based) as Ctrl-C would."""
    def install(stop_at=None, **costs):
        clock = VirtualClock(**costs)
        forward, step, validate = GPT.forward, train.Trainer.train_step, train.Trainer.validate
        summarize = train.inference.summarize_on_ranks

        def timed_forward(model, x, targets=None):  # a training micro-batch's forward (and its backward)
            if model.training:
                slow = clock.slow if clock.slow_from is not None and clock.step >= clock.slow_from else 1.0
                slow *= clock.pace(clock.step) if clock.pace else 1.0
                slow *= x.numel() / clock.per_token if clock.per_token else 1.0
                clock.cost("micro", clock.micro * slow)
            return forward(model, x, targets)

        def timed_step(trainer, it):
            clock.step = it
            if it == stop_at:
                trainer.signals.handle(signal.SIGINT, None)
            done = step(trainer, it)
            clock.trained = clock.now
            return done

        def timed_validate(trainer):
            pace = clock.evaluation_pace(clock.now - 100.0) if clock.evaluation_pace else 1.0
            clock.cost("evaluation", clock.evaluation * pace)
            return validate(trainer)

        def timed_summaries(model, prompts, *args, **kwargs):
            summary = clock.summary * (clock.summary_pace(clock.now - 100.0) if clock.summary_pace else 1.0)
            clock.cost("summary", summary * len(prompts), summary * min(len(prompts), GEN_BATCH))
            return summarize(model, prompts, *args, **kwargs)
        monkeypatch.setattr(train, "time", clock)
        monkeypatch.setattr(preparation, "time", clock)  # start-up: the budget's clock and its priming
        monkeypatch.setattr(GPT, "forward", timed_forward)
        monkeypatch.setattr(train.Trainer, "train_step", timed_step)
        monkeypatch.setattr(train.Trainer, "validate", timed_validate)
        monkeypatch.setattr(train.inference, "summarize_on_ranks", timed_summaries)
        # metrics.png (tests/test_tracking.py) costs no virtual time: undrawn, it saves a tenth of these runs' time
        monkeypatch.setattr(train, "plot_metrics", lambda *args: None)
        return clock
    return install


@pytest.fixture
def run(write_csv, tmp_path):
    csv, test = write_csv("train.csv", 60), write_csv("test.csv", 10, seed=1, test=True)
    # width 16: these runs train hundreds of real steps, whose seconds the virtual clock does not count
    return [*tiny(n_embd=16), f"--train_csv={csv}", f"--test_csv={test}", f"--data_cache_dir={tmp_path / 'cache'}",
            "--val_fraction=0.2", "--batch_size=4", "--micro_batch_size=4", "--max_iters=100000",
            f"--warmup_iters={WARMUP}", "--learning_rate=1e-3", f"--min_lr={MIN_LR}", "--log_interval=1",
            "--eval_val_batches=1", "--rouge_samples=4", f"--gen_batch_size={GEN_BATCH}",
            f"--out_dir={tmp_path / 'out'}"]


def assert_cools_down_at_the_end(rows):
    """The last step trains at min_lr, the LR reaches it within the last 5% of the steps, and at most 5% sit there."""
    lrs = [row["lr"] for row in rows]
    at_min = [i for i, lr in enumerate(lrs) if lr <= MIN_LR * (1 + 1e-9) and i >= WARMUP]
    assert at_min and at_min[-1] == len(lrs) - 1, lrs[-5:]
    assert at_min[0] >= 0.95 * len(lrs) and len(at_min) <= 0.05 * len(lrs), (len(lrs), at_min)
    peak = [lr for lr in lrs[WARMUP:] if lr >= 0.99e-3]  # the cooldown is the last 20%
    assert len(peak) >= 0.7 * len(lrs), lrs


def test_a_rate_keeps_the_first_samples_one_time_cost_apart():
    rate = Rate()
    assert rate.per_unit() is None and rate.slowest() is None
    rate.add(40.0, 20)  # 2 s a unit: the compile in it
    assert rate.per_unit() == 2.0 == rate.slowest()  # an upper bound until a warm sample
    for seconds in (0.1, 0.1, 5.0, 0.1):  # a lone spike does not move the median; the slowest is the spike
        rate.add(seconds * 20, 20)
    assert rate.per_unit() == pytest.approx(0.1) and rate.slowest() == pytest.approx(5.0)


def session(schedule, first, steps):
    """(the LRs, the schedule after them) of a last session of `steps` steps from step `first` (0-based) whose
    budget leaves them at a steady pace."""
    lrs, last = [], first + steps - 1
    for it in range(first, last + 1):
        lr, schedule = advance(schedule, it, steps_left=last - it, ended=it == last)
        lrs.append(lr)
    return lrs, schedule


def test_one_call_a_step_gives_its_learning_rate_and_the_schedule_after_it():
    """The LR a step trains at is what the schedule it leaves says of that step (the cooldown computed once, then
    kept); at a steady pace the cooldown is the last 20% of the steps, 1-sqrt, at min_lr at the last."""
    schedule, lrs = lr_schedule(SCHEDULE), []
    for it in range(200):
        lr, schedule = advance(schedule, it, steps_left=199 - it, ended=it == 199)
        assert lr == learning_rate(it, schedule)
        lrs.append(lr)
    shape = [MIN_LR + (1e-3 - MIN_LR) * (1 - math.sqrt(k / 40)) for k in range(1, 41)]
    assert cut_short(schedule, 200) is None
    assert lrs[160:] == pytest.approx(shape, rel=1e-5) and lrs[WARMUP:160] == pytest.approx([1e-3] * 155, rel=1e-3)


def test_a_cooldown_under_way_goes_on_when_the_estimate_is_unsettled_again():
    """The cooldown starts on a settled estimate; when the pace recovers and an evaluation could come before the
    end again (unsettled), it goes on with the steps left instead of stalling until a cliff at the last step (a real
    CPU run under a load that came and went stayed at 3.7e-3 for 10 steps, then dropped to min_lr in one)."""
    _, schedule = advance(lr_schedule(SCHEDULE), 160, steps_left=39)
    lrs = []
    for it in range(161, 200):
        lr, schedule = advance(schedule, it, steps_left=199 - it, settled=it == 199, ended=it == 199)
        lrs.append(lr)
    assert all(b < a for a, b in zip(lrs, lrs[1:], strict=False)) and lrs[-1] == MIN_LR
    assert lrs[-2] - lrs[-1] < lrs[0] - lrs[1]  # the shape's last step, not a cliff


@pytest.mark.slow
@pytest.mark.parametrize("case", ["steady", "slowdown", "no_evaluation_in_the_budget"])
def test_the_learning_rate_reaches_min_lr_at_the_last_step(run, virtual, capsys, case):
    """First calls 20x a warm call; the steps slow down 2.5x half-way; or eval_interval beyond the budget (the run's
    only evaluation is its last)."""
    virtual(**({"slow_from": 120, "slow": 2.5} if case == "slowdown" else {}))
    interval = 100000 if case == "no_evaluation_in_the_budget" else 25
    train.main([*run, f"--eval_interval={interval}", "--max_time=40"])
    rows = [row for row in metrics(run[-1].split("=", 1)[1]) if "loss" in row]
    assert 100 < len(rows) < 100000
    assert_cools_down_at_the_end(rows)
    assert f"max_time=40: stopped after iter {len(rows)} of 100000" in capsys.readouterr().out


def varied_csv(path, n):
    """Dialogues of two lengths, every other one five times as long: length-grouped steps alternate short and
    long."""
    rows = conftest.synthetic_rows(n, 0)
    for row in rows[::2]:
        row["dialogue"] = "\n".join([row["dialogue"]] * 5)
    return conftest.save_csv(path, rows)


PACES = {"steady": None, "slows_then_speeds_up": lambda step: 2.0 if 100 <= step < 220 else 0.4 if step >= 220 else 1.0,
         "speeds_up_in_the_cooldown": lambda step: 0.3 if step >= 300 else 1.0}


@pytest.mark.slow
@pytest.mark.parametrize("pace", PACES)
def test_the_cooldown_never_rises_and_the_estimate_holds_when_steps_alternate_short_and_long(run, virtual, capsys,
                                                                                           tmp_path, pace):
    """A step costs its tokens (short and long steps alternate in length-grouped batches); the pace is steady, or
    halves, then runs at 2.5x; or speeds up 3x once the cooldown is under way. The learning rate never rises after
    the warmup, reaches min_lr at the last step, and the run stops inside its budget; on a steady pace the start
    line's estimate is within 1.5x of the steps that ran (450 for 360 here) and the cooldown spans the last tenth
    of the steps or more."""
    clock = virtual(per_token=4 * 64, pace=PACES[pace])
    train.main([*run, f"--train_csv={varied_csv(tmp_path / 'varied.csv', 60)}", "--eval_interval=25", "--max_time=80"])
    printed = capsys.readouterr().out
    rows = [row for row in metrics(run[-1].split("=", 1)[1]) if "loss" in row]
    lrs = [row["lr"] for row in rows]
    assert all(b <= a for a, b in zip(lrs[WARMUP:-1], lrs[WARMUP + 1:], strict=True)), lrs[WARMUP:]
    cooling = next(i for i, lr in enumerate(lrs) if i >= WARMUP and lr < 0.99e-3)  # the cooldown, not the cosine
    assert lrs[-1] == MIN_LR and lrs[-2] > MIN_LR, lrs[-5:]
    assert f"max_time=80: stopped after iter {len(rows)} of 100000 with " in printed, printed[-2000:]
    assert clock.now - 100.0 <= 80
    estimate = int(re.search(r"buy about (\d+) steps", printed)[1])
    if pace == "steady":
        assert len(rows) / 1.5 <= estimate <= 1.5 * len(rows), (estimate, len(rows))
        assert len(rows) - cooling >= 0.1 * len(rows), (cooling, len(rows))  # a cooldown, not a drop


# a steady run of `run` with --eval_interval=25 --max_time=40 trains 214 steps and cools down from step 171 (0-based)
SLOWDOWNS = {"at_the_cooldowns_start": lambda step: 4.0 if 171 <= step < 176 else 1.0,
             "late": lambda step: 4.0 if step >= 165 else 1.0}


@pytest.mark.slow
@pytest.mark.parametrize("slowdown", SLOWDOWNS)
def test_a_slower_pace_keeps_the_cooldowns_shape_and_a_cooldown_cut_short_says_so(run, virtual, capsys, slowdown):
    """Five steps 4x slower where the cooldown starts (the clock's estimate of the steps left falls 4x for a few
    steps), or every step 4x slower from shortly before it to the end: the LR never rises, no step drops it by more
    than 1.5x the shape's own steepest step (its first), and it reaches min_lr at the last step; the late
    slow-down cuts the cooldown short, which the run says in one line."""
    virtual(pace=SLOWDOWNS[slowdown])
    train.main([*run, "--eval_interval=25", "--max_time=40"])
    printed = capsys.readouterr().out
    lrs = [row["lr"] for row in metrics(run[-1].split("=", 1)[1]) if "loss" in row]
    assert all(b <= a for a, b in zip(lrs[WARMUP:-1], lrs[WARMUP + 1:], strict=True)), lrs[WARMUP:]
    assert lrs[-1] == MIN_LR and lrs[-2] > MIN_LR
    steepest = (1e-3 - MIN_LR) * math.sqrt(1 / (COOLDOWN * len(lrs)))
    drops = [a - b for a, b in zip(lrs[WARMUP:-1], lrs[WARMUP + 1:], strict=True)]
    cut = [line for line in printed.splitlines() if "cooldown was cut short" in line]
    if slowdown == "late":
        assert max(drops[:-1]) <= 1.5 * steepest, (steepest, drops[-40:])
        ran = len(lrs) - next(i for i, lr in enumerate(lrs) if i >= WARMUP and lr < 0.99e-3)
        assert cut == [f"note: the learning rate's cooldown was cut short: its last step dropped it from "
                       f"{lrs[-2]:.2e} to min_lr {MIN_LR:.2e} after {ran} of the about {COOLDOWN * len(lrs):.0f} "
                       f"steps it plans (the last 20% of the {len(lrs)} steps of its decay): the steps the budget "
                       f"leaves fell faster than it could follow (a slower pace or evaluation near the end)"], \
            printed[-2000:]
    else:
        assert max(drops) <= 1.5 * steepest and not cut, (steepest, drops[-60:])


def test_a_peak_given_to_a_resumed_run_is_the_peak_it_trains_at():
    """A first session of 1000 steps ends at its budget, at min_lr; a second of 60, given --learning_rate=1.5e-3,
    trains at that peak from its first step and cools down over the last 20% of its own steps (not of the whole
    run's); once that decay has ended, the same flag again (now the saved learning_rate) decays from that peak
    again, and a resume without it stays at min_lr."""
    saved = {"learning_rate": 1e-3, "min_lr": MIN_LR, "lr_decay_iters": 0}
    peak = load_config(["--learning_rate=1.5e-3", f"--min_lr={MIN_LR}", "--max_iters=100000",
                        f"--warmup_iters={WARMUP}"])
    first, schedule = session(lr_schedule(SCHEDULE), 0, 1000)
    assert first[-1] == MIN_LR and decayed(1000, schedule)
    second, schedule = session(resumed_schedule(schedule, saved, peak, 1000, {"learning_rate": 1.5e-3}), 1000, 60)
    assert second[0] == pytest.approx(1.5e-3) and second[-1] == MIN_LR
    assert sum(lr > 1.49e-3 for lr in second) == 48, second
    saved["learning_rate"] = 1.5e-3
    assert resumed_schedule(schedule, saved, peak, 1060, {}) == schedule and decayed(1060, schedule)
    third, _ = session(resumed_schedule(schedule, saved, peak, 1060, {"learning_rate": 1.5e-3}), 1060, 60)
    assert third[0] == pytest.approx(1.5e-3) and third[-1] == MIN_LR


@pytest.mark.slow
def test_a_resumed_run_cools_down_at_the_end_of_its_budget_and_a_finished_one_stays_at_min_lr(run, virtual,
                                                                                             tmp_path, capsys):
    virtual(stop_at=60)
    with pytest.raises(SystemExit):  # Ctrl-C in step 61: ckpt.pt holds iter 61
        train.main([*run, "--eval_interval=25", "--max_time=40"])
    virtual()
    train.main([*run, "--eval_interval=25", "--max_time=40", "--init_from=resume"])
    rows = [row for row in metrics(tmp_path / "out") if "loss" in row]
    assert [row["iter"] for row in rows] == list(range(1, len(rows) + 1))
    assert_cools_down_at_the_end(rows)
    schedule = load_checkpoint(str(tmp_path / "out" / "ckpt.pt"))["schedule"]
    assert schedule["floor"] == MIN_LR and schedule["sessions_done"] == 1
    capsys.readouterr()
    # continued as its continue command says: without --learning_rate, which would decay from that peak again
    continued = [arg for arg in run if not arg.startswith("--learning_rate=")]
    train.main([*continued, "--eval_interval=25", f"--max_iters={len(rows) + 3}", "--init_from=resume"])
    hint = re.search(f"stays at min_lr {MIN_LR:.2e} until iter {len(rows) + 3}: the run's decay has ended; "
                     r"--learning_rate=<a peak, e.g. (\S+)> decays from that peak again", capsys.readouterr().out)
    assert hint
    again = [row for row in metrics(tmp_path / "out") if row["iter"] > len(rows)]
    assert [row["lr"] for row in again] == [learning_rate(row["iter"] - 1, schedule) for row in again] == [MIN_LR] * 3
    # the hint, followed literally (its example is not the run's learning_rate, which would change nothing)
    train.main([*run, "--eval_interval=25", f"--max_iters={len(rows) + 6}", "--init_from=resume",
                f"--learning_rate={hint[1]}"])
    decayed = [row["lr"] for row in metrics(tmp_path / "out") if row["iter"] > len(rows) + 3]
    assert decayed[0] == pytest.approx(float(hint[1])) and decayed == sorted(decayed, reverse=True), decayed


def test_a_run_that_ended_at_min_lr_is_told_so_by_its_budget_line():
    """A resumed run whose last session ended at its budget stays at min_lr: its budget line says so instead of
    promising a cooldown to it."""
    schedule = lr_schedule({"warmup_iters": WARMUP, "learning_rate": 1e-3, "min_lr": MIN_LR, "lr_decay_iters": 0,
                            "max_iters": 100000})
    assert not decayed(300, schedule)
    _, ended = advance(schedule, 299, steps_left=0, ended=True)
    assert decayed(300, ended) and learning_rate(300, ended) == MIN_LR
    clock = Clock(60, started=0.0, now=lambda: 10.0)
    clock.prime(1e-3, tokens=1)
    line = clock.budget_line(300, 100000, decayed(300, ended), 2, 1)
    assert line.endswith("not the 99700 to max_iters=100000: the learning rate stays at min_lr"), line


@pytest.mark.slow
def test_a_run_over_two_sessions_cools_down_in_the_second_only(run, virtual, tmp_path):
    """docs/kaggle.md's recipe, a virtual minute a session: session 1 trains at the schedule's LR to its budget;
    session 2, from a copy of its ckpt.pt in another folder, trains above min_lr for most of its steps and ends at
    min_lr."""
    first, second = tmp_path / "session1", tmp_path / "session2"
    virtual()
    train.main([*run, "--eval_interval=50", "--max_time=60", "--sessions=2", f"--out_dir={first}"])
    one = [row for row in metrics(first) if "loss" in row]
    assert all(row["lr"] == pytest.approx(1e-3, rel=1e-2) for row in one[WARMUP:])  # the peak to the end
    virtual()
    train.main([*run, "--eval_interval=50", "--max_time=60", f"--out_dir={second}",
                f"--resume_from={first / 'ckpt.pt'}"])
    carried, two = metrics(second)[:len(metrics(first))], [row for row in metrics(second)[len(metrics(first)):]
                                                           if "loss" in row]
    assert carried == metrics(first) and len(two) > 100 and two[0]["iter"] == one[-1]["iter"] + 1
    assert sum(row["lr"] > MIN_LR for row in two) > 0.75 * len(two) and two[-1]["lr"] == MIN_LR
    assert_cools_down_at_the_end(one + two)


def test_the_estimates_before_step_1_are_the_warm_ones(run, virtual, capsys):
    """The decoding's first call (20x a warm batch) is a one-time cost, counted once: the start line gives the warm
    rate a summary; a budget that the last evaluation and the after-run (on the graphs training compiled) would
    spend is refused with a figure within 2x of what they then take."""
    after = [*run, "--eval_interval=1000", "--evaluate_after=True", "--predict_after=True"]
    virtual(summary=0.5)
    err = one_error_line(capsys, train.main, [*after, "--max_time=55"])  # 46 s of start-up, priming included
    need = re.search(r"need about (\d+) s", err)
    assert need, err
    need = float(need.group(1))
    clock = virtual(summary=0.5)
    train.main([*after, "--max_time=1000", "--max_iters=1"])
    took = clock.now - clock.trained  # the last evaluation and the after-run
    assert took / 2 <= need <= 2 * took, (need, took)
    printed = capsys.readouterr().out
    assert "500 ms a summary warm (the slowest of the last few);" in printed and "compile the decoding" not in printed


@pytest.mark.slow
def test_a_run_pushed_past_its_budget_by_a_pace_change_says_by_how_much_and_why(run, virtual, capsys):
    """The last evaluation takes 20x what every earlier one took (another job took the machine): the run ends
    past its budget, and its last line says by how much, what the last step, evaluation and save took and what
    was measured."""
    clock = virtual(evaluation_pace=lambda seconds: 20.0 if seconds > 36 else 1.0)
    train.main([*run, "--eval_interval=25", "--max_time=40"])
    printed = capsys.readouterr().out
    past = re.search(r"max_time=40: stopped after iter \d+ of 100000 ([\d.]+) s past the budget: the last step, "
                     r"evaluation and save took ([\d.]+) s where ([\d.]+) s were measured \(the pace changed", printed)
    assert past, printed[-1500:]
    assert float(past[1]) == pytest.approx(clock.now - 100.0 - 40, abs=0.1) and float(past[2]) > 5 * float(past[3])


@pytest.mark.slow
def test_an_after_run_past_the_budget_says_by_how_much_and_what_took_longer(run, virtual, capsys, monkeypatch):
    """predict_after (first: the submission) takes 40 s more than the clock measured (another job took the machine):
    the run's last line says how far past the budget it ended, what predict_after took and what was left for it;
    evaluate_after, with no time left, is not started."""
    clock, predict = virtual(), train.predict

    def slow_predict(*args):
        clock.now += 40.0
        return predict(*args)
    monkeypatch.setattr(train, "predict", slow_predict)
    train.main([*run, "--eval_interval=25", "--max_time=40", "--evaluate_after=True", "--predict_after=True"])
    printed = capsys.readouterr().out
    last = printed.strip().splitlines()[-1]
    past = re.fullmatch(r"max_time=40: the run ended ([\d.]+) s past the budget: predict_after took ([\d.]+) s, where "
                        r"([\d.]+) s were left for them \(([\d.]+) s measured for the 10 summaries of predict_after, "
                        r"loading best.pt and writing\)", last)
    assert past, last
    assert float(past[1]) == pytest.approx(clock.now - 100.0 - 40, abs=0.1)
    assert float(past[2]) > 40 > float(past[3]) and float(past[4]) <= float(past[3])
    assert "max_time=40: evaluate_after is not started" in printed


@pytest.mark.slow
def test_the_progress_bar_shows_the_budget_as_the_clock_re_measures_it(run, virtual, capsys):
    """Start-up timed on a busy moment (the timing before step 1 and the first 20 steps run 4x slower): the start
    line's estimate is under half the steps that run, and the bar's figures (time left, the steps that still fit)
    show the re-measured budget long before the end, and ~0 steps at the end."""
    virtual(pace=lambda step: 4.0 if step < 20 else 1.0)
    train.main([*run, "--eval_interval=25", "--max_time=80"])
    out, err = capsys.readouterr()
    steps = len([row for row in metrics(run[-1].split("=", 1)[1]) if "loss" in row])
    estimate = int(re.search(r"buy about (\d+) steps", out)[1])
    shown = [(int(done), int(fit)) for done, fit in re.findall(r"(\d+)/100000 [^\]]*left=\d[^,\]]* ~(\d+) it", err)]
    assert estimate < steps / 2 and shown[-1] == (steps, 0), (estimate, steps, shown[-5:])
    assert any(done + fit >= 0.9 * steps for done, fit in shown if done < steps / 2), shown


def test_a_budget_that_start_up_spends_ends_the_run_between_its_phases_in_one_line(run, virtual, monkeypatch, capsys,
                                                                                      tmp_path):
    """Building the model takes a minute (a big preset on a CPU): a 2 s budget ends the run as the next phase begins,
    in one line naming what spent it and a budget; nothing is left in out_dir. No timer raises from a signal handler
    at any bytecode (before: SIGALRM, around every phase, an earlier run's file moves included)."""
    clock, build = virtual(), preparation.model_to_train

    def a_minute(*args):
        clock.now += 60
        return build(*args)
    monkeypatch.setattr(preparation, "model_to_train", a_minute)
    monkeypatch.setattr(signal, "setitimer", lambda *args: pytest.fail("an interval timer was set"))
    capsys.readouterr()
    with pytest.raises(SystemExit):
        train.main([*run, "--max_time=2"])
    out, err = capsys.readouterr()
    assert out.rstrip().endswith("start-up: building the model ...")  # no phase after it began
    lines = [line for line in err.split("\n")[:-1] if "\r" not in line]  # as one_error_line: one line, no traceback
    assert len(lines) == 1 and lines[0].startswith("error: "), err
    assert re.search(r"max_time=2 is used up before the first step: start-up took 60 s so far \(the last: building "
                     r"the model\).* e\.g\. --max_time=600", lines[0]), lines[0]
    assert not (tmp_path / "out").exists() or not any((tmp_path / "out").iterdir())


@pytest.mark.slow
def test_a_minute_with_a_compiled_decoding_trains_and_writes_the_submission(run, virtual, tmp_path):
    """A budget of 60 s for training, evaluate_after and predict_after where the decoding's first batch pays a compile
    (20x a warm batch, 8 s): the estimate before step 1 counts it once, not for the pace of every summary, so the run
    trains, ends within its budget and writes the submission (refused before, on a CPU's real compile)."""
    clock = virtual(summary=0.1)
    train.main([*run, "--eval_interval=25", "--max_time=60", "--evaluate_after=True", "--predict_after=True"])
    assert metrics(tmp_path / "out")[-1]["iter"] >= 10 and clock.now - 100.0 <= 60
    assert len(pd.read_csv(tmp_path / "out" / "submission.csv")) == 10


@pytest.mark.slow
def test_an_after_run_that_a_slower_pace_would_push_past_the_budget_is_not_started_and_says_how_to_run_it(
        run, virtual, capsys):
    """Summaries 30x slower from the run's last seconds on (another job took the machine): the last evaluation
    measures it, and what evaluate_after and predict_after would take no longer fits: neither starts, each says so
    in a line with the command that does it later, and the run ends inside its budget (it ran 8 s past it before)."""
    clock = virtual(summary_pace=lambda seconds: 30.0 if seconds > 52 else 1.0)
    train.main([*run, "--eval_interval=25", "--max_time=60", "--evaluate_after=True", "--predict_after=True"])
    printed = capsys.readouterr().out
    assert clock.now - 100.0 <= 60, printed[-1500:]
    best = run[-1].split("=", 1)[1] + "/best.pt"
    for key, script, summaries in (("evaluate_after", "evaluate.py", 12), ("predict_after", "predict.py", 10)):
        said = re.search(rf"max_time=60: {key} is not started: the {summaries} summaries of {key} need about \d+ s "
                         rf"\(.*\) where \d+ s are left; run it later with:\n  python {script} (.*)\n", printed)
        assert said and said[1].endswith(f" --ckpt={best}") and run[-1] in said[1], printed[-3000:]
    assert "wrote 10 summaries" not in printed and "past the budget" not in printed


def test_a_budget_refusal_names_only_the_after_runs_that_are_on():
    """No after-run: neither is named nor advised off; evaluate_after alone: it alone."""
    lines = {}
    for after in ({}, {"evaluate_after": 82}, {"evaluate_after": 82, "predict_after": 819}):
        clock = Clock(60, started=0.0, now=lambda: 55.0, rouge_summaries=4, after=after)
        clock.prime(1.0, tokens=1, decodings=[(32.0, 4), (8.0, 4), (8.0, 4)])  # 2 s a summary warm
        lines[len(after)] = clock.start_up_problem()
    # 2 x (55 s of start-up + a step of 1 s and the last evaluation's 4 summaries, 8 s), in tens of seconds
    assert "summaries" not in lines[0] and "_after" not in lines[0] and lines[0].endswith(
        "no training would fit (a thin margin: a quieter moment may fit); give --max_time above 130"), lines[0]
    assert "the 82 summaries of evaluate_after need" in lines[1] and "predict" not in lines[1], lines[1]
    assert lines[1].endswith("or summarize later (--evaluate_after=False, then evaluate.py)"), lines[1]
    assert "the 901 summaries of evaluate_after and predict_after need" in lines[2] and lines[2].endswith(
        "or summarize later (--evaluate_after=False --predict_after=False, then evaluate.py and predict.py)")


def test_an_after_run_starts_where_the_time_left_holds_half_of_what_the_slowest_rate_asks():
    """A new user's run (240 s, busy CPU): training stopped with 164 s left for predict_after, whose 819 summaries
    the slowest recent rate (340 ms) put at 280 s; it was not started, and then took 88.6 s by hand."""
    for left, started in ((164.0, True), (139.0, False)):
        clock = Clock(240, started=0.0, now=lambda left=left: 240 - left, after={"predict_after": 819})
        clock.prime(1.0, tokens=1, decodings=[(10.0, 1), (0.2, 1), (0.34, 1), (0.2, 1)])
        assert clock.after_run() == pytest.approx(819 * 0.34)
        assert (clock.after_run_problem("predict_after", "python predict.py") is None) == started, left


def test_within_a_factor_safe_of_the_need_either_verdict_says_its_margin_is_thin():
    """A new user's preflight and train.py, seconds apart on a busy CPU, timed a step at 2,542 and 980 ms and gave
    opposite verdicts for one budget, neither saying it was close. Start-up 20 s here, the step's need varied."""

    def clock(budget, step):
        timed = Clock(budget, started=0.0, now=lambda: 20.0)
        timed.prime(step, tokens=1)
        return timed
    assert clock(35, 10).start_up_problem() is None and "is thin" in clock(35, 10).thin_margin()  # 35 < 2 x 30
    assert clock(60, 10).thin_margin() is None  # the suggested budget: a plain go
    assert "no training would fit (a thin margin: a quieter moment may fit); give --max_time above 90" in \
        clock(35, 25).start_up_problem()  # 45 s needed: within 2 x 35
    assert "thin" not in clock(35, 60).start_up_problem()  # 80 s needed: beyond 2 x 35


def test_one_quiet_batch_does_not_size_the_after_run():
    """Three warm batches timed before step 1, one of them 8x faster (a quiet moment on a busy machine): the
    after-run is sized by the slowest, not by that one."""
    clock = Clock(600, started=0.0, now=lambda: 10.0, after={"predict_after": 800})
    clock.prime(1.0, tokens=1, decodings=[(40.0, 16), (0.5, 16), (4.0, 16), (4.0, 16)])
    assert clock.after_run() == pytest.approx(800 * 0.25)


def test_a_compiling_runs_preflight_counts_its_compile_as_train_py_does(run, virtual, capsys, monkeypatch, tmp_path):
    """A compile is most of a compiling run's start-up (76 s, cold, on an H200): on a virtual clock where the compiled
    step's first call costs 200 s, a budget of 100 s is train.py's refusal and the preflight's no-go in its line (an
    eager preflight timed a step of a tenth of a second and said go)."""
    argv = [*run, "--compile=True", "--max_time=100"]
    compiled = set()

    def install():
        clock = virtual()

        def forward(module, *args):  # the compile's cost, once a module; then the step, eagerly
            if id(module) not in compiled:
                compiled.add(id(module))
                clock.now += 200.0
            return module.compiled._orig_mod(*args)
        monkeypatch.setattr(backends.CompiledModule, "forward", forward)
        return clock
    monkeypatch.setattr(preflight, "time", install())
    capsys.readouterr()
    preflight.main([*argv, f"--report={tmp_path / 'report.json'}"])
    verdict = capsys.readouterr().out.splitlines()[-2]
    install()
    assert verdict == "no-go: train.py: " + one_error_line(capsys, train.main, argv)[7:]
    assert "max_time=100 is used up before the first step: start-up took 202 s" in verdict


@pytest.mark.slow
def test_the_preflight_advises_the_budget_train_py_advises_and_accepts(run, virtual, capsys, monkeypatch, tmp_path):
    """On the same virtual costs (the preflight counts from its own start, as train.py does): a budget train.py
    refuses is the preflight's no-go in train.py's line; one just above what start-up and a step need is a go that
    says its margin is thin and suggests train.py's budget; that budget train.py trains in, and the preflight's go
    is plain."""
    argv = [*run, "--eval_interval=1000", "--evaluate_after=True", "--predict_after=True"]

    def preflight_line(budget):
        monkeypatch.setattr(preflight, "time", virtual(summary=0.5))
        capsys.readouterr()
        preflight.main([*argv, f"--max_time={budget}", f"--report={tmp_path / 'report.json'}"])
        return capsys.readouterr().out.splitlines()[-2]
    refused = preflight_line(50)
    virtual(summary=0.5)
    assert refused == "no-go: train.py: " + one_error_line(capsys, train.main, [*argv, "--max_time=50"])[7:]
    found = re.search(r"leaves (\d+) s after start-up, .* need about (\d+) s .* give --max_time above (\d+)", refused)
    assert found, refused
    left, need, suggested = map(int, found.groups())
    thin = preflight_line(50 - left + need + 3)
    assert thin.startswith("go: ") and thin.endswith(f"is thin: start-up took {50 - left} s, one step with what "
                                                     f"follows it needs {need} s; a busier moment may leave no "
                                                     f"step: give --max_time above {suggested}"), (thin, refused)
    assert preflight_line(suggested) == "go: every check that ran passed (gpus, collective not run)"
    virtual(summary=0.5)
    train.main([*argv, f"--max_time={suggested}", "--max_iters=2"])
    assert metrics(run[-1].split("=", 1)[1])[-1]["iter"] == 2
