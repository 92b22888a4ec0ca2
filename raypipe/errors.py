"""One exception family. Every message names the file (or row, or field) and what is wrong.

Invariant: code that detects bad input or a bad file raises one of these, never a bare
ValueError/KeyError, so the CLI can print it as one line and exit non-zero.
"""

from __future__ import annotations


class RaypipeError(Exception):
    """Base class of every error raypipe raises on purpose."""


class ConfigError(RaypipeError):
    """A config key or value is invalid, or a rerun's config differs from the output's."""


class InputError(RaypipeError):
    """An input corpus file, column or row cannot be used."""


BAD_FILES_NAMED = 20  # input errors one message names at most (the rest are counted)


def bad_input(errors: list[InputError], hint: str = "pass --skip-bad-files to skip such "
              "files and keep going") -> InputError:
    """One InputError naming several bad input files (each on its own line, the first
    BAD_FILES_NAMED of them); one error alone is itself."""
    if len(errors) == 1:
        return errors[0]
    named = "\n".join(f"  {error}" for error in errors[:BAD_FILES_NAMED])
    more = len(errors) - BAD_FILES_NAMED
    return InputError(f"{len(errors)} input files cannot be read ({hint}):\n{named}"
                      + (f"\n  and {more} more" if more > 0 else ""))


class FormatError(RaypipeError):
    """An output shard is corrupt, truncated or not of the format it claims."""

    def __init__(self, path: object, what: str, expected: object = None, actual: object = None):
        self.path = str(path)
        self.what = what
        self.expected = expected
        self.actual = actual
        detail = f"{self.path}: {what}"
        if expected is not None or actual is not None:
            detail += f" (expected {expected}, found {actual})"
        super().__init__(detail)

    def __reduce__(self) -> tuple:
        """Pickle by the constructor's own arguments (errors cross Ray's object store)."""
        return (type(self), (self.path, self.what, self.expected, self.actual))


class StorageError(RaypipeError):
    """An output file cannot be written (disk full, permissions, ...)."""


class StateError(RaypipeError):
    """A loader state does not belong to this dataset or these loader settings."""
