"""A small real English corpus that needs no download: the docstrings of Python's standard
library (and, for benchmarks, of every installed package), read with `ast` (nothing is
imported or executed).

Invariant: for one Python installation the document list is deterministic (files sorted,
docstrings in source order). Cost: ~2 s to parse the standard library (~2,500 files).
"""

from __future__ import annotations

import ast
import sysconfig
import warnings
from collections.abc import Iterator
from pathlib import Path

import pyarrow as pa
import pyarrow.parquet as pq

DOCSTRING_OWNERS = (ast.Module, ast.ClassDef, ast.FunctionDef, ast.AsyncFunctionDef)
MIN_CHARS = 40


def stdlib_root() -> Path:
    return Path(sysconfig.get_paths()["stdlib"])


def python_files(root: Path, skip_site_packages: bool = True) -> list[Path]:
    files = []
    for path in sorted(root.rglob("*.py")):
        parts = set(path.relative_to(root).parts)
        if skip_site_packages and ("site-packages" in parts or "dist-packages" in parts):
            continue
        if "test" in parts or "tests" in parts:
            continue
        files.append(path)
    return files


def docstrings_of(path: Path) -> Iterator[str]:
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            tree = ast.parse(path.read_bytes(), filename=str(path))
    except (SyntaxError, ValueError, OSError):
        return
    for node in ast.walk(tree):
        if isinstance(node, DOCSTRING_OWNERS):
            text = ast.get_docstring(node, clean=True)
            if text and len(text) >= MIN_CHARS:
                yield text


def gather_docstrings(roots: list[Path] | None = None, limit_chars: int | None = None,
                      skip_site_packages: bool = True) -> list[str]:
    """Docstrings of every .py file under `roots` (default: the standard library)."""
    documents: list[str] = []
    total = 0
    for root in roots or [stdlib_root()]:
        for path in python_files(root, skip_site_packages):
            for text in docstrings_of(path):
                documents.append(text)
                total += len(text)
                if limit_chars is not None and total >= limit_chars:
                    return documents
    return documents


def write_corpus(documents: list[str], directory: Path, files: int = 4,
                 row_group_rows: int = 2000) -> list[Path]:
    """Write documents round-robin into `files` parquet files with an `id` and `text` column."""
    directory.mkdir(parents=True, exist_ok=True)
    paths = []
    for index in range(files):
        texts = documents[index::files]
        ids = list(range(index, len(documents), files))
        table = pa.table({"id": pa.array(ids, pa.int64()), "text": pa.array(texts, pa.string())})
        path = directory / f"part-{index:05d}.parquet"
        pq.write_table(table, path, row_group_size=row_group_rows)
        paths.append(path)
    return paths
