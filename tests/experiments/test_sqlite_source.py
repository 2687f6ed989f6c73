"""SQLite data source: the rows of data.query, read-only, errors naming the query and the row."""

from __future__ import annotations

import sqlite3

import pytest

from entrenar.config import Recipe
from entrenar.data.sources import read_records
from entrenar.errors import ConfigError, DataError


@pytest.fixture
def db(tmp_path):
    path = tmp_path / "logs.db"
    with sqlite3.connect(path) as c:
        c.execute("CREATE TABLE logs (id INTEGER, prompt TEXT, answer TEXT, score REAL)")
        c.executemany("INSERT INTO logs VALUES (?, ?, ?, ?)",
                      [(1, "2+2=", "4", 0.9), (2, "3+3=", None, 0.1), (3, "1+1=", "2", 0.8)])
    c.close()
    return path


def test_rows_become_records_with_their_column_names(db):
    records, stats = read_records(db, query="SELECT prompt, answer AS completion FROM logs WHERE score > 0.5 "
                                            "ORDER BY id")
    assert [r.fields for r in records] == [{"prompt": "2+2=", "completion": "4"}, {"prompt": "1+1=", "completion": "2"}]
    assert records[1].where == f"{db} row 2" and stats.files == [str(db)]
    copy = db.with_suffix(".sqlite3")
    copy.write_bytes(db.read_bytes())
    assert len(read_records(copy, query="WITH t AS (SELECT * FROM logs) SELECT prompt AS text FROM t")[0]) == 3


def test_a_null_text_is_a_record_error_that_skip_honours(db):
    from entrenar.data import tokenize_records
    from entrenar.models.random_init import byte_tokenizer

    records, _ = read_records(db, query="SELECT prompt || ifnull(answer, '') AS text, answer FROM logs ORDER BY id")
    nulls, _ = read_records(db, query="SELECT answer AS text FROM logs ORDER BY id")
    assert nulls[1].fields == {"text": None}
    with pytest.raises(DataError, match=rf"{db} row 2: field 'text' must be a string"):
        tokenize_records(nulls, byte_tokenizer(), 32)
    examples, stats = tokenize_records(nulls, byte_tokenizer(), 32, on_error="skip")
    assert len(examples) == 2 and len(records) == 3


def test_bad_sql_names_the_query_and_the_file_is_never_written(db):
    with pytest.raises(DataError, match=r"data.query 'SELECT nope FROM logs' failed: no such column: nope"):
        read_records(db, query="SELECT nope FROM logs")
    with pytest.raises(ConfigError, match="needs data.query"):
        read_records(db)
    for statement in ("DELETE FROM logs", "DROP TABLE logs", "SELECT 1; DELETE FROM logs",
                      "-- a comment\nUPDATE logs SET score = 0", "PRAGMA user_version = 3"):
        with pytest.raises(ConfigError, match="'data.query' must be"):
            Recipe.from_dict({"model": {"path": "m"}, "data": {"train": str(db), "query": statement}})
        with pytest.raises(ConfigError):
            read_records(db, query=statement)
    with pytest.raises(ConfigError, match="'data.query' reads a SQLite file .* data.train is 'x.jsonl'"):
        Recipe.from_dict({"model": {"path": "m"}, "data": {"train": "x.jsonl", "query": "SELECT 1"}})
    # Read-only even when a statement slips past the SELECT check: a CTE cannot write, and the URI forbids it.
    with pytest.raises(DataError, match="readonly|read-only|not authorized|failed"):
        read_records(db, query="WITH x AS (SELECT 1) INSERT INTO logs VALUES (9, 'a', 'b', 1.0)")
    with sqlite3.connect(db) as c:
        assert c.execute("SELECT count(*) FROM logs").fetchone() == (3,)
    c.close()


def test_a_missing_or_non_sqlite_file_is_a_data_error(tmp_path):
    with pytest.raises(DataError, match="no such file"):
        read_records(tmp_path / "none.db", query="SELECT 1")
    bad = tmp_path / "bad.db"
    bad.write_text("not a database at all, just text " * 10)
    with pytest.raises(DataError, match="bad.db: cannot be read as a SQLite database: file is not a database"):
        read_records(bad, query="SELECT 1")


