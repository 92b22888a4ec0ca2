"""Object storage end to end, against a real S3-protocol server (moto) on 127.0.0.1:
tokenize writes only objects, reruns change none, a killed job's rerun converges, verify
names a damaged object, the loader reads through a node-local cache (shared, bounded,
checked) and resumes exactly at another world size."""

from __future__ import annotations

import hashlib
import json
import logging
import os
import re
import shutil
import subprocess
import sys
import time
from pathlib import Path
from urllib.parse import urlparse

import numpy as np
import pytest

from bench.latency_proxy import LatencyProxy  # at collection: one thread compiles it
from raypipe.config import load_config
from raypipe.dataset import TokenDataset
from raypipe.errors import ConfigError, FormatError, StateError
from raypipe.formats import get_format
from raypipe.formats.megatron import MegatronReader
from raypipe.io.cache import ShardCache
from raypipe.io.manifest import read_manifest
from raypipe.io.store import Store
from raypipe.loader import TokenLoader
from raypipe.loader import mixing as mixing_module
from raypipe.loader.mixing import times_uniform
from raypipe.loader.stats import ADVICE_EVERY
from raypipe.preprocess.job import run_job
from raypipe.tools.verify import verify_dataset
from tests import test_state_harness as harness
from tests.helpers import upload_tree
from tests.test_chat_formats import every_mask_format  # noqa: F401
from tests.test_chat_job import chat_tokenizer_path, chats  # noqa: F401

ROOT = Path(__file__).resolve().parents[1]


def objects(uri: str) -> dict[str, tuple[int, int | None]]:
    """Every object under `uri`: relative key -> (size, modification time)."""
    store = Store(uri)
    return {name: store.info(name) for name in store.list_files()}


def tokenize_to(uri: str, corpus: Path, tokenizer: str, **overrides):
    config = load_config(None, inputs=[str(corpus)], output=uri, tokenizer=tokenizer,
                         shard_tokens=8_000, unit_bytes=40_000, **overrides)
    return run_job(config)


@pytest.fixture
def in_tmp_cwd(tmp_path, monkeypatch) -> Path:
    """Run from an empty directory, so a stray local directory named after a URI shows."""
    workdir = tmp_path / "cwd"
    workdir.mkdir()
    monkeypatch.chdir(workdir)
    return workdir


def test_tokenize_to_s3_writes_only_objects_and_a_rerun_changes_none(
        bucket, corpus_dir, tokenizer_path, in_tmp_cwd, tmp_path, figure):
    uri = f"s3://{bucket}/tokens"
    first = tokenize_to(uri, corpus_dir, tokenizer_path, formats=["megatron", "llmbatch"],
                        seq_len=33, batch_size=2)
    assert list(in_tmp_cwd.iterdir()) == [], "a local directory appeared in the cwd"
    before = objects(uri)
    manifest = read_manifest(uri)
    listed = {f.path for s in manifest.formats["megatron"].shards for f in s.files}
    assert listed <= set(before) and "manifest.json" in before
    assert not any(".raypipe.tmp" in name for name in before)
    store = Store(uri)
    for name in before:  # no endpoint or credential in any record
        if name.endswith((".json", ".yaml")):
            text = store.read_bytes(name).decode()
            assert os.environ["AWS_SECRET_ACCESS_KEY"] not in text, name
            assert os.environ["AWS_ENDPOINT_URL"] not in text, name
    second = tokenize_to(uri, corpus_dir, tokenizer_path, formats=["megatron", "llmbatch"],
                         seq_len=33, batch_size=2)
    assert second.units_run == 0 and second.tokens == first.tokens
    assert objects(uri) == before, "a no-op rerun rewrote objects"
    # the objects, downloaded, are a Megatron dataset holding the same tokens
    local = tmp_path / "downloaded"
    for name in listed:
        (local / name).parent.mkdir(parents=True, exist_ok=True)
        store.download(name, local / name)
    tokens = 0
    for shard in manifest.formats["megatron"].shards:
        reader = MegatronReader(local / shard.files[0].path[:-len(".bin")])
        assert reader.num_documents == shard.documents
        tokens += reader.num_tokens
    assert tokens == first.tokens
    figure("tokenize to s3", f"{first.units} units, {len(before)} objects, "
           f"{first.tokens:,} tokens; rerun ran {second.units_run} units, 0 objects changed")


def test_output_uris_raypipe_cannot_write_fail_without_a_local_directory(in_tmp_cwd,
                                                                        tokenizer_path):
    for output, words in (("s3:/bucket/out", "one slash"), ("nosuch://bucket/out",
                                                            "cannot open nosuch://")):
        with pytest.raises(ConfigError, match=words):
            Store(output)
    assert list(in_tmp_cwd.iterdir()) == []


@pytest.mark.slow
def test_killed_job_rerun_converges_to_the_same_objects(bucket, corpus_dir, tokenizer_path,
                                                        tmp_path, monkeypatch):
    clean, killed = f"s3://{bucket}/clean", f"s3://{bucket}/killed"
    staging = tmp_path / "staging"
    monkeypatch.setenv("RAYPIPE_STAGING_DIR", str(staging))
    tokenize_to(clean, corpus_dir, tokenizer_path)
    fault = {"point": "unit.rows", "action": "kill", "after_rows": 100,
             "marker": str(tmp_path / "fault-marker")}
    script = ("import sys; from raypipe.config import load_config; "
              "from raypipe.preprocess.job import run_job; "
              f"run_job(load_config(None, inputs=[{str(corpus_dir)!r}], output={killed!r}, "
              f"tokenizer={tokenizer_path!r}, shard_tokens=8_000, unit_bytes=40_000))")
    result = subprocess.run([sys.executable, "-c", script], cwd=tmp_path, timeout=300,
                            env={**os.environ, "RAYPIPE_TEST_FAULT": json.dumps(fault)})
    assert result.returncode == -9, "the fault did not kill the job"
    assert not Store(killed).exists("manifest.json")
    assert len(list(staging.iterdir())) == 1, "the killed job left no staging directory"
    summary = tokenize_to(killed, corpus_dir, tokenizer_path)
    assert summary.units_run >= 1
    assert list(staging.iterdir()) == [], "the dead job's staging directory was not swept"
    clean_store, killed_store = Store(clean), Store(killed)
    # (records, the manifest, and the bookkeeping of each run's progress: its live
    # manifests and their unit orders, which differ with the run's history)
    progress = ("_units/", "_live/", "_views/")
    shard_names = [n for n in clean_store.list_files() if not n.startswith(progress)
                   and n not in ("manifest.json", "config.yaml")]
    assert [n for n in killed_store.list_files() if n in shard_names or not (
        n.startswith(progress) or n in ("manifest.json", "config.yaml"))] == shard_names
    assert killed_store.read_json("_live/status.json")["state"] == "finished"
    for name in shard_names:
        assert killed_store.sha256(name) == clean_store.sha256(name), name
    assert read_manifest(killed).totals == read_manifest(clean).totals


def test_verify_passes_then_names_a_truncated_object(bucket, corpus_dir, tokenizer_path,
                                                     tmp_path):
    uri = f"s3://{bucket}/tokens"
    tokenize_to(uri, corpus_dir, tokenizer_path)
    counts = verify_dataset(uri, ShardCache(tmp_path / "cache"))
    assert counts.files > 0
    store = Store(uri)
    victim = read_manifest(uri).formats["megatron"].shards[1].files[0].path
    store.write_bytes(victim, store.read_bytes(victim)[:-7])
    with pytest.raises(FormatError) as caught:
        verify_dataset(uri, ShardCache(tmp_path / "cache2"))
    assert f"s3://{bucket}/tokens/{victim}" in str(caught.value)
    assert "size" in str(caught.value)


def test_verify_reads_each_object_once_and_rechecks_what_a_warm_cache_holds(
        bucket, corpus_dir, tokenizer_path, tmp_path, monkeypatch):
    from collections import Counter

    uri = f"s3://{bucket}/verify-once"
    tokenize_to(uri, corpus_dir, tokenizer_path)
    entries = [entry for section in read_manifest(uri).formats.values()
               for shard in section.shards for entry in shard.files]
    reads: Counter[str] = Counter()
    for method in ("sha256", "download", "read_bytes"):  # every way a Store reads an object
        real = getattr(Store, method)
        monkeypatch.setattr(Store, method, lambda self, relative, *rest, _real=real:
                            reads.update([relative]) or _real(self, relative, *rest))
    cache = ShardCache(tmp_path / "cache")
    assert verify_dataset(uri, cache).files == len(entries)
    assert {entry.path: reads[entry.path] for entry in entries} == {
        entry.path: 1 for entry in entries}
    # the cache now holds every file: verify still checks the bucket, not those copies
    store, victim = Store(uri), entries[-1]
    data = bytearray(store.read_bytes(victim.path))
    data[-1] ^= 0xFF  # same size, other contents
    store.write_bytes(victim.path, bytes(data))
    with pytest.raises(FormatError, match="sha256 differs") as caught:
        verify_dataset(uri, cache)
    assert store.uri_of(victim.path) in str(caught.value)


def test_cache_refuses_an_object_whose_checksum_differs(bucket, token_dataset, tmp_path):
    uri = f"s3://{bucket}/tokens"
    upload_tree(token_dataset, uri)
    manifest = read_manifest(uri)
    entry = manifest.formats["megatron"].shards[0].files[0]
    store = Store(uri)
    data = bytearray(store.read_bytes(entry.path))
    data[-1] ^= 0xFF  # same size, other contents
    store.write_bytes(entry.path, bytes(data))
    cache = ShardCache(tmp_path / "cache")
    with pytest.raises(FormatError, match="sha256 differs") as caught:
        cache.fetch(store, "key", entry)
    assert store.uri_of(entry.path) in str(caught.value)
    assert cache.cached_files() == [], "a refused object was cached"


