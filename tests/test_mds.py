"""MosaicML MDS output opened by the real reader, `streaming.StreamingDataset`: tokenize and
convert write datasets it reads unchanged, sample for sample, plain and zstd-compressed.
(The shared checks every format gets are in test_conformance.py.)"""

from __future__ import annotations

import json
from pathlib import Path, PurePosixPath

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

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


def test_concat_tokens_writes_fixed_length_samples_that_streaming_reads(
        tmp_path, corpus_dir, tokenizer_path, caplog):
    """`--mds-concat-tokens 64` (LLM Foundry's --concat_tokens): every sample holds exactly
    64 tokens, the samples of a shard are its documents back to back, each shard's tail
    under 64 is dropped and counted in the summary; Megatron beside it keeps every
    document."""
    import logging

    from raypipe.io.manifest import read_manifest

    output = tmp_path / "out"
    config = load_config(None, inputs=[str(corpus_dir)], output=str(output),
                         tokenizer=tokenizer_path, unit_bytes=1, shard_tokens=1_000,
                         formats=["megatron", "mds"], mds_concat_tokens=64)
    with caplog.at_level(logging.WARNING, logger="raypipe"):
        summary = run_job(config)
    samples = streaming_samples(output / "mds")
    assert samples and all(sample["tokens"].size == 64 for sample in samples)
    manifest = read_manifest(output)
    megatron, mds = manifest.formats["megatron"], manifest.formats["mds"]
    got = [sample["tokens"].tolist() for sample in samples]
    at = 0
    for documents_shard, samples_shard in zip(megatron.shards, mds.shards, strict=True):
        reader = TokenDataset(output, "megatron").reader(megatron.shards.index(documents_shard))
        stream = np.asarray(reader.tokens).tolist()
        count = samples_shard.documents
        assert count == len(stream) // 64 and samples_shard.tokens == count * 64
        assert [token for sample in got[at:at + count] for token in sample] == \
            stream[:count * 64]
        at += count
    dropped = manifest.totals.tokens - sum(shard.tokens for shard in mds.shards)
    assert 0 < dropped < 64 * len(mds.shards)
    assert f"dropped {dropped:,} tokens" in summary.render()
    assert "dropped as shard tails" in caplog.text  # small shards: over 1% dropped, warned
    assert sum(shard.tokens for shard in megatron.shards) == manifest.totals.tokens


IMPORTS_ONLY_THE_MDS_EXTRA = r'''
import importlib.abc, importlib.metadata as md, importlib.util, sys, tomllib
from packaging.requirements import Requirement
from packaging.utils import canonicalize_name

def requirements(texts, extra=""):
    for text in texts or []:
        req = Requirement(text)
        if req.marker is None or req.marker.evaluate({"extra": extra}):
            yield canonicalize_name(req.name), tuple(req.extras)

project = tomllib.load(open(sys.argv[1], "rb"))["project"]  # the checkout's, not the install's
todo = [*requirements(project["dependencies"]),
        *requirements(project["optional-dependencies"]["mds"])]
allowed = set()
while todo:  # the closure: what those distributions themselves require
    name, extras = todo.pop()
    if name in allowed:
        continue
    allowed.add(name)
    try:
        texts = md.requires(name)
    except md.PackageNotFoundError:
        continue
    for extra in ("", *extras):
        todo += list(requirements(texts, extra))
modules = {module for module, dists in md.packages_distributions().items()
           if any(canonicalize_name(d) in allowed for d in dists)} | {"raypipe", "streaming"}
# streaming itself goes in with --no-deps: none of its own requirements is allowed

def blocked(name):  # installed, but not by raypipe, its mds extra or the standard library
    top = name.split(".")[0]
    return (top not in sys.stdlib_module_names and top not in modules
            and top not in sys.modules and top in md.packages_distributions())

class OnlyTheExtra(importlib.abc.MetaPathFinder):
    def find_spec(self, name, path=None, target=None):
        if blocked(name):
            raise ModuleNotFoundError(f"No module named {name.split('.')[0]!r}", name=name)
        return None

real_find_spec = importlib.util.find_spec
importlib.util.find_spec = lambda name, package=None: (
    None if blocked(name) else real_find_spec(name, package))  # as if not installed
sys.meta_path.insert(0, OnlyTheExtra())
from raypipe.loader.mosaic_streaming import import_streaming
streaming = import_streaming()
assert streaming.StreamingDataset and streaming.MDSWriter
print("imported")
'''


