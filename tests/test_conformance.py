"""The format conformance suite: every registered format, through its registry entry only,
gets the same checks. A new format gets all of them by registering (and adding its module
to raypipe/formats/__init__.py).

- round trip through tokenize, and through convert (document formats: a -> megatron -> a);
- the same bytes at any parallelism (serial job, one and two Ray workers);
- a kill at every commit step, then a rerun, converges to the clean run's bytes;
- verify names a flipped byte and a missing file in every kind of file the format writes;
- inspect describes it;
- the loader reads it where it holds documents, the same rows as from megatron.
"""

from __future__ import annotations

import shutil
from pathlib import Path

import numpy as np
import pytest
import torch

from raypipe.config import load_config
from raypipe.dataset import BatchDataset, TokenDataset
from raypipe.errors import FormatError
from raypipe.formats import FORMATS, document_formats, get_format
from raypipe.preprocess.job import run_job
from raypipe.tools.convert import convert_dataset
from raypipe.tools.inspect import inspect_dataset
from raypipe.tools.verify import verify_dataset
from tests.conftest import write_parquet
from tests.helpers import expected_documents, shard_files

EVERY_FORMAT = sorted(FORMATS)
BATCH_OPTIONS = {"record_len": 48, "batch_size": 4, "batches_per_shard": 9}


def is_batch_format(name):
    return get_format(name).kind == "batches"


def options_of(name):
    """The options each format is written with here: a batch format's record shape."""
    return BATCH_OPTIONS if is_batch_format(name) else None


def tokenize_options(**extra):
    return {"formats": {name: options_of(name) for name in EVERY_FORMAT}, "unit_bytes": 1,
            "shard_tokens": 6_000, "encode_batch_rows": 40, **extra}


@pytest.fixture(scope="module")
def corpus(tmp_path_factory, corpus_texts):
    directory = tmp_path_factory.mktemp("conformance") / "corpus"
    for index in range(2):
        write_parquet(directory / f"part-{index}.parquet", corpus_texts[index:400:2],
                      row_group_rows=60)
    return directory


@pytest.fixture(scope="module")
def every_format(tmp_path_factory, corpus, tokenizer_path):
    """One output holding every registered format (written by the serial job)."""
    output = tmp_path_factory.mktemp("conformance") / "out"
    run_job(load_config(None, inputs=[str(corpus)], output=str(output),
                        tokenizer=tokenizer_path, **tokenize_options()))
    return output


def records(output, name):
    """What a format holds, as token lists: documents, or a batch format's records."""
    if is_batch_format(name):
        return [r.tolist() for r in BatchDataset(output).iter_records()]
    return [d.tolist() for d in TokenDataset(output, name).iter_documents()]


@pytest.mark.parametrize("name", EVERY_FORMAT)
def test_round_trip_through_tokenize(every_format, corpus, tokenizer_path, name):
    expected = expected_documents(corpus, tokenizer_path)
    held = records(every_format, name)
    if is_batch_format(name):  # records: pieces of the documents, none invented
        corpus_tokens = np.bincount(np.concatenate([np.array(d) for d in expected]))
        served = np.bincount(np.concatenate([np.array(r) for r in held]),
                             minlength=corpus_tokens.size)
        assert (served <= corpus_tokens).all() and served.sum() >= 0.9 * corpus_tokens.sum()
    else:
        assert held == expected


@pytest.mark.parametrize("name", EVERY_FORMAT)
def test_round_trip_through_convert(every_format, tmp_path, name):
    original = records(every_format, "megatron")
    options = {k: BATCH_OPTIONS[k] for k in ("record_len", "batch_size")}
    convert_dataset(every_format, tmp_path / "to", name, options if is_batch_format(name) else None,
                    source_format="megatron")
    verify_dataset(tmp_path / "to")
    if is_batch_format(name):
        assert records(tmp_path / "to", name) == records(every_format, name)  # same plan
        return
    assert records(tmp_path / "to", name) == original
    convert_dataset(tmp_path / "to", tmp_path / "back", "megatron")
    assert records(tmp_path / "back", "megatron") == original