def test_the_training_loop_reads_a_database_through_data_query(db, tmp_path):
    from entrenar.config import load_recipe
    from entrenar.train.loop import train

    recipe = tmp_path / "r.yaml"
    recipe.write_text(f"""
model: {{init: random, device: cpu, config: {{model_type: llama, hidden_size: 32, intermediate_size: 32,
         num_hidden_layers: 1, num_attention_heads: 2, num_key_value_heads: 1}}}}
data: {{train: {db}, query: "SELECT prompt, answer AS completion FROM logs", on_error: skip, seq_len: 16}}
lora: null
training: {{max_steps: 2, batch_size: 2}}
output: {{dir: {tmp_path / 'run'}}}
""")
    result = train(load_recipe(recipe), progress=False)
    skipped = (result.run_dir / "skipped.jsonl").read_text()
    assert result.steps == 2 and "row 2" in skipped and "completion" in skipped


@pytest.fixture
def ledger(tmp_path):
    """A ledger of two files, as the original MoE runner kept it: decisions in one, their outcomes in another."""
    decisions, outcomes = tmp_path / "decisions.db", tmp_path / "outcomes.db"
    with sqlite3.connect(decisions) as c:
        c.execute("CREATE TABLE decisions (id INTEGER, prompt TEXT)")
        c.executemany("INSERT INTO decisions VALUES (?, ?)", [(1, "route a"), (2, "route b"), (3, "route c")])
    c.close()
    with sqlite3.connect(outcomes) as c:
        c.execute("CREATE TABLE outcomes (decision_id INTEGER, quality REAL)")
        c.executemany("INSERT INTO outcomes VALUES (?, ?)", [(3, 0.25), (1, 0.75)])
    c.close()
    return decisions, outcomes


JOIN = "SELECT d.prompt AS text, o.quality AS label FROM decisions d JOIN outcomes.outcomes o " \
       "ON o.decision_id = d.id ORDER BY d.id"


def test_data_attach_joins_two_database_files_in_one_query_read_only(ledger):
    decisions, outcomes = ledger
    before = outcomes.read_bytes()
    records, _ = read_records(decisions, query=JOIN, attach={"outcomes": str(outcomes)})
    assert [r.fields for r in records] == [{"text": "route a", "label": 0.75}, {"text": "route c", "label": 0.25}]
    with pytest.raises(DataError, match="readonly|read-only"):  # the attached file is read-only too
        read_records(decisions, query="WITH x AS (SELECT 1) INSERT INTO outcomes.outcomes VALUES (9, 1.0)",
                     attach={"outcomes": str(outcomes)})
    assert outcomes.read_bytes() == before


def test_data_attach_errors_name_the_key_and_the_file(ledger, tmp_path):
    decisions, outcomes = ledger
    with pytest.raises(DataError, match=r"data.attach.outcomes: .*missing.db: no such file"):
        read_records(decisions, query=JOIN, attach={"outcomes": str(tmp_path / "missing.db")})
    bad = tmp_path / "bad.db"
    bad.write_text("not a database at all, just text " * 10)
    with pytest.raises(DataError, match=r"data.attach.outcomes: .*bad.db: cannot be read as a SQLite database"):
        read_records(decisions, query=JOIN, attach={"outcomes": str(bad)})
    base = {"model": {"path": "m"}, "data": {"train": str(decisions), "query": JOIN}}
    for attach, message in (({"main": str(outcomes)}, "SQL identifier other than main"),
                            ({"1x": str(outcomes)}, "SQL identifier"), ("outcomes.db", "mapping"),
                            ({"outcomes": ""}, "must name a file")):
        with pytest.raises(ConfigError, match=f"data.attach.*{message}"):
            Recipe.from_dict({**base, "data": {**base["data"], "attach": attach}})
    with pytest.raises(ConfigError, match="'data.attach' .* set data.query too"):
        Recipe.from_dict({"model": {"path": "m"}, "data": {"train": str(decisions), "attach": {"o": str(outcomes)}}})


def test_a_missing_attached_file_is_found_before_the_model_loads(ledger, tmp_path):
    from entrenar.train.run_data import check_paths

    decisions, _ = ledger
    recipe = Recipe.from_dict({"model": {"path": str(tmp_path / "no-model")},
                               "data": {"train": str(decisions), "query": JOIN,
                                        "attach": {"outcomes": str(tmp_path / "gone.db")}}})
    with pytest.raises(DataError, match=r"data.attach.outcomes: no such file or folder: .*gone.db"):
        check_paths(recipe)
