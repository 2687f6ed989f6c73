"""Reading records: every format, and errors that name the file and line."""

from __future__ import annotations

import json
import re
import sys

import pytest

from entrenar.data.sources import read_records
from entrenar.errors import ConfigError, DataError


def write(path, text: str):
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(text, encoding="utf-8")
    return path


def test_jsonl_records_carry_file_and_line(tmp_path):
    path = write(tmp_path / "train.jsonl", '{"text": "a"}\n\n{"text": "b"}\n')
    records, stats = read_records(path)
    assert [r.fields for r in records] == [{"text": "a"}, {"text": "b"}]
    assert [r.where for r in records] == [f"{path} line 1", f"{path} line 3"]
    assert (stats.records, stats.skipped, stats.files) == (2, 0, [str(path)])


def test_malformed_jsonl_line_names_file_and_line(tmp_path):
    path = write(tmp_path / "train.jsonl", '{"text": "a"}\n{"text": "b"}\n{"text": oops}\n')
    with pytest.raises(DataError, match="^" + re.escape(f"{path} line 3: invalid JSON: Expecting value")):
        read_records(path)


def test_jsonl_line_that_is_not_an_object(tmp_path):
    path = write(tmp_path / "train.jsonl", '{"text": "a"}\n["a", "list"]\n')
    with pytest.raises(DataError, match=re.escape(f"{path} line 2: expected a JSON object, got list")):
        read_records(path)


def test_skip_mode_counts_and_reports_bad_records(tmp_path):
    path = write(tmp_path / "train.jsonl", '{"text": "a"}\nnot json\n{"text": "c"}\n42\n')
    records, stats = read_records(path, on_error="skip")
    assert [r.fields["text"] for r in records] == ["a", "c"]
    assert stats.records == 2 and stats.skipped == 2
    assert stats.skip_reasons[0].startswith(f"{path} line 2: invalid JSON")
    assert stats.skip_reasons[1] == f"{path} line 4: expected a JSON object, got int"


def test_invalid_utf8_names_the_line(tmp_path):
    path = tmp_path / "train.jsonl"
    path.write_bytes(b'{"text": "ok"}\n{"text": "\xff"}\n')
    with pytest.raises(DataError, match=re.escape(f"{path} line 2: not UTF-8 text")):
        read_records(path)


def test_json_list_and_data_key_give_item_lines(tmp_path):
    items = [{"prompt": "p0", "completion": "c0"}, {"prompt": "p1", "completion": "c1"}]
    listed = write(tmp_path / "list.json", json.dumps(items, indent=2))
    wrapped = write(tmp_path / "wrapped.json", json.dumps({"version": 1, "data": items}, indent=2))
    # Each item's object opens on the line named: 2 and 6 in the bare list, 4 and 8 under "data".
    for path, lines in ((listed, (2, 6)), (wrapped, (4, 8))):
        records, _ = read_records(path)
        assert [r.fields for r in records] == items
        assert [r.location for r in records] == [f"item 0 (line {lines[0]})", f"item 1 (line {lines[1]})"]
        assert [path.read_text().splitlines()[n - 1].strip() for n in lines] == ["{", "{"]


def test_json_item_that_is_not_an_object(tmp_path):
    path = write(tmp_path / "data.json", '[\n  {"text": "a"},\n  "b"\n]')
    with pytest.raises(DataError, match=re.escape(f"{path} item 1 (line 3): expected a JSON object, got str")):
        read_records(path)


def test_json_syntax_error_names_line(tmp_path):
    path = write(tmp_path / "data.json", '[\n  {"text": "a"},\n  {"text": }\n]')
    with pytest.raises(DataError, match=re.escape(f"{path} line 3: invalid JSON")):
        read_records(path)


def test_json_with_wrong_shape(tmp_path):
    path = write(tmp_path / "data.json", '{"rows": []}')
    expected = 'expected a list of objects or {"data": [...]}, got dict with keys [\'rows\']'
    with pytest.raises(DataError, match=re.escape(expected)):
        read_records(path)


def test_json_file_holding_json_lines_is_read_as_jsonl(tmp_path):
    path = write(tmp_path / "data.json", '{"text": "a"}\n{"text": "b"}\n')
    records, _ = read_records(path)
    assert [(r.fields["text"], r.location) for r in records] == [("a", "line 1"), ("b", "line 2")]


def test_csv_rows_with_start_lines(tmp_path):
    path = write(tmp_path / "data.csv", 'prompt,completion\nhi,there\n"multi\nline",x\n\nlast,one\n')
    records, _ = read_records(path)
    assert [r.fields for r in records] == [
        {"prompt": "hi", "completion": "there"},
        {"prompt": "multi\nline", "completion": "x"},
        {"prompt": "last", "completion": "one"},
    ]
    assert [r.location for r in records] == ["line 2", "line 3", "line 6"]


