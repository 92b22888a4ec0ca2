"""The README's Python code blocks, then those of the docs pages, run as written, in order,
in a directory holding what they name (`corpus/` parquet files, `corpus.jsonl`,
`tokenizer.json`), inside the test session's local Ray: tokenize, tokenize a Ray Dataset,
load and resume, Ray Train."""

from __future__ import annotations

import contextlib
import json
import re
import shutil
from collections.abc import Iterator
from pathlib import Path

import pytest

from raypipe.demo.train_tokenizer import SHIPPED
from raypipe.formats import FORMATS
from raypipe.sampling.balance import COST_MODELS
from raypipe.sampling.modes import base as modes_base
from tests.conftest import write_parquet

pytestmark = [pytest.mark.ray, pytest.mark.slow]

ROOT = Path(__file__).resolve().parents[1]
README = ROOT / "README.md"
DOCS = sorted((ROOT / "docs").glob("*.md"))


def python_blocks(text: str) -> list[str]:
    return re.findall(r"^```python\n(.*?)^```", text, flags=re.MULTILINE | re.DOTALL)


def test_the_readme_has_python_blocks_for_tokenize_load_and_ray_train():
    blocks = python_blocks(README.read_text())
    assert len(blocks) >= 4
    joined = "\n".join(blocks)
    for call in ("raypipe.tokenize(", "TokenLoader(", "load_state_dict(", "worker_loader(",
                 "trainer.fit()"):
        assert call in joined, call


def test_every_readme_and_docs_python_block_runs_as_written(ray_session, tmp_path, monkeypatch,
                                                   corpus_texts, capsys):
    texts = corpus_texts[:600]
    for index in range(2):
        write_parquet(tmp_path / "corpus" / f"part-{index}.parquet", texts[index::2])
    with open(tmp_path / "corpus.jsonl", "w") as handle:
        for text in texts:
            handle.write(json.dumps({"text": text}) + "\n")
    shutil.copy(SHIPPED, tmp_path / "tokenizer.json")
    monkeypatch.chdir(tmp_path)
    namespace: dict = {"__name__": "__readme__"}
    with registries_restored():  # the docs' example format and mode register themselves
        run_blocks(namespace)
    assert (tmp_path / "out" / "manifest.json").exists()
    assert (tmp_path / "out-filtered" / "manifest.json").exists()
    assert "3\n" in capsys.readouterr().out  # the resumed loader's first step
    assert namespace["result"].checkpoint is not None
    run_trace_commands(capsys)


def run_blocks(namespace: dict) -> None:
    """Every python block of the README, then of each docs page, in one namespace."""
    for page in [README, *DOCS]:
        for number, block in enumerate(python_blocks(page.read_text()), start=1):
            where = f"{page.relative_to(ROOT)} python block {number}"
            try:
                exec(compile(block, where, "exec", dont_inherit=True), namespace)  # as a file
            except Exception as exc:  # noqa: BLE001  (named with the block that raised it)
                pytest.fail(f"{where} raised {exc!r}:\n{block}")


@contextlib.contextmanager
def registries_restored() -> Iterator[None]:
    """The format, loader-mode and cost-model registries as they were, after the block."""
    formats, modes, costs = dict(FORMATS), dict(modes_base._MODES), dict(COST_MODELS)
    try:
        yield
    finally:
        FORMATS.clear()
        FORMATS.update(formats)
        modes_base._MODES.clear()
        modes_base._MODES.update(modes)
        COST_MODELS.clear()
        COST_MODELS.update(costs)


def run_trace_commands(capsys) -> None:
    """The `raypipe trace` commands of the README and docs, on the dataset their Python
    blocks made: each ends with status 0 and prints JSON lines naming input rows."""
    import shlex

    from raypipe.cli import main

    commands = [line for page in [README, *DOCS] for line in page.read_text().splitlines()
                if line.startswith("raypipe trace ")]
    assert commands
    for command in commands:
        assert main(shlex.split(command)[1:]) == 0, command
        records = [json.loads(line) for line in capsys.readouterr().out.splitlines()]
        assert records and all(record["input_row"] is not None for record in records)
