"""Checksum units of a token file (.sums): written in pieces as a job writes, they equal
the units of the whole stream, compose into a loader's blocks, and catch any altered byte."""

from __future__ import annotations

import zlib

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from raypipe.errors import FormatError
from raypipe.io.checksums import (
    CheckedTokens,
    ChecksumWriter,
    StreamChecksums,
    read_sums,
    unit_bounds,
)
from raypipe.sampling.blocks import cut_blocks

UNIT = 64  # a small unit, so documents of a few dozen bytes span and share units


def written(sizes: list[int], pieces: list[int], tmp_path) -> tuple[bytes, np.ndarray, str]:
    """A stream of documents of `sizes` bytes written in `pieces` documents at a time; its
    bytes, document starts and .sums path."""
    rng = np.random.default_rng(len(sizes))
    data = rng.integers(0, 256, sum(sizes), dtype=np.uint8).tobytes()
    starts = np.concatenate([[0], np.cumsum(sizes)]).astype(np.int64)
    writer = ChecksumWriter(UNIT)
    cuts = np.cumsum([0, *pieces])
    for low, high in zip(cuts[:-1], cuts[1:], strict=True):
        low, high = min(int(low), len(sizes)), min(int(high), len(sizes))
        writer.add(data[starts[low]:starts[high]], np.asarray(sizes[low:high]))
    writer.add(data[starts[min(cuts[-1], len(sizes))]:], np.asarray(sizes[cuts[-1]:]))
    path = tmp_path / "s.sums"
    path.write_bytes(writer.encoded())
    return data, starts, str(path)


@settings(max_examples=60, deadline=None)
@given(sizes=st.lists(st.integers(1, 300), min_size=0, max_size=40),
       pieces=st.lists(st.integers(0, 7), max_size=10))
def test_units_written_in_pieces_equal_each_units_crc_of_the_whole_stream(
        sizes, pieces, tmp_path_factory):
    data, starts, path = written(sizes, pieces, tmp_path_factory.mktemp("sums"))
    unit_bytes, crcs = read_sums(path)
    bounds = unit_bounds(starts, unit_bytes)
    assert unit_bytes == UNIT and len(crcs) == -(-len(data) // UNIT)
    expected = [zlib.crc32(data[a:b]) for a, b in zip(bounds[:-1], bounds[1:], strict=True)]
    assert crcs.tolist() == expected
    # a unit never cuts a document: every bound is a document start or the end
    assert set(bounds.tolist()) <= set(starts.tolist())


@settings(max_examples=40, deadline=None)
@given(sizes=st.lists(st.integers(1, 300), min_size=1, max_size=40),
       multiple=st.integers(1, 5))
def test_a_block_of_a_multiple_of_the_unit_is_a_run_of_whole_units_and_checks(
        sizes, multiple, tmp_path_factory):
    data, starts, path = written(sizes, [len(sizes)], tmp_path_factory.mktemp("sums"))
    sums = StreamChecksums(path, starts, "shard.bin")
    lengths = np.asarray(sizes, dtype=np.int64)  # one-byte tokens
    blocks = cut_blocks(lengths, np.asarray([len(sizes)]), 1, UNIT * multiple)
    for first, stop in zip(blocks.starts[:-1], blocks.starts[1:], strict=True):
        low, high = int(starts[first]), int(starts[stop])
        assert sums.problem(data[low:high], low) is None
        altered = bytearray(data[low:high])
        altered[len(altered) // 2] ^= 0x01
        assert "differ from what the job wrote" in sums.problem(bytes(altered), low)


@settings(max_examples=40, deadline=None)
@given(lengths=st.lists(st.integers(1, 120), min_size=1, max_size=40),
       itemsize=st.sampled_from([2, 4, 8]), multiple=st.integers(1, 5))
def test_a_block_cut_by_token_bytes_is_a_run_of_whole_loss_mask_units_and_checks(
        lengths, itemsize, multiple, tmp_path_factory):
    """A loss mask's sums in units of UNIT / itemsize bytes (a byte a token, written as
    the job does) put their bounds where the token file's do, so a block of whole token
    units is one of whole mask units: its mask bytes check, and an altered one is found."""
    tokens = np.asarray(lengths, dtype=np.int64)
    starts = np.concatenate([[0], np.cumsum(tokens)]).astype(np.int64)
    mask = np.random.default_rng(len(lengths)).integers(0, 2, int(starts[-1]), dtype=np.uint8)
    writer = ChecksumWriter(UNIT // itemsize)
    writer.add(mask, tokens)
    path = tmp_path_factory.mktemp("mask") / "s.mask.sums"
    path.write_bytes(writer.encoded())
    sums = StreamChecksums(path, starts, "shard.mask")
    assert (unit_bounds(starts * itemsize, UNIT) == sums.bounds * itemsize).all()
    blocks = cut_blocks(tokens, np.asarray([len(lengths)]), itemsize, UNIT * multiple)
    for first, stop in zip(blocks.starts[:-1], blocks.starts[1:], strict=True):
        low, high = int(starts[first]), int(starts[stop])
        assert sums.problem(mask[low:high].tobytes(), low) is None
        altered = mask[low:high].copy()
        altered[len(altered) // 2] ^= 1
        assert "differ from what the job wrote" in sums.problem(altered.tobytes(), low)


def test_checked_tokens_refuse_a_read_of_an_altered_unit_and_serve_the_others(tmp_path):
    sizes = [100] * 20
    data, starts, path = written(sizes, [20], tmp_path)
    altered = bytearray(data)
    altered[1_050] ^= 0xFF  # inside document 10, unit 1_050 // 64 = 16
    tokens = np.frombuffer(bytes(altered), dtype=np.uint8)
    checked = CheckedTokens(tokens, StreamChecksums(path, starts, "shard.bin"))
    assert checked[0:500].tobytes() == data[:500]  # documents 0-4: units intact
    assert checked[np.array([200, 1_500])].tolist() == [data[200], data[1_500]]
    with pytest.raises(FormatError, match="shard.bin.*differ from what the job wrote"):
        checked[1_000:1_100]
    with pytest.raises(FormatError, match="differ from what the job wrote"):
        checked[np.array([1_060])]


def test_a_sums_file_that_is_not_one_is_refused_naming_it(tmp_path):
    path = tmp_path / "x.sums"
    path.write_bytes(b"not sums at all")
    with pytest.raises(FormatError, match="x.sums.*not a raypipe .sums file"):
        read_sums(path)
