"""Bad data is one DataError naming file and line (or, with on_error=skip, a counted skip), never a crash."""

from __future__ import annotations

import csv
import json
import random
import re
import sys

import pytest
from tiny_chat_tokenizer import BOS, CHATML, EOS, chat_backend, chat_tokenizer

from entrenar.data.report import data_notes, skipped_in_order, write_skipped
from entrenar.data.sources import read_records
from entrenar.data.tokenize import tokenize_record, tokenize_records
from entrenar.data.tokenizer import Tokenizer
from entrenar.errors import DataError
from entrenar.tasks.classification.data import read_texts

DEEP = "[" * 5000 + "]" * 5000
LONG_INT = "9" * (sys.get_int_max_str_digits() + 1)


@pytest.fixture(scope="module")
def tokenizer():
    return chat_tokenizer()


def lines(*texts: str) -> str:
    return "".join(t + "\n" for t in texts)


def read_and_tokenize(path, tokenizer, on_error="raise"):
    records, read = read_records(path, on_error=on_error)
    examples, stats = tokenize_records(records, tokenizer, seq_len=64, on_error=on_error)
    return examples, read, stats


@pytest.mark.parametrize(("bad", "reason", "message"), [
    ('{"text": ' + DEEP + "}", "nested too deeply", "invalid JSON: nested too deeply to read"),
    ('{"text": "a", "id": ' + LONG_INT + "}", "number too long", "invalid JSON: an integer longer than"),
    ('{"text": "lone \\ud800 surrogate"}', "invalid text",
     r"field 'text' is not valid Unicode text: \ud800 at character 5 is a lone surrogate"),
    ('{"prompt": "p", "completion": 7}', "field not a string", "field 'completion' must be a string, got int"),
    ('{"text": null}', "field not a string", "field 'text' must be a string, got NoneType"),
    ('{"messages": [{"role": "user", "content": ["a", "list"]}]}', "bad messages",
     "messages[0].content must be a string, got list"),
    ('{"messages": [{"role": "user", "content": "\\udfff"}, {"role": "assistant", "content": "x"}]}',
     "invalid text", "field 'messages' is not valid Unicode text"),
    ('{"messages": [{"role": "us\\ud800er", "content": "q"}, {"role": "assistant", "content": "x"}]}',
     "invalid text", r"field 'messages' is not valid Unicode text: \ud800 at character 14 is a lone surrogate"),
    ('{"conversations": [{"from": "human", "value": "q"}, {"from": "gpt", "value": "\\udc00"}]}',
     "invalid text", r"field 'messages' is not valid Unicode text: \udc00"),
    ('{"instruction": "\\ud800", "output": "x"}', "invalid text", "field 'messages' is not valid Unicode text"),
    ('\ufeff{"text": "joined"}', "byte-order mark",
     "a byte-order mark (U+FEFF) starts the line, which belongs only at the start of a file"),
    ('{"text": "a\\ufeffb"}', "byte-order mark", "field 'text' holds a byte-order mark (U+FEFF) at character 1"),
    ('{"prompt": "p", "completion": "\ufeff"}', "byte-order mark", "field 'completion' holds a byte-order mark"),
], ids=["deep", "long-int", "surrogate", "int-completion", "null-text", "list-content", "surrogate-chat",
        "surrogate-role", "surrogate-sharegpt", "surrogate-alpaca", "bom-line", "bom-escaped", "bom-raw"])
def test_each_bad_record_is_one_error_naming_file_and_line_or_a_counted_skip(tmp_path, tokenizer, bad, reason,
                                                                              message):
    path = tmp_path / "train.jsonl"
    path.write_text(lines('{"text": "fox"}', '{"text": "dog"}', bad, '{"text": "end"}'))
    with pytest.raises(DataError, match="^" + re.escape(f"{path} line 3: {message}")):
        read_and_tokenize(path, tokenizer)
    examples, read, stats = read_and_tokenize(path, tokenizer, on_error="skip")
    assert len(examples) == 3
    (skip,) = skipped_in_order(read, stats)
    assert (skip.file, skip.line, skip.reason) == (str(path), 3, reason)
    assert skip.message.startswith(f"{path} line 3: {message}")


