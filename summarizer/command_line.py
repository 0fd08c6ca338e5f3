"""The command line of train.py, evaluate.py, predict.py and export.py: presets and --key=value overrides.

    python train.py [preset.py|preset.json ...] [--key=value ...]      --help lists the keys

Presets are applied first, in their order (a later preset wins over an earlier one), then every --key=value flag
in its order: a flag beats any preset, whether it comes before or after it (`--device=cpu config/kaggle_t4x2.py`
runs on the CPU). Values are Python literals (`--learning_rate=3e-4`, `--prompt_template='"..."'`); for a text
field a bare word is taken as it is (`--init_from=gpt2-medium`, `--device=cuda:1`). A yes/no key takes
true/false, yes/no, on/off or 1/0 in any case (`--evaluate_after=true`, `--compile=False`). max_time takes
seconds (`5400`, `5400s`) or hours, minutes and seconds, each number with its unit (`1.5h`, `45m`, `11h30m`,
`1h30m15s`). Preset .py files are parsed with `ast`, never executed: only top-level `name = <literal>` lines.
`python -m summarizer.command_line` prints the reference table of all keys in Markdown (docs/config.md's).
"""
import ast
import dataclasses
import difflib
import json
import os
import re
import sys
import typing

from config import FIELDS, GROUPS, READ_ONLY_BY, Config, Decoding, keys
from summarizer.errors import UserError
from summarizer.files import atomic_write

# ---- arguments and presets --------------------------------------------------------------------------------


def read_arguments(argv):
    """{key: value} that presets and --key=value overrides set: the presets in their order, then the flags in
    theirs, so a flag beats a preset wherever it stands; --help prints the usage and every key, and exits."""
    if "-h" in argv or "--help" in argv:
        print_help()
        raise SystemExit(0)
    return {key: value for key, value, _ in settings_given(argv)}


def settings_given(argv):
    """(key, value, source) for every key the arguments set, in the order they apply (presets first, then the
    flags; a later tuple of the same key wins). source: the preset's path, or 'command line'."""
    presets = [arg for arg in argv if not arg.startswith("--")]
    flags = [arg for arg in argv if arg.startswith("--")]
    given = [(key, value, path) for path in presets for key, value in read_preset(path).items()]
    return given + [(*parse_override(arg), "command line") for arg in flags]


def check_key(key, source):
    if key not in FIELDS:
        close = difflib.get_close_matches(key, FIELDS, n=1)
        hint = f"did you mean {close[0]!r}?" if close else "run with --help to list the keys"
        raise UserError(f"unknown config key {key!r} in {source}: {hint}")


def types_of(f):
    """The types a field accepts: (int,), or (bool, str) for `bool | str`."""
    return typing.get_args(f.type) or (f.type,)


def type_name(f):
    return " or ".join(kind.__name__ for kind in types_of(f))


TRUE_WORDS, FALSE_WORDS = ("true", "yes", "on", "1"), ("false", "no", "off", "0")
BOOL_FORMS = "true/false, yes/no, on/off or 1/0, in any case"


def as_bool(value):
    """True or False for a yes/no word (any case) or 1/0; None for anything else (a bool stays itself)."""
    if type(value) is bool:
        return value
    if type(value) is int and value in (0, 1):
        return bool(value)
    if isinstance(value, str):
        word = value.strip().lower()
        if word in TRUE_WORDS or word in FALSE_WORDS:
            return word in TRUE_WORDS
    return None


def typed(key, value, source):
    """`value` as the field's type (an int is accepted for a float, a yes/no word or 1/0 for a bool), or
    UserError naming the key."""
    check_key(key, source)
    kinds = types_of(FIELDS[key])
    if kinds == (float,) and type(value) is int:
        return float(value)
    if bool in kinds and as_bool(value) is not None:
        return as_bool(value)
    if kinds == (bool,):
        raise UserError(f"{key}={value!r} is not a yes/no value: write {BOOL_FORMS} (in {source})")
    if type(value) not in kinds:
        raise UserError(f"{key} expects {type_name(FIELDS[key])}, got {value!r} ({type(value).__name__}) in {source}")
    return value


