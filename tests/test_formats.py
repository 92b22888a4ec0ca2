"""Document-format shards: byte layouts per docs/formats.md; and, for every registered
document format through its own registry entry (writer, `Reader.from_manifest`), round
trips and corrupt files that fail naming the file."""

from __future__ import annotations

import struct
import zlib
from pathlib import Path

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from raypipe.errors import FormatError
from raypipe.formats import FORMATS, document_formats
from raypipe.formats.megatron import megatron_dtype
from raypipe.formats.nanogpt import nanogpt_dtype
from raypipe.io.atomic import file_sha256
from raypipe.io.records import FormatSection, ShardEntry, TokenizerInfo

BOS = 0


def make_documents(rng: np.random.Generator, count: int, high: int) -> list[np.ndarray]:
    return [np.concatenate([[BOS], rng.integers(1, high, rng.integers(0, 50))]).astype(np.uint32)
            for _ in range(count)]


def write_shard(fmt_name, directory, documents, dtype, batches=3, bos_id=BOS):
    """Write `documents` as shard `shard` of `fmt_name` in `directory`; return its file
    names (and keep its manifest entry beside it for `read_shard`)."""
    fmt = FORMATS[fmt_name]
    writer = fmt.writer(directory, "shard", np.dtype(dtype), bos_id)
    for part in np.array_split(np.arange(len(documents)), batches):
        docs = [documents[i] for i in part]
        tokens = np.concatenate(docs) if docs else np.empty(0, np.uint32)
        writer.add(tokens.astype(np.uint32), np.array([d.size for d in docs], np.int64))
    entries = writer.commit()
    for entry in entries:  # hashed while written == hashed from disk
        path = Path(directory) / Path(entry.path).name
        assert (entry.bytes, entry.sha256) == (path.stat().st_size, file_sha256(path))
    documents_count, tokens = len(documents), sum(d.size for d in documents)
    COMMITTED[Path(directory)] = (ShardEntry("shard", tuple(entries), documents=documents_count,
                                             tokens=tokens),
                                  FormatSection(np.dtype(dtype).name, (), fmt.options().to_json()))
    return [Path(entry.path).name for entry in entries]


COMMITTED: dict[Path, tuple[ShardEntry, FormatSection]] = {}
TOKENIZER = TokenizerInfo("test", "0" * 64, 100_000, BOS, None)


def read_shard(fmt_name, directory):
    """The shard as every reader opens it: the format's `from_manifest` on its entry."""
    shard, section = COMMITTED[Path(directory)]
    reader = FORMATS[fmt_name].reader.from_manifest(Path(directory).parent, shard, section,
                                                    TOKENIZER)
    reader.check_counts(shard, Path(directory) / shard.name)
    return reader


MAIN_FILE = {"megatron": "shard.idx", "nanogpt": "shard.bin", "stream": "shard.metadata.index",
             "mds": "shard.mds"}
SIDECAR = {"megatron": "shard.bin", "nanogpt": "shard.bos.idx", "stream": "shard.metadata.bin",
           "mds": "shard.mds"}


def test_megatron_layout_is_byte_exact(tmp_path):
    docs = [np.array([0, 5, 6], np.uint32), np.array([0, 7], np.uint32)]
    assert write_shard("megatron", tmp_path, docs, np.uint16) == ["shard.bin", "shard.idx",
                                                                  "shard.sums"]
    idx = (tmp_path / "shard.idx").read_bytes()
    assert idx[:9] == b"MMIDIDX\x00\x00"
    assert struct.unpack_from("<QBQQ", idx, 9) == (1, 8, 2, 3)
    assert len(idx) == 34 + 12 * 2 + 8 * 3
    assert np.frombuffer(idx, "<i4", 2, 34).tolist() == [3, 2]
    assert np.frombuffer(idx, "<i8", 2, 42).tolist() == [0, 6]  # byte offsets
    assert np.frombuffer(idx, "<i8", 3, 58).tolist() == [0, 1, 2]
    assert (tmp_path / "shard.bin").read_bytes() == np.array([0, 5, 6, 0, 7], "<u2").tobytes()
    sums = (tmp_path / "shard.sums").read_bytes()  # one 4 KiB unit holds both documents
    assert sums[:8] == b"RPSUMS\x00\x01" and struct.unpack_from("<QI", sums, 8) == (
        4096, zlib.crc32((tmp_path / "shard.bin").read_bytes())) and len(sums) == 20


def test_nanogpt_layout_is_byte_exact(tmp_path):
    docs = [np.array([0, 5, 6], np.uint32), np.array([0, 7], np.uint32)]
    assert write_shard("nanogpt", tmp_path, docs, np.uint16) == ["shard.bin", "shard.bos.idx",
                                                                 "shard.sums"]
    data = (tmp_path / "shard.bin").read_bytes()
    header = np.frombuffer(data, "<i4", 256)
    assert header[:4].tolist() == [20240520, 1, 5, 0] and not header[4:].any()
    assert data[1024:] == np.array([0, 5, 6, 0, 7], "<u2").tobytes()
    assert np.fromfile(tmp_path / "shard.bos.idx", "<i4").tolist() == [0, 3]
    sums = (tmp_path / "shard.sums").read_bytes()  # of the tokens, the header not counted
    assert sums[:8] == b"RPSUMS\x00\x01" and struct.unpack_from("<QI", sums, 8) == (
        4096, zlib.crc32(data[1024:])) and len(sums) == 20


