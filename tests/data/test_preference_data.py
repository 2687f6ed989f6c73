"""Preference data: TRL's formats tokenized as TRL's trainers tokenize them, errors naming file and line, pairs kept
together in packed or padded micro-batches, streams that resume exactly."""

from __future__ import annotations

import csv
import json
import types

import pytest
import torch
from tiny_chat_tokenizer import BOS, CHATML, EOS, chat_backend, chat_tokenizer

from entrenar.data.batching import packed_documents, padding_free, split_validation
from entrenar.data.preference import (
    PreferencePair,
    PreferenceStream,
    UnpairedExample,
    collate_preference,
    preference_eval_batches,
    read_preference_file,
)
from entrenar.data.tokenize import IGNORE_INDEX
from entrenar.errors import CheckpointError, DataError

M = IGNORE_INDEX
USER = "What is the capital of France?"
PAIRS = [
    {"prompt": USER, "chosen": " Paris.", "rejected": " The fox."},
    {"prompt": "The quick brown fox", "chosen": " jumps over the lazy dog.", "rejected": " is a dog"},
    # Tokens merge across the boundary (" capital"): the prompt is what it shares with both, without its space.
    {"prompt": "What is the ", "chosen": "capital of France?", "rejected": "fox?"},
]
IMPLICIT = [
    {"chosen": "The quick brown fox jumps.", "rejected": "The quick brown dog sleeps."},
    {"chosen": "The capital of France is Paris.", "rejected": "The capital of France is a fox."},
]
CONVERSATIONS = [
    {"prompt": [{"role": "user", "content": USER}], "chosen": [{"role": "assistant", "content": "Paris."}],
     "rejected": [{"role": "assistant", "content": "Lyon, the fox."}]},
    {"prompt": [{"role": "system", "content": "Answer, then stop."}, {"role": "user", "content": "The quick?"}],
     "chosen": [{"role": "assistant", "content": "Brown fox."}],
     "rejected": [{"role": "assistant", "content": "Lazy dog."}]},
]
IMPLICIT_CONVERSATIONS = [  # TRL's implicit prompt: the messages both share
    {"chosen": c["prompt"] + c["chosen"], "rejected": c["prompt"] + c["rejected"]} for c in CONVERSATIONS
]
UNPAIRED = [
    {"prompt": USER, "completion": " Paris.", "label": True},
    {"prompt": "The quick brown fox", "completion": " is a dog", "label": False},
]


@pytest.fixture(scope="module")
def tokenizer():
    return chat_tokenizer()


def write_jsonl(path, records):
    path.write_text("".join(json.dumps(r) + "\n" for r in records))
    return path


def read(path, tokenizer, **kw):
    kw.setdefault("seq_len", 128)
    return read_preference_file(str(path), tokenizer, **kw)


# -- tokenization: TRL's ------------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def trl_prepare():
    """TRL's own dataset preparation (extract prompt, add EOS, tokenize) of DPOTrainer and KTOTrainer, run on a
    transformers tokenizer over the same tokenizer.json (no model: only the tokenize step)."""
    from datasets import Dataset
    from transformers import PreTrainedTokenizerFast
    from trl import DPOTrainer, KTOTrainer

    hf = PreTrainedTokenizerFast(tokenizer_object=chat_backend(), bos_token=BOS, eos_token=EOS, chat_template=CHATML)
    def prepare(records, kto=False, kl_batch=None):
        args = types.SimpleNamespace(dataset_num_proc=None, max_length=None, truncation_mode="keep_start",
                                     per_device_train_batch_size=kl_batch)
        trainer = types.SimpleNamespace(_tokenizer=hf, calculate_KL=kl_batch is not None, desirable_weight=1.0,
                                        undesirable_weight=1.0)
        cls = KTOTrainer if kto else DPOTrainer
        return list(cls._prepare_dataset(trainer, Dataset.from_list(records), hf, args, "train"))

    return prepare


