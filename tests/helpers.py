"""Test helpers: the documents a tokenize job must produce, computed without raypipe."""

from __future__ import annotations

import os
from pathlib import Path

import pyarrow.parquet as pq
from tokenizers import Tokenizer


def expected_documents(corpus: Path, tokenizer_path: str, bos: bool = True,
                       eos: bool = False) -> list[list[int]]:
    """`tokenizers` applied to each non-empty string text, files sorted, rows in order."""
    tokenizer = Tokenizer.from_file(tokenizer_path)
    bos_id, eos_id = tokenizer.token_to_id("<|bos|>"), tokenizer.token_to_id("<|eos|>")
    documents = []
    for path in sorted(Path(corpus).rglob("*.parquet")):
        for text in pq.read_table(path, columns=["text"]).column(0).to_pylist():
            if isinstance(text, bytes):
                try:
                    text = text.decode("utf-8")
                except UnicodeDecodeError:
                    continue
            if isinstance(text, str) and text:
                ids = tokenizer.encode(text, add_special_tokens=False).ids
                documents.append(([bos_id] if bos else []) + ids + ([eos_id] if eos else []))
    return documents


def shard_files(output: Path) -> dict[str, bytes]:
    """Every shard file under a final name (hidden temp files excluded), keyed by its path
    relative to the output."""
    from raypipe.formats import FORMATS

    files = {}
    for directory in FORMATS:  # every registered format's folder the output has
        for path in sorted((Path(output) / directory).glob("[!.]*")):
            files[f"{directory}/{path.name}"] = path.read_bytes()
    return files


def file_identities(output: Path) -> dict[str, tuple[int, int]]:
    return {str(p.relative_to(output)): (os.stat(p).st_ino, os.stat(p).st_mtime_ns)
            for p in sorted(Path(output).rglob("*")) if p.is_file()}


def upload_tree(local: Path, uri: str) -> str:
    """Copy a finished local dataset to object storage (file by file, manifest last)."""
    from raypipe.io.store import Store

    store = Store(uri)
    files = sorted(p for p in local.rglob("*") if p.is_file() and p.name != "manifest.json")
    for path in [*files, local / "manifest.json"]:
        store.write_bytes(str(path.relative_to(local)), path.read_bytes())
    return uri


