"""The learning-rate rule, all of it: linear warmup, cosine decay to min_lr, max_time's cooldown to min_lr at the
last step the budget leaves (the steps left come from summarizer/clock.py), which once started never goes back (a
faster pace lengthens it, it does not undo it) and keeps its shape through a pace slow for a moment, and the floor:
min_lr once a run's last session ended at its budget. Saved in ckpt.pt with the cooldown's progress and the sessions
the run has ended, and continued (or reshaped by a changed config or a peak given again) when a run resumes."""
import math

COOLDOWN = 0.2  # the last share of a budget-bound run's steps that decays to min_lr (Hägele et al. 2024)
STEEPEST = 2  # how many of the cooldown shape's steps one step may go at most, when the pace slows


def lr_schedule(run_config):
    """The LR schedule a run starts with (a dict, saved in ckpt.pt): linear warmup to learning_rate over
    warmup_iters, cosine decay to min_lr at lr_decay_iters (0 = max_iters), then min_lr."""
    c = run_config
    return {"start": 0, "warmup_iters": c["warmup_iters"], "peak_lr": c["learning_rate"], "min_lr": c["min_lr"],
            "decay_iters": c["lr_decay_iters"] or c["max_iters"]}


def learning_rate(it, schedule):
    """The LR of step `it` (0-based) by `schedule`: the warmup and cosine's, never above the floor, cooled down by
    1-sqrt (Hägele et al. 2024) as far as the schedule's cooldown has come (advance moves it)."""
    lr = min(stepped_rate(it, schedule), schedule.get("floor", math.inf))
    if lr <= schedule["min_lr"]:
        return lr
    return schedule["min_lr"] + (lr - schedule["min_lr"]) * (1 - math.sqrt(schedule.get("cooldown", 0.0)))


def advance(schedule, it, steps_left=None, settled=True, ended=False, last_session=True):
    """(the LR of step `it`, the schedule after it), the one call of a training step. Under max_time in the last
    session (`steps_left`: what the budget leaves after this step, else None) the cooldown starts on a `settled`
    estimate, then follows the steps left to min_lr at the last step. A session ended at its budget (`ended`) is
    counted, the run's last leaving the floor at min_lr."""
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
    """Whether the LR has ended its decay at step `it`: min_lr from there on."""
    return it >= schedule["warmup_iters"] and learning_rate(it, schedule) <= schedule["min_lr"]


def cooldown_length(it, schedule, steps_left):
    """The cooldown's steps by its shape: the last COOLDOWN of the decay's steps (from its start: a resumed run's
    new peak decays over its own steps, not the whole run's), `it` and `steps_left` after it the last."""
    return COOLDOWN * (it + 1 - schedule["start"] + steps_left)


def cooldown_progress(it, schedule, steps_left):
    """How far the cooldown is at step `it`, from 0 to 1 (min_lr, at the last step): what is left of it spread evenly
    over the steps left, never going back, a step at most STEEPEST times the shape's step: a pace slow for a moment
    shortens it without a cliff; one slow to the end cuts it short (cut_short says so)."""
    if steps_left == 0:
        return 1.0
    done, length = schedule.get("cooldown", 0.0), cooldown_length(it, schedule, steps_left)
    due = done + (1 - done) / (steps_left + 1) if done else 1 - steps_left / length
    return max(done, min(due, done + STEEPEST / length))


def cut_short(schedule, steps):
    """The line of a session ended after `steps` steps whose last step had to drop the LR further than STEEPEST of
    the cooldown shape's steps, else None."""
    it, lr = schedule.get("cut_short", (None, None))
    if it != steps - 1:
        return None
    length = cooldown_length(it, schedule, 0)
    return (f"note: the learning rate's cooldown was cut short: its last step dropped it from {lr:.2e} to min_lr "
            f"{schedule['min_lr']:.2e} after {it + 1 - schedule['cooldown_from']} of the about {length:.0f} steps "
            f"it plans (the last {COOLDOWN:.0%} of the {it + 1 - schedule['start']} steps of its decay): the steps "
            f"the budget leaves fell faster than it could follow (a slower pace or evaluation near the end)")


def stepped_rate(it, schedule):
    s = schedule
    if it < s["warmup_iters"]:
        return s["peak_lr"] * (it - s["start"] + 1) / (s["warmup_iters"] - s["start"] + 1)
    if it >= s["decay_iters"]:
        return s["min_lr"]
    ratio = (it - s["warmup_iters"]) / max(1, s["decay_iters"] - s["warmup_iters"])
    return s["min_lr"] + 0.5 * (1.0 + math.cos(math.pi * ratio)) * (s["peak_lr"] - s["min_lr"])


def sessions_done(schedule):
    """How many max_time sessions of the run ended at their budget."""
    return schedule.get("sessions_done", 0)


def resumed_schedule(schedule, saved, cfg, it, given=()):
    """The schedule a run resumed at step `it` follows. Unchanged settings continue the saved schedule (a larger
    max_iters does not stretch its decay), but a warmup that outlasted its decay finishes and decays to the new
    horizon. A changed lr_decay_iters or min_lr decays from the current LR to min_lr at the new horizon, a changed
    learning_rate from that peak; so does one the command line gave (`given`) once the decay has ended, even the
    saved one: a peak asked for is the peak the run trains at."""
    changed = {k for k in ("learning_rate", "min_lr", "lr_decay_iters") if getattr(cfg, k) != saved[k]}
    if "learning_rate" in given and decayed(it, schedule):
        changed.add("learning_rate")
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
    """One line: the LR of step `it` (0-based, so logged as iter it + 1, as metrics.jsonl counts) and what the LR
    does from there to the last step (logged as iter max_iters). `learning_rate_setting`: the run's learning_rate;
    `by_clock`: max_time may end the run's last session first, at min_lr (its line says at which iter)."""
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
