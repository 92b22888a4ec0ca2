"""A document format and a batch format, each from one new file (docs/formats.md's two
examples), registered the way a plugin is (an installed distribution's entry points in the
group `raypipe.formats`), each with an option of its own: with no other edit, the tokenize
command line takes the options as flags and writes both formats with them, and inspect,
verify and convert serve them. Every check runs in a fresh process whose import path holds
the plugin's distribution (tmp_path), as an installed plugin is found."""

from __future__ import annotations

import json
import re
from pathlib import Path

import numpy as np
import pytest

from tests.helpers import install_plugin, run_with_plugin

ROOT = Path(__file__).resolve().parents[1]
DOCS = ROOT / "docs" / "formats.md"
RECORD_LEN, BATCH = 33, 4


def documented_formats() -> dict[str, str]:
    """The two python blocks of docs/formats.md's "A format of your own": the modules a
    user would ship (`flat`, option offset_width; `npybatch`, option dtype)."""
    section = DOCS.read_text().split("## 8. A format of your own", 1)[1]
    blocks = re.findall(r"^```python\n(.*?)^```", section, flags=re.MULTILINE | re.DOTALL)
    return {"flat": blocks[0], "npybatch": blocks[1]}


@pytest.fixture
def plugin_site(tmp_path) -> Path:
    """An installed distribution whose entry points register `flat` and `npybatch`."""
    return install_plugin(tmp_path / "site", "raypipe_formats_demo", "raypipe.formats",
                          documented_formats())


# the tokenize command line, parsed and run by the serial runner (the job a Ray unit runs)
TOKENIZE = """
import sys
from raypipe.cli import build_parser, config_from_args
from raypipe.preprocess.job import run_job

run_job(config_from_args(build_parser().parse_args(["tokenize", *sys.argv[1:]])))
"""

# the documents and records as token lists, read through the registry (a fresh process)
READ = """
import json, sys
from raypipe.dataset import open_format

print(json.dumps({name: [t.tolist() for _, items in open_format(sys.argv[1], name)
                         .shard_documents() for t, _ in items] for name in sys.argv[2:]}))
"""


def held(site: Path, root: Path, *names: str) -> dict[str, list[list[int]]]:
    return json.loads(run_with_plugin(site, "-c", READ, str(root), *names).stdout)


@pytest.fixture
def written(plugin_site, corpus_dir, tokenizer_path, tmp_path) -> Path:
    out = tmp_path / "out"
    run_with_plugin(plugin_site, "-c", TOKENIZE, str(corpus_dir), "--tokenizer", tokenizer_path,
                 "-o", str(out), "--format", "megatron,flat,npybatch",
                 "--flat-offset-width", "4", "--npybatch-record-len", str(RECORD_LEN),
                 "--npybatch-batch-size", str(BATCH), "--npybatch-id-dtype", "uint16",
                 "--npybatch-batches-per-shard", "5", "--unit-bytes", "20000")
    return out


def test_the_tokenize_and_convert_command_lines_show_each_plugin_format_s_option(plugin_site):
    for command in ("tokenize", "convert"):
        shown = run_with_plugin(plugin_site, "-m", "raypipe.cli", command, "--help").stdout
        assert "--flat-offset-width {4,8}" in shown, shown
        assert "--npybatch-id-dtype {uint16,uint32}" in shown and "--npybatch-record-len" in shown


def test_tokenize_writes_both_plugin_formats_with_their_options(plugin_site, written):
    manifest = json.loads((written / "manifest.json").read_text())
    assert manifest["formats"]["flat"]["offset_width"] == 4  # a section records its options
    assert manifest["formats"]["npybatch"]["id_dtype"] == "uint16"
    assert manifest["formats"]["npybatch"]["record_len"] == RECORD_LEN
    for shard in manifest["formats"]["flat"]["shards"]:  # 4 bytes an offset, N + 1 of them
        offsets = next(f for f in shard["files"] if f["path"].endswith(".off"))
        assert offsets["bytes"] == 4 * (shard["documents"] + 1)
    batches = [np.load(written / f["path"]) for shard in manifest["formats"]["npybatch"]["shards"]
               for f in shard["files"] if f["path"].endswith("0.npy")]
    assert len(batches) >= 2 and all(b.dtype == np.uint16 and b.shape[1:] == (BATCH, RECORD_LEN)
                                     for b in batches)
    documents = held(plugin_site, written, "megatron", "flat", "npybatch")
    assert documents["flat"] == documents["megatron"]
    served = np.bincount(np.concatenate([np.array(r) for r in documents["npybatch"]]))
    corpus = np.bincount(np.concatenate([np.array(d) for d in documents["megatron"]]),
                         minlength=served.size)
    assert (served <= corpus).all() and served.sum() > 0.8 * corpus.sum()  # pieces of them


