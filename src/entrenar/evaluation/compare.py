"""Two models side by side on the same tokens: is the second (an export, a merge, someone else's file) the first?

:func:`compare_models` scores a reference and a candidate model on the same held-out batches and returns a
:class:`Comparison`: each one's loss and perplexity, the mean KL divergence of the candidate's next-token
distribution from the reference's, how often their top-1 tokens agree, greedy continuations of a few prompts under
the reference's chat template, whether the candidate's tokenizer renders the same template and round-trips every
special token to the same id, and whether the tokens that end the reference's generations (EOS, end of turn) also
end the candidate's. :meth:`Comparison.problems` says, in words, what is beyond the thresholds.
"""

from __future__ import annotations

import math
from collections.abc import Iterable, Sequence
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

import torch
import torch.nn.functional as F

from entrenar.data import eval_batches, read_records, split_validation, tokenize_records
from entrenar.data.batching import Batch
from entrenar.data.formats import DATA_FORMATS, split_format
from entrenar.data.templates import Message
from entrenar.data.tokenize import IGNORE_INDEX
from entrenar.data.tokenizer import Tokenizer
from entrenar.errors import ModelError
from entrenar.evaluation.rules import EvalRules
from entrenar.generation.sampling import generate
from entrenar.models.transformer import compute_device

# Nats per token beyond which the candidate is flagged. SmolLM2-135M-Instruct against its own exports (2026-11-26,
# docs/QUANTIZATION.md "Choosing --max-kl"): f16 < 5e-6, q8_0 0.0015, q4_k_m 0.058, q4_0 0.36, and one tensor's
# Q8_0 scales corrupted 15.0; the default passes 8-bit and k-quant 4-bit exports and flags faults by 100x.
MAX_KL = 0.1
MIN_TOP1: float | None = None  # flag below this top-1 agreement (off: near-uniform tiny models make it noise)
PROMPTS: tuple[str, ...] = ("What is the capital of France?", "Write one sentence about the sea.")
SAMPLE_TEXTS = (  # held-out text when neither --data nor the run's validation file is there
    "The quick brown fox jumps over the lazy dog. What is the capital of France? The capital of France is Paris.",
    "Fine-tuning adapts a pretrained language model to a task with a small amount of data.",
    "user: answer the question, then stop. assistant: The answer is four, because two and two make four.",
)



@dataclass
class Continuation:
    """One prompt's greedy continuation from each model (text, and whether a stop token ended it)."""

    prompt: str
    reference: str
    candidate: str
    same: bool
    reference_stopped: bool
    candidate_stopped: bool


@dataclass
class Comparison:
    """What :func:`compare_models` measured; ``problems()`` lists what is beyond the thresholds."""

    tokens: int
    reference_loss: float
    candidate_loss: float
    kl: float  # mean KL(reference || candidate) per scored position, nats
    top1_agreement: float
    max_kl: float = MAX_KL
    min_top1: float | None = MIN_TOP1
    chat_template_same: bool | None = None  # None: the reference has no chat template
    special_tokens: dict[str, str] = field(default_factory=dict)  # name -> "ok" or what is wrong
    eos: dict[str, Any] = field(default_factory=dict)  # reference's and candidate's stop ids, missing ones
    continuations: list[Continuation] = field(default_factory=list)

    @property
    def reference_perplexity(self) -> float:
        return math.exp(min(self.reference_loss, 700.0))

    @property
    def candidate_perplexity(self) -> float:
        return math.exp(min(self.candidate_loss, 700.0))

    def problems(self) -> list[str]:
        """Each finding beyond a threshold, one line each (empty: the candidate is the reference, within them)."""
        found = []
        if not math.isfinite(self.candidate_loss):
            found.append(f"the candidate's loss is {self.candidate_loss}")
        if not self.kl <= self.max_kl:
            found.append(f"KL divergence {self.kl:.4f} nats/token > {self.max_kl}")
        if self.min_top1 is not None and not self.top1_agreement >= self.min_top1:
            found.append(f"top-1 agreement {self.top1_agreement:.1%} < {self.min_top1:.0%}")
        if self.chat_template_same is False:
            found.append("the chat template differs from the trained model's")
        found += [f"special token {name}: {what}" for name, what in self.special_tokens.items() if what != "ok"]
        if self.eos.get("missing"):
            found.append(f"token ids {self.eos['missing']} end the trained model's generations but not the "
                         "candidate's (it would not stop)")
        return found

    def to_json(self) -> dict[str, Any]:
        """Everything, plus the perplexities and the problems, as JSON-ready values."""
        data = asdict(self)
        data["reference_perplexity"] = self.reference_perplexity
        data["candidate_perplexity"] = self.candidate_perplexity
        data["problems"] = self.problems()
        return data