def test_a_json_document_that_breaks_json_names_the_line(tmp_path, tokenizer):
    deep = tmp_path / "deep.json"
    deep.write_text('[\n{"text": "a"},\n{"text": ' + DEEP + "}\n]")
    with pytest.raises(DataError, match=re.escape(f"{deep} line 3: invalid JSON: nested too deeply")):
        read_records(deep, on_error="skip")  # one document: its own parse fails, whatever the mode
    long = tmp_path / "long.json"
    long.write_text('{"data": [\n{"text": "a"},\n{"text": "b", "n": ' + LONG_INT + "}]}")
    with pytest.raises(DataError, match=re.escape(f"{long} line 3: invalid JSON: an integer longer than")):
        read_records(long)


def test_csv_fields_longer_than_the_csv_module_default_are_read(tmp_path, tokenizer):
    limit = csv.field_size_limit()
    text = "word " * 60_000  # 300,000 characters, over the csv module's 131,072
    path = tmp_path / "long.csv"
    with open(path, "w", newline="") as f:
        csv.writer(f).writerows([["text"], [text], ["short"]])
    records, _ = read_records(path)
    assert [r.fields["text"] for r in records] == [text, "short"]
    assert csv.field_size_limit() == limit  # the process-wide limit is left as it was


def test_skipped_records_are_listed_in_file_order_and_counted_by_reason(tmp_path, tokenizer):
    path = tmp_path / "train.jsonl"
    path.write_text(lines(
        '{"text": 1}',                      # line 1: found by the tokenizer
        "not json",                         # line 2: found by the reader
        '{"text": "ok"}',
        '{"prompt": "p"}',                  # line 4: tokenizer
        "[1]",                              # line 5: reader
        '{"text": "\\ud800"}',              # line 6: tokenizer
    ))
    examples, read, stats = read_and_tokenize(path, tokenizer, on_error="skip")
    skipped = skipped_in_order(read, stats)
    assert [(s.line, s.reason) for s in skipped] == [
        (1, "field not a string"), (2, "invalid JSON"), (4, "missing field"), (5, "not an object"),
        (6, "invalid text")]
    (note,) = data_notes("data.train", skipped, stats)
    assert note.startswith("data.train: 5 malformed record(s) skipped (")
    assert f"first: {path} line 1: field 'text' must be a string" in note
    for count in ("1 field not a string", "1 invalid JSON", "1 missing field", "1 not an object", "1 invalid text"):
        assert count in note

    written = write_skipped(tmp_path / "run", skipped)
    rows = [json.loads(line) for line in written.read_text().splitlines()]
    assert [(r["file"], r["line"], r["reason"]) for r in rows] == [(str(path), s.line, s.reason) for s in skipped]
    assert rows[0]["message"] == skipped[0].message
    assert write_skipped(tmp_path / "none", []) is None and not (tmp_path / "none").exists()


def test_likely_mistakes_are_taken_and_counted_by_kind_with_the_first_place(tmp_path, tokenizer):
    path = tmp_path / "train.jsonl"
    chat = [{"role": "user", "content": "q"}, {"role": "assistant", "content": "a"}]
    path.write_text(lines(
        json.dumps({"text": "fine"}),
        json.dumps({"text": "  "}),                                               # 2: empty text
        json.dumps({"prompt": "p", "completion": ""}),                            # 3: empty completion
        json.dumps({"messages": [{"role": "bot", "content": "hi"}, *chat]}),      # 4: unknown role
        json.dumps({"text": "t", "prompt": "p", "completion": "c"}),              # 5: two kinds
        json.dumps({"messages": [{"role": "system", "content": None}, *chat]}),   # 6: null content
        json.dumps({"text": ""}),                                                 # 7: empty text again
        json.dumps({"messages": [{"role": "USER", "content": "q"}, chat[1]]}),    # 8: a role in capitals
        json.dumps({"messages": [*chat, chat[1]]}),                               # 9: two assistant turns
        json.dumps({"prompt": "p", "completion": "a\x00b"}),                      # 10: NUL
        json.dumps({"messages": [{"role": "hacker", "content": "q"}, *chat]}),    # 11: unknown role
    ))
    lenient = Tokenizer(chat_backend(), bos_token=BOS, eos_token=EOS,  # a template that takes null content
                        chat_template=CHATML.replace("m['content']", "(m['content'] or '')"))
    examples, read, stats = read_and_tokenize(path, lenient)
    assert len(examples) == 11  # taken as written
    assert stats.suspicious == {
        "empty text": (2, f"{path} line 2"),
        "empty completion": (1, f"{path} line 3"),
        "unknown chat role 'bot'": (1, f"{path} line 4"),
        "both 'prompt'/'completion' and 'text' ('prompt'/'completion' used)": (1, f"{path} line 5"),
        "null message content": (1, f"{path} line 6"),
        "unknown chat role 'USER' (roles are case-sensitive: 'user'?)": (1, f"{path} line 8"),
        "two assistant turns in a row": (1, f"{path} line 9"),
        "NUL character (U+0000) in text": (1, f"{path} line 10"),
        "unknown chat role 'hacker'": (1, f"{path} line 11"),
    }
    (note,) = data_notes("data.train", [], stats)
    assert f"1 with two assistant turns in a row (first: {path} line 9)" in note
    assert note.startswith("data.train: taken as written, but likely mistakes: 2 with empty text "
                           f"(first: {path} line 2); 1 with empty completion")


