"""Which call of each fast encoder is fastest on one thread, by document length: the
measurement behind each backend's choice (issue 55).

    python bench/encode_paths_bench.py [--mb 40] [--tokenizer gpt2|shipped] [--workdir bench_out]

The texts are the machine's docstrings and text files, deduplicated (bench/common
.unique_corpus: no encoder cache can flatter a repeat), held in memory as an Arrow string
array per 1,024 texts, as a unit reads them, and bucketed by length in UTF-8 bytes. Per
backend installed, each call runs over every bucket REPEATS times; the least process CPU
time of each is kept (process time, so an encoder's own threads count), and printed as MB
per CPU-second and as a ratio against the per-text loop measured in the same run:
- gigatoken: a loop of `encode(text)`; `encode_batch(list, parallel=False)` over the
  array's Python strings (`to_pylist` counted); `encode_batch(awkward, parallel=False)`
  over the array's own buffers; and `encode_arrow`, the call the units make, which picks
  between the last two by the batch's mean text length;
- fastokens: a loop of one-text `encode_batch_flat` calls against one call per batch.
Every call's ids are checked equal to the per-text loop's.
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

import numpy as np
import pyarrow as pa

sys.path.insert(0, str(Path(__file__).resolve().parent))

from common import corpus_texts, print_table, unique_corpus  # noqa: E402
from gpt2_tokenizer import gpt2_tokenizer_json  # noqa: E402

from raypipe.preprocess.encoding.encoder import load_tokenizer, tokenizer_sha256  # noqa: E402

BUCKETS = ((0, 256), (256, 1024), (1024, 4096), (4096, 1 << 40))
BATCH = 1024
REPEATS = 5


def batches_of(texts: list[str]) -> list[pa.Array]:
    return [pa.array(texts[start:start + BATCH]) for start in range(0, len(texts), BATCH)]


def one_by_one(encode_one) -> object:
    def call(batch: pa.Array) -> np.ndarray:
        return np.concatenate([encode_one(text) for text in batch.to_pylist()])
    return call


def gigatoken_calls(tokenizer, sha256: str) -> dict[str, object]:
    from raypipe.preprocess.encoding.gigatoken_backend import (
        GigatokenIds,
        awkward_strings,
        flat_ids,
    )

    ids = GigatokenIds(tokenizer, sha256, "special")
    return {
        "per-text encode (baseline)": one_by_one(ids.encode_one),
        "encode_batch, Python strings": lambda batch: flat_ids(ids.model.encode_batch(
            batch.to_pylist(), parallel=False))[0],
        "encode_batch, Arrow buffers": lambda batch: flat_ids(ids.model.encode_batch(
            awkward_strings(batch), parallel=False))[0],
        "encode_arrow (the units' call)": lambda batch: ids.encode_arrow(batch)[0],
    }


def fastokens_calls(tokenizer, sha256: str) -> dict[str, object]:
    from raypipe.preprocess.encoding.fastokens_backend import FastokensIds

    ids = FastokensIds(tokenizer, sha256, "special")
    return {"per-text encode (baseline)": one_by_one(ids.encode_one),
            "encode_batch_flat (the units' call)": lambda batch: ids.encode_flat(
                batch.to_pylist())[0]}


def best_seconds(call, batches: list[pa.Array]) -> float:
    best = float("inf")
    for _ in range(REPEATS):
        started = time.process_time()
        for batch in batches:
            call(batch)
        best = min(best, time.process_time() - started)
    return best


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--mb", type=int, default=40)
    parser.add_argument("--tokenizer", choices=("gpt2", "shipped"), default="gpt2")
    parser.add_argument("--workdir", type=Path, default=Path("bench_out"))
    args = parser.parse_args()
    corpus = unique_corpus(args.workdir / f"unique-{args.mb}mb", args.mb << 20)
    texts = [text for part in corpus_texts(corpus) for text in part]
    spec = (str(gpt2_tokenizer_json(args.workdir)) if args.tokenizer == "gpt2"
            else str(Path(__file__).resolve().parents[1] / "raypipe/demo/tokenizer.json"))
    tokenizer = load_tokenizer(spec)
    sha256 = tokenizer_sha256(tokenizer)
    sizes = np.array([len(text.encode("utf-8", "surrogatepass")) for text in texts])
    buckets = {f"{low}-{high if high < 1 << 40 else 'inf'} B": [
        text for text, size in zip(texts, sizes, strict=True) if low <= size < high]
        for low, high in BUCKETS}
    buckets["all"] = texts
    print(f"{len(texts):,} texts, {sizes.sum() / 1e6:.1f} MB, tokenizer {args.tokenizer}")
    for backend, make in (("gigatoken", gigatoken_calls), ("fastokens", fastokens_calls)):
        try:
            calls = make(tokenizer, sha256)
        except Exception as exc:  # noqa: BLE001  (a backend not installed, or refused)
            print(f"{backend}: not measured ({exc})")
            continue
        rows = [("bucket", "texts", "MB", *(f"{name} MB/CPU-s (x baseline)" for name in calls))]
        for label, chosen in buckets.items():
            if not chosen:
                continue
            batches = batches_of(chosen)
            expected = [calls["per-text encode (baseline)"](batch) for batch in batches]
            for name, call in calls.items():
                for batch, want in zip(batches, expected, strict=True):
                    assert np.array_equal(call(batch), want), (backend, name, label)
            megabytes = sum(len(t.encode("utf-8", "surrogatepass")) for t in chosen) / 1e6
            rates = {name: megabytes / best_seconds(call, batches) for name, call in calls.items()}
            base = rates["per-text encode (baseline)"]
            rows.append((label, f"{len(chosen):,}", f"{megabytes:.1f}",
                         *(f"{rate:.0f} ({rate / base:.2f}x)" for rate in rates.values())))
        print(f"\n{backend}, one calling thread:")
        print_table(rows)


if __name__ == "__main__":
    main()