def test_nanogpt_uint32_uses_automodel_header(tmp_path):
    docs = [np.array([0, 70000, 6], np.uint32)]
    write_shard("nanogpt", tmp_path, docs, nanogpt_dtype(70000), batches=1)
    header = np.fromfile(tmp_path / "shard.bin", "<i4", 4)
    assert header.tolist() == [278895051, 1, 3, 4]
    assert read_shard("nanogpt", tmp_path).document(0).tolist() == [0, 70000, 6]


def test_dtype_rules():
    assert megatron_dtype(65499) == np.uint16 and megatron_dtype(65500) == np.int32
    assert nanogpt_dtype(65535) == np.uint16 and nanogpt_dtype(65536) == np.uint32


@pytest.mark.parametrize("fmt_name", document_formats())
def test_token_that_does_not_fit_is_an_error(tmp_path, fmt_name):
    with pytest.raises(FormatError, match="does not fit uint16"):
        write_shard(fmt_name, tmp_path, [np.array([0, 70000], np.uint32)], np.uint16, 1)


@pytest.mark.parametrize("fmt_name", document_formats())
@settings(max_examples=40, deadline=None)
@given(count=st.integers(0, 30), seed=st.integers(0, 2**31), batches=st.integers(1, 4),
       wide=st.booleans())
def test_round_trip(tmp_path_factory, fmt_name, count, seed, batches, wide):
    directory = tmp_path_factory.mktemp(fmt_name)
    high = 100_000 if wide else 60_000
    docs = make_documents(np.random.default_rng(seed), count, high)
    dtype = FORMATS[fmt_name].token_dtype(high)
    write_shard(fmt_name, directory, docs, dtype, batches=batches)
    reader = read_shard(fmt_name, directory)
    assert reader.num_documents == count
    assert reader.num_tokens == sum(d.size for d in docs)
    for index, doc in enumerate(docs):
        assert reader.document(index).tolist() == doc.tolist()
    if FORMATS[fmt_name].index_suffixes:  # a loader's lengths without the tokens
        shard, _ = COMMITTED[directory]
        from_index = reader.index_document_lengths(directory.parent, shard, TOKENIZER)
        assert from_index.tolist() == reader.document_lengths.tolist()


@pytest.mark.parametrize("fmt_name", ["stream", "mds"])
def test_a_lengths_sidecar_that_disagrees_with_its_shard_is_refused_naming_it(tmp_path,
                                                                              fmt_name):
    """Two lengths swapped (the same size and sum, so the manifest's counts still hold):
    plans made from the sidecar would cut the wrong documents, so the shard's open
    refuses it, naming the file and the first document that differs."""
    docs = make_documents(np.random.default_rng(5), 6, 1000)
    docs[2] = np.concatenate([docs[2], [7, 7, 7]]).astype(np.uint32)  # unequal neighbours
    write_shard(fmt_name, tmp_path, docs, np.uint16)
    lengths = np.fromfile(tmp_path / "shard.lengths", "<u4")
    assert lengths.tolist() == [doc.size for doc in docs]
    lengths[[2, 3]] = lengths[[3, 2]]
    lengths.tofile(tmp_path / "shard.lengths")
    with pytest.raises(FormatError, match=r"shard\.lengths.*differ .* at document 2"):
        read_shard(fmt_name, tmp_path)


@pytest.fixture(params=document_formats())
def good_shard(request, tmp_path):
    docs = make_documents(np.random.default_rng(1), 20, 1000)
    write_shard(request.param, tmp_path, docs, np.uint16)
    return request.param, tmp_path


def _corrupt(fmt_name, directory, kind):
    main = directory / MAIN_FILE[fmt_name]
    data = bytearray(main.read_bytes())
    if kind == "truncated":
        main.write_bytes(data[:-1])
    elif kind == "magic":  # stream has no magic: its index's first offset must be 0
        data[0:4] = b"XXXX"
        main.write_bytes(bytes(data))
    elif kind == "claims_more":
        if fmt_name == "megatron":
            struct.pack_into("<Q", data, 18, 2**40)   # S
        elif fmt_name == "nanogpt":
            struct.pack_into("<i", data, 8, 2**31 - 1)  # T
        elif fmt_name == "mds":
            struct.pack_into("<I", data, 0, 2**31)  # samples
        else:
            struct.pack_into("<Q", data, len(data) - 8, 2**62)  # index[M]
        main.write_bytes(bytes(data))
    elif kind == "missing_sidecar":
        (directory / SIDECAR[fmt_name]).unlink()
    elif kind == "header_only":
        main.write_bytes(data[:5])


