"""Packing benchmark: what each packing keeps of a corpus per epoch, and how fast it plans.

    python bench/packing_bench.py [--files 6000] [--workdir bench_out]

Two real corpora, tokenized with the shipped 8192-token BPE (BOS prepended, as raypipe
writes them): the docstrings of the standard library and installed packages (the demo
corpus: mostly short), and whole source files of installed Python packages (long-tailed:
a few files are hundreds of thousands of tokens). For T = 512, 2048 and 8192 (rows of
T + 1 tokens) it prints, per packing, the share of the corpus's tokens trained in one epoch,
cropped, padded (of the rows' size), dropped, and the row count:
- split: raypipe's default (pieces + best-fit decreasing, blocks of 4096 documents);
- crop: raypipe's opt-in nanochat-compatible packing (same blocks);
- concat: windows of the concatenated stream (`mode="windows"`);
- nanochat: the reference re-implementation of nanochat's streaming best-fit with a
  1000-document buffer (bench/nanochat_reference.py), on the same shuffled order.
Then the planner's documents per second for split and crop on 1 M lognormal documents.
"""

from __future__ import annotations

import argparse
import random
import site
import time
from pathlib import Path

import numpy as np
from common import print_table
from nanochat_reference import nanochat_bestfit_crop

from raypipe.demo.corpus import gather_docstrings, stdlib_root
from raypipe.demo.train_tokenizer import SHIPPED
from raypipe.sampling.plans import BestFitPlan, WindowPlan

SEQ_LENS = (512, 2048, 8192)


def token_lengths(texts: list[str]) -> np.ndarray:
    """Tokens per document as raypipe writes it (BOS + content)."""
    from tokenizers import Tokenizer

    tokenizer = Tokenizer.from_file(str(SHIPPED))
    lengths = []
    for first in range(0, len(texts), 512):
        batch = tokenizer.encode_batch_fast(texts[first:first + 512], add_special_tokens=False)
        lengths.extend(len(e.ids) + 1 for e in batch)
    return np.array(lengths, dtype=np.int64)


def source_files(limit: int, seed: int = 0) -> list[str]:
    """Whole .py files of installed packages (a seeded sample of `limit`)."""
    paths = sorted({p for root in site.getsitepackages() for p in Path(root).rglob("*.py")})
    random.Random(seed).shuffle(paths)
    texts = []
    for path in paths[:limit]:
        try:
            text = path.read_text(encoding="utf-8")
        except (UnicodeDecodeError, OSError):
            continue
        if text.strip():
            texts.append(text)
    return texts


def cached_lengths(workdir: Path, name: str, texts_of) -> np.ndarray:
    path = workdir / f"lengths-{name}.npy"
    if not path.exists():
        np.save(path, token_lengths(texts_of()))
    return np.load(path)


def row_of_results(name: str, used: int, cropped: int, padded: int, dropped: int,
                   rows: int, total: int) -> tuple[str, ...]:
    return (name, f"{used / total:.2%}", f"{cropped / total:.2%}", f"{padded / total:.2%}",
            f"{dropped / total:.2%}", f"{rows:,}")


def compare(lengths: np.ndarray, seq_len: int) -> list[tuple[str, ...]]:
    total = int(lengths.sum())
    results = []
    for packing in ("split", "crop"):
        report = BestFitPlan(lengths, seq_len, seed=1, epoch=0, packing=packing).report()
        results.append(row_of_results(packing, report.used_tokens, report.cropped_tokens,
                                      report.padded_tokens, report.dropped_tokens,
                                      report.rows, total))
    windows = WindowPlan(total, seq_len, 1, 0).report()
    results.append(row_of_results("concat", windows.used_tokens, 0, 0, windows.dropped_tokens,
                                  windows.rows, total))
    plan = BestFitPlan(lengths, seq_len, seed=1, epoch=0)
    order = np.concatenate([plan.block_documents_ids(b) for b in range(plan.num_blocks)])
    reference = nanochat_bestfit_crop(lengths[order], seq_len + 1)
    results.append(row_of_results("nanochat", reference["used"], reference["cropped"], 0,
                                  reference["dropped"], reference["used"] // (seq_len + 1),
                                  total))
    return results


def planner_rate(packing: str, documents: int = 1_000_000, repeats: int = 2) -> float:
    lengths = (np.random.default_rng(0).lognormal(6.0, 1.2, documents) + 2).astype(np.int64)
    best = float("inf")
    for _ in range(repeats):
        began = time.perf_counter()
        BestFitPlan(lengths, 2048, seed=1, epoch=0, packing=packing).report()
        best = min(best, time.perf_counter() - began)
    return documents / best


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--files", type=int, default=6000)
    parser.add_argument("--workdir", type=Path, default=Path("bench_out"))
    args = parser.parse_args()
    args.workdir.mkdir(exist_ok=True)
    roots = [stdlib_root(), *map(Path, site.getsitepackages())]
    corpora = {
        "docstrings": cached_lengths(args.workdir, "docstrings", lambda: gather_docstrings(
            roots, skip_site_packages=False)),
        "source files": cached_lengths(args.workdir, f"source-{args.files}",
                                       lambda: source_files(args.files)),
    }
    for name, lengths in corpora.items():
        percentiles = np.percentile(lengths, [50, 90, 99, 100]).astype(int).tolist()
        print(f"\n{name}: {len(lengths):,} documents, {int(lengths.sum()):,} tokens; "
              f"length p50/p90/p99/max {' / '.join(f'{p:,}' for p in percentiles)}")
        for seq_len in SEQ_LENS:
            print(f"-- T = {seq_len} (rows of {seq_len + 1} tokens)")
            print_table([("packing", "trained", "cropped", "padded", "dropped", "rows"),
                         *compare(lengths, seq_len)])
    print("\nplanner, 1,000,000 lognormal documents, T = 2048 (best of 2):")
    print_table([("packing", "documents/s"),
                 *[(p, f"{planner_rate(p):,.0f}") for p in ("split", "crop")]])


if __name__ == "__main__":
    main()