def test_inspect_and_verify_serve_both_plugin_formats(plugin_site, written):
    shown = run_with_plugin(plugin_site, "-m", "raypipe.cli", "inspect", str(written)).stdout
    assert "format flat: dtype uint16" in shown and "format npybatch" in shown, shown
    assert f"batches of [{BATCH}, {RECORD_LEN}]" in shown and "sample 0 (" in shown
    verified = run_with_plugin(plugin_site, "-m", "raypipe.cli", "verify", str(written)).stdout
    assert "OK" in verified and "of 3 format(s)" in verified, verified
    offsets = next((written / "flat").glob("*.off"))
    offsets.write_bytes(offsets.read_bytes()[:-4] + (10**6).to_bytes(4, "little"))
    broken = run_with_plugin(plugin_site, "-m", "raypipe.cli", "verify", str(written), status=2)
    assert offsets.name in broken.stderr, broken.stderr


def test_convert_writes_and_reads_both_plugin_formats_with_their_options(plugin_site,
                                                                        written, tmp_path):
    wide = tmp_path / "flat8"
    run_with_plugin(plugin_site, "-m", "raypipe.cli", "convert", str(written), str(wide),
                 "--format", "flat", "--source-format", "megatron", "--flat-offset-width", "8")
    assert json.loads((wide / "manifest.json").read_text())["formats"]["flat"][
        "offset_width"] == 8
    back = tmp_path / "nanogpt"
    run_with_plugin(plugin_site, "-m", "raypipe.cli", "convert", str(wide), str(back),
                 "--format", "nanogpt")
    original = held(plugin_site, written, "megatron")["megatron"]
    assert held(plugin_site, back, "nanogpt")["nanogpt"] == original
    packed = tmp_path / "packed"
    run_with_plugin(plugin_site, "-m", "raypipe.cli", "convert", str(wide), str(packed),
                 "--format", "npybatch", "--npybatch-record-len", str(RECORD_LEN),
                 "--npybatch-batch-size", str(BATCH), "--npybatch-batches-per-shard", "5")
    assert held(plugin_site, packed, "npybatch") == held(plugin_site, written, "npybatch")
    wrong = run_with_plugin(plugin_site, "-m", "raypipe.cli", "convert", str(wide),
                         str(tmp_path / "x"), "--format", "nanogpt", "--flat-offset-width",
                         "4", status=2)
    assert "options of flat given" in wrong.stderr, wrong.stderr


def test_a_new_in_tree_format_is_one_new_file_in_the_formats_package(tmp_path):
    """The docs' `flat` format saved as raypipe/formats/flat.py in a copy of the package
    (tmp_path) is registered, with its option, by importing raypipe.formats: no list of
    names to edit."""
    import shutil
    import subprocess
    import sys

    copy = tmp_path / "raypipe"
    shutil.copytree(ROOT / "raypipe", copy, ignore=shutil.ignore_patterns("__pycache__"))
    (copy / "formats" / "flat.py").write_text(documented_formats()["flat"])
    check = ("import raypipe, raypipe.formats as f; "
             f"assert raypipe.__file__.startswith({str(copy)!r}), raypipe.__file__; "
             "print(sorted(f.FORMATS))")
    done = subprocess.run([sys.executable, "-c", check], capture_output=True, text=True,
                          cwd=tmp_path, env={"PYTHONPATH": str(tmp_path), "PATH": ""},
                          timeout=120)
    assert done.returncode == 0, done.stderr[-2000:]
    assert "'flat'" in done.stdout and "'megatron'" in done.stdout
