"""Loader modes, one module each, registered by name (raypipe.sampling.modes.base).

Every module of this package but `base` is a mode and is imported here, so a new mode is one
new file."""

import importlib
import pkgutil

from raypipe.sampling.modes.base import (
    BatchFiller,
    LoaderMode,
    PlanInputs,
    PlanSpec,
    get_mode,
    metadata_modes,
    mode_names,
    preformed_mode,
    register,
    upgrade_knobs,
    waste_hints,
)

for _module in sorted(module.name for module in pkgutil.iter_modules(__path__)):
    if _module != "base":
        importlib.import_module(f"{__name__}.{_module}")

from raypipe.sampling.modes.llmbatch import RECORD_PLANS, record_plan  # noqa: E402

__all__ = ["RECORD_PLANS", "BatchFiller", "LoaderMode", "PlanInputs", "PlanSpec", "get_mode",
           "metadata_modes", "mode_names", "preformed_mode", "record_plan", "register",
           "upgrade_knobs", "waste_hints"]
