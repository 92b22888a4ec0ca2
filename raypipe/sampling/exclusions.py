"""Documents left out of a run from a step on: the run's exclusions, in its state.

Invariant: an exclusion is a set of documents (the dataset's numbers) and the global step it
begins at; the run's exclusions are appended in order of their steps and never change, so a
phase names the ones in force by their count (raypipe.sampling.schedule.Phase.excluded) and
every step stays a pure function of what the state records. An exclusion holds only
documents the run serves (a split's) that no earlier one excluded; the names that matched
none, and those excluded already, are counted, not dropped silently. The plans number a
split's documents from 0: `in_plan(k)` is the union of the first k exclusions in that
numbering. Cost: O(documents excluded) memory and a sort per exclusion; nothing per
document of the dataset.
"""

from __future__ import annotations

import logging
from collections.abc import Sequence

import numpy as np

from raypipe.io.states import Exclusion

logger = logging.getLogger("raypipe")

__all__ = ["Exclusion", "RunExclusions"]


class RunExclusions:
    """A run's exclusions, in order of their steps, and their unions in the numbering of the
    documents its plans number (`split_ids`: a split's dataset numbers, ascending; None:
    every document, `count` of them)."""

    def __init__(self, count: int, split_ids: np.ndarray | None = None):
        self.count, self.split_ids = count, split_ids
        self.records: list[Exclusion] = []
        self._unions: list[np.ndarray] = [np.zeros(0, dtype=np.int64)]  # plan numbering

    def __len__(self) -> int:
        return len(self.records)

    @property
    def documents(self) -> np.ndarray:
        """Every document excluded so far (the dataset's numbers, ascending)."""
        return self.to_dataset(self._unions[-1])

    def in_plan(self, excluded: int) -> np.ndarray:
        """The union of the first `excluded` exclusions, in the plans' numbering."""
        return self._unions[excluded]

    def to_plan(self, documents: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        """(the plans' numbers of `documents` the run serves, a mask of those it serves)."""
        documents = np.asarray(documents, dtype=np.int64)
        if self.split_ids is None:
            served = (documents >= 0) & (documents < self.count)
            return documents[served], served
        at = np.searchsorted(self.split_ids, documents)
        served = (at < self.split_ids.size) & (
            self.split_ids[np.minimum(at, max(self.split_ids.size - 1, 0))] == documents
            if self.split_ids.size else np.zeros(documents.shape, dtype=bool))
        return at[served], served

    def to_dataset(self, planned: np.ndarray) -> np.ndarray:
        return planned if self.split_ids is None else self.split_ids[planned]

    def add(self, step: int, documents: Sequence[int] | np.ndarray, named: int | None = None,
            not_found: int = 0) -> Exclusion | None:
        """Exclude `documents` (the dataset's numbers) from global step `step` on; `named`:
        how many names were given (default: one per document), `not_found`: of those, how
        many matched no document already. None (and nothing recorded) when none is left to
        exclude."""
        given = np.asarray(documents, dtype=np.int64)
        named = given.size + not_found if named is None else named
        unique = np.unique(given)
        planned, served = self.to_plan(unique)
        fresh = planned[~np.isin(planned, self._unions[-1])]
        repeated = int(planned.size - fresh.size) + int(given.size - unique.size)
        if fresh.size == 0:
            return None
        record = Exclusion(int(step), self.to_dataset(fresh).tolist(), int(named),
                           int(not_found + (~served).sum()), repeated)
        self.adopt(record)
        return record

    def adopt(self, record: Exclusion) -> None:
        """Append a recorded exclusion (a state's), as it was made."""
        if self.records and record.step < self.records[-1].step:
            raise ValueError(f"exclusion from step {record.step} before the last one's")
        planned, served = self.to_plan(np.array(record.documents, dtype=np.int64))
        if not served.all():
            missing = np.array(record.documents)[~served][:3].tolist()
            raise ValueError(f"documents {missing} of the exclusion from step {record.step} "
                             "are not among the documents this run serves")
        self.records.append(record)
        self._unions.append(np.union1d(self._unions[-1], planned))

    def pop(self) -> None:
        """Take the last exclusion back (one its run could not plan)."""
        self.records.pop()
        self._unions.pop()

    def log(self, record: Exclusion, root: str) -> None:
        """One line: what was excluded from which step, and what was not."""
        log = logger.warning if record.not_found else logger.info
        log("%s: %d document(s) excluded from step %d on (%d named: %d not found among the "
            "documents this loader serves, %d excluded already); %d excluded in all",
            root, len(record.documents), record.step, record.named, record.not_found,
            record.repeated, int(self._unions[-1].size))