def test_a_chat_template_that_fails_on_a_record_is_a_data_error(tokenizer):
    # ChatML's `m['content'] + '<|im_end|>'` is a TypeError in the template when content is null.
    record = {"messages": [{"role": "user", "content": None}, {"role": "assistant", "content": "x"}]}
    with pytest.raises(DataError, match=r"the chat template failed on it: TypeError.*\(content of message 0 is null\)"):
        tokenize_record(record, tokenizer)


def test_a_csv_quote_never_closed_is_refused_where_it_opened(tmp_path, tokenizer):
    path = tmp_path / "train.csv"
    path.write_text('text,completion\nfox,a\n"two\nlines",b\ndog,"never closed\ncat,c\nowl,d\n')
    with pytest.raises(DataError, match="^" + re.escape(f"{path} line 5: a quote opened here is never closed, so "
                                                        "its field runs to the end of the file (line 7)")):
        read_records(path)
    records, read = read_records(path, on_error="skip")  # the rows before it are kept; the rest are lost with it
    assert [r.fields["text"] for r in records] == ["fox", "two\nlines"]
    assert [(s.line, s.reason) for s in read.skipped_records] == [(5, "unclosed quote")]
    opens_later = tmp_path / "later.csv"  # the open quote is in the row's second field, on its second line
    opens_later.write_text('text,completion\nfox,a\n"two\nlines","open\nrest\n')
    with pytest.raises(DataError, match=re.escape(f"{opens_later} line 4: a quote opened here is never closed")):
        read_records(opens_later)
    closed = tmp_path / "closed.csv"  # a quoted last field over several lines, closed: read as it always was
    closed.write_text('text,completion\nfox,"a ""b""\nc"\n')
    records, _ = read_records(closed)
    assert records[0].fields == {"text": "fox", "completion": 'a "b"\nc'}


def test_a_byte_order_mark_inside_a_csv_or_text_file_is_refused(tmp_path, tokenizer):
    path = tmp_path / "joined.csv"
    path.write_bytes(b"\xef\xbb\xbftext\nfox\n\xef\xbb\xbftext\ndog\n")  # two files with BOMs joined by cat
    with pytest.raises(DataError, match="^" + re.escape(f"{path} line 3: a byte-order mark (U+FEFF) inside")):
        read_records(path)
    records, read = read_records(path, on_error="skip")
    assert [r.fields["text"] for r in records] == ["fox", "dog"]  # the first BOM is the file's own, stripped
    assert [(s.line, s.reason) for s in read.skipped_records] == [(3, "byte-order mark")]
    header = tmp_path / "header.csv"
    header.write_text("text,co\ufeffmpletion\nfox,a\n")
    with pytest.raises(DataError, match=re.escape(f"{header} line 1: a byte-order mark (U+FEFF) inside the header")):
        read_records(header, on_error="skip")  # no column can be named right: the whole file
    text = tmp_path / "joined.txt"
    text.write_bytes(b"\xef\xbb\xbfhello\n\xef\xbb\xbfworld\n")
    with pytest.raises(DataError, match=re.escape(f"{text}: field 'text' holds a byte-order mark (U+FEFF) at "
                                                  "character 6")):
        read_and_tokenize(text, tokenizer)


def test_a_lone_surrogate_in_a_csv_file_names_the_line(tmp_path):
    path = tmp_path / "train.csv"
    path.write_bytes("text\nfox\na\ud800b\n".encode("utf-8", "surrogatepass"))  # as a careless writer leaves it
    for on_error in ("raise", "skip"):  # a CSV row may span lines: the reader cannot find the next one safely
        with pytest.raises(DataError, match="^" + re.escape(f"{path} line 3: not UTF-8 text")):
            read_records(path, on_error=on_error)


