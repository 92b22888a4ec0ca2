"""What checking tokens against a shard's .sums costs (raypipe.io.checksums): the Megatron
writer's time with and without its checksum units, and a loader's reads of documents from
a checked token map against the plain map, first reads (every unit checked) and repeats.

Printed as ratios against the baseline measured in the same run. Usage:
    python bench/checksum_bench.py [--tokens 50000000] [--repeats 3] [--workdir DIR]
"""

from __future__ import annotations

import argparse
import tempfile
import time
from pathlib import Path

import numpy as np

from raypipe.formats.megatron import MegatronReader, MegatronWriter
from raypipe.io.checksums import CheckedTokens, ChecksumWriter, StreamChecksums


def corpus(tokens: int, seed: int = 0) -> np.ndarray:
    """Document lengths of a web-like lognormal (median ~400 tokens) summing to ~tokens."""
    rng = np.random.default_rng(seed)
    lengths = np.maximum(rng.lognormal(6.0, 1.0, tokens // 300), 1).astype(np.int64)
    return lengths[np.cumsum(lengths) <= tokens]


def best(run, repeats: int) -> float:
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        run()
        times.append(time.perf_counter() - start)
    return min(times)


def write_shard(directory: Path, tokens: np.ndarray, lengths: np.ndarray,
                batch_documents: int = 1000) -> None:
    writer = MegatronWriter(directory, "shard", np.dtype(np.uint16), None)
    starts = np.concatenate([[0], np.cumsum(lengths)])
    for first in range(0, len(lengths), batch_documents):
        stop = min(first + batch_documents, len(lengths))
        writer.add(tokens[starts[first]:starts[stop]], lengths[first:stop])
    writer.commit()


def sums_alone(tokens: np.ndarray, lengths: np.ndarray, batch_documents: int = 1000) -> None:
    sums = ChecksumWriter()
    data = tokens.astype(np.uint16)
    starts = np.concatenate([[0], np.cumsum(lengths)])
    for first in range(0, len(lengths), batch_documents):
        stop = min(first + batch_documents, len(lengths))
        sums.add(data[starts[first]:starts[stop]].data, lengths[first:stop] * 2)
    sums.encoded()


def read_documents(tokens, starts: np.ndarray, order: np.ndarray) -> int:
    total = 0
    for document in order.tolist():
        total += int(tokens[starts[document]:starts[document + 1]][-1])
    return total


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--tokens", type=int, default=50_000_000)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--workdir", default=None, help="where the shard is written "
                        "(default: a temporary directory)")
    args = parser.parse_args()
    lengths = corpus(args.tokens)
    tokens = np.random.default_rng(1).integers(0, 50_000, int(lengths.sum()), dtype=np.uint32)
    with tempfile.TemporaryDirectory(dir=args.workdir) as workdir:
        root = Path(workdir)
        total = best(lambda: write_shard(root / "w", tokens, lengths), args.repeats)
        alone = best(lambda: sums_alone(tokens, lengths), args.repeats)
        print(f"{len(lengths):,} documents, {int(lengths.sum()):,} tokens "
              f"({int(lengths.sum()) * 2 / 1e6:.0f} MB uint16)")
        print(f"writer: {total:.3f} s, of which checksum units {alone:.3f} s: "
              f"{total / (total - alone):.3f}x the writer without them")
        reader = MegatronReader(root / "w" / "shard")
        plain_tokens = np.asarray(reader.tokens).view(np.ndarray)  # as the loader reads it
        starts = np.concatenate([[0], np.cumsum(reader.document_lengths)]).astype(np.int64)
        shuffled = np.random.default_rng(2).permutation(len(lengths))
        for name, order in (("in order", np.arange(len(lengths))), ("shuffled", shuffled)):
            print(reads_line(name, plain_tokens, root / "w" / "shard.sums", starts, order,
                             args.repeats))


def reads_line(name: str, tokens: np.ndarray, sums_path: Path, starts: np.ndarray,
               order: np.ndarray, repeats: int) -> str:
    """Documents read in `order` from the plain map, then checked: a fresh check each
    repeat (every unit's first read), and one whose units were all checked before."""
    def checked() -> CheckedTokens:
        return CheckedTokens(tokens, StreamChecksums(sums_path, starts * 2, "shard.bin"))

    plain = best(lambda: read_documents(tokens, starts, order), repeats)
    first = best(lambda: read_documents(checked(), starts, order), repeats)
    warm = checked()
    read_documents(warm, starts, order)
    again = best(lambda: read_documents(warm, starts, order), repeats)
    return (f"reads {name}: plain map {plain:.3f} s; checked, first read {first / plain:.2f}x; "
            f"checked, again {again / plain:.2f}x")

if __name__ == "__main__":
    main()
