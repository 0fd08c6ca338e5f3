"""The command line of train.py, evaluate.py, predict.py and export.py: presets and --key=value overrides.

    python train.py [preset.py|preset.json ...] [--key=value ...]      later arguments win; --help lists the keys

Values are Python literals (`--learning_rate=3e-4`, `--compile=False`, `--prompt_template='"..."'`); for a text
field a bare word is taken as it is (`--init_from=gpt2-medium`, `--device=cuda:1`). Preset .py files are parsed
with `ast`, never executed: only top-level `name = <literal>` lines. `python -m summarizer.command_line` prints
the reference table of all keys in Markdown (docs/config.md's).
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
    """{key: value} that presets and --key=value overrides set, in order (later ones win); --help prints the
    usage and every key, and exits."""
    if "-h" in argv or "--help" in argv:
        print_help()
        raise SystemExit(0)
    values = {}
    for arg in argv:
        if arg.startswith("--"):
            key, value = parse_override(arg)
            values[key] = value
        else:
            values.update(read_preset(arg))
    return values


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


def typed(key, value, source):
    """`value` as the field's type (an int is accepted for a float), or UserError naming the key."""
    check_key(key, source)
    kinds = types_of(FIELDS[key])
    if kinds == (float,) and type(value) is int:
        return float(value)
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
        raise UserError(f"preset {path} does not exist: pass an existing .py or .json file")
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


def changed_settings(argv):
    """'batch_size=32 (config/demo.py), max_iters=5 (command line)': the keys whose value differs from the
    default, and the preset or command line that set them last."""
    defaults, cfg, source = Config(), Config(**read_arguments(argv)), {}
    for arg in argv:
        keys_set = [parse_override(arg)[0]] if arg.startswith("--") else read_preset(arg)
        source.update(dict.fromkeys(keys_set, "command line" if arg.startswith("--") else arg))
    changed = [key for key in FIELDS if getattr(cfg, key) != getattr(defaults, key)]
    return ", ".join(f"{key}={getattr(cfg, key)!r} ({source[key]})" for key in changed)


# ---- texts inside settings --------------------------------------------------------------------------------


def parse_duration(text):
    """max_time's seconds: '' -> None, '5400' or '5400s' -> 5400.0, '11h30m' -> 41400.0, '1.5h' -> 5400.0."""
    if not text.strip():
        return None
    parts = re.fullmatch(r"\s*(?:([\d.]+)h)?\s*(?:([\d.]+)m)?\s*(?:([\d.]+)s?)?\s*", text)
    try:
        hours, minutes, seconds = (float(p or 0) for p in parts.groups())
    except (AttributeError, ValueError):
        parts = None
    if parts is None or not any(parts.groups()) or hours * 3600 + minutes * 60 + seconds <= 0:
        raise UserError(f"max_time={text!r} is not a positive duration: write seconds (41400) or e.g. 11h30m, 45m")
    return hours * 3600 + minutes * 60 + seconds


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
