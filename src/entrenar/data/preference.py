"""Preference data: TRL's record formats read and tokenized as TRL does, and batches that keep a pair together.

Record formats (TRL's names; field names set by ``columns``):

- pairs, ``{"prompt", "chosen", "rejected"}``: strings, or conversations (``prompt`` a list of messages,
  ``chosen``/``rejected`` lists of the assistant's messages) rendered with the tokenizer's chat template;
- pairs with an implicit prompt, ``{"chosen", "rejected"}`` only: the prompt is their common beginning, cut as
  TRL's ``extract_prompt`` cuts it (on characters for strings, a space before the cut going to the
  completions; on whole messages for conversations);
- unpaired (KTO), ``{"prompt", "completion", "label"}``, ``label`` true for a desirable completion. Pairs read as
  unpaired become two examples each (chosen desirable, rejected not), in TRL's ``unpair_preference_dataset`` order.

Tokenization is TRL's (``DPOTrainer``/``KTOTrainer._prepare_dataset``): the prompt and prompt + completion are
tokenized whole (strings with the tokenizer's special tokens, EOS text appended to completions that lack it;
conversations rendered by the chat template, the prompt with the generation prompt); the prompt is the tokens
the prompt alone and every prompt + completion share at the start, and each completion is the rest. Loss is taken
on completion tokens only.

A pair longer than ``seq_len`` keeps the end of its prompt (at least ``seq_len // 2`` tokens of it when it has
that many) and then cuts its completions at the end, one prompt for both sequences; notes count both cuts.

:class:`PreferenceStream` deals out ``batch_size`` pairs (or unpaired examples) a micro-batch, in a seeded order,
resumable as :class:`~entrenar.data.batching.BatchStream` is. Each sequence (prompt + one completion) is one
document: packed rows (best-fit, documents isolated) or one sequence a padded row, laid out by
:func:`~entrenar.data.batching.collate`, so :func:`~entrenar.data.batching.padding_free` and
:func:`~entrenar.data.batching.packed_documents` apply unchanged. Beside BatchStream's keys a batch holds
``sequence_ids`` (the sequence of each token, -1 on padding), ``num_sequences`` (pairs: sequence 2i is pair i's
chosen, 2i+1 its rejected; unpaired: sequence i is example i), ``example_index`` (each unit's index in the
stream's examples) and, unpaired, ``desirable``.

With ``share_prompt`` a pairs batch also carries the same pairs laid out with each prompt once
(:func:`shared_prompt_layout`, keys ``shared_*``): one padding-free row of ``[prompt, chosen, rejected]`` per pair,
the rejected tokens attending the prompt and themselves only. The rows above stay as they are (what the step's
token count reads: the prompt counted twice, as TRL processes it); the task picks the layout it runs.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch

from entrenar.data.batching import PAD_DOCUMENT, EpochCursor, best_fit, check_stream_state, collate
from entrenar.data.formats import RecordError
from entrenar.data.report import data_notes, skipped_in_order
from entrenar.data.sources import Record, Skip, read_records
from entrenar.data.templates import render_chat
from entrenar.data.tokenize import IGNORE_INDEX, Example, TokenizeStats, _messages_field, check_text
from entrenar.errors import CheckpointError, ConfigError, DataError

if TYPE_CHECKING:
    from entrenar.data.tokenizer import Tokenizer

KINDS = ("auto", "pairs", "unpaired")
COLUMNS = ("prompt", "chosen", "rejected", "completion", "label")
SAME_PAIR = "chosen == rejected (no preference to learn)"
PreferenceBatch = dict[str, Any]  # LongTensors [R, T] as BatchStream's, plus the keys the module docstring names


@dataclass(frozen=True)
class PreferencePair:
    """One prompt, a preferred and a dispreferred completion, as token ids (completions without the prompt, EOS
    appended as TRL appends it). ``origin``: the record it came from."""

    prompt: list[int]
    chosen: list[int]
    rejected: list[int]
    origin: str = ""

    def sequences(self) -> tuple[list[int], list[int]]:
        """The completions of the pair, chosen first: sequence 2i and 2i+1 of a batch."""
        return self.chosen, self.rejected


@dataclass(frozen=True)
class UnpairedExample:
    """KTO's example: a prompt, one completion and whether it is desirable."""

    prompt: list[int]
    completion: list[int]
    desirable: bool
    origin: str = ""

    def sequences(self) -> tuple[list[int]]:
        return (self.completion,)