def test_csv_row_with_wrong_field_count(tmp_path):
    path = write(tmp_path / "data.csv", "prompt,completion\nhi,there\na,b,c\n")
    with pytest.raises(DataError, match=re.escape(f"{path} line 3: row has 3 fields, header has 2")):
        read_records(path)


def test_parquet_rows(tmp_path):
    pa = pytest.importorskip("pyarrow")
    import pyarrow.parquet as pq

    rows = [{"messages": [{"role": "user", "content": f"q{i}"}, {"role": "assistant", "content": f"a{i}"}]}
            for i in range(5)]
    path = tmp_path / "chat.parquet"
    pq.write_table(pa.Table.from_pylist(rows), path, row_group_size=2)  # several batches
    records, _ = read_records(path)
    assert [r.fields for r in records] == rows
    assert [r.location for r in records] == [f"row {i}" for i in range(5)]


def test_parquet_without_pyarrow_says_what_to_install(tmp_path, monkeypatch):
    monkeypatch.setitem(sys.modules, "pyarrow", None)  # makes `import pyarrow...` raise ImportError
    monkeypatch.setitem(sys.modules, "pyarrow.parquet", None)
    path = write(tmp_path / "data.parquet", "")
    with pytest.raises(DataError, match=r"needs pyarrow: pip install entrenar\[parquet\]"):
        read_records(path)


def test_folder_of_text_files_gives_one_record_per_file(tmp_path):
    write(tmp_path / "docs" / "b.md", "# Second\n\nbody\n")
    write(tmp_path / "docs" / "a.txt", "First document.\n\nStill the first.")
    write(tmp_path / "docs" / "sub" / "c.txt", "Third.")
    write(tmp_path / "docs" / ".hidden.txt", "ignored")
    write(tmp_path / "docs" / "notes.bin", "ignored")
    records, stats = read_records(tmp_path / "docs")
    texts = [r.fields["text"] for r in records]
    assert texts == ["First document.\n\nStill the first.", "# Second\n\nbody\n", "Third."]
    assert [r.where for r in records] == [str(tmp_path / "docs" / n) for n in ("a.txt", "b.md", "sub/c.txt")]
    assert len(stats.files) == 3


def test_folder_with_explicit_format_reads_only_that_format(tmp_path):
    write(tmp_path / "d" / "a.jsonl", '{"text": "from jsonl"}\n')
    write(tmp_path / "d" / "b.txt", "from text")
    records, _ = read_records(tmp_path / "d", format="jsonl")
    assert [r.fields["text"] for r in records] == ["from jsonl"]


def test_several_paths_keep_their_order(tmp_path):
    first = write(tmp_path / "z.jsonl", '{"text": "z"}\n')
    second = write(tmp_path / "a.csv", "text\na\n")
    records, _ = read_records([first, second])
    assert [r.fields["text"] for r in records] == ["z", "a"]


def test_empty_dataset_names_the_files(tmp_path):
    path = write(tmp_path / "empty.jsonl", "\n\n")
    with pytest.raises(DataError, match=re.escape(f"no records in {path}") + "$"):
        read_records(path)
    bad = write(tmp_path / "bad.jsonl", "nope\n")
    expected = f"no records in {bad} (1 malformed records skipped; first: {bad} line 1"
    with pytest.raises(DataError, match=re.escape(expected)):
        read_records(bad, on_error="skip")


def test_missing_paths_and_unknown_formats(tmp_path):
    with pytest.raises(DataError, match=re.escape(f"{tmp_path / 'nope.jsonl'}: no such file or folder")):
        read_records(tmp_path / "nope.jsonl")
    with pytest.raises(DataError, match=r"cannot tell the format from extension '\.xml'"):
        read_records(write(tmp_path / "data.xml", "<a/>"))
    with pytest.raises(DataError, match="folder holds no data files"):
        read_records((tmp_path / "emptydir").mkdir() or tmp_path / "emptydir")
    with pytest.raises(ConfigError, match="data format 'yaml'"):
        read_records(tmp_path, format="yaml")


def test_empty_text_document_is_a_bad_record(tmp_path):
    write(tmp_path / "d" / "a.txt", "text")
    empty = write(tmp_path / "d" / "b.txt", "  \n")
    with pytest.raises(DataError, match=re.escape(f"{empty}: empty document")):
        read_records(tmp_path / "d")
    records, stats = read_records(tmp_path / "d", on_error="skip")
    assert len(records) == 1 and stats.skipped == 1
