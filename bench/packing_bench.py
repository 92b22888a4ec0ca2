"""Packing benchmark: what each packing makes of four corpora, and how fast it plans.

    python bench/packing_bench.py [--files 6000] [--documents 50000] [--workdir bench_out]

Corpora (packing depends on document lengths only):
- long-tailed: whole source files of installed Python packages, tokenized with the shipped
  8192-token BPE (BOS prepended, as raypipe writes them): most are short, a few are
  hundreds of thousands of tokens;
- narrow: every document 0.55-0.8 of a row (two never share one: chunked corpora, code cut
  at a limit);
- bimodal: half short (2.5-10% of a row), half long (70-95% of a row);
- uniform: lengths uniform in 1 .. 2 rows.
The synthetic ones have --documents documents, scaled to each T. For T = 512, 2048 and 8192
(rows of T + 1 tokens) it prints, per packing: the share of the positions that are padding,
the share of the corpus's tokens trained in one epoch, cuts per document (places a document
is split between rows, or cropped) and the share of documents cut at all:
- fill: raypipe's default (split, then every row filled with pieces of documents);
- split: every token, documents whole where they fit, the rest padded (Ding et al. 2024);
- crop: raypipe's opt-in nanochat-compatible packing;
- concat: windows of the concatenated stream (`mode="windows"`; Megatron, nanoGPT);
- nanochat (long-tailed only): the reference re-implementation of nanochat's streaming
  best-fit with a 1000-document buffer (bench/nanochat_reference.py), on the same order.
Every target true: for each tokenization (BOS before each document, EOS after it, both),
fill packing's rows at T = 2048 on every corpus, with the positions spent on separators
(joins a reader could not see without an inserted token: raypipe's cut rule needs none)
and the targets the loader masks because they would cross from one piece into another
document (per row, and as a share of the targets).
Then the planner's documents per second on 1 M lognormal documents at T = 2048: the epoch
plan (row counts and report; fill needs no block packed) and packing every block (what the
loader does, one block at a time, for the blocks it reads).
Targets: fill pads <= 1% of the positions and trains every token on every corpus and for
every tokenization, with 0 separator positions; its planner >= 1 M documents/s.
"""

from __future__ import annotations

import argparse
import random
import site
import time
from collections.abc import Callable
from pathlib import Path

import numpy as np
from common import print_table
from nanochat_reference import nanochat_bestfit_crop

from raypipe.demo.train_tokenizer import SHIPPED
from raypipe.sampling.modes.bestfit import BestFitPlan
from raypipe.sampling.modes.windows import WindowPlan
from raypipe.sampling.pack import PackedBlock

SEQ_LENS = (512, 2048, 8192)
HEADER = ("packing", "padding", "trained", "cuts/doc", "docs cut")


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


def cached_lengths(workdir: Path, name: str, texts_of: Callable[[], list[str]]) -> np.ndarray:
    path = workdir / f"lengths-{name}.npy"
    if not path.exists():
        np.save(path, token_lengths(texts_of()))
    return np.load(path)