@pytest.mark.parametrize("kind", ["truncated", "magic", "claims_more", "missing_sidecar",
                                  "header_only"])
def test_corrupt_shards_fail_naming_the_file(good_shard, kind):
    fmt_name, directory = good_shard
    if fmt_name not in MAIN_FILE:
        pytest.fail(f"format {fmt_name!r} has no corruption cases here: add its files")
    _corrupt(fmt_name, directory, kind)
    with pytest.raises(FormatError) as info:
        read_shard(fmt_name, directory)
    assert str(directory / "shard") in str(info.value)


def test_bos_index_pointing_elsewhere_is_detected(tmp_path):
    docs = make_documents(np.random.default_rng(2), 10, 1000)
    write_shard("nanogpt", tmp_path, docs, np.uint16)
    positions = np.fromfile(tmp_path / "shard.bos.idx", "<i4")
    (positions + 1).astype("<i4").tofile(tmp_path / "shard.bos.idx")
    with pytest.raises(FormatError, match="not BOS"):
        read_shard("nanogpt", tmp_path)


def test_megatron_core_opens_our_files(tmp_path):
    indexed = pytest.importorskip("megatron.core.datasets.indexed_dataset")
    docs = make_documents(np.random.default_rng(3), 25, 1000)
    write_shard("megatron", tmp_path, docs, np.uint16)
    dataset = indexed.IndexedDataset(str(tmp_path / "shard"))
    assert len(dataset) == 25
    for index, doc in enumerate(docs):
        assert dataset[index].tolist() == doc.tolist()


@pytest.mark.parametrize("fmt_name", document_formats())
def test_every_file_truncated_or_missing_fails_naming_the_shard(tmp_path, fmt_name):
    docs = make_documents(np.random.default_rng(4), 12, 1000)
    names = write_shard(fmt_name, tmp_path, docs, np.uint16)
    originals = {name: (tmp_path / name).read_bytes() for name in names}
    for name in names:
        for damage in ("truncate", "delete"):
            if damage == "truncate":
                (tmp_path / name).write_bytes(originals[name][:-1])
            else:
                (tmp_path / name).unlink()
            with pytest.raises(FormatError) as info:
                read_shard(fmt_name, tmp_path)
            assert str(tmp_path / "shard") in str(info.value), (name, damage)
            (tmp_path / name).write_bytes(originals[name])


def test_mds_layout_is_byte_exact(tmp_path):
    docs = [np.array([0, 5, 6], np.uint32), np.array([0, 7], np.uint32)]
    assert write_shard("mds", tmp_path, docs, np.uint16, batches=1) == [
        "shard.mds", "shard.offsets", "shard.sums", "shard.lengths"]
    assert np.fromfile(tmp_path / "shard.lengths", "<u4").tolist() == [3, 2]
    data = (tmp_path / "shard.mds").read_bytes()
    config = (b'{"column_encodings": ["int64", "str", "ndarray:uint16"], "column_names": '
              b'["id", "source", "tokens"], "column_sizes": [8, null, null], "compression": '
              b'null, "format": "mds", "hashes": [], "size_limit": null, "version": 2}')
    start = 4 + 4 * 3 + len(config)
    samples = [np.array([5, 8], "<u4").tobytes() + (0).to_bytes(8, "little") + b"shard"
               + bytes([4, 3]) + np.array([0, 5, 6], "<u2").tobytes(),
               np.array([5, 6], "<u4").tobytes() + (1).to_bytes(8, "little") + b"shard"
               + bytes([4, 2]) + np.array([0, 7], "<u2").tobytes()]
    offsets = np.cumsum([start, *map(len, samples)]).astype("<u4")
    assert data == np.uint32(2).tobytes() + offsets.tobytes() + config + b"".join(samples)
    assert (tmp_path / "shard.offsets").read_bytes() == offsets.tobytes()
    # one 4 KiB checksum unit over the samples (the header is the offsets' to check)
    sums = (tmp_path / "shard.sums").read_bytes()
    assert sums == (b"RPSUMS\x00\x01" + (4096).to_bytes(8, "little")
                    + zlib.crc32(b"".join(samples)).to_bytes(4, "little"))


def test_nanogpt_index_lengths_refuse_a_bos_index_that_disagrees_with_the_manifest(tmp_path):
    from dataclasses import replace

    directory = tmp_path / "d"
    directory.mkdir()
    docs = [np.array([BOS, 5, 6], np.uint16), np.array([BOS, 7], np.uint16)]
    write_shard("nanogpt", directory, docs, np.uint16)
    shard, _ = COMMITTED[directory]
    reader = FORMATS["nanogpt"].reader
    assert reader.index_document_lengths(tmp_path, shard, TOKENIZER).tolist() == [3, 2]
    with pytest.raises(FormatError, match=r"shard\.bos\.idx.*documents the BOS positions"):
        reader.index_document_lengths(tmp_path, replace(shard, documents=3), TOKENIZER)
