"""Corpora as users tokenize them: many small files grouped by bytes, giant rows, corrupt
files skipped on request, and every skipped row named. Serial runner, no Ray."""

from __future__ import annotations

import gzip
import json
import logging
import os
import random
from pathlib import Path

import pyarrow.parquet as pq
import pytest
from tokenizers import Tokenizer

from raypipe.config import load_config
from raypipe.dataset import TokenDataset
from raypipe.errors import InputError
from raypipe.io.manifest import read_manifest, unit_record_name
from raypipe.io.records import UnitRecord
from raypipe.io.store import Store
from raypipe.preprocess.inputs import find_inputs
from raypipe.preprocess.job import run_job
from raypipe.preprocess.planning import GROUP_FILES, file_groups, plan_inputs
from raypipe.provenance.rows import InputRows
from raypipe.tools.inspect import list_rejects
from tests.conftest import write_parquet

UNIT_BYTES = 16 << 10


def small_corpus(directory: Path, texts: list[str], files: int) -> list[Path]:
    """`files` small parquet files (with a null and an empty row in some) and one JSON-lines
    file, sizes drawn unevenly."""
    rng = random.Random(5)
    paths, start = [], 0
    for index in range(files):
        count = rng.choice([2, 3, 5, 9])
        rows: list = texts[start:start + count]
        start += count
        if index % 7 == 3:
            rows = [rows[0], None, "", *rows[1:]]
        paths.append(write_parquet(directory / f"f{index:03d}.parquet", rows, 4))
    lines = [json.dumps({"text": text}) for text in texts[start:start + 12]]
    (directory / "g.jsonl").write_text("\n".join(lines[:5] + [""] + lines[5:]) + "\n")
    return [*paths, directory / "g.jsonl"]


def tokenize(inputs: list[str], output: Path, tokenizer: str, **options):
    return run_job(load_config(None, inputs=inputs, output=str(output), tokenizer=tokenizer,
                               formats=["megatron"], **options))


def test_small_files_are_grouped_into_units_by_bytes(tmp_path, corpus_texts):
    paths = small_corpus(tmp_path / "in", corpus_texts, 60)
    large = write_parquet(tmp_path / "in" / "large.parquet", corpus_texts[:400], 40)
    found = find_inputs([*map(str, paths), str(large)])
    units = plan_inputs(found, ["text"], UNIT_BYTES).units
    small_bytes = sum(stat.size for uri, stat in found.stats.items() if uri != str(large))
    large_units = [unit for unit in units if unit.uri == str(large)]
    groups = [unit for unit in units if unit.kind == "group"]
    assert len(large_units) > 1  # a large file is cut as before
    assert groups and len(groups) <= small_bytes / UNIT_BYTES + 1
    assert len(units) <= sum(found.stats[u].size for u in found.files) / UNIT_BYTES + 1
    member_uris = [uri for unit in units if unit.uri != str(large) for uri in unit.uris]
    assert sorted(member_uris) == sorted(set(found.files) - {str(large)})  # each file once
    assert all(group.size_bytes >= UNIT_BYTES for group in groups[:-1])


def test_grouping_is_a_pure_function_of_the_sorted_files_and_sizes(tmp_path, corpus_texts):
    paths = small_corpus(tmp_path / "in", corpus_texts, 30)
    found = find_inputs([str(path) for path in paths])
    first = plan_inputs(found, ["text"], UNIT_BYTES).units
    listed = find_inputs(list(reversed(found.files)))  # the same files, named otherwise
    assert [u.name for u in plan_inputs(listed, ["text"], UNIT_BYTES).units] == \
        [u.name for u in first]
    many = [f"s3://b/{index:06d}.parquet" for index in range(GROUP_FILES + 10)]
    stats = {uri: found.stats[found.files[0]] for uri in many}
    groups = file_groups(many, stats, 1 << 62)
    assert [len(group) for group in groups] == [GROUP_FILES, 10]  # a record stays bounded