PreferenceExample = PreferencePair | UnpairedExample


def preference_columns(columns: Mapping[str, str] | None) -> dict[str, str]:
    """``columns`` (the recipe's field names of prompt/chosen/rejected/completion/label) over the defaults."""
    names = {name: name for name in COLUMNS}
    unknown = sorted(set(columns or {}) - set(names))
    if unknown:
        raise ConfigError(f"preference columns {unknown} are not among {list(COLUMNS)} (map these names to your "
                          "fields)")
    names.update(columns or {})
    return names


def read_preference_file(
    path: str | Path | Sequence[str | Path],
    tokenizer: Tokenizer,
    *,
    seq_len: int,
    kind: str = "auto",
    columns: Mapping[str, str] | None = None,
    on_error: str = "raise",
    seed: int = 0,
    query: str | None = None,
    format: str = "auto",
    key: str = "data",
) -> tuple[list[PreferencePair] | list[UnpairedExample], list[Skip], list[str]]:
    """``(examples, skipped, notes)`` of preference records in ``path`` (any file :func:`read_records` reads;
    ``format``: its file format, ``seed``/``query`` as there).

    ``kind``: ``pairs`` (DPO, IPO, SimPO, ORPO), ``unpaired`` (KTO: unpaired records, or pairs split in two) or
    ``auto`` (what the first record is). A bad record raises a ``DataError`` naming file, line and field, or with
    ``on_error="skip"`` is skipped and returned. ``notes`` (prefixed with ``key``, e.g. ``data.train``) count the
    skips, the pairs whose chosen equals rejected, and the cuts to ``seq_len``."""
    if kind not in KINDS:
        raise ConfigError(f"preference data kind {kind!r} is not one of {', '.join(KINDS)}")
    if seq_len < 2:
        raise ConfigError(f"seq_len must be at least 2 (one input and one target), got {seq_len}")
    names = preference_columns(columns)
    records, read_stats = read_records(path, format=format, on_error=on_error, seed=seed, query=query)
    stats = TokenizeStats()
    found: list[PreferenceExample] = []
    first: tuple[str, str] | None = None  # the kind of record the file holds, and where it was first seen
    cut = _Cuts()
    for record in records:
        try:
            record_kind = _record_kind(record.fields, names, record.where)
            if kind == "pairs" and record_kind == "unpaired":
                raise RecordError("unpaired record", f"{record.where}: an unpaired record ('{names['completion']}'"
                                  f", '{names['label']}') where pairs ('{names['chosen']}', '{names['rejected']}') "
                                  "are wanted; a KTO loss reads unpaired data")
            first = first or (record_kind, record.where)
            if record_kind != first[0]:
                raise RecordError("mixed kinds", f"{record.where}: a record of {record_kind} in data of "
                                  f"{first[0]} (from {first[1]} on); one data set holds one kind")
            made = _tokenize(record, tokenizer, record_kind, kind if kind != "auto" else record_kind, names)
        except DataError as e:
            if on_error == "raise":
                raise
            stats.skipped += 1
            stats.skipped_records.append(Skip(record.file, record.location, getattr(e, "reason", "bad record"),
                                              str(e)))
            continue
        for example in made:
            example = cut.truncate(example, seq_len)
            if isinstance(example, PreferencePair) and example.chosen == example.rejected:
                stats.suspect(SAME_PAIR, record.where)
            found.append(example)
    skipped = skipped_in_order(read_stats, stats)
    if not found:
        raise DataError(f"{key} ({path}): no preference examples ({len(skipped)} record(s) skipped"
                        + (f"; first: {skipped[0].message})" if skipped else ")"))
    notes = data_notes(key, skipped, stats) + cut.notes(key, seq_len)
    if isinstance(found[0], PreferencePair):
        return [e for e in found if isinstance(e, PreferencePair)], skipped, notes
    return [e for e in found if isinstance(e, UnpairedExample)], skipped, notes


