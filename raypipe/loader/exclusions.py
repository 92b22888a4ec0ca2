"""The loaders' `exclude` option: documents named as `raypipe trace` names them, resolved once
per loader, excluded once where its run starts.

Invariant: the names are read when the loader is made (a file that cannot be read, or a
mixture's name without its source, fails there, in one line); each is resolved to its
source's document number in the data the run serves when it is excluded (a run resumed
on an output that gained units numbers its documents as it did: raypipe.sampling.growth):
from the step the run stands at when it first serves a batch or gives its state, or at the
step a state resumes (the run records each exclusion: raypipe.sampling.exclusions), so a
loader resumed with the same names excludes nothing twice. Cost: the resolution's
(raypipe.provenance.rows.DocumentsByName), once per resume.
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from typing import Any

import numpy as np

from raypipe.errors import ConfigError
from raypipe.provenance.rows import DocumentName, DocumentsByName, document_names

logger = logging.getLogger("raypipe")
Resolved = dict[str | None, tuple[np.ndarray, int, int]]  # source -> (documents, named, none)


class PendingExclusions:
    """The `exclude` option of one loader: `datasets` are its sources by name (None: the
    one dataset of a TokenLoader), `refuse` refuses an exclusion its mode cannot serve,
    `rank` the loader's (rank 0 logs)."""

    def __init__(self, names: Any, datasets: Callable[[], dict[str | None, Any]],
                 refuse: Callable[[str], None], rank: int = 0):
        """`datasets()`: the run's sources, as it serves them now."""
        self.names: list[DocumentName] | None = None
        self.datasets, self.rank = datasets, rank
        if names is not None:
            refuse("exclude")
            self.names = document_names(names)
            for name in self.names:
                source_of(name, datasets())
        self.due = self.names is not None

    def resumed(self) -> None:
        """A state was loaded: the names are excluded again from its step (those it holds
        already count as repeated)."""
        self.due = self.names is not None

    def apply(self, exclude: Callable[[Resolved], None]) -> None:
        """Exclude the names now, if they are due."""
        if self.due and self.names is not None:
            self.due = False
            exclude(resolve(self.names, self.datasets(), self.rank == 0))


def resolve(names: list[DocumentName], datasets: dict[str | None, Any], log: bool = True
            ) -> Resolved:
    """Each source's (document numbers, names given, names that matched none) for `names`;
    with several sources, each name says its source (a trace record's `source`); the names
    of a source the mixture does not have (one dropped) are counted in one warning (`log`:
    rank 0's)."""
    grouped: dict[str | None, list[DocumentName]] = {}
    others: dict[str, int] = {}  # names of sources the mixture does not have
    for name in names:
        source = source_of(name, datasets)
        if source is not None and source not in datasets:
            others[source] = others.get(source, 0) + 1
            continue
        grouped.setdefault(source, []).append(name)
    if others and log:
        logger.warning("exclude: %d name(s) of sources this mixture does not have (%s): "
                       "nothing of theirs is served, nothing to exclude", sum(others.values()),
                       ", ".join(f"{source}: {count}" for source, count in sorted(others.items())))
    resolved: Resolved = {}
    for source, given in grouped.items():
        found, missing = DocumentsByName(datasets[source])(given)
        resolved[source] = (found, len(given), missing)
    return resolved


def source_of(name: DocumentName, datasets: dict[str | None, Any]) -> str | None:
    """The source `name` belongs to: the one dataset's, or its `source`."""
    if list(datasets) == [None]:
        return None
    source = name.get("source") if isinstance(name, dict) else None
    if source is None:
        raise ConfigError(f"exclude: {name!r} names no source; a mixture's documents are "
                          "named as `raypipe trace` records them, with their 'source' "
                          f"(one of {sorted(map(str, datasets))})")
    return str(source)