def test_a_group_tokenizes_every_row_once_and_traces_each_document_to_its_file_row(
        tmp_path, corpus_texts, tokenizer_path):
    paths = small_corpus(tmp_path / "in", corpus_texts, 40)
    summary = tokenize([str(path) for path in paths], tmp_path / "out", tokenizer_path,
                       unit_bytes=UNIT_BYTES)
    manifest = read_manifest(tmp_path / "out")
    assert summary.units == len(manifest.units) < len(paths) / 4
    assert summary.shards < len(paths) / 4  # shards follow bytes, not files
    tokenizer = Tokenizer.from_file(tokenizer_path)
    bos, eos = manifest.tokenizer.bos_id, manifest.tokenizer.eos_id
    dataset = TokenDataset(tmp_path / "out", "megatron")
    rows = InputRows(dataset)
    texts: dict[str, list] = {}
    for index, document in enumerate(dataset.iter_documents()):
        uri, row = rows(index)
        if uri not in texts:
            texts[uri] = (pq.read_table(uri).column("text").to_pylist() if
                          uri.endswith(".parquet") else
                          [json.loads(line)["text"] if line else None
                           for line in Path(uri).read_text().splitlines()])
        ids = tokenizer.encode(texts[uri][row], add_special_tokens=False).ids
        assert document.tolist() == [*[bos][:bos is not None], *ids,
                                     *[eos][:eos is not None]], (uri, row)
    assert summary.documents == index + 1


def test_a_rerun_skips_committed_groups_and_runs_only_a_changed_one(
        tmp_path, corpus_texts, tokenizer_path):
    small_corpus(tmp_path / "in", corpus_texts, 40)
    inputs = [str(tmp_path / "in")]
    first = tokenize(inputs, tmp_path / "out", tokenizer_path, unit_bytes=UNIT_BYTES)
    assert tokenize(inputs, tmp_path / "out", tokenizer_path,
                    unit_bytes=UNIT_BYTES).units_run == 0
    changed = tmp_path / "in" / "f010.parquet"  # rewritten in place: same size, new time
    changed.write_bytes(changed.read_bytes())
    os.utime(changed, ns=(1, 1))
    again = tokenize(inputs, tmp_path / "out", tokenizer_path, unit_bytes=UNIT_BYTES)
    assert again.units_run == 1 and again.units == first.units


def test_skipped_rows_are_named_with_file_row_and_reason(tmp_path, corpus_texts,
                                                          tokenizer_path):
    write_parquet(tmp_path / "in" / "a.parquet", ["fine text", None, "", "x" * 5000,
                                                  "more text"], 2)
    (tmp_path / "in" / "b.jsonl").write_text('{"text": "one"}\n\n{"text": 7}\n')
    tokenize([str(tmp_path / "in" / "a.parquet"), str(tmp_path / "in" / "b.jsonl")],
             tmp_path / "out", tokenizer_path, max_document_chars=1000)
    store = Store(tmp_path / "out")
    rejects = {(r.uri.rsplit("/", 1)[-1], r.row, r.reason)
               for unit in read_manifest(store).units
               for r in UnitRecord.from_json(store.read_json(unit_record_name(unit.name)),
                                             "x").rejects}
    assert rejects == {("a.parquet", 1, "null"), ("a.parquet", 2, "empty"),
                       ("a.parquet", 3, "too_long"), ("b.jsonl", 1, "blank_line"),
                       ("b.jsonl", 2, "non_string")}
    listed = list_rejects(tmp_path / "out")
    assert "a.parquet\trow 3\ttoo_long" in listed and "b.jsonl\trow 1\tblank_line" in listed


def test_a_giant_row_is_counted_too_long_and_named_without_being_encoded(
        tmp_path, corpus_texts, tokenizer_path):
    giant = "word " * 4_000_000  # 20 MB in one row
    write_parquet(tmp_path / "in" / "a.parquet", [*corpus_texts[:20], giant], 50)
    summary = tokenize([str(tmp_path / "in")], tmp_path / "out", tokenizer_path,
                       max_document_chars=1_000_000, tokenizer_backend="auto")
    assert summary.skipped == {"too_long": 1} and summary.documents == 20
    assert "row 20\ttoo_long" in list_rejects(tmp_path / "out")