@torch.no_grad()
def compare_logits(
    reference: torch.nn.Module, candidate: torch.nn.Module, batches: Iterable[Batch], max_tokens: int | None = None
) -> tuple[int, float, float, float, float]:
    """(tokens, reference loss, candidate loss, mean KL(ref || cand), top-1 agreement) over the labelled positions
    of ``batches``, stopping after the batch that reaches ``max_tokens`` scored tokens."""
    ref_device, cand_device = compute_device(reference), compute_device(candidate)
    sums = torch.zeros(4, dtype=torch.float64)  # ref loss, cand loss, kl, top-1 agreements
    tokens = 0
    for batch in batches:
        args = (batch["input_ids"], batch["position_ids"], batch["document_ids"])
        ref = reference(*(a.to(ref_device) for a in args))[:, :-1].float().cpu()
        cand = candidate(*(a.to(cand_device) for a in args))[:, :-1].float().cpu()
        if ref.shape != cand.shape:
            raise ModelError(f"the two models' logits differ in shape: {tuple(ref.shape)} and {tuple(cand.shape)} "
                             "(different vocabularies?)")
        targets = batch["labels"][:, 1:]
        keep = targets != IGNORE_INDEX
        ref_logp, cand_logp = F.log_softmax(ref[keep], -1), F.log_softmax(cand[keep], -1)
        t = targets[keep]
        sums[0] -= ref_logp.gather(1, t[:, None]).sum().double()
        sums[1] -= cand_logp.gather(1, t[:, None]).sum().double()
        sums[2] += (ref_logp.exp() * (ref_logp - cand_logp)).sum().double()
        sums[3] += (ref_logp.argmax(-1) == cand_logp.argmax(-1)).sum().double()
        tokens += int(keep.sum())
        if max_tokens is not None and tokens >= max_tokens:
            break
    n = max(tokens, 1)
    return tokens, float(sums[0]) / n, float(sums[1]) / n, max(float(sums[2]) / n, 0.0), float(sums[3]) / n


def check_special_tokens(
    reference: Tokenizer, candidate: Tokenizer, tokens: dict[str, str] | None = None
) -> dict[str, str]:
    """For each of the reference's named special tokens (or ``tokens``, name -> text): "ok" when the candidate
    encodes its text to the same single id and decodes that id back to the text, else what it does instead."""
    result = {}
    for name, text in (reference.special_tokens if tokens is None else tokens).items():
        want = reference.encode(text, add_special_tokens=False)
        got = candidate.encode(text, add_special_tokens=False)
        back = candidate.decode(want, skip_special_tokens=False)
        if got != want:
            result[name] = f"{text!r} encodes to {got}, the trained model's tokenizer to {want}"
        elif back != text:
            result[name] = f"{want} decodes to {back!r}, not {text!r}"
        else:
            result[name] = "ok"
    return result


def check_eos(reference: Tokenizer, candidate: Tokenizer) -> dict[str, Any]:
    """The ids that end generation for each tokenizer (EOS and generation_config's others: end of turn), and the
    reference's ones the candidate lacks."""
    missing = [i for i in reference.eos_ids if i not in candidate.eos_ids]
    return {"reference": reference.eos_ids, "candidate": candidate.eos_ids, "missing": missing}


def chat_prompt(tokenizer: Tokenizer, prompt: str) -> list[int]:
    """``prompt`` as a user turn under the tokenizer's chat template (the text itself when it has none)."""
    if tokenizer.chat_template is None:
        return tokenizer.encode(prompt)
    messages: list[Message] = [{"role": "user", "content": prompt}]
    return tokenizer.encode(tokenizer.apply_chat_template(messages, add_generation_prompt=True),
                            add_special_tokens=False)