@pytest.mark.slow
def test_loader_from_s3_resumes_exactly_at_other_world_sizes(bucket, rich_dataset, tmp_path,
                                                             monkeypatch):
    uri = f"s3://{bucket}/rich"
    upload_tree(rich_dataset, uri)
    monkeypatch.setenv("RAYPIPE_CACHE_DIR", str(tmp_path / "cache"))
    for mode in ("windows+metadata", "bestfit", "documents", "batches", "bestfit-shard-local"):
        harness.check_resume_1_2_3(uri, mode, first_stop=1, reference_path=rich_dataset)


def _fetch_every_file(store: Store, key: str, cache: ShardCache) -> list:
    manifest = read_manifest(store)
    entries = [f for s in manifest.formats["megatron"].shards for f in s.files]
    return [(entry, cache.fetch(store, key, entry)) for entry in entries]


def test_cache_evicts_least_recently_used_files_to_its_budget(bucket, token_dataset,
                                                              tmp_path):
    uri = f"s3://{bucket}/tokens"
    upload_tree(token_dataset, uri)
    store = Store(uri)
    entries = [f for s in read_manifest(uri).formats["megatron"].shards for f in s.files]
    total = sum(entry.bytes for entry in entries)
    budget = total // 3
    cache = ShardCache(tmp_path / "cache", budget)
    fetched = _fetch_every_file(store, "k", cache)
    assert cache.used_bytes() <= budget
    assert cache.stats.downloaded_bytes == total and cache.stats.evicted_files > 0
    newest = fetched[-1][1]
    assert newest.exists(), "the file just fetched was evicted"
    oldest_entry, oldest = fetched[0]
    assert not oldest.exists(), "the least recently used file survived"
    cache.pin([newest])
    again = cache.fetch(store, "k", oldest_entry)  # evicted: downloaded again, checked
    assert again.read_bytes() == store.read_bytes(oldest_entry.path)
    assert newest.exists(), "a pinned file was evicted"


def test_a_shard_another_process_evicts_between_its_fetch_and_its_open_is_fetched_again(
        bucket, token_dataset, tmp_path):
    """A shard prefetched here and deleted by another process's eviction that did not see
    this process's pins (one in another pid namespace, or one that read the pin lists
    before the shard was pinned) before this one opened it is fetched again, not a `file is
    missing` error, and the refetch is counted."""
    uri = f"s3://{bucket}/tokens"
    upload_tree(token_dataset, uri)
    cache_dir = tmp_path / "shared-cache"
    here = TokenDataset(uri, "megatron", cache=ShardCache(cache_dir))
    here.prefetch([0])
    fetched = here._fetching[0].result()  # fetched and pinned, not yet opened
    for path in fetched:  # what such an eviction does
        path.unlink()
    documents = [document.tolist() for document in here.iter_documents()]
    local = TokenDataset(token_dataset, "megatron")
    assert documents == [document.tolist() for document in local.iter_documents()]
    assert here.cache.stats.lost_before_open == len(here.shards[0].files)
    here.close()


SHARED_CACHE_READER = """
import sys, hashlib
from raypipe.loader import TokenLoader
from raypipe.loader import mixing as mixing_module
from raypipe.loader.mixing import times_uniform
from raypipe.loader.stats import ADVICE_EVERY
loader = TokenLoader(sys.argv[1], 32, 4, mode="bestfit", cache_dir=sys.argv[2], seed=3)
digest = hashlib.sha256()
for batch in loader:
    digest.update(batch.inputs.numpy().tobytes())
print(digest.hexdigest(), loader.cache_stats.downloads)
"""


def test_two_processes_share_one_cache_without_corrupting_it(bucket, token_dataset,
                                                             tmp_path):
    uri = f"s3://{bucket}/tokens"
    upload_tree(token_dataset, uri)
    cache_dir = tmp_path / "shared-cache"
    readers = [subprocess.Popen([sys.executable, "-c", SHARED_CACHE_READER, uri,
                                 str(cache_dir)], stdout=subprocess.PIPE, text=True,
                                cwd=ROOT) for _ in range(2)]
    outputs = [reader.communicate(timeout=300)[0].split() for reader in readers]
    assert all(reader.returncode == 0 for reader in readers)
    local = TokenLoader(token_dataset, 32, 4, mode="bestfit", seed=3, shuffle="windowed")
    import hashlib
    digest = hashlib.sha256()
    for batch in local:
        digest.update(batch.inputs.numpy().tobytes())
    assert outputs[0][0] == outputs[1][0] == digest.hexdigest()
    shards = read_manifest(uri).formats["megatron"].shards
    entries = [f for s in shards for f in s.files]
    # each of a shard's three objects read once: its .sums whole, its .idx's lengths by
    # range at the open, its tokens as the range of its one block (a shard under 4 MiB)
    assert len(entries) == 3 * len(shards)
    assert sum(int(o[1]) for o in outputs) == len(entries), \
        "a file was downloaded by both processes"
    cached = ShardCache(cache_dir).cached_files()
    assert len(cached) == len(entries)
    assert not list(cache_dir.rglob("*.raypipe.tmp"))


class FlipsAByte(Store):
    """The real bucket, with the first `copies` downloads arriving with one byte flipped
    (a transfer that came back wrong without an error)."""

    def __init__(self, uri: str, copies: int):
        super().__init__(uri)
        self.flipped_left, self.downloads = copies, 0

    def _download_once(self, relative, target):
        size, digest = super()._download_once(relative, target)
        self.downloads += 1
        if self.flipped_left:
            self.flipped_left -= 1
            data = bytearray(target.read_bytes())
            data[0] ^= 0xFF
            target.write_bytes(bytes(data))
            digest = hashlib.sha256(data).hexdigest()
        return size, digest


def test_a_copy_that_arrives_wrong_is_fetched_again_and_one_that_stays_wrong_is_refused(
        bucket, token_dataset, tmp_path):
    uri = f"s3://{bucket}/tokens"
    upload_tree(token_dataset, uri)
    entry = read_manifest(uri).formats["megatron"].shards[0].files[0]
    once = FlipsAByte(uri, copies=1)
    cache = ShardCache(tmp_path / "cache", 10**9)
    path = cache.fetch(once, "k", entry)
    assert once.downloads == 2 and cache.stats.retries == 1
    assert path.read_bytes() == (token_dataset / entry.path).read_bytes()
    always = FlipsAByte(uri, copies=10)
    with pytest.raises(FormatError, match="sha256 differs from the manifest") as refused:
        ShardCache(tmp_path / "other", 10**9).fetch(always, "k", entry)
    assert entry.path in str(refused.value) and always.downloads == 2
    assert not list((tmp_path / "other").rglob("*.bin"))  # nothing wrong was cached


PINNING_PROCESS = """
import sys
from pathlib import Path
from raypipe.io.cache import ShardCache
cache = ShardCache(sys.argv[1], 10**9)
cache.pin([Path(sys.argv[2])])
print("pinned", flush=True)
sys.stdin.read()
"""


def test_eviction_keeps_a_file_another_process_of_the_node_pinned(tmp_path):
    """A rank's pins are kept by every rank's eviction (the file it fetched ahead and has
    not opened yet is not deleted under it); once that process ends its pins go too."""
    folder = tmp_path / "cache" / "dataset"
    folder.mkdir(parents=True)
    theirs, mine = folder / "a.bin", folder / "b.bin"
    for age, path in enumerate((theirs, mine)):
        path.write_bytes(b"x" * 1000)
        os.utime(path, (1000 + age, 1000 + age))  # theirs is the least recently used
    pinning = subprocess.Popen([sys.executable, "-c", PINNING_PROCESS, str(tmp_path / "cache"),
                                str(theirs)], stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                               text=True, cwd=ROOT)
    try:
        assert pinning.stdout.readline().strip() == "pinned"
        cache = ShardCache(tmp_path / "cache", 1500)
        cache.evict()
        assert theirs.exists() and not mine.exists()  # the other process's pin held
    finally:
        pinning.communicate("", timeout=60)
    mine.write_bytes(b"x" * 1000)
    cache.evict()
    assert not theirs.exists() and mine.exists()  # its process ended: its pins went too
    assert not list((tmp_path / "cache" / ".locks").glob("pins-*"))


def test_eviction_keeps_a_file_another_cache_of_the_same_process_pinned(tmp_path):
    """A mixture's sources each have a cache object over the node's one directory: what one
    pinned (a block fetched ahead, not read yet) is kept by the other's eviction (both once
    wrote one pins list a process, the last writer's pins alone, and an eviction skipped
    its own process's list, so a source's blocks were deleted under it); once that cache
    object goes, its pins go too."""
    import gc

    folder = tmp_path / "cache" / "dataset"
    folder.mkdir(parents=True)
    theirs, mine = folder / "a.bin", folder / "b.bin"
    for age, path in enumerate((theirs, mine)):
        path.write_bytes(b"x" * 1000)
        os.utime(path, (1000 + age, 1000 + age))  # theirs is the least recently used
    pinning, evicting = ShardCache(tmp_path / "cache", 1500), ShardCache(tmp_path / "cache", 1500)
    pinning.pin([theirs])
    evicting.pin([mine])
    evicting.unpin([mine])
    evicting.evict()
    assert theirs.exists() and not mine.exists()
    del pinning
    gc.collect()
    mine.write_bytes(b"x" * 1000)
    evicting.evict()
    assert not theirs.exists() and mine.exists()


