"""Turn one text column batch into clean Python strings, counting what is skipped.

Invariant: every input row is either returned (in order) or counted under exactly one skip
reason: `null`, `empty`, `non_string` (the column is not string/binary), `invalid_utf8`
(binary column), `too_long` (over `max_document_chars`); the JSON-lines reader adds
`blank_line`, and turns a non-string text or one that is not valid Unicode into a null it
counts as `non_string` / `invalid_utf8` itself (raypipe.preprocess.jsonl).
rows = kept + sum(skipped).
Cost: vectorized pyarrow filters on the offsets for string columns (a text is measured in
characters only where its bytes exceed the limit); a per-row decode only for binary ones.
"""

from __future__ import annotations

from collections import Counter

import numpy as np
import pyarrow as pa
import pyarrow.compute as pc

STRING_TYPES = (pa.types.is_string, pa.types.is_large_string, pa.types.is_string_view)
BINARY_TYPES = (pa.types.is_binary, pa.types.is_large_binary, pa.types.is_binary_view)


def _is_any(kind: pa.DataType, predicates: tuple) -> bool:
    return any(predicate(kind) for predicate in predicates)


def can_hold_text(kind: pa.DataType) -> bool:
    """String or binary (plain, large, view), a dictionary of those, or all-null."""
    if pa.types.is_dictionary(kind):
        kind = kind.value_type
    return pa.types.is_null(kind) or _is_any(kind, STRING_TYPES + BINARY_TYPES)


def plain_text_column(column: pa.Array) -> pa.Array:
    """Dictionary-encoded columns decoded; view types cast to their large form (the compute
    kernels used below have no view kernels)."""
    if pa.types.is_dictionary(column.type):
        column = column.dictionary_decode()
    if pa.types.is_string_view(column.type):
        column = pc.cast(column, pa.large_string())
    elif pa.types.is_binary_view(column.type):
        column = pc.cast(column, pa.large_binary())
    return column


def decode_binary(column: pa.Array, skipped: Counter) -> pa.Array:
    """Binary -> string, with invalid UTF-8 rows turned into nulls and counted."""
    try:
        return pc.cast(column, pa.large_string())
    except pa.ArrowInvalid:
        texts = []
        for value in column.to_pylist():
            try:
                texts.append(None if value is None else value.decode("utf-8"))
            except UnicodeDecodeError:
                skipped["invalid_utf8"] += 1
                texts.append(None)
        return pa.array(texts, type=pa.large_string())


def clean_texts(column: pa.Array | pa.ChunkedArray,
                max_document_chars: int | None = None) -> tuple[list[str], Counter]:
    """Kept texts in row order, and the count of skipped rows by reason."""
    texts, _, skipped = clean_texts_with_rows(column, max_document_chars)
    return texts, skipped


def clean_texts_with_rows(column: pa.Array | pa.ChunkedArray, max_document_chars: int | None
                          = None) -> tuple[list[str], np.ndarray, Counter]:
    """Kept texts, their row indices in `column`, and skipped rows by reason."""
    kept, rows, skipped = clean_text_array(column, max_document_chars)
    return kept.to_pylist(), rows, skipped


def clean_text_array(column: pa.Array | pa.ChunkedArray, max_document_chars: int | None
                     = None) -> tuple[pa.Array, np.ndarray, Counter]:
    """As `clean_texts_with_rows`, the kept texts as an Arrow string array."""
    if isinstance(column, pa.ChunkedArray):
        column = column.combine_chunks()
    column = plain_text_column(column)
    rows = pa.array(np.arange(len(column), dtype=np.int64))
    skipped: Counter = Counter()
    if _is_any(column.type, BINARY_TYPES):
        nulls_before = column.null_count
        column = decode_binary(column, skipped)
        skipped["null"] += nulls_before
    elif _is_any(column.type, STRING_TYPES):
        skipped["null"] += column.null_count
    else:
        skipped["null"] += column.null_count
        skipped["non_string"] += len(column) - column.null_count
        return pa.array([], pa.large_string()), np.empty(0, np.int64), +skipped
    if column.null_count:
        valid = pc.is_valid(column)
        column, rows = column.filter(valid), rows.filter(valid)
    sizes = pc.binary_length(column)  # bytes, from the offsets: no pass over the text
    keep = pc.greater(sizes, 0)  # (no bytes: no characters)
    skipped["empty"] += len(column) - pc.sum(keep).as_py() if len(column) else 0
    if max_document_chars is not None:
        too_long = too_long_rows(column, sizes, max_document_chars)
        skipped["too_long"] += pc.sum(too_long).as_py() or 0
        keep = pc.and_(keep, pc.invert(too_long))
    if pc.all(keep).as_py() is not False:  # (all kept, or no row)
        return column, rows.to_numpy(zero_copy_only=False), +skipped
    return column.filter(keep), rows.filter(keep).to_numpy(zero_copy_only=False), +skipped


def too_long_rows(column: pa.Array, sizes: pa.Array, limit: int) -> pa.Array:
    """Which rows hold more than `limit` characters: a character is at least one byte, so
    only rows of more than `limit` bytes can, and only those are measured (a column of
    documents under the limit costs no pass over its text)."""
    candidates = pc.greater(sizes, limit)
    if not pc.any(candidates).as_py():
        return candidates
    measured = np.flatnonzero(candidates.to_numpy(zero_copy_only=False))
    over = pc.greater(pc.utf8_length(column.take(pa.array(measured))), limit)
    too_long = np.zeros(len(column), dtype=bool)
    too_long[measured[over.to_numpy(zero_copy_only=False)]] = True
    return pa.array(too_long)


def skip_reasons(column: pa.Array | pa.ChunkedArray, rows: np.ndarray,
                 max_document_chars: int | None) -> list[str]:
    """The skip reason of each of `rows` (rows `clean_texts_with_rows` did not keep), read
    from those rows alone: a 150 MB text is measured, never copied into Python."""
    picked = plain_text_column(column.take(pa.array(rows, pa.int64())))
    if isinstance(picked, pa.ChunkedArray):
        picked = picked.combine_chunks()
    if not _is_any(picked.type, STRING_TYPES + BINARY_TYPES):
        return ["null" if null else "non_string" for null in picked.is_null().to_pylist()]
    if _is_any(picked.type, BINARY_TYPES):
        bad: Counter = Counter()
        decoded = decode_binary(picked, bad)
        invalid = pc.and_(pc.is_null(decoded), pc.is_valid(picked)).to_pylist()
        picked = decoded
    else:
        invalid = [False] * len(picked)
    lengths = pc.utf8_length(picked).to_pylist()
    limit = max_document_chars if max_document_chars is not None else float("inf")
    return ["invalid_utf8" if wrong else "null" if length is None else "empty"
            if length == 0 else "too_long" if length > limit else "kept"
            for wrong, length in zip(invalid, lengths, strict=True)]
