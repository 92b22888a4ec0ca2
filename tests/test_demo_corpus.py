"""The demo corpus: docstrings gathered with `ast`, each file's cached while it is unchanged."""

from __future__ import annotations

from pathlib import Path

import pytest

from raypipe.demo import corpus


def module(docstring: str, function_doc: str) -> str:
    return f'"""{docstring}"""\n\n\ndef f():\n    """{function_doc}"""\n'


@pytest.fixture
def source_tree(tmp_path, monkeypatch) -> Path:
    monkeypatch.setenv("RAYPIPE_CACHE_DIR", str(tmp_path / "cache"))
    root = tmp_path / "lib"
    (root / "pkg").mkdir(parents=True)
    (root / "tests").mkdir()
    (root / "a.py").write_text(module("Module a explains at length what it is for, " * 2,
                                      "Function f of module a does one thing, said at length."))
    (root / "pkg" / "b.py").write_text(module("Module b, a second module with a long enough "
                                              "docstring to count.", "short"))
    (root / "tests" / "test_c.py").write_text(module("A test module that the corpus leaves out "
                                                     "whatever it says.", "ignored"))
    return root


def parsed_files(monkeypatch) -> list[str]:
    """The files `docstrings_of` parses from now on (the cache's misses)."""
    seen: list[str] = []
    parse = corpus.docstrings_of
    monkeypatch.setattr(corpus, "docstrings_of",
                        lambda path: seen.append(path.name) or parse(path))
    return seen


def test_a_cached_file_is_not_parsed_again_until_it_changes(source_tree, monkeypatch):
    first = corpus.gather_docstrings([source_tree])
    assert first == ["Module a explains at length what it is for, " * 2,
                     "Function f of module a does one thing, said at length.",
                     "Module b, a second module with a long enough docstring to count."]
    parsed = parsed_files(monkeypatch)
    assert corpus.gather_docstrings([source_tree]) == first and parsed == []
    (source_tree / "pkg" / "b.py").write_text(module("Module b, rewritten: its docstring is "
                                                     "now another one.", "short"))
    again = corpus.gather_docstrings([source_tree])
    assert parsed == ["b.py"]
    assert again == [*first[:2], "Module b, rewritten: its docstring is now another one."]


def test_a_pass_cut_at_a_limit_caches_what_it_read_and_the_full_pass_is_the_same(
        source_tree, monkeypatch):
    whole = corpus.gather_docstrings([source_tree], limit_chars=None)
    cache = corpus.DocstringCache(source_tree)
    cache.path.unlink()
    cut = corpus.gather_docstrings([source_tree], limit_chars=10)
    assert cut == whole[:1]  # stops at the first docstring that reaches the limit
    parsed = parsed_files(monkeypatch)
    assert corpus.gather_docstrings([source_tree]) == whole
    assert parsed == ["b.py"]  # a.py came from the cache the cut pass wrote


def test_an_unreadable_cache_is_rebuilt(source_tree):
    whole = corpus.gather_docstrings([source_tree])
    cache = corpus.DocstringCache(source_tree)
    cache.path.write_bytes(b"not an arrow file")
    assert corpus.gather_docstrings([source_tree]) == whole
    assert len(corpus.DocstringCache(source_tree).entries) == 2
