"""Prompt files in, result files out.

Prompt files: JSONL with `prompt` (or Spec-Bench style `turns`, whose first turn is used) and an
optional `id` (`question_id` is taken too); `.csv` with a header row naming a `prompt` column and
optionally an `id` column (cells may span lines when quoted); or plain text with one prompt per line.

Files are read strictly: UTF-8 (a byte-order mark is dropped), lines split on \n only, a `.jsonl`
file is JSON objects, result lines are checked before a resume trusts them. Output paths are
checked before anything runs (check_output_path): never a prompt file, a symlink or a device.

Result files: JSONL, one line per request. Each line is written and flushed as soon as its request
finishes (completion order), so an interrupted run keeps everything it finished; at the end the
file is rewritten in input order (atomically). `--resume` reads the lines already there, skips
those requests and writes the union in input order.
"""
from __future__ import annotations

import errno
import json
import os
import stat
import tempfile
from pathlib import Path

from .errors import SpecbatchError


class InputError(SpecbatchError):
    """A problem with an input file or an output path; the message names the file and line."""


class OutputError(SpecbatchError):
    """Writing results failed (a full disk, a lost folder); what was flushed before stays readable."""


def _refuse_constant(name: str):
    raise ValueError(f"{name} is not a JSON number")


def _check_strings(value, where: str):
    """Refuse lone surrogates (a JSON escape such as \\ud800 decodes to one, which no UTF-8 file holds)."""
    stack = [value]
    while stack:
        item = stack.pop()
        if isinstance(item, str):
            try:
                item.encode("utf-8")
            except UnicodeEncodeError:
                raise InputError(f"{where}: a string holds a lone surrogate (an escape such as \\ud800 with no pair)"
                                 ) from None
        elif isinstance(item, dict):
            stack.extend(item.keys())
            stack.extend(item.values())
        elif isinstance(item, list):
            stack.extend(item)


def loads_strict(text: str, where: str):
    """One JSON value from `text`, or an InputError naming `where` (file:line) and the problem:
    malformed JSON, nesting deeper than Python's recursion limit, NaN or Infinity, an integer of
    more than 4,300 digits, a lone surrogate. Every JSON and JSONL input of specbatch is read here."""
    try:
        value = json.loads(text, parse_constant=_refuse_constant)
    except json.JSONDecodeError as e:
        raise InputError(f"{where}: malformed JSON ({e.msg} at column {e.colno})") from None
    except RecursionError:
        raise InputError(f"{where}: JSON nested too deeply to read") from None
    except ValueError as e:  # NaN / Infinity, an integer past Python's digit limit
        raise InputError(f"{where}: {str(e).split(';')[0]}") from None
    _check_strings(value, where)
    return value


def check_input_file(path, what: str) -> Path:
    """A regular file to read: a FIFO, a device or a folder is refused (reading one could wait forever)."""
    path = Path(path)
    if not path.exists():
        raise InputError(f"no such {what}: {path}")
    if path.is_dir():
        raise InputError(f"{what} {path} is a folder, not a file")
    if not path.is_file():
        raise InputError(f"{what} {path} is not a regular file (a FIFO, device or socket); refusing to read it")
    return path


def text_lines(path: Path, what: str) -> list[str]:
    """The file's lines, split on \n only (a U+2028 or a form feed inside a line stays in it), a
    UTF-8 byte-order mark dropped, \r\n line ends accepted. Only regular files are read."""
    path = check_input_file(path, what)
    try:
        text = path.read_bytes().decode("utf-8-sig")
    except UnicodeDecodeError as e:
        raise InputError(f"{path}: not a UTF-8 text {what} (byte {e.start} cannot be decoded)") from None
    except OSError as e:
        raise InputError(f"cannot read {what} {path}: {e.strerror}") from None
    return [line[:-1] if line.endswith("\r") else line for line in text.split("\n")]


def json_objects(path, what: str) -> list[tuple[int, dict]]:
    """[(line number, object)] of a JSONL file, blank lines skipped: every line read by loads_strict
    and required to be a JSON object, or an InputError naming the file and line."""
    out = []
    for n, line in enumerate(text_lines(Path(path), what), 1):
        if not line.strip():
            continue
        obj = loads_strict(line, f"{path}:{n}")
        if not isinstance(obj, dict):
            raise InputError(f"{path}:{n}: expected a JSON object, got {type(obj).__name__}")
        out.append((n, obj))
    return out


