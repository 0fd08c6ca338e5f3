"""The run's clock under max_time: what each kind of work costs warm apart from its one-time costs, how many steps
still fit with the margin the pace's spread asks for, and so when training stops and how far the learning rate has
cooled down (summarizer/schedule.py). Time comes from `now`, which tests replace with a virtual clock."""
import contextlib
import math
import signal
import statistics
import threading
import time
from collections import deque

from command_line import UserError
from config import describe_duration
from summarizer.schedule import COOLDOWN

WINDOW = 5  # a rate is the median of this many recent warm samples: a slowdown shows within 3, a lone spike never
# the budget suggested: SAFE times start-up and a step with the reserve (a busy machine may double either); below
SAFE, THIN = 2, 1.5  # THIN times them, a preflight's go says its margin is thin
# Before an evaluation was timed, its validation loss is guessed from the training pace (a forward costs about a
# third of a forward and backward) and its save from its bytes at a modest disk's speed.
FORWARD_SHARE, SAVE_BYTES_PER_S = 1 / 3, 200e6


class Rate:
    """Seconds per unit of one kind of work: the median of the last WINDOW warm samples; the first sample, which pays
    the one-time costs (a compile, first calls), is kept apart and stands alone until a warm one exists."""

    def __init__(self):
        self.first = None  # (seconds, units)
        self.warm = deque(maxlen=WINDOW)

    def add(self, seconds, units=1):
        if units <= 0:
            return
        if self.first is None:
            self.first = (seconds, units)
        else:
            self.warm.append(seconds / units)

    def per_unit(self):
        """Warm seconds per unit; None before any sample."""
        if self.warm:
            return statistics.median(self.warm)
        return self.first[0] / self.first[1] if self.first else None

    def measured(self):
        return self.first is not None

    def slowest(self):
        """The slowest recent warm seconds per unit (None before any sample): what an after-run is sized by."""
        return max(self.warm) if self.warm else self.per_unit()

    def spread(self):
        """How far the slowest recent warm sample lies above the rate, as a share of it (0 to 1)."""
        if len(self.warm) < 2:
            return 0.0
        return min(1.0, max(self.warm) / self.per_unit() - 1)


def used_up(budget, took, doing):
    """The line of a budget that start-up spent in `took` seconds (`doing`: what they went on)."""
    return (f"max_time={budget:g} is used up before the first step: start-up took {took:.0f} s {doing}: give a "
            f"budget well above that, e.g. --max_time={max(60, round(10 * took, -1)):g}")


@contextlib.contextmanager
def start_up_deadline(budget, started, now=time.monotonic):
    """Until step 1: a budget from `started` that start-up spends (a big model on a CPU takes minutes) ends the run
    there in one line. A timer (SIGALRM) needs the main thread; elsewhere the checks between the phases stand."""
    if budget is None or threading.current_thread() is not threading.main_thread():
        yield
        return

    def spent(signum, frame):
        raise UserError(used_up(budget, now() - started, "so far (the last 'start-up:' line says what it was doing)")
                        + ", or a smaller model or micro_batch_size")
    previous = signal.signal(signal.SIGALRM, spent)
    signal.setitimer(signal.ITIMER_REAL, max(budget - (now() - started), 1e-3))
    try:
        yield
    finally:
        signal.setitimer(signal.ITIMER_REAL, 0)
        signal.signal(signal.SIGALRM, previous)


