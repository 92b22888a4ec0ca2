"""A loader mode from one new file (docs/loader.md's example), registered the way a plugin
is (an installed distribution's entry point in the group `raypipe.loader_modes`), with a
knob of its own: with no other edit, the command line shows the knob, the loader takes it
as a keyword, the shared state harness resumes the mode exactly, and a state made with
another value of the knob is refused, naming it. Each check runs in a fresh process whose
import path holds the plugin's distribution (tmp_path), as an installed plugin is found."""

from __future__ import annotations

import re
from pathlib import Path

import pytest

from tests.helpers import install_plugin, run_with_plugin

ROOT = Path(__file__).resolve().parents[1]

DOCS = ROOT / "docs" / "loader.md"


def documented_plugin() -> str:
    """The first python block of docs/loader.md's "A loader mode of your own": the
    module a user would ship (it registers the `sparse` mode, knob `skip_tokens`)."""
    section = DOCS.read_text().split("## A loader mode of your own", 1)[1]
    return re.findall(r"^```python\n(.*?)^```", section, flags=re.MULTILINE | re.DOTALL)[0]


CHECKS = '''
import sys

import numpy as np

sys.path.insert(0, sys.argv[2])  # tests/: the shared state harness
from test_state_harness import check_resume_1_2_3, make_loader, run_segment

from raypipe.errors import StateError
from raypipe.loader import TokenLoader

path = sys.argv[1]
# the loader takes the knob as a keyword, and the rows follow it
loader = TokenLoader(path, 32, 4, mode="sparse", skip_tokens=5, seed=1, rank=0,
                     world_size=1)
batch = next(iter(loader))
starts = loader.plan(0).window_starts(batch.positions)[1]
assert np.all(starts % (32 + 1 + 5) == 0), starts
print("keyword ok", loader.plan(0).size)
# the shared harness: stop at 1 rank, resume at 2, finish at 3, every window once
for first_stop in (0, 1, 3):
    check_resume_1_2_3(path, "sparse", first_stop)
print("harness ok")
# a state made with another value of the knob is refused, naming it
_, state = run_segment(path, {"mode": "sparse"}, 1, None, steps=1)
other = make_loader(path, {"mode": "sparse", "skip_tokens": 5}, 0, 1)
try:
    other.load_state_dict(state)
except StateError as exc:
    print("refused:", exc)
else:
    raise SystemExit("a state of skip_tokens=16 loaded into skip_tokens=5")
'''


@pytest.fixture
def plugin_site(tmp_path) -> Path:
    """An installed distribution that registers the `sparse` mode through its entry point."""
    return install_plugin(tmp_path / "site", "raypipe_sparse", "raypipe.loader_modes",
                          {"sparse": documented_plugin()})


def test_a_plugin_mode_s_knob_is_an_option_of_trace_and_pack_report(plugin_site):
    for command in ("trace", "pack-report"):
        shown = run_with_plugin(plugin_site, "-m", "raypipe.cli", command, "--help").stdout
        assert "--skip-tokens" in shown and "sparse: stream tokens left out" in shown
        assert "sparse" in shown.split("--mode", 1)[1].split("--", 1)[0]  # a mode choice


def test_a_plugin_mode_loads_by_keyword_resumes_exactly_and_refuses_another_knob(
        plugin_site, token_dataset):
    done = run_with_plugin(plugin_site, "-c", CHECKS, str(token_dataset),
                           str(ROOT / "tests"))
    assert "keyword ok" in done.stdout and "harness ok" in done.stdout, done.stdout
    refusal = done.stdout.split("refused:", 1)[1]
    assert "skip_tokens: saved 16, now 5" in refusal, refusal


def test_pack_report_and_trace_run_a_plugin_mode_with_its_knob(plugin_site, token_dataset):
    report = run_with_plugin(plugin_site, "-m", "raypipe.cli", "pack-report",
                             str(token_dataset), "--seq-len", "32", "--mode", "sparse",
                             "--skip-tokens", "5").stdout
    assert "sparse rows of 32 + 1 tokens" in report, report
    traced = run_with_plugin(plugin_site, "-m", "raypipe.cli", "trace", str(token_dataset),
                             "--seq-len", "32", "--batch-size", "2", "--mode", "sparse",
                             "--skip-tokens", "5", "--step", "1").stdout
    assert len(traced.splitlines()) >= 2, traced
    wrong = run_with_plugin(plugin_site, "-m", "raypipe.cli", "trace", str(token_dataset),
                            "--seq-len", "32", "--mode", "windows", "--skip-tokens", "5",
                            status=2)
    assert "skip_tokens: a knob of mode sparse, not of 'windows'" in wrong.stderr, wrong.stderr

