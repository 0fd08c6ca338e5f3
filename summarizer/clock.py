"""max_time's clock and the learning rate it cools down: warm rates apart from one-time costs, the steps that still
fit, and the schedule whose cooldown reaches min_lr at the last of them. Tests replace `now` with a virtual clock."""
import bisect
import math
import statistics
import time
from collections import deque

from config import describe_duration

WINDOW = 5  # a rate is the median of this many recent warm samples: a slowdown shows within 3, a lone spike never
SAFE = 2  # the budget suggested over start-up and a step with the reserve: a busy machine may double either
# Before an evaluation was timed, its validation loss is guessed from the training pace (a forward costs about a
# third of a forward and backward) and its save from its bytes at a modest disk's speed.
FORWARD_SHARE, SAVE_BYTES_PER_S = 1 / 3, 200e6
COOLDOWN = 0.2  # the last share of a budget-bound run's steps that decays to min_lr (Hägele et al. 2024)
STEEPEST = 2  # how many of the cooldown shape's steps one step may go at most, when the pace slows


class Rate:
    """Seconds per unit: the median of the last WINDOW warm samples; the first pays one-time costs (a compile)."""

    def __init__(self):
        self.first, self.warm = None, deque(maxlen=WINDOW)  # first: (seconds, units)

    def add(self, seconds, units=1):
        if units > 0 and self.first is None:
            self.first = (seconds, units)
        elif units > 0:
            self.warm.append(seconds / units)

    def per_unit(self):
        if self.warm:
            return statistics.median(self.warm)
        return self.first[0] / self.first[1] if self.first else None

    def slowest(self):
        return max(self.warm) if self.warm else self.per_unit()

    def spread(self):  # how far the slowest recent sample lies above the rate, as a share of it
        return min(1.0, max(self.warm) / self.per_unit() - 1) if len(self.warm) > 1 else 0.0


def used_up(budget, took, doing):
    return (f"max_time={budget:g} is used up before the first step: start-up took {took:.0f} s {doing}: give a "
            f"budget well above that, e.g. --max_time={max(60, round(10 * took, -1)):g}")


