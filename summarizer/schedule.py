"""The learning-rate rule: linear warmup, cosine decay to min_lr, max_time's cooldown to min_lr at the last
step the budget leaves (which never goes back and keeps its shape through a pace slow for a moment), and the
floor: min_lr once the run's last session ended at its budget. Saved in ckpt.pt and continued on resume."""
import math

COOLDOWN = 0.2  # the last share of a budget-bound run's steps that decays to min_lr (Hägele et al. 2024)
STEEPEST = 2  # how many of the cooldown shape's steps one step may go at most, when the pace slows


def lr_schedule(run_config):
    """The schedule a run starts with (a dict, saved in ckpt.pt); lr_decay_iters=0 means max_iters."""
    c = run_config
    return {"start": 0, "warmup_iters": c["warmup_iters"], "peak_lr": c["learning_rate"], "min_lr": c["min_lr"],
            "decay_iters": c["lr_decay_iters"] or c["max_iters"]}


def learning_rate(it, schedule):
    """The LR of step `it` (0-based), cooled down by 1-sqrt (Hägele et al. 2024) as far as the cooldown came."""
    lr = min(stepped_rate(it, schedule), schedule.get("floor", math.inf))
    if lr <= schedule["min_lr"]:
        return lr
    return schedule["min_lr"] + (lr - schedule["min_lr"]) * (1 - math.sqrt(schedule.get("cooldown", 0.0)))


def advance(schedule, it, steps_left=None, settled=True, ended=False, last_session=True):
    """(the LR of step `it`, the schedule after it). `steps_left`: what max_time leaves after this step in the
    last session, else None; the cooldown starts on a `settled` estimate. A session `ended` at its budget is counted."""
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


def cooldown_length(it, schedule, steps_left):
    """The last COOLDOWN of the decay's steps, counted from its start (a resumed run's new peak's own)."""
    return COOLDOWN * (it + 1 - schedule["start"] + steps_left)


def cooldown_progress(it, schedule, steps_left):
    """0 to 1 (min_lr at the last step), never going back, a step at most STEEPEST times the shape's: a pace
    slow for a moment shortens it without a cliff; one slow to the end cuts it short (cut_short says so)."""
    if steps_left == 0:
        return 1.0
    done, length = schedule.get("cooldown", 0.0), cooldown_length(it, schedule, steps_left)
    due = done + (1 - done) / (steps_left + 1) if done else 1 - steps_left / length
    return max(done, min(due, done + STEEPEST / length))


def cut_short(schedule, steps):
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
    return schedule.get("sessions_done", 0)


def resumed_schedule(schedule, saved, cfg, it, given=()):
    """Unchanged settings continue the saved schedule (a larger max_iters does not stretch it); a warmup that
    outlasted its decay finishes. A changed lr_decay_iters or min_lr decays from the current LR, a changed (or
    given, once the decay ended) learning_rate from that peak: a peak asked for is the peak the run trains at."""
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
    """`it` is 0-based, logged as iter it + 1; `by_clock`: max_time may end the last session first, at min_lr."""
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