def truncated_gzip(path: Path, texts: list[str]) -> Path:
    data = "".join(json.dumps({"text": text}) + "\n" for text in texts).encode()
    packed = gzip.compress(data)
    path.write_bytes(packed[:len(packed) // 2])
    return path


def complete_lines_before_the_damage(path: Path) -> list[str]:
    """What Python's gzip module decodes of a damaged file before it raises, whole lines
    only (independent of raypipe's reader; a lower bound: it loses what its buffer held)."""
    lines = []
    with gzip.open(path, "rt") as handle:
        try:
            for line in handle:
                if line.endswith("\n"):
                    lines.append(line)
        except (EOFError, OSError):
            pass
    return lines


def good_and_bad_jsonl(directory: Path, texts: list[str]) -> Path:
    directory.mkdir(parents=True)
    for index in range(3):
        (directory / f"good{index}.jsonl").write_text(
            "".join(json.dumps({"text": t}) + "\n" for t in texts[index * 30:index * 30 + 30]))
    return truncated_gzip(directory / "bad.jsonl.gz", texts[200:900])


@pytest.mark.parametrize("unit_bytes", [1, 1 << 30], ids=["alone", "grouped"])
def test_a_truncated_gzip_fails_in_one_line_naming_it(tmp_path, corpus_texts, tokenizer_path,
                                                       unit_bytes):
    bad = good_and_bad_jsonl(tmp_path / "in", corpus_texts)
    with pytest.raises(InputError) as caught:
        tokenize([str(tmp_path / "in")], tmp_path / "out", tokenizer_path,
                 unit_bytes=unit_bytes)
    assert str(bad) in str(caught.value) and "\n" not in str(caught.value)
    assert "Truncated" in str(caught.value) or "truncated" in str(caught.value)


@pytest.mark.parametrize("unit_bytes", [1, 1 << 30], ids=["alone", "grouped"])
def test_skip_bad_files_completes_and_names_the_file_in_summary_and_manifest(
        tmp_path, corpus_texts, tokenizer_path, unit_bytes):
    bad = good_and_bad_jsonl(tmp_path / "in", corpus_texts)
    summary = tokenize([str(tmp_path / "in")], tmp_path / "out", tokenizer_path,
                       unit_bytes=unit_bytes, skip_bad_files=True)
    [skipped] = summary.bad_files
    kept = skipped.rows_read  # the file's first lines: at least what Python's gzip decodes
    assert kept >= len(complete_lines_before_the_damage(bad)) > 100
    assert summary.documents == 90 + sum(1 for text in corpus_texts[200:200 + kept] if text)
    assert skipped.uri == str(bad) and skipped.reason.startswith(f"line {kept + 1}: ")
    assert [b.uri for b in read_manifest(tmp_path / "out").bad_files] == [str(bad)]
    assert str(bad) in summary.render() and "bad file" in list_rejects(tmp_path / "out")
    rerun = tokenize([str(tmp_path / "in")], tmp_path / "out", tokenizer_path,
                     unit_bytes=unit_bytes, skip_bad_files=True)
    assert rerun.units_run == 0 and [b.uri for b in rerun.bad_files] == [str(bad)]


def test_a_corrupt_parquet_footer_is_skipped_at_planning_on_request(
        tmp_path, corpus_texts, tokenizer_path):
    write_parquet(tmp_path / "in" / "a.parquet", corpus_texts[:30], 10)
    broken = tmp_path / "in" / "b.parquet"
    broken.write_bytes(b"PAR1" + os.urandom(3000) + b"PAR1")
    with pytest.raises(InputError, match="b.parquet"):
        tokenize([str(tmp_path / "in")], tmp_path / "out", tokenizer_path, unit_bytes=1)
    summary = tokenize([str(tmp_path / "in")], tmp_path / "out", tokenizer_path,
                       unit_bytes=1, skip_bad_files=True)
    assert summary.documents == 30 and [b.uri for b in summary.bad_files] == [str(broken)]


def test_a_group_of_files_with_different_text_types_gives_every_row_in_order(
        tmp_path, corpus_texts, tokenizer_path):
    import pyarrow as pa

    kinds = [pa.string(), pa.large_string(), pa.binary(), pa.string()]
    paths = [write_parquet(tmp_path / "in" / f"f{index}.parquet",
                           [t.encode() if kind == pa.binary() else t
                            for t in corpus_texts[index * 5:index * 5 + 5]], 2, kind)
             for index, kind in enumerate(kinds)]
    tokenize([str(p) for p in paths], tmp_path / "out", tokenizer_path, encode_batch_rows=3)
    manifest = read_manifest(tmp_path / "out")
    assert len(manifest.units) == 1 and manifest.totals.documents == 20
    tokenizer = Tokenizer.from_file(tokenizer_path)
    eos = manifest.tokenizer.eos_id
    got = [d.tolist() for d in TokenDataset(tmp_path / "out", "megatron").iter_documents()]
    assert got == [[*tokenizer.encode(t, add_special_tokens=False).ids, eos]
                   for t in corpus_texts[:20]]


def test_a_group_reads_compressed_json_lines_files_whole(tmp_path, corpus_texts,
                                                          tokenizer_path):
    paths = []
    for index in range(3):
        data = "".join(json.dumps({"text": t}) + "\n"
                       for t in corpus_texts[index * 10:index * 10 + 10]).encode()
        path = tmp_path / "in" / f"part{index}.jsonl.gz"
        path.parent.mkdir(exist_ok=True)
        path.write_bytes(gzip.compress(data))
        paths.append(str(path))
    summary = tokenize(paths, tmp_path / "out", tokenizer_path)
    assert summary.units == 1 and summary.documents == 30 and not summary.bad_files


def documents_of(output: Path) -> list[list[int]]:
    return [d.tolist() for d in TokenDataset(output, "megatron").iter_documents()]


def encoded(tokenizer_path: str, texts: list[str]) -> list[list[int]]:
    tokenizer = Tokenizer.from_file(tokenizer_path)
    eos = tokenizer.token_to_id("<|eos|>")
    return [[*tokenizer.encode(t, add_special_tokens=False).ids, eos] for t in texts if t]


@pytest.mark.parametrize("unit_bytes", [100_000, 1 << 30], ids=["byte-ranges", "grouped"])
def test_a_bad_json_line_under_skip_bad_files_is_a_named_reject_and_every_other_line_is_kept(
        tmp_path, corpus_texts, tokenizer_path, unit_bytes, caplog):
    """3,000 good lines then a bad one (past two whole batches of 1,024), and a file whose
    line 3 is bad: every other line is kept, in order; each bad line is a reject named by
    its row, counted as invalid_json; neither file is a bad file."""
    texts = [corpus_texts[i % 800] or "x" for i in range(3000)]
    (tmp_path / "in").mkdir()
    (tmp_path / "in" / "a.jsonl").write_text(
        "".join(json.dumps({"text": t}) + "\n" for t in texts) + '{"text": "cut\n')
    small = [json.dumps({"text": t}) + "\n" for t in corpus_texts[:6]]
    small[2] = "not json at all\n"
    (tmp_path / "in" / "b.jsonl").write_text("".join(small))
    with caplog.at_level(logging.WARNING, logger="raypipe"):
        summary = tokenize([str(tmp_path / "in")], tmp_path / "out", tokenizer_path,
                           unit_bytes=unit_bytes, skip_bad_files=True)
    assert "line(s) that are not JSON skipped" not in caplog.text  # 2 of 3,006: under 1%
    kept = texts + [t for i, t in enumerate(corpus_texts[:6]) if i != 2]
    assert documents_of(tmp_path / "out") == encoded(tokenizer_path, kept)
    assert summary.skipped.get("invalid_json") == 2 and not summary.bad_files
    listed = list_rejects(tmp_path / "out")
    assert "a.jsonl\trow 3000\tinvalid_json" in listed
    assert "b.jsonl\trow 2\tinvalid_json" in listed
    with pytest.raises(InputError, match="b.jsonl: line 3: not valid JSON"):
        tokenize([str(tmp_path / "in" / "b.jsonl")], tmp_path / "strict", tokenizer_path)
    with caplog.at_level(logging.WARNING, logger="raypipe"):  # 1 of 6 rows: a warning
        tokenize([str(tmp_path / "in" / "b.jsonl")], tmp_path / "small", tokenizer_path,
                 skip_bad_files=True)
    assert "1 line(s) that are not JSON skipped: 16.7% of the rows read" in caplog.text


def damage_row_group(path: Path, group: int) -> None:
    """Overwrite the middle of one row group's text column chunk, leaving the footer."""
    column = pq.ParquetFile(path).metadata.row_group(group).column(0)
    start = column.data_page_offset
    data = bytearray(path.read_bytes())
    middle = start + column.total_compressed_size // 2
    data[start + 8:middle] = os.urandom(middle - start - 8)
    path.write_bytes(bytes(data))


@pytest.mark.parametrize("unit_bytes", [1, 1 << 30], ids=["alone", "grouped"])
def test_a_damaged_parquet_row_group_keeps_the_whole_row_groups_before_it(
        tmp_path, corpus_texts, tokenizer_path, unit_bytes):
    texts = [t or "x" for t in corpus_texts[:100]]
    write_parquet(tmp_path / "in" / "a.parquet", corpus_texts[100:110], 5)
    damaged = write_parquet(tmp_path / "in" / "b.parquet", texts, 20)
    damage_row_group(damaged, 2)
    summary = tokenize([str(tmp_path / "in")], tmp_path / "out", tokenizer_path,
                       unit_bytes=unit_bytes, skip_bad_files=True)
    rows_read = 40 if unit_bytes > 1 else 0  # alone: each row group a unit; group 2's read 0
    assert [(b.uri, b.rows_read) for b in summary.bad_files] == [(str(damaged), rows_read)]
    assert "row group 2 cannot be read" in summary.bad_files[0].reason
    assert "\n" not in summary.bad_files[0].reason
    after = texts[60:] if unit_bytes == 1 else []  # alone: the groups after are units too
    assert documents_of(tmp_path / "out") == encoded(tokenizer_path,
                                                     corpus_texts[100:110] + texts[:40] + after)


def test_a_group_with_garbage_files_fails_before_its_work_naming_every_one(
        tmp_path, corpus_texts, tokenizer_path, monkeypatch):
    """Without --skip-bad-files, a unit of many good files and two garbage ones fails before
    a row is tokenized (an injected fault at the first tokenized rows would otherwise fire
    first), naming both files; the planner names every bad file it reads too."""
    from raypipe import _faults as faults

    for index in range(40):
        write_parquet(tmp_path / "in" / f"f{index:02d}.parquet", corpus_texts[index::40][:5])
    garbage = [tmp_path / "in" / "f20x.parquet", tmp_path / "in" / "f39x.parquet"]
    for path in garbage:
        path.write_bytes(b"PAR1" + os.urandom(500) + b"PAR1")
    monkeypatch.setenv(faults.ENVIRONMENT_VARIABLE, json.dumps(
        {"point": "unit.rows", "action": "raise", "marker": str(tmp_path / "fired")}))
    with pytest.raises(InputError) as caught:
        tokenize([str(tmp_path / "in")], tmp_path / "out", tokenizer_path)
    message = str(caught.value)
    assert message.startswith("2 input files cannot be read (pass --skip-bad-files")
    assert all(str(path) in message for path in garbage)
    assert not (tmp_path / "fired").exists()  # no row was tokenized
    with pytest.raises(InputError) as planned:  # every file its own unit: the planner
        tokenize([str(tmp_path / "in")], tmp_path / "out2", tokenizer_path, unit_bytes=1)
    assert all(str(path) in str(planned.value) for path in garbage)


def test_a_document_limit_capped_by_the_memory_budget_is_said_in_the_log_and_summary(
        tmp_path, corpus_texts, tokenizer_path, caplog):
    """--max-document-chars 60,000,000 under a budget that allows 50,000 characters: the
    100,000-character row past the cap is too_long, and both the log and the summary say why."""
    import logging

    write_parquet(tmp_path / "in" / "a.parquet", [*corpus_texts[:5], "word " * 20_000], 10)
    with caplog.at_level(logging.WARNING, logger="raypipe"):
        summary = tokenize([str(tmp_path / "in")], tmp_path / "out", tokenizer_path,
                           max_document_chars=60_000_000, worker_memory_budget=10_000_000)
    note = "--max-document-chars 60,000,000 is capped at 50,000 characters by " \
        "--worker-memory-budget 10,000,000"
    assert summary.skipped == {"too_long": 1} and note in caplog.text
    assert f"  too_long   {note}" in summary.render()
    quiet = tokenize([str(tmp_path / "in")], tmp_path / "out2", tokenizer_path)
    assert "too_long   " not in quiet.render()


def test_a_batch_that_spans_a_good_and_a_damaged_row_group_loses_none_of_the_good_rows(
        tmp_path, corpus_texts):
    """Batches of 32 rows over row groups of 20: the batch of rows 32-63 holds group 1's
    last 8 rows beside damaged group 2's. The reader gives rows 0-39 (every whole row group
    before the damage, each row once, in order), then an error naming row group 2."""
    from raypipe.preprocess.inputs import unit_batches, units_of_file

    texts = [f"row {index}: {text}" for index, text in enumerate(corpus_texts[:100])]
    damaged = write_parquet(tmp_path / "b.parquet", texts, 20)
    damage_row_group(damaged, 2)
    [unit] = units_of_file(str(damaged), ["text"], 1 << 30)
    got = []
    with pytest.raises(InputError, match="row group 2 cannot be read"):
        for batch in unit_batches(unit, ["text"], 32):
            got += batch.column("text").to_pylist()
    assert got == texts[:40]
