"""The run's clock under max_time: what the budget has left; what each kind of work costs warm (a training step, an
evaluation and its save, a summary) apart from its one-time costs (compiling, first calls, the first save); how many
steps still fit; and from that, when training stops and how far the learning rate has cooled down. train.py's loop
asks it after each step. Time comes from `now`, which tests replace with a virtual clock."""
import math
import statistics
import time
from collections import deque

WINDOW = 5  # a rate is the median of this many recent warm samples: a slowdown shows within 3, a lone spike never
COOLDOWN = 0.2  # the last share of a budget-bound run's steps that decays to min_lr (Hägele et al. 2024)
UNMEASURED_EVALUATION = 0.05  # of the budget: an evaluation and its save before one was measured


class Rate:
    """Seconds per unit of one kind of work. Its first sample pays the kind's one-time costs (a compile, first calls)
    and is kept apart: the rate is the median of the last WINDOW warm samples, the first sample's own until one
    exists (an upper bound)."""

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

    def one_time(self):
        """What the first sample cost beyond its units at the warm rate (0 before a warm sample)."""
        if self.first is None or not self.warm:
            return 0.0
        return max(0.0, self.first[0] - self.first[1] * self.per_unit())

    def measured(self):
        return self.first is not None


class RunClock:
    """max_time's seconds for this process, from `started` (its start on the command line). The loop feeds it the
    seconds of each step, of each evaluation with its save apart from its summaries, and of the summaries; it
    answers how many more steps fit after the one about to start (steps_left), which decides both the stop and the
    cooldown (cooldown_lr), so the learning rate reaches min_lr at the last step whatever the pace did."""

    def __init__(self, budget, started=None, now=time.monotonic, eval_interval=1, rouge_summaries=0,
                 after_summaries=0, after_evaluations=0):
        self.budget, self.now = budget, now
        self.started = now() if started is None else started
        self.eval_interval = eval_interval
        self.rouge_summaries = rouge_summaries  # summarized at every evaluation
        self.after_summaries = after_summaries  # by evaluate_after and predict_after
        self.after_evaluations = after_evaluations  # how many of those two run: each loads and writes like one
        self.steps, self.evaluations, self.summaries = Rate(), Rate(), Rate()
        self.decoding = 0.0  # seconds of summaries decoded in the evaluation in progress

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

    def evaluation(self):
        """The seconds of one evaluation with its save: the rest of one measured warm, its summaries at the warm
        rate; before one was measured, UNMEASURED_EVALUATION of the budget stands for the rest."""
        rest = self.evaluations.per_unit()
        rest = UNMEASURED_EVALUATION * self.budget if rest is None else rest
        return rest + self.rouge_summaries * (self.summaries.per_unit() or 0.0)

    def after_run(self):
        """The seconds evaluate_after and predict_after take: their summaries at the warm rate (they decode with the
        graphs this run's evaluations compiled: nothing compiles again), and for each of them its loading of
        best.pt and its writing as an evaluation's rest."""
        if not self.after_summaries:
            return 0.0
        rest = self.evaluations.per_unit() or 0.0
        return self.after_summaries * (self.summaries.per_unit() or 0.0) + self.after_evaluations * rest

    def reserve(self):
        """What the budget keeps after the last step: the last evaluation with its save, and the after-run."""
        return self.evaluation() + self.after_run()

    def steps_left(self, primed=None):
        """How many steps fit after the one about to start (its own time, the evaluations every eval_interval
        steps and the reserve counted), at the warm rates measured so far (`primed`: a step's seconds measured
        before step 1, until a step is); None when neither is known."""
        step = self.steps.per_unit()
        step = primed if step is None else step
        if step is None:
            return None
        per_step = max(step + self.evaluation() / self.eval_interval, 1e-9)
        return max(0, math.floor((self.left() - step - self.reserve()) / per_step))

    def start_up_problem(self, training):
        """Why the budget cannot train before step 1 (the start-up spent it; a step with the last evaluation and
        the after-run take what is left), else None. `training`: a step's seconds measured before step 1."""
        if self.left() <= 0:
            spent = self.spent()
            return (f"max_time={self.budget:g} is used up before the first step: start-up took {spent:.0f} s "
                    f"(imports, reading the data, building the model): give a budget well above that, e.g. "
                    f"--max_time={max(60, round(10 * spent, -1)):g}")
        need = self.reserve() + (training or 0.0)
        if need >= self.left():
            enough = 10 * math.ceil((self.spent() + 2 * need) / 10)
            return (f"max_time={self.budget:g} leaves {self.left():.0f} s after start-up, and one step with the last "
                    f"evaluation, its save and the {self.after_summaries} summaries of evaluate_after and "
                    f"predict_after need about {need:.0f} s ({self.describe(training)}): no training would fit; give "
                    f"--max_time above {enough:g}, or summarize later (--evaluate_after=False "
                    f"--predict_after=False, then evaluate.py and predict.py)")
        return None

    def describe(self, primed=None):
        """The rates measured so far, in words (`primed`: a step's seconds measured before step 1)."""
        parts = []
        step = self.steps.per_unit() if self.steps.measured() else primed
        if step is not None:
            parts.append(f"{1000 * step:.0f} ms a step")
        if self.summaries.measured():
            parts.append(f"{1000 * self.summaries.per_unit():.0f} ms a summary warm"
                         + (f", {self.summaries.one_time():.1f} s to compile the decoding"
                            if self.summaries.one_time() >= 0.05 else ""))
        if self.evaluations.measured():
            parts.append(f"{self.evaluation():.1f} s an evaluation with its save")
        return ", ".join(parts) or "nothing measured yet"


def cooldown_lr(lr, min_lr, steps_left, steps_done, last_session=True):
    """The learning rate of a step under the clock: `lr` as the schedule has it, until the last COOLDOWN of the
    steps the budget leaves (steps_done before this one, this one, steps_left after it); then a 1-sqrt cooldown
    (Hägele et al. 2024) driven by the steps left, reaching min_lr at the last step. A session before the last of a
    run planned over several (--sessions) does not cool down."""
    if steps_left is None or not last_session:
        return lr
    total = steps_done + 1 + steps_left
    ratio = steps_left / (COOLDOWN * total)
    if ratio >= 1:
        return lr
    return min(lr, min_lr + (lr - min_lr) * (1 - math.sqrt(1 - ratio)))