class RunClock:
    """max_time's seconds for this process, from `started`. The loop feeds it the seconds and tokens of each step
    (the pace is per token: steps differ in length), evaluation and summary; steps_left decides both the stop and
    the cooldown, so the learning rate reaches min_lr at the last step whatever the pace did."""

    def __init__(self, budget, started=None, now=time.monotonic, eval_interval=1, rouge_summaries=0, after=None,
                 step_tokens=1, validation_tokens=0, save_bytes=0):
        self.budget, self.now = budget, now
        self.started = now() if started is None else started
        self.eval_interval, self.step_tokens = eval_interval, step_tokens
        # what an evaluation's validation loss reads and its saves write, for the guess before one is timed
        self.validation_tokens, self.save_bytes = validation_tokens, save_bytes
        self.rouge_summaries = rouge_summaries  # summarized at every evaluation
        self.after = after or {}  # {'evaluate_after' and/or 'predict_after': the dialogues it summarizes}
        self.steps, self.evaluations, self.summaries = Rate(), Rate(), Rate()
        self.primed = None  # seconds a token, timed before step 1 (warm), until a step is measured
        self.decoding = 0.0  # seconds of summaries decoded in the evaluation in progress
        self.longest = step_tokens  # the most tokens a step had so far
        self.last_call = None  # (when steps_left last answered 0, the seconds it expected the rest to take)

    def prime(self, step_seconds, tokens, decodings=()):
        """Before step 1: a warm step took `step_seconds` for `tokens` tokens (the pace until a step is measured);
        `decodings`: (seconds, summaries) of batches of summaries, the first paying the one-time costs."""
        self.primed = step_seconds / tokens
        for seconds, summaries in decodings:
            self.summaries.add(seconds, summaries)

    def stepped(self, seconds, tokens):
        """A training step of `tokens` (every rank's, padding aside) took `seconds`."""
        self.steps.add(seconds, tokens)
        self.longest = max(self.longest, tokens)

    def summarized(self, seconds, summaries):
        """An evaluation's summaries took `seconds`."""
        self.summaries.add(seconds, summaries)
        self.decoding += seconds

    def evaluated(self, seconds):
        """An evaluation with its save took `seconds`, its summaries (as summarized) included."""
        self.evaluations.add(seconds - self.decoding)
        self.decoding = 0.0

    def spent(self):
        return self.now() - self.started

    def left(self):
        return self.budget - self.spent()

    def per_token(self):
        """A training token's seconds at the warm pace; None before any was timed."""
        return self.steps.per_unit() if self.steps.measured() else self.primed

    def step(self, tokens=None):
        """The seconds of a step of `tokens` (the mean length's) at the warm pace; None before any was timed."""
        per_token = self.per_token()
        return None if per_token is None else per_token * (tokens or self.step_tokens)

    def evaluation(self):
        """The seconds of one evaluation with its save: the rest of one measured warm, its summaries at the warm
        rate; before one was measured, the rest guessed from the training pace and the bytes saved."""
        rest = self.evaluations.per_unit()
        if rest is None:
            rest = (FORWARD_SHARE * (self.per_token() or 0.0) * self.validation_tokens
                    + self.save_bytes / SAVE_BYTES_PER_S)
        return rest + self.rouge_summaries * (self.summaries.per_unit() or 0.0)

    def after_run(self, keys=None):
        """The seconds of after-runs `keys` (else all): their summaries at the slowest recent warm rate (a busy
        machine's quiet moment must not start what cannot end in time), plus an evaluation's rest each."""
        rest = self.evaluations.per_unit() or 0.0
        return sum(self.after[key] * (self.summaries.slowest() or 0.0) + rest for key in keys or self.after)

    def after_words(self, keys=None):
        keys = list(keys or self.after)
        return f"the {sum(self.after[key] for key in keys)} summaries of {' and '.join(keys)}"

    def after_run_problem(self, key, later):
        """The line of after-run `key` that would end past the budget, so is not started (`later` does it), or None."""
        if (need := self.after_run([key])) <= self.left():
            return None
        return (f"max_time={self.budget:g}: {key} is not started: {self.after_words([key])} need about {need:.0f} s "
                f"({self.describe()}) where {max(0.0, self.left()):.0f} s are left; run it later with:\n  {later}")

    def margin(self):
        """What the budget keeps for the last step being the longest seen, and for it and the last evaluation
        running slower than measured: each by how far its kind's slowest recent sample lay above its rate."""
        longest = self.step(self.longest) or 0.0
        return (longest - (self.step() or 0.0) + self.steps.spread() * longest
                + self.evaluations.spread() * self.evaluation())

    def reserve(self):
        """What the budget keeps after the last step: the last evaluation and save, the after-run, the margin."""
        return self.evaluation() + self.after_run() + self.margin()

    def steps_left(self, it, tokens=None):
        """How many steps fit after step `it` (0-based, of `tokens`), the evaluations that fall due and the reserve
        counted, at the warm rates so far; None before a step was timed."""
        if self.per_token() is None:
            return None
        step, evaluation = self.step(), self.evaluation()
        room = self.left() - self.step(tokens) - self.reserve()

        def cost(n):  # n more steps, and the evaluations due after this one and them but the last (in the reserve)
            return n * step + ((it + n) // self.eval_interval - it // self.eval_interval) * evaluation
        low, high = 0, 1
        while cost(high) <= room and high < 2**40:  # a step timed at 0 s fits without end
            low, high = high, 2 * high
        while high - low > 1:  # cost(low) fits (or low is 0), cost(high) does not
            middle = (low + high) // 2
            low, high = (middle, high) if cost(middle) <= room else (low, middle)
        if low == 0:
            self.last_call = (self.now(), self.step(tokens) + evaluation + self.after_run())
        return low

    def settled(self, it, tokens=None):
        """Whether the steps left before step `it` (0-based, of `tokens`) are an estimate to start a cooldown on,
        which cannot be undone: it rests on warm rates alone, or no evaluation can come to measure one better."""
        if self.evaluations.warm or self.per_token() is None:
            return True
        steps_alone = (self.left() - self.step(tokens) - self.after_run() - self.margin()) / self.step()
        return self.eval_interval - it % self.eval_interval > steps_alone

    def ending(self):
        """How the session ended against its budget, in words, for the line of a run stopped by its clock."""
        left = self.left()
        if left > 0:
            return f"with {left:.0f} s left for what follows"
        line = f"{-left:.1f} s past the budget"
        if self.last_call:
            when, expected = self.last_call
            took = self.now() - when
            line += (f": the last step, evaluation and save took {took:.1f} s where {expected:.1f} s were measured "
                     f"(the pace changed by more than the margin its spread asked for)")
        return line

    def after_run_ending(self, took):
        """The line of an after-run that ended past the budget (`took`: {'evaluate_after' or 'predict_after':
        seconds}): by how much, what each took, and what the budget had left and measured for them."""
        left_then = self.left() + sum(took.values())
        spent = " and ".join(f"{name} took {seconds:.1f} s" for name, seconds in took.items())
        return (f"max_time={self.budget:g}: the run ended {-self.left():.1f} s past the budget: {spent}, where "
                f"{max(0.0, left_then):.1f} s were left for them ({self.after_run(took):.1f} s measured for "
                f"{self.after_words(took)}, loading best.pt and writing)")

    def start_up_problem(self):
        """Why the budget cannot train before step 1 (the start-up spent it; a step with the last evaluation and
        the after-run take what is left), else None."""
        if self.left() <= 0:
            return used_up(self.budget, self.spent(), "(imports, reading the data, building the model, timing a step)")
        if (need := self.suggested())[0] < self.left():
            return None
        line = (f"max_time={self.budget:g} leaves {self.left():.0f} s after start-up, and one step with the last "
                f"evaluation, its save{f' and {self.after_words()}' if self.after else ''} need about {need[0]:.0f} s "
                f"({self.describe()}): no training would fit; give --max_time above {need[1]:g}")
        return line + (f", or summarize later ({' '.join(f'--{key}=False' for key in self.after)}, then "
                       f"{' and '.join(key.split('_')[0] + '.py' for key in self.after)})" if self.after else "")

    def suggested(self):
        """(the seconds one step with the reserve needs, the budget train.py and the preflight suggest: SAFE times
        start-up and them, in tens of seconds)."""
        need = self.reserve() + (self.step() or 0.0)
        return need, 10 * math.ceil(SAFE * (self.spent() + need) / 10)

    def thin_margin(self):
        """The preflight's line where start-up and one step with the reserve take over 1/THIN of the budget (train.py,
        slower for a moment on a busy machine, would refuse it), else None."""
        if THIN * (self.spent() + (need := self.suggested())[0]) <= self.budget:
            return None
        return (f"the margin of max_time={self.budget:g} is thin: start-up took {self.spent():.0f} s, one step with "
                f"what follows it needs {need[0]:.0f} s; a busier moment may leave no step: give --max_time above "
                f"{need[1]:g}")

    def describe(self):
        """The rates measured so far, in words."""
        parts = []
        step = self.step()
        if step is not None:
            parts.append(f"{1000 * step:.0f} ms a step of {self.step_tokens:.0f} tokens")
        if self.summaries.measured():
            parts.append(f"{1000 * self.summaries.slowest():.0f} ms a summary warm (the slowest of the last few)")
        if self.evaluations.measured():
            parts.append(f"{self.evaluation():.1f} s an evaluation with its save")
        return ", ".join(parts) or "nothing measured yet"

    def budget_line(self, step, max_iters, at_min_lr, session, sessions):
        """What max_time buys before step `step` + 1 of session `session` (1-based) of `sessions`, at the pace
        measured now (`at_min_lr`: the run's LR has ended its decay, and stays there)."""
        fit = 1 + self.steps_left(step)
        line = (f"max_time={self.budget:g} ({describe_duration(self.budget)}): {self.left():.0f} s left after "
                f"start-up buy about {fit} steps ({self.describe()}; re-measured every step)")
        if self.after:
            line += f", keeping {self.after_run():.0f} s for {self.after_words()}"
        if step + fit >= max_iters:
            return line + f": room for the {max_iters - step} steps to max_iters={max_iters}"
        if at_min_lr:
            return line + f", not the {max_iters - step} to max_iters={max_iters}: the learning rate stays at min_lr"
        if session < sessions:
            return (line + f", not the {max_iters - step} to max_iters={max_iters}; session {session} of "
                    f"sessions={sessions}: the learning rate follows the schedule to the budget's end, and cools down "
                    f"in the last session")
        return (line + f", not the {max_iters - step} to max_iters={max_iters}: the learning rate cools down over "
                f"the last {COOLDOWN:.0%} of them to min_lr at the last (iter {step + fit} at this pace), by the clock"
                + ("; warning: few steps for a run" if fit < 10 else ""))
