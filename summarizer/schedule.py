"""The learning-rate schedule: linear warmup, cosine decay to min_lr; saved in ckpt.pt and continued (or
reshaped by a changed config) when a run resumes."""
import math


def lr_schedule(run_config):
    """The LR schedule a run starts with (a dict, saved in ckpt.pt): linear warmup to learning_rate over
    warmup_iters, cosine decay to min_lr at lr_decay_iters (0 = max_iters), then min_lr."""
    c = run_config
    return {"start": 0, "warmup_iters": c["warmup_iters"], "peak_lr": c["learning_rate"], "min_lr": c["min_lr"],
            "decay_iters": c["lr_decay_iters"] or c["max_iters"]}


def learning_rate(it, schedule):
    s = schedule
    if it < s["warmup_iters"]:
        return s["peak_lr"] * (it - s["start"] + 1) / (s["warmup_iters"] - s["start"] + 1)
    if it >= s["decay_iters"]:
        return s["min_lr"]
    ratio = (it - s["warmup_iters"]) / max(1, s["decay_iters"] - s["warmup_iters"])
    return s["min_lr"] + 0.5 * (1.0 + math.cos(math.pi * ratio)) * (s["peak_lr"] - s["min_lr"])


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
    if warming_up:  # finish the warmup, then decay to the new horizon
        return dict(schedule, peak_lr=cfg.learning_rate, min_lr=cfg.min_lr, decay_iters=horizon)
    start_lr = cfg.learning_rate if "learning_rate" in changed else learning_rate(it, schedule)
    return {"start": it, "warmup_iters": it, "peak_lr": start_lr, "min_lr": cfg.min_lr, "decay_iters": horizon}


def fitted_to_budget(schedule, it, last):
    """The schedule of a run whose time budget ends at step `last`, before its decay would (planned at step `it`,
    and marked so): the cosine decay reaches min_lr at `last`, continuing from the LR of step `it` (a warmup in
    progress finishes first). A resume continues it as saved."""
    if it < schedule["warmup_iters"] < last:
        return dict(schedule, decay_iters=last, fitted_to_budget=True)
    return {"start": it, "warmup_iters": it, "peak_lr": learning_rate(it, schedule), "min_lr": schedule["min_lr"],
            "decay_iters": max(last, it + 1), "fitted_to_budget": True}


def describe_schedule(schedule, it, max_iters):
    """One line: the LR of step `it` (0-based, so logged as iter it + 1, as metrics.jsonl counts) and what the LR
    does from there to the last step (logged as iter max_iters)."""
    s, lr, last = schedule, learning_rate(it, schedule), learning_rate(max_iters - 1, schedule)
    decay_end = s["decay_iters"] + 1  # the first logged iter at min_lr
    if max_iters <= s["warmup_iters"]:
        plan = f"warmup: rises to {last:.2e} at iter {max_iters} (the warmup ends at iter {s['warmup_iters'] + 1})"
    elif it >= s["decay_iters"]:
        plan = (f"stays at min_lr {s['min_lr']:.2e} until iter {max_iters} "
                "(--lr_decay_iters=N decays over a new horizon)")
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
