"""Tokenizer flattening, text cleaning and input planning: fast, no Ray."""

from __future__ import annotations

from collections import Counter

import numpy as np
import pyarrow as pa
import pytest
from hypothesis import given
from hypothesis import strategies as st
from tokenizers import Tokenizer

from raypipe.demo.train_tokenizer import SHIPPED
from raypipe.errors import FormatError, InputError
from raypipe.preprocess.encoding.encoder import DocumentEncoder, flatten_documents
from raypipe.preprocess.inputs import expand_inputs, unit_name
from raypipe.preprocess.planning import plan_units
from raypipe.preprocess.texts import clean_texts
from tests.conftest import write_parquet


@given(st.lists(st.lists(st.integers(3, 2**20), max_size=8), max_size=8),
       st.sampled_from([(0, None), (None, 1), (0, 1)]))
def test_flatten_matches_naive(ids, special):
    bos, eos = special
    tokens, lengths = flatten_documents(ids, bos, eos)
    expected = [([bos] if bos is not None else []) + doc + ([eos] if eos is not None else [])
                for doc in ids]
    assert lengths.tolist() == [len(doc) for doc in expected]
    assert tokens.tolist() == [t for doc in expected for t in doc]
    assert tokens.dtype == np.uint32


def test_encoder_equals_tokenizers(tokenizer_path, corpus_texts):
    tokenizer = Tokenizer.from_file(tokenizer_path)
    bos, eos = tokenizer.token_to_id("<|bos|>"), tokenizer.token_to_id("<|eos|>")
    texts = corpus_texts[:50]
    tokens, lengths = DocumentEncoder(tokenizer, bos, eos).encode(texts)
    pieces = np.split(tokens, np.cumsum(lengths)[:-1])
    for text, piece in zip(texts, pieces, strict=True):
        assert piece.tolist() == [bos, *tokenizer.encode(text, add_special_tokens=False).ids, eos]


def test_clean_texts_counts_each_reason():
    column = pa.array(["a", None, "", "bbb", "cccc", None])
    texts, skipped = clean_texts(column, max_document_chars=3)
    assert texts == ["a", "bbb"]
    assert skipped == {"null": 2, "empty": 1, "too_long": 1}


@given(st.lists(st.none() | st.text(alphabet="aé€𝄞 ", max_size=8), max_size=12),
       st.none() | st.integers(0, 9), st.booleans())
def test_clean_texts_keeps_and_counts_each_row_as_its_characters_say(texts, limit, large):
    """Every row kept in order or counted once: null, empty, or more than `limit`
    characters (counted in characters, not bytes: 1-4 bytes each here), whatever the
    column's string type."""
    from raypipe.preprocess.texts import clean_texts_with_rows

    column = pa.array(texts, pa.large_string() if large else pa.string())
    kept, rows, skipped = clean_texts_with_rows(column, limit)
    reasons = ["null" if text is None else "empty" if not text else "too_long"
               if limit is not None and len(text) > limit else "kept" for text in texts]
    assert rows.tolist() == [row for row, reason in enumerate(reasons) if reason == "kept"]
    assert kept == [texts[row] for row in rows.tolist()]
    assert skipped == Counter(reason for reason in reasons if reason != "kept")


def test_clean_texts_binary_and_non_string():
    texts, skipped = clean_texts(pa.array([b"ok", b"\xff\xfe", None, b""], pa.binary()))
    assert texts == ["ok"] and skipped == {"invalid_utf8": 1, "null": 1, "empty": 1}
    texts, skipped = clean_texts(pa.array([1, 2, None], pa.int64()))
    assert texts == [] and skipped == {"non_string": 2, "null": 1}