def _record_kind(fields: Mapping[str, Any], names: Mapping[str, str], where: str) -> str:
    if names["chosen"] in fields or names["rejected"] in fields:
        for name in (names["chosen"], names["rejected"]):
            if name not in fields:
                raise RecordError("missing field", f"{where}: missing field '{name}' of a preference pair (the "
                                                   f"record has {sorted(fields)[:10]})")
        return "pairs"
    if names["completion"] in fields or names["label"] in fields:
        for name in (names["prompt"], names["completion"], names["label"]):
            if name not in fields:
                raise RecordError("missing field", f"{where}: missing field '{name}' of an unpaired example (the "
                                                   f"record has {sorted(fields)[:10]})")
        return "unpaired"
    raise RecordError("no known fields", f"{where}: record has neither '{names['chosen']}'+'{names['rejected']}' "
                                         f"(pairs) nor '{names['prompt']}'+'{names['completion']}'+"
                                         f"'{names['label']}' (unpaired); it has {sorted(fields)[:10]}")


def _tokenize(record: Record, tokenizer: Tokenizer, record_kind: str, kind: str,
              names: Mapping[str, str]) -> list[PreferenceExample]:
    """The examples of one record: a pair, one unpaired example, or the two halves of a pair read as unpaired."""
    fields, where = record.fields, record.where
    if record_kind == "unpaired":
        prompt, completion = fields[names["prompt"]], fields[names["completion"]]
        desirable = _label(fields[names["label"]], where, names["label"])
        _check_side(completion, where, names["completion"])
        ids, (completion_ids,) = _tokenize_prompt_and(tokenizer, prompt, {names["completion"]: completion}, where,
                                                      names["prompt"])
        return [UnpairedExample(ids, completion_ids, desirable, where)]
    prompt, chosen, rejected = _split_prompt(fields, names, where)
    _check_side(chosen, where, names["chosen"])
    _check_side(rejected, where, names["rejected"])
    if kind == "unpaired":  # each half on its own, as TRL tokenizes the unpaired data set
        halves: list[PreferenceExample] = []
        for name, side, desirable in ((names["chosen"], chosen, True), (names["rejected"], rejected, False)):
            ids, (side_ids,) = _tokenize_prompt_and(tokenizer, prompt, {name: side}, where, names["prompt"])
            halves.append(UnpairedExample(ids, side_ids, desirable, where))
        return halves
    ids, (chosen_ids, rejected_ids) = _tokenize_prompt_and(
        tokenizer, prompt, {names["chosen"]: chosen, names["rejected"]: rejected}, where, names["prompt"])
    return [PreferencePair(ids, chosen_ids, rejected_ids, where)]


def _is_chat(value: Any) -> bool:
    return isinstance(value, list)


