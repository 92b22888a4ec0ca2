"""JSON-lines inputs (serial runner, no Ray): the parquet run's documents from .jsonl, .json,
.jsonl.gz and .jsonl.zst; byte-range units that read every line once; errors naming the file
and line; skips counted by reason; input identity and resume."""

from __future__ import annotations

import gzip
import json
from pathlib import Path

import pyarrow as pa
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from raypipe.config import load_config
from raypipe.dataset import TokenDataset
from raypipe.errors import InputError
from raypipe.io.records import WorkUnit
from raypipe.preprocess.inputs import unit_batches
from raypipe.preprocess.job import run_job
from raypipe.preprocess.planning import plan_units
from tests.conftest import write_parquet
from tests.helpers import expected_documents, file_identities, shard_files


def jsonl_bytes(texts: list, **fields: list) -> bytes:
    rows = [{"text": text, **{name: values[i] for name, values in fields.items()}}
            for i, text in enumerate(texts)]
    return b"".join(json.dumps(row).encode() + b"\n" for row in rows)


def write_compressed(path: Path, data: bytes) -> Path:
    path.parent.mkdir(parents=True, exist_ok=True)
    if path.name.endswith(".gz"):
        path.write_bytes(gzip.compress(data))
    elif path.name.endswith(".zst"):
        with pa.CompressedOutputStream(str(path), "zstd") as stream:
            stream.write(data)
    else:
        path.write_bytes(data)
    return path


def tokenize(inputs, output, tokenizer_path, **options):
    config = load_config(None, inputs=[str(inputs)], output=str(output),
                         tokenizer=tokenizer_path, formats=["megatron"], **options)
    return run_job(config)


def documents_of(output: Path) -> list[list[int]]:
    return [document.tolist() for document in TokenDataset(output).iter_documents()]


@pytest.mark.parametrize("name", ["part.jsonl", "part.json", "part.jsonl.gz", "part.json.gz",
                                  "part.jsonl.zst"])
def test_jsonl_inputs_yield_the_parquet_runs_documents(tmp_path, corpus_texts, tokenizer_path,
                                                       name):
    texts = corpus_texts[:300]
    write_parquet(tmp_path / "parquet" / "part.parquet", texts)
    write_compressed(tmp_path / "jsonl" / name, jsonl_bytes(texts))
    parquet = tokenize(tmp_path / "parquet", tmp_path / "from-parquet", tokenizer_path)
    jsonl = tokenize(tmp_path / "jsonl", tmp_path / "from-jsonl", tokenizer_path,
                     unit_bytes=4096)
    assert documents_of(tmp_path / "from-jsonl") == documents_of(tmp_path / "from-parquet")
    assert documents_of(tmp_path / "from-jsonl") == expected_documents(  # megatron: EOS
        tmp_path / "parquet", tokenizer_path, bos=False, eos=True)
    assert (jsonl.rows, jsonl.tokens) == (parquet.rows, parquet.tokens)
    compressed = not name.endswith((".jsonl", ".json"))
    assert (jsonl.units == 1) == compressed  # a compressed file cannot be cut