def test_the_mds_extra_holds_every_module_the_mds_reader_imports():
    """`pip install '.[mds]'` and streaming with --no-deps must import: every module the
    reader's import reaches is raypipe's, the mds extra's or the standard library's (the
    dev extra's matplotlib once hid a missing pillow)."""
    import subprocess
    import sys

    pyproject = Path(__file__).resolve().parents[1] / "pyproject.toml"
    run = subprocess.run([sys.executable, "-c", IMPORTS_ONLY_THE_MDS_EXTRA, str(pyproject)],
                         capture_output=True, text=True, timeout=120)
    assert run.returncode == 0 and "imported" in run.stdout, run.stderr[-2000:]


@settings(max_examples=30, deadline=None)
@given(lengths=st.lists(st.integers(1, 3_000), min_size=1, max_size=30),
       pieces=st.integers(1, 5), wide=st.booleans(), masked=st.booleans(),
       multiple=st.integers(1, 4))
def test_a_block_of_whole_samples_cut_by_token_bytes_checks_and_decodes_alone(
        lengths, pieces, wide, masked, multiple, tmp_path_factory):
    """An MDS shard's `.sums` units are cut by its samples' token bytes, as a loader cuts
    blocks: every block's sample bytes (placed by the `.offsets` sidecar) are a run of whole
    units that checks and decodes to the block's tokens (and mask) alone, and an altered
    byte is found."""
    from raypipe.formats import FORMATS
    from raypipe.io.checksums import UNIT_BYTES, StreamChecksums
    from raypipe.sampling.blocks import cut_blocks

    dtype = np.dtype(np.uint32 if wide else np.uint16)
    rng = np.random.default_rng(len(lengths) * 7 + pieces)
    tokens = rng.integers(0, 60_000, sum(lengths), dtype=np.uint32)
    mask = rng.integers(0, 2, tokens.size, dtype=np.uint8)
    folder = tmp_path_factory.mktemp("mds")
    fmt = FORMATS["mds"]
    writer = fmt.writer(folder, "shard", dtype, None, loss_mask=masked)
    starts = np.concatenate([[0], np.cumsum(lengths)]).astype(np.int64)
    for part in np.array_split(np.arange(len(lengths)), pieces):
        if part.size:
            low, high = int(starts[part[0]]), int(starts[part[-1] + 1])
            if masked:
                writer.add_loss_mask(mask[low:high], np.asarray(lengths)[part])
            writer.add(tokens[low:high], np.asarray(lengths)[part])
    writer.commit()
    data = np.fromfile(folder / "shard.mds", np.uint8)
    offsets = np.fromfile(folder / "shard.offsets", "<u4").astype(np.int64)
    sums = StreamChecksums(folder / "shard.sums", offsets - offsets[0], "shard.mds",
                           starts * dtype.itemsize)
    blocks = cut_blocks(np.asarray(lengths, np.int64), np.asarray([len(lengths)]),
                        dtype.itemsize, UNIT_BYTES * multiple)
    for first, stop in zip(blocks.starts[:-1].tolist(), blocks.starts[1:].tolist(),
                           strict=True):
        low, high = int(offsets[first]), int(offsets[stop])
        block = data[low:high]
        assert sums.problem(block, low - int(offsets[0])) is None
        got, got_mask = fmt.samples.decode(block, offsets[first:stop] - low, dtype, masked,
                                           "shard.mds")
        assert np.array_equal(got, tokens[starts[first]:starts[stop]])
        assert (got_mask is None) == (not masked)
        if masked:
            assert np.array_equal(got_mask, mask[starts[first]:starts[stop]])
        altered = block.copy()
        altered[len(altered) // 2] ^= 0x01
        assert "differ from what the job wrote" in sums.problem(altered, low - int(offsets[0]))
