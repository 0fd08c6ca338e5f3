"""What a command says of its settings: the start-up block (keys changed from the defaults, and by which source),
config.json, and docs/config.md's table (`python -m summarizer.settings_report`)."""
import dataclasses
import json
import os
from typing import NamedTuple

from command_line import atomic_write
from config import FIELDS, GROUPS, TAKES, Config, Use, describe_duration, keys, settings_given, type_name


def as_json(cfg):
    return json.loads(json.dumps(dataclasses.asdict(cfg)))


def save_config(cfg, path):
    os.makedirs(os.path.dirname(path) or ".", exist_ok=True)
    with atomic_write(path) as f:
        json.dump(as_json(cfg), f, indent=2)
        f.write("\n")


def changed_values(given):
    """[(key, value, source)] of the keys a preset or the command line changed (a preset's value a flag
    overrode too), in config.py's order; `given`: settings_given(argv)."""
    defaults, cfg = Config(), Config(**{key: value for key, value, _ in given})
    source = {key: where for key, _, where in given}
    moved = {key for key, value, _ in given if value != getattr(cfg, key)}  # a preset's value a flag overrode
    return [(key, getattr(cfg, key), source[key]) for key in FIELDS
            if getattr(cfg, key) != getattr(defaults, key) or key in moved]


SETTINGS_WIDTH = 110  # the settings block's lines, but for a single value too long for one


class FromRun(NamedTuple):
    """The checkpoint a command takes its run's settings from (config.resolve), as the settings block names it."""
    path: str
    own: set  # the keys the command decides itself
    changed: list  # [(key, the run's value, this command's)] that the command gave


def settings_report(argv, config_json, from_run=None):
    """The settings block: a line naming config_json, then per source (presets, then the command line) the keys
    it changed, by group, in lines of at most SETTINGS_WIDTH; `from_run`: what the command changed of the run's."""
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
    """Segments (lists of words) joined by ' | ' in lines of at most `width`: a segment that does not fit the line's
    rest starts the next, unbroken where it fits one."""
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
    text = f"{key}={value!r}"
    if key == "max_time" and value:
        text += f" [{describe_duration(value)} = {round(value, 3):.10g} s]"
    return text


# ---- help and the reference -------------------------------------------------------------------------------


def scope_table():
    rows = ["| scope | what | " + " | ".join(use.meaning for use in Use) + " |", "| --- " * (len(Use) + 2) + "|"]
    rows += [f"| `{scope.value}` | {scope.meaning} | " + " | ".join(uses[use].value for use in Use) + " |"
             for scope, uses in TAKES.items()]
    return "\n".join(rows)


def markdown_reference():
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
