"""Stream-with-metadata and LLMBATCH outputs of the tokenize job (serial runner, no Ray):
round trips against direct tokenization, per-token metadata, spans, LLMBATCH layout."""

from __future__ import annotations

import struct
from collections import Counter

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import pytest
from tokenizers import Tokenizer

from raypipe.config import load_config
from raypipe.dataset import LLMBatchDataset, TokenDataset
from raypipe.errors import InputError
from raypipe.formats.llmbatch import PAD_ID, LLMBatchReader
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
    files = sorted(p.name for p in (tmp_path / "out" / "stream").iterdir())
    assert files and all(name.endswith(".tokens") for name in files)
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
    seq_len, batch = 64, 3
    summary = run(corpus_dir, tmp_path / "out", tokenizer_path, formats=["llmbatch"],
                  seq_len=seq_len, batch_size=batch, seed=77, packing=packing,
                  batches_per_shard=10)
    assert summary.documents > 0
    import json

    manifest = json.loads((tmp_path / "out" / "manifest.json").read_text())
    section = manifest["formats"]["llmbatch"]
    assert len(section["shards"]) > 1
    documents = expected_documents(corpus_dir, tokenizer_path)
    stream = np.concatenate([np.array(d) for d in documents])
    doc_starts = {0}
    total = 0
    for d in documents:
        total += len(d)
        doc_starts.add(total)
    seen_records = []
    for shard in section["shards"]:
        path = tmp_path / "out" / shard["files"][0]["path"]
        data = path.read_bytes()
        magic, version, b, t, n, dtype, seed, total_records = struct.unpack_from(
            "<8sIIIQIII", data)
        assert (magic, version, b, t, n, dtype, seed) == (b"LLMBATCH", 1, batch, seq_len,
                                                          shard["batches"], 0, 77)
        assert total_records == section["total_records"]
        assert not any(data[40:4096])
        padded = -(-batch * seq_len * 4 // 4096) * 4096
        assert len(data) == 4096 + n * padded
        reader = LLMBatchReader(path)
        for i in range(n):
            slot = data[4096 + i * padded: 4096 + (i + 1) * padded]
            assert not any(slot[batch * seq_len * 4:])  # slot padding is zero
            records = np.frombuffer(slot, "<u4", batch * seq_len).reshape(batch, seq_len)
            assert np.array_equal(records, reader.batch(i))
            seen_records.extend(map(tuple, records.tolist()))
    assert len(seen_records) == section["num_batches"] * batch
    assert section["num_batches"] == section["total_records"] // batch
    for record in seen_records[:50]:
        if packing in ("bestfit", "crop"):
            assert record[0] == 0  # every record starts with BOS
        elif packing == "concat":  # a window of the concatenated stream
            assert _is_window(stream, record, seq_len - 1)
    counts = {k: section[f"{k}_tokens"] for k in ("used", "cropped", "padded", "dropped")}
    assert counts["used"] + counts["cropped"] + counts["dropped"] == len(stream) or \
        packing == "concat"  # windows share a token: their counts are per window
    if packing in ("split", "fill"):  # every token in a record at most once; padding is PAD_ID
        flat = np.array(seen_records, dtype=np.int64).reshape(-1)
        assert int((flat == PAD_ID).sum()) == counts["padded"]
        assert counts["cropped"] == 0
        assert counts["used"] == int((flat != PAD_ID).sum())
        assert counts["used"] + counts["dropped"] == len(stream)
        assert counts["used"] >= 0.99 * len(stream) - batch * seq_len


def test_split_llmbatch_holds_every_document_piece_once_and_the_loader_masks_padding(
        tmp_path, corpus_dir, tokenizer_path):
    from raypipe.loader import TokenLoader

    seq_len, batch = 65, 2
    summary = run(corpus_dir, tmp_path / "out", tokenizer_path, formats=["llmbatch"],
                  seq_len=seq_len, batch_size=batch, batches_per_shard=7, packing="split")
    assert "llmbatch   split packing: trained 99." in summary.render()
    assert "(cropped 0.00%" in summary.render()
    documents = [tuple(d) for d in expected_documents(corpus_dir, tokenizer_path)]
    dataset = LLMBatchDataset(tmp_path / "out")
    pieces = [tuple(r.tolist()) for r in dataset.iter_records()]
    # each record is pieces of documents back to back; together, with the few records left
    # out of the last batch, they are every document's tokens exactly once
    flat_records = [t for piece in pieces for t in piece]
    assert PAD_ID not in flat_records  # iter_records strips the padding
    corpus_tokens = Counter(t for d in documents for t in d)
    assert not Counter(flat_records) - corpus_tokens  # no token invented or repeated
    section = dataset.section.options
    assert len(flat_records) == section["used_tokens"]
    assert section["used_tokens"] + section["dropped_tokens"] == sum(corpus_tokens.values())
    assert section["dropped_tokens"] < batch * seq_len  # only the last partial batch
    loader = TokenLoader(tmp_path / "out", mode="llmbatch", pad_id=5)
    masked = 0
    for b in loader:
        raw = dataset.batch(int(b.observation_ids[0])).astype(np.int64)
        padding = raw == PAD_ID
        assert np.array_equal(b.mask.numpy(), ~padding[:, 1:])
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
    summary = run(corpus_dir, out, tokenizer_path, formats=["llmbatch"], seq_len=65,
                  batch_size=2, packing="split")
    report = PackingReport.from_options(LLMBatchDataset(out).section.options)
    assert report.padded_tokens > 0 and report.dropped_tokens > 0  # all three lines matter
    line = f"split packing: {report.summary_line()}"
    assert line in summary.render()
    assert line in inspect_dataset(out, samples=0)
    assert main(["pack-report", str(out), "--mode", "llmbatch"]) == 0
    assert report.render() in capsys.readouterr().out
