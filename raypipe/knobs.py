"""Knobs: the fields a user sets, declared once where they belong (a loader mode's knobs, a
format's options, the plan's shared knobs), from which the CLI's options, the YAML keys and
the Python keywords are made.

Invariant: a knob is a dataclass field whose metadata holds its `help` (how the command
line says it), its `choices` (the values allowed, or a function listing them) and, for a
knob that only means something under one value of another (a shuffle's layout), `applies`
= (that knob, that value). A field without `help` is recorded, never set by a user. Cost:
none at run time.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from typing import Any


def knob(default: Any, help: str,
         choices: tuple[Any, ...] | Callable[[], tuple[Any, ...]] | None = None,
         applies: tuple[str, Any] | None = None) -> Any:
    """A field a user sets: its default, `help`, `choices`, and `applies`: (knob, value)
    under which alone it means something (None: always)."""
    return dataclasses.field(default=default, metadata={"help": help, "choices": choices,
                                                        "applies": applies})


def knob_fields_of(cls: type) -> tuple[dataclasses.Field, ...]:
    """The fields of dataclass `cls` that a user sets (declared with `knob`)."""
    return tuple(spec for spec in dataclasses.fields(cls) if "help" in spec.metadata)


def knob_choices(spec: dataclasses.Field) -> tuple[Any, ...] | None:
    """The values a knob allows (None: any of its type)."""
    choices = spec.metadata.get("choices")
    return choices() if callable(choices) else choices


def applies(spec: dataclasses.Field, record: Any) -> bool:
    """Knob `spec` means something in `record` (its `applies` condition holds there)."""
    condition = spec.metadata.get("applies")
    return condition is None or getattr(record, condition[0]) == condition[1]


def not_applying(record: Any, given: dict[str, Any]) -> list[tuple[str, tuple[str, Any]]]:
    """The knobs `given` (name: value) that `record` would ignore: each whose `applies`
    condition fails there, given a value other than its default; (name, condition)."""
    found = []
    for spec in dataclasses.fields(record):
        condition = spec.metadata.get("applies")
        if (spec.name in given and condition is not None and not applies(spec, record)
                and given[spec.name] != spec.default):
            found.append((spec.name, condition))
    return found