@pytest.mark.ray
@pytest.mark.slow
def test_every_format_is_the_same_bytes_serial_and_on_ray_workers(ray_session, tmp_path, corpus,
                                                                  tokenizer_path, every_format):
    from raypipe.ray.executor import run_on_ray as run_tokenize

    clean = shard_files(every_format)
    assert {path.split("/")[0] for path in clean} == set(EVERY_FORMAT)
    for workers in (1, 2):
        output = tmp_path / f"w{workers}"
        run_tokenize(load_config(None, inputs=[str(corpus)], output=str(output),
                                 tokenizer=tokenizer_path, num_workers=workers,
                                 **tokenize_options(encode_batch_rows=7 * workers)))
        assert shard_files(output) == clean, f"{workers} worker(s)"


@pytest.mark.slow
@pytest.mark.parametrize("point", ["shard.commit", "unit.before_record",
                                   "manifest.before_rename"])
def test_a_kill_at_every_commit_step_then_a_rerun_gives_the_clean_bytes(
        tmp_path, corpus, tokenizer_path, every_format, point):
    import json
    import os
    import subprocess
    import sys

    from raypipe import _faults as faults

    output = tmp_path / "out"
    fault = {"point": point, "action": "exit", "marker": str(tmp_path / "fault"),
             "unit": None if point.startswith("manifest") else "part-1"}
    code = (f"import sys; sys.path.insert(0, {str(Path(__file__).parents[1])!r})\n"
            "from raypipe.config import load_config\n"
            "from raypipe.preprocess.job import run_job\n"
            "from tests.test_conformance import tokenize_options\n"
            f"run_job(load_config(None, inputs=[{str(corpus)!r}], output={str(output)!r}, "
            f"tokenizer={tokenizer_path!r}, **tokenize_options()))\n")
    env = {**os.environ, faults.ENVIRONMENT_VARIABLE: json.dumps(fault)}
    killed = subprocess.run([sys.executable, "-c", code], capture_output=True, env=env,
                            timeout=300)
    assert killed.returncode == 137, killed.stderr.decode()[-2000:]
    run_job(load_config(None, inputs=[str(corpus)], output=str(output),
                        tokenizer=tokenizer_path, **tokenize_options()))
    assert shard_files(output) == shard_files(every_format)
    verify_dataset(output)


def format_files(output: Path, name: str) -> list[Path]:
    """One file of each kind (suffix) the format wrote."""
    fmt, chosen = get_format(name), {}
    for path in sorted((output / name).glob("[!.]*")):
        suffix = next((s for s in sorted(fmt.suffixes, key=len, reverse=True)
                       if path.name.endswith(s)), path.suffix)
        chosen.setdefault(suffix, path)
    return list(chosen.values())


@pytest.mark.parametrize("name", EVERY_FORMAT)
def test_verify_names_a_flipped_byte_and_a_missing_file_of_every_kind(every_format, tmp_path,
                                                                      name):
    copy = tmp_path / "copy"
    shutil.copytree(every_format, copy)
    victims = format_files(copy, name)
    assert victims
    for victim in victims:
        original = victim.read_bytes()
        flipped = bytearray(original)
        flipped[len(flipped) // 2] ^= 0xFF
        victim.write_bytes(bytes(flipped))
        with pytest.raises(FormatError, match=str(victim.name)):
            verify_dataset(copy)
        victim.unlink()
        with pytest.raises(FormatError, match=str(victim.name)):
            verify_dataset(copy)
        victim.write_bytes(original)
    verify_dataset(copy)


@pytest.mark.parametrize("name", EVERY_FORMAT)
def test_inspect_describes_every_format(every_format, name):
    shown = inspect_dataset(every_format, samples=1)
    section = next(line for line in shown.splitlines() if line.startswith(f"format {name}:"))
    assert "shards" in section


@pytest.mark.parametrize("name", document_formats())
def test_the_loader_reads_every_document_format_as_it_reads_megatron(every_format, name):
    from raypipe.loader import TokenLoader

    def rows(fmt):
        loader = TokenLoader(every_format, 32, 4, mode="bestfit", seed=3, format=fmt)
        return [batch.inputs.clone() for _, batch in zip(range(6), loader, strict=False)]

    for mine, reference in zip(rows(name), rows("megatron"), strict=True):
        assert torch.equal(mine, reference)
