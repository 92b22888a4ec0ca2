"""Hostile and odd inputs and outputs: every name and path read from a manifest is checked
before use, and nothing is written outside the destination; loader states are checked field
by field; impossible world sizes are refused; odd text columns are tokenized or refused at
planning; special-token literals in text cannot forge a special id."""

from __future__ import annotations

import json
import re
import shutil

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from raypipe.errors import ConfigError, FormatError, InputError, StateError
from raypipe.loader import TokenLoader
from raypipe.tools.convert import convert_dataset
from raypipe.tools.inspect import inspect_dataset
from raypipe.tools.verify import verify_dataset

HOSTILE_NAMES = ["../../../outside/PWNED", "/tmp/abs-PWNED", "a/b", "..", ".", "", "x\x00y"]


def edit_manifest(root, edit) -> None:
    manifest = json.loads((root / "manifest.json").read_text())
    edit(manifest)
    (root / "manifest.json").write_text(json.dumps(manifest))


def crafted_fields():
    """(label, the format it breaks or None for all, edit) for every name or path field."""
    for name in HOSTILE_NAMES:
        for fmt in ("megatron", "stream", "llmbatch"):
            yield (f"{fmt} shard name {name!r}", fmt,
                   lambda m, f=fmt, n=name: m["formats"][f]["shards"][0].update(name=n))
            yield (f"{fmt} file path {name!r}", fmt,
                   lambda m, f=fmt, n=name: m["formats"][f]["shards"][0]["files"][0].update(
                       path=n))
        yield (f"unit name {name!r}", None, lambda m, n=name: m["units"][0].update(name=n))


def users_of(root, destination, fmt):
    """Everything that reads the dataset's format `fmt` (None: any format)."""
    readers = {
        "megatron": [lambda: TokenLoader(root, 16, 2, mode="windows", format="megatron"),
                     lambda: convert_dataset(root, destination, "nanogpt")],
        "stream": [lambda: TokenLoader(root, 16, 2, mode="windows", format="stream")],
        "llmbatch": [lambda: TokenLoader(root, mode="batches")],
    }
    chosen = [use for name, uses in readers.items() if fmt in (None, name) for use in uses]
    return [lambda: verify_dataset(root), lambda: inspect_dataset(root), *chosen]


@pytest.mark.parametrize("label,fmt,edit", list(crafted_fields()), ids=lambda v: str(v)[:40])
def test_every_manifest_name_and_path_is_checked_before_use(rich_dataset, tmp_path, label,
                                                            fmt, edit):
    root = tmp_path / "data"
    shutil.copytree(rich_dataset, root)
    edit_manifest(root, edit)
    destination = tmp_path / "deep" / "er" / "dst"
    for use in users_of(root, destination, fmt):
        with pytest.raises(FormatError):
            use()
    outside = [p for p in tmp_path.rglob("*PWNED*")]
    assert outside == [], label
    assert not destination.exists() or not any((destination).rglob("*.bin")), label


def test_unknown_fields_types_and_versions_are_refused(rich_dataset, tmp_path):
    root = tmp_path / "data"
    shutil.copytree(rich_dataset, root)
    cases = {
        "documents": lambda m: m["formats"]["megatron"]["shards"][0].update(documents="7"),
        "bytes": lambda m: m["formats"]["megatron"]["shards"][0]["files"][0].update(
            bytes=-1),
        "tokenizer": lambda m: m.update(tokenizer=[]),
        "manifest_version": lambda m: m.update(manifest_version=2),
    }
    original = (root / "manifest.json").read_text()
    for field, edit in cases.items():
        (root / "manifest.json").write_text(original)
        edit_manifest(root, edit)
        with pytest.raises(FormatError) as info:
            verify_dataset(root)
        assert "manifest.json" in str(info.value), field


@pytest.mark.parametrize("field,value", [
    ("position", 12.7), ("position", "12"), ("position", True), ("position", -1),
    ("epoch", -1), ("epoch", 0.5), ("epoch", "0"), ("epoch", 10**30), ("epoch", None),
    ("version", "1"), ("knobs", "bestfit"), ("dataset", 7), ("saved_with", 3)])
def test_loader_state_fields_are_type_and_range_checked(token_dataset, field, value):
    loader = TokenLoader(token_dataset, 16, 2, mode="windows")
    state = {**loader.state_dict(), field: value}
    with pytest.raises(StateError, match=field):
        TokenLoader(token_dataset, 16, 2, mode="windows").load_state_dict(state)