def test_shard_local_shuffle_downloads_each_shard_once_per_epoch(bucket, token_dataset,
                                                                 tmp_path, figure, caplog):
    uri = f"s3://{bucket}/tokens"
    upload_tree(token_dataset, uri)
    entries = [f for s in read_manifest(uri).formats["megatron"].shards for f in s.files]
    data_bytes = sum(e.bytes for e in entries)
    shards = read_manifest(uri).formats["megatron"].shards
    largest = max(sum(f.bytes for f in shard.files) for shard in shards)
    assert len(shards) >= 5
    downloaded, said_at_open, steps_taken = {}, {}, {}
    caplog.set_level(logging.WARNING, logger="raypipe")
    for shuffle in ("global", "shard_local", "auto"):
        caplog.clear()
        given = ({} if shuffle == "auto" else {"shuffle": shuffle, "group_shards": 1}
                 if shuffle == "shard_local" else {"shuffle": shuffle})
        loader = TokenLoader(uri, 32, 4, mode="windows", cache_dir=tmp_path / shuffle,
                             cache_bytes=2 * largest, **given)
        said_at_open[shuffle] = caplog.text
        if shuffle == "auto":  # the default on a bucket the cache cannot hold: groups that
            # fit it (the group read and the next: one shard each here), recorded in the state
            assert (loader.spec.shuffle, loader.spec.group_shards) == ("shard_local", 1)
            knobs = loader.state_dict()["knobs"]
            assert (knobs["shuffle"], knobs["group_shards"]) == ("shard_local", 1)
        steps = 0
        for _ in loader:
            steps += 1
            if shuffle == "global" and loader.cache_stats.downloaded_bytes > data_bytes:
                break  # already past what a shard-local epoch fetches: the rest is time
        assert steps > 0
        downloaded[shuffle], steps_taken[shuffle] = loader.cache_stats.downloaded_bytes, steps
        loader.close()
        # global over a dataset the cache cannot hold is said before the epoch, with what
        # fetches each shard once; shard-local groups that fit are not warned about
        warned = "fetched many times" in said_at_open[shuffle]
        assert warned == (shuffle == "global"), said_at_open[shuffle]
    # the remedy named fits the budget: a group of one shard (the group read and the next)
    assert "shuffle='shard_local' with group_shards=1 " in said_at_open["global"]
    assert downloaded["shard_local"] == data_bytes, "a shard was fetched twice in one epoch"
    assert downloaded["auto"] == data_bytes, "auto fetched a shard twice in one epoch"
    # global fetched more than the whole dataset before its epoch was half over
    assert downloaded["global"] > downloaded["shard_local"]
    assert steps_taken["global"] < steps_taken["shard_local"] / 2
    figure("bytes downloaded per epoch / dataset",
           f"global passes 1.00x after {steps_taken['global']} of "
           f"{steps_taken['shard_local']} steps, shard-local "
           f"{downloaded['shard_local'] / data_bytes:.2f}x, auto (shard-local) "
           f"{downloaded['auto'] / data_bytes:.2f}x (mode windows, a cache of 2 of "
           f"{len(shards)} shards)")


@pytest.mark.parametrize("fmt", ["megatron", "nanogpt", "stream", "mds"])
def test_lengths_on_a_bucket_come_from_the_index_files_alone(bucket, corpus_dir,
                                                             tokenizer_path, tmp_path, fmt,
                                                             figure):
    """Every rank reads every shard's lengths when it opens: for Megatron the lengths'
    range of each `.idx` (4 of its 20 bytes a document), for NanoGPT the `.bos.idx` files
    (~4 bytes a document), for stream and MDS the `.lengths` sidecars (with the `.sums`
    the blocks' reads need), not every token file of the dataset; and they are the lengths
    the readers find."""
    local = tmp_path / "local"
    tokenize_to(str(local), corpus_dir, tokenizer_path, formats=[fmt], bos=True)
    uri = f"s3://{bucket}/tokens"
    upload_tree(local, uri)
    shards = read_manifest(uri).formats[fmt].shards
    index_files = sum(f.bytes for shard in shards for f in shard.files
                      if f.path.endswith(get_format(fmt).index_suffixes))
    index_bytes = TokenDataset(local, fmt).index_bytes_read
    assert index_bytes < index_files if fmt == "megatron" else index_bytes == index_files
    cache = ShardCache(tmp_path / "c")
    lengths = TokenDataset(uri, fmt, cache=cache).document_lengths()
    assert cache.stats.downloaded_bytes == index_bytes, "token files fetched for lengths"
    data_bytes = sum(f.bytes for s in shards for f in s.files)
    assert len(shards) > 1 and index_bytes < data_bytes / 4
    figure(f"{fmt} lengths from a bucket", f"{index_bytes:,} bytes fetched of a "
           f"{data_bytes:,}-byte dataset ({index_bytes / data_bytes:.1%}; its index files "
           f"whole: {index_files:,})")
    on_disk = TokenDataset(local, fmt)
    from_tokens = np.concatenate([on_disk.reader(i).document_lengths
                                  for i in range(on_disk.num_shards)])
    assert np.array_equal(lengths, from_tokens)


def test_a_megatron_idx_whose_lengths_differ_from_the_manifest_is_refused_naming_it(
        bucket, token_dataset, tmp_path):
    """The lengths a bucket loader reads by range from a `.idx` are checked against the
    manifest's documents and tokens: one altered is refused at the open, naming the file."""
    uri = f"s3://{bucket}/tokens"
    upload_tree(token_dataset, uri)
    store = Store(uri)
    victim = read_manifest(uri).formats["megatron"].shards[1].files[1].path
    assert victim.endswith(".idx")
    data = bytearray(store.read_bytes(victim))
    data[34] ^= 0x01  # the first document's length
    store.write_bytes(victim, bytes(data))
    with pytest.raises(FormatError) as refused:
        TokenDataset(uri, "megatron", cache=ShardCache(tmp_path / "c")).document_lengths()
    assert store.uri_of(victim) in str(refused.value)
    assert "against the manifest's documents and tokens" in str(refused.value)


# the document formats a bucket loader reads a block at a time (ranged GETs)
RANGED_FORMATS = ["megatron", "nanogpt", "stream", "mds"]


def dataset_of(request, fmt: str) -> Path:
    """The test output holding `fmt`: token_dataset, stream_dataset or mds_dataset (the
    same corpus)."""
    return request.getfixturevalue({"stream": "stream_dataset", "mds": "mds_dataset"}.get(
        fmt, "token_dataset"))


def unread_header_bytes(fmt: str, shards: list, root: Path) -> int:
    """The bytes of a format's token files that blocks leave out: a fixed header (NanoGPT),
    or the header before the first sample (MDS: its offsets sidecar's first entry)."""
    samples = get_format(fmt).samples
    if samples is None:
        return get_format(fmt).tokens_at * len(shards)
    return sum(int(np.fromfile(root / f.path, "<u4")[0]) for shard in shards
               for f in shard.files if f.path.endswith(samples.offsets_suffix))


@pytest.mark.parametrize("fmt", RANGED_FORMATS)
def test_bucket_loader_resolves_auto_to_windowed_and_fetches_each_block_once_per_epoch(
        bucket, request, tmp_path, fmt):
    token_dataset = dataset_of(request, fmt)
    uri = f"s3://{bucket}/tokens"
    upload_tree(token_dataset, uri)
    shards = read_manifest(uri).formats[fmt].shards
    index_suffixes = get_format(fmt).index_suffixes
    token_file = get_format(fmt).suffixes[0]  # stream's metadata files: never read
    # the token files, and what the open reads of the index (Megatron's .idx: its lengths)
    data_bytes = (sum(f.bytes for shard in shards for f in shard.files
                      if f.path.endswith(token_file))
                  + TokenDataset(token_dataset, fmt).index_bytes_read)
    largest = max(sum(f.bytes for f in shard.files) for shard in shards)
    loader = TokenLoader(uri, 32, 4, seed=5, window_blocks=1, cache_dir=tmp_path / "c",
                         cache_bytes=3 * largest, format=fmt)
    assert loader.spec.shuffle == "windowed" and len(shards) >= 5
    served = [batch.inputs.numpy().tobytes() for batch in loader]
    fetched = loader.cache_stats.downloaded_bytes
    state = loader.state_dict()
    loader.close()
    # every block once, though the cache holds 3 shards (a ranged block leaves a header
    # out); the index files are read twice at most (once for the lengths at the open)
    index_bytes = sum(f.bytes for shard in shards for f in shard.files
                      if f.path.endswith(index_suffixes))
    headers = unread_header_bytes(fmt, shards, token_dataset)
    assert data_bytes - headers <= fetched <= data_bytes + index_bytes
    assert state["knobs"]["shuffle"] == "windowed"
    metrics = loader.stats.metrics()
    assert metrics["fetched_bytes"] == fetched and metrics["cache_budget_bytes"] == 3 * largest
    assert 0 < metrics["cache_used_bytes"] <= 3 * largest and "data_wait_p99_ms" in metrics
    assert loader.cache_stats.ranged_reads > 0  # blocks smaller than a shard: ranges
    # the local copy under the same budget cuts the same blocks: the same batches
    local = TokenLoader(token_dataset, 32, 4, seed=5, shuffle="windowed", window_blocks=1,
                        cache_bytes=3 * largest, format=fmt)
    assert local.spec.shuffle == "windowed"
    assert local.spec.block_bytes == loader.spec.block_bytes
    assert [batch.inputs.numpy().tobytes() for batch in local] == served
    assert TokenLoader(token_dataset, 32, 4, format=fmt).spec.shuffle == "global"  # locally


