"""A run's data when its output gained units: the units it had, in its order, then the added.

Invariant: a run numbers documents in the order of the units it began with (the output's
kept unit order, `LoaderState.view`: raypipe.io.views), then, for each `UnitsAdded` its state
records, the units of that later order it did not hold, in that order; so every document
keeps its number, the added are numbered after, and the run's data is a pure function of
what the state records and the output's kept orders. A unit the run held that the output
no longer holds is refused naming it, and so is one rewritten (its files differ from the
digests kept with the order). Added units are served from the epoch after the one the
run stands in (from that one where it has served none of it yet: `Cursor.begun`, which a
phase begun by an earlier join counts as under way); under units_join "epoch" (the default)
they also join the rest of the epoch in progress, shuffled in among what it had not served
(a phase: raypipe.sampling.plans.continued_order). Cost: one manifest's units
and shards, reordered, once per loader; one small read per kept order the state names.
The digests that name a rewritten unit are computed only when a resume's fingerprint
differs (8.7 us a unit).
"""

from __future__ import annotations

from dataclasses import dataclass, replace

from raypipe.dataset import BatchDataset, TokenDataset, open_kind
from raypipe.errors import FormatError, StateError
from raypipe.io.records import Manifest
from raypipe.io.states import UnitsAdded
from raypipe.io.views import read_view, rewritten_unit, unit_names, view_key, view_manifest

__all__ = ["RunData", "UnitsAdded"]


@dataclass(frozen=True)
class RunData:
    """The data of a run: the output's manifest, the key of the unit order the run began
    with, the units it gained (each with the epoch it is served from), and its dataset:
    the output's units in the run's order."""

    output: Manifest
    view: str
    added: tuple[UnitsAdded, ...]
    dataset: TokenDataset | BatchDataset

    @classmethod
    def of(cls, dataset: TokenDataset | BatchDataset) -> RunData:
        """A run's data when it begins: the output's units in its manifest's order."""
        return cls(dataset.manifest, view_key(unit_names(dataset.manifest)), (), dataset)

    def as_saved(self, view: str, added: tuple[UnitsAdded, ...]) -> RunData:
        """The data of a run that began with unit order `view` and gained `added`, from
        this output (a unit it lacks, or an order it does not keep, is a StateError)."""
        data = RunData(self.output, view, added, self.dataset)
        if view == self.view and not added:
            return data
        return RunData(self.output, view, added, data.opened(data.names()))

    def names(self) -> list[str]:
        """The run's units, in its order."""
        names = list(self.kept(self.view, "the run began with"))
        held = set(names)
        for record in self.added:
            fresh = [name for name in self.kept(record.view, f"added at step {record.step}")
                     if name not in held]
            names += fresh
            held.update(fresh)
        return names

    def keeps(self, key: str) -> bool:
        """The output keeps unit order `key` (a run of it may have begun with it)."""
        return read_view(self.dataset.store, key, self.output) is not None

    def kept(self, key: str, what: str) -> list[str]:
        names = read_view(self.dataset.store, key, self.output)
        if names is None:
            raise StateError(f"{self.dataset.root}: the output does not keep the unit order "
                             f"{key} (the units {what}; raypipe.io.views keeps each "
                             "manifest's from this release on)")
        return names

    def opened(self, names: list[str]) -> TokenDataset:
        """The output's `names` units, in that order, as a dataset."""
        try:
            manifest = view_manifest(self.output, names, self.dataset.format_name)
        except FormatError as exc:
            raise StateError(f"{self.dataset.root}: {exc}") from None
        dataset = open_kind(self.dataset.store, TokenDataset.kind, self.dataset.format_name,
                            manifest=manifest, cache=self.dataset.cache)
        dataset.share_cache(self.dataset)  # (object storage: what was fetched stays used)
        return dataset

    def fresh(self, key: str | None = None) -> list[str]:
        """The units of the output's kept order `key` (None: the output's own) this data
        does not hold, in that order."""
        held = set(self.names())
        order = unit_names(self.output) if key is None else self.kept(key, "to add")
        return [name for name in order if name not in held]

    def grown(self, step: int, epoch: int, joins: bool = False, key: str | None = None
              ) -> RunData | None:
        """This data with the units of order `key` (None: the output's own) it does not
        hold added at global step `step`, served from epoch `epoch` on (`joins`: and the
        rest of the epoch before it from `step`); None where there are none."""
        names, fresh = self.names(), self.fresh(key)
        if not fresh:
            return None
        dataset = self.opened(names + fresh)
        record = UnitsAdded(step, key or view_key(unit_names(self.output)),
                            len(names) + len(fresh), dataset.num_documents, epoch, joins)
        return RunData(self.output, self.view, (*self.added, record), dataset)

    def with_output(self, output: Manifest) -> RunData:
        """This data, its units now found in `output` (a later manifest of the same
        output: a running job's, raypipe.io.live)."""
        return replace(self, output=output)

    @property
    def joins(self) -> tuple[tuple[int, int], ...]:
        """((step, documents served from it), ...) of the units that joined an epoch in
        progress."""
        return tuple((record.step, record.documents) for record in self.added if record.joins)

    def rewritten(self) -> str | None:
        """A unit of the run's data whose files differ from those the output kept with
        its order (None: none found)."""
        for key in (self.view, *(record.view for record in self.added)):
            unit = rewritten_unit(self.dataset.store, key, self.output,
                                  self.dataset.format_name)
            if unit is not None:
                return unit
        return None

    @property
    def served_from(self) -> tuple[tuple[int, int], ...]:
        """((first epoch, documents served from it), ...); none where nothing was added."""
        if not self.added:
            return ()
        units = {unit.name: unit.documents for unit in self.output.units}
        began = sum(units[name] for name in self.kept(self.view, "the run began with"))
        return ((0, began), *((record.epoch, record.documents) for record in self.added))
