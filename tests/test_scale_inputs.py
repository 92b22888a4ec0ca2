"""Corpora as users tokenize them: many small files grouped by bytes, giant rows, corrupt
files skipped on request, and every skipped row named. Serial runner, no Ray."""

from __future__ import annotations

import gzip
import json
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
from raypipe.tools.inspect import list_rejects
from raypipe.tools.trace import InputRows
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
    assert summary.documents == 90
    assert [b.uri for b in summary.bad_files] == [str(bad)]
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
