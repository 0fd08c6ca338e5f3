"""The learning-rate schedule: linear warmup, cosine decay to min_lr, and a floor: min_lr once a run's last
max_time session has cooled down to it (summarizer/clock.py); saved in ckpt.pt with the sessions the run has ended,
and continued (or reshaped by a changed config) when a run resumes."""
import math


def lr_schedule(run_config):
    """The LR schedule a run starts with (a dict, saved in ckpt.pt): linear warmup to learning_rate over
    warmup_iters, cosine decay to min_lr at lr_decay_iters (0 = max_iters), then min_lr."""
    c = run_config
    return {"start": 0, "warmup_iters": c["warmup_iters"], "peak_lr": c["learning_rate"], "min_lr": c["min_lr"],
            "decay_iters": c["lr_decay_iters"] or c["max_iters"]}


def learning_rate(it, schedule):
    """The LR of step `it` (0-based): the warmup and cosine's, never above the floor."""
    return min(stepped_rate(it, schedule), schedule.get("floor", math.inf))


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


def resumed_schedule(schedule, saved, cfg, it):
    """The schedule a run resumed at step `it` follows. Unchanged settings continue the saved schedule (a larger
    max_iters does not stretch its decay: the LR stays at min_lr after it), except that a run stopped inside a
    warmup that outlasted its decay (max_iters < warmup_iters) finishes the warmup and decays to the new horizon.
    A changed lr_decay_iters or min_lr decays from the current LR to min_lr at the new horizon, a changed
    learning_rate from that LR instead. (warmup_iters is fixed by training: config.Scope.)"""
    changed = [k for k in ("learning_rate", "min_lr", "lr_decay_iters") if getattr(cfg, k) != saved[k]]
    warming_up = it < schedule["warmup_iters"]
    if not changed and not (warming_up and schedule["decay_iters"] <= schedule["warmup_iters"]):
        return schedule
    horizon = cfg.lr_decay_iters or cfg.max_iters
    kept = {"sessions_done": sessions_done(schedule)}  # a changed LR setting lifts the floor, not the sessions
    if warming_up:  # finish the warmup, then decay to the new horizon
        return {**{k: v for k, v in schedule.items() if k != "floor"}, "peak_lr": cfg.learning_rate,
                "min_lr": cfg.min_lr, "decay_iters": horizon, **kept}
    start_lr = cfg.learning_rate if "learning_rate" in changed else learning_rate(it, schedule)
    return {"start": it, "warmup_iters": it, "peak_lr": start_lr, "min_lr": cfg.min_lr, "decay_iters": horizon, **kept}


def describe_schedule(schedule, it, max_iters):
    """One line: the LR of step `it` (0-based, so logged as iter it + 1, as metrics.jsonl counts) and what the LR
    does from there to the last step (logged as iter max_iters)."""
    s, lr, last = schedule, learning_rate(it, schedule), learning_rate(max_iters - 1, schedule)
    decay_end = s["decay_iters"] + 1  # the first logged iter at min_lr
    if max_iters <= s["warmup_iters"]:
        plan = f"warmup: rises to {last:.2e} at iter {max_iters} (the warmup ends at iter {s['warmup_iters'] + 1})"
    elif lr <= s["min_lr"]:
        plan = (f"stays at min_lr {s['min_lr']:.2e} until iter {max_iters}: the run's decay has ended; "
                f"--learning_rate=<a peak, e.g. {s['peak_lr']:.0e}> decays from that peak again (under max_time, to "
                f"min_lr at the budget's end; a run planned over several sessions says --sessions=N from its first)")
    else:
        if s["decay_iters"] <= s["warmup_iters"]:
            plan = f"min_lr {s['min_lr']:.2e} from iter {s['warmup_iters'] + 1}"
        elif decay_end <= max_iters:
            plan = (f"cosine decay to min_lr {s['min_lr']:.2e} at iter {decay_end}, constant after it until iter "
                    f"{max_iters}")
        else:
            plan = (f"cosine decay to {last:.2e} at iter {max_iters} (it would reach min_lr {s['min_lr']:.2e} at "
                    f"iter {decay_end})")
        if it < s["warmup_iters"]:
            plan = f"warmup: rises to {s['peak_lr']:.2e} at iter {s['warmup_iters'] + 1}, then {plan}"
    return f"learning rate at iter {it + 1}: {lr:.2e}; {plan}"
