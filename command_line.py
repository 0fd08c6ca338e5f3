"""A command line in words (presets, --key=value flags, --help), which config.py types and checks; UserError lives
here: a command line is the first thing to get wrong. atomic_write: the one way every module writes a file."""
import ast
import contextlib
import difflib
import errno
import json
import os
import shutil
import sys

COMMAND_LINE = """\
Presets are applied first, in their order (a later preset wins over an earlier one), then every --key=value flag
(also written --key value) in its order: a flag beats any preset, whether it comes before or after it
(`--device=cpu config/kaggle_t4x2.py` runs on the CPU). Values are Python literals (`--learning_rate=3e-4`,
`--prompt_template='"..."'`); for a text field a bare word is taken as it is (`--init_from=gpt2-medium`,
`--device=cuda:1`). A yes/no key takes true/false, yes/no, on/off or 1/0 in any case (`--evaluate_after=true`,
`--compile=False`). max_time takes seconds (`5400`, `5400s`) or hours, minutes and seconds, each number with its
unit (`1.5h`, `45m`, `11h30m`, `1h30m15s`). Preset .py files are read, never run: only top-level
`name = <literal>` lines.

A command that uses a trained run (a resume, a new run from a checkpoint, evaluate.py, predict.py, export.py)
takes from it what each key's scope says (the table in docs/config.md); a flag that contradicts what training
fixed stops in one line."""


REPO = os.path.dirname(os.path.abspath(__file__))  # the commands' folder, where the presets' relative paths lead


def repository_copy_hint(path, use):
    """The clause for a relative path missing from the working folder that the repository holds, else ''."""
    if os.path.isabs(path) or not os.path.exists(there := os.path.join(REPO, path)):
        return ""
    return (f"; relative paths resolve against the working folder ({os.getcwd()}), and {there} exists: use it with "
            f"{use}={there}, or run from {REPO}")


class UserError(Exception):
    """A mistake the user can fix; entry points print it as one `error: ...` line."""


def first_line(error):
    """What a one-line message keeps of an exception: its text's first line ('' where it has none)."""
    return str(error).strip().partition("\n")[0]


def error_line(error):
    """An exception as one line: its type and its text's first line."""
    return f"{type(error).__name__}: {first_line(error)}"


def arguments(argv):
    """(presets, flags as '--key=value'); `--max_iters 5` is `--max_iters=5`, whatever the next word looks like."""
    presets, flags, words, two_words = [], [], list(argv), None
    while words:
        word, follows, two_words = words.pop(0), two_words, None
        if not word.startswith("--"):
            if follows and not os.path.isfile(word):  # `--max_time 1h 30m`: the shell split one value in two
                raise UserError(f"{word!r} follows {follows[0]} {follows[1]}: a value with a space must be one "
                                f"word: {follows[0]}='{follows[1]} {word}'")
            presets.append(word)
        elif "=" not in word and word not in ("-h", "--help") and words and not words[0].startswith("--"):
            two_words = (word, words.pop(0))
            flags.append("=".join(two_words))
        else:
            flags.append(word)
    return presets, flags


def flag(arg):
    key, eq, text = arg[2:].partition("=")
    if not arg.startswith("--") or not eq:
        raise UserError(f"cannot read argument {arg!r}: use --key=value (or --key value), or a preset .py/.json file")
    return key, text


def literal(text):
    try:
        return ast.literal_eval(text)
    except (ValueError, SyntaxError):
        return text


def preset(path):
    """[(key, value, where it is set)] of a .json object or a .py file of `name = <literal>` lines."""
    if not os.path.isfile(path):
        near = near_preset(path)
        hint = (f"did you mean {near}?" if near else f"to set a key, write --{path.lstrip('-')}" if "=" in path
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
        return [(key, value, path) for key, value in values.items()]
    if not path.endswith(".py"):
        raise UserError(f"preset {path} must end in .py or .json")
    try:
        tree = ast.parse(text, filename=path)
    except SyntaxError as e:
        raise UserError(f"preset {path} line {e.lineno}: syntax error: {e.msg}") from None
    values = []
    for node in tree.body:
        source = f"{path} line {node.lineno}"
        if isinstance(node, ast.Expr) and isinstance(node.value, ast.Constant) and isinstance(node.value.value, str):
            continue  # a docstring
        if not (isinstance(node, ast.Assign) and len(node.targets) == 1 and isinstance(node.targets[0], ast.Name)):
            raise UserError(f"{source}: only `name = <literal>` lines are allowed in a preset, got "
                            f"{ast.get_source_segment(text, node)!r}")
        try:
            values.append((node.targets[0].id, ast.literal_eval(node.value), source))
        except ValueError:
            raise UserError(f"{source}: {ast.get_source_segment(text, node.value)!r} is not a literal "
                            f"(write the value itself, e.g. 256, not 8 * 32)") from None
    return values


def near_preset(path):
    """The existing preset a missing path most likely means, or None."""
    if found := next((path + ext for ext in (".py", ".json") if os.path.isfile(path + ext)), None):
        return found
    files = {}  # name: its path, the path's own folder first
    for folder in dict.fromkeys([os.path.dirname(path), os.path.relpath(os.path.join(REPO, "config"))]):
        for name in sorted(os.listdir(folder)) if folder and os.path.isdir(folder) else ():
            if name.endswith((".py", ".json")):
                files.setdefault(name, os.path.normpath(os.path.join(folder, name)))
    wanted = os.path.basename(path if path.endswith((".py", ".json")) else path + ".py")
    close = difflib.get_close_matches(wanted, files, n=1)
    return files[close[0]] if close else None


def print_help(usage, settings):
    """A reader that stops early (`--help | head`) is not an error."""
    try:
        print("\n\n".join(text.strip() for text in (usage, COMMAND_LINE, settings) if text), flush=True)
    except BrokenPipeError:
        os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())  # Python's flush at exit would fail again


class DiskFull(UserError):  # no space left, or the quota used up: what was saved is intact
    pass


def disk_full(path, error):
    """The DiskFull an OSError from writing `path` is when the disk or quota is full, else None."""
    if error.errno not in (errno.ENOSPC, errno.EDQUOT, errno.EFBIG):
        return None
    folder = os.path.dirname(os.path.abspath(path))
    free = shutil.disk_usage(folder).free if os.path.isdir(folder) else 0
    return DiskFull(f"cannot write {path}: {error.strerror} ({free / 1e6:.0f} MB free in {folder})")


@contextlib.contextmanager
def atomic_write(path, mode="w"):
    """A temp file beside `path`, fsync'd and renamed over it: a crash or a full disk never leaves half a file."""
    tmp = f"{path}.tmp{os.getpid()}"  # the writer's pid: see run_folder.left_by_a_dead_process
    text = {} if "b" in mode else {"encoding": "utf-8", "newline": ""}
    try:
        with open(tmp, mode, **text) as f:
            yield f
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
    except BaseException as e:
        with contextlib.suppress(OSError):
            os.remove(tmp)
        if full := isinstance(e, OSError) and disk_full(path, e):
            raise full from None
        raise