@settings(max_examples=40, deadline=None,
          suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(lines=st.lists(st.text(alphabet="ab\u00e9\u4e2d \t", max_size=40), min_size=1,
                      max_size=60),
       unit_bytes=st.integers(1, 400))
def test_byte_range_units_read_every_line_exactly_once(tmp_path_factory, lines, unit_bytes):
    path = tmp_path_factory.mktemp("jl") / "lines.jsonl"
    path.write_bytes(jsonl_bytes(lines))
    units = plan_units([str(path)], "text", unit_bytes)
    read = [text for unit in units
            for batch in unit_batches(unit, ["text"], 7)
            for text in batch.column("text").to_pylist()]
    assert read == lines
    assert units[0].byte_start == 0 and all(
        a.byte_stop == b.byte_start for a, b in zip(units, units[1:], strict=False))
    assert len({unit.name for unit in units}) == len(units)


def test_a_malformed_line_names_the_file_and_its_line_and_keeps_committed_units(
        tmp_path, corpus_texts, tokenizer_path):
    good = write_compressed(tmp_path / "in" / "a.jsonl", jsonl_bytes(corpus_texts[:50]))
    lines = jsonl_bytes(corpus_texts[50:150]).splitlines(keepends=True)
    lines[77] = b'{"text": "unterminated\n'
    bad = write_compressed(tmp_path / "in" / "b.jsonl", b"".join(lines))
    with pytest.raises(InputError) as error:
        tokenize(tmp_path / "in", tmp_path / "out", tokenizer_path, unit_bytes=2000)
    assert str(error.value).startswith(f"{bad}: line 78: not valid JSON")
    assert "(Unterminated string starting at column 10)" in str(error.value)  # one "at"
    committed = sorted(p.name for p in (tmp_path / "out" / "_units").glob("a-*.json"))
    assert committed, "the good file's units were committed before the bad line"
    before = file_identities(tmp_path / "out" / "megatron")
    lines[77] = json.dumps({"text": corpus_texts[127]}).encode() + b"\n"
    bad.write_bytes(b"".join(lines))  # fixed: the rerun keeps what was committed
    rerun = tokenize(tmp_path / "in", tmp_path / "out", tokenizer_path, unit_bytes=2000)
    assert rerun.units_run < rerun.units
    assert all(file_identities(tmp_path / "out" / "megatron")[name] == identity
               for name, identity in before.items() if name.startswith("a-"))
    assert good.exists()


def test_a_line_that_is_not_an_object_is_refused_by_line(tmp_path, tokenizer_path):
    path = write_compressed(tmp_path / "in" / "x.jsonl.gz",
                            b'{"text": "fine"}\n["a", "list"]\n')
    with pytest.raises(InputError, match=rf"^{path}: line 2: not a JSON object"):
        tokenize(path, tmp_path / "out", tokenizer_path)


def test_a_missing_text_field_is_refused_at_plan_time_naming_the_fields(tmp_path,
                                                                        tokenizer_path):
    path = write_compressed(tmp_path / "in" / "x.jsonl", b'{"body": "a", "id": 1}\n')
    with pytest.raises(InputError, match=r"text field 'text' not found; available fields: "
                                         r"\['body', 'id'\]"):
        tokenize(path, tmp_path / "out", tokenizer_path)
    assert not (tmp_path / "out").exists()
    summary = tokenize(path, tmp_path / "out", tokenizer_path, text_column="body")
    assert summary.documents == 1


def test_rows_that_hold_no_text_are_counted_by_reason(tmp_path, tokenizer_path):
    lines = [b'{"text": "kept one"}', b'{"text": null}', b'{"id": 3}', b'   ',
             b'{"text": 42}', b'{"text": ""}', b'{"text": "\\ud800 lone"}',
             b'{"text": "bad \xff\xfe bytes"}', b'{"text": "kept two"}']
    path = write_compressed(tmp_path / "in" / "x.jsonl", b"\n".join(lines) + b"\n")
    summary = tokenize(path, tmp_path / "out", tokenizer_path)
    assert summary.documents == 2 and summary.rows == len(lines)
    assert summary.skipped == {"blank_line": 1, "empty": 1, "invalid_utf8": 2,
                               "non_string": 1, "null": 2}
    assert summary.rows == summary.documents + sum(summary.skipped.values())


def test_a_changed_compressed_file_is_tokenized_again(tmp_path, corpus_texts, tokenizer_path):
    path = write_compressed(tmp_path / "in" / "x.jsonl.gz", jsonl_bytes(corpus_texts[:40]))
    tokenize(path, tmp_path / "out", tokenizer_path)
    assert tokenize(path, tmp_path / "out", tokenizer_path).units_run == 0
    write_compressed(path, jsonl_bytes(corpus_texts[1:41]))
    again = tokenize(path, tmp_path / "out", tokenizer_path)
    assert again.units_run == 1
    fresh = tokenize(path, tmp_path / "fresh", tokenizer_path)
    assert shard_files(tmp_path / "out") == shard_files(tmp_path / "fresh")
    assert fresh.documents == 40


def test_stream_metadata_rows_are_file_lines_in_every_byte_range(tmp_path, corpus_texts,
                                                                 tokenizer_path):
    texts = corpus_texts[:120]
    path = write_compressed(tmp_path / "in" / "x.jsonl",
                            jsonl_bytes(texts, id=[f"doc-{i}" for i in range(len(texts))]))
    config = load_config(None, inputs=[str(path)], output=str(tmp_path / "out"),
                         tokenizer=tokenizer_path, formats=["stream"], unit_bytes=3000,
                         metadata_columns=["id"])
    summary = run_job(config)
    assert summary.units > 3
    dataset = TokenDataset(tmp_path / "out", "stream")
    records = [record for shard in range(dataset.num_shards)
               for record in dataset.reader(shard).read_records(
                   0, dataset.reader(shard).num_records - 1)]
    kept = [i for i, text in enumerate(texts) if text]
    assert [record["row"] for record in records] == kept
    assert [record["id"] for record in records] == [f"doc-{i}" for i in kept]
    assert {record["source"] for record in records} == {"x.jsonl"}


def test_a_unit_names_its_byte_range_in_messages(tmp_path):
    unit = WorkUnit("/d/x.jsonl", 0, 1, -1, "x", kind="jsonl", byte_start=10, byte_stop=20)
    assert unit.location == "/d/x.jsonl: bytes 10..19"
    whole = WorkUnit("/d/x.jsonl.gz", 0, 1, -1, "x", kind="jsonl")
    assert whole.location == "/d/x.jsonl.gz"


def test_units_a_rewritten_file_no_longer_yields_are_removed_and_counted(
        tmp_path, corpus_texts, tokenizer_path):
    """A rewritten uncompressed file is cut into other byte ranges: once the new manifest
    is written, the old ranges' shards and records are gone (counted), so the output holds
    exactly what a fresh run of the new file writes."""
    path = write_compressed(tmp_path / "in" / "x.jsonl", jsonl_bytes(corpus_texts[:100]))
    first = tokenize(path, tmp_path / "out", tokenizer_path, unit_bytes=3000)
    write_compressed(path, jsonl_bytes(corpus_texts[7:90]))
    again = tokenize(path, tmp_path / "out", tokenizer_path, unit_bytes=3000)
    assert first.units > 2 and again.units_removed >= 1
    assert "removed" in again.render()
    tokenize(path, tmp_path / "fresh", tokenizer_path, unit_bytes=3000)
    assert shard_files(tmp_path / "out") == shard_files(tmp_path / "fresh")
    assert sorted(p.name for p in (tmp_path / "out" / "_units").iterdir()) == \
        sorted(p.name for p in (tmp_path / "fresh" / "_units").iterdir())


@pytest.mark.parametrize("unit_bytes", [1, 64 << 20], ids=["file-units", "one-group"])
def test_empty_json_lines_files_are_counted_in_the_summary_not_fatal(
        tmp_path, corpus_texts, tokenizer_path, unit_bytes):
    """An empty `.jsonl`, an empty `.jsonl.gz` and a 0-row parquet file are empty inputs,
    not corrupt ones: without --skip-bad-files the job goes on and names them; a file of
    blank lines is read (its lines counted as blank_line)."""
    write_compressed(tmp_path / "in" / "a.jsonl", jsonl_bytes(corpus_texts[:20]))
    (tmp_path / "in" / "b-empty.jsonl").write_bytes(b"")
    write_compressed(tmp_path / "in" / "c-empty.jsonl.gz", b"")
    (tmp_path / "in" / "d-blank.jsonl").write_bytes(b"\n\n")
    write_parquet(tmp_path / "in" / "e-empty.parquet", [])
    summary = tokenize(tmp_path / "in", tmp_path / "out", tokenizer_path,
                       unit_bytes=unit_bytes)
    assert summary.documents == sum(1 for text in corpus_texts[:20] if text)
    assert [uri.rsplit("/", 1)[1] for uri in summary.empty_files] == \
        ["b-empty.jsonl", "c-empty.jsonl.gz", "e-empty.parquet"]
    assert "empty      3 input file(s) hold no row (counted, not an error): " in \
        summary.render()
    assert summary.skipped.get("blank_line") == 2 and not summary.bad_files


def lines_before_the_error(path: Path) -> tuple[list[bytes], str]:
    from raypipe.preprocess.jsonl import _lines

    got = []
    with pytest.raises(InputError) as caught:
        for line in _lines(str(path), 0, None, chunk_bytes=4096):
            got.append(line)
    return got, str(caught.value)


def gzip_module_lines(path: Path) -> list[bytes]:
    """The complete lines Python's gzip module decodes before the damage (it loses what its
    buffer held when it raised: a lower bound)."""
    lines = []
    with gzip.open(path, "rb") as handle:
        try:
            for line in handle:
                if line.endswith(b"\n"):
                    lines.append(line[:-1])
        except (EOFError, OSError, gzip.BadGzipFile):
            pass
    return lines


def agreeing(lines: list[bytes], original: list[bytes]) -> int:
    """How many of `lines`, from the first, are the original file's lines."""
    count = 0
    for line, expected in zip(lines, original, strict=False):
        if line != expected:
            break
        count += 1
    return count


@pytest.mark.parametrize("damage", ["truncated", "truncated-second-member", "corrupt-block"])
def test_a_damaged_gzip_yields_every_complete_line_before_the_damage(tmp_path, corpus_texts,
                                                                    damage):
    """pyarrow's decoder loses the read that fails; the reader decodes the file again with
    zlib from where it stood, so the complete lines before the damage come out (at least
    as many as Python's gzip module gives, each the original line; a truncated file's are
    exactly the original's first lines, the cut one dropped), then one error naming the
    byte it stopped at. (Inside a corrupt deflate block, bytes can decode into garbage
    before zlib notices: those lines are not the original's, as with any gzip reader.)"""
    import random

    original = jsonl_bytes(corpus_texts[:600]).splitlines()
    first = gzip.compress(b"\n".join(original[:300]) + b"\n")
    second = gzip.compress(b"\n".join(original[300:]) + b"\n")
    if damage == "truncated":
        packed = first[:len(first) * 2 // 3]
    elif damage == "truncated-second-member":
        packed = first + second[:len(second) // 2]
    else:
        middle = len(first) // 2
        packed = first[:middle] + random.Random(0).randbytes(64) + first[middle + 64:]
    path = tmp_path / "damaged.jsonl.gz"
    path.write_bytes(packed)
    got, error = lines_before_the_error(path)
    assert f"{path}: cannot be read past decompressed byte" in error
    assert agreeing(got, original) >= agreeing(gzip_module_lines(path), original) and \
        agreeing(got, original) > 50
    if damage != "corrupt-block":
        assert got == original[:len(got)]
    if damage == "truncated-second-member":
        assert len(got) > 300  # the whole first member, and part of the second


def test_an_empty_gzip_file_of_zero_bytes_reads_as_no_line(tmp_path):
    from raypipe.preprocess.jsonl import _lines

    (tmp_path / "empty.jsonl.gz").write_bytes(b"")
    assert list(_lines(str(tmp_path / "empty.jsonl.gz"), 0, None)) == []


def test_a_skipped_truncated_gzip_names_its_path_once_in_each_line(tmp_path, corpus_texts,
                                                                   tokenizer_path, caplog):
    """Under skip_bad_files, a truncated .jsonl.gz is named once in the warning and in the
    summary's line, its reason beside it (the reason repeated the path before)."""
    data = tmp_path / "in"
    data.mkdir()
    (data / "good.jsonl").write_bytes(jsonl_bytes(corpus_texts[:200]))
    packed = gzip.compress(jsonl_bytes(corpus_texts[200:800]))
    bad = data / "cut.jsonl.gz"
    bad.write_bytes(packed[:len(packed) // 2])
    summary = run_job(load_config(None, inputs=[str(data)], output=str(tmp_path / "out"),
                                  tokenizer=tokenizer_path, skip_bad_files=True))
    reason = summary.bad_files[0].reason
    assert str(bad) not in reason and "truncated gzip stream" in reason
    warned = [r.getMessage() for r in caplog.records if "bad input file" in r.getMessage()]
    line = next(line for line in summary.render().splitlines() if "bad files" in line)
    for text in (*warned, line):
        assert text.count(str(bad)) == 1, text