@pytest.mark.parametrize("records", [PAIRS, IMPLICIT, CONVERSATIONS, IMPLICIT_CONVERSATIONS],
                         ids=["strings", "implicit", "conversations", "implicit-conversations"])
def test_pairs_tokenize_as_trl_dpo_trainer(tmp_path, tokenizer, trl_prepare, records):
    pairs, skipped, notes = read(write_jsonl(tmp_path / "p.jsonl", records), tokenizer)
    reference = trl_prepare(records)
    assert [(p.prompt, p.chosen, p.rejected) for p in pairs] == \
        [(r["prompt_ids"], r["chosen_ids"], r["rejected_ids"]) for r in reference]
    assert not skipped and not notes
    assert all(p.chosen[-1] in (tokenizer.eos_id, tokenizer.encode("\n", add_special_tokens=False)[0])
               for p in pairs)


def test_unpaired_tokenize_as_trl_kto_trainer(tmp_path, tokenizer, trl_prepare):
    examples, _, _ = read(write_jsonl(tmp_path / "u.jsonl", UNPAIRED), tokenizer)
    assert [(e.prompt, e.completion, e.desirable) for e in examples] == \
        [(r["prompt_ids"], r["completion_ids"], r["label"]) for r in trl_prepare(UNPAIRED, kto=True)]
    # Pairs read as unpaired: TRL's KTOTrainer unpairs them (chosen desirable, rejected not).
    split, _, _ = read(write_jsonl(tmp_path / "p.jsonl", PAIRS), tokenizer, kind="unpaired")
    key = sorted((e.prompt, e.completion, e.desirable) for e in split)
    assert key == sorted((r["prompt_ids"], r["completion_ids"], r["label"]) for r in trl_prepare(PAIRS, kto=True))
    assert [e.desirable for e in split] == [True, False] * len(PAIRS)  # a pair's halves stay neighbours


def test_kl_sequences_are_trl_kto_mismatched_pairs(tmp_path, tokenizer, trl_prepare):
    """KTO's KL estimate: example k's prompt with example k-1's completion within a batch, as TRL rotates them
    within each batch of per_device_train_batch_size (in data order: our unshuffled batches)."""
    records = UNPAIRED + [{"prompt": p["prompt"], "completion": p["chosen"], "label": bool(i % 2)}
                          for i, p in enumerate(PAIRS)]
    examples, _, _ = read(write_jsonl(tmp_path / "u.jsonl", records), tokenizer)
    reference = trl_prepare(records, kto=True, kl_batch=3)
    batches = preference_eval_batches(examples, batch_size=3, seq_len=128, packing=True, pad_id=0, kl=True)
    kl = []
    for batch in batches:
        found = sequences_of(batch)
        n = batch["kl_offset"]
        assert batch["num_sequences"] == 2 * n and batch["desirable"].shape == (n,)
        kl += [found[n + k] for k in range(n)]
    assert [tokens for tokens, _ in kl] == [r["prompt_ids"] + r["KL_completion_ids"] for r in reference]
    assert [labels for _, labels in kl] == [[M] * len(r["prompt_ids"]) + r["KL_completion_ids"] for r in reference]


def test_padded_batch_equals_trl_collator(tmp_path, tokenizer, trl_prepare):
    """TRL's DataCollatorForPreference lays out chosen rows then rejected rows; ours interleaves them (sequence 2i,
    2i+1): the same rows, and loss exactly on TRL's completion mask."""
    from trl.trainer.dpo_trainer import DataCollatorForPreference

    pairs, _, _ = read(write_jsonl(tmp_path / "p.jsonl", PAIRS), tokenizer)
    reference = DataCollatorForPreference(pad_token_id=0)(
        [{k: r[k] for k in ("prompt_ids", "chosen_ids", "rejected_ids")} for r in trl_prepare(PAIRS)])
    batch = collate_preference(pairs, [0, 1, 2], 128, packing=False, pad_id=0, pad_to="longest")
    order = [0, 3, 1, 4, 2, 5]  # ours (c0, r0, c1, r1, ...) in TRL's rows (c0, c1, c2, r0, r1, r2)
    assert torch.equal(batch["input_ids"], reference["input_ids"][order])
    assert torch.equal(batch["labels"] != M, reference["completion_mask"][order].bool())
    assert torch.equal(batch["document_ids"] >= 0, reference["attention_mask"][order].bool())


