"""Preference pairs for DPO from the ChatterBot dialogs: each prompt's own reply (chosen) against another's (rejected).

    python examples/smollm2_chat/prepare_data.py \
        --corpus data/downloads/chatterbot_corpus-1.3.3-py2.py3-none-any.whl --out data/chatterbot --on-error skip
    python examples/dpo_smollm2/prepare_pairs.py --chat data/chatterbot --out data/chatterbot-dpo

`--chat` is the folder `examples/smollm2_chat/prepare_data.py` writes (its train/validation split holds out whole
groups of conversations that open with the same prompt). Each conversation becomes one pair in TRL's
conversational format:

    {"prompt": [the messages before the last reply], "chosen": [the last reply],
     "rejected": [the last reply of another conversation of the same corpus file], "source": ..., "rejected_from": ...}

The rejected reply comes from the same split and the same topic file (trivia, coding, science...: same register,
plausibly an answer, but written for another question), never from a conversation whose last question is the same
(case, spacing and final punctuation aside), never the same text: :func:`entrenar.data.mismatch.mismatched_answers`
with the seed. The chosen reply is better by construction: a person wrote it in answer to this prompt.
"""

from __future__ import annotations

import argparse
import json
import sys
from collections.abc import Callable, Sequence
from pathlib import Path

from entrenar.data.mismatch import mismatched_answers
from entrenar.errors import DataError, EntrenarError


def question_key(text: str) -> str:
    """A question reduced to what makes two "the same": case, spacing and final punctuation aside."""
    return " ".join(text.casefold().split()).rstrip("?!. ")


def read_conversations(path: Path) -> list[dict]:
    """The ``{"messages", "source"}`` records of one of prepare_data.py's files, each ending with a reply."""
    if not path.is_file():
        raise DataError(f"{path}: no such file (run examples/smollm2_chat/prepare_data.py first)")
    records = []
    for number, line in enumerate(path.read_text(encoding="utf-8").splitlines(), 1):
        try:
            record = json.loads(line)
            messages = record["messages"]
        except (ValueError, KeyError, TypeError) as e:
            raise DataError(f"{path} line {number}: not a prepare_data.py record ({e})") from None
        if len(messages) < 2 or messages[-1].get("role") != "assistant":
            raise DataError(f"{path} line {number}: the conversation does not end with an assistant reply")
        records.append(record)
    return records


def pairs(records: Sequence[dict], seed: int = 0) -> list[dict]:
    """One pair per conversation, the rejected reply from another conversation of the same topic file."""
    answers = [r["messages"][-1]["content"] for r in records]
    keys = [question_key(r["messages"][-2]["content"]) for r in records]
    topics = [r.get("source", "").split(":")[0] for r in records]
    others = mismatched_answers(answers, keys=keys, topics=topics, seed=seed)
    out = []
    for record, j in zip(records, others, strict=True):
        if j is None:
            continue
        out.append({"prompt": record["messages"][:-1], "chosen": [record["messages"][-1]],
                    "rejected": [{"role": "assistant", "content": answers[j]}],
                    "source": record.get("source", ""), "rejected_from": records[j].get("source", "")})
    return out


def prepare(chat: str | Path, out: str | Path, *, seed: int = 0, log: Callable[[str], None] = print) -> dict[str, int]:
    """Write ``out/train.jsonl`` and ``out/validation.jsonl`` (pairs within each split); returns their counts."""
    chat, out = Path(chat), Path(out)
    counts = {}
    written = {}
    for split in ("train", "validation"):
        records = read_conversations(chat / f"{split}.jsonl")
        written[split] = pairs(records, seed)
        counts[split] = len(written[split])
        if not written[split]:
            raise DataError(f"{chat / f'{split}.jsonl'}: no conversation could be paired with another's reply")
    out.mkdir(parents=True, exist_ok=True)
    for split, rows in written.items():
        text = "".join(json.dumps(r, ensure_ascii=False) + "\n" for r in rows)
        (out / f"{split}.jsonl").write_text(text, encoding="utf-8")
        same = sum(r["source"].split(":")[0] == r["rejected_from"].split(":")[0] for r in rows)
        log(f"{out / f'{split}.jsonl'}: {len(rows)} pairs ({same} rejected replies from the same topic file)")
    return counts


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--chat", required=True, help="folder with prepare_data.py's train.jsonl and validation.jsonl")
    parser.add_argument("--out", required=True, help="folder for the pairs' train.jsonl and validation.jsonl")
    parser.add_argument("--seed", type=int, default=0, help="seed of the rejected replies' draw (default 0)")
    args = parser.parse_args(argv)
    try:
        prepare(args.chat, args.out, seed=args.seed)
    except EntrenarError as e:
        print(f"error: {e}", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