@pytest.mark.parametrize("missing", ["version", "dataset", "knobs", "epoch", "position"])
def test_loader_state_with_a_missing_key_names_it(token_dataset, missing):
    state = TokenLoader(token_dataset, 16, 2, mode="windows").state_dict()
    del state[missing]
    with pytest.raises(StateError, match=missing):
        TokenLoader(token_dataset, 16, 2, mode="windows").load_state_dict(state)


def test_fewer_observations_than_ranks_times_batch_is_an_error(token_dataset):
    loader = TokenLoader(token_dataset, 16, 4, mode="documents", world_size=1000)
    with pytest.raises(ConfigError, match=r"world_size 1000 x batch_size 4"):
        next(iter(loader))


def write_column(path, column: pa.Array) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    pq.write_table(pa.table({"text": column}), path)


@pytest.mark.parametrize("kind", ["dictionary", "large_string", "string_view"])
def test_odd_string_columns_are_tokenized(tmp_path, tokenizer_path, corpus_texts, kind):
    from raypipe.config import load_config
    from raypipe.preprocess.job import run_job

    texts = corpus_texts[:30] + corpus_texts[:10]  # repeats: a real dictionary
    column = {"dictionary": pa.array(texts).dictionary_encode(),
              "large_string": pa.array(texts, pa.large_string()),
              "string_view": pa.array(texts, pa.string_view())}[kind]
    write_column(tmp_path / "in" / "a.parquet", column)
    summary = run_job(load_config(None, inputs=[str(tmp_path / "in")],
                                  output=str(tmp_path / "out"), tokenizer=tokenizer_path))
    assert summary.documents == len(texts) and summary.skipped == {}


@pytest.mark.parametrize("column", [pa.array([[1, 2], [3]]), pa.array([{"a": 1}, {"a": 2}]),
                                    pa.array([1.5, 2.5])])
def test_a_column_that_cannot_hold_text_is_refused_at_planning(tmp_path, tokenizer_path,
                                                               column):
    from raypipe.config import load_config
    from raypipe.preprocess.job import run_job

    write_column(tmp_path / "in" / "a.parquet", column)
    with pytest.raises(InputError, match=r"a.parquet: text column 'text' has type"):
        run_job(load_config(None, inputs=[str(tmp_path / "in")],
                            output=str(tmp_path / "out"), tokenizer=tokenizer_path))
    assert not (tmp_path / "out").exists()  # refused before the output was touched


def test_a_symlink_loop_and_two_spellings_take_each_file_once(tmp_path, tokenizer_path,
                                                               corpus_texts):
    from raypipe.preprocess.inputs import expand_inputs

    write_column(tmp_path / "in" / "sub" / "a.parquet", pa.array(corpus_texts[:3]))
    (tmp_path / "in" / "sub" / "back").symlink_to(tmp_path / "in")
    (tmp_path / "in" / "alias").symlink_to(tmp_path / "in" / "sub")
    files = expand_inputs([str(tmp_path / "in"), str(tmp_path / "in" / "sub" / "a.parquet"),
                           str(tmp_path / "in" / "alias" / "a.parquet")])
    assert files == [str((tmp_path / "in" / "sub" / "a.parquet").resolve())]


@pytest.mark.parametrize("policy", ["text", "special"])
def test_special_token_literals_in_text_cannot_forge_a_bos_by_default(tmp_path, tokenizer_path,
                                                                      policy):
    from tokenizers import Tokenizer

    from raypipe.config import load_config
    from raypipe.dataset import TokenDataset
    from raypipe.preprocess.job import run_job

    texts = ["Hello<|bos|>World", "plain text", "two <|eos|> and <|bos|>"]
    write_column(tmp_path / "in" / "a.parquet", pa.array(texts))
    summary = run_job(load_config(None, inputs=[str(tmp_path / "in")],
                                  output=str(tmp_path / "out"), tokenizer=tokenizer_path,
                                  special_tokens_in_text=policy))
    reference = Tokenizer.from_file(tokenizer_path)
    reference.encode_special_tokens = policy == "text"
    expected = [[0] + reference.encode(t, add_special_tokens=False).ids for t in texts]
    # nanoGPT's documents start with BOS (its ecosystem's separator, by default)
    documents = [d.tolist() for d in TokenDataset(tmp_path / "out", "nanogpt").iter_documents()]
    forged = sum(d[1:].count(0) for d in expected)
    if policy == "text":  # no document holds a BOS (id 0) but its first token
        assert documents == expected and forged == 0
    else:  # tokenizers' default: the literal becomes the special id, so a trainer that
        # finds documents by scanning for BOS sees more documents than raypipe's index
        from raypipe.formats.base import starts_from_markers

        assert documents == expected and forged == 2
        stream = np.concatenate([np.array(d) for d in documents])
        assert len(starts_from_markers(stream, 0, None)) - 1 == len(texts) + forged
    assert summary.special_literals == 2 and "special-token literals in 2" in summary.render()


