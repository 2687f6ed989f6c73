"""Preference pairs from text that has no preference labels: each prompt's own answer against another's.

A corpus of (prompt, answer) records, or of documents cut into (beginning, continuation), gives a pair per record
whose ``chosen`` is the answer written for that prompt and whose ``rejected`` is the answer of another record,
drawn with a seed: of the same topic where a topic is given (same register, wrong response: a plausible but wrong
answer), never one to the same prompt (``keys``), never the same text. The chosen answer is better by
construction: it is the one a person wrote in reply to this prompt; the rejected one was written for another.
The SmolLM2 DPO example (``examples/dpo_smollm2/prepare_pairs.py``) and ``bench/bench_dpo.py`` build their pairs
with these two functions.
"""

from __future__ import annotations

import random
import re
from collections.abc import Sequence
from typing import Any

from entrenar.data.tokenizer import Tokenizer
from entrenar.errors import DataError


def _normal(text: str) -> str:
    return re.sub(r"\s+", " ", text).strip().casefold()


def mismatched_answers(answers: Sequence[str], *, keys: Sequence[str] | None = None,
                       topics: Sequence[str] | None = None, seed: int = 0) -> list[int | None]:
    """For each record i, the index j of the record whose answer is its rejected one (None: no record qualifies).

    j has the same topic as i when ``topics`` is given and a record of that topic qualifies (else any topic), a
    different key (``keys``: records answering the same prompt share one), and an answer that differs from i's
    (compared ignoring case and spacing). Drawn with ``random.Random(seed)``, so the same inputs give the same
    indices.
    """
    n = len(answers)
    keys = list(keys) if keys is not None else [str(i) for i in range(n)]
    topics = list(topics) if topics is not None else [""] * n
    if len(keys) != n or len(topics) != n:
        raise ValueError(f"{n} answers but {len(keys)} keys and {len(topics)} topics")
    normal = [_normal(a) for a in answers]
    by_topic: dict[str, list[int]] = {}
    for i, topic in enumerate(topics):
        by_topic.setdefault(topic, []).append(i)
    rng = random.Random(seed)
    chosen: list[int | None] = []
    for i in range(n):
        found = None
        for pool in (by_topic[topics[i]], range(n)):
            candidates = [j for j in pool if keys[j] != keys[i] and normal[j] != normal[i]]
            if candidates:
                found = candidates[rng.randrange(len(candidates))]
                break
        chosen.append(found)
    return chosen


def continuation_pairs(texts: Sequence[str], tokenizer: Tokenizer, *, prompt_tokens: int, completion_tokens: int,
                       seed: int = 0, limit: int | None = None) -> list[dict[str, Any]]:
    """``{"prompt", "chosen", "rejected"}`` string pairs from documents: a document's first ``prompt_tokens``
    tokens, its next ``completion_tokens`` (chosen) and another document's tokens at the same place (rejected).

    Documents shorter than ``prompt_tokens + completion_tokens`` tokens are left out; at most ``limit`` pairs. The
    text is decoded from the cut token ids, so prompt and completions are about that many tokens once encoded
    again (a merge across the cut can move a token).
    """
    need = prompt_tokens + completion_tokens
    cuts: list[tuple[str, str]] = []
    for text in texts:
        ids = tokenizer.encode(text, add_special_tokens=False)
        if len(ids) >= need:
            cuts.append((tokenizer.decode(ids[:prompt_tokens]), tokenizer.decode(ids[prompt_tokens:need])))
        if limit is not None and len(cuts) >= limit:
            break
    if len(cuts) < 2:
        raise DataError(f"{len(cuts)} of {len(texts)} documents have {need} tokens ({prompt_tokens} of prompt and "
                        f"{completion_tokens} of completion): at least 2 are needed to pair one with another")
    others = mismatched_answers([c for _, c in cuts], seed=seed)
    return [{"prompt": p, "chosen": c, "rejected": cuts[j][1]}
            for (p, c), j in zip(cuts, others, strict=True) if j is not None]


__all__ = ["continuation_pairs", "mismatched_answers"]