def read_prompts(path) -> list[tuple[str, str]]:
    """[(id, text)] in file order. A `.jsonl` (or `.json`) file must hold one JSON object per line;
    other files are JSONL when their first line starts with "{", else plain text, one prompt per line."""
    path = Path(path)
    if path.suffix.lower() in (".tsv", ".parquet", ".xlsx", ".xls", ".arrow"):
        raise InputError(f"{path}: {path.suffix} prompt files are not read; use JSONL, CSV (a 'prompt' column) or "
                         "plain text")
    lines = text_lines(path, "prompt file")
    numbered = [(n, line) for n, line in enumerate(lines, 1) if line.strip()]
    if not numbered:
        raise InputError(f"{path}: the prompt file is empty")
    if path.suffix.lower() == ".csv":
        return _csv_prompts(path, "\n".join(lines))
    is_jsonl = path.suffix.lower() in (".jsonl", ".json") or numbered[0][1].lstrip().startswith("{")
    if not is_jsonl:
        return [(str(i), line) for i, (_, line) in enumerate(numbered)]
    prompts = []
    for i, (n, line) in enumerate(numbered):
        obj = loads_strict(line, f"{path}:{n}")
        if not isinstance(obj, dict):
            raise InputError(f"{path}:{n}: expected a JSON object with a 'prompt' field")
        if isinstance(obj.get("prompt"), str):
            text = obj["prompt"]
        elif isinstance(obj.get("turns"), list) and obj["turns"] and isinstance(obj["turns"][0], str):
            text = obj["turns"][0]
        else:
            raise InputError(f"{path}:{n}: no 'prompt' string (or 'turns' list) in this line")
        ident = obj.get("id", obj.get("question_id", i))
        if not isinstance(ident, (str, int)) or isinstance(ident, bool):
            raise InputError(f"{path}:{n}: 'id' must be a string or an integer, got {ident!r}")
        prompts.append((str(ident), text))
    ids = [p[0] for p in prompts]
    if len(set(ids)) != len(ids):
        dup = next(x for x in ids if ids.count(x) > 1)
        raise InputError(f"{path}: id {dup!r} appears more than once")
    return prompts


def _csv_prompts(path: Path, text: str) -> list[tuple[str, str]]:
    """A CSV prompt file: a header row naming a 'prompt' column and optionally an 'id' column."""
    import csv
    import io
    try:
        rows = list(csv.reader(io.StringIO(text, newline=""), strict=True))
    except csv.Error as e:
        raise InputError(f"{path}: not a readable CSV file ({e})") from None
    rows = [r for r in rows if any(cell.strip() for cell in r)]
    header = [cell.strip().lower() for cell in rows[0]]
    if "prompt" not in header:
        raise InputError(f"{path}: a CSV prompt file needs a header row with a 'prompt' column (and optionally 'id'); "
                         f"its first row is {rows[0][:4]!r}")
    at, id_at = header.index("prompt"), header.index("id") if "id" in header else None
    prompts = []
    for n, row in enumerate(rows[1:], 2):
        if len(row) != len(header):
            raise InputError(f"{path}: row {n} has {len(row)} fields, the header {len(header)}")
        prompts.append((row[id_at] if id_at is not None else str(n - 2), row[at]))
    if not prompts:
        raise InputError(f"{path}: the CSV prompt file has a header and no prompts")
    ids = [p[0] for p in prompts]
    if len(set(ids)) != len(ids):
        raise InputError(f"{path}: id {next(x for x in ids if ids.count(x) > 1)!r} appears more than once")
    return prompts


