"""Stream-with-metadata and LLMBATCH outputs of the tokenize job (serial runner, no Ray):
round trips against direct tokenization, per-token metadata, spans, LLMBATCH layout."""

from __future__ import annotations

import struct
from collections import Counter

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from tokenizers import Tokenizer

from raypipe.config import load_config
from raypipe.dataset import BatchDataset, TokenDataset
from raypipe.errors import InputError
from raypipe.formats.llmbatch import LLMBatchReader
from raypipe.io.manifest_compat import PAD_BEFORE_LENGTHS as LEGACY_PAD_ID
from raypipe.preprocess.job import run_job
from tests.helpers import expected_documents

WORD_SPANS_PER_DOC = 3


def annotated_corpus(directory, texts):
    """Parquet with id, url, text and spans: the first few words of each text annotated."""
    rows = []
    for index, text in enumerate(texts):
        spans, at = [], 0
        for word in text.split()[:WORD_SPANS_PER_DOC]:
            start = text.index(word, at)
            spans.append({"start": start, "end": start + len(word), "labels": [f"w{index}"]})
            at = start + len(word)
        rows.append(spans)
    table = pa.table({"id": list(range(len(texts))), "url": [f"https://x/{i}" for i in
                                                            range(len(texts))],
                      "text": texts, "spans": rows})
    directory.mkdir(parents=True, exist_ok=True)
    pq.write_table(table, directory / "a.parquet", row_group_size=40)
    return directory


def run(corpus, output, tokenizer_path, **options):
    config = load_config(None, inputs=[str(corpus)], output=str(output), tokenizer=tokenizer_path,
                         unit_bytes=1, **options)
    return run_job(config)


def test_stream_round_trip_with_document_and_span_metadata(tmp_path, corpus_texts,
                                                           tokenizer_path):
    texts = corpus_texts[:120]
    corpus = annotated_corpus(tmp_path / "corpus", texts)
    run(corpus, tmp_path / "out", tokenizer_path, formats=["stream", "megatron"],
        metadata_columns=["id", "url"], span_column="spans", shard_tokens=4000)
    stream = TokenDataset(tmp_path / "out", "stream")
    assert stream.num_shards > 1
    docs = [d.tolist() for d in stream.iter_documents()]
    assert docs == expected_documents(corpus, tokenizer_path)
    tokenizer = Tokenizer.from_file(tokenizer_path)
    position = 0
    for index, text in enumerate(texts):
        encoding = tokenizer.encode(text, add_special_tokens=False)
        window = stream.window(position, len(encoding.ids) + 1)
        document = window.record_of(0)  # BOS carries the document record
        assert document == {"source": "a.parquet", "row": index, "id": index,
                            "url": f"https://x/{index}"}
        table_spans = [s for s in annotated_spans(text)]
        for token, (start, end) in enumerate(encoding.offsets, start=1):
            covering = [s for s in table_spans if start < s[1] and end > s[0]]
            record = window.record_of(token)
            if covering:
                assert record["start"] == covering[0][0] and record["end"] == covering[0][1]
                assert record["labels"] == [f"w{index}"]
                assert window.records[int(window.metadata_ids[0])] == document
            else:
                assert record == document
        position += len(encoding.ids) + 1


def annotated_spans(text):
    spans, at = [], 0
    for word in text.split()[:WORD_SPANS_PER_DOC]:
        start = text.index(word, at)
        spans.append((start, start + len(word)))
        at = start + len(word)
    return spans


def test_stream_without_metadata_is_plain_tokens(tmp_path, corpus_dir, tokenizer_path):
    run(corpus_dir, tmp_path / "out", tokenizer_path, formats=["stream"], metadata=False)
    files = sorted(p.name for p in (tmp_path / "out" / "stream").glob("*.tokens"))
    others = {p.suffix for p in (tmp_path / "out" / "stream").iterdir()} - {".tokens"}
    assert files and others == {".lengths", ".sums"}  # no metadata files; the sidecars
    docs = [d.tolist() for d in TokenDataset(tmp_path / "out", "stream").iter_documents()]
    assert docs == expected_documents(corpus_dir, tokenizer_path)
    path = tmp_path / "out" / "stream" / files[0]
    assert path.stat().st_size % 4 == 0