def _split_prompt(fields: Mapping[str, Any], names: Mapping[str, str], where: str) -> tuple[Any, Any, Any]:
    """``(prompt, chosen, rejected)``: the record's prompt, or (no prompt, or one of another kind than the
    completions, as TRL's ``maybe_extract_prompt`` decides) the common beginning of chosen and rejected."""
    chosen, rejected = fields[names["chosen"]], fields[names["rejected"]]
    for name, value in ((names["chosen"], chosen), (names["rejected"], rejected)):
        if not isinstance(value, (str, list)):
            raise RecordError("bad completion", f"{where}: field '{name}' must be a string or a list of messages, "
                                                f"got {type(value).__name__}")
    if _is_chat(chosen) != _is_chat(rejected):
        raise RecordError("bad completion", f"{where}: '{names['chosen']}' and '{names['rejected']}' must both be "
                                            "strings or both lists of messages")
    prompt = fields.get(names["prompt"])
    if prompt is not None and _is_chat(prompt) == _is_chat(chosen):
        return prompt, chosen, rejected
    # TRL's extract_prompt: the first index where they differ; a space just before it goes to the completions.
    # Where one is a prefix of the other TRL's loop ends one short of the shorter's length; kept for parity.
    shorter = min(len(chosen), len(rejected))
    if shorter == 0:
        empty = names["chosen"] if not chosen else names["rejected"]
        raise RecordError("empty completion", f"{where}: field '{empty}' is empty")
    idx = shorter - 1
    for i in range(shorter):
        if chosen[i] != rejected[i]:
            idx = i - 1 if i > 0 and chosen[i - 1] == " " else i
            break
    return chosen[:idx], chosen[idx:], rejected[idx:]


def _check_side(value: Any, where: str, name: str) -> None:
    """A completion is a non-empty string, or a non-empty list of messages with some content."""
    if isinstance(value, str):
        if not value.strip():
            raise RecordError("empty completion", f"{where}: field '{name}' is empty")
        check_text(value, where, name)
        return
    if not isinstance(value, list):
        raise RecordError("bad completion", f"{where}: field '{name}' must be a string or a list of messages, got "
                                            f"{type(value).__name__}")
    if not value:
        raise RecordError("empty completion", f"{where}: field '{name}' is an empty list of messages")
    messages = _messages_field({name: value}, name, where)
    if not any(isinstance(m.get("content"), str) and m["content"].strip() for m in messages):
        raise RecordError("empty completion", f"{where}: the messages of field '{name}' are empty")


def _label(value: Any, where: str, name: str) -> bool:
    """KTO's label: a boolean (CSV's ``true``/``false`` text too)."""
    if isinstance(value, bool):
        return value
    if isinstance(value, str) and value.strip().lower() in ("true", "false"):
        return value.strip().lower() == "true"
    raise RecordError("bad label", f"{where}: field '{name}' must be true or false (desirable or not), got "
                                   f"{str(value)[:40]!r}")


def _tokenize_prompt_and(tokenizer: Tokenizer, prompt: Any, completions: Mapping[str, Any], where: str,
                         prompt_name: str) -> tuple[list[int], list[list[int]]]:
    """TRL's tokenize step: ``(prompt ids, [completion ids])`` from the prompt alone and each prompt + completion
    (``completions``: field name -> value) tokenized whole, the prompt being the tokens they all share at the
    start."""
    chat = _is_chat(next(iter(completions.values())))
    if prompt is None:
        prompt = [] if chat else ""
    if chat:
        if not _is_chat(prompt):
            raise RecordError("bad prompt", f"{where}: field '{prompt_name}' must be a list of messages as the "
                                            "completions are")
        template = tokenizer.chat_template
        if template is None:
            raise RecordError("no chat template", f"{where}: conversations need a chat template, and the "
                                                  "tokenizer has none")
        messages = _messages_field({prompt_name: prompt}, prompt_name, where) if prompt else []
        alone = _chat_ids(tokenizer, template, messages, True, where)
        whole = [_chat_ids(tokenizer, template, messages + _messages_field({name: c}, name, where), False, where)
                 for name, c in completions.items()]
    else:
        if not isinstance(prompt, str):
            raise RecordError("bad prompt", f"{where}: field '{prompt_name}' must be a string as the completions "
                                            f"are, got {type(prompt).__name__}")
        eos = tokenizer.special_tokens.get("eos_token")
        if eos is None:
            raise DataError(f"{where}: preference completions end with EOS, and the tokenizer has no EOS token")
        check_text(prompt, where, prompt_name)
        alone = tokenizer.encode(prompt, add_special_tokens=True)
        whole = [tokenizer.encode(prompt + (c if c.endswith(eos) else c + eos), add_special_tokens=True)
                 for c in completions.values()]
    shared = min(_common_prefix(alone, ids) for ids in whole)
    return alone[:shared], [ids[shared:] for ids in whole]


