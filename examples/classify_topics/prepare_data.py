"""Topic classification data from the ChatterBot English corpus (BSD-3-Clause, shipped on PyPI).

    pip download --no-deps chatterbot-corpus==1.3.3 -d data/downloads
    python examples/classify_topics/prepare_data.py \
        --corpus data/downloads/chatterbot_corpus-1.3.3-py2.py3-none-any.whl --out data/topics

Each conversation's opening user turn is a text; the corpus file it comes from
(``ai.yml``, ``coding.yml``, ...) is its label. Only the topics in ``TOPICS``
are kept (categories with at least ~20 distinct openings and a topic one can
read off the text). Texts are deduplicated after normalising case and
whitespace, so no text is in two splits, and split per label with a seeded
shuffle into train / validation / test (60 / 20 / 20). Writes
``{"text": ..., "label": ..., "source": "english/ai.yml:4"}`` lines.
"""

from __future__ import annotations

import argparse
import json
import random
import zipfile
from pathlib import Path

import yaml

TOPICS = ("ai", "coding", "conversations", "emotion", "movies", "science", "sports", "trivia")
SPLITS = (("train", 0.6), ("validation", 0.2), ("test", 0.2))


def read_files(corpus: Path) -> dict[str, str]:
    """``{topic: yaml text}`` from the wheel (a zip) or a folder holding the .yml files."""
    out = {}
    if corpus.is_file():
        with zipfile.ZipFile(corpus) as z:
            for topic in TOPICS:
                out[topic] = z.read(f"chatterbot_corpus/data/english/{topic}.yml").decode("utf-8")
    else:
        for topic in TOPICS:
            matches = sorted(corpus.rglob(f"english/{topic}.yml")) or sorted(corpus.rglob(f"{topic}.yml"))
            if not matches:
                raise SystemExit(f"{corpus}: no {topic}.yml")
            out[topic] = matches[0].read_text(encoding="utf-8")
    return out


def openings(topic: str, text: str) -> list[tuple[str, str]]:
    """``(opening turn, source)`` of each conversation, first occurrence of each normalised text."""
    node = yaml.compose(text)
    conversations = next(v for k, v in node.value if k.value == "conversations")
    seen, out = set(), []
    for item in conversations.value:
        if not isinstance(item, yaml.SequenceNode) or not item.value:
            continue
        first = item.value[0]
        if not isinstance(first, yaml.ScalarNode) or not str(first.value).strip():
            continue
        key = " ".join(str(first.value).lower().split())
        if key not in seen:
            seen.add(key)
            out.append((" ".join(str(first.value).split()), f"english/{topic}.yml:{first.start_mark.line + 1}"))
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--corpus", required=True, type=Path, help="chatterbot_corpus wheel or extracted folder")
    parser.add_argument("--out", required=True, type=Path, help="folder for train/validation/test.jsonl")
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args()
    files = read_files(args.corpus)
    rows = {name: [] for name, _ in SPLITS}
    taken: set[str] = set()
    for topic in TOPICS:
        texts = [(t, s) for t, s in openings(topic, files[topic]) if t.lower() not in taken]
        taken.update(t.lower() for t, _ in texts)  # a text opening two topics stays with the first
        random.Random(f"{args.seed}-{topic}").shuffle(texts)
        start = 0
        for i, (name, fraction) in enumerate(SPLITS):
            end = len(texts) if i == len(SPLITS) - 1 else start + round(fraction * len(texts))
            rows[name] += [{"text": t, "label": topic, "source": s} for t, s in texts[start:end]]
            start = end
    args.out.mkdir(parents=True, exist_ok=True)
    for name, items in rows.items():
        random.Random(f"{args.seed}-{name}").shuffle(items)
        with open(args.out / f"{name}.jsonl", "w", encoding="utf-8") as f:
            for item in items:
                f.write(json.dumps(item, ensure_ascii=False) + "\n")
        counts = {t: sum(r["label"] == t for r in items) for t in TOPICS}
        print(f"{name}: {len(items)} texts {counts}")


if __name__ == "__main__":
    main()