@pytest.mark.parametrize("fmt", RANGED_FORMATS)
def test_shards_of_one_block_are_each_one_ranged_read_checked_by_their_sums(
        bucket, request, tmp_path, fmt):
    """Blocks larger than the shards (a large cache over small shards) make each shard one
    block: its token file comes in one ranged GET, checked by its .sums as every block is,
    not as whole files (a HEAD and a GET for each of them); the batches equal the local
    copy's. Megatron, NanoGPT, stream and MDS alike."""
    token_dataset = dataset_of(request, fmt)
    uri = f"s3://{bucket}/tokens"
    upload_tree(token_dataset, uri)
    shards = read_manifest(uri).formats[fmt].shards
    token_file = get_format(fmt).suffixes[0]
    largest = max(f.bytes for shard in shards for f in shard.files
                  if f.path.endswith(token_file))
    knobs = {"seed": 5, "shuffle": "windowed", "block_bytes": -(-largest // 4096) * 4096,
             "window_blocks": 2, "cache_bytes": 1 << 30, "format": fmt}
    loader = TokenLoader(uri, 32, 4, cache_dir=tmp_path / "c", **knobs)
    served = [batch.inputs.numpy().tobytes() for batch in loader]
    loader.close()
    cached = [path.name for path in (tmp_path / "c").rglob(f"*{token_file}*")]
    assert len(loader.run.planned.plans.blocks()) == len(shards) > 2
    assert not [name for name in cached if name.endswith(token_file)]  # none whole
    assert len([name for name in cached if f"{token_file}.range-" in name]) == len(shards)
    local = TokenLoader(token_dataset, 32, 4, **knobs)
    assert [batch.inputs.numpy().tobytes() for batch in local] == served


def test_bucket_loader_under_auto_resumes_a_global_state_as_global(bucket, token_dataset,
                                                                   tmp_path):
    """A state of 0.6 (no shuffle recorded: global) resumes on the bucket as global, not
    under the windowed shuffle auto picks for a new run."""
    uri = f"s3://{bucket}/tokens"
    upload_tree(token_dataset, uri)
    local = TokenLoader(token_dataset, 32, 4, seed=5)
    batches = iter(local)
    next(batches)
    state = local.state_dict()
    assert "shuffle" not in state["knobs"]  # global: recorded as a 0.6 state records it
    expected = [batch.inputs.numpy().tobytes() for batch in batches]
    resumed = TokenLoader(uri, 32, 4, seed=5, cache_dir=tmp_path / "c")
    assert resumed.spec.shuffle == "windowed"
    planned = resumed.run.planned
    resumed.load_state_dict(state)
    assert resumed.spec.shuffle == "global" and resumed.run.planned is planned
    assert [batch.inputs.numpy().tobytes() for batch in resumed] == expected
    with pytest.raises(StateError, match="shuffle: saved 'global', now 'windowed'"):
        TokenLoader(uri, 32, 4, seed=5, shuffle="windowed",
                    cache_dir=tmp_path / "c").load_state_dict(state)


@pytest.mark.ray
@pytest.mark.slow
def test_ray_workers_upload_the_same_shards_a_local_run_writes(ray_session, bucket,
                                                               corpus_dir, tokenizer_path,
                                                               tmp_path, in_tmp_cwd):
    from raypipe.ray.executor import run_on_ray as run_tokenize
    from tests.helpers import shard_files

    uri = f"s3://{bucket}/tokens"
    config = load_config(None, inputs=[str(corpus_dir)], output=uri, tokenizer=tokenizer_path,
                         unit_bytes=1, num_workers=2)
    summary = run_tokenize(config)
    assert summary.units_run == summary.units > 2
    local = tmp_path / "local"
    run_job(load_config(None, inputs=[str(corpus_dir)], output=str(local),
                        tokenizer=tokenizer_path, unit_bytes=1))
    store = Store(uri)
    expected = shard_files(local)
    assert {name: store.read_bytes(name) for name in expected} == expected
    assert list(in_tmp_cwd.iterdir()) == []


def test_inspect_pack_report_and_convert_take_uris(bucket, token_dataset, tmp_path, capsys,
                                                   monkeypatch):
    from raypipe.cli import main
    from raypipe.dataset import TokenDataset

    monkeypatch.setenv("RAYPIPE_CACHE_DIR", str(tmp_path / "cache"))
    uri = upload_tree(token_dataset, f"s3://{bucket}/tokens")
    assert main(["inspect", uri, "--samples", "1"]) == 0
    assert f"dataset {uri}" in capsys.readouterr().out
    assert main(["pack-report", uri, "--seq-len", "64", "--shuffle", "shard_local"]) == 0
    report = capsys.readouterr().out
    assert "shard_local shuffle" in report and "trained" in report
    converted = f"s3://{bucket}/as-nanogpt"
    assert main(["convert", uri, converted, "--format", "nanogpt"]) == 0
    assert main(["verify", converted]) == 0
    got = [d.tolist() for d in TokenDataset(converted).iter_documents()]
    assert got == [d.tolist() for d in TokenDataset(token_dataset).iter_documents()]


def test_a_missing_bucket_is_one_line_naming_the_uri_and_the_bucket(
        s3_server, tmp_path, corpus_dir, tokenizer_path, capsys):
    """Writing to, or reading from, a bucket that does not exist: one line naming the URI
    and the bucket, not the SDK's whole error with its request id."""
    from raypipe.cli import main

    code = main(["tokenize", str(corpus_dir), "--tokenizer", tokenizer_path, "--output",
                 "s3://no-such-bucket-rp/out", "--num-workers", "1"])
    error = capsys.readouterr().err
    assert code == 2 and "s3://no-such-bucket-rp/out" in error
    assert "bucket 'no-such-bucket-rp' does not exist" in error and "Request ID" not in error
    assert len(error.strip().splitlines()) == 1
    assert main(["inspect", "s3://no-such-bucket-rp/out"]) == 2
    error = capsys.readouterr().err
    assert "bucket 'no-such-bucket-rp' does not exist" in error
    assert len(error.strip().splitlines()) == 1


def through_a_fault_proxy(monkeypatch, fails, resets=None):
    """AWS_ENDPOINT_URL pointed at the bench's loopback proxy in front of the test server,
    answering the GETs `fails` picks with 503 SlowDown and resetting those `resets` picks
    (a Store made after this call opens its filesystem there)."""
    from raypipe.io import store as store_module

    proxy = LatencyProxy(urlparse(os.environ["AWS_ENDPOINT_URL"]).port, 0, fails,
                         resets).start()
    monkeypatch.setenv("AWS_ENDPOINT_URL", proxy.url)
    monkeypatch.setattr(store_module, "RETRY_SECONDS", 0.01)
    return proxy


def test_a_503_slow_down_on_every_objects_first_get_is_retried_and_counted(
        bucket, token_dataset, tmp_path, monkeypatch):
    """A bucket that throttles the first GET of every object (small ones included, whose
    503 body is longer than the object): every shard still arrives whole, the documents
    are the local copy's, and the retries are counted in the cache's stats."""
    uri = f"s3://{bucket}/tokens"
    upload_tree(token_dataset, uri)
    proxy = through_a_fault_proxy(monkeypatch, lambda path, asked: asked == 0)
    try:
        remote = TokenDataset(uri, "megatron", cache=ShardCache(tmp_path / "cache"))
        documents = [document.tolist() for document in remote.iter_documents()]
        stats = remote.cache.stats
        remote.close()
    finally:
        proxy.stop()
    local = TokenDataset(token_dataset, "megatron")
    assert documents == [document.tolist() for document in local.iter_documents()]
    files = sum(len(shard.files) for shard in local.shards)
    assert stats.downloads == files and proxy.injected >= files
    assert 0 < stats.retries <= proxy.injected


def test_an_object_that_keeps_failing_fails_in_one_line_naming_it_and_the_tries(
        bucket, token_dataset, tmp_path, monkeypatch):
    from raypipe.errors import StorageError
    from raypipe.io.store import DOWNLOAD_TRIES

    uri = f"s3://{bucket}/tokens"
    upload_tree(token_dataset, uri)
    proxy = through_a_fault_proxy(monkeypatch, lambda path, asked: path.endswith(".idx"))
    try:
        remote = TokenDataset(uri, "megatron", cache=ShardCache(tmp_path / "cache"))
        with pytest.raises(StorageError) as failed:
            remote.reader(0)
        remote.close()
    finally:
        proxy.stop()
    message = str(failed.value)
    assert message.startswith(f"{uri}/megatron/") and ".idx: cannot download" in message
    assert f"(failed {DOWNLOAD_TRIES} times; giving up)" in message and "\n" not in message


@pytest.mark.slow
def test_a_late_batch_names_the_shard_the_loader_waits_on(bucket, token_dataset, tmp_path,
                                                          monkeypatch):
    """While the shards a batch needs are on their way (here: a bucket 150 ms a request
    away), the line the loader logs for a late batch names them, and the cache's counts."""
    import threading

    uri = f"s3://{bucket}/tokens"
    upload_tree(token_dataset, uri)
    proxy = LatencyProxy(urlparse(os.environ["AWS_ENDPOINT_URL"]).port, 150).start()
    monkeypatch.setenv("AWS_ENDPOINT_URL", proxy.url)
    try:
        loader = TokenLoader(uri, 32, 4, seed=2, cache_dir=tmp_path / "cache")
        first = threading.Thread(target=lambda: next(iter(loader)))
        first.start()
        deadline = time.monotonic() + 60
        while not loader.dataset.fetching_now() and time.monotonic() < deadline:
            time.sleep(0.005)
        named = loader.dataset.fetching_now()
        line = loader.waits.describe()
        first.join()
    finally:
        proxy.stop()
    shard_names = {shard.name for shard in loader.dataset.shards}
    assert named and set(named) <= shard_names
    assert line.startswith(f"waiting on {named[0]}"), line
    assert uri in line and "downloads" in line and "budget" in line


@pytest.mark.slow
def test_a_bucket_run_whose_read_ahead_is_shorter_than_its_fetches_is_told_the_least_budget(
        bucket, token_dataset, tmp_path, monkeypatch, caplog):
    """A bucket 150 ms a request away and a cache whose read-ahead holds ~50 steps of a
    fast loop: its batches wait, and the loader says once why and what cache_bytes would
    hold two fetches' worth of its reading; its stats carry the same figures."""
    uri = f"s3://{bucket}/tokens"
    upload_tree(token_dataset, uri)
    index = TokenDataset(token_dataset, "megatron").index_bytes_read  # what the open keeps
    budget = index + (16 << 10)
    proxy = LatencyProxy(urlparse(os.environ["AWS_ENDPOINT_URL"]).port, 150).start()
    monkeypatch.setenv("AWS_ENDPOINT_URL", proxy.url)
    try:
        with caplog.at_level(logging.WARNING, logger="raypipe"):
            loader = TokenLoader(uri, 32, 4, seed=2, cache_dir=tmp_path / "cache",
                                 cache_bytes=budget, block_bytes=4096)
            steps = sum(1 for _ in loader)
    finally:
        proxy.stop()
    stats = loader.stats
    sizing = stats.sizing
    assert loader.spec.shuffle == "windowed" and steps > ADVICE_EVERY
    assert sizing.fetch_p99_ms >= 150 and sizing.short
    assert sizing.least_budget_bytes > budget
    lines = [r.getMessage() for r in caplog.records if "give cache_bytes >=" in r.getMessage()]
    assert len(lines) == 1 and "(warned once)" in lines[0]
    assert "the fetches' p99 from object storage" in lines[0]
    metrics = stats.metrics()
    assert metrics["least_cache_bytes"] == sizing.least_budget_bytes
    assert metrics["fetch_p99_ms"] == sizing.fetch_p99_ms


def test_a_bucket_run_whose_windows_mix_few_shards_is_told_a_block_size_that_mixes_more(
        bucket, token_dataset, tmp_path, monkeypatch, caplog):
    """Windows of two 16 KiB blocks from a dataset of several shards: once ADVICE_EVERY
    batches have set the read rate, rank 0 names a smaller block_bytes whose windows mix
    the shards at least twice as well, once (the request bound lifted: a test loop reads
    far faster than training); its stats carry the mixing and the block named."""
    uri = f"s3://{bucket}/tokens"
    upload_tree(token_dataset, uri)
    monkeypatch.setattr(mixing_module, "MAX_GETS_A_SECOND", 1e12)
    index = TokenDataset(token_dataset, "megatron").index_bytes_read
    block = 16 << 10
    with caplog.at_level(logging.WARNING, logger="raypipe"):
        loader = TokenLoader(uri, 32, 4, seed=2, cache_dir=tmp_path / "cache",
                             cache_bytes=index + 8 * block, block_bytes=block)
        steps = sum(1 for _ in loader)
    (mixing,) = loader.stats.mixing
    assert steps > ADVICE_EVERY and mixing.window_blocks == 2
    advised = mixing.better_block_bytes
    assert 0 < advised < block
    assert mixing.times_uniform >= 2 * times_uniform(mixing.shards,
                                                     mixing.window_with(advised))
    lines = [r.getMessage() for r in caplog.records if "windowed shuffle mixes" in
             r.getMessage()]
    assert len(lines) == 1 and f"block_bytes={advised} makes windows" in lines[0]
    assert loader.stats.metrics()["advised_block_bytes"] == advised


def test_a_local_loader_has_no_fetch_sizing(token_dataset):
    loader = TokenLoader(token_dataset, 32, 4, seed=2, shuffle="windowed")
    next(iter(loader))
    assert loader.stats.sizing is None and "fetch_p99_ms" not in loader.stats.metrics()


def test_a_bucket_loader_excludes_documents_named_by_input_and_row_from_trace(
        bucket, token_dataset, tmp_path):
    """Documents named as trace names them in a bucket's output (its unit records read from
    the bucket) are excluded on resume; the same steps as the local output's run."""
    from raypipe import trace

    uri = upload_tree(token_dataset, f"s3://{bucket}/excluded")
    options = {"seed": 2, "cache_dir": tmp_path / "cache", "shuffle": "global"}
    loader = TokenLoader(uri, 32, 4, **options)
    next(iter(loader))
    state = loader.state_dict()
    named = [f"{record.input}:{record.input_row}"
             for record in trace(uri, 0, world_size=1, seq_len=32, batch_size=4, **options)]
    resumed = TokenLoader(uri, 32, 4, exclude=named, **options)
    resumed.load_state_dict(state)
    local = TokenLoader(token_dataset, 32, 4, exclude=named, **options)
    local.load_state_dict(state)
    record = resumed.state_dict()["exclusions"][0]
    assert record["step"] == 1 and record["not_found"] == 0 and record["documents"]
    assert record == local.state_dict()["exclusions"][0]
    assert next(iter(resumed)).inputs.tolist() == next(iter(local)).inputs.tolist()


def test_a_bucket_run_under_the_default_shuffle_at_two_ranks_excludes_inside_an_epoch(
        bucket, token_dataset, tmp_path):
    """The default shuffle on a bucket at 2 ranks is windowed in 2 lanes; documents
    excluded on a resume inside the epoch (those trace names in its next steps) have each
    lane's rest planned again: none of them is served after, every rank gets the batches
    the local copy gives under the same shuffle, and a resume of that state at 3 ranks
    goes on where it stands."""
    from raypipe import trace

    uri = upload_tree(token_dataset, f"s3://{bucket}/lanes")
    budget = {"cache_dir": tmp_path / "cache", "cache_bytes": 1 << 20}

    def ranks(path, world=2, **options):
        return [TokenLoader(path, 32, 4, seed=2, rank=rank, world_size=world, **budget,
                            **options) for rank in range(world)]

    first = ranks(uri)
    assert (first[0].spec.shuffle, first[0].spec.lanes) == ("windowed", 2)
    for loader in first:
        next(iter(loader))
    state = first[0].state_dict()
    named = sorted({record.document for record in trace(
        uri, state=state, steps=2, seq_len=32, batch_size=4, cache_dir=tmp_path / "cache")})
    resumed = ranks(uri, exclude=named)
    local = ranks(token_dataset, exclude=named, shuffle="windowed")
    for loader in (*resumed, *local):
        loader.load_state_dict(state)
    after, steps = resumed[0].state_dict(), len(resumed[0])
    assert after["exclusions"][0]["documents"] == named and steps > 0
    for bucket_rank, local_rank in zip(resumed, local, strict=True):
        assert ([batch.inputs.numpy().tobytes() for batch in bucket_rank]
                == [batch.inputs.numpy().tobytes() for batch in local_rank])
    served = {record.document for record in trace(
        uri, state=after, steps=steps, seq_len=32, batch_size=4, cache_dir=tmp_path / "cache")}
    assert served and not served & set(named)
    three = ranks(uri, world=3)
    three[1].load_state_dict(after)
    assert next(iter(three[1])).step == after["steps"]


def test_a_loader_follows_a_job_writing_to_a_bucket_fetching_each_shard_once(
        bucket, corpus_dir, tokenizer_path, tmp_path, monkeypatch):
    """A tokenize job writes to s3:// while a loader follows it (windowed shuffle, one
    lane): its units join as they commit, their shards read as windows after the epoch's
    own, and what the cache fetched before a join is used after it, not fetched again."""
    import threading
    import time

    from raypipe.loader import TokenLoader

    uri = f"s3://{bucket}/live"
    monkeypatch.setenv("RAYPIPE_TEST_FAULT", json.dumps(
        {"point": "unit.before_record", "action": "delay", "seconds": 0.3, "always": True,
         "marker": str(tmp_path / "slow-units")}))
    outcome: list = []
    job = threading.Thread(target=lambda: outcome.append(tokenize_to(
        uri, corpus_dir, tokenizer_path)), daemon=True)
    job.start()
    loader = TokenLoader(uri, 32, 4, seed=2, follow=True, follow_steps=2, lanes=1,
                         device="cpu", cache_dir=str(tmp_path / "cache"))
    while True:
        for _ in loader:
            if job.is_alive():
                time.sleep(0.02)
        if not loader.follower.active:
            break
    job.join()
    assert outcome and outcome[0].units > 2
    joins = loader.state_dict()["units_added"]
    assert any(record["joins"] for record in joins)
    assert loader.dataset.num_documents == outcome[0].documents
    files = {entry.path for shard in loader.dataset.shards for entry in shard.files}
    lengths_ranges = len(loader.dataset.shards)  # each .idx's lengths, read at the open
    assert loader.stats.cache.downloads <= len(files) + lengths_ranges, \
        "a shard was fetched again"


def test_a_status_replaced_between_its_head_and_its_get_is_read_again_not_refused(
        bucket, monkeypatch, caplog):
    """A follower reads `_live/status.json` while the job replaces it: here the job's PUT
    of a longer status lands after the reader's HEAD and before its GET (made so by the
    proxy, which puts it straight to the server when the GET arrives). The cut-short read
    is made again, and the follower sees the new status, not a 'not valid JSON' error."""
    from raypipe.io.live import LIVE_STATUS, LiveOutput
    from raypipe.io.records import LiveStatus
    from raypipe.io.store import Store

    uri = f"s3://{bucket}/racing"
    direct = Store(uri)
    short = LiveStatus("job-1", "running", 9, 1, "", 1.0)
    longer = LiveStatus("job-1", "running", 9, 2, "view-" + "0" * 64, 2.0)
    direct.write_json(LIVE_STATUS, short.to_json())
    replaced: list[str] = []

    def put_the_longer_status_first(path: str, asked: int) -> bool:
        if path.endswith(LIVE_STATUS) and not replaced:
            direct.write_json(LIVE_STATUS, longer.to_json())
            replaced.append(path)
        return False

    proxy = through_a_fault_proxy(monkeypatch, put_the_longer_status_first)
    caplog.set_level(logging.INFO, logger="raypipe")
    try:
        status = LiveOutput(Store(uri)).status()
    finally:
        proxy.stop()
    assert replaced, "the status was never read through the proxy"
    assert status == longer
    assert proxy.gets[f"/{bucket}/racing/{LIVE_STATUS}"] >= 2, "the first read was not cut"
    assert "cut short while it was replaced" in caplog.text, "the re-read was not logged"


@pytest.mark.parametrize("fmt", RANGED_FORMATS)
def test_bucket_blocks_are_ranged_reads_that_survive_503s_and_equal_the_local_copy(
        bucket, request, tmp_path, monkeypatch, fmt):
    """Blocks smaller than a shard (and than a 503's body) come by ranged GETs (each range
    checked for its length); a 503 SlowDown on each object's first GET and a reset of a
    token file's second (the retry's) are retried and counted, and the batches are the
    local copy's under the same knobs and budget."""
    token_dataset = dataset_of(request, fmt)
    uri = f"s3://{bucket}/tokens"
    upload_tree(token_dataset, uri)
    knobs = {"seed": 4, "block_bytes": 4096, "cache_bytes": 1 << 20, "format": fmt}
    token_file = get_format(fmt).suffixes[0]
    proxy = through_a_fault_proxy(monkeypatch, lambda path, asked: asked == 0,
                                  lambda path, asked: asked == 1 and path.endswith(token_file))
    try:
        loader = TokenLoader(uri, 32, 4, cache_dir=tmp_path / "c", **knobs)
        served = [batch.inputs.numpy().tobytes() for batch in loader]
        stats = loader.cache_stats
        loader.close()
    finally:
        proxy.stop()
    assert loader.spec.shuffle == "windowed" and stats.ranged_reads > 0
    assert stats.retries > 0 and proxy.injected > 0 and proxy.reset > 0
    local = TokenLoader(token_dataset, 32, 4, shuffle="windowed", **knobs)
    assert [batch.inputs.numpy().tobytes() for batch in local] == served


def test_a_bucket_budget_below_one_block_a_rank_is_refused_naming_the_least_budget(
        bucket, token_dataset, tmp_path, monkeypatch):
    from raypipe.errors import ConfigError

    uri = f"s3://{bucket}/tokens"
    upload_tree(token_dataset, uri)
    monkeypatch.setenv("LOCAL_WORLD_SIZE", "4")
    with pytest.raises(ConfigError) as refused:
        TokenLoader(uri, 32, 4, cache_dir=tmp_path / "c", cache_bytes=100_000,
                    block_bytes=64 << 10)
    message = str(refused.value)
    assert "cache_bytes >= " in message and "4 rank(s)" in message and "\n" not in message


def test_a_bucket_output_too_old_for_blocks_is_read_in_whole_shards_with_a_warning_saying_why(
        bucket, mds_dataset, tmp_path, caplog):
    """MDS shards written before raypipe wrote `.offsets` cannot be read a block at a
    time: the windowed shuffle fetches them whole and says so once, naming the shards, the
    missing file and the remedy; the same output with its sidecars says nothing of it."""
    import shutil

    from raypipe.sampling.blocks import WHOLE_SHARDS
    from tests.helpers import without_sidecar

    older = without_sidecar(shutil.copytree(mds_dataset, tmp_path / "older"), "mds",
                            ".offsets")
    shards = len(read_manifest(older).formats["mds"].shards)
    caplog.set_level(logging.INFO, logger="raypipe")
    knobs = {"cache_bytes": 64 << 10, "format": "mds"}
    for name, output in (("older", older), ("newer", mds_dataset)):
        upload_tree(output, f"s3://{bucket}/{name}")
        loader = TokenLoader(f"s3://{bucket}/{name}", 32, 4, cache_dir=tmp_path / name,
                             **knobs)
        loader.close()
        assert loader.spec.shuffle == "windowed"
        assert (loader.spec.block_bytes >= WHOLE_SHARDS) == (name == "older")
    warned = [record.getMessage() for record in caplog.records
              if "cannot be read a block at a time" in record.getMessage()]
    assert len(warned) == 1 and "/older" in warned[0]
    assert f"{shards} of {shards} shards" in warned[0] and "has no .offsets" in warned[0]
    assert "raypipe convert" in warned[0] and "\n" not in warned[0]


def test_a_kept_ranged_handle_of_an_object_rewritten_since_is_opened_again_not_refused(
        bucket):
    """A Store keeps an object open for ranged reads (its size asked once); an object
    rewritten since with another size, which a newer manifest lists, is opened again and
    read, and one whose size is not the manifest's is still refused, naming it."""
    store = Store(f"s3://{bucket}/kept")
    store.write_bytes("shard.bin", bytes(range(100)))
    assert store.read_ranges("shard.bin", [(10, 20)], expected_size=100) == [bytes(range(10, 20))]
    store.write_bytes("shard.bin", bytes(range(200)))
    assert store.read_ranges("shard.bin", [(150, 160)], expected_size=200) == [
        bytes(range(150, 160))]
    with pytest.raises(FormatError, match="kept/shard.bin.*size differs from the manifest"):
        store.read_ranges("shard.bin", [(0, 10)], expected_size=100)


@pytest.mark.slow
def test_a_block_of_a_shard_read_before_costs_its_get_alone_over_more_shards_than_64(
        bucket, tmp_path, monkeypatch):
    """Blocks drawn from the whole corpus visit the shards over and over: each object's
    size is asked (a HEAD) once a process, before its first ranged GET, not before every
    block of it (64 objects kept once: ~1 HEAD a GET over 405 shards)."""
    from bench.common import synthetic_token_dataset
    from raypipe.io.store import RANGED_HANDLES

    output = synthetic_token_dataset(tmp_path, 700_000, 6, 6_000)  # 2-3 blocks a shard
    uri = f"s3://{bucket}/many"
    upload_tree(output, uri)
    shards = read_manifest(uri).formats["megatron"].shards
    assert 128 < len(shards) <= RANGED_HANDLES
    proxy = through_a_fault_proxy(monkeypatch, lambda path, asked: False)
    try:
        loader = TokenLoader(uri, 1023, 4, seed=2, block_bytes=4096,
                             cache_dir=tmp_path / "c", cache_bytes=512 << 10,
                             shuffle="windowed")
        for _ in loader:  # an epoch
            pass
        stats = loader.cache_stats
        loader.close()
    finally:
        proxy.stop()
    assert stats.ranged_reads > 2 * len(shards)  # every shard's blocks
    # each object's size asked once: each .bin and .idx (its lengths, at the open) read
    # by range, each .sums downloaded whole
    dataset_heads = {path: count for path, count in proxy.heads.items()
                     if path.endswith((".bin", ".idx", ".sums"))}
    assert len(dataset_heads) == 3 * len(shards)
    assert set(dataset_heads.values()) == {1}


@pytest.mark.parametrize("fmt", RANGED_FORMATS)
@pytest.mark.parametrize("change", ["flipped", "appended"])
def test_a_token_object_changed_on_the_bucket_is_refused_before_an_altered_block_is_served(
        bucket, request, tmp_path, change, fmt):
    """A byte flipped in a Megatron or NanoGPT .bin or a stream .tokens on the bucket (read
    a block at a time: each block checked against the shard's .sums as it arrives), or
    bytes appended (the object's size is checked at its open): the loader refuses the
    object, naming it, and every batch it served before is the local copy's."""
    from tests.test_hostile import served_until_refused

    token_dataset = dataset_of(request, fmt)
    uri = f"s3://{bucket}/tokens"
    upload_tree(token_dataset, uri)
    knobs = {"seed": 4, "block_bytes": 4096, "cache_bytes": 1 << 20, "shuffle": "windowed",
             "format": fmt}
    clean, _ = served_until_refused(TokenLoader(token_dataset, 32, 4, **knobs))
    store = Store(uri)
    victim = read_manifest(uri).formats[fmt].shards[1].files[0].path
    data = bytearray(store.read_bytes(victim))
    if change == "flipped":
        data[len(data) // 2] ^= 0x5A
    else:
        data += bytes(8)
    store.write_bytes(victim, bytes(data))
    loader = TokenLoader(uri, 32, 4, cache_dir=tmp_path / "c", **knobs)
    served, refused = served_until_refused(loader)
    assert refused is not None and store.uri_of(victim) in str(refused)
    assert "\n" not in str(refused) and loader.cache_stats.ranged_reads > 0
    assert served == clean[:len(served)] and len(served) < len(clean)


def test_a_mixture_with_one_source_on_a_bucket_sizes_its_blocks_for_the_bucket_cache(
        bucket, token_dataset, rich_dataset, tmp_path):
    """One source on a bucket, one local, a small cache: `auto` windows both, over blocks
    sized for the bucket source's cache (the local source's budget sized them for 64 GiB
    before, and the bucket source refused them); the batches are those of the same
    mixture over a local copy under the same knobs, and the cache holds within budget."""
    import itertools

    from raypipe.loader import open_loader

    uri = f"s3://{bucket}/tokens"
    upload_tree(token_dataset, uri)
    knobs = {"weights": {"web": 0.6, "code": 0.4}, "mode": "bestfit", "seed": 3,
             "cache_bytes": 1 << 20}
    loader = open_loader({"web": uri, "code": str(rich_dataset)}, 32, 4,
                         cache_dir=tmp_path / "c", **knobs)
    served = [batch.inputs.numpy().tobytes() for batch in itertools.islice(loader, 80)]
    resolved = loader.state_dict()["knobs"]
    stats = loader.stats
    local = open_loader({"web": str(token_dataset), "code": str(rich_dataset)}, 32, 4,
                        shuffle="windowed", **knobs)
    assert [batch.inputs.numpy().tobytes() for batch in itertools.islice(local, 80)] == served
    assert resolved["shuffle"] == "windowed" and resolved["block_bytes"] <= 64 << 10
    assert stats.cache.ranged_reads > 0 and stats.used_bytes <= stats.budget_bytes


def test_two_mixture_sources_on_buckets_share_the_node_cache_in_equal_parts(
        bucket, token_dataset, tmp_path):
    """Two sources on object storage, one node cache: each source's windows are sized for
    half of it (their windows are read side by side), so one source alone resolves windows
    twice as long as the mixture's."""
    from raypipe.loader import open_loader

    upload_tree(token_dataset, f"s3://{bucket}/a")
    upload_tree(token_dataset, f"s3://{bucket}/b")
    knobs = {"mode": "bestfit", "cache_bytes": 2 << 20, "cache_dir": tmp_path / "c",
             "block_bytes": 4096}
    alone = TokenLoader(f"s3://{bucket}/a", 32, 4, **knobs).state_dict()["knobs"]
    both = open_loader({"a": f"s3://{bucket}/a", "b": f"s3://{bucket}/b"}, 32, 4,
                       **knobs).state_dict()["knobs"]
    assert both["window_blocks"] * 2 <= alone["window_blocks"] + 1


def test_a_mixture_on_buckets_sizes_its_windows_for_the_source_that_fetches_most_a_block(
        bucket, token_dataset, mds_dataset, tmp_path):
    """Megatron and MDS sources of one corpus on a bucket: an MDS block fetches its
    samples' headers, ids and sources beside the tokens, so the mixture's one layout is
    resolved by the MDS source (the windows of two MDS sources), not by the first source
    by name (the Megatron one, whose windows would overrun the MDS source's part)."""
    from raypipe.loader import open_loader

    for name, output in (("a", token_dataset), ("b", mds_dataset), ("c", mds_dataset),
                         ("d", token_dataset)):
        upload_tree(output, f"s3://{bucket}/{name}")
    knobs = {"mode": "bestfit", "cache_bytes": 1 << 20, "cache_dir": tmp_path / "c",
             "block_bytes": 4096}

    def windows(*names):
        loader = open_loader({name: f"s3://{bucket}/{name}" for name in names}, 32, 4,
                             **knobs)
        try:
            return loader.state_dict()["knobs"]["window_blocks"]
        finally:
            loader.close()

    assert windows("a", "b") == windows("b", "c") < windows("a", "d")


def test_two_mixture_sources_on_buckets_fetch_ahead_within_their_parts_of_the_cache(
        bucket, token_dataset, tmp_path):
    """What each source of a mixture holds and fetches ahead is its part of the node
    cache: the two together stay within the share of the budget one source alone gets
    (each once took the whole share, so a node held twice its budget)."""
    from raypipe.loader import open_loader

    upload_tree(token_dataset, f"s3://{bucket}/a")
    upload_tree(token_dataset, f"s3://{bucket}/b")
    knobs = {"mode": "bestfit", "cache_bytes": 2 << 20, "cache_dir": tmp_path / "c",
             "block_bytes": 4096}
    alone = TokenLoader(f"s3://{bucket}/a", 32, 4, **knobs)
    both = open_loader({"a": f"s3://{bucket}/a", "b": f"s3://{bucket}/b"}, 32, 4, **knobs)
    next(iter(alone)), next(iter(both))
    holds = [dataset.hold_bytes for dataset in both._datasets()]
    assert len(holds) == 2 and min(holds) > 0
    assert sum(holds) <= alone.dataset.hold_bytes + 1
    alone.close(), both.close()


@pytest.mark.parametrize("sources", [1, 2])
def test_every_block_a_bucket_run_reads_was_asked_for_ahead_of_its_step(
        bucket, token_dataset, tmp_path, sources):
    """One dataset or a mixture of two on buckets, a cache that holds the read-ahead:
    each step's blocks were fetched ahead from the schedule, so no reader fetched a block
    itself on the filling path (a mixture's steps fetched every block there once)."""
    import itertools

    from raypipe.loader import open_loader

    uris = {name: f"s3://{bucket}/{name}" for name in ("a", "b")[:sources]}
    for uri in uris.values():
        upload_tree(token_dataset, uri)
    knobs = {"mode": "bestfit", "cache_bytes": 8 << 20, "cache_dir": tmp_path / "c",
             "block_bytes": 4096, "seed": 5}
    loader = open_loader(uris if sources > 1 else uris["a"], 32, 4, **knobs)
    assert sum(1 for _ in itertools.islice(loader, 100)) == 100
    datasets = loader._datasets()
    assert len(datasets) == sources and all(d.blocks is not None for d in datasets)
    assert loader.stats.cache.ranged_reads > 0
    assert [dataset.blocks_fetched_on_read for dataset in datasets] == [0] * sources
    loader.close()


def test_an_s3_store_made_again_for_quick_retries_keeps_every_setting_of_its_uri(bucket):
    """quick_retrying rebuilds the S3 filesystem with another retry strategy: the endpoint,
    region, scheme and credentials' settings from_uri resolved stay as they were, and the
    store reads what was written."""
    import pyarrow.fs as pafs

    uri = f"s3://{bucket}/settings?region=us-east-1"
    resolved, _ = pafs.FileSystem.from_uri(uri)
    store = Store(uri)
    assert isinstance(store.fs, pafs.S3FileSystem)
    assert store.fs.__reduce__()[1] == resolved.__reduce__()[1]
    store.write_json("probe.json", {"written": 1})
    assert store.read_json("probe.json") == {"written": 1}


def test_an_object_cut_under_a_kept_open_file_is_refused_as_cut_not_retried_for_ever(
        bucket, monkeypatch):
    """Ranged reads keep the object's open file across a transient failure (no HEAD a
    retry); an object replaced by a shorter one answers a range past its new end with an
    error a retry cannot mend, so after two failed tries the file is opened again and the
    size is refused against the manifest's, naming the object."""
    import boto3

    from raypipe.errors import FormatError
    from raypipe.io import store as store_module

    monkeypatch.setattr(store_module, "RANGE_RETRY_SECONDS", 0.001)
    store = Store(f"s3://{bucket}/cut")
    store.write_bytes("tokens.bin", bytes(range(256)) * 800)  # 204,800 bytes
    assert store.read_ranges("tokens.bin", [(102_400, 102_656)],
                             expected_size=204_800) == [bytes(range(256))]
    boto3.client("s3").put_object(Bucket=bucket, Key="cut/tokens.bin", Body=b"x" * 50_000)
    with pytest.raises(FormatError) as refused:
        store.read_ranges("tokens.bin", [(150_000, 150_256)], expected_size=204_800)
    assert "tokens.bin" in str(refused.value) and "size differs" in str(refused.value)


def test_closing_a_bucket_loader_under_an_open_iteration_stops_every_fetch_it_made(
        bucket, token_dataset, tmp_path):
    """A training loop that holds its iterator and calls `close()` (a stop, a Ray Train
    worker's teardown): the batches built ahead stop, nothing of the loader fetches into
    or pins files in the node cache after close returns, the held iteration serves what
    was built and then raises instead of hanging, and iterating again continues where the
    taken batches end."""
    import threading

    uri = f"s3://{bucket}/tokens"
    upload_tree(token_dataset, uri)
    cache = tmp_path / "c"
    knobs = {"mode": "windows", "seed": 3, "cache_dir": cache, "prefetch": 4}
    whole = [batch.inputs.numpy().tobytes() for batch in TokenLoader(uri, 32, 4, **knobs)]
    shutil.rmtree(cache)
    loader = TokenLoader(uri, 32, 4, **knobs)
    held = iter(loader)
    taken = [next(held).inputs.numpy().tobytes() for _ in range(3)]
    loader.close()
    assert not [t for t in threading.enumerate() if t.name == "raypipe-prefetch"]
    files = {path: path.stat().st_mtime_ns for path in cache.rglob("*") if path.is_file()}
    time.sleep(0.5)
    assert {path: path.stat().st_mtime_ns for path in cache.rglob("*")
            if path.is_file()} == files, "the cache changed after close"
    with pytest.raises(StateError, match="closed while this iteration was open"):
        for batch in held:  # the batches built before close (a few handoffs)
            taken.append(batch.inputs.numpy().tobytes())
    assert len(taken) < len(whole) // 2
    rest = [batch.inputs.numpy().tobytes() for batch in loader]
    loader.close()
    assert taken + rest == whole


def test_a_closed_loader_lets_go_of_a_build_that_waits_on_a_queued_fetch(
        bucket, tmp_path, monkeypatch):
    """One fetch thread and a bucket 400 ms a request away once the loader is open: the
    producer builds ahead and waits on a fetch queued behind others. `close()` cancels the
    fetches not begun before it joins the producer, so no queued fetch runs while it
    waits, the producer ends and no GET begins after close returns (close once joined the
    producer first: it waited while the queue drained, up to 10 s, then left it
    running)."""
    import threading

    import raypipe.dataset
    from bench.common import synthetic_token_dataset

    monkeypatch.setattr(raypipe.dataset, "PREFETCH_THREADS", 1)
    local = synthetic_token_dataset(tmp_path, 2_000_000, 5, 75_000)  # 27 shards
    uri = f"s3://{bucket}/tokens"
    upload_tree(local, uri)
    proxy = LatencyProxy(urlparse(os.environ["AWS_ENDPOINT_URL"]).port, 0).start()
    monkeypatch.setenv("AWS_ENDPOINT_URL", proxy.url)
    try:
        loader = TokenLoader(uri, 512, 8, mode="bestfit", seed=3, shuffle="windowed",
                             cache_dir=tmp_path / "c", block_bytes=4096, prefetch=8)
        proxy.delay = 0.4  # (the index files fetched at the open came at once)
        held = iter(loader)
        next(held)
        time.sleep(0.2)  # the producer builds on to a step whose blocks are queued
        asked = loader.dataset.fetching_now()  # blocks queued or in flight
        before = proxy.requests["GET"]
        loader.close()
        during = proxy.requests["GET"] - before
        time.sleep(1.0)
        after = proxy.requests["GET"] - before
    finally:
        proxy.stop()
    assert len(asked) > 2  # more asked for than the one thread had in flight
    assert not [t for t in threading.enumerate() if t.name == "raypipe-prefetch"]
    # the one thread's fetch in flight as close began may reach the bucket during it
    assert during <= 1, f"{during} queued fetches ran while close waited for the producer"
    assert after == during, "a fetch began after close returned"


CHAT_KNOBS = {"seed": 4, "block_bytes": 4096, "cache_bytes": 1 << 20, "shuffle": "windowed"}


def served_with_masks(loader) -> list[tuple[bytes, bytes]]:
    """Each batch's inputs and mask bytes, the loader closed after."""
    try:
        return [(batch.inputs.numpy().tobytes(), batch.mask.numpy().tobytes())
                for batch in loader]
    finally:
        loader.close()


@pytest.mark.parametrize("fmt", ["megatron", "stream", "mds"])
def test_chat_data_on_a_bucket_is_read_in_ranged_blocks_of_tokens_and_mask_and_equals_the_local_copy(  # noqa: E501
        bucket, every_mask_format, tmp_path, fmt):  # noqa: F811
    """Chat data's shards come a block at a time, the `.mask` sidecar by ranged GETs beside
    the tokens (MDS: samples carrying their mask) and no whole token or mask file fetched,
    and every batch's inputs and loss mask are the local copy's under the same knobs."""
    uri = f"s3://{bucket}/chat"
    upload_tree(every_mask_format, uri)
    loader = TokenLoader(uri, 32, 4, cache_dir=tmp_path / "c", format=fmt, **CHAT_KNOBS)
    served = served_with_masks(loader)
    cached = [path.name for path in (tmp_path / "c").rglob("*") if path.is_file()]
    mask_file = ".mask" if get_format(fmt).samples is None else get_format(fmt).suffixes[0]
    assert any(f"{mask_file}.range-" in name for name in cached)
    assert not [name for name in cached if name.endswith((".mask", ".bin", ".tokens", ".mds"))]
    assert loader.cache_stats.ranged_reads > 0
    local = TokenLoader(every_mask_format, 32, 4, format=fmt, **CHAT_KNOBS)
    assert served_with_masks(local) == served
    assert any(np.frombuffer(mask, dtype=np.bool_).any() for _, mask in served)


def test_a_loss_mask_changed_on_the_bucket_is_refused_before_an_altered_mask_is_served(
        bucket, every_mask_format, tmp_path):  # noqa: F811
    """A byte flipped in a `.mask` object (read a block at a time, each checked against
    the shard's `.mask.sums` as it arrives): the loader refuses the object, naming it, and
    every batch it served before is the local copy's, mask included."""
    uri = f"s3://{bucket}/chat"
    upload_tree(every_mask_format, uri)
    clean = served_with_masks(TokenLoader(every_mask_format, 32, 4, format="megatron",
                                          **CHAT_KNOBS))
    store = Store(uri)
    shard = read_manifest(uri).formats["megatron"].shards[1]
    victim = next(entry.path for entry in shard.files if entry.path.endswith(".mask"))
    data = bytearray(store.read_bytes(victim))
    data[len(data) // 2] ^= 1
    store.write_bytes(victim, bytes(data))
    loader = TokenLoader(uri, 32, 4, cache_dir=tmp_path / "c", format="megatron",
                         **CHAT_KNOBS)
    served: list[tuple[bytes, bytes]] = []
    with pytest.raises(FormatError) as refused:
        for batch in loader:
            served.append((batch.inputs.numpy().tobytes(), batch.mask.numpy().tobytes()))
    loader.close()
    assert store.uri_of(victim) in str(refused.value) and "\n" not in str(refused.value)
    assert served == clean[:len(served)] and len(served) < len(clean)


def test_batches_from_a_bucket_under_auto_read_shard_local_groups_fetching_each_shard_once(
        bucket, rich_dataset, tmp_path, figure):
    """Pre-formed batches (LLMBATCH) from a bucket whose node cache holds a quarter of
    them: `auto` serves shard-local groups of the shuffled blocks (the global block shuffle
    fetched a shard again for each of its blocks), so each shard comes once an epoch, every
    batch is served once, and a local run given the same shuffle and group serves the same
    batches."""
    from raypipe.dataset import BatchDataset

    uri = f"s3://{bucket}/rich"
    upload_tree(rich_dataset, uri)
    batches = BatchDataset(rich_dataset)
    size = sum(entry.bytes for shard in batches.shards for entry in shard.files)
    knobs = {"mode": "batches", "block_batches": 4, "seed": 3}
    fetched = {}
    for shuffle in ("global", "auto"):
        loader = TokenLoader(uri, cache_dir=tmp_path / shuffle, cache_bytes=size // 4,
                             shuffle=shuffle, **knobs)
        served = [batch.inputs.numpy().tobytes() for batch in loader]
        fetched[shuffle] = loader.cache_stats.downloaded_bytes
        loader.close()
    assert batches.num_shards >= 4 and loader.spec.shuffle == "shard_local"
    assert len(served) == batches.num_batches
    assert fetched["auto"] == size, "a shard was fetched twice in one epoch"
    assert fetched["global"] > size
    figure("batches from a bucket, bytes an epoch / dataset",
           f"global {fetched['global'] / size:.2f}x, auto (shard-local) "
           f"{fetched['auto'] / size:.2f}x (a cache of a quarter, {batches.num_shards} shards)")
    local = TokenLoader(rich_dataset, shuffle="shard_local",
                        group_shards=loader.spec.group_shards, **knobs)
    assert [batch.inputs.numpy().tobytes() for batch in local] == served


def books_dataset(directory: Path) -> tuple[Path, int, int]:
    """A Megatron dataset of numbered tokens (a token's id says where it is) whose short
    documents come with three 'books' far longer than a 256 KiB cache's windows (each a
    block of its own): (path, tokens, the largest book's bytes)."""
    from bench.common import write_synthetic_dataset

    rng = np.random.default_rng(1)
    lengths = np.clip(rng.lognormal(4.5, 1.0, 1500).astype(np.int64) + 2, 2, 3000)
    lengths[[100, 700, 1200]] = [60_000, 40_000, 30_000]
    ids = np.arange(1, 1 + int(lengths.sum()), dtype=np.uint32)
    output = write_synthetic_dataset(directory / "books", "megatron", [(ids, lengths, None)],
                                     "books", shard_tokens=40_000, largest_id=1 << 22)
    return output, int(lengths.sum()), 60_000 * 4


def test_documents_longer_than_the_windows_of_a_small_cache_are_all_served_once_from_a_bucket(
        bucket, tmp_path, monkeypatch, caplog):
    """Two ranks of a node share a cache whose windows hold far less than the longest
    documents: each such document is a block of its own, the cache passes its budget while
    it is read, and the loader says which documents and what budget holds them; every
    shard's .sums stays pinned until read (the fetch's own eviction took it before, and
    the build failed on a missing file), and every token is served once but the tail."""
    from tests.helpers import lockstep

    output, total, largest = books_dataset(tmp_path)
    uri = f"s3://{bucket}/books"
    upload_tree(output, uri)
    monkeypatch.setenv("LOCAL_WORLD_SIZE", "2")
    caplog.set_level(logging.WARNING, logger="raypipe")
    loaders = [TokenLoader(uri, 256, 4, rank=rank, world_size=2, seed=3,
                           cache_dir=tmp_path / "c", cache_bytes=256 << 10)
               for rank in range(2)]
    assert loaders[0].spec.shuffle == "windowed" and loaders[0].spec.block_bytes < largest
    taken, _ = lockstep(loaders, None, 10_000)
    for loader in loaders:
        loader.close()
    served = np.concatenate([rows[:, :-1].ravel() for _, rows in taken.values()])
    served = served[served > 0]
    assert np.unique(served).size == served.size  # no token twice
    assert total - served.size < 2 * 4 * 257  # every token but the drop-last tail's
    warned = [record.getMessage() for record in caplog.records
              if "hold more than a window" in record.getMessage()]
    assert len(warned) == 1 and "cache_bytes >= " in warned[0], warned
    said = re.search(r"the largest, ([\d,]+) bytes, is in shard (\S+);", warned[0])
    assert said is not None and int(said[1].replace(",", "")) >= largest
    assert said[2] in {shard.name for shard in read_manifest(uri).formats["megatron"].shards}