def _chat_ids(tokenizer: Tokenizer, template: str, messages: list[dict[str, Any]], generation_prompt: bool,
              where: str) -> list[int]:
    try:
        text = render_chat(template, messages, generation_prompt, tokenizer.special_tokens, where)
    except RecordError:
        raise
    except DataError as e:
        raise RecordError("chat template rejected it", str(e)) from None
    # The template writes BOS itself where the model wants one, as transformers' apply_chat_template does.
    return tokenizer.encode(check_text(text, where, "messages"), add_special_tokens=False)


def _common_prefix(a: Sequence[int], b: Sequence[int]) -> int:
    n = 0
    for x, y in zip(a, b, strict=False):
        if x != y:
            break
        n += 1
    return n


class _Cuts:
    """Pairs (or unpaired examples) cut to ``seq_len``: the prompt from its start first, then completions at their
    end; counted for the notes."""

    def __init__(self) -> None:
        self.prompts = self.prompt_tokens = self.completions = self.completion_tokens = 0

    def truncate(self, example: PreferenceExample, seq_len: int) -> PreferenceExample:
        sides = example.sequences()
        longest = max(len(s) for s in sides)
        prompt = example.prompt
        if len(prompt) + longest <= seq_len:
            return example
        keep = max(seq_len - longest, min(len(prompt), seq_len // 2))
        if keep < len(prompt):
            self.prompts += 1
            self.prompt_tokens += len(prompt) - keep
            prompt = prompt[len(prompt) - keep:]
        room = seq_len - len(prompt)
        if longest > room:
            self.completions += 1
            self.completion_tokens += sum(max(0, len(s) - room) for s in sides)
        if isinstance(example, PreferencePair):
            return PreferencePair(prompt, example.chosen[:room], example.rejected[:room], example.origin)
        return UnpairedExample(prompt, example.completion[:room], example.desirable, example.origin)

    def notes(self, key: str, seq_len: int) -> list[str]:
        notes = []
        if self.prompts:
            notes.append(f"{key}: {self.prompts} prompt(s) cut from the start to fit seq_len={seq_len} beside their "
                         f"longer completion ({self.prompt_tokens:,} tokens dropped)")
        if self.completions:
            notes.append(f"{key}: {self.completions} example(s) with completions cut at the end to fit "
                         f"seq_len={seq_len} ({self.completion_tokens:,} tokens dropped)")
        return notes


# -- batches ------------------------------------------------------------------------------------------------


def collate_preference(examples: Sequence[PreferenceExample], indices: Sequence[int], seq_len: int, *,
                       packing: bool = True, pad_id: int = 0, pad_to: str = "seq_len",
                       kl: bool = False, share_prompt: bool = False) -> PreferenceBatch:
    """The micro-batch of ``examples[i]`` for ``i`` in ``indices``: each sequence (prompt + one completion) one
    document, packed best-fit into rows of ``seq_len`` or one a padded row (to ``seq_len``, or to the longest
    with ``pad_to="longest"``).

    ``kl`` (unpaired examples, KTO's KL estimate): after the n sequences of the examples come n mismatched ones,
    sequence n + k being example k's prompt with example k-1's completion (example 0 with the last one's), cut at
    the end to ``seq_len``: TRL's ``KL_completion_ids``, rotated by one within a batch. ``kl_offset`` = n then
    names the first of them. ``share_prompt`` (pairs): the ``shared_*`` keys of :func:`shared_prompt_layout` too."""
    sequences: list[Example] = []
    for i in indices:
        example = examples[i]
        for completion in example.sequences():
            sequences.append(_sequence(example.prompt, completion, seq_len, example.origin))
    if kl:
        units = [examples[i] for i in indices]
        if not all(isinstance(e, UnpairedExample) for e in units):
            raise ConfigError("kl: the mismatched sequences of KTO's KL estimate are made from unpaired examples")
        for k, example in enumerate(units):
            sequences.append(_sequence(example.prompt, units[k - 1].sequences()[0], seq_len, example.origin))
    if packing:
        rows = best_fit([len(s) for s in sequences], seq_len)
    else:
        rows = [[i] for i in range(len(sequences))]
    width = max(len(s) for s in sequences) if not packing and pad_to == "longest" else seq_len
    batch: PreferenceBatch = dict(collate([[sequences[i] for i in row] for row in rows], width, pad_id))
    sequence_ids = torch.full_like(batch["input_ids"], PAD_DOCUMENT)
    for r, row in enumerate(rows):
        start = 0
        for s in row:
            sequence_ids[r, start:start + len(sequences[s])] = s
            start += len(sequences[s])
    batch["sequence_ids"] = sequence_ids
    batch["num_sequences"] = len(sequences)
    batch["example_index"] = torch.tensor(list(indices), dtype=torch.long)
    unpaired = [examples[i] for i in indices if isinstance(examples[i], UnpairedExample)]
    if unpaired:
        batch["desirable"] = torch.tensor([e.desirable for e in unpaired if isinstance(e, UnpairedExample)])
    if kl:
        batch["kl_offset"] = len(indices)
    if share_prompt:
        pairs = [examples[i] for i in indices]
        if not all(isinstance(e, PreferencePair) for e in pairs):
            raise ConfigError("share_prompt: only a preference pair's two completions share a prompt (KTO's "
                              "examples are unpaired)")
        batch.update(shared_prompt_layout([e for e in pairs if isinstance(e, PreferencePair)]))
    return batch


def shared_prompt_layout(pairs: Sequence[PreferencePair]) -> dict[str, torch.Tensor | int]:
    """``pairs`` as one padding-free row computing each prompt once: the ``shared_*`` keys of a batch.

    Pair i is one stretch ``[prompt, chosen, rejected]`` of ``shared_input_ids`` ([M]) with the position ids of the
    unshared sequences (prompt and chosen ``0 .. P+C-1``, rejected ``P .. P+R-1``, as in ``[prompt, rejected]``),
    in two attention segments (``shared_cu_seqlens``, int32 [2 x pairs + 1]): the queries of prompt + chosen, then
    those of rejected. ``shared_kv_index`` ([K]) lists the tokens whose keys each segment attends
    (``shared_cu_seqlens_k``): prompt + chosen for the first, the prompt again then rejected for the second, so
    rejected never sees chosen; the queries are aligned with the last key (bottom-right causal).
    ``shared_sources``/``shared_targets``/``shared_owners`` ([completion tokens]): the position whose hidden state
    predicts each completion token (rejected's first from the prompt's last), the token, and its sequence (2i
    chosen, 2i+1 rejected). ``shared_max_seqlen``/``shared_max_seqlen_k``: the longest segments (Python ints);
    ``shared_tokens``: M, the tokens computed; ``shared_counted_tokens``: the tokens of the two sequences of each
    pair (what the rows hold, and what TRL computes)."""
    ids: list[int] = []
    positions: list[int] = []
    cu_q, cu_k, kv_index = [0], [0], []
    sources: list[int] = []
    targets: list[int] = []
    owners: list[int] = []
    for i, pair in enumerate(pairs):
        base, p, c, r = len(ids), len(pair.prompt), len(pair.chosen), len(pair.rejected)
        ids += pair.prompt + pair.chosen + pair.rejected
        positions += list(range(p + c)) + list(range(p, p + r))
        cu_q += [cu_q[-1] + p + c, cu_q[-1] + p + c + r]
        kv_index += list(range(base, base + p + c)) + list(range(base, base + p)) + \
            list(range(base + p + c, base + p + c + r))
        cu_k += [cu_k[-1] + p + c, cu_k[-1] + p + c + p + r]
        for owner, start, completion in ((2 * i, base + p, pair.chosen), (2 * i + 1, base + p + c, pair.rejected)):
            for j, token in enumerate(completion):
                # the token before: the prompt's last for a completion's first (none without a prompt, as in the
                # unshared sequence, whose first token is never a target)
                source = start + j - 1 if j else (base + p - 1 if p else -1)
                if source >= 0:
                    sources.append(source)
                    targets.append(token)
                    owners.append(owner)
    lengths_q = [b - a for a, b in zip(cu_q[:-1], cu_q[1:])]
    lengths_k = [b - a for a, b in zip(cu_k[:-1], cu_k[1:])]
    return {
        "shared_input_ids": torch.tensor(ids, dtype=torch.long),
        "shared_position_ids": torch.tensor(positions, dtype=torch.long),
        "shared_cu_seqlens": torch.tensor(cu_q, dtype=torch.int32),
        "shared_max_seqlen": max(lengths_q, default=0),
        "shared_kv_index": torch.tensor(kv_index, dtype=torch.long),
        "shared_cu_seqlens_k": torch.tensor(cu_k, dtype=torch.int32),
        "shared_max_seqlen_k": max(lengths_k, default=0),
        "shared_sources": torch.tensor(sources, dtype=torch.long),
        "shared_targets": torch.tensor(targets, dtype=torch.long),
        "shared_owners": torch.tensor(owners, dtype=torch.long),
        "shared_tokens": len(ids),
        "shared_counted_tokens": sum(2 * len(e.prompt) + len(e.chosen) + len(e.rejected) for e in pairs),
    }


def _sequence(prompt: list[int], completion: Sequence[int], seq_len: int, origin: str) -> Example:
    """Prompt + completion as one document, loss on the completion; cut at the end to ``seq_len`` (only a KL
    sequence can be longer: the others were cut when read)."""
    completion = list(completion[:seq_len - len(prompt)])
    return Example(prompt + completion, [IGNORE_INDEX] * len(prompt) + completion, origin)


def _check_examples(examples: Sequence[PreferenceExample], seq_len: int) -> None:
    if not examples:
        raise DataError("no preference examples to batch")
    kinds = {type(e) for e in examples}
    if len(kinds) > 1 or not kinds <= {PreferencePair, UnpairedExample}:
        raise DataError(f"preference examples must be all PreferencePair or all UnpairedExample, got "
                        f"{sorted(k.__name__ for k in kinds)}")
    for index, example in enumerate(examples):
        for completion in example.sequences():
            n = len(example.prompt) + len(completion)
            if not completion or n > seq_len:
                where = example.origin or f"example {index}"
                raise DataError(f"{where}: a sequence of {n} tokens with {len(completion)} of completion; each must "
                                f"have a completion and at most seq_len={seq_len} tokens (read_preference_file cuts)")


class PreferenceStream:
    """An endless, deterministic stream of micro-batches of ``batch_size`` pairs (or unpaired examples).

    Each epoch visits every example once, in an order drawn from ``(seed, epoch)`` when ``shuffle`` is set; a
    micro-batch takes the next ``batch_size`` of that order (continuing into the next epoch at its end), so both
    sequences of a pair are always in one micro-batch. The stream is a pure function of ``(seed, epoch,
    position)``, saved by :meth:`state_dict` and restored by :meth:`load_state_dict`: a resumed stream gives the
    batch an uninterrupted one would."""

    def __init__(
        self,
        examples: Sequence[PreferenceExample],
        batch_size: int,
        seq_len: int,
        *,
        packing: bool = True,
        shuffle: bool = True,
        seed: int = 0,
        pad_id: int = 0,
        pad_to: str = "seq_len",
        kl: bool = False,
        share_prompt: bool = False,
    ) -> None:
        if batch_size < 1 or seq_len < 2:
            raise ConfigError(f"batch_size must be >= 1 and seq_len >= 2, got {batch_size} and {seq_len}")
        if pad_to not in ("seq_len", "longest"):
            raise ConfigError(f"pad_to {pad_to!r} must be 'seq_len' or 'longest'")
        _check_examples(examples, seq_len)
        if kl and not isinstance(examples[0], UnpairedExample):
            raise ConfigError("kl: the mismatched sequences of KTO's KL estimate are made from unpaired examples")
        if share_prompt and not isinstance(examples[0], PreferencePair):
            raise ConfigError("share_prompt: only a preference pair's two completions share a prompt (KTO's "
                              "examples are unpaired)")
        self.examples = examples
        self.batch_size = batch_size
        self.seq_len = seq_len
        self.packing = packing
        self.shuffle = shuffle
        self.seed = seed
        self.pad_id = pad_id
        self.pad_to = pad_to
        self.kl = kl
        self.share_prompt = share_prompt  # the shared_* keys too (pairs)
        self.cursor = EpochCursor(len(examples), shuffle, seed)  # the seeded order BatchStream visits too

    def __iter__(self) -> PreferenceStream:
        return self

    def __next__(self) -> PreferenceBatch:
        return collate_preference(self.examples, self.cursor.take(self.batch_size), self.seq_len, packing=self.packing,
                                  pad_id=self.pad_id, pad_to=self.pad_to, kl=self.kl,
                                  share_prompt=self.share_prompt)

    def rows_per_epoch(self) -> int:
        """Units (pairs or unpaired examples) of one epoch: what ``batch_size`` counts, so ``training.epochs``
        resolves as it does for BatchStream's rows."""
        return len(self.examples)

    def skip(self, batches: int) -> None:
        """Move past ``batches`` micro-batches without building them (another rank's share of a step)."""
        self.cursor.take(batches * self.batch_size)

    def state_dict(self) -> dict[str, int | str]:
        """Where the stream is, as JSON-able values (with the dataset size and seed, checked on load)."""
        return {"epoch": self.cursor.epoch, "position": self.cursor.position, "num_examples": len(self.examples),
                "seed": self.seed, "stream": "preference"}

    def load_state_dict(self, state: Mapping[str, Any]) -> None:
        """Continue from ``state``; refuses a state taken over other data, another seed or another kind of
        stream."""
        try:
            epoch, position = int(state["epoch"]), int(state["position"])
        except (KeyError, TypeError, ValueError) as e:
            raise CheckpointError(f"data stream state {state!r} lacks integer 'epoch' and 'position'") from e
        check_stream_state(state, {"num_examples": len(self.examples), "seed": self.seed, "stream": "preference"},
                           epoch, position)
        self.cursor.seek(epoch, position)


def preference_eval_batches(examples: Sequence[PreferenceExample], batch_size: int, seq_len: int, *,
                            packing: bool = True, pad_id: int = 0, kl: bool = False,
                            share_prompt: bool = False) -> list[PreferenceBatch]:
    """Every example once, in order, ``batch_size`` a micro-batch (the last may hold fewer): held-out evaluation."""
    if batch_size < 1:
        raise ConfigError(f"batch_size must be >= 1, got {batch_size}")
    _check_examples(examples, seq_len)
    return [collate_preference(examples, range(start, min(start + batch_size, len(examples))), seq_len,
                               packing=packing, pad_id=pad_id, kl=kl, share_prompt=share_prompt)
            for start in range(0, len(examples), batch_size)]


__all__ = ["COLUMNS", "KINDS", "PreferenceBatch", "PreferenceExample", "PreferencePair", "PreferenceStream",
           "UnpairedExample", "collate_preference", "preference_columns", "preference_eval_batches",
           "read_preference_file", "shared_prompt_layout"]