class Clock:
    """max_time's seconds for this process, from `started`. The pace is per token (steps differ in length);
    steps_left decides both the stop and the cooldown, so the LR reaches min_lr at the last step whatever the pace."""

    def __init__(self, budget, started=None, now=time.monotonic, eval_interval=1, rouge_summaries=0, after=None,
                 step_tokens=1, validation_tokens=0, save_bytes=0):
        self.budget, self.now, self.started = budget, now, now() if started is None else started
        self.eval_interval, self.step_tokens, self.longest = eval_interval, step_tokens, step_tokens
        self.validation_tokens, self.save_bytes = validation_tokens, save_bytes  # an untimed evaluation's guess
        self.rouge_summaries = rouge_summaries  # summarized at every evaluation
        self.after = after or {}  # {'evaluate_after' and/or 'predict_after': the dialogues it summarizes}
        self.steps, self.evaluations, self.summaries = Rate(), Rate(), Rate()
        self.primed = None  # seconds a token, timed warm before step 1, until a step is measured
        self.decoding = 0.0  # seconds of summaries decoded in the evaluation in progress
        self.last_call = None  # (when steps_left last answered 0, the seconds it expected the rest to take)

    def prime(self, step_seconds, tokens, decodings=()):
        # before step 1: a warm step's seconds; `decodings`: (seconds, summaries) of batches, the first cold
        self.primed = step_seconds / tokens
        for seconds, summaries in decodings:
            self.summaries.add(seconds, summaries)

    def stepped(self, seconds, tokens):  # every rank's tokens, padding aside
        self.steps.add(seconds, tokens)
        self.longest = max(self.longest, tokens)

    def summarized(self, seconds, summaries):
        self.summaries.add(seconds, summaries)
        self.decoding += seconds

    def evaluated(self, seconds):  # its summaries, which summarized() timed, included
        self.evaluations.add(seconds - self.decoding)
        self.decoding = 0.0

    def spent(self):
        return self.now() - self.started

    def left(self):
        return self.budget - self.spent()

    def step(self, tokens=None):
        per_token = self.steps.per_unit() if self.steps.first else self.primed
        return None if per_token is None else per_token * (tokens or self.step_tokens)

    def evaluation(self):
        rest = self.evaluations.per_unit()
        if rest is None:
            rest = FORWARD_SHARE * (self.step(1) or 0.0) * self.validation_tokens + self.save_bytes / SAVE_BYTES_PER_S
        return rest + self.rouge_summaries * (self.summaries.per_unit() or 0.0)

    def after_run(self, keys=None):
        """After-runs `keys` (else all) at the slowest recent rate: a quiet moment must not start what cannot end."""
        rest = self.evaluations.per_unit() or 0.0
        return sum(self.after[key] * (self.summaries.slowest() or 0.0) + rest for key in keys or self.after)

    def after_words(self, keys=None):
        keys = list(keys or self.after)
        return f"the {sum(self.after[key] for key in keys)} summaries of {' and '.join(keys)}"

    def after_run_problem(self, key, later):
        """The line of after-run `key` not started (`later` runs it), or None. Only where the time left holds not
        even half its need: the slowest rate is a busy moment's, and a run must not end without its submission."""
        if (need := self.after_run([key])) <= 2 * self.left():
            return None
        return (f"max_time={self.budget:g}: {key} is not started: {self.after_words([key])} need about {need:.0f} s "
                f"({self.describe()}) where {max(0.0, self.left()):.0f} s are left; run it later with:\n  {later}")

    def margin(self):
        """Room for the last step being the longest seen, and for it and the last evaluation to run slow."""
        longest = self.step(self.longest) or 0.0
        return (longest - (self.step() or 0.0) + self.steps.spread() * longest
                + self.evaluations.spread() * self.evaluation())

    def reserve(self):  # what the budget keeps after the last step
        return self.evaluation() + self.after_run() + self.margin()

    def steps_left(self, it, tokens=None):
        if self.step() is None:
            return None
        step, evaluation = self.step(), self.evaluation()
        room = self.left() - self.step(tokens) - self.reserve()

        def over(n):  # n more steps, and the evaluations due after this one and them but the last (in the reserve)
            return n * step + ((it + n) // self.eval_interval - it // self.eval_interval) * evaluation > room
        fit = max(0, bisect.bisect_left(range(2**40), True, key=over) - 1)  # a step timed at 0 s fits without end
        if fit == 0:
            self.last_call = (self.now(), self.step(tokens) + evaluation + self.after_run())
        return fit

    def settled(self, it, tokens=None):
        """Whether steps_left is an estimate to start a cooldown on, which cannot be undone: it rests on warm rates
        alone, or no evaluation comes before the end to measure one better."""
        if self.evaluations.warm or self.step() is None:
            return True
        steps_alone = (self.left() - self.step(tokens) - self.after_run() - self.margin()) / self.step()
        return self.eval_interval - it % self.eval_interval > steps_alone

    def ending(self):
        if (left := self.left()) > 0:
            return f"with {left:.0f} s left for what follows"
        if not self.last_call:
            return f"{-left:.1f} s past the budget"
        when, expected = self.last_call
        return (f"{-left:.1f} s past the budget: the last step, evaluation and save took {self.now() - when:.1f} s "
                f"where {expected:.1f} s were measured (the pace changed by more than the margin its spread asked for)")

    def after_run_ending(self, took):
        left_then = self.left() + sum(took.values())
        spent = " and ".join(f"{name} took {seconds:.1f} s" for name, seconds in took.items())
        return (f"max_time={self.budget:g}: the run ended {-self.left():.1f} s past the budget: {spent}, where "
                f"{max(0.0, left_then):.1f} s were left for them ({self.after_run(took):.1f} s measured for "
                f"{self.after_words(took)}, loading best.pt and writing)")

    def start_up_problem(self):
        if self.left() <= 0:
            return used_up(self.budget, self.spent(), "(imports, reading the data, building the model, timing a step)")
        if (need := self.suggested())[0] < self.left():
            return None
        thin = " (a thin margin: a quieter moment may fit)" if self.spent() + need[0] <= SAFE * self.budget else ""
        line = (f"max_time={self.budget:g} leaves {self.left():.0f} s after start-up, and one step with the last "
                f"evaluation, its save{f' and {self.after_words()}' if self.after else ''} need about {need[0]:.0f} s "
                f"({self.describe()}): no training would fit{thin}; give --max_time above {need[1]:g}")
        return line + (f", or summarize later ({' '.join(f'--{key}=False' for key in self.after)}, then "
                       f"{' and '.join(key.split('_')[0] + '.py' for key in self.after)})" if self.after else "")

    def suggested(self):
        # (one step with the reserve, the budget suggested: SAFE times start-up and it, in tens of seconds)
        need = self.reserve() + (self.step() or 0.0)
        return need, 10 * math.ceil(SAFE * (self.spent() + need) / 10)

    def thin_margin(self):
        if self.budget >= (need := self.suggested())[1]:
            return None
        return (f"the margin of max_time={self.budget:g} is thin: start-up took {self.spent():.0f} s, one step with "
                f"what follows it needs {need[0]:.0f} s; a busier moment may leave no step: give --max_time above "
                f"{need[1]:g}")

    def describe(self):
        step = self.step()
        parts = [] if step is None else [f"{1000 * step:.0f} ms a step of {self.step_tokens:.0f} tokens"]
        if self.summaries.first:
            parts.append(f"{1000 * self.summaries.slowest():.0f} ms a summary warm (the slowest of the last few)")
        if self.evaluations.first:
            parts.append(f"{self.evaluation():.1f} s an evaluation with its save")
        return ", ".join(parts) or "nothing measured yet"

    def budget_line(self, step, max_iters, at_min_lr, session, sessions):
        fit = 1 + self.steps_left(step)
        line = (f"max_time={self.budget:g} ({describe_duration(self.budget)}): {self.left():.0f} s left after "
                f"start-up buy about {fit} steps ({self.describe()}; re-measured every step)")
        if self.after:
            line += f", keeping {self.after_run():.0f} s for {self.after_words()}"
        if step + fit >= max_iters:
            return line + f": room for the {max_iters - step} steps to max_iters={max_iters}"
        line += f", not the {max_iters - step} to max_iters={max_iters}"
        if at_min_lr:
            return line + ": the learning rate stays at min_lr"
        if session < sessions:
            return (line + f"; session {session} of sessions={sessions}: the learning rate follows the schedule to "
                    f"the budget's end, and cools down in the last session")
        few = "; warning: few steps for a run" if fit < 10 else ""
        return (line + f": the learning rate cools down over the last {COOLDOWN:.0%} of them to min_lr at the last "
                f"(iter {step + fit} at this pace), by the clock{few}")


def lr_schedule(c):  # c: a run's config, as a dict
    return {"start": 0, "warmup_iters": c["warmup_iters"], "peak_lr": c["learning_rate"], "min_lr": c["min_lr"],
            "decay_iters": c["lr_decay_iters"] or c["max_iters"]}


def learning_rate(it, schedule):
    """The LR of step `it`, cooled down by 1-sqrt (Hägele et al. 2024) as far as the cooldown came."""
    lr = min(stepped_rate(it, schedule), schedule.get("floor", math.inf))
    if lr <= schedule["min_lr"]:
        return lr
    return schedule["min_lr"] + (lr - schedule["min_lr"]) * (1 - math.sqrt(schedule.get("cooldown", 0.0)))


def advance(schedule, it, steps_left=None, settled=True, ended=False, last_session=True):
    """(the LR of step `it`, the schedule after it). `steps_left`: what max_time leaves after it in the last
    session, else None; a cooldown starts on a `settled` estimate; a session `ended` at its budget is counted."""
    cooling = steps_left is not None and last_session and (settled or "cooldown" in schedule)
    if cooling and not decayed(it, schedule):  # at min_lr, nothing cools down
        progress, done = cooldown_progress(it, schedule, steps_left), schedule.get("cooldown", 0.0)
        if steps_left == 0 and progress - done > STEEPEST / cooldown_length(it, schedule, 0):
            schedule = {**schedule, "cut_short": (it, learning_rate(it, schedule))}  # the LR it drops from
        if progress:
            schedule = {**schedule, "cooldown": progress, "cooldown_from": schedule.get("cooldown_from", it)}
    lr = learning_rate(it, schedule)
    if ended:
        schedule = {**schedule, "sessions_done": sessions_done(schedule) + 1,
                    **({"floor": schedule["min_lr"]} if last_session else {})}
    return lr, schedule


def decayed(it, schedule):
    return it >= schedule["warmup_iters"] and learning_rate(it, schedule) <= schedule["min_lr"]


def cooldown_length(it, schedule, steps_left):  # the last COOLDOWN of the decay's steps, from its (new) peak
    return COOLDOWN * (it + 1 - schedule["start"] + steps_left)


def cooldown_progress(it, schedule, steps_left):
    """0 to 1 (min_lr at the last step), never going back, a step at most STEEPEST times the shape's: a pace slow
    for a moment shortens it without a cliff; one slow to the end cuts it short (cut_short says so)."""
    if steps_left == 0:
        return 1.0
    done, length = schedule.get("cooldown", 0.0), cooldown_length(it, schedule, steps_left)
    due = done + (1 - done) / (steps_left + 1) if done else 1 - steps_left / length
    return max(done, min(due, done + STEEPEST / length))


def cut_short(schedule, steps):
    it, lr = schedule.get("cut_short", (None, None))
    if it != steps - 1:
        return None
    return (f"note: the learning rate's cooldown was cut short: its last step dropped it from {lr:.2e} to min_lr "
            f"{schedule['min_lr']:.2e} after {it + 1 - schedule['cooldown_from']} of the about "
            f"{cooldown_length(it, schedule, 0):.0f} steps it plans (the last {COOLDOWN:.0%} of the "
            f"{it + 1 - schedule['start']} steps of its decay): the steps the budget leaves fell faster than it could "
            f"follow (a slower pace or evaluation near the end)")


def stepped_rate(it, s):
    if it < s["warmup_iters"]:
        return s["peak_lr"] * (it - s["start"] + 1) / (s["warmup_iters"] - s["start"] + 1)
    if it >= s["decay_iters"]:
        return s["min_lr"]
    ratio = (it - s["warmup_iters"]) / max(1, s["decay_iters"] - s["warmup_iters"])
    return s["min_lr"] + 0.5 * (1.0 + math.cos(math.pi * ratio)) * (s["peak_lr"] - s["min_lr"])


def sessions_done(schedule):
    return schedule.get("sessions_done", 0)


def resumed_schedule(schedule, saved, cfg, it, given=()):
    """Unchanged settings continue the saved schedule (a larger max_iters does not stretch it); a changed min_lr or
    lr_decay_iters decays from the current LR, a changed (or, once decayed, given) learning_rate from its value."""
    changed = {k for k in ("learning_rate", "min_lr", "lr_decay_iters") if getattr(cfg, k) != saved[k]
               or (k == "learning_rate" and k in given and decayed(it, schedule))}
    warming_up = it < schedule["warmup_iters"]
    if not changed and not (warming_up and schedule["decay_iters"] <= schedule["warmup_iters"]):
        return schedule
    horizon = cfg.lr_decay_iters or cfg.max_iters
    kept = {"sessions_done": sessions_done(schedule)}  # a changed LR setting lifts the floor, not the sessions
    if warming_up:  # finish the warmup, then decay to the new horizon
        kept.update({k: v for k, v in schedule.items()
                     if k not in ("floor", "cooldown", "cooldown_from", "cut_short")})
        return {**kept, "peak_lr": cfg.learning_rate, "min_lr": cfg.min_lr, "decay_iters": horizon}
    start_lr = cfg.learning_rate if "learning_rate" in changed else learning_rate(it, schedule)
    return {"start": it, "warmup_iters": it, "peak_lr": start_lr, "min_lr": cfg.min_lr, "decay_iters": horizon, **kept}


def describe_schedule(schedule, it, max_iters, learning_rate_setting, by_clock=False):
    s, lr, last = schedule, learning_rate(it, schedule), learning_rate(max_iters - 1, schedule)
    decay_end = s["decay_iters"] + 1  # the first logged iter at min_lr
    if max_iters <= s["warmup_iters"]:
        plan = f"warmup: rises to {last:.2e} at iter {max_iters} (the warmup ends at iter {s['warmup_iters'] + 1})"
    elif decayed(it, s):
        plan = (f"stays at min_lr {s['min_lr']:.2e} until iter {max_iters}: the run's decay has ended; "
                f"--learning_rate=<a peak, e.g. {learning_rate_setting:.1e}> decays from that peak again (under "
                f"max_time, to min_lr at the budget's end; a run planned over several sessions says --sessions=N "
                f"from its first)")
    else:
        if s["decay_iters"] <= s["warmup_iters"]:
            plan = f"min_lr {s['min_lr']:.2e} from iter {s['warmup_iters'] + 1}"
        elif decay_end <= max_iters:
            plan = (f"cosine decay to min_lr {s['min_lr']:.2e} at iter {decay_end}, constant after it until iter "
                    f"{max_iters}")
        else:
            plan = f"cosine decay to {last:.2e} at iter {max_iters}"
            if f"{last:.2e}" != f"{s['min_lr']:.2e}":  # else it reads as two ends of one decay
                plan += f" (it would reach min_lr {s['min_lr']:.2e} at iter {decay_end})"
        if it < s["warmup_iters"]:
            plan = f"warmup: rises to {s['peak_lr']:.2e} at iter {s['warmup_iters'] + 1}, then {plan}"
        if by_clock:
            plan += "; or sooner, to min_lr at the last step max_time leaves (the max_time line says which)"
    return f"learning rate at iter {it + 1}: {lr:.2e}; {plan}"
