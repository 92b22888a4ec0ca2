"""Format read benchmark: LLMBATCH batch reads and stream windows with metadata.

    python bench/formats_bench.py [--tokens 50_000_000] [--workdir bench_out]

Prints from one run, side by side:
- LLMBATCH: `LLMBatchReader.batch(i)` copied into a preallocated int64 [B, T] array, random
  batch order, against the baseline: a raw numpy memmap slice of the same bytes + the same
  copy (target >= 0.8x);
- stream with metadata: `TokenDataset.window(start, 2048)` (tokens + metadata ids + decoded
  records) at random starts from one thread, against a raw memmap slice of the same token
  records (target >= 20,000 windows/s).
The dataset is synthetic documents (lognormal lengths) written through raypipe's own stream
writer with a JSON record per document and per 64-token span.
"""

from __future__ import annotations

import argparse
import time
from pathlib import Path

import numpy as np
from common import print_table, synthetic_token_dataset, write_synthetic_dataset

from raypipe.dataset import BatchDataset, TokenDataset
from raypipe.formats import DocumentMetadata
from raypipe.tools.convert import convert_dataset

WINDOW, B, T = 2048, 8, 2049


def stream_dataset(workdir: Path, total_tokens: int) -> Path:
    output = workdir / f"stream-{total_tokens // 1_000_000}M"
    if (output / "manifest.json").exists():
        return output

    def batches():
        rng = np.random.default_rng(1)
        written, row = 0, 0
        while written < total_tokens:
            lengths = np.clip(rng.lognormal(6.0, 1.0, 5_000).astype(np.int64) + 2, 2, 50_000)
            tokens = rng.integers(1, 32768, int(lengths.sum()), dtype=np.uint32)
            tokens[np.cumsum(lengths) - lengths] = 0
            metadata = []
            for length in lengths.tolist():
                spans = [(s, min(s + 32, length), {"label": "concept", "score": 0.5})
                         for s in range(1, length, 64)]
                metadata.append(DocumentMetadata({"source": "synthetic", "row": row,
                                                  "url": f"https://example.org/{row}"}, spans))
                row += 1
            yield tokens, lengths, metadata
            written += tokens.size

    return write_synthetic_dataset(output, "stream", batches(), "synthetic-stream", 1 << 26)


def llmbatch_rates(dataset: BatchDataset, reads: int) -> tuple[float, float]:
    reader = dataset.reader(0)
    raw = np.memmap(reader.path, dtype=np.uint8, mode="r")
    out = np.empty((dataset.batch_size, dataset.record_len), dtype=np.int64)
    order = np.random.default_rng(0).integers(0, reader.num_batches, reads)
    nbytes = dataset.batch_size * dataset.record_len * 4
    for index in range(reader.num_batches):  # warm the page cache and the mappings once
        out[...] = reader.batch(index)
    began = time.perf_counter()
    for index in order.tolist():
        start = 4096 + index * reader.padded
        out[...] = raw[start:start + nbytes].view("<u4").reshape(out.shape)
    baseline = reads / (time.perf_counter() - began)
    began = time.perf_counter()
    for index in order.tolist():
        out[...] = reader.batch(index)
    return baseline, reads / (time.perf_counter() - began)


def stream_rates(dataset: TokenDataset, windows: int) -> tuple[float, float, float]:
    reader = dataset.reader(0)
    starts = np.random.default_rng(0).integers(0, reader.num_tokens - WINDOW, windows)
    out = np.empty(WINDOW, dtype=np.int64)
    records = np.asarray(reader.records)
    began = time.perf_counter()
    for start in starts.tolist():
        out[:] = records["token"][start:start + WINDOW]
    baseline = windows / (time.perf_counter() - began)
    began = time.perf_counter()
    count = 0
    for start in starts.tolist():
        count += len(dataset.window(start, WINDOW).records)
    rate = windows / (time.perf_counter() - began)
    return baseline, rate, count / windows


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--tokens", type=int, default=50_000_000)
    parser.add_argument("--workdir", type=Path, default=Path("bench_out"))
    parser.add_argument("--reads", type=int, default=20_000)
    args = parser.parse_args()
    args.workdir.mkdir(exist_ok=True)
    source = synthetic_token_dataset(args.workdir, args.tokens)
    llm_dir = args.workdir / f"llmbatch-{args.tokens // 1_000_000}M"
    if not (llm_dir / "manifest.json").exists():
        convert_dataset(source, llm_dir, "llmbatch",
                        {"record_len": T, "batch_size": B, "packing": "bestfit", "seed": 1,
                         "batches_per_shard": 1 << 30})
    llm = BatchDataset(llm_dir)
    base_llm, llm_rate = llmbatch_rates(llm, args.reads)
    stream = TokenDataset(stream_dataset(args.workdir, args.tokens // 5), "stream")
    base_stream, stream_rate, records = stream_rates(stream, args.reads)
    print(f"LLMBATCH: {llm.num_batches:,} batches of [{B}, {T}]; stream: "
          f"{stream.num_tokens:,} tokens, {records:.1f} metadata records per window")
    print_table([
        ("what", "per second", "vs baseline"),
        ("baseline: raw memmap slice + copy (LLMBATCH bytes)", f"{base_llm:,.0f} batches",
         "1.00"),
        ("LLMBatchReader.batch + copy", f"{llm_rate:,.0f} batches", f"{llm_rate / base_llm:.2f}"),
        ("baseline: raw memmap slice of stream tokens", f"{base_stream:,.0f} windows", "1.00"),
        ("stream window + metadata records", f"{stream_rate:,.0f} windows",
         f"{stream_rate / base_stream:.2f}"),
    ])
    verdict = llm_rate >= 0.8 * base_llm and stream_rate >= 20_000
    print(f"TARGETS {'PASS' if verdict else 'MISSED'} (LLMBATCH >= 0.8x baseline: "
          f"{llm_rate / base_llm:.2f}; stream windows >= 20,000/s: {stream_rate:,.0f})")


if __name__ == "__main__":
    main()