def test_expand_inputs_glob_directory_list(tmp_path):
    for name in ("a", "b"):
        write_parquet(tmp_path / "d" / f"{name}.parquet", ["x"])
    write_parquet(tmp_path / "d" / "sub" / "c.parquet", ["x"])
    (tmp_path / "d" / "notes.txt").write_text("not parquet")
    by_dir = expand_inputs([str(tmp_path / "d")])
    assert [p.rsplit("/", 1)[1] for p in by_dir] == ["a.parquet", "b.parquet", "c.parquet"]
    assert expand_inputs([str(tmp_path / "d" / "*.parquet")]) == by_dir[:2]
    assert expand_inputs([by_dir[1], by_dir[0], by_dir[1]]) == by_dir[:2]


def test_empty_glob_and_missing_path_are_errors(tmp_path):
    with pytest.raises(InputError, match="no parquet or JSON-lines file"):
        expand_inputs([str(tmp_path / "*.parquet")])
    with pytest.raises(InputError, match="no such file"):
        expand_inputs([str(tmp_path / "nope.parquet")])


def test_missing_column_names_file_and_columns(tmp_path):
    path = write_parquet(tmp_path / "a.parquet", ["x"])
    with pytest.raises(InputError) as info:
        plan_units([str(path)], "content", 1 << 20)
    assert str(path) in str(info.value) and "['id', 'text']" in str(info.value)


def test_not_parquet_is_an_input_error(tmp_path):
    bad = tmp_path / "bad.parquet"
    bad.write_bytes(b"this is not parquet at all")
    with pytest.raises(InputError, match="bad.parquet"):
        plan_units([str(bad)], "text", 1 << 20)


def test_units_follow_row_groups_and_names_are_stable(tmp_path):
    path = write_parquet(tmp_path / "a.parquet", [f"doc {i}" for i in range(1000)],
                         row_group_rows=100)
    units = plan_units([str(path)], "text", 1)
    assert [(u.row_group_start, u.row_group_stop) for u in units] == [(i, i + 1)
                                                                       for i in range(10)]
    assert sum(u.num_rows for u in units) == 1000
    assert units[3].name == unit_name(str(path), 3, 4)
    whole = plan_units([str(path)], "text", 1 << 40)
    assert len(whole) == 1 and whole[0].num_rows == 1000


def test_double_star_glob_crosses_directories(tmp_path):
    write_parquet(tmp_path / "d" / "a.parquet", ["x"])
    write_parquet(tmp_path / "d" / "sub" / "deeper" / "c.parquet", ["x"])
    found = expand_inputs([str(tmp_path / "d" / "**" / "*.parquet")])
    assert [p.rsplit("/", 1)[1] for p in found] == ["a.parquet", "c.parquet"]


@pytest.mark.parametrize("entry,problem", [
    ({"path": "m/a.bin", "bytes": True, "sha256": "0" * 64}, "field 'bytes' has the wrong type"),
    ({"path": "m/a.bin", "bytes": 1.5, "sha256": "0" * 64}, "field 'bytes' has the wrong type"),
    ({"path": "m/a.bin", "sha256": "0" * 64}, "lacks field 'bytes'"),
    ({"path": "m/a.bin", "bytes": 3, "sha256": "0" * 64, "mtime_ns": "1"},
     "field 'mtime_ns' has the wrong type"),
    ({"path": "../a.bin", "bytes": 3, "sha256": "0" * 64}, "must be relative"),
    ("m/a.bin", "is not a JSON object"),
])
def test_manifest_records_refuse_wrong_types_bools_as_numbers_and_escaping_paths(entry,
                                                                                 problem):
    from raypipe.io.records import FileEntry

    with pytest.raises(FormatError, match=problem):
        FileEntry.from_json(entry, "manifest.json")


def test_manifest_records_accept_optional_fields_absent_or_null():
    from raypipe.io.records import FileEntry

    entry = {"path": "m/a.bin", "bytes": 3, "sha256": "0" * 64}
    assert FileEntry.from_json(entry, "w").mtime_ns is None
    assert FileEntry.from_json({**entry, "mtime_ns": None}, "w").mtime_ns is None
    assert FileEntry.from_json({**entry, "mtime_ns": 7}, "w").mtime_ns == 7


