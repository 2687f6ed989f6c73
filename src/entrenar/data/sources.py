"""Read training records from files: JSONL, JSON, CSV, Parquet, plain text, or folders of them.

A record is a dict of fields plus where it came from (file and line or row),
so every later error can name the place to fix. Formats:

- ``.jsonl``/``.ndjson``: one JSON object per line (blank lines ignored).
- ``.json``: a list of objects, or ``{"data": [...]}``. A ``.json`` file that
  holds one object per line is read as JSONL, since many datasets are named so.
- ``.csv``: a header row, then one record per row (all values are strings; a field may be of any length).
- ``.parquet``: one record per row (needs ``pyarrow``: ``pip install entrenar[parquet]``).
- ``.txt``/``.md``: the whole file is one ``{"text": ...}`` record.
- a folder: every file of a known format below it, in sorted path order.
- ``.db``/``.sqlite``/``.sqlite3``: the rows of ``query`` (:mod:`entrenar.io.sqlite`; not read from folders).
- ``synth:KIND:N[:SEED]``: generated records (:mod:`entrenar.data.synth`), ``seed`` when none is named.
"""

from __future__ import annotations

import csv
import json
import re
import sys
from collections.abc import Iterator, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from entrenar.data import synth
from entrenar.data.synth import is_synth
from entrenar.errors import ConfigError, DataError
from entrenar.io.sqlite import is_sqlite, read_sqlite

FORMATS = ("auto", "jsonl", "json", "csv", "parquet", "text")
_EXTENSIONS = {
    ".jsonl": "jsonl", ".ndjson": "jsonl", ".json": "json", ".csv": "csv",
    ".parquet": "parquet", ".txt": "text", ".md": "text",
}
_MAX_REPORTED = 10
# The csv module's default field limit (131,072 characters) refuses long texts; C long is 32-bit on Windows.
_CSV_FIELD_LIMIT = 2**31 - 1
_DEEP = 100  # a nesting depth no record needs, used to point at where a too-deeply nested document goes wrong


@dataclass(frozen=True)
class Record:
    """One record: its fields, the file it came from and where in it (``"line 17"``, ``"row 3"``, or ``""``)."""

    fields: dict[str, Any]
    file: str
    location: str = ""

    @property
    def where(self) -> str:
        return f"{self.file} {self.location}" if self.location else self.file


@dataclass(frozen=True)
class Skip:
    """A skipped record: where it was, a short ``reason`` (what notes count by) and the full ``message``."""

    file: str
    location: str
    reason: str
    message: str

    @property
    def line(self) -> int | None:
        """The 1-based line the record starts on, where the format has lines."""
        found = re.search(r"line (\d+)", self.location)
        return int(found.group(1)) if found else None

    def to_json(self) -> dict[str, Any]:
        return {"file": self.file, "line": self.line, "location": self.location, "reason": self.reason,
                "message": self.message}


@dataclass
class ReadStats:
    """What reading found: files read, records kept, records skipped (every one, with where and why)."""

    files: list[str] = field(default_factory=list)
    records: int = 0
    skipped: int = 0
    skip_reasons: list[str] = field(default_factory=list)  # the first few messages
    skipped_records: list[Skip] = field(default_factory=list)

    def skip(self, bad: Skip) -> None:
        self.skipped += 1
        self.skipped_records.append(bad)
        if len(self.skip_reasons) < _MAX_REPORTED:
            self.skip_reasons.append(bad.message)


def _bad(path: Path, location: str, reason: str, detail: str) -> Skip:
    """A malformed record, yielded by the file readers; ``read_records`` raises or skips it."""
    return Skip(str(path), location, reason, f"{path}{' ' + location if location else ''}: {detail}")