def compare_models(
    reference: torch.nn.Module,
    reference_tokenizer: Tokenizer,
    candidate: torch.nn.Module,
    candidate_tokenizer: Tokenizer,
    batches: Iterable[Batch],
    max_tokens: int | None = None,
    prompts: Sequence[str] = PROMPTS,
    max_new_tokens: int = 16,
    max_kl: float = MAX_KL,
    min_top1: float | None = MIN_TOP1,
) -> Comparison:
    """Score ``candidate`` against ``reference`` (see the module docstring). Each model prompts and stops as its
    own tokenizer says, so a candidate with a wrong template or without the end-of-turn token shows it."""
    tokens, ref_loss, cand_loss, kl, top1 = compare_logits(reference, candidate, batches, max_tokens)
    template = reference_tokenizer.chat_template
    same_template = None if template is None else candidate_tokenizer.chat_template == template
    continuations = []
    for prompt in prompts:
        ref_new = generate(reference, chat_prompt(reference_tokenizer, prompt), max_new_tokens,  # type: ignore[arg-type]
                           stop_ids=reference_tokenizer.eos_ids)
        cand_new = generate(candidate, chat_prompt(candidate_tokenizer, prompt), max_new_tokens,  # type: ignore[arg-type]
                            stop_ids=candidate_tokenizer.eos_ids)
        ref_text, cand_text = reference_tokenizer.decode(ref_new), candidate_tokenizer.decode(cand_new)
        continuations.append(Continuation(prompt, ref_text, cand_text, ref_text == cand_text,
                                          len(ref_new) < max_new_tokens, len(cand_new) < max_new_tokens))
    return Comparison(tokens=tokens, reference_loss=ref_loss, candidate_loss=cand_loss, kl=kl, top1_agreement=top1,
                      max_kl=max_kl, min_top1=min_top1, chat_template_same=same_template,
                      special_tokens=check_special_tokens(reference_tokenizer, candidate_tokenizer),
                      eos=check_eos(reference_tokenizer, candidate_tokenizer), continuations=continuations)


def format_comparison(c: Comparison, reference: str = "trained", candidate: str = "export") -> list[str]:
    """The short printed report: one line per measure, then each problem loudly."""
    stops = "ok" if not c.eos.get("missing") else f"MISSING {c.eos['missing']}"
    lines = [
        f"{reference:>8}: loss {c.reference_loss:.4f}  perplexity {c.reference_perplexity:.3f}",
        f"{candidate:>8}: loss {c.candidate_loss:.4f}  perplexity {c.candidate_perplexity:.3f}  "
        f"({c.tokens:,} tokens)",
        f"KL {c.kl:.5f} nats/token (max {c.max_kl})  top-1 agreement {c.top1_agreement:.1%}",
        f"chat template {'n/a' if c.chat_template_same is None else 'same' if c.chat_template_same else 'DIFFERENT'}"
        f"  special tokens {'ok' if all(v == 'ok' for v in c.special_tokens.values()) else 'WRONG'}"
        f"  stop ids {c.eos.get('candidate')} {stops}",
    ]
    same = sum(x.same for x in c.continuations)
    lines.append(f"greedy continuations: {same}/{len(c.continuations)} identical")
    problems = c.problems()
    if problems:
        named = reference.upper() if reference.lower().endswith("model") else f"{reference.upper()} MODEL"
        lines.append(f"!!! {candidate.upper()} DIFFERS FROM THE {named}: " + "; ".join(problems))
    else:
        lines.append("verified: within the thresholds")
    return lines


def held_out_batches(
    tokenizer: Tokenizer, data: str | Path | None, rules: EvalRules, batch_size: int = 4,
    split: tuple[float, int] | None = None,
) -> tuple[list[Batch], str]:
    """The held-out batches and where they came from: ``data`` scored by ``rules`` (with ``split`` =
    ``(fraction, seed)``, only the part a run's ``data.validation_split`` held out of it), else the built-in
    texts (all their tokens scored: they have no prompt to mask)."""
    if data is not None:
        file_format, kind = split_format(rules.fmt) if rules.fmt in DATA_FORMATS else (rules.fmt, "auto")
        records: Any = read_records(data, format=file_format)[0]
        source, train_on, columns = str(data), rules.train_on, rules.columns
    else:
        records, kind, source = [{"text": t} for t in SAMPLE_TEXTS], "auto", "built-in sample texts (pass --data)"
        train_on, columns = "all", None
    examples, _ = tokenize_records(records, tokenizer, rules.seq_len, kind=kind, train_on=train_on,
                                   add_eos=rules.add_eos, columns=columns)
    if data is not None and split is not None:
        examples = split_validation(examples, split[0], seed=split[1])[1]
        source = f"{data} (the {split[0]:g} validation split the run held out)"
    pad_id = tokenizer.pad_id if tokenizer.pad_id is not None else 0
    return list(eval_batches(examples, batch_size, rules.seq_len, packing=True, pad_id=pad_id)), source