def parse_override(arg):
    """'--key=value' -> (key, value) with the value as a Python literal, or as text for a text field."""
    key, eq, text = arg[2:].partition("=")
    if not arg.startswith("--") or not eq:
        raise UserError(f"cannot read argument {arg!r}: use --key=value, or a preset .py/.json file")
    source = f"--{key}={text}"
    check_key(key, source)
    try:
        value = ast.literal_eval(text)
    except (ValueError, SyntaxError):
        value = text
    if FIELDS[key].type is str and not isinstance(value, str):
        value = text
    return key, typed(key, value, source)


def read_preset(path):
    """{key: value} from a preset: a .json object, or a .py file of top-level `name = <literal>` lines."""
    if not os.path.isfile(path):
        near = near_preset(path)
        hint = (f"did you mean {near}?" if near else f"to set a key, write --{path}" if "=" in path
                else "pass an existing .py or .json file (the presets are in config/)")
        raise UserError(f"preset {path}: no such preset; {hint}")
    with open(path, encoding="utf-8") as f:
        text = f.read()
    if path.endswith(".json"):
        try:
            values = json.loads(text)
        except json.JSONDecodeError as e:
            raise UserError(f"preset {path} is not valid JSON: {e}") from None
        if not isinstance(values, dict):
            raise UserError(f"preset {path} must hold a JSON object of key: value")
        return {key: typed(key, value, path) for key, value in values.items()}
    if not path.endswith(".py"):
        raise UserError(f"preset {path} must end in .py or .json")
    try:
        tree = ast.parse(text, filename=path)
    except SyntaxError as e:
        raise UserError(f"preset {path} line {e.lineno}: syntax error: {e.msg}") from None
    values = {}
    for node in tree.body:
        source = f"{path} line {node.lineno}"
        if isinstance(node, ast.Expr) and isinstance(node.value, ast.Constant) and isinstance(node.value.value, str):
            continue  # a docstring
        if not (isinstance(node, ast.Assign) and len(node.targets) == 1 and isinstance(node.targets[0], ast.Name)):
            raise UserError(f"{source}: only `name = <literal>` lines are allowed in a preset, got "
                            f"{ast.get_source_segment(text, node)!r}")
        try:
            value = ast.literal_eval(node.value)
        except ValueError:
            raise UserError(f"{source}: {ast.get_source_segment(text, node.value)!r} is not a literal "
                            f"(write the value itself, e.g. 256, not 8 * 32)") from None
        values[node.targets[0].id] = typed(node.targets[0].id, value, source)
    return values


def near_preset(path):
    """The existing preset a missing path most likely means: the path with .py (or .json) added, else the closest
    name among the .py/.json files of config/ and of the folder the path names; None when none is close."""
    for ext in (".py", ".json"):
        if os.path.isfile(path + ext):
            return path + ext
    shipped = os.path.relpath(os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "config"))
    files = {}  # name: its path, the path's own folder first
    for folder in dict.fromkeys([os.path.dirname(path), shipped]):
        if folder and os.path.isdir(folder):
            for name in sorted(os.listdir(folder)):
                if name.endswith((".py", ".json")):
                    files.setdefault(name, os.path.normpath(os.path.join(folder, name)))
    wanted = os.path.basename(path if path.endswith((".py", ".json")) else path + ".py")
    close = difflib.get_close_matches(wanted, files, n=1)
    return files[close[0]] if close else None


def save_config(cfg, path):
    """Write the resolved config as a JSON preset, atomically."""
    os.makedirs(os.path.dirname(path) or ".", exist_ok=True)
    with atomic_write(path) as f:
        json.dump(dataclasses.asdict(cfg), f, indent=2)
        f.write("\n")


def explicit_keys(argv):
    """The keys given as --key=value (not those a preset sets): what a command asks for in so many words."""
    return {parse_override(arg)[0] for arg in argv if arg.startswith("--") and arg not in ("-h", "--help")}


