"""The tokenize job as a Ray Data job (local Ray, 2 CPUs): a user's ray.data.Dataset in,
JSON lines through Ray, resume by block, the execution plan in Ray's ray-data log."""

from __future__ import annotations

import gzip
import json
from pathlib import Path

import pytest

import raypipe
from raypipe.dataset import TokenDataset
from raypipe.errors import InputError
from tests.conftest import write_parquet
from tests.helpers import file_identities, shard_files

pytestmark = pytest.mark.ray


def keep_short(row: dict) -> bool:
    return row["text"] is not None and len(row["text"]) < 400


def filtered_dataset(ray_session, corpus_dir: Path):
    """A user's pipeline: read parquet, drop long documents, add a column."""
    import ray.data

    return (ray.data.read_parquet(str(corpus_dir))
            .filter(keep_short)
            .map(lambda row: {**row, "chars": len(row["text"])})
            .repartition(5))  # small files read as one block: 5 blocks, 5 units


def expected_of(dataset, tokenizer_path: str) -> list[list[int]]:
    """The Dataset's documents as a megatron-only job writes them: EOS after each."""
    from tokenizers import Tokenizer

    tokenizer = Tokenizer.from_file(tokenizer_path)
    eos = tokenizer.token_to_id("<|eos|>")
    dataset.context.execution_options.preserve_order = True  # the order the job keeps
    return [[*tokenizer.encode(row["text"], add_special_tokens=False).ids, eos]
            for row in dataset.iter_rows() if row["text"]]


@pytest.mark.slow
def test_a_filtered_dataset_yields_exactly_its_documents_at_any_concurrency(
        ray_session, tmp_path, corpus_dir, tokenizer_path):
    indexed = pytest.importorskip("megatron.core.datasets.indexed_dataset")
    dataset = filtered_dataset(ray_session, corpus_dir)
    expected = expected_of(dataset, tokenizer_path)
    outputs = {}
    for workers in (1, 2):
        output = tmp_path / f"w{workers}"
        summary = raypipe.tokenize(dataset, str(output), tokenizer_path, formats="megatron",
                                   num_workers=workers)
        assert summary.documents == len(expected) and summary.units_run == summary.units > 1
        assert "blocks" in summary.render()
        outputs[workers] = shard_files(output)
    assert outputs[1] == outputs[2]
    got = [document.tolist() for document in TokenDataset(tmp_path / "w2").iter_documents()]
    assert got == expected
    manifest = json.loads((tmp_path / "w2" / "manifest.json").read_text())
    shards = [shard["name"] for shard in manifest["formats"]["megatron"]["shards"]]
    read = [document.tolist() for name in shards
            for document in indexed.IndexedDataset(str(tmp_path / "w2" / "megatron" / name))]
    assert read == expected  # megatron-core opens every shard, blocks in the Dataset's order


@pytest.mark.slow
def test_a_rerun_skips_committed_blocks_and_rewrites_changed_ones(ray_session, tmp_path,
                                                                  corpus_dir, tokenizer_path):
    import ray.data

    output = tmp_path / "out"
    dataset = ray.data.read_parquet(str(corpus_dir)).repartition(6)
    first = raypipe.tokenize(dataset, str(output), tokenizer_path, formats="megatron")
    before = file_identities(output / "megatron")
    again = raypipe.tokenize(dataset, str(output), tokenizer_path, formats="megatron")
    assert again.units == first.units and again.units_run == 0
    assert file_identities(output / "megatron") == before
    # the user's pipeline changes: blocks whose rows changed are rewritten, the others kept
    narrower = ray.data.read_parquet(str(corpus_dir)).filter(keep_short).repartition(6)
    changed = raypipe.tokenize(narrower, str(output), tokenizer_path, formats="megatron")
    assert changed.units_run >= 1 and changed.units_removed >= 1
    fresh = tmp_path / "fresh"
    raypipe.tokenize(narrower, str(fresh), tokenizer_path, formats="megatron")
    assert shard_files(output) == shard_files(fresh)
    assert sorted(p.name for p in (output / "_units").iterdir()) == \
        sorted(p.name for p in (fresh / "_units").iterdir())