def test_a_directory_reads_every_kind_and_names_each_file_it_passes_over(tmp_path, caplog):
    """Parquet and JSON-lines files of one directory are all read; a file of another kind,
    a hidden or marker file and a dataset's metadata are passed over, each with why, and
    logged (a warning only past PASSED_OVER_WARN_SHARE of the bytes); naming one reads it."""
    import gzip
    import logging

    from raypipe.preprocess.inputs import find_inputs

    write_parquet(tmp_path / "d" / "a.parquet", ["x"])
    (tmp_path / "d" / "sub").mkdir()
    (tmp_path / "d" / "sub" / "b.jsonl").write_text('{"text": "y"}\n')
    (tmp_path / "d" / "c.json.gz").write_bytes(gzip.compress(b'{"text": "z"}\n'))
    (tmp_path / "d" / "dataset_info.json").write_text('{"rows": 1,\n "bytes": 1}\n')
    (tmp_path / "d" / "_SUCCESS").write_text("")
    (tmp_path / "d" / "README.md").write_text("x" * 10)
    with caplog.at_level(logging.INFO, logger="raypipe"):
        found = find_inputs([str(tmp_path / "d")])
    assert [p.rsplit("/", 1)[1] for p in found.files] == ["a.parquet", "c.json.gz", "b.jsonl"]
    reasons = {m.uri.rsplit("/", 1)[1]: m.reason for m in found.passed_over}
    assert sorted(reasons) == ["README.md", "_SUCCESS", "dataset_info.json"]
    assert "not parquet or JSON lines" in reasons["README.md"]
    assert "metadata" in reasons["dataset_info.json"] and "'_'" in reasons["_SUCCESS"]
    assert {m.uri.rsplit("/", 1)[1]: m.bytes for m in found.passed_over}["README.md"] == 10
    record = next(r for r in caplog.records if "passed over" in r.getMessage())
    assert record.levelno == logging.WARNING  # 37 bytes of ~1 KB: past 1%
    assert "README.md" in record.getMessage()
    (tmp_path / "d" / "out" / "_units").mkdir(parents=True)  # a raypipe output inside
    (tmp_path / "d" / "out" / "_units" / "_job.json").write_text("{}")
    (tmp_path / "d" / "out" / "manifest.json").write_text('{"kind": "raypipe-tokens"}\n')
    again = find_inputs([str(tmp_path / "d")])
    assert len(again.files) == 3 and {m.reason for m in again.passed_over
                                      if "/out/" in m.uri} == {"inside a raypipe output"}
    named = find_inputs([str(tmp_path / "d"), str(tmp_path / "d" / "dataset_info.json")])
    assert len(named.files) == 4 and len(named.passed_over) == 4  # named: read
    write_parquet(tmp_path / "big" / "a.parquet", ["x" * 100_000])
    (tmp_path / "big" / "notes.txt").write_text("n")
    caplog.clear()
    with caplog.at_level(logging.INFO, logger="raypipe"):
        assert len(find_inputs([str(tmp_path / "big")]).passed_over) == 1
    assert [r.levelno for r in caplog.records if "passed over" in r.getMessage()] == \
        [logging.INFO]


@given(st.lists(st.text(alphabet="<|>[]().*+?{}^$\\ab#- ", min_size=1, max_size=6),
                min_size=1, max_size=5),
       st.lists(st.text(alphabet="<|>[]().*+?{}^$\\ab#- x", max_size=20), max_size=20))
def test_special_literals_are_counted_alike_on_arrow_and_python_texts(literals, texts):
    tokenizer = Tokenizer.from_file(str(SHIPPED))
    encoder = DocumentEncoder(tokenizer, None, None)
    encoder.special_literals = literals
    assert encoder.count_special_literals(pa.array(texts, pa.large_string())) == \
        encoder.count_special_literals(texts)