# -- formats, columns, files --------------------------------------------------------------------------------


def test_columns_renamed_and_files_of_each_kind(tmp_path, tokenizer):
    renamed = [{"question": r["prompt"], "good": r["chosen"], "bad": r["rejected"]} for r in PAIRS]
    columns = {"prompt": "question", "chosen": "good", "rejected": "bad"}
    expected, _, _ = read(write_jsonl(tmp_path / "p.jsonl", PAIRS), tokenizer)
    jsonl, _, _ = read(write_jsonl(tmp_path / "r.jsonl", renamed), tokenizer, columns=columns)
    (tmp_path / "r.json").write_text(json.dumps(renamed, indent=1))
    as_json, _, _ = read(tmp_path / "r.json", tokenizer, columns=columns)
    with open(tmp_path / "r.csv", "w", newline="") as f:
        writer = csv.DictWriter(f, ["question", "good", "bad"])
        writer.writeheader()
        writer.writerows(renamed)
    as_csv, _, _ = read(tmp_path / "r.csv", tokenizer, columns=columns)
    import pyarrow as pa
    import pyarrow.parquet as pq

    pq.write_table(pa.Table.from_pylist(renamed), tmp_path / "r.parquet")
    as_parquet, _, _ = read(tmp_path / "r.parquet", tokenizer, columns=columns)
    strip = [(p.prompt, p.chosen, p.rejected) for p in expected]
    for found in (jsonl, as_json, as_csv, as_parquet):
        assert [(p.prompt, p.chosen, p.rejected) for p in found] == strip


def test_csv_labels_read_as_booleans(tmp_path, tokenizer):
    path = tmp_path / "u.csv"
    path.write_text("prompt,completion,label\nThe quick,\" fox.\",true\nThe lazy,\" dog.\",False\n")
    examples, _, _ = read(path, tokenizer)
    assert [e.desirable for e in examples] == [True, False]


# -- bad input: one DataError naming file, line and field; or a counted skip --------------------------------


@pytest.mark.parametrize(("record", "message"), [
    ({"prompt": "a", "chosen": "b"}, r"line 2: missing field 'rejected'"),
    ({"prompt": "a", "chosen": "   ", "rejected": "c"}, r"line 2: field 'chosen' is empty"),
    ({"prompt": "a", "chosen": [], "rejected": []}, r"line 2: field 'chosen' is empty"),
    ({"prompt": "a", "chosen": 3, "rejected": "c"}, r"line 2: field 'chosen' must be a string or a list"),
    ({"prompt": "a", "completion": "b", "label": True}, r"line 2: a record of unpaired in data of pairs "
                                                         r"\(from .*line 1 on\)"),
    ({"text": "a"}, r"line 2: record has neither 'chosen'\+'rejected'"),
])
def test_bad_record_names_file_line_and_field(tmp_path, tokenizer, record, message):
    path = write_jsonl(tmp_path / "bad.jsonl", [PAIRS[0], record, PAIRS[1]])
    with pytest.raises(DataError, match=rf"bad\.jsonl {message}"):
        read(path, tokenizer)
    pairs, skipped, notes = read(path, tokenizer, on_error="skip", key="data.train")
    assert len(pairs) == 2 and [(s.file, s.line) for s in skipped] == [(str(path), 2)]  # PAIRS[0], PAIRS[1]
    assert notes[0].startswith("data.train: 1 malformed record(s) skipped")


