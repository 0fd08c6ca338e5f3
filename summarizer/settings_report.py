"""What a command says of its settings: the block train.py prints at start-up (the keys changed from the defaults,
and where each value came from), config.json, and the Markdown reference of every key (`python -m
summarizer.settings_report` prints docs/config.md's table). Reading a command line into settings is config.py's."""
import dataclasses
import json
import os
from typing import NamedTuple

from config import FIELDS, GROUPS, TAKES, Config, Use, describe_duration, keys, settings_given, type_name
from summarizer.files import atomic_write


def as_json(cfg):
    """The settings as config.json holds them (tuples as lists): a JSON preset that gives the same Config."""
    return json.loads(json.dumps(dataclasses.asdict(cfg)))


def save_config(cfg, path):
    """Write the resolved config as a JSON preset, atomically."""
    os.makedirs(os.path.dirname(path) or ".", exist_ok=True)
    with atomic_write(path) as f:
        json.dump(as_json(cfg), f, indent=2)
        f.write("\n")


def changed_values(given):
    """[(key, value, source)] for the keys whose value differs from the default or from what a preset gave, in
    config.py's order, with the preset or the command line whose value holds; `given`: settings_given(argv)."""
    defaults, cfg = Config(), Config(**{key: value for key, value, _ in given})
    source = {key: where for key, _, where in given}
    moved = {key for key, value, _ in given if value != getattr(cfg, key)}  # a preset's value a flag overrode
    return [(key, getattr(cfg, key), source[key]) for key in FIELDS
            if getattr(cfg, key) != getattr(defaults, key) or key in moved]


SETTINGS_WIDTH = 110  # the settings block's lines, but for a single value too long for one


class FromRun(NamedTuple):
    """What the settings block says of the checkpoint a command takes its run's settings from (config.resolve)."""
    path: str
    own: set  # the keys the command decides itself
    changed: list  # [(key, the run's value, this command's)] that the command gave


def settings_report(argv, config_json, from_run=None):
    """What start-up prints of the settings: a line naming config_json (every key, written before step 1: a run that
    stops earlier writes none), then for each source whose values hold (the presets, then the command line) the
    keys it changed from the defaults, by group of config.py, in lines of at most SETTINGS_WIDTH characters:
        settings (changed from the defaults; every key in /kaggle/working/out/config.json before step 1):
          config/kaggle_t4x2.py: System: device='cuda' nccl_p2p_disable=True | Summarizing: gen_batch_size=64
          command line: Paths: out_dir='/kaggle/working/out'
            Training: max_iters=600 max_time=41400.0 [11h 30m = 41400 s] | Evaluation: log_to='tensorboard'
    `from_run`: for a command that takes the others from a run's checkpoint, what it changed of the run's settings,
    then the command's own keys."""
    given = settings_given(argv)
    changed = changed_values(given)
    if from_run:
        changed = [(key, value, source) for key, value, source in changed if key in from_run.own]
        winner = {key: "the command line" if where == "command line" else where for key, _, where in given}
        lines = [f"settings (the run's, from {from_run.path}, and this command's; every key in {config_json} before "
                 f"step 1):"]
        if not from_run.changed:
            lines.append("  changed from the run's: none")
        for source in dict.fromkeys(winner[key] for key, _, _ in from_run.changed):  # presets, then the command line
            lines += pack([[f"{key}={old!r} -> {new!r}" for key, old, new in from_run.changed
                            if winner[key] == source]], f"  changed from the run's by {source}: ", "    ")
    elif not changed:
        return f"settings: the defaults; every key in {config_json} before step 1"
    else:
        lines = [f"settings (changed from the defaults; every key in {config_json} before step 1):"]
    sources = dict.fromkeys(source for *_, source in given)  # the presets, then the command line
    for source in [source for source in sources if any(where == source for *_, where in changed)]:
        by_group = [(group, [setting_text(key, value) for key, value, where in changed
                             if where == source and key in keys(group)]) for group in GROUPS]
        lines += pack([[f"{group.__name__}: {words[0]}", *words[1:]] for group, words in by_group if words],
                      f"  {source}: ", "    ")
    return "\n".join(lines)


def pack(segments, first, indent, width=SETTINGS_WIDTH):
    """Segments (lists of words) in lines of at most `width` characters (the first starts with `first`, the others
    `indent`), apart by ' | ': one that does not fit the line's rest starts the next, unbroken where it fits one."""
    lines, line = [], first
    for segment in segments:
        whole = " ".join(segment)
        if line not in (first, indent) and len(line) + 3 + len(whole) > width and len(indent) + len(whole) <= width:
            lines.append(line)
            line = indent
        for j, word in enumerate(segment):
            sep = "" if line in (first, indent) else " | " if j == 0 else " "
            if sep and len(line) + len(sep) + len(word) > width:
                lines.append(line)
                line, sep = indent, ""
            line += sep + word
    return [*lines, line]


def setting_text(key, value):
    """'key=value' as a preset or flag would give it; max_time with its budget: max_time=5400.0 [1h 30m = 5400 s]."""
    text = f"{key}={value!r}"
    if key == "max_time" and value:
        text += f" [{describe_duration(value)} = {round(value, 3):.10g} s]"
    return text


# ---- help and the reference -------------------------------------------------------------------------------


def scope_table():
    """config.TAKES as a Markdown table: what each command takes from a run's checkpoint, by scope."""
    rows = ["| scope | what | " + " | ".join(use.meaning for use in Use) + " |", "| --- " * (len(Use) + 2) + "|"]
    rows += [f"| `{scope.value}` | {scope.meaning} | " + " | ".join(uses[use].value for use in Use) + " |"
             for scope, uses in TAKES.items()]
    return "\n".join(rows)


def markdown_reference():
    """docs/config.md's reference: what a command takes from a run by each scope, then the keys of each group."""
    defaults = Config()
    sections = ["What a command that uses a run's checkpoint takes from it, by each key's scope (\"given\": a flag, "
                "and for a new run from the weights a preset too):\n\n"
                + scope_table()]
    for group in GROUPS:
        rows = [f"### {group.__name__}\n\n{group.__doc__}\n", "| key | type | default | scope | meaning |",
                "| --- | --- | --- | --- | --- |"]
        for f in dataclasses.fields(group):
            default = repr(getattr(defaults, f.name)).replace("|", "\\|")
            rows.append(f"| `{f.name}` | {type_name(f)} | `{default}` | {f.metadata['scope'].value} | "
                        f"{f.metadata['help']} |")
        sections.append("\n".join(rows))
    return "\n\n".join(sections)


if __name__ == "__main__":
    print(markdown_reference())
