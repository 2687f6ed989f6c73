"""What reading and tokenizing left out or found odd: the run's notes, and every skipped record in ``skipped.jsonl``.

With ``data.on_error: skip`` a malformed record costs the run nothing but the
record, so each one is written down (file, line, reason) for the user to fix,
and the notes count them by reason. Records that are legal but likely mistakes
(``TokenizeStats.suspicious``) are counted by kind with the first place each was seen.
"""

from __future__ import annotations

import json
import re
from collections import Counter
from pathlib import Path

from entrenar.data.sources import ReadStats, Skip
from entrenar.data.tokenize import TokenizeStats
from entrenar.io import atomic
from entrenar.io.run_dir import SKIPPED_FILE


def skipped_in_order(read: ReadStats, tokenized: TokenizeStats) -> list[Skip]:
    """Every record skipped in reading or tokenizing, in file order and, within a file, in record order."""
    files = {name: i for i, name in enumerate(read.files)}

    def key(skip: Skip) -> tuple[int, int]:
        number = re.search(r"\d+", skip.location)  # line, item or row: one kind per file
        return files.get(skip.file, len(files)), int(number.group()) if number else -1

    return sorted([*read.skipped_records, *tokenized.skipped_records], key=key)


def data_notes(key: str, skipped: list[Skip], tokenized: TokenizeStats) -> list[str]:
    """Notes for the report on the data of recipe key ``key`` (e.g. ``data.train``)."""
    notes = []
    if skipped:
        reasons = ", ".join(f"{n} {reason}" for reason, n in Counter(s.reason for s in skipped).most_common())
        notes.append(f"{key}: {len(skipped)} malformed record(s) skipped ({reasons}); first: {skipped[0].message} "
                     f"(a run lists each in its {SKIPPED_FILE})")
    if tokenized.suspicious:
        kinds = "; ".join(f"{n} with {kind} (first: {first})" for kind, (n, first) in tokenized.suspicious.items())
        notes.append(f"{key}: taken as written, but likely mistakes: {kinds}")
    return notes


def write_skipped(run_dir: str | Path, skipped: list[Skip]) -> Path | None:
    """``run_dir/skipped.jsonl``, one skipped record a line, written atomically; nothing if none was skipped."""
    if not skipped:
        return None
    lines = "".join(json.dumps(skip.to_json()) + "\n" for skip in skipped)  # ASCII: paths may not be UTF-8
    Path(run_dir).mkdir(parents=True, exist_ok=True)
    return atomic.write_text(Path(run_dir) / SKIPPED_FILE, lines)