def test_bad_label_and_pairs_wanted(tmp_path, tokenizer):
    path = write_jsonl(tmp_path / "u.jsonl", [UNPAIRED[0], {**UNPAIRED[1], "label": "maybe"}])
    with pytest.raises(DataError, match=r"u\.jsonl line 2: field 'label' must be true or false"):
        read(path, tokenizer)
    with pytest.raises(DataError, match=r"u\.jsonl line 1: an unpaired record .* where pairs"):
        read(path, tokenizer, kind="pairs")


def test_conversation_needs_a_chat_template(tmp_path):
    from entrenar.data.tokenizer import Tokenizer

    plain = Tokenizer(chat_backend(), bos_token=BOS, eos_token=EOS)
    with pytest.raises(DataError, match=r"c\.jsonl line 1: conversations need a chat template"):
        read(write_jsonl(tmp_path / "c.jsonl", CONVERSATIONS), plain)


def test_chosen_equal_to_rejected_is_noted_and_kept(tmp_path, tokenizer):
    path = write_jsonl(tmp_path / "p.jsonl", [PAIRS[0], {**PAIRS[1], "rejected": PAIRS[1]["chosen"]}])
    pairs, _, notes = read(path, tokenizer, key="data.train")
    assert len(pairs) == 2 and pairs[1].chosen == pairs[1].rejected
    assert notes == [f"data.train: taken as written, but likely mistakes: 1 with chosen == rejected (no preference "
                     f"to learn) (first: {path} line 2)"]


def test_nothing_left_is_one_error(tmp_path, tokenizer):
    path = write_jsonl(tmp_path / "p.jsonl", [{"prompt": "a", "chosen": "", "rejected": "b"}])
    with pytest.raises(DataError, match=r"data\.train .*no preference examples \(1 record\(s\) skipped; first: "
                                         r".*line 1: field 'chosen' is empty"):
        read(path, tokenizer, on_error="skip", key="data.train")


# -- truncation ---------------------------------------------------------------------------------------------