def read_done(path, known_ids=None, field: str = "token_ids") -> dict:
    """Results already in an output file, by id, each checked: a JSON object with a known `id` and
    `token_ids` (a list of integers; field="sequences": a list of such lists). A torn last line (a
    crash mid-write: no final newline) is ignored; anything else malformed is an InputError, and so
    is an id the prompt file does not have (resuming would drop that result)."""
    path = Path(path)
    done = {}
    if not path.exists():
        return done
    if not path.is_file():
        raise InputError(f"{path}: not a regular file")
    lines = text_lines(path, "results file")
    last = len(lines) - 1  # after the final newline: "" (complete file) or a torn line
    known = None if known_ids is None else set(known_ids)
    for n, line in enumerate(lines, 1):
        if not line.strip():
            continue
        try:
            obj = loads_strict(line, f"{path}:{n}")
        except InputError as e:
            if n - 1 == last and "malformed JSON" in str(e):
                continue  # the torn last line of an interrupted run
            raise InputError(f"{e}; fix or remove the line to resume") from None
        if not isinstance(obj, dict) or not isinstance(obj.get("id"), (str, int)) or isinstance(obj.get("id"), bool):
            raise InputError(f"{path}:{n}: a result line must be a JSON object with an 'id'")
        lists = obj.get(field) if field == "sequences" else [obj.get(field)]
        if not isinstance(lists, list) or not all(_is_id_list(tokens) for tokens in lists):
            raise InputError(f"{path}:{n}: result {obj['id']!r} has no {field!r} list of integers; remove the "
                             "line to generate it again")
        ident = str(obj["id"])
        if known is not None and ident not in known:
            raise InputError(f"{path}:{n}: result id {ident!r} is not in the prompt file; refusing to resume "
                             "(the result would be lost): use the prompt file it came from, or another --out")
        if ident in done:
            raise InputError(f"{path}:{n}: result id {ident!r} appears twice")
        done[ident] = obj
    return done


def _is_id_list(tokens) -> bool:
    return isinstance(tokens, list) and all(isinstance(t, int) and not isinstance(t, bool) for t in tokens)


def check_output_path(path, what: str, others: dict) -> Path:
    """Refuse an output path that is not ours to replace: an existing directory, device, FIFO or
    socket, a symlink, or the same file as another input or output (`others`: {role: path}).
    Its folder must exist and be writable. Checked before any model is loaded."""
    path = Path(path)
    if path.is_symlink():
        raise InputError(f"{what} {path} is a symlink; give the path of a regular file (it would be replaced)")
    if path.exists():
        if path.is_dir():
            raise InputError(f"{what} {path} is a directory")
        if not path.is_file():
            raise InputError(f"{what} {path} is not a regular file (a device, FIFO or socket); refusing to write it")
    for role, other in others.items():
        if other is None:
            continue
        other = Path(other)
        same = os.path.abspath(path) == os.path.abspath(other) or (
            path.exists() and other.exists() and os.path.samefile(path, other))
        if same:
            raise InputError(f"{what} {path} is the same file as {role}; it would be overwritten")
    folder = path.parent if str(path.parent) else Path(".")
    if not folder.is_dir():
        raise InputError(f"{what} {path}: folder {folder} does not exist")
    if not os.access(folder, os.W_OK | os.X_OK) or (path.exists() and not os.access(path, os.W_OK)):
        raise InputError(f"{what} {path}: not writable")
    return path


def check_not_replacing(path, resume: bool, overwrite: bool, what: str = "--out") -> bool:
    """Nothing is replaced unless asked: an existing non-empty `path` needs --resume (keep it) or
    --overwrite (replace it), and not both. Returns whether `path` holds results now."""
    if resume and overwrite:
        raise InputError("--resume keeps what is in --out and --overwrite replaces it: give one of them")
    path = Path(path)
    holds = path.is_file() and path.stat().st_size > 0
    if holds and not resume and not overwrite:
        raise InputError(f"{what} {path} already holds results; pass --resume to keep them and add only what is "
                         "missing, or --overwrite to replace it")
    return holds


# ---------------------------------------------------------------- writing files we own

