"""MosaicML MDS output opened by the real reader, `streaming.StreamingDataset`: tokenize and
convert write datasets it reads unchanged, sample for sample, plain and zstd-compressed.
(The shared checks every format gets are in test_conformance.py.)"""

from __future__ import annotations

import json
from pathlib import Path, PurePosixPath

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
