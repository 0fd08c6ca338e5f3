"""The one way this project writes a file: into a temp file next to it, fsync'd, then renamed over it, so a crash
or a full disk never leaves a half-written file under the real name. And what a file given as a CSV holds
(csv_content): a CSV, a compressed CSV, or something else, said in one line."""
import bz2
import contextlib
import errno
import gzip
import io
import json
import lzma
import os
import shlex
import shutil
import zipfile
import zlib

from summarizer.errors import DiskFull, UserError


def disk_full(path, error):
    """The DiskFull that an OSError from writing `path` is when the disk is full (a quota, a file size limit): one
    line that names the file and the space left, instead of a traceback; None for another error."""
    if error.errno not in (errno.ENOSPC, errno.EDQUOT, errno.EFBIG):
        return None
    folder = os.path.dirname(os.path.abspath(path))
    free = shutil.disk_usage(folder).free if os.path.isdir(folder) else 0
    return DiskFull(f"cannot write {path}: {error.strerror} ({free / 1e6:.0f} MB free in {folder})")


@contextlib.contextmanager
def atomic_write(path, mode="w"):
    """`with atomic_write(path) as f:` writes f to `path` atomically; on any error the temp file is removed and
    `path` keeps what it held. Text mode is UTF-8 with newlines written as given (CSV writers pick their own)."""
    tmp = f"{path}.tmp{os.getpid()}"
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
        full = isinstance(e, OSError) and disk_full(path, e)
        if full:
            raise full from None
        raise


@contextlib.contextmanager
def no_empty_folder_left(*paths):
    """Run the body; if it fails, remove those of `paths` (deepest first) that did not exist before and are empty
    now, so a failed command leaves no empty out_dir behind. A folder with anything in it is never removed."""
    new = [path for path in paths if path and not os.path.exists(path)]
    try:
        yield
    except BaseException:
        for path in sorted(new, key=len, reverse=True):
            with contextlib.suppress(OSError):
                os.rmdir(path)
        raise


# ---- what a file holds, by its first bytes --------------------------------------------------------------------

# (first bytes, what a file that starts with them is, how to make a CSV of it). In a hint, {src} is the file
# (!r for Python, {src_sh} for a shell), {dst} the CSV to write, {key} the setting that named the file.
CONVERT = "convert it: pandas.{reader}({{src!r}}{args}).to_csv({{dst!r}}, index=False), then pass --{{key}}={{dst}}"
NOT_CSV = (
    (b"PAR1", "a Parquet file", CONVERT.format(reader="read_parquet", args="")),
    (b"ARROW1", "an Arrow (Feather) file", CONVERT.format(reader="read_feather", args="")),
    (b"\xd0\xcf\x11\xe0\xa1\xb1\x1a\xe1", "an Excel workbook (.xls)", CONVERT.format(reader="read_excel", args="")),
    (b"\x89HDF\r\n\x1a\n", "an HDF5 file", CONVERT.format(reader="read_hdf", args="")),
    (b"SQLite format 3\x00", "an SQLite database",
     "export a table: sqlite3 -header -csv {src_sh} 'SELECT * FROM <table>' > {dst_sh}, then pass --{key}={dst}"),
    (b"\x93NUMPY", "a NumPy array (.npy)", "save the rows as a CSV with a header row and pass --{key}=<it>"),
    (b"%PDF-", "a PDF document", "pass the CSV file the data comes in as --{key}=<it>"),
    (b"\x28\xb5\x2f\xfd", "a zstd-compressed file", "decompress it: zstd -d {src_sh} -o {dst_sh}, then pass "
                                                     "--{key}={dst}"),
    (b"7z\xbc\xaf\x27\x1c", "a 7z archive", "extract it: 7z x {src_sh} -o{dir_sh}, then pass the .csv inside as "
                                            "--{key}=<it>"),
    (b"Rar!\x1a\x07", "a RAR archive", "extract it: unrar x {src_sh} {dir_sh}/, then pass the .csv inside as "
                                       "--{key}=<it>"),
    (b"version https://git-lfs", "a Git LFS pointer file", "fetch the CSV it points to (git lfs pull) or download "
                                                           "it again"),
)
TAR = ("a tar archive", "extract it: tar -xf {src_sh} -C {dir_sh}, then pass the .csv inside as --{key}=<it>")
ZIP = b"PK\x03\x04", b"PK\x05\x06"  # a zip's first entry, or the end of an empty zip
COMPRESSED = {b"\x1f\x8b": ("gzip", gzip.decompress, "gunzip -c"), b"BZh": ("bzip2", bz2.decompress, "bunzip2 -c"),
              b"\xfd7zXZ\x00": ("xz", lzma.decompress, "unxz -c")}
COMPRESSED_SUFFIXES = (".gz", ".gzip", ".bz2", ".xz", ".zip")