def read_records(
    paths: str | Path | Sequence[str | Path],
    format: str = "auto",
    on_error: str = "raise",
    seed: int = 0,
    query: str | None = None,
    attach: Mapping[str, str] | None = None,
) -> tuple[list[Record], ReadStats]:
    """Read every record of ``paths`` (files or folders).

    ``format="auto"`` picks the reader from each file's extension. With
    ``on_error="skip"`` malformed records are skipped and counted in the
    returned stats; with ``"raise"`` the first one raises ``DataError``.
    Missing files, unreadable files and an empty result raise ``DataError``.
    ``seed`` draws ``synth:`` sources that name no seed; ``query`` is the SELECT of SQLite files,
    run with ``attach``'s files (``{schema: file}``) attached.
    """
    if format not in FORMATS:
        raise ConfigError(f"data format {format!r} is not one of {', '.join(FORMATS)}")
    if on_error not in ("raise", "skip"):
        raise ConfigError(f"on_error {on_error!r} must be 'raise' or 'skip'")
    if isinstance(paths, (str, Path)):
        paths = [paths]
    if not paths:
        raise DataError("no data files given")

    stats = ReadStats()
    records: list[Record] = []
    for file, file_format in _expand(paths, format):
        stats.files.append(str(file))
        try:
            for item in _read_file(file, file_format, seed, query, attach):
                if isinstance(item, Skip):
                    if on_error == "raise":
                        raise DataError(item.message)
                    stats.skip(item)
                else:
                    records.append(item)
        except OSError as e:
            raise DataError(f"{file}: cannot be read: {e.strerror or e}") from e
    stats.records = len(records)
    if not records:
        names = ", ".join(stats.files)
        if stats.skipped:
            names += f" ({stats.skipped} malformed records skipped; first: {stats.skip_reasons[0]})"
        raise DataError(f"no records in {names}")
    return records, stats


def _expand(paths: Sequence[str | Path], format: str) -> list[tuple[Path, str]]:
    """Files to read with their formats; folders are walked in sorted order."""
    files: list[tuple[Path, str]] = []
    for path in map(Path, paths):
        if is_synth(path):  # a generated source, not a file
            files.append((path, "synth"))
        elif path.is_dir():
            found = [
                (f, _format_of(f, format)) for f in sorted(path.rglob("*"))
                if f.is_file() and not any(p.startswith(".") for p in f.relative_to(path).parts)
                and f.suffix.lower() in _EXTENSIONS
                and format in ("auto", _EXTENSIONS[f.suffix.lower()])
            ]
            if not found:
                kinds = ", ".join(sorted(_EXTENSIONS)) if format == "auto" else f"{format} files"
                raise DataError(f"{path}: folder holds no data files ({kinds})")
            files.extend(found)
        elif path.is_file():
            files.append((path, _format_of(path, format)))
        else:
            raise DataError(f"{path}: no such file or folder")
    return files


def _format_of(path: Path, format: str) -> str:
    if format != "auto":
        return format
    if is_sqlite(path):
        return "sqlite"
    try:
        return _EXTENSIONS[path.suffix.lower()]
    except KeyError:
        raise DataError(
            f"{path}: cannot tell the format from extension {path.suffix!r}; "
            f"name it one of {', '.join(sorted(_EXTENSIONS))} or set the format"
        ) from None


def _read_file(path: Path, format: str, seed: int = 0, query: str | None = None,
               attach: Mapping[str, str] | None = None) -> Iterator[Record | Skip]:
    if format == "synth":
        return _read_synth(str(path), seed)
    if format == "sqlite":
        return (Record(fields, str(path), location) for location, fields in read_sqlite(path, query, attach))
    readers = {"jsonl": _read_jsonl, "json": _read_json, "csv": _read_csv, "parquet": _read_parquet, "text": _read_text}
    return readers[format](path)


def _read_synth(source: str, seed: int) -> Iterator[Record | Skip]:
    for index, fields in synth.records(synth.parse(source), seed):
        yield Record(fields, source, f"record {index}")


def _object_or_bad(value: Any, path: Path, location: str) -> dict[str, Any] | Skip:
    if isinstance(value, dict):
        return value
    return _bad(path, location, "not an object", f"expected a JSON object, got {type(value).__name__}")


def _json_problem(error: Exception) -> tuple[str, str]:
    """(reason, detail) of a JSON text that ``json`` refuses: a syntax error, Python's limits on nesting
    (its recursion limit) and on integer digits (``sys.get_int_max_str_digits``)."""
    if isinstance(error, json.JSONDecodeError):
        return "invalid JSON", f"invalid JSON: {error.msg} (column {error.colno})"
    if isinstance(error, RecursionError):
        return "nested too deeply", "invalid JSON: nested too deeply to read"
    if "integer string conversion" in str(error):
        return "number too long", f"invalid JSON: an integer longer than {sys.get_int_max_str_digits()} digits"
    return "invalid JSON", f"invalid JSON: {error}"


