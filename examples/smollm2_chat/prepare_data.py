"""Turn the ChatterBot dialog corpus (YAML) into chat `messages` JSONL for entrenar.

    pip download --no-deps chatterbot-corpus==1.3.3 -d data/downloads
    python examples/smollm2_chat/prepare_data.py \
        --corpus data/downloads/chatterbot_corpus-1.3.3-py2.py3-none-any.whl --out data/chatterbot --on-error skip

`--corpus` is the downloaded wheel (a zip) or a folder it was extracted to.
Each conversation `[turn 1, turn 2, ...]` becomes
`{"messages": [{"role": "user", ...}, {"role": "assistant", ...}, ...], "source": "english/ai.yml:4"}`,
turns alternating user/assistant from the first; a trailing user turn, which
has no reply to learn, is dropped.

The split is by opening user turn, not by conversation: the corpus repeats
prompts (tech_support.yml asks "My printer is not printing." over a hundred
times), and a held-out conversation whose prompt was trained on measures
recall, not generalisation. So exact duplicate conversations are kept once,
conversations are grouped by their normalised first turn, and whole groups go
to validation in an order fixed by a seeded hash until about
`--validation-fraction` of the conversations are held out.

A malformed entry (not a list of turns, a turn that is not text, fewer than
two turns) raises `DataError` naming file and line, or with `--on-error skip`
is reported on stderr and left out (corpus 1.3.3 has one, in english/trivia.yml).
A file that is not YAML, or has no `conversations` list, always raises.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import re
import sys
import zipfile
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path

import yaml

from entrenar.errors import DataError, EntrenarError

_NULL_TAG = "tag:yaml.org,2002:null"
ROLES = ("user", "assistant")
YAML_SUFFIXES = (".yml", ".yaml")


@dataclass(frozen=True)
class Conversation:
    """The text turns of one dialog, and where it was written (``english/ai.yml:4``)."""

    turns: tuple[str, ...]
    source: str


def read_corpus(path: str | Path, language: str = "english") -> list[tuple[str, str]]:
    """The ``(name, yaml text)`` of every ``data/<language>/*.yml`` in a wheel/zip or folder, sorted by name.

    A folder that holds ``.yml`` files directly (no ``data/<language>`` below it) is read as it is.
    """
    path = Path(path)
    if zipfile.is_zipfile(path):
        with zipfile.ZipFile(path) as archive:
            pattern = re.compile(rf"(^|/)data/{re.escape(language)}/[^/]+\.ya?ml$")
            names = sorted(n for n in archive.namelist() if pattern.search(n))
            files = [(f"{language}/{Path(n).name}", archive.read(n)) for n in names]
    elif path.is_dir():
        found = sorted(p for p in path.rglob("*") if p.suffix in YAML_SUFFIXES and p.parent.name == language
                       and p.parent.parent.name == "data")
        if not found:
            found = sorted(p for p in path.iterdir() if p.suffix in YAML_SUFFIXES)
        files = [(f"{p.parent.name}/{p.name}", p.read_bytes()) for p in found]
    elif path.exists():
        raise DataError(f"{path}: not a zip/wheel or a folder "
                        "(pass the chatterbot-corpus wheel or its extracted folder)")
    else:
        raise DataError(f"{path}: no such file or folder")
    if not files:
        raise DataError(f"{path}: no YAML files for language '{language}' (looked for data/{language}/*.yml)")
    texts = []
    for name, raw in files:
        try:
            texts.append((name, raw.decode("utf-8")))
        except UnicodeDecodeError as e:
            raise DataError(f"{name}: not UTF-8 text (byte {e.start})") from None
    return texts


def parse_conversations(text: str, name: str, on_error: str = "raise") -> tuple[list[Conversation], list[str]]:
    """The conversations of one corpus file, and one message per malformed entry left out (``on_error="skip"``).

    Turns are taken as the YAML text wrote them (so an unquoted ``1984`` or
    ``yes`` stays that text rather than becoming a number or a boolean), with
    surrounding whitespace stripped.
    """
    if on_error not in ("raise", "skip"):
        raise ValueError(f"on_error must be 'raise' or 'skip', got {on_error!r}")
    try:
        root = yaml.compose(text, Loader=yaml.SafeLoader)
    except yaml.YAMLError as e:
        mark = getattr(e, "problem_mark", None)
        where = f"{name}:{mark.line + 1}" if mark is not None else name
        raise DataError(f"{where}: not valid YAML ({getattr(e, 'problem', None) or e})") from None
    conversations_node = _mapping_value(root, "conversations")
    if not isinstance(conversations_node, yaml.SequenceNode):
        raise DataError(f"{name}: no 'conversations' list at the top level")

    conversations, problems = [], []
    for index, node in enumerate(conversations_node.value):
        where = f"{name}:{node.start_mark.line + 1}"
        try:
            turns = _turns(node, where, index)
        except DataError as e:
            if on_error == "raise":
                raise
            problems.append(str(e))
            continue
        conversations.append(Conversation(turns, where))
    return conversations, problems


def _mapping_value(node: yaml.Node | None, key: str) -> yaml.Node | None:
    if not isinstance(node, yaml.MappingNode):
        return None
    for key_node, value_node in node.value:
        if isinstance(key_node, yaml.ScalarNode) and key_node.value == key:
            return value_node
    return None


def _turns(node: yaml.Node, where: str, index: int) -> tuple[str, ...]:
    if not isinstance(node, yaml.SequenceNode):
        kind = "a string" if isinstance(node, yaml.ScalarNode) else "a mapping"
        raise DataError(f"{where}: conversation {index} must be a list of turns, got {kind}")
    turns = []
    for i, turn in enumerate(node.value):
        if not isinstance(turn, yaml.ScalarNode):
            raise DataError(f"{where}: conversation {index}, turn {i} must be text, got a nested list or mapping")
        if turn.tag == _NULL_TAG or not turn.value.strip():
            raise DataError(f"{where}: conversation {index}, turn {i} is empty")
        turns.append(turn.value.strip())
    if len(turns) < 2:
        raise DataError(f"{where}: conversation {index} has {len(turns)} turn(s); it needs a user turn and a reply")
    return tuple(turns)


def to_messages(turns: Sequence[str]) -> list[dict[str, str]]:
    """Alternate user/assistant from the first turn; drop a trailing user turn, which has no reply to learn."""
    kept = len(turns) - len(turns) % 2
    return [{"role": ROLES[i % 2], "content": turn} for i, turn in enumerate(turns[:kept])]


def prompt_key(text: str) -> str:
    """The first user turn reduced to what makes two prompts "the same": case, spacing and final punctuation aside."""
    return " ".join(text.casefold().split()).rstrip("?!. ")


def deduplicate(conversations: Sequence[Conversation]) -> list[Conversation]:
    """Keep the first of each set of conversations whose turns are identical."""
    seen: set[tuple[str, ...]] = set()
    kept = []
    for conversation in conversations:
        if conversation.turns not in seen:
            seen.add(conversation.turns)
            kept.append(conversation)
    return kept


def split_by_prompt(conversations: Sequence[Conversation], fraction: float,
                    seed: int) -> tuple[list[Conversation], list[Conversation]]:
    """(train, validation): whole prompt groups are held out, in seeded-hash order, until `fraction` is reached.

    Deterministic for a given corpus and seed, independent of Python's hash
    randomisation; conversations keep their corpus order within each side.
    """
    if not 0.0 <= fraction < 1.0:
        raise ValueError(f"validation fraction must be in [0, 1), got {fraction}")
    keys = {prompt_key(c.turns[0]) for c in conversations}
    order = sorted(keys, key=lambda k: hashlib.sha256(f"{seed}\0{k}".encode()).hexdigest())
    sizes: dict[str, int] = {}
    for conversation in conversations:
        key = prompt_key(conversation.turns[0])
        sizes[key] = sizes.get(key, 0) + 1
    target = fraction * len(conversations)
    held_out: set[str] = set()
    count = 0
    for key in order:
        if count >= target:
            break
        held_out.add(key)
        count += sizes[key]
    train = [c for c in conversations if prompt_key(c.turns[0]) not in held_out]
    validation = [c for c in conversations if prompt_key(c.turns[0]) in held_out]
    return train, validation


def write_jsonl(conversations: Sequence[Conversation], path: Path) -> None:
    with open(path, "w", encoding="utf-8") as f:
        for conversation in conversations:
            record = {"messages": to_messages(conversation.turns), "source": conversation.source}
            f.write(json.dumps(record, ensure_ascii=False) + "\n")


def prepare(corpus: str | Path, out: str | Path, *, language: str = "english", validation_fraction: float = 0.1,
            seed: int = 0, on_error: str = "raise", log: Callable[[str], None] = print) -> tuple[int, int]:
    """Read the corpus, write ``out/train.jsonl`` and ``out/validation.jsonl``; returns their record counts."""
    files = read_corpus(corpus, language)
    conversations, problems = [], []
    for name, text in files:
        kept, left_out = parse_conversations(text, name, on_error)
        conversations += kept
        problems += left_out
    for problem in problems:
        print(f"skipped {problem}", file=sys.stderr)
    unique = deduplicate(conversations)
    trailing = sum(len(c.turns) % 2 for c in unique)
    train, validation = split_by_prompt(unique, validation_fraction, seed)
    if not train or (validation_fraction > 0 and not validation):
        raise DataError(f"{corpus}: {len(unique)} conversations are too few to hold out {validation_fraction:.0%}")
    out = Path(out)
    out.mkdir(parents=True, exist_ok=True)
    write_jsonl(train, out / "train.jsonl")
    write_jsonl(validation, out / "validation.jsonl")
    prompts = len({prompt_key(c.turns[0]) for c in validation})
    log(f"{len(files)} files, {len(conversations)} conversations read, {len(problems)} malformed skipped, "
        f"{len(conversations) - len(unique)} exact duplicates removed, {trailing} trailing user turns dropped")
    log(f"{out / 'train.jsonl'}: {len(train)} conversations")
    log(f"{out / 'validation.jsonl'}: {len(validation)} conversations ({prompts} opening prompts never seen in train)")
    return len(train), len(validation)


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--corpus", required=True,
                        help="chatterbot-corpus wheel/zip, or the folder it was extracted to")
    parser.add_argument("--out", required=True, help="folder for train.jsonl and validation.jsonl")
    parser.add_argument("--language", default="english", help="corpus language folder (default: english)")
    parser.add_argument("--validation-fraction", type=float, default=0.1, help="share of conversations held out")
    parser.add_argument("--seed", type=int, default=0, help="seed of the split (default 0)")
    parser.add_argument("--on-error", choices=("raise", "skip"), default="raise",
                        help="a malformed conversation stops the run (raise) or is reported and left out (skip)")
    args = parser.parse_args(argv)
    if not 0.0 <= args.validation_fraction < 1.0:
        parser.error(f"--validation-fraction must be in [0, 1), got {args.validation_fraction}")
    try:
        prepare(args.corpus, args.out, language=args.language, validation_fraction=args.validation_fraction,
                seed=args.seed, on_error=args.on_error)
    except EntrenarError as e:
        print(f"error: {e}", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