def test_truncation_keeps_the_prompt_end_then_cuts_completions(tmp_path, tokenizer):
    long_prompt = {"prompt": " ".join(["The quick brown fox jumps over the lazy dog."] * 4),
                   "chosen": " Paris.", "rejected": " The capital of France is Paris."}
    whole, _, _ = read(write_jsonl(tmp_path / "a.jsonl", [long_prompt]), tokenizer, seq_len=512)
    (full,) = whole
    seq_len = 40
    (cut,), _, notes = read(write_jsonl(tmp_path / "b.jsonl", [long_prompt]), tokenizer, seq_len=seq_len,
                            key="data.train")
    longest = max(len(full.chosen), len(full.rejected))
    assert cut.prompt == full.prompt[-(seq_len - longest):]  # its end, beside the longer completion
    assert (cut.chosen, cut.rejected) == (full.chosen, full.rejected)
    assert notes == [f"data.train: 1 prompt(s) cut from the start to fit seq_len={seq_len} beside their longer "
                     f"completion ({len(full.prompt) - len(cut.prompt)} tokens dropped)"]

    seq_len = 2 * len(full.chosen) + 2  # the long rejected completion leaves less than half for the prompt
    (cut,), _, notes = read(write_jsonl(tmp_path / "c.jsonl", [long_prompt]), tokenizer, seq_len=seq_len)
    assert cut.prompt == full.prompt[-(seq_len // 2):]
    assert cut.chosen == full.chosen and cut.rejected == full.rejected[:seq_len - seq_len // 2]
    assert len(notes) == 2 and "1 example(s) with completions cut at the end" in notes[1]
    assert f"({len(full.rejected) - (seq_len - seq_len // 2)} tokens dropped)" in notes[1]


# -- batches ------------------------------------------------------------------------------------------------


def synthetic_pairs(n: int, seed: int = 0) -> list[PreferencePair]:
    """Pairs of random lengths whose ids encode (pair, part): prompt 1000*i + j, chosen 2000..., rejected 3000..."""
    g = torch.Generator().manual_seed(seed)

    def length(low: int, high: int) -> int:
        return int(torch.randint(low, high + 1, (1,), generator=g))

    return [PreferencePair([10_000 * i + j for j in range(length(1, 6))], [10_000 * i + 2000 + j for j in
                           range(length(1, 5))], [10_000 * i + 3000 + j for j in range(length(1, 5))], f"pair {i}")
            for i in range(n)]


def sequences_of(batch) -> dict[int, tuple[list[int], list[int]]]:
    """Sequence id -> (its tokens, its labels), read back from a batch through sequence_ids."""
    ids, labels, seq = batch["input_ids"], batch["labels"], batch["sequence_ids"]
    return {s: (ids[seq == s].tolist(), labels[seq == s].tolist()) for s in range(batch["num_sequences"])}


@pytest.mark.parametrize("packing", [True, False])
def test_pairs_travel_together_with_loss_on_completions_only(packing):
    pairs = synthetic_pairs(7)
    stream = PreferenceStream(pairs, batch_size=3, seq_len=16, packing=packing, seed=1)
    for _ in range(5):
        batch = next(stream)
        assert batch["num_sequences"] == 6 and batch["example_index"].shape == (3,)
        found = sequences_of(batch)
        for k, i in enumerate(batch["example_index"].tolist()):
            p = pairs[i]
            for s, completion in ((2 * k, p.chosen), (2 * k + 1, p.rejected)):
                assert found[s][0] == p.prompt + completion
                assert found[s][1] == [M] * len(p.prompt) + completion
        assert ((batch["sequence_ids"] < 0) == (batch["document_ids"] < 0)).all()
        assert ((batch["labels"] != M) <= (batch["sequence_ids"] >= 0)).all()
        if not packing:
            assert batch["input_ids"].shape == (6, 16)


def test_packing_is_one_document_per_sequence_for_varlen_attention():
    pairs = synthetic_pairs(9, seed=3)
    batch = next(PreferenceStream(pairs, batch_size=4, seq_len=20, seed=2))
    assert batch["input_ids"].shape[0] < 8  # packed: fewer rows than sequences
    lengths = [len(tokens) for tokens, _ in sequences_of(batch).values()]

    flat = padding_free(batch)
    cu = flat["cu_seqlens"].tolist()
    keep = batch["document_ids"] >= 0
    sequence_of_token = batch["sequence_ids"][keep]  # in padding_free's token order
    spans = [sequence_of_token[a:b].unique().tolist() for a, b in zip(cu, cu[1:], strict=False)]
    assert all(len(span) == 1 for span in spans)  # each document is one sequence ...
    assert sorted(s for (s,) in spans) == list(range(batch["num_sequences"]))  # ... and each sequence one document
    assert sorted(b - a for a, b in zip(cu, cu[1:], strict=False)) == sorted(lengths)
    assert (flat["position_ids"][0] == torch.cat([torch.arange(n) for n in (b - a for a, b in
                                                   zip(cu, cu[1:], strict=False))])).all()

    packed = packed_documents(batch)
    seq = batch["sequence_ids"].flatten()
    cu = packed["cu_seqlens"].tolist()
    segments = [seq[a:b].unique().tolist() for a, b in zip(cu, cu[1:], strict=False)]
    assert sorted(s for (s,) in segments if s >= 0) == list(range(batch["num_sequences"]))


def test_unpaired_batches_carry_desirable():
    examples = [UnpairedExample([1, 2], [3, 4], True, "a"), UnpairedExample([5], [6, 7, 8], False, "b"),
                UnpairedExample([9, 10, 11], [12], True, "c")]
    batch = next(PreferenceStream(examples, batch_size=3, seq_len=8, shuffle=False))
    assert batch["num_sequences"] == 3 and batch["example_index"].tolist() == [0, 1, 2]
    assert batch["desirable"].tolist() == [True, False, True]
    assert sequences_of(batch)[1] == ([5, 6, 7, 8], [M, 6, 7, 8])


def test_stream_resumes_exactly_and_skips_as_it_steps():
    pairs = synthetic_pairs(11, seed=5)
    stream = PreferenceStream(pairs, batch_size=4, seq_len=16, seed=7)
    for _ in range(4):  # past the end of the first epoch (11 pairs)
        next(stream)
    state = json.loads(json.dumps(stream.state_dict()))  # as a checkpoint stores it
    expected = [next(stream) for _ in range(3)]

    resumed = PreferenceStream(pairs, batch_size=4, seq_len=16, seed=7)
    resumed.load_state_dict(state)
    skipped = PreferenceStream(pairs, batch_size=4, seq_len=16, seed=7)
    skipped.skip(4)
    for want in expected:
        for got in (next(resumed), next(skipped)):
            assert got.keys() == want.keys()
            assert all(torch.equal(got[k], want[k]) if isinstance(want[k], torch.Tensor) else got[k] == want[k]
                       for k in want)
    with pytest.raises(CheckpointError, match="seed=7 but this run has seed=8"):
        PreferenceStream(pairs, batch_size=4, seq_len=16, seed=8).load_state_dict(state)
    with pytest.raises(CheckpointError, match="stream"):
        stream.load_state_dict({"epoch": 0, "position": 0, "num_examples": 11, "seed": 7, "stream": "lm"})


def test_each_epoch_visits_every_pair_once_in_a_seeded_order():
    pairs = synthetic_pairs(12)
    stream = PreferenceStream(pairs, batch_size=4, seq_len=16, seed=3)
    assert stream.rows_per_epoch() == 12
    epochs = [[i for _ in range(3) for i in next(stream)["example_index"].tolist()] for _ in range(2)]
    assert sorted(epochs[0]) == sorted(epochs[1]) == list(range(12)) and epochs[0] != epochs[1]
    again = PreferenceStream(pairs, batch_size=4, seq_len=16, seed=3)
    assert [i for _ in range(3) for i in next(again)["example_index"].tolist()] == epochs[0]


def test_eval_batches_visit_every_pair_once_in_order():
    pairs = synthetic_pairs(7, seed=2)
    batches = preference_eval_batches(pairs, batch_size=3, seq_len=16, packing=True, pad_id=0)
    assert [b["example_index"].tolist() for b in batches] == [[0, 1, 2], [3, 4, 5], [6]]
    assert batches[-1]["num_sequences"] == 2


def test_stream_refuses_sequences_longer_than_seq_len_and_empty_data():
    with pytest.raises(DataError, match="pair 0: a sequence of 9 tokens"):
        PreferenceStream([PreferencePair([1] * 6, [2, 3, 4], [5], "pair 0")], batch_size=1, seq_len=8)
    with pytest.raises(DataError, match="no preference examples"):
        PreferenceStream([], batch_size=1, seq_len=8)


def test_validation_split_fits_pairs():
    pairs = synthetic_pairs(10)
    train, held_out = split_validation(pairs, 0.2, seed=1)
    assert len(held_out) == 2 and sorted(p.origin for p in train + held_out) == sorted(p.origin for p in pairs)


def test_unreadable_and_untokenizable_records_skipped_in_file_order(tmp_path, tokenizer):
    path = tmp_path / "p.jsonl"
    path.write_text(json.dumps(PAIRS[0]) + "\n" + json.dumps({"prompt": "a", "chosen": "", "rejected": "b"}) + "\n"
                    + '{"prompt": "broken\n' + json.dumps(PAIRS[1]) + "\n")
    pairs, skipped, notes = read(path, tokenizer, on_error="skip", key="data.train")
    assert len(pairs) == 2
    assert [(s.line, s.reason) for s in skipped] == [(2, "empty completion"), (3, "invalid JSON")]
    assert "2 malformed record(s) skipped (1 empty completion, 1 invalid JSON)" in notes[0]