def _read_jsonl(path: Path) -> Iterator[Record | Skip]:
    with open(path, "rb") as f:
        for number, raw in enumerate(f, start=1):
            location = f"line {number}"
            try:
                line = raw.decode("utf-8-sig" if number == 1 else "utf-8")
            except UnicodeDecodeError as e:
                yield _bad(path, location, "not UTF-8", f"not UTF-8 text: {e}")
                continue
            if not line.strip():
                continue
            if line.startswith("\ufeff"):  # the start of a file's line 1 is stripped above: this one was joined on
                yield _bad(path, location, "byte-order mark", "a byte-order mark (U+FEFF) starts the line, which "
                           "belongs only at the start of a file: files joined together?")
                continue
            try:
                value = json.loads(line.rstrip("\r\n"))  # an error's column counts within the line
            except (ValueError, RecursionError) as e:
                yield _bad(path, location, *_json_problem(e))
                continue
            obj = _object_or_bad(value, path, location)
            yield obj if isinstance(obj, Skip) else Record(obj, str(path), location)


def _read_text_file(path: Path) -> str:
    try:
        return path.read_text(encoding="utf-8-sig")
    except UnicodeDecodeError as e:
        raise DataError(f"{path}: not UTF-8 text: {e}") from e


def _read_json(path: Path) -> Iterator[Record | Skip]:
    text = _read_text_file(path)
    try:
        document = json.loads(text)
    except json.JSONDecodeError as e:
        if e.msg == "Extra data":  # several top-level values: the file is really JSON Lines
            yield from _read_jsonl(path)
            return
        raise DataError(f"{path} line {e.lineno}: invalid JSON: {e.msg} (column {e.colno})") from e
    except (ValueError, RecursionError) as e:  # one document: a record that breaks it breaks the file
        line = _problem_line(text, e)
        raise DataError(f"{path}{f' line {line}' if line else ''}: {_json_problem(e)[1]}") from None
    if isinstance(document, dict) and isinstance(document.get("data"), list):
        items = document["data"]
    elif isinstance(document, list):
        items = document
    else:
        raise DataError(f"{path}: expected a list of objects or {{\"data\": [...]}}, got {type(document).__name__}"
                        + (f" with keys {sorted(document)[:5]}" if isinstance(document, dict) else ""))
    lines = _item_lines(text, len(items))
    for index, value in enumerate(items):
        location = f"item {index} (line {lines[index]})" if lines else f"item {index}"
        obj = _object_or_bad(value, path, location)
        yield obj if isinstance(obj, Skip) else Record(obj, str(path), location)


def _problem_line(text: str, error: Exception) -> int | None:
    """Where in a JSON text nesting first passes ``_DEEP`` levels, or the first integer too long to read."""
    if isinstance(error, RecursionError):
        depth, in_string, escaped = 0, False, False
        for i, char in enumerate(text):
            if in_string:
                in_string, escaped = (escaped or char != '"'), (not escaped and char == "\\")
            elif char == '"':
                in_string = True
            elif char in "[{":
                depth += 1
                if depth > _DEEP:
                    return text.count("\n", 0, i) + 1
            elif char in "]}":
                depth -= 1
        return None
    found = re.search(r"\d{%d,}" % (sys.get_int_max_str_digits() + 1), text)  # noqa: UP031 - braces of a regex
    return text.count("\n", 0, found.start()) + 1 if found else None


def _item_lines(text: str, count: int) -> list[int] | None:
    """Line where each item of the file's record list starts, found by scanning the JSON text.

    ``json`` gives no positions for parsed values, so the list (top level, or
    the value of ``"data"``) is walked with ``raw_decode``. Returns None if the
    layout is not the expected one (the caller then names items by index only).
    """
    decoder = json.JSONDecoder()
    reached, line = 0, 1  # lines are counted onward from the last item, not from the start each time

    def line_at(i: int) -> int:
        nonlocal reached, line
        line += text.count("\n", reached, i)
        reached = i
        return line

    def skip_ws(i: int) -> int:
        while i < len(text) and text[i] in " \t\r\n":
            i += 1
        return i

    def scan_list(i: int) -> list[int]:
        lines: list[int] = []
        i = skip_ws(i + 1)  # past "["
        while text[i] != "]":
            lines.append(line_at(i))
            _, i = decoder.raw_decode(text, i)
            i = skip_ws(i)
            if text[i] == ",":
                i = skip_ws(i + 1)
        return lines

    try:
        i = skip_ws(0)
        if text[i] == "[":
            lines = scan_list(i)
        else:  # {"...": ..., "data": [...], ...}
            lines = []
            i = skip_ws(i + 1)
            while text[i] != "}":
                key, i = decoder.raw_decode(text, i)
                i = skip_ws(skip_ws(i) + 1)  # past ":"
                if key == "data" and text[i] == "[":
                    lines = scan_list(i)
                _, i = decoder.raw_decode(text, i)
                i = skip_ws(i)
                if text[i] == ",":
                    i = skip_ws(i + 1)
    except (IndexError, ValueError, RecursionError):
        return None
    return lines if len(lines) == count else None


