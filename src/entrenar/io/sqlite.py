"""Records from a SQLite database: ``data.train: FILE.db`` with ``data.query: SELECT ...``.

The file is opened read-only (a ``mode=ro`` URI, and ``PRAGMA query_only``), only one SELECT (or
``WITH ... SELECT``) statement is run, and each row becomes a record whose fields are the result's column
names, mapped like JSONL fields (``text_field``, ``prompt_field``, ...). SQL NULL is None, so a NULL text is
that record's error (``on_error: skip`` skips it). Rows are numbered from 1 (``row 17``).

``data.attach: {outcomes: outcomes.db}`` attaches further files to the same connection, read-only too, under
their schema names, so one query joins across files (``... JOIN outcomes.results r ON ...``).
"""

from __future__ import annotations

import re
import sqlite3
from collections.abc import Iterator, Mapping
from pathlib import Path
from urllib.parse import quote

from entrenar.errors import ConfigError, DataError

SQLITE_EXTENSIONS = (".db", ".sqlite", ".sqlite3")
_COMMENTS = re.compile(r"\s*(--[^\n]*(\n|$)|/\*.*?\*/)", re.DOTALL)
_BATCH = 1024


def is_sqlite(path: str | Path) -> bool:
    """True for a file name SQLite sources are known by."""
    return Path(path).suffix.lower() in SQLITE_EXTENSIONS


def check_query(query: str) -> str:
    """The query when it is one SELECT statement (``WITH`` allowed before it), else a ConfigError."""
    body = query
    while (found := _COMMENTS.match(body)) and found.end():
        body = body[found.end():]
    first = re.match(r"\s*([A-Za-z]+)", body)
    if first is None or first.group(1).upper() not in ("SELECT", "WITH"):
        raise ConfigError(f"data.query must be a SELECT statement, got {query!r}")
    if not sqlite3.complete_statement(query.rstrip().rstrip(";") + ";") or query.strip().rstrip(";").count(";"):
        raise ConfigError(f"data.query must be one complete SELECT statement, got {query!r}")
    return query


def _uri(path: Path) -> str:
    return f"file:{quote(str(path.absolute()))}?mode=ro"


def attach_files(connection: sqlite3.Connection, attach: Mapping[str, str | Path]) -> None:
    """ATTACH each ``{schema: file}`` read-only (the connection was opened with URIs on); a missing or non-SQLite
    file is a DataError naming its ``data.attach`` key."""
    for name, file in attach.items():
        where = f"data.attach.{name}: {file}"
        if not Path(file).is_file():
            raise DataError(f"{where}: no such file")
        try:
            connection.execute(f'ATTACH DATABASE ? AS "{name}"', (_uri(Path(file)),))
            connection.execute(f'SELECT count(*) FROM "{name}".sqlite_master').fetchone()
        except sqlite3.Error as e:
            raise DataError(f"{where}: cannot be read as a SQLite database: {e}") from None


def read_sqlite(path: Path, query: str | None,
                attach: Mapping[str, str | Path] | None = None) -> Iterator[tuple[str, dict]]:
    """(location, fields) of every row ``query`` returns from ``path`` (with ``attach``'s files attached)."""
    if query is None:
        raise ConfigError(f"{path}: a SQLite data file needs data.query (a SELECT statement giving the columns)")
    check_query(query)
    try:
        connection = sqlite3.connect(_uri(path), uri=True)
    except sqlite3.Error as e:
        raise DataError(f"{path}: cannot be opened as a SQLite database: {e}") from None
    try:
        try:
            connection.execute("PRAGMA query_only = ON")
            connection.execute("SELECT count(*) FROM sqlite_master").fetchone()  # reads the header: is it SQLite?
        except sqlite3.Error as e:
            raise DataError(f"{path}: cannot be read as a SQLite database: {e}") from None
        attach_files(connection, attach or {})
        try:
            cursor = connection.execute(query)
        except sqlite3.Error as e:
            raise DataError(f"{path}: data.query {query!r} failed: {e}") from None
        if cursor.description is None:
            raise DataError(f"{path}: data.query {query!r} returns no rows (not a SELECT)")
        columns = [c[0] for c in cursor.description]
        if len(set(columns)) != len(columns):
            raise DataError(f"{path}: data.query {query!r} names a column twice ({columns}); give each an AS name")
        number = 0
        while True:
            try:
                rows = cursor.fetchmany(_BATCH)
            except sqlite3.Error as e:
                raise DataError(f"{path}: data.query {query!r} failed after row {number}: {e}") from None
            if not rows:
                return
            for row in rows:
                number += 1
                yield f"row {number}", dict(zip(columns, row, strict=True))
    finally:
        connection.close()


__all__ = ["SQLITE_EXTENSIONS", "attach_files", "check_query", "is_sqlite", "read_sqlite"]
