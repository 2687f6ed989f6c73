"""Arithmetic prompts for the GRPO worked example on SmolLM2-135M-Instruct (recipes/grpo-smollm2-arithmetic.yaml).

Writes ``OUT/train.jsonl`` and ``OUT/validation.jsonl``: each line ``{"prompt": ..., "answer": "12"}`` where the
prompt is a question ("What is 7 + 5? Answer with the number only.") already in SmolLM2's chat template (the GRPO
task tokenizes the prompt text as it is). Every pair of operands 1..12 is one question; a seeded shuffle puts 48
of them in the held-out file, never trained on. Deterministic: the same seed writes the same files.
"""

from __future__ import annotations

import argparse
import json
import random
from pathlib import Path


def chat_prompt(question: str) -> str:
    """``question`` as one user turn of SmolLM2's chat template, ready for the reply (no system turn: shorter
    prompts make each step cheaper)."""
    return f"<|im_start|>user\n{question}<|im_end|>\n<|im_start|>assistant\n"


def questions(low: int = 1, high: int = 12) -> list[dict[str, str]]:
    """One record per ordered pair of operands in [low, high]: the chat prompt and the sum as text."""
    return [{"prompt": chat_prompt(f"What is {a} + {b}? Answer with the number only."), "answer": str(a + b)}
            for a in range(low, high + 1) for b in range(low, high + 1)]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", default="data/arithmetic", help="folder for train.jsonl and validation.jsonl")
    parser.add_argument("--held-out", type=int, default=48, help="questions kept out of training")
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args()
    records = questions()
    random.Random(args.seed).shuffle(records)
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    for name, part in (("validation", records[:args.held_out]), ("train", records[args.held_out:])):
        with open(out / f"{name}.jsonl", "w", encoding="utf-8") as f:
            f.writelines(json.dumps(r) + "\n" for r in part)
        print(f"{out / name}.jsonl: {len(part)} prompts")


if __name__ == "__main__":
    main()
