"""Test helpers: the documents a tokenize job must produce, computed without raypipe; a
plugin distribution installed in tmp_path and run in a fresh process; corpora whose tokens
are numbered (a token's id says which token of which document it is), or whose rows
include rows that make no document; a serial tokenize job; an output as an earlier release wrote
it (a sidecar left out)."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
from tokenizers import Tokenizer

from bench.common import write_synthetic_dataset
from raypipe.config import load_config
from raypipe.dataset import TokenDataset
from raypipe.preprocess.job import run_job


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




def install_plugin(site: Path, distribution: str, group: str,
                   modules: dict[str, str]) -> Path:
    """An installed distribution in `site` (a dist-info with its entry points), as pip lays
    one out: package `distribution` holds `modules` ({module name: source}), each an entry
    point of `group` under its module name."""
    package = site / distribution
    package.mkdir(parents=True)
    (package / "__init__.py").write_text("")
    for name, source in modules.items():
        (package / f"{name}.py").write_text(source)
    info = site / f"{distribution}-0.1.dist-info"
    info.mkdir()
    (info / "METADATA").write_text(f"Metadata-Version: 2.1\nName: {distribution}\n"
                                   "Version: 0.1\n")
    (info / "entry_points.txt").write_text(f"[{group}]\n" + "".join(
        f"{name} = {distribution}.{name}\n" for name in modules))
    return site


def run_with_plugin(site: Path, *args: str, status: int = 0) -> subprocess.CompletedProcess:
    """`python *args` in a fresh process whose import path holds `site` (as an installed
    plugin is found), in the repository; its exit status must be `status`."""
    root = Path(__file__).resolve().parents[1]
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(site), str(root)])}
    done = subprocess.run([sys.executable, *args], capture_output=True, text=True, env=env,
                          cwd=root, timeout=300)
    assert done.returncode == status, (done.stdout[-2000:], done.stderr[-3000:])
    return done


def numbered_dataset(directory, tokens: int, first: int = 1, seed: int = 7):
    """A megatron dataset whose tokens are numbered from `first` on, in storage order (so a
    token's id says which token of which document it is); (path, its token count)."""
    rng = np.random.default_rng(seed)
    lengths = np.clip(rng.lognormal(3.6, 1.0, 6000).astype(np.int64) + 2, 2, 400)
    lengths = lengths[np.cumsum(lengths) <= tokens]
    ids = np.arange(first, first + int(lengths.sum()), dtype=np.uint32)
    output = directory / "tokens"
    write_synthetic_dataset(output, "megatron", [(ids, lengths, None)], f"numbered-{first}",
                            shard_tokens=40_000, largest_id=1 << 20)
    return output, int(lengths.sum())


def document_starts(path) -> np.ndarray:
    """The id of each document's first token (token ids number the tokens from 1)."""
    lengths = TokenDataset(path).document_lengths()
    return np.concatenate([[0], np.cumsum(lengths)[:-1]]) + 1


def assert_every_token_once(taken, total, tail_tokens):
    """Every document token is in exactly one row of one step, but the drop-last tail's."""
    counts = np.bincount(np.concatenate([rows.ravel() for _, rows in taken.values()]),
                         minlength=total + 1)[1:]
    assert counts.max() == 1, f"{int((counts > 1).sum())} tokens trained twice"
    assert int((counts == 0).sum()) == tail_tokens


def corpus_with_gaps(directory, texts):
    """Parquet files whose rows include empty and null texts (skipped: no document), so a
    document's index is not its input row."""
    directory.mkdir(parents=True, exist_ok=True)
    rows = []
    for index, text in enumerate(texts):
        rows.append(text)
        if index % 7 == 3:
            rows.append("" if index % 2 else None)
    for part in range(2):
        table = pa.table({"text": pa.array(rows[part::2], pa.string())})
        pq.write_table(table, directory / f"part-{part}.parquet", row_group_size=60)
    return directory


def tokenize(corpus, output, tokenizer_path, **options):
    options = {"bos": True, "shard_tokens": 9_000, **options}  # BOS starts documents
    run_job(load_config(None, inputs=[str(corpus)], output=str(output),  # in every format
                        tokenizer=tokenizer_path, unit_bytes=1, **options))
    return output


def without_sidecar(output: Path, fmt: str, suffix: str) -> Path:
    """Rewrite `output` as a release before `fmt`'s shards carried a `suffix` file wrote
    it: the files gone from the manifest and from disk, everything else as written."""
    from dataclasses import replace

    from raypipe.io.manifest import read_manifest, write_manifest

    manifest = read_manifest(output)
    section = manifest.formats[fmt]
    shards = []
    for shard in section.shards:
        gone = [entry for entry in shard.files  # `.sums`, not `.mask.sums`
                if entry.path.rpartition("/")[2] == shard.name + suffix]
        for entry in gone:
            (Path(output) / entry.path).unlink()
        shards.append(replace(shard, files=tuple(entry for entry in shard.files
                                                 if entry not in gone)))
    formats = {**manifest.formats, fmt: replace(section, shards=tuple(shards))}
    write_manifest(output, replace(manifest, formats=formats))
    return output


def lockstep(loaders, state, steps):
    """Loaders of one run (one a rank) resumed from `state` (None: from the start), then
    up to `steps` steps taken in lockstep (fewer where the epoch ends): ({step: (seq_len,
    rows of every rank, rank-major, each its T + 1 tokens)}, the state after, which every
    rank agrees on, JSON round-tripped)."""
    import json

    import torch

    for loader in loaders:
        if state is not None:
            loader.load_state_dict(state)
    iterators = [iter(loader) for loader in loaders]
    taken = {}
    for _ in range(steps):
        batches = [next(iterator, None) for iterator in iterators]
        if batches[0] is None:
            break
        rows = [torch.cat([b.inputs, b.targets[:, -1:]], 1).numpy().copy() for b in batches]
        taken[batches[0].step] = (batches[0].inputs.shape[1], np.concatenate(rows))
    for iterator in iterators:
        iterator.close()
    states = [loader.state_dict() for loader in loaders]
    assert all(saved == states[0] for saved in states), "ranks disagree on the state"
    return taken, json.loads(json.dumps(states[0]))