def synthetic_lengths(kind: str, capacity: int, count: int) -> np.ndarray:
    rng = np.random.default_rng(11)
    if kind == "narrow":
        return rng.integers(int(0.55 * capacity), int(0.8 * capacity) + 1, count)
    if kind == "bimodal":
        short = rng.integers(capacity // 40, capacity // 10, count)
        return np.where(rng.random(count) < 0.5, short,
                        rng.integers(int(0.7 * capacity), int(0.95 * capacity), count))
    return rng.integers(1, 2 * capacity + 1, count)


def shares(padded: int, positions: int, trained: int, total: int, cuts: int, cut_docs: int,
           documents: int) -> tuple[str, ...]:
    return (f"{padded / max(positions, 1):.2%}", f"{trained / total:.2%}",
            f"{cuts / documents:.3f}", f"{cut_docs / documents:.1%}")


def packed_row(packing: str, lengths: np.ndarray, seq_len: int) -> tuple[str, ...]:
    """One bestfit packing's figures; every block packed to count its cuts."""
    plan = BestFitPlan(lengths, seq_len, seed=1, epoch=0, packing=packing)
    report = plan.report()
    blocks = [plan.pack(block) for block in range(plan.num_blocks)]
    pieces = np.concatenate([block.doc_ids for block in blocks])
    if packing == "crop":  # a cut is a cropped document; its tail is not trained
        take = np.concatenate([block.take for block in blocks])
        cut = np.count_nonzero(take < lengths[pieces])
        cuts = cut_docs = cut
    else:
        per_document = np.bincount(pieces, minlength=len(lengths))
        cuts = int(pieces.size - np.count_nonzero(per_document))
        cut_docs = int(np.count_nonzero(per_document > 1))
    return (packing, *shares(report.padded_tokens, report.positions, report.used_tokens,
                             report.total_tokens, cuts, cut_docs, len(lengths)))


def concat_row(lengths: np.ndarray, seq_len: int) -> tuple[str, ...]:
    """Windows of the concatenated stream: a cut wherever a window boundary (every T
    tokens) falls inside a document."""
    total = int(lengths.sum())
    report = WindowPlan(total, seq_len, 1, 0).report()
    order = BestFitPlan(lengths, seq_len, seed=1, epoch=0)
    shuffled = lengths[order.document_order(np.arange(len(lengths), dtype=np.int64))]
    ends = np.cumsum(shuffled)
    per_document = (ends - 1) // seq_len - (ends - shuffled) // seq_len
    return ("concat", *shares(0, report.positions, report.used_tokens, total,
                              int(per_document.sum()), int(np.count_nonzero(per_document)),
                              len(lengths)))


def nanochat_row(lengths: np.ndarray, seq_len: int) -> tuple[str, ...]:
    plan = BestFitPlan(lengths, seq_len, seed=1, epoch=0, packing="crop")
    order = np.concatenate([plan.block_documents_ids(b) for b in range(plan.num_blocks)])
    reference = nanochat_bestfit_crop(lengths[order], seq_len + 1)
    return ("nanochat", f"{0:.2%}", f"{reference['used'] / int(lengths.sum()):.2%}", "-", "-")


def compare(lengths: np.ndarray, seq_len: int, with_nanochat: bool) -> list[tuple[str, ...]]:
    rows = [packed_row(packing, lengths, seq_len) for packing in ("fill", "split", "crop")]
    rows.append(concat_row(lengths, seq_len))
    if with_nanochat:
        rows.append(nanochat_row(lengths, seq_len))
    return rows


def planner_rates(packing: str, documents: int = 1_000_000) -> tuple[float, float]:
    """(documents/s of the epoch plan, documents/s of packing every block), best of 2."""
    lengths = (np.random.default_rng(0).lognormal(6.0, 1.2, documents) + 2).astype(np.int64)
    plan_best = pack_best = float("inf")
    for _ in range(2):
        began = time.perf_counter()
        plan = BestFitPlan(lengths, 2048, seed=1, epoch=0, packing=packing)
        plan.report()
        plan_best = min(plan_best, time.perf_counter() - began)
        began = time.perf_counter()
        for block in range(plan.num_blocks):
            plan.pack(block)
        pack_best = min(pack_best, time.perf_counter() - began)
    return documents / plan_best, documents / pack_best


def describe(name: str, lengths: np.ndarray) -> str:
    percentiles = np.percentile(lengths, [10, 50, 90, 100]).astype(int).tolist()
    return (f"{name}: {len(lengths):,} documents, {int(lengths.sum()):,} tokens; length "
            f"p10/p50/p90/max {' / '.join(f'{p:,}' for p in percentiles)}")


TOKENIZATIONS = {"BOS": (True, False), "EOS": (False, True), "BOS+EOS": (True, True)}
TARGET_HEADER = ("corpus", "tokens", "padding", "trained", "separators", "masked/row",
                 "masked targets")


def join_counts(block: PackedBlock, bos: bool, eos: bool) -> tuple[int, int]:
    """(joins inside rows no reader could see, joins whose crossing target is masked)."""
    if block.doc_ids.size < 2:
        return 0, 0
    same_row = np.ones(block.doc_ids.size - 1, dtype=bool)
    same_row[block.row_offsets[1:-1][block.row_offsets[1:-1] > 0] - 1] = False
    starts, ends = block.starts == 0, block.ends_document
    visible = (ends[:-1] & eos) | (starts[1:] & bos)
    true = ends[:-1] & starts[1:]
    return (int(np.count_nonzero(same_row & ~visible)),
            int(np.count_nonzero(same_row & ~true)))


def target_row(name: str, tokenization: str, lengths: np.ndarray,
               seq_len: int) -> tuple[str, ...]:
    """Fill packing under one tokenization: its padding, tokens trained, separator
    positions and masked targets."""
    bos, eos = TOKENIZATIONS[tokenization]
    lengths = lengths + int(bos and eos)  # a corpus's lengths hold one separator each
    plan = BestFitPlan(lengths, seq_len, seed=1, epoch=0, separator="bos" if bos else "eos")
    report = plan.report()
    separators = masked = 0
    for block in range(plan.num_blocks):
        hidden, crossing = join_counts(plan.pack(block), bos, eos)
        separators, masked = separators + hidden, masked + crossing
    return (name, tokenization, f"{report.padding_fraction:.2%}",
            f"{report.used_tokens / report.total_tokens:.2%}", f"{separators}",
            f"{masked / report.rows:.2f}", f"{masked / (report.rows * seq_len):.3%}")


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--files", type=int, default=6000)
    parser.add_argument("--documents", type=int, default=50_000)
    parser.add_argument("--workdir", type=Path, default=Path("bench_out"))
    args = parser.parse_args()
    args.workdir.mkdir(exist_ok=True)
    long_tailed = cached_lengths(args.workdir, f"source-{args.files}",
                                 lambda: source_files(args.files))
    print(describe("long-tailed (source files)", long_tailed))
    for seq_len in SEQ_LENS:
        corpora = {"long-tailed": long_tailed}
        corpora.update({kind: synthetic_lengths(kind, seq_len + 1, args.documents)
                        for kind in ("narrow", "bimodal", "uniform")})
        for name, lengths in corpora.items():
            print(f"\n-- {name}, T = {seq_len} (rows of {seq_len + 1} tokens)")
            print_table([HEADER, *compare(lengths, seq_len, name == "long-tailed")])
    print("\nevery target true: fill at T = 2048, by tokenization")
    corpora = {"long-tailed": long_tailed}  # lengths with one separator (BOS or EOS) each
    corpora.update({kind: synthetic_lengths(kind, 2049, args.documents)
                    for kind in ("narrow", "bimodal", "uniform")})
    rows = [target_row(name, tokenization, lengths, 2048)
            for name, lengths in corpora.items() for tokenization in TOKENIZATIONS]
    print_table([TARGET_HEADER, *rows])
    held = all(float(row[2].rstrip("%")) <= 1.0 and float(row[3].rstrip("%")) >= 99.0
               and row[4] == "0" for row in rows)
    print(f"TARGET fill trains >= 99%, pads <= 1%, 0 separator positions for BOS, EOS and "
          f"BOS+EOS: {'PASS' if held else 'MISSED'}")
    print("\nplanner, 1,000,000 lognormal documents, T = 2048 (best of 2):")
    rates = {p: planner_rates(p) for p in ("fill", "split", "crop")}
    print_table([("packing", "epoch plan docs/s", "every block packed docs/s"),
                 *[(p, f"{plan:,.0f}", f"{packed:,.0f}") for p, (plan, packed) in rates.items()]])
    fill_ok = rates["fill"][0] >= 1e6
    print(f"TARGET fill planner >= 1 M documents/s: {'PASS' if fill_ok else 'MISSED'}")


if __name__ == "__main__":
    main()