def check_command(argv, command):
    """One line when the command line gives `command` a key that only another command reads (config.READ_ONLY_BY),
    instead of ignoring it."""
    for group, reader in READ_ONLY_BY.items():
        given = sorted(explicit_keys(argv) & set(keys(group)))
        if given and reader != command:
            raise UserError(f"--{given[0]} is read by {reader}, not {command}: run python {reader} with it "
                            f"(docs/config.md)")


def changed_values(given):
    """[(key, value, source)] for the keys whose value differs from the default, in config.py's order, with the
    preset or the command line whose value holds (a flag beats a preset, whatever the order); `given`:
    settings_given(argv)."""
    defaults, cfg = Config(), Config(**{key: value for key, value, _ in given})
    source = {key: where for key, _, where in given}
    return [(key, getattr(cfg, key), source[key]) for key in FIELDS if getattr(cfg, key) != getattr(defaults, key)]


def changed_settings(argv):
    """'batch_size=32 (config/demo.py), max_iters=5 (command line)': the keys whose value differs from the
    default, and the preset or command line whose value holds, in one line."""
    changed = changed_values(settings_given(argv))
    return ", ".join(f"{setting_text(key, value)} ({source})" for key, value, source in changed)


SETTINGS_WIDTH = 110  # the settings block's lines, but for a single value too long for one


def settings_report(argv, config_json):
    """What start-up prints of the settings: a line naming config_json (every key), then for each source whose
    values hold (the presets, then the command line) the keys it changed from the defaults, by group of config.py:
        settings (changed from the defaults; every key: /kaggle/working/out/config.json):
          config/kaggle_t4x2.py: System: device='cuda' nccl_p2p_disable=True | Summarizing: gen_batch_size=64
          command line: Run: out_dir='/kaggle/working/out'
            Training: max_iters=600 max_time='11h30m' [11h 30m = 41400 s] | Evaluation: log_to='tensorboard'
    in lines of at most SETTINGS_WIDTH characters; max_time with its budget in hours, minutes and seconds."""
    given = settings_given(argv)
    changed = changed_values(given)
    if not changed:
        return f"settings: the defaults; every key: {config_json}"
    lines = [f"settings (changed from the defaults; every key: {config_json}):"]
    sources = dict.fromkeys(source for *_, source in given)  # the presets, then the command line
    for source in [source for source in sources if any(where == source for *_, where in changed)]:
        segments = []
        for group in GROUPS:
            words = [setting_text(key, value) for key, value, where in changed
                     if where == source and key in keys(group)]
            if words:
                segments.append([f"{group.__name__}: {words[0]}", *words[1:]])
        lines += pack(segments, f"  {source}: ", "    ")
    return "\n".join(lines)


def pack(segments, first, indent, width=SETTINGS_WIDTH):
    """Segments (lists of words) in lines of at most `width` characters, apart by ' | ', a segment's words apart
    by spaces: a segment that does not fit the line's rest starts the next line, and one that fits no line is
    broken between its words (a word longer than a line stands alone on its own). The first line starts with
    `first`, the others with `indent`."""
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
    """'key=value' as a preset or flag would give it; max_time with its budget: max_time='1.5h' [1h 30m = 5400 s]."""
    text = f"{key}={value!r}"
    if key == "max_time" and value:
        seconds = parse_duration(value)
        text += f" [{describe_duration(seconds)} = {round(seconds, 3):.10g} s]"
    return text


# ---- texts inside settings --------------------------------------------------------------------------------


NUMBER = r"(?:\d+(?:\.\d*)?|\.\d+)"


