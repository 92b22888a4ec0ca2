"""convert, verify and inspect: lossless round trips between document formats, LLMBATCH as
source and target, corrupt or truncated files of every format named by verify and readers."""

from __future__ import annotations

import json
import struct
import time

import numpy as np
import pytest

from raypipe.cli import main
from raypipe.config import load_config
from raypipe.dataset import BatchDataset, TokenDataset
from raypipe.errors import FormatError
from raypipe.io.records import Manifest
from raypipe.preprocess.job import run_job
from raypipe.tools.convert import convert_dataset
from raypipe.tools.verify import open_every_shard, verify_dataset


@pytest.fixture
def all_formats(tmp_path, corpus_dir, tokenizer_path):
    config = load_config(None, inputs=[str(corpus_dir)], output=str(tmp_path / "all"),
                         tokenizer=tokenizer_path, unit_bytes=1,
                         formats=["megatron", "nanogpt", "stream", "llmbatch"], seq_len=48,
                         batch_size=4, batches_per_shard=25, metadata_columns=["id"])
    run_job(config)
    return tmp_path / "all"


def documents(path, fmt=None):
    return [d.tolist() for d in TokenDataset(path, fmt).iter_documents()]


@pytest.mark.parametrize("chain", [("nanogpt", "megatron"), ("stream", "megatron"),
                                   ("megatron", "nanogpt"), ("nanogpt", "stream")])
def test_convert_a_b_a_is_lossless(all_formats, tmp_path, chain):
    first, second = chain
    source = tmp_path / "src"
    convert_dataset(all_formats, source, first)
    convert_dataset(source, tmp_path / "b", second)
    convert_dataset(tmp_path / "b", tmp_path / "a", first)
    original = documents(all_formats, "megatron")
    assert documents(tmp_path / "b") == original
    assert documents(tmp_path / "a") == original
    for path in (source, tmp_path / "b", tmp_path / "a"):
        verify_dataset(path)
    a_files = sorted(p.name for p in (tmp_path / "a" / first).iterdir())
    src_files = sorted(p.name for p in (source / first).iterdir())
    assert a_files == src_files
    for name in a_files:
        assert (tmp_path / "a" / first / name).read_bytes() == \
            (source / first / name).read_bytes()


def test_llmbatch_source_yields_records_and_target_packs(all_formats, tmp_path, capsys):
    llm = BatchDataset(all_formats)
    only_llm = tmp_path / "only"
    convert_dataset(all_formats, only_llm, "llmbatch", {"record_len": 48, "batch_size": 4})
    assert main(["convert", str(only_llm), str(tmp_path / "rec"), "--format", "megatron"]) == 0
    assert "records (packed rows), not the original documents" in capsys.readouterr().out
    records = documents(tmp_path / "rec")
    assert records == [r.tolist() for r in BatchDataset(only_llm).iter_records()]
    assert records == [r.tolist() for r in llm.iter_records()]  # same seed, same plan
    assert all(0 < len(r) <= 48 for r in records)
    assert sum(map(len, records)) == llm.section.options["used_tokens"]  # no padding kept


def test_convert_reads_the_source_format_named(all_formats, tmp_path, capsys):
    assert main(["convert", str(all_formats), str(tmp_path / "from-llm"), "--format",
                 "megatron", "--source-format", "llmbatch"]) == 0
    assert "records (packed rows)" in capsys.readouterr().out
    records = [r.tolist() for r in BatchDataset(all_formats).iter_records()]
    assert documents(tmp_path / "from-llm") == records
    assert main(["convert", str(all_formats), str(tmp_path / "from-stream"), "--format",
                 "megatron", "--source-format", "stream"]) == 0
    assert "records" not in capsys.readouterr().out
    assert documents(tmp_path / "from-stream") == documents(all_formats, "stream")


def test_verify_cli_passes_then_names_the_first_bad_file(all_formats, capsys):
    assert main(["verify", str(all_formats)]) == 0
    assert "OK" in capsys.readouterr().out
    victim = sorted((all_formats / "stream").glob("*.metadata.bin"))[0]
    data = bytearray(victim.read_bytes())
    data[3] ^= 0xFF
    victim.write_bytes(bytes(data))
    assert main(["verify", str(all_formats)]) == 2
    assert f"{victim}: sha256 differs from the manifest" in capsys.readouterr().err


def test_verify_names_every_problem_in_one_report(all_formats, capsys):
    """A flipped byte, a truncated shard of another format and a stray file: one run of
    verify names all three (a truncated file is named once, not again by its reader)."""
    flipped = sorted((all_formats / "megatron").glob("*.bin"))[0]
    data = bytearray(flipped.read_bytes())
    data[-1] ^= 0xFF
    flipped.write_bytes(bytes(data))
    truncated = sorted((all_formats / "nanogpt").glob("*.bin"))[-1]
    truncated.write_bytes(truncated.read_bytes()[:-2])
    (all_formats / "megatron" / "stray-0000.bin").write_bytes(b"x")
    assert main(["verify", str(all_formats)]) == 2
    error = capsys.readouterr().err
    assert "2 problem(s):" in error
    assert f"{flipped}: sha256 differs from the manifest" in error
    assert error.count(str(truncated)) == 1
    assert "1 file(s) the manifest does not list: megatron/stray-0000.bin" in error