def test_the_special_literal_policy_of_older_outputs_keeps_their_fingerprint():
    from raypipe.config import load_config

    old = load_config(None, inputs=["x"], output="o", tokenizer="t",
                      special_tokens_in_text="special")
    new = load_config(None, inputs=["x"], output="o", tokenizer="t")
    assert "special_tokens_in_text" not in old.output_fields()
    assert new.output_fields()["special_tokens_in_text"] == "text"
    assert old.output_fingerprint("s") != new.output_fingerprint("s")


def test_a_byte_flipped_in_a_committed_shard_is_caught_by_the_rerun_and_the_loader(
        tmp_path, corpus_dir, tokenizer_path, caplog):
    from raypipe.config import load_config
    from raypipe.preprocess.job import run_job
    from tests.helpers import shard_files

    config = load_config(None, inputs=[str(corpus_dir)], output=str(tmp_path / "out"),
                         tokenizer=tokenizer_path, unit_bytes=1)
    first = run_job(config)
    clean = shard_files(tmp_path / "out")
    state = TokenLoader(tmp_path / "out", 16, 2, mode="windows").state_dict()
    victim = sorted((tmp_path / "out" / "megatron").glob("*.bin"))[2]
    data = bytearray(victim.read_bytes())
    data[len(data) // 2] ^= 0xFF  # same size
    victim.write_bytes(bytes(data))
    loader = TokenLoader(tmp_path / "out", 16, 2, mode="windows")
    loader.load_state_dict(state)  # shards open when first read, not all up front
    with pytest.raises(FormatError, match="contents changed since the commit") as refused:
        for _ in loader:
            pass
    assert str(victim) in str(refused.value)
    with caplog.at_level("WARNING", logger="raypipe"):
        again = run_job(config)
    assert again.units_run == 1 and first.units > 1  # only the edited unit, and it says so
    assert any(str(victim) in r.getMessage() for r in caplog.records)
    assert shard_files(tmp_path / "out") == clean
    TokenLoader(tmp_path / "out", 16, 2, mode="windows").load_state_dict(state)


def served_until_refused(loader) -> tuple[list[bytes], FormatError | None]:
    """The batches a loader serves, and the refusal that stopped it (None: the epoch)."""
    served: list[bytes] = []
    try:
        for batch in loader:
            served.append(batch.inputs.numpy().tobytes())
    except FormatError as refused:
        return served, refused
    finally:
        loader.close()
    return served, None


@pytest.mark.parametrize("fmt", ["megatron", "nanogpt", "stream"])
@pytest.mark.parametrize("change", ["flipped", "appended"])
def test_a_token_file_changed_in_place_is_refused_before_an_altered_token_is_served(
        request, tmp_path, change, fmt):
    """A byte flipped in a Megatron or NanoGPT .bin or a stream .tokens with its
    modification time put back (bit rot, a copy that kept times), or bytes appended: the
    loader refuses the file, naming it, and every batch it served before is the unchanged
    output's."""
    import os

    from raypipe.formats import get_format

    copy = tmp_path / "copy"
    dataset = request.getfixturevalue("stream_dataset" if fmt == "stream" else "token_dataset")
    shutil.copytree(dataset, copy)  # times kept
    knobs = {"mode": "windows", "seed": 5, "format": fmt}
    clean, _ = served_until_refused(TokenLoader(copy, 16, 2, **knobs))
    victim = sorted((copy / fmt).glob("*" + get_format(fmt).suffixes[0]))[1]
    before = victim.stat()
    data = bytearray(victim.read_bytes())
    if change == "flipped":
        data[len(data) // 2] ^= 0x5A
    else:
        data += bytes(8)
    victim.write_bytes(bytes(data))
    os.utime(victim, ns=(before.st_atime_ns, before.st_mtime_ns))
    served, refused = served_until_refused(TokenLoader(copy, 16, 2, **knobs))
    assert refused is not None and str(victim) in str(refused)
    assert "\n" not in str(refused)
    if change == "flipped":  # found by the shard's .sums (the size and time are kept)
        assert "differ from what the job wrote" in str(refused)
    assert served == clean[:len(served)] and len(served) < len(clean)


def test_a_copy_that_did_not_keep_modification_times_still_opens(token_dataset, tmp_path):
    copy = tmp_path / "copy"
    shutil.copytree(token_dataset, copy, copy_function=shutil.copy)  # new mtimes
    state = TokenLoader(token_dataset, 16, 2, mode="windows").state_dict()
    TokenLoader(copy, 16, 2, mode="windows").load_state_dict(state)  # settled by sha256
    verify_dataset(copy)


def test_a_second_job_on_the_same_output_is_refused_naming_the_first(tmp_path, corpus_dir,
                                                                     tokenizer_path):
    import os
    import signal
    import subprocess
    import sys
    import time
    from pathlib import Path

    from raypipe import _faults as faults
    from raypipe.config import load_config
    from raypipe.errors import ConfigError
    from raypipe.preprocess.job import run_job
    from tests.helpers import shard_files

    root = Path(__file__).resolve().parents[1]
    output, marker = tmp_path / "out", tmp_path / "paused"
    fault = {"point": "unit.rows", "unit": "part-1", "action": "pause", "marker": str(marker)}
    code = (f"import sys; sys.path.insert(0, {str(root)!r})\n"
            "from raypipe.config import load_config\n"
            "from raypipe.preprocess.job import run_job\n"
            f"run_job(load_config(None, inputs=[{str(corpus_dir)!r}], output={str(output)!r}, "
            f"tokenizer={tokenizer_path!r}, unit_bytes=1))\n")
    first = subprocess.Popen([sys.executable, "-c", code], env={
        **os.environ, faults.ENVIRONMENT_VARIABLE: json.dumps(fault)})
    try:
        deadline = time.monotonic() + 60
        while not (marker.exists() and marker.read_text()) and time.monotonic() < deadline:
            time.sleep(0.05)
        assert marker.exists(), "the first job did not reach its pause point"
        config = load_config(None, inputs=[str(corpus_dir)], output=str(output),
                             tokenizer=tokenizer_path, unit_bytes=1)
        temps_before = sorted(output.rglob("*.raypipe.tmp"))
        with pytest.raises(ConfigError, match=f"pid {first.pid} on this host"):
            run_job(config)
        assert sorted(output.rglob("*.raypipe.tmp")) == temps_before  # its temps untouched
    finally:
        first.send_signal(signal.SIGKILL)
        first.wait()
    summary = run_job(config)  # the dead job's lock is taken over; the output converges
    assert summary.units_run >= 1 and not list(output.rglob("*.raypipe.tmp"))
    assert not (output / ".raypipe-lock.json").exists()
    clean = tmp_path / "clean"
    run_job(load_config(None, inputs=[str(corpus_dir)], output=str(clean),
                        tokenizer=tokenizer_path, unit_bytes=1))
    assert shard_files(output) == shard_files(clean)


def test_an_input_rewritten_under_the_same_name_is_re_run(tmp_path, tokenizer_path,
                                                          corpus_texts, caplog):
    from raypipe.config import load_config
    from raypipe.dataset import TokenDataset
    from raypipe.preprocess.job import run_job
    from tests.conftest import write_parquet
    from tests.helpers import expected_documents

    corpus = tmp_path / "in"
    write_parquet(corpus / "a.parquet", corpus_texts[:60], row_group_rows=20)
    write_parquet(corpus / "b.parquet", corpus_texts[60:120], row_group_rows=20)
    config = load_config(None, inputs=[str(corpus)], output=str(tmp_path / "out"),
                         tokenizer=tokenizer_path, unit_bytes=1)
    first = run_job(config)
    write_parquet(corpus / "b.parquet", corpus_texts[200:260], row_group_rows=20)  # new text
    with caplog.at_level("WARNING", logger="raypipe"):
        again = run_job(config)
    assert again.units_run == first.units // 2  # b's units only, and it says why
    assert any("b.parquet changed" in r.getMessage() for r in caplog.records)
    got = [d.tolist() for d in TokenDataset(tmp_path / "out").iter_documents()]
    assert got == expected_documents(corpus, tokenizer_path, bos=False, eos=True)  # Megatron
    assert run_job(config).units_run == 0  # unchanged inputs: nothing to redo


def test_a_document_over_the_worker_memory_budget_is_skipped_as_too_long(tmp_path,
                                                                          tokenizer_path,
                                                                          corpus_texts):
    from raypipe.config import load_config
    from raypipe.preprocess.job import run_job

    long_text = "word " * 40_000  # 200,000 characters: ~40 MB of worker memory budgeted
    write_column(tmp_path / "in" / "a.parquet", pa.array(corpus_texts[:5] + [long_text]))
    small = run_job(load_config(None, inputs=[str(tmp_path / "in")],
                                output=str(tmp_path / "small"), tokenizer=tokenizer_path,
                                worker_memory_budget=200 * 100_000))
    assert small.skipped == {"too_long": 1} and small.documents == 5
    roomy = run_job(load_config(None, inputs=[str(tmp_path / "in")],
                                output=str(tmp_path / "roomy"), tokenizer=tokenizer_path))
    assert roomy.skipped == {} and roomy.documents == 6
    assert "worker_memory_budget" not in load_config(
        None, inputs=["x"], output="o", tokenizer="t").output_fields()  # 0.1 fingerprints


@pytest.mark.parametrize("executor", [
    pytest.param("ray", marks=[pytest.mark.ray, pytest.mark.slow]), "local"])
def test_an_error_inside_a_worker_is_one_line_naming_the_file(request, tmp_path, tokenizer_path,
                                                              corpus_texts, capsys, executor):
    from raypipe.cli import main

    if executor == "ray":
        request.getfixturevalue("ray_session")
    from tests.conftest import write_parquet

    path = write_parquet(tmp_path / "in" / "bad.parquet", corpus_texts[:200], row_group_rows=50)
    data = bytearray(path.read_bytes())
    middle = len(data) // 3  # a data page: the footer (planning) stays readable
    data[middle:middle + 64] = b"\xff" * 64
    path.write_bytes(bytes(data))
    code = main(["tokenize", str(tmp_path / "in"), "--tokenizer", tokenizer_path,
                 "--output", str(tmp_path / "out"), "--unit-bytes", "1", "--executor", executor])
    error = capsys.readouterr().err.strip().splitlines()
    assert code == 2
    assert error[-1].startswith("raypipe: error: ") and str(path) in error[-1]
    assert "Traceback" not in "\n".join(error)


def test_the_temp_sweep_touches_only_raypipes_own_temp_names(tmp_path, corpus_dir,
                                                             tokenizer_path):
    from raypipe.config import load_config
    from raypipe.preprocess.job import run_job

    output = tmp_path / "out"
    config = load_config(None, inputs=[str(corpus_dir)], output=str(output),
                         tokenizer=tokenizer_path)
    run_job(config)
    mine = output / ".notes.tmp"
    mine.write_text("the user's")
    stale = output / "megatron" / ".x.bin.123.raypipe.tmp"
    stale.write_bytes(b"left by a killed writer")
    run_job(config)
    assert mine.read_text() == "the user's" and not stale.exists()


@pytest.mark.parametrize("edit,named", [
    (lambda s: s["history"][0].update(step=3), "field 'history': legs from steps [3]"),
    (lambda s: s["history"][0].update(world_size=0), "world size >= 1"),
    (lambda s: s["history"][0]["stage_weights"][0].pop("code"), "each stage weighing"),
    (lambda s: s["history"][0].update(batches=[[2, 4, 16]]), "batches begin at step 0"),
    (lambda s: s.update(views={**s["views"], "gone": "k"}), "'views' names source 'gone'"),
])
def test_a_mixture_state_s_legs_and_records_are_checked_naming_the_field(
        token_dataset, rich_dataset, edit, named):
    """A mixture state's history of legs, and the sources its records name, are checked
    on load: a hand-edited one is one StateError naming what is wrong."""
    from raypipe.loader import MixtureLoader

    paths = {"web": str(token_dataset), "code": str(rich_dataset)}
    state = MixtureLoader(paths, 16, 2, mode="documents").state_dict()
    edit(state)
    with pytest.raises(StateError, match=re.escape(named)):
        MixtureLoader(paths, 16, 2, mode="documents").load_state_dict(state)