def csv_content(raw, path, key):
    """The bytes of the CSV that a file of bytes `raw` holds: `raw` itself, or what it decompresses to (gzip,
    bzip2, xz, a zip of one file); or UserError in one line saying what the file is, if not a CSV, and how to make
    a CSV of it. `key` is the setting that named the file (train_csv, ...)."""
    unpacked = unpack(raw, path, key)
    if unpacked is None:
        found = not_csv(raw)
        if found:
            what, hint = found
            raise UserError(f"{key} {path} is {what}, not a CSV: {fill(hint, path, key)}")
        return raw
    container, inner, inner_path, command = unpacked
    found = not_csv(inner)
    if found:
        what, hint = found
        if what == TAR[0]:  # tar unpacks compressed archives itself
            raise UserError(f"{key} {path} is {container} holding {what}, not a CSV: {fill(hint, path, key)}")
        raise UserError(f"{key} {path} is {container} holding {what}, not a CSV: {command}, then "
                        f"{fill(hint, inner_path, key)}")
    return inner


def unpack(raw, path, key):
    """(what the container is, the bytes it holds, where unpacking puts them, the command that does) for a
    compressed file or a zip of one file, None for another file; UserError for a damaged or ambiguous one."""
    folder = os.path.dirname(path) or "."
    for magic, (name, decompress, tool) in COMPRESSED.items():
        if raw.startswith(magic):
            try:
                inner = decompress(raw)
            except (OSError, EOFError, ValueError, lzma.LZMAError, zlib.error) as e:
                raise UserError(f"{key} {path} is a damaged {name} file ({e}): download or compress it "
                                f"again") from None
            out = plain_name(path)
            command = f"decompress it: {tool} {shlex.quote(path)} > {shlex.quote(out)}"
            return f"a {name}-compressed file", inner, out, command
    if not raw.startswith(ZIP):
        return None
    unzip = f"unzip -d {shlex.quote(folder)} {shlex.quote(path)}"
    try:
        with zipfile.ZipFile(io.BytesIO(raw)) as archive:
            names = [i.filename for i in archive.infolist() if not i.is_dir()
                     and not i.filename.startswith("__MACOSX/") and os.path.basename(i.filename) != ".DS_Store"]
            if "xl/workbook.xml" in names:
                raise UserError(f"{key} {path} is an Excel workbook (.xlsx), not a CSV: "
                                f"{fill(CONVERT.format(reader='read_excel', args=''), path, key)}")
            if not names:
                raise UserError(f"{key} {path} is an empty zip archive, not a CSV: pass the CSV as --{key}=<it>")
            if len(names) > 1:
                listed = ", ".join(names[:5]) + (", ..." if len(names) > 5 else "")
                raise UserError(f"{key} {path} is a zip archive of {len(names)} files ({listed}), not a CSV: unzip "
                                f"it ({unzip}) and pass the .csv you mean as --{key}=<it>")
            inner = archive.read(names[0])
    except zipfile.BadZipFile as e:
        raise UserError(f"{key} {path} is a damaged zip archive ({e}): download or zip it again") from None
    except (RuntimeError, NotImplementedError, zlib.error) as e:  # encrypted, or a method zipfile cannot read
        raise UserError(f"{key} {path} is a zip archive this program cannot open ({e}): unzip it ({unzip}) and "
                        f"pass the .csv inside as --{key}=<it>") from None
    return "a zip archive", inner, os.path.join(folder, names[0]), f"unzip it ({unzip})"


def not_csv(raw):
    """(what the file is, how to make a CSV of it) when its first bytes say it is not a CSV; else None."""
    for magic, what, hint in NOT_CSV:
        if raw.startswith(magic):
            return what, hint
    if raw[257:262] == b"ustar":
        return TAR
    if raw.startswith(ZIP):
        return "a zip archive", "unzip it: unzip -d {dir_sh} {src_sh}, then pass the .csv inside as --{key}=<it>"
    text = raw[:4096].removeprefix(b"\xef\xbb\xbf").lstrip().lower()
    if text.startswith((b"<!doctype html", b"<html")):
        return ("an HTML page (a download that saved the web page instead of the file?)",
                "download the CSV file itself and pass --{key}=<it>")
    if text.startswith(b"<?xml"):
        return "an XML file", CONVERT.format(reader="read_xml", args="")
    if text[:1] in (b"{", b"["):
        lines = ", lines=True" if json_lines(raw) else ""
        return f"JSON{' Lines' if lines else ''}", CONVERT.format(reader="read_json", args=lines)
    return None


def json_lines(raw):
    """Whether JSON-looking bytes are JSON Lines (one value a line) rather than one JSON document."""
    text = raw.decode("utf-8-sig", errors="replace").strip()
    try:
        json.loads(text)
        return False
    except ValueError:
        first = text.partition("\n")[0]
        try:
            json.loads(first)
            return True
        except ValueError:
            return False


def without_compression(path):
    """`path` without its compression suffix (.gz, .bz2, .xz, .zip), if it has one."""
    stem, suffix = os.path.splitext(path)
    return stem if suffix.lower() in COMPRESSED_SUFFIXES else path


def plain_name(path):
    """Where decompressing `path` writes: `path` without its compression suffix, or path + '.out'."""
    plain = without_compression(path)
    return plain if plain != path else f"{path}.out"


def fill(hint, path, key):
    """A NOT_CSV hint for the file at `path`: the CSV to write is named after it."""
    stem = os.path.splitext(without_compression(path))[0]
    dst = f"{stem}.csv" if f"{stem}.csv" != path else f"{stem}-converted.csv"
    return hint.format(src=path, src_sh=shlex.quote(path), dst=dst, dst_sh=shlex.quote(dst), key=key,
                       dir_sh=shlex.quote(os.path.dirname(path) or "."))