CORRUPTIONS = {
    "megatron": [("*.idx", "truncate"), ("*.bin", "truncate"), ("*.idx", "magic")],
    "nanogpt": [("*.bin", "truncate"), ("*.bin", "magic"), ("*.bos.idx", "delete")],
    "stream": [("*.tokens", "truncate"), ("*.metadata.index", "huge"),
               ("*.metadata.bin", "delete")],
    "llmbatch": [("*.batch", "truncate"), ("*.batch", "magic"), ("*.batch", "huge")],
}


@pytest.mark.parametrize("fmt,pattern,kind", [(f, p, k) for f, cases in CORRUPTIONS.items()
                                               for p, k in cases])
def test_corrupt_files_fail_verify_and_readers(all_formats, fmt, pattern, kind, figure):
    victim = sorted((all_formats / fmt).glob(pattern))[0]
    data = bytearray(victim.read_bytes())
    if kind == "truncate":
        victim.write_bytes(bytes(data[:-1]))
    elif kind == "magic":
        data[0:4] = b"XXXX"
        victim.write_bytes(bytes(data))
    elif kind == "delete":
        victim.unlink()
    elif kind == "huge":
        offset = 20 if fmt == "llmbatch" else len(data) - 8  # num_batches / index[M]
        struct.pack_into("<Q", data, offset, 2**60)
        victim.write_bytes(bytes(data))
    with pytest.raises(FormatError) as info:
        verify_dataset(all_formats)
    assert str(victim) in str(info.value)
    # the reader alone (no checksum) also refuses the file, naming it
    manifest = json.loads((all_formats / "manifest.json").read_text())
    for shard in manifest["formats"][fmt]["shards"]:
        for entry in shard["files"]:
            entry["sha256"] = "ignored"
    edited = Manifest.from_json(manifest, "edited manifest")
    began = time.perf_counter()
    problems = open_every_shard(all_formats, fmt, edited)
    assert len(problems) == 1 and victim.name.split(".")[0] in str(problems[0])
    figure(f"corrupt {fmt} ({pattern}, {kind})",
           f"reader refused in {(time.perf_counter() - began) * 1000:.1f} ms: {problems[0]}")


def test_manifest_path_cannot_escape_the_dataset(all_formats):
    manifest = json.loads((all_formats / "manifest.json").read_text())
    manifest["formats"]["megatron"]["shards"][0]["files"][0]["path"] = "../../etc/passwd"
    (all_formats / "manifest.json").write_text(json.dumps(manifest))
    with pytest.raises(FormatError, match="must be relative to the dataset, without .."):
        verify_dataset(all_formats)


def test_inspect_prints_tables_samples_metadata_and_plot(all_formats, tmp_path, capsys):
    plot = tmp_path / "lengths.png"
    assert main(["inspect", str(all_formats), "--plot", str(plot), "--samples", "2"]) == 0
    out = capsys.readouterr().out
    for needle in ("format megatron", "format stream", "format llmbatch",
                   "document length (tokens) min/p10/p50/p90/p99/max", "sample 1",
                   "metadata: [{", "'id': 0", "records, not documents"):
        assert needle in out, needle
    data = plot.read_bytes()
    assert data[:8] == b"\x89PNG\r\n\x1a\n" and b"IEND" in data[-12:]
    lengths = np.array([len(d) for d in documents(all_formats)])
    assert f"{lengths.max():,} tokens" in out
    assert "matplotlib, axes and labels" in out  # the dev extra brings matplotlib


def test_inspect_prints_megatrons_data_path_for_every_prefix_and_a_mixtures_blend(
        tmp_path, corpus_dir, tokenizer_path, capsys):
    """The printed argument, parsed by megatron-core's own `get_blend_from_list`, names
    every shard (megatron-core opens each, all documents once); a mixture's blend splits
    each source's weight over its prefixes by tokens."""
    utils = pytest.importorskip("megatron.core.datasets.utils")
    indexed = pytest.importorskip("megatron.core.datasets.indexed_dataset")
    from raypipe.cli import main
    from raypipe.config import load_config
    from raypipe.preprocess.job import run_job

    summaries = {}
    for name in ("a", "b"):
        summaries[name] = run_job(load_config(
            None, inputs=[str(corpus_dir)], output=str(tmp_path / name),
            tokenizer=tokenizer_path, formats=["megatron"], unit_bytes=1))
    assert main(["inspect", str(tmp_path / "a"), "--megatron-data-path"]) == 0
    prefixes, weights = utils.get_blend_from_list(capsys.readouterr().out.split())
    assert weights is None and len(prefixes) == summaries["a"].shards > 1
    assert sum(len(indexed.IndexedDataset(prefix)) for prefix in prefixes) == \
        summaries["a"].documents
    spec = tmp_path / "mix.yaml"
    spec.write_text("sources:\n  a: {path: a, weight: 0.7}\n  b: {path: b, weight: 0.3}\n")
    assert main(["inspect", str(spec), "--megatron-data-path"]) == 0
    prefixes, weights = utils.get_blend_from_list(capsys.readouterr().out.split())
    share_a = sum(w for w, p in zip(weights, prefixes, strict=True) if "/a/" in p)
    assert len(prefixes) == summaries["a"].shards + summaries["b"].shards
    assert abs(share_a - 0.7) < 1e-6 and abs(sum(weights) - 1.0) < 1e-6