def test_a_dataset_without_the_text_column_is_refused_naming_its_columns(
        ray_session, tmp_path, tokenizer_path):
    import ray.data

    dataset = ray.data.from_items([{"body": "a"}, {"body": "b"}])
    with pytest.raises(InputError, match=r"ray.data.Dataset: text column 'text' not found; "
                                         r"available columns: \['body'\]"):
        raypipe.tokenize(dataset, str(tmp_path / "out"), tokenizer_path)
    assert not (tmp_path / "out" / "manifest.json").exists()


def test_jsonl_gz_and_zst_on_ray_match_the_parquet_run(ray_session, tmp_path, corpus_texts,
                                                       tokenizer_path):
    import pyarrow as pa

    texts = corpus_texts[:400]
    write_parquet(tmp_path / "parquet" / "part.parquet", texts)
    lines = b"".join(json.dumps({"text": t}).encode() + b"\n" for t in texts)
    (tmp_path / "gz").mkdir()
    (tmp_path / "gz" / "part.jsonl.gz").write_bytes(gzip.compress(lines))
    (tmp_path / "zst").mkdir()
    with pa.CompressedOutputStream(str(tmp_path / "zst" / "part.jsonl.zst"), "zstd") as out:
        out.write(lines)
    documents = {}
    for name in ("parquet", "gz", "zst"):
        raypipe.tokenize(str(tmp_path / name), str(tmp_path / f"out-{name}"), tokenizer_path,
                         formats="megatron")
        documents[name] = [d.tolist() for d in TokenDataset(tmp_path / f"out-{name}")
                           .iter_documents()]
    assert documents["gz"] == documents["zst"] == documents["parquet"]
    assert len(documents["parquet"]) == sum(1 for t in texts if t)


def test_the_execution_plan_of_the_tokenize_stage_is_in_rays_data_log(ray_session, tmp_path,
                                                                      corpus_dir,
                                                                      tokenizer_path):
    from ray._private.worker import global_worker

    raypipe.tokenize(str(corpus_dir), str(tmp_path / "out"), tokenizer_path,
                     formats="megatron", unit_bytes=1)
    logs = Path(global_worker.node.get_session_dir_path()) / "logs" / "ray-data"
    text = "".join(path.read_text() for path in logs.glob("ray-data*.log"))
    assert "Execution plan of Dataset" in text
    assert "TaskPoolMapOperator[MapBatches(tokenize_units)]" in text


DRIVER = """
import sys
from raypipe.config import load_config
from raypipe.ray.executor import run_on_ray as run_tokenize
corpus, output, tokenizer = sys.argv[1:4]
run_tokenize(load_config(None, inputs=[corpus], output=output, tokenizer=tokenizer,
                         unit_bytes=1, num_workers=2, encode_batch_rows=16))
"""


