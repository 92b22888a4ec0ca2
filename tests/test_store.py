"""Store, staging and cache units without a server: URIs, escapes, sweeps, budgets."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest

from raypipe.errors import ConfigError, FormatError
from raypipe.io.cache import ShardCache, parse_bytes
from raypipe.io.records import FileEntry
from raypipe.io.staging import _sweep_dead
from raypipe.io.store import Store


def test_a_uri_with_one_slash_or_an_unknown_scheme_is_refused_before_any_write(tmp_path,
                                                                              monkeypatch):
    monkeypatch.chdir(tmp_path)
    with pytest.raises(ConfigError, match=r"s3://bucket/out"):
        Store("s3:/bucket/out")
    with pytest.raises(ConfigError, match="cannot open nosuch://"):
        Store("nosuch://bucket/out")
    assert list(tmp_path.iterdir()) == []


def test_file_uris_and_relative_paths_are_the_same_local_store(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    assert Store("out").uri == Store(f"file://{tmp_path}/out").uri == str(tmp_path / "out")
    assert Store("out").local


def test_store_paths_cannot_leave_the_root(tmp_path):
    store = Store(tmp_path / "root")
    for bad in ("../x", "/etc/passwd", "a/../../x", ""):
        with pytest.raises(FormatError, match="escapes"):
            store.path(bad)


def test_local_store_writes_whole_files_and_lists_them(tmp_path):
    store = Store(tmp_path / "root")
    store.write_json("_units/a.json", {"k": 1})
    store.write_bytes("megatron/x.bin", b"abc")
    assert store.list_files() == ["_units/a.json", "megatron/x.bin"]
    assert store.info("megatron/x.bin")[0] == 3 and store.info("missing") is None
    assert not list((tmp_path / "root").rglob("*.raypipe.tmp"))
    store.delete_tree("megatron")
    assert store.list_files() == ["_units/a.json"]


def test_staging_sweep_removes_directories_of_dead_processes_only(tmp_path):
    dead = subprocess.run([sys.executable, "-c", "import os; print(os.getpid())"],
                          capture_output=True, text=True).stdout.strip()
    (tmp_path / f"{dead}-abc").mkdir()
    (tmp_path / f"{os.getpid()}-mine").mkdir()
    (tmp_path / "1-init").mkdir()  # pid 1 is alive (maybe not ours to signal)
    _sweep_dead(tmp_path)
    assert sorted(p.name for p in tmp_path.iterdir()) == sorted([f"{os.getpid()}-mine",
                                                                 "1-init"])


def test_cache_budget_parses_units_and_refuses_nonsense():
    assert parse_bytes("64GiB") == 64 << 30 and parse_bytes("500MB") == 500 * 10**6
    assert parse_bytes("1e6") == 10**6 and parse_bytes(123) == 123
    with pytest.raises(ConfigError, match="not a byte count"):
        parse_bytes("lots")


def test_cache_refuses_a_file_missing_from_the_store(tmp_path):
    store = Store(tmp_path / "data")
    cache = ShardCache(tmp_path / "cache")
    with pytest.raises(FormatError, match="missing"):
        cache.fetch(store, "k", FileEntry("megatron/a.bin", 3, "0" * 64))
    assert cache.cached_files() == []