def test_bad_span_names_file_row_and_column(tmp_path, tokenizer_path):
    table = pa.table({"text": ["hello world", "second"],
                      "spans": [[{"start": 0, "end": 5}], [{"start": 3, "end": 99}]]})
    (tmp_path / "c").mkdir()
    pq.write_table(table, tmp_path / "c" / "bad.parquet")
    with pytest.raises(InputError, match=r"bad.parquet: row 1, column 'spans'"):
        run(tmp_path / "c", tmp_path / "out", tokenizer_path, formats=["stream"],
            span_column="spans")


@pytest.mark.parametrize("packing", ["bestfit", "crop", "concat", "split", "fill"])
def test_llmbatch_files_match_the_spec_field_by_field(tmp_path, corpus_dir, tokenizer_path,
                                                      packing):
    record_len, batch = 64, 3
    summary = run(corpus_dir, tmp_path / "out", tokenizer_path, formats={"llmbatch": {
        "record_len": record_len, "batch_size": batch, "seed": 77, "packing": packing,
        "batches_per_shard": 10}})
    assert summary.documents > 0
    import json

    manifest = json.loads((tmp_path / "out" / "manifest.json").read_text())
    section = manifest["formats"]["llmbatch"]
    assert len(section["shards"]) > 1
    assert section["packing"] == packing  # as given: an output's fingerprint keeps it
    read = BatchDataset(tmp_path / "out").options.packing  # a former name read as today's
    assert read == ("crop" if packing == "bestfit" else packing)
    documents = expected_documents(corpus_dir, tokenizer_path)
    stream = np.concatenate([np.array(d) for d in documents])
    doc_starts = {0}
    total = 0
    for d in documents:
        total += len(d)
        doc_starts.add(total)
    seen_records, seen_lengths = [], []
    pad_id = section["pad_id"]
    tokenizer = manifest["tokenizer"]
    assert tokenizer["pad_id"] is not None  # the demo tokenizer's <pad>
    assert pad_id == tokenizer["pad_id"]
    for shard in section["shards"]:
        path, lengths_path, pieces_path = (tmp_path / "out" / entry["path"]
                                           for entry in shard["files"])
        assert (path.suffix, lengths_path.suffix, pieces_path.suffix) == (
            ".batch", ".lengths", ".pieces")
        data = path.read_bytes()
        magic, version, b, t, n, dtype, seed, total_records = struct.unpack_from(
            "<8sIIIQIII", data)
        assert (magic, version, b, t, n, dtype, seed) == (b"LLMBATCH", 1, batch, record_len,
                                                          shard["batches"], 0, 77)
        assert total_records == section["total_records"]
        assert not any(data[40:4096])
        padded = -(-batch * record_len * 4 // 4096) * 4096
        assert len(data) == 4096 + n * padded
        reader = LLMBatchReader(path, lengths_path, pieces_path)
        lengths = np.frombuffer(lengths_path.read_bytes(), "<u4")
        assert lengths.size == n * batch and lengths.max() <= record_len
        pieces = pieces_path.read_bytes()  # (records + 1) u64 offsets, then u32 words
        offsets = np.frombuffer(pieces, "<u8", n * batch + 1).astype(np.int64)
        words = np.frombuffer(pieces, "<u4", offset=8 * (n * batch + 1))
        assert offsets[0] == 0 and offsets[-1] == words.size and (np.diff(offsets) > 0).all()
        columns = words & ((1 << 30) - 1)
        assert (columns[offsets[:-1]] == 0).all()  # a record's first piece starts it
        record_of = np.repeat(np.arange(n * batch), np.diff(offsets))
        assert (columns < lengths[record_of]).all()
        seen_lengths.extend(lengths.tolist())
        for i in range(n):
            slot = data[4096 + i * padded: 4096 + (i + 1) * padded]
            assert not any(slot[batch * record_len * 4:])  # slot padding is zero
            records = np.frombuffer(slot, "<u4", batch * record_len).reshape(batch, record_len)
            assert np.array_equal(records, reader.batch(i))
            seen_records.extend(map(tuple, records.tolist()))
    assert len(seen_records) == section["num_batches"] * batch
    assert section["num_batches"] == section["total_records"] // batch
    for record in seen_records[:50]:
        if packing in ("bestfit", "crop"):
            assert record[0] == 0  # every record starts with BOS
        elif packing == "concat":  # a window of the concatenated stream
            assert _is_window(stream, record, record_len - 1)
    counts = {k: section[f"{k}_tokens"] for k in ("used", "cropped", "padded", "dropped")}
    assert counts["used"] + counts["cropped"] + counts["dropped"] == len(stream) or \
        packing == "concat"  # windows share a token: their counts are per window
    records = np.array(seen_records, dtype=np.int64)
    assert records.max() <= manifest["tokenizer"]["largest_id"]  # every id a real token
    padding = np.arange(record_len)[None, :] >= np.array(seen_lengths)[:, None]
    assert (records[padding] == pad_id).all()  # padding is the record's tail of pad tokens
    if packing in ("split", "fill"):  # every token in a record at most once
        assert int(padding.sum()) == counts["padded"]
        assert counts["cropped"] == 0
        assert counts["used"] == int((~padding).sum())
        assert counts["used"] + counts["dropped"] == len(stream)
        assert counts["used"] >= 0.99 * len(stream) - batch * record_len


def test_split_llmbatch_holds_every_document_piece_once_and_the_loader_masks_padding(
        tmp_path, corpus_dir, tokenizer_path):
    from raypipe.loader import TokenLoader

    record_len, batch = 65, 2
    summary = run(corpus_dir, tmp_path / "out", tokenizer_path, formats={"llmbatch": {
        "record_len": record_len, "batch_size": batch, "batches_per_shard": 7,
        "packing": "split"}})
    assert "llmbatch   split packing: trained 99." in summary.render()
    assert "(cropped 0.00%" in summary.render()
    documents = [tuple(d) for d in expected_documents(corpus_dir, tokenizer_path)]
    dataset = BatchDataset(tmp_path / "out")
    pieces = [tuple(r.tolist()) for r in dataset.iter_records()]
    # each record is pieces of documents back to back; together, with the few records left
    # out of the last batch, they are every document's tokens exactly once
    flat_records = [t for piece in pieces for t in piece]
    corpus_tokens = Counter(t for d in documents for t in d)
    assert not Counter(flat_records) - corpus_tokens  # no token invented or repeated
    section = dataset.section.options
    assert len(flat_records) == section["used_tokens"]
    assert section["used_tokens"] + section["dropped_tokens"] == sum(corpus_tokens.values())
    assert section["dropped_tokens"] < batch * record_len  # only the last partial batch
    loader = TokenLoader(tmp_path / "out", mode="batches", pad_id=5)
    masked = 0
    for b in loader:
        index = int(b.observation_ids[0])
        lengths = np.array([len(record) for record in dataset.records(index)])
        padding = np.arange(record_len)[None, :] >= lengths[:, None]
        expected = ~padding[:, 1:]
        pieces = dataset.pieces(index)  # the target into a piece of another document: 0
        false = pieces.false_joins
        expected[pieces.records[false], pieces.columns[false] - 1] = False
        assert np.array_equal(b.mask.numpy(), expected)
        starts = pieces.records * (record_len - 1) + pieces.columns
        starts = starts[pieces.columns < record_len - 1].tolist()
        assert set(starts) <= set(b.cu_seqlens[:-1].tolist())  # every piece a sequence
        assert (b.inputs.numpy()[padding[:, :-1]] == 5).all()
        masked += int(padding[:, 1:].sum())
    assert masked > 0


def _is_window(stream, record, stride):
    """The record equals stream[k*stride : k*stride + len(record)] for some k."""
    window = np.array(record)
    starts = np.flatnonzero(stream == window[0])
    return any(np.array_equal(stream[s:s + len(window)], window)
               for s in starts[starts % stride == 0])


def test_tokenize_summary_inspect_and_pack_report_agree_on_llmbatch_waste(
        tmp_path, corpus_dir, tokenizer_path, capsys):
    from raypipe.cli import main
    from raypipe.sampling.plans import PackingReport
    from raypipe.tools.inspect import inspect_dataset

    out = tmp_path / "out"
    summary = run(corpus_dir, out, tokenizer_path, formats={"llmbatch": {
        "record_len": 65, "batch_size": 2, "packing": "split"}})
    report = PackingReport.from_options(BatchDataset(out).section.options)
    assert report.padded_tokens > 0 and report.dropped_tokens > 0  # all three lines matter
    line = f"split packing: {report.summary_line()}"
    assert line in summary.render()
    assert line in inspect_dataset(out, samples=0)
    assert main(["pack-report", str(out), "--mode", "batches"]) == 0
    assert report.render() in capsys.readouterr().out


def as_legacy_llmbatch(root):
    """Rewrite an LLMBATCH output as raypipe 0.3 wrote it: padding holds 0xFFFFFFFF, no
    `.lengths` or `.pieces` sidecar, no `pad_id` option, the record length under
    `seq_len`."""
    from dataclasses import replace

    from raypipe.io.atomic import file_sha256
    from raypipe.io.manifest import read_manifest, write_manifest
    from raypipe.io.records import FileEntry

    manifest = read_manifest(root)
    section = manifest.formats["llmbatch"]
    dataset = BatchDataset(root)
    shards = []
    for index, shard in enumerate(section.shards):
        batch_file, lengths_file, pieces_file = (root / entry.path for entry in shard.files)
        first = dataset.batch_offsets[index]
        batches = np.stack([dataset.batch(first + i) for i in range(shard.batches)])
        paddings = np.stack([dataset.padding(first + i) for i in range(shard.batches)])
        batches[paddings] = LEGACY_PAD_ID
        raw = bytearray(batch_file.read_bytes())
        slot = (len(raw) - 4096) // shard.batches
        for i, batch in enumerate(batches):
            raw[4096 + i * slot:4096 + i * slot + batch.nbytes] = batch.astype("<u4").tobytes()
        dataset.close()
        batch_file.write_bytes(bytes(raw))
        lengths_file.unlink()
        pieces_file.unlink()
        entry = FileEntry(shard.files[0].path, len(raw), file_sha256(batch_file),
                          batch_file.stat().st_mtime_ns)
        shards.append(replace(shard, files=(entry,)))
    options = {("seq_len" if k == "record_len" else k): v
               for k, v in section.options.items() if k != "pad_id"}
    legacy = replace(section, shards=tuple(shards), options=options)
    write_manifest(root, replace(manifest, formats={**manifest.formats, "llmbatch": legacy}))


def test_llmbatch_ids_are_all_real_tokens_and_a_legacy_sentinel_file_still_reads(
        tmp_path, corpus_dir, tokenizer_path):
    from raypipe.loader import TokenLoader

    run(corpus_dir, tmp_path / "out", tokenizer_path, formats={"llmbatch": {
        "record_len": 65, "batch_size": 2, "batches_per_shard": 7, "packing": "split"}})
    dataset = BatchDataset(tmp_path / "out")
    vocabulary = dataset.manifest.tokenizer.largest_id + 1
    ids = np.stack([dataset.batch(i) for i in range(dataset.num_batches)])
    assert ids.max() < vocabulary  # what an embedding of the vocabulary accepts
    records = list(dataset.iter_records())
    current = [(b.inputs.clone(), b.mask.clone()) for b in
               TokenLoader(tmp_path / "out", mode="batches", pad_id=5, seed=1)]
    assert sum(int((~b[1].bool()).sum()) for b in current) > 0  # the corpus pads
    as_legacy_llmbatch(tmp_path / "out")
    legacy = BatchDataset(tmp_path / "out")
    assert any((legacy.batch(i) == LEGACY_PAD_ID).any() for i in range(legacy.num_batches))
    assert legacy.record_len == dataset.record_len == 65  # read from its `seq_len` key
    assert [r.tolist() for r in legacy.iter_records()] == [r.tolist() for r in records]
    served = [(b.inputs.clone(), b.mask.clone()) for b in
              TokenLoader(tmp_path / "out", mode="batches", pad_id=5, seed=1)]
    assert len(served) == len(current)
    for (inputs, mask), (legacy_inputs, legacy_mask) in zip(current, served, strict=True):
        # a 0.3 file masks its padding; today's also the targets into other documents' pieces
        assert torch.equal(inputs, legacy_inputs) and torch.equal(mask & legacy_mask, mask)


@settings(max_examples=60, deadline=None)
@given(st.integers(1, 4), st.integers(1, 9), st.integers(1, 5), st.data())
def test_a_legacy_files_padding_reads_as_the_lengths_sidecar(batch_size, record_len,
                                                              batches, data):
    """A 0.3 LLMBATCH file marks padding with the sentinel, always a record's tail; read
    through manifest_compat.SentinelLengths, its lengths are those today's `.lengths`
    sidecar holds, however they are indexed."""
    from raypipe.io.manifest_compat import SentinelLengths

    records = batches * batch_size
    lengths = np.array(data.draw(st.lists(st.integers(0, record_len), min_size=records,
                                          max_size=records)), dtype=np.uint32)
    ids = np.arange(records * record_len, dtype=np.uint32).reshape(records, record_len)
    ids[np.arange(record_len)[None, :] >= lengths[:, None]] = LEGACY_PAD_ID
    read = SentinelLengths(lambda index: ids[index * batch_size:(index + 1) * batch_size],
                           batch_size, records)
    chosen = np.array(data.draw(st.lists(st.integers(0, records - 1), max_size=6)),
                      dtype=np.int64)
    assert np.array_equal(np.asarray(read), lengths)
    assert np.array_equal(read[chosen], lengths[chosen])
    assert np.array_equal(read[1:records:2], lengths[1:records:2])
    assert read[records - 1] == lengths[-1] and read.size == len(read) == records


def split_at_separators(record: np.ndarray, bos_id: int | None, eos_id: int | None
                        ) -> list[np.ndarray]:
    """What a reader that knows only the LLMBATCH layout sees as sequences: a record cut
    before every BOS and after every EOS."""
    cuts = set()
    if bos_id is not None:
        cuts.update(np.flatnonzero(record == bos_id).tolist())
    if eos_id is not None:
        cuts.update((np.flatnonzero(record == eos_id) + 1).tolist())
    bounds = sorted(cuts | {0, record.size})
    return [record[a:b] for a, b in zip(bounds, bounds[1:], strict=False) if b > a]


@pytest.mark.parametrize("record_len", [512, 513, 2049])
@pytest.mark.parametrize("bos, eos", [(True, False), (False, True)])
@pytest.mark.parametrize("packing", ["fill", "split"])
def test_a_spec_reader_splitting_llmbatch_records_at_separators_sees_slices_of_single_documents(
        tmp_path, corpus_dir, tokenizer_path, record_len, bos, eos, packing):
    run(corpus_dir, tmp_path / "out", tokenizer_path, formats={"llmbatch": {
        "record_len": record_len, "batch_size": 2, "packing": packing}}, bos=bos, eos=eos)
    documents = [np.array(d, dtype=np.uint32).tobytes() for d in
                 expected_documents(corpus_dir, tokenizer_path, bos=bos, eos=eos)]
    dataset = BatchDataset(tmp_path / "out")
    tokenizer = dataset.manifest.tokenizer
    cut_documents = segments = 0
    for record in dataset.iter_records():
        parts = split_at_separators(np.asarray(record), tokenizer.bos_id, tokenizer.eos_id)
        for part in parts:
            needle = part.astype(np.uint32).tobytes()
            assert any(_aligned_find(document, needle) for document in documents), (
                f"a segment of {part.size} tokens is no slice of one document")
        segments += len(parts)
        cut_documents += sum(1 for part in parts if part[0] != tokenizer.bos_id and bos)
    assert segments > dataset.num_batches * 2  # records hold several documents' pieces
    assert cut_documents > 0 or not bos  # and some of them are pieces cut from a document


def _aligned_find(haystack: bytes, needle: bytes) -> bool:
    at = haystack.find(needle)
    while at >= 0:
        if at % 4 == 0:
            return True
        at = haystack.find(needle, at + 1)
    return False