@pytest.mark.slow
def test_a_driver_killed_mid_job_then_rerun_gives_the_clean_runs_bytes(
        ray_session, tmp_path, corpus_dir, tokenizer_path):
    import os
    import signal
    import subprocess
    import sys
    import tempfile
    import time

    from raypipe.ray.executor import run_on_ray as run_tokenize
    from tests.test_reliability import config_for

    clean, output = tmp_path / "clean", tmp_path / "out"
    run_tokenize(config_for(corpus_dir, clean, tokenizer_path, formats=["megatron",
                                                                       "nanogpt"]))
    env = {**os.environ, "RAY_TMPDIR": tempfile.mkdtemp(prefix="t-", dir=os.environ["RAY_TMPDIR"])}
    env.pop("RAY_ADDRESS", None)
    driver = subprocess.Popen([sys.executable, "-c", DRIVER, str(corpus_dir), str(output),
                               tokenizer_path], env=env, start_new_session=True,
                              stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    try:
        deadline = time.monotonic() + 120
        while len(list((output / "_units").glob("part-*.json"))) < 3:
            assert driver.poll() is None, "the job ended before it could be killed"
            assert time.monotonic() < deadline, "no unit committed in 120 s"
            time.sleep(0.05)
    finally:
        os.killpg(driver.pid, signal.SIGKILL)  # the driver and the Ray it started
        driver.wait()
    committed = len(list((output / "_units").glob("part-*.json")))
    assert not (output / "manifest.json").exists()
    summary = run_tokenize(config_for(corpus_dir, output, tokenizer_path,
                                      formats=["megatron", "nanogpt"]))
    assert summary.units_run <= summary.units - committed
    assert shard_files(output) == shard_files(clean)
    assert sorted(p.name for p in output.rglob("*.tmp")) == []


@pytest.mark.slow
def test_a_dataset_of_conversations_tokenizes_with_its_loss_mask(ray_session, tmp_path,
                                                                 tokenizer_path):
    """A Ray Dataset with a `messages` column (list of structs) under --chat: its
    conversations in the Dataset's order, ids and masks as the chat encoder gives them."""
    from tokenizers import AddedToken, Tokenizer

    from raypipe.preprocess.chat import CHATML, ChatEncoder, ChatTemplate

    tokenizer = Tokenizer.from_file(tokenizer_path)
    tokenizer.add_special_tokens([AddedToken("<|im_start|>", special=True),
                                  AddedToken("<|im_end|>", special=True)])
    chat_tokenizer = tmp_path / "tokenizer.json"
    tokenizer.save(str(chat_tokenizer))
    rows = [{"messages": [{"role": "user", "content": f"question {index}?"},
                          {"role": "assistant", "content": f"answer {index}."}]}
            for index in range(40)]
    dataset = ray_session.data.from_items(rows, override_num_blocks=4)
    summary = raypipe.tokenize(dataset, str(tmp_path / "out"), str(chat_tokenizer),
                               chat=True)
    assert summary.documents == 40 and summary.units == 4
    encoder = ChatEncoder(tokenizer, ChatTemplate(CHATML, {}))
    want = [encoder.encode(row["messages"]) for row in rows]
    got = TokenDataset(tmp_path / "out")
    assert [d.tolist() for d in got.iter_documents()] == [w.ids.tolist() for w in want]
    assert [got.document_loss_mask(i).astype(bool).tolist() for i in range(40)] == \
        [w.trained.tolist() for w in want]


def test_a_dataset_job_runs_the_dataset_once_and_self_checks_on_its_own_rows(
        ray_session, tmp_path, corpus_texts, tokenizer_path, monkeypatch):
    """No execution of the user's Dataset before the job's own: the column check reads
    the schema Ray Data knows without running it, and the self-check encodes the first rows
    of the first block a worker tokenizes (offered to the driver through the ledger)."""
    import ray.data

    from raypipe.preprocess import job as job_module
    from tests.test_ray_tokenize import ray_data_plans

    checked: list[list[str]] = []
    choose = job_module.choose_backend
    monkeypatch.setattr(job_module, "choose_backend", lambda requested, tokenizer, policy,
                        sample: checked.append(sample) or choose(requested, tokenizer,
                                                                 policy, sample))
    dataset = ray.data.from_items([{"text": text} for text in corpus_texts[:90]],
                                  override_num_blocks=3).map(
        lambda row: {"text": row["text"].upper()})
    before = ray_data_plans("Execution plan of Dataset")
    summary = raypipe.tokenize(dataset, str(tmp_path / "out"), tokenizer_path,
                               formats="megatron")
    plans = ray_data_plans("Execution plan of Dataset") - before
    assert len(plans) == 1 and plans <= ray_data_plans("MapBatches(tokenize_block)"), plans
    assert summary.units_run == summary.units >= 1
    assert len(checked) == 1 and checked[0], "the self-check got no text of the Dataset"
    uppercased = {row["text"] for row in dataset.take_all() if row["text"]}
    assert set(checked[0]) <= uppercased  # the Dataset's rows as its map made them
    again = raypipe.tokenize(dataset, str(tmp_path / "out"), tokenizer_path,
                             formats="megatron")
    assert again.units_run == 0 and len(checked) == 2 and checked[1] == []  # none tokenized


def test_a_dataset_whose_columns_are_known_only_by_running_it_is_refused_by_its_blocks(
        ray_session, tmp_path, tokenizer_path):
    """A map's output schema is unknown until the Dataset runs: the job runs it once, and
    its blocks refuse it, naming the columns they have; nothing is committed."""
    import ray.data

    from raypipe.errors import InputError

    dataset = ray.data.from_items([{"body": f"text {i}"} for i in range(20)]).map(
        lambda row: {"body": row["body"], "chars": len(row["body"])})
    assert dataset.schema(fetch_if_missing=False) is None  # what this test is about
    with pytest.raises(InputError, match=r"ray.data.Dataset: column\(s\) \['text'\] not found "
                                         r"in a block; available columns: \['body', 'chars'\]"):
        raypipe.tokenize(dataset, str(tmp_path / "out"), tokenizer_path)
    assert not (tmp_path / "out" / "manifest.json").exists()


def test_a_self_check_that_fails_on_the_first_block_s_rows_fails_the_dataset_job_with_its_error(
        ray_session, tmp_path, corpus_texts, tokenizer_path, monkeypatch):
    """The check waits for the rows a map task offers, fails on them; the task, waiting
    for the settings, fails for want of them; the job raises the check's own error, commits
    no unit, and no map task of it holds a CPU after it (free for what runs next)."""
    import time

    import ray.data

    from raypipe.errors import ConfigError
    from raypipe.preprocess import job as job_module

    offered: list[int] = []

    def failing_check(resolved, sample):
        offered.append(sample.num_rows)
        raise ConfigError("tokenizer_backend: the check's own words")

    monkeypatch.setattr(job_module, "with_backend", failing_check)
    dataset = ray.data.from_items([{"text": text} for text in corpus_texts[:40]])
    with pytest.raises(ConfigError, match="the check's own words"):
        raypipe.tokenize(dataset, str(tmp_path / "out"), tokenizer_path, formats="megatron")
    assert offered and offered[0] > 0  # it failed on the Dataset's rows
    assert not list((tmp_path / "out" / "_units").glob("block-*.json"))
    deadline = time.monotonic() + 20
    while ray_session.available_resources().get("CPU", 0) < 2 and time.monotonic() < deadline:
        time.sleep(0.2)
    assert ray_session.available_resources().get("CPU", 0) == 2, "a map task outlived the job"


def test_a_dataset_that_yields_no_block_is_refused_and_its_self_check_stops_waiting(
        ray_session, tmp_path, tokenizer_path):
    """No actor ever offers rows: the check stops waiting when the run ends, and the job
    fails in one line instead of hanging."""
    import threading
    import time

    import ray.data

    dataset = ray.data.range(0).map(lambda row: {"text": "never"})
    with pytest.raises(InputError, match=r"ray.data.Dataset: the Dataset yields no block"):
        raypipe.tokenize(dataset, str(tmp_path / "out"), tokenizer_path)
    assert not (tmp_path / "out" / "manifest.json").exists()
    deadline = time.monotonic() + 10
    while any(t.name == "raypipe-self-check" for t in threading.enumerate()) and \
            time.monotonic() < deadline:
        time.sleep(0.05)
    assert not [t for t in threading.enumerate() if t.name == "raypipe-self-check"]
