"""Shared benchmark helpers: the real-text corpus, peak-RSS reading, table printing."""

from __future__ import annotations

import resource
import site
import sys
from pathlib import Path

import pyarrow.parquet as pq

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from raypipe.demo.corpus import gather_docstrings, stdlib_root, write_corpus  # noqa: E402


def docstring_corpus(directory: Path, target_bytes: int, files: int = 16) -> Path:
    """At least `target_bytes` of docstrings (stdlib + installed packages) as parquet files,
    built once and cached in `directory`. Repeats the document list if one pass is short."""
    corpus = directory / f"corpus-{target_bytes >> 20}MB"
    if not any(corpus.glob("*.parquet")):
        roots = [stdlib_root(), *map(Path, site.getsitepackages())]
        documents = gather_docstrings(roots, skip_site_packages=False)
        pool, size = list(documents), sum(len(d.encode()) for d in documents)
        while size < target_bytes:
            documents.extend(pool)
            size += sum(len(d.encode()) for d in pool)
        write_corpus(documents, corpus, files=files, row_group_rows=2000)
    return corpus


def corpus_texts(corpus: Path) -> list[list[str]]:
    """Texts per parquet file, in file order."""
    return [pq.read_table(p, columns=["text"]).column(0).to_pylist()
            for p in sorted(corpus.glob("*.parquet"))]


def peak_rss_mib() -> float:
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024


def print_table(rows: list[tuple[str, ...]]) -> None:
    widths = [max(len(r[i]) for r in rows) for i in range(len(rows[0]))]
    for row in rows:
        print("  ".join(cell.ljust(width) for cell, width in zip(row, widths, strict=True)))