def test_a_csv_field_with_nul_is_taken_and_noted(tmp_path, tokenizer):
    path = tmp_path / "train.csv"
    path.write_text("text\nfox\na\x00b\n")
    examples, read, stats = read_and_tokenize(path, tokenizer)
    assert len(examples) == 2
    assert stats.suspicious == {"NUL character (U+0000) in text": (1, f"{path} line 3")}


# -- fuzzing: mutated data files give records or one DataError, never anything else -----------------------------

SEEDS = [
    json.dumps({"text": "The quick brown fox."}),
    json.dumps({"prompt": "What is the capital of France?", "completion": " Paris."}),
    json.dumps({"messages": [{"role": "user", "content": "Hi?"}, {"role": "assistant", "content": "Hello."}]}),
]
INSERTS = ["\x00", "\x7f", "\x1b", "\ud800", "\\ud800", "\ufeff", "\u2028", '"', "\\", ",", "\n", "{", "[", "]", "}",
           "null", "1e999", LONG_INT, "[" * 3000, '"messages":', '"text":', '"role": 5', "\r"]


# Values that keep the JSON well-formed but break what reads it, put in place of a string.
VALUES = ['"\\ud800x"', '"a\\udfff"', "null", "7", "[]", "{}", "[" * 3000 + "]" * 3000, LONG_INT, '""', '" "',
          '[{"role": 1}]', '[{"role": "bot", "content": null}]', '{"a": ' * 2000 + "1" + "}" * 2000]
STRING = re.compile(r'"(?:[^"\\]|\\.)*"')


def mutate(text: str, rng: random.Random) -> str:
    for _ in range(rng.randint(1, 4)):
        i = rng.randrange(len(text) + 1)
        op = rng.random()
        strings = list(STRING.finditer(text))
        if op < 0.35 and strings:
            found = rng.choice(strings)
            text = text[:found.start()] + rng.choice(VALUES) + text[found.end():]
        elif op < 0.5:
            text = text[:i] + text[i + rng.randint(1, 5):]
        elif op < 0.65:
            j = rng.randint(i, min(len(text), i + 20))
            text = text[:j] + text[i:j] + text[j:]
        else:
            text = text[:i] + rng.choice(INSERTS) + text[i:]
    return text


def fuzz_file(tmp_path, rng: random.Random, n: int):
    kind = rng.choice(["jsonl", "json", "csv"])
    rows = [rng.choice(SEEDS) for _ in range(rng.randint(1, 4))]
    if kind == "jsonl":
        text = "\n".join(rows)
    elif kind == "json":
        text = "[" + ",\n".join(rows) + "]"
    else:
        text = "text,completion\n" + "\n".join(f'"{r[:30]}",x' for r in rows)
    path = tmp_path / f"f{n}.{kind}"
    path.write_bytes(mutate(text, rng).encode("utf-8", "surrogatepass"))
    return path


def test_fuzzed_data_files_give_records_or_a_data_error(tmp_path, tokenizer):
    rng = random.Random(15)
    outcomes = {"ok": 0, "error": 0}
    for n in range(300):
        path = fuzz_file(tmp_path, rng, n)
        for on_error in ("raise", "skip"):
            try:
                read_and_tokenize(path, tokenizer, on_error=on_error)
                outcomes["ok"] += 1
            except DataError:
                outcomes["error"] += 1
            # anything else fails the test, with the file to reproduce it
    assert outcomes["ok"] > 50 and outcomes["error"] > 50  # the fuzzing reaches both outcomes


def test_a_classification_text_is_checked_as_a_causal_one(tmp_path, tokenizer):
    path = tmp_path / "texts.jsonl"
    path.write_text(lines('{"text": "fox"}', '{"text": "a\\ud800"}', '{"text": "b\\ufeff"}'))
    with pytest.raises(DataError, match="^" + re.escape(f"{path} line 2: field 'text' is not valid Unicode text")):
        read_texts(str(path), tokenizer, None)
    skipped = []
    examples, notes = read_texts(str(path), tokenizer, None, on_error="skip", skipped_out=skipped)
    assert len(examples) == 1
    assert [(s.line, s.message.split(": ", 1)[1][:40]) for s in skipped] == [
        (2, "field 'text' is not valid Unicode text: "), (3, "field 'text' holds a byte-order mark (U+")]
    assert notes[0].startswith("data: 2 record(s) skipped")