def _read_csv(path: Path) -> Iterator[Record | Skip]:
    limit = csv.field_size_limit(_CSV_FIELD_LIMIT)  # process-wide: restored when the file is done
    reader = None
    try:
        with open(path, encoding="utf-8-sig", newline="") as f:
            lines = _Lines(f)
            reader = csv.reader(lines)
            header = next(reader, None)
            lines.taken = []
            if header is None:
                return
            if len(set(header)) != len(header) or any(not name for name in header):
                raise DataError(f"{path} line 1: header must name every column once, got {header}")
            if any("\ufeff" in name for name in header):
                raise DataError(f"{path} line 1: a byte-order mark (U+FEFF) inside the header, which belongs only "
                                f"at the start of the file: {header}")
            end_line = reader.line_num
            for row in reader:
                start_line, end_line = end_line + 1, reader.line_num
                taken, lines.taken = lines.taken, []
                location = f"line {start_line}"
                if not row:
                    continue
                opened = _unclosed_quote(taken, row)
                if opened is not None:
                    where = start_line + "".join(taken).count("\n", 0, opened)
                    yield _bad(path, f"line {where}", "unclosed quote",
                               f"a quote opened here is never closed, so its field runs to the end of the file "
                               f"(line {end_line}) and takes every row after it")
                    continue
                if any("\ufeff" in value for value in row):
                    yield _bad(path, location, "byte-order mark", "a byte-order mark (U+FEFF) inside the file, "
                               "which belongs only at its start: files joined together?")
                    continue
                if len(row) != len(header):
                    yield _bad(path, location, "wrong number of fields",
                               f"row has {len(row)} fields, header has {len(header)}")
                    continue
                yield Record(dict(zip(header, row, strict=True)), str(path), location)
    except UnicodeDecodeError as e:  # the stream decodes in chunks: find the line again
        bad = _first_bad_line(path)
        raise DataError(f"{path}{f' line {bad}' if bad else ''}: not UTF-8 text: {e}") from e
    except csv.Error as e:
        line = f" line {reader.line_num}" if reader is not None and reader.line_num else ""
        raise DataError(f"{path}{line}: malformed CSV: {e}") from e
    finally:
        csv.field_size_limit(limit)


def _first_bad_line(path: Path) -> int | None:
    """The first line of a file that is not UTF-8 (a lone surrogate written as bytes is not)."""
    with open(path, "rb") as f:
        for number, raw in enumerate(f, start=1):
            try:
                raw.decode("utf-8")
            except UnicodeDecodeError:
                return number
    return None


class _Lines:
    """The lines of a text file, keeping those the csv reader took since the caller last emptied ``taken``."""

    def __init__(self, file: Iterator[str]) -> None:
        self.file = file
        self.taken: list[str] = []

    def __iter__(self) -> _Lines:
        return self

    def __next__(self) -> str:
        line = next(self.file)
        self.taken.append(line)
        return line


def _unclosed_quote(taken: list[str], row: list[str]) -> int | None:
    """Where in a CSV row's text (the lines it was read from) a quoted field opens that never closes, or None.

    The csv module reads such a field to the end of the file without a word; its strict mode says "unexpected
    end of data" instead, so the row is read again strictly (only rows with a quote in them).
    """
    if not any('"' in line for line in taken):
        return None
    try:
        for _ in csv.reader(taken, strict=True):
            pass
    except csv.Error as e:
        if "unexpected end of data" not in str(e):
            return None  # another oddity that the lenient reading took as csv always has
        text = "".join(taken)
        opened = len(text) - len(row[-1].replace('"', '""')) - 1  # the open field is the row's last, to the end
        return opened if 0 <= opened < len(text) and text[opened] == '"' else 0
    return None


def _read_parquet(path: Path) -> Iterator[Record | Skip]:
    try:
        import pyarrow.parquet as pq
    except ImportError:
        raise DataError(f"{path}: reading Parquet needs pyarrow: pip install entrenar[parquet]") from None
    try:
        file = pq.ParquetFile(path)
    except Exception as e:  # pyarrow raises ArrowInvalid and friends
        raise DataError(f"{path}: cannot be read as Parquet: {e}") from e
    row = 0
    for batch in file.iter_batches():
        for fields in batch.to_pylist():
            yield Record(fields, str(path), f"row {row}")
            row += 1


def _read_text(path: Path) -> Iterator[Record | Skip]:
    text = _read_text_file(path)
    if not text.strip():
        yield _bad(path, "", "empty document", "empty document")
    else:
        yield Record({"text": text}, str(path))