def open_for_writing(path, append: bool = False):
    """A text file opened to write `path` itself: never through a symlink, never a FIFO, device or
    folder (OutputError in one line instead). append=False truncates a regular file; every file
    specbatch writes in place is opened here."""
    path = Path(path)
    flags = os.O_WRONLY | os.O_CREAT | os.O_NOFOLLOW | os.O_NONBLOCK | (os.O_APPEND if append else 0)
    try:
        fd = os.open(path, flags, 0o644)
    except OSError as e:
        reason = {errno.ELOOP: "is a symlink", errno.EISDIR: "is a directory",
                  errno.ENXIO: "is a FIFO with no reader"}.get(e.errno, e.strerror)
        raise OutputError(f"cannot write {path}: it {reason}; refusing to write through it" if e.errno in
                          (errno.ELOOP, errno.EISDIR, errno.ENXIO) else f"cannot write {path}: {reason}") from None
    if not stat.S_ISREG(os.fstat(fd).st_mode):
        os.close(fd)
        raise OutputError(f"cannot write {path}: it is not a regular file (a FIFO, device or socket)")
    os.set_blocking(fd, True)
    if not append:
        os.ftruncate(fd, 0)
    return os.fdopen(fd, "w", encoding="utf-8")


def replace_atomically(path, lines) -> None:
    """Write `lines` to a new temporary file in path's folder (created exclusively, with a unique
    name: nothing already there is followed or reused), fsync it and rename it over `path`."""
    path = Path(path)
    fd, tmp = tempfile.mkstemp(dir=path.parent if str(path.parent) else ".", prefix=f".{path.name}.", suffix=".tmp")
    try:
        with os.fdopen(fd, "w", encoding="utf-8") as f:
            f.writelines(lines)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise


class OutputLock:
    """Holds `OUT.lock` so that a second run on the same --out is refused in one line. Each rank locks
    its own byte of the file (POSIX record locks, released by the OS on exit, also on SIGKILL), so
    the ranks of one torchrun run do not block each other and any rank of a second run is refused."""

    def __init__(self, out, rank: int = 0):
        import fcntl
        self.path = Path(f"{out}.lock")
        self.file = open_for_writing(self.path, append=True)
        try:
            fcntl.lockf(self.file.fileno(), fcntl.LOCK_EX | fcntl.LOCK_NB, 1, rank)
        except OSError:
            self.file.close()
            raise InputError(f"--out {out} is in use by another specbatch run (it holds {self.path}); wait for it "
                             "to finish or choose another --out") from None

    def release(self) -> None:
        self.file.close()


class ResultWriter:
    """Appends one flushed line per finished request; `finish` rewrites the file in input order."""

    def __init__(self, path, order: list[str], previous: dict, append: bool = False):
        """previous: results already on disk (kept: the file is rewritten with them first).
        append: add to the file as it is (a part file of a torchrun run: never truncated; a torn
        last line, which holds no complete result, is cut first)."""
        self.path, self.order, self.results = Path(path), order, dict(previous)
        if append:
            self.file = open_for_writing(self.path, append=True)
            _cut_torn_tail(self.path, self.file)
            return
        if previous:  # start from a clean file (a crash may have torn the last line)
            self._rewrite()
        self.file = open_for_writing(self.path, append=bool(previous))

    def add(self, record: dict) -> None:
        self.results[record["id"]] = record
        try:
            self.file.write(json.dumps(record) + "\n")
            self.file.flush()
            os.fsync(self.file.fileno())
        except OSError as e:
            raise OutputError(f"cannot write results to {self.path}: {e.strerror}; the results written before "
                              "stay there (run again with --resume)") from None

    def finish(self) -> None:
        try:
            self.file.close()
        except OSError:
            pass  # the last line may be torn: read_done ignores it, --resume regenerates it
        self._rewrite()

    def _rewrite(self) -> None:
        """Input order, written beside the file and renamed over it: a failure leaves the old file."""
        try:
            replace_atomically(self.path, [json.dumps(self.results[ident]) + "\n" for ident in self.order
                                           if ident in self.results])
        except OSError as e:
            raise OutputError(f"cannot rewrite {self.path} in input order: {e.strerror}; its results (in completion "
                              "order) stay readable, and --resume completes them") from None


def _cut_torn_tail(path: Path, file) -> None:
    """Drop a last line without its newline (a write killed midway holds no complete result)."""
    data = path.read_bytes()
    if data and not data.endswith(b"\n"):
        file.flush()
        os.truncate(path, data.rfind(b"\n") + 1)