def parse_duration(text):
    """max_time's seconds: '' -> None, '5400' or '5400s' -> 5400.0, '11h30m' -> 41400.0, '1.5h' -> 5400.0,
    '1h30m15s' -> 5415.0. The units go h, m, s, each at most once; a number after a unit needs its own: '1h30' is
    refused (1h30m or 1h30s?)."""
    if not text.strip():
        return None
    compact = re.sub(r"\s", "", text)
    if re.fullmatch(NUMBER, compact):
        compact += "s"  # plain seconds
    match = re.fullmatch(rf"(?:({NUMBER})h)?(?:({NUMBER})m)?(?:({NUMBER})s)?", compact)
    if match is None and re.fullmatch(rf"(?:{NUMBER}h)?(?:{NUMBER}m)?{NUMBER}", compact):
        last = re.findall(r"[hm]", compact)[-1]  # the units after it are the ones meant
        meant = [compact + unit for unit in "hms"["hms".index(last) + 1:]]
        raise UserError(f"max_time={text!r} is ambiguous: write {meant[0]}"
                        + (f" (or {meant[1]})" if len(meant) > 1 else "") + ", each number with its unit")
    hours, minutes, seconds = (float(number or 0) for number in match.groups()) if match else (0, 0, 0)
    seconds += hours * 3600 + minutes * 60
    if seconds <= 0:
        raise UserError(f"max_time={text!r} is not a positive duration: write seconds (5400, 5400s) or hours, "
                        f"minutes and seconds, each number with its unit (1.5h, 45m, 11h30m, 1h30m15s)")
    return seconds


def describe_duration(seconds):
    """5400 -> '1h 30m', 5415 -> '1h 30m 15s', 90 -> '1m 30s', 41400 -> '11h 30m', 0.5 -> '0.5s'."""
    hours, rest = divmod(round(seconds, 3), 3600)
    minutes, rest = divmod(rest, 60)
    parts = [f"{int(hours)}h" if hours else "", f"{int(minutes)}m" if minutes else "", f"{rest:g}s" if rest else ""]
    return " ".join(p for p in parts if p) or "0s"


def lora_target_list(lora_targets):
    return [t.strip() for t in lora_targets.split(",") if t.strip()]


def sweep_keys():
    """What evaluate.py --sweep may vary: the decoding settings but the summary budget (fixed by training), the
    sampling seed and the generation batch."""
    return (*keys(Decoding)[1:], "seed", "gen_batch_size")


def parse_sweep(text):
    """'num_beams=1,4 length_penalty=0.8,1.0' -> every combination, as [{key: value}, ...] (the last key varies
    fastest); [] for ''. Values are read as --key=value would be."""
    settings = [{}] if text.strip() else []
    for group in text.split():
        key, eq, values = group.partition("=")
        if not eq or not values:
            raise UserError(f"sweep={text!r}: cannot read {group!r}, write key=value1,value2,...")
        if key not in sweep_keys():
            raise UserError(f"sweep={text!r}: {key!r} is not a decoding setting; "
                            f"sweep one of {', '.join(sweep_keys())}")
        try:
            typed_values = [parse_override(f"--{key}={value}")[1] for value in values.split(",")]
        except UserError as e:
            raise UserError(f"sweep={text!r}: {e}") from None
        settings = [dict(s, **{key: v}) for s in settings for v in typed_values]
    return settings


# ---- help and the reference -------------------------------------------------------------------------------


def print_help():
    """The usage and every key; a reader that stops early (`--help | head`) is not an error."""
    try:
        print(__doc__.strip() + "\n\n" + help_text(), flush=True)
    except BrokenPipeError:
        os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())  # Python's flush at exit would fail again


def help_text():
    defaults = Config()
    return "\n".join(f"--{name}={getattr(defaults, name)!r}\n    {f.metadata['help']}" for name, f in FIELDS.items())


def markdown_reference():
    """docs/config.md's reference: a table of keys per group of settings."""
    defaults, sections = Config(), []
    for group in GROUPS:
        rows = [f"### {group.__name__}\n\n{group.__doc__}\n", "| key | type | default | meaning |",
                "| --- | --- | --- | --- |"]
        for f in dataclasses.fields(group):
            default = repr(getattr(defaults, f.name)).replace("|", "\\|")
            rows.append(f"| `{f.name}` | {type_name(f)} | `{default}` | {f.metadata['help']} |")
        sections.append("\n".join(rows))
    return "\n\n".join(sections)


if __name__ == "__main__":
    print(markdown_reference())
