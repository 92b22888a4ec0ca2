"""MosaicML MDS output opened by the real reader, `streaming.StreamingDataset`: tokenize and
convert write datasets it reads unchanged, sample for sample, plain and zstd-compressed.
(The shared checks every format gets are in test_conformance.py.)"""

from __future__ import annotations

import json
from pathlib import PurePosixPath

import numpy as np
import pytest

from raypipe.cli import main
from raypipe.config import load_config
from raypipe.dataset import TokenDataset
from raypipe.loader.mosaic_streaming import import_streaming
from raypipe.preprocess.job import run_job
from tests.helpers import expected_documents

SHARD_TOKENS = 5_000


def tokenize(corpus, output, tokenizer_path, **options):
    config = load_config(None, inputs=[str(corpus)], output=str(output),
                         tokenizer=tokenizer_path, unit_bytes=1, shard_tokens=SHARD_TOKENS,
                         **{"formats": ["megatron", "mds"], **options})
    run_job(config)
    return output


def streaming_samples(directory):
    streaming = import_streaming()
    dataset = streaming.StreamingDataset(local=str(directory), batch_size=1, shuffle=False)
    return [dataset[index] for index in range(len(dataset))]


def input_rows(corpus):
    """(input file name, row) of every non-empty document, in the job's order."""
    import pyarrow.parquet as pq

    rows = []
    for path in sorted(corpus.rglob("*.parquet")):
        texts = pq.read_table(path, columns=["text"]).column(0).to_pylist()
        rows += [(path.name, row) for row, text in enumerate(texts)
                 if isinstance(text, str) and text.strip()]
    return rows


@pytest.mark.parametrize("compression", [None, "zstd"])
def test_streaming_dataset_reads_every_document_with_its_row_and_source(
        tmp_path, corpus_dir, tokenizer_path, compression):
    output = tokenize(corpus_dir, tmp_path / "out", tokenizer_path,
                      mds_compression=compression)
    samples = streaming_samples(output / "mds")
    # MDS alone: EOS after each document, as LLM Foundry's eos_text
    expected = expected_documents(corpus_dir, tokenizer_path, bos=False, eos=True)
    assert len(samples) == len(expected)
    for sample, document in zip(samples, expected, strict=True):
        assert sample["tokens"].dtype == np.uint16  # the tokenizer's width (1,024 ids)
        assert sample["tokens"].tolist() == document
    assert [(s["source"], int(s["id"])) for s in samples] == input_rows(corpus_dir)
    index = json.loads((output / "mds" / "index.json").read_text())
    suffix = ".mds.zstd" if compression else ".mds"
    shards = TokenDataset(output, "mds").shards
    assert [s["zip_data" if compression else "raw_data"]["basename"]
            for s in index["shards"]] == [shard.name + suffix for shard in shards]
    assert [s["samples"] for s in index["shards"]] == [shard.documents for shard in shards]


def test_mds_shards_roll_at_shard_tokens_like_every_format(tmp_path, corpus_dir,
                                                           tokenizer_path):
    output = tokenize(corpus_dir, tmp_path / "out", tokenizer_path)
    mds, megatron = TokenDataset(output, "mds"), TokenDataset(output, "megatron")
    assert mds.num_shards > 3
    assert [(s.name, s.documents, s.tokens) for s in mds.shards] == \
        [(s.name, s.documents, s.tokens) for s in megatron.shards]
    assert all(s.tokens <= SHARD_TOKENS or s.documents == 1 for s in mds.shards)


def test_convert_to_mds_is_read_by_streaming_and_back_is_lossless(tmp_path, corpus_dir,
                                                                  tokenizer_path, capsys):
    output = tokenize(corpus_dir, tmp_path / "out", tokenizer_path, formats=["megatron"])
    assert main(["convert", str(output), str(tmp_path / "mds"), "--format", "mds"]) == 0
    samples = streaming_samples(tmp_path / "mds" / "mds")
    documents = [d.tolist() for d in TokenDataset(output).iter_documents()]
    assert [s["tokens"].tolist() for s in samples] == documents
    # a converted document's row is its index in its source shard, its source that shard
    first_shard = TokenDataset(output).shards[0]
    head = samples[:first_shard.documents]
    assert [int(s["id"]) for s in head] == list(range(first_shard.documents))
    assert {s["source"] for s in head} == {PurePosixPath(first_shard.name).name}
    assert main(["convert", str(tmp_path / "mds"), str(tmp_path / "back"), "--format",
                 "megatron"]) == 0
    assert [d.tolist() for d in TokenDataset(tmp_path / "back").iter_documents()] == documents
    capsys.readouterr()
