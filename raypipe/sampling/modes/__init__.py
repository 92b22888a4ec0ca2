"""Loader modes, one module each, registered by name (raypipe.sampling.modes.base).

Every module of this package but `base` is a mode and is imported here, so a new mode is one
new file. A mode of another package is a plugin: its distribution names the module that
registers it under the entry-point group `raypipe.loader_modes` (in pyproject.toml:
`[project.entry-points."raypipe.loader_modes"] mine = "my_package.my_mode"`), and it is
imported here after the built-in ones. Cost: the entry-point scan, ~76 ms once per process
(measured cold, in a venv of 164 distributions), nothing per unit or per batch."""

import importlib
import pkgutil
from importlib.metadata import entry_points

from raypipe.sampling.modes.base import (
    SHARED_KNOBS,
    BatchFiller,
    EpochPlan,
    LoaderMode,
    ModeKnobs,
    PlanInputs,
    PlanSpec,
    describe_shuffle,
    document_split,
    get_mode,
    knob,
    knob_differences,
    knob_fields,
    knob_owners,
    metadata_modes,
    mode_names,
    mode_serving,
    plan_knob_names,
    refuse_stray_knobs,
    register,
    waste_hints,
    windowed_modes,
)

PLUGIN_GROUP = "raypipe.loader_modes"

for _module in sorted(module.name for module in pkgutil.iter_modules(__path__)):
    if _module != "base":
        importlib.import_module(f"{__name__}.{_module}")
for _plugin in entry_points(group=PLUGIN_GROUP):
    _plugin.load()

from raypipe.sampling.modes.batches import RECORD_PLANS, record_plan  # noqa: E402

__all__ = ["PLUGIN_GROUP", "RECORD_PLANS", "SHARED_KNOBS", "BatchFiller", "EpochPlan", "LoaderMode",
           "ModeKnobs", "PlanInputs", "PlanSpec", "get_mode", "knob", "knob_differences",
           "knob_fields", "knob_owners", "metadata_modes", "mode_names",
           "plan_knob_names", "mode_serving", "describe_shuffle", "document_split", "record_plan",
           "refuse_stray_knobs", "register", "waste_hints", "windowed_modes"]
