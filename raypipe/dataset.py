"""A finished raypipe output opened through its manifest: shards of one format, in order.

Invariant: documents are numbered globally in manifest order (shard by shard); the
dataset fingerprint (manifest fingerprint + every shard's name, size and checksum) changes
whenever any shard file does. Shard readers open lazily, on first use (maps that hold no
file descriptor: raypipe.io.mapping), so opening a dataset of 10,000 shards reads only the
manifest (and checks each shard's file names, ~1 us a file), and any number of open shards
fits under a small open-file limit. The root may be a local directory or a URI
(raypipe.io.store): over object storage a shard opens from the node-local cache
(raypipe.io.cache) once its files arrived checked, and document lengths come from index files
alone where the format has them. Cost of `document_lengths()`: one pass over each shard's
index (Megatron .idx / NanoGPT .bos.idx), plus on object storage one download of each index
file (Megatron: the `.idx`'s lengths by one ranged GET, 4 bytes a document, and the
`.sums`). The dataset
opener (`open_format`, `open_kind`, `open_source`) picks the dataset class by the kind of
format (`DATASET_KINDS`: one dict lookup) and reads the manifest once when not given it.
"""

from __future__ import annotations

import hashlib
import json
from collections import OrderedDict
from collections.abc import Callable, Iterable, Iterator
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass
from functools import cached_property
from pathlib import Path
from typing import Any, ClassVar, TypeVar

import numpy as np

from raypipe.errors import FormatError
from raypipe.formats import FORMATS, ShardReader, batch_formats, document_formats, get_format
from raypipe.formats.base import (
    MASK_SIDECAR,
    MASK_SUMS_SIDECAR,
    lists_file,
    shard_file,
    shard_prefix,
)
from raypipe.io.cache import RangeCheck, ShardCache
from raypipe.io.checksums import SUMS_SUFFIX, CheckedTokens, StreamChecksums
from raypipe.io.manifest import MANIFEST_NAME, as_store, file_problem, read_manifest
from raypipe.io.mapping import map_file, token_view
from raypipe.io.ranged import BlockFile, BlockTokens, HeldBlock
from raypipe.io.records import FileEntry, Manifest, ShardEntry
from raypipe.io.store import Store, dataset_key

T = TypeVar("T")
PREFETCH_THREADS = 16  # fetches in flight a process (a small block costs a round trip)
PREFETCH_SHARE = 0.75  # of the cache budget, open and pending shards together
OPEN_SHARE = 0.5  # ... open shards alone (past it the least recently used are closed)


@dataclass
class StreamWindow:
    """A window of the global token stream: tokens, each token's global metadata id (-1
    where the format has none) and the records of those ids."""

    tokens: np.ndarray
    metadata_ids: np.ndarray
    records: dict[int, Any]

    def record_of(self, position: int) -> Any:
        return self.records.get(int(self.metadata_ids[position]))


OPEN_TRIES = 5  # fetches of a shard other processes keep evicting before it opens
TOKEN_STARTS_KEPT = 64  # ranged shards whose document token offsets a process keeps


@dataclass(frozen=True)
class ShardBlocks:
    """The blocks a dataset is fetched in: block b is global documents [starts[b],
    stops[b]) of shard shards[b]; a shard's blocks are consecutive and cover it whole."""

    shards: np.ndarray
    starts: np.ndarray
    stops: np.ndarray

    @classmethod
    def of(cls, shards: np.ndarray, starts: np.ndarray,
           document_offsets: np.ndarray) -> ShardBlocks:
        """From each block's shard and first document (a shard's first block snapped to
        the shard's first document: a split's blocks skip held-out ones)."""
        shards = np.asarray(shards, dtype=np.int64)
        starts = np.asarray(starts, dtype=np.int64).copy()
        firsts = np.ones(len(shards), dtype=bool)
        firsts[1:] = shards[1:] != shards[:-1]
        starts[firsts] = document_offsets[shards[firsts]]
        stops = np.append(starts[1:], 0)
        lasts = np.append(firsts[1:], True)
        stops[lasts] = document_offsets[shards[lasts] + 1]
        return cls(shards, starts, stops)

    def in_shard(self, shard: int) -> np.ndarray:
        """The blocks of shard `shard`."""
        first, stop = np.searchsorted(self.shards, [shard, shard + 1])
        return np.arange(first, stop, dtype=np.int64)

    def of_documents(self, ids: np.ndarray) -> np.ndarray:
        return np.searchsorted(self.starts, ids, side="right") - 1


class RangedShard(ShardReader):
    """A shard read a block at a time: its documents' token offsets from its index, its
    tokens and (chat data) its loss mask `BlockTokens` (raypipe.io.ranged); `units`: its
    blocks' numbers."""

    def __init__(self, tokens: BlockTokens, document_starts: np.ndarray, units: np.ndarray,
                 loss_mask: BlockTokens | None = None):
        self.tokens = tokens  # type: ignore[assignment]
        self.loss_mask = loss_mask  # type: ignore[assignment]
        self.document_starts = document_starts
        self.units = units

    def forget(self, keep: set[int]) -> None:
        """Unmap every block but those of `keep` (the dataset's block numbers): O(blocks
        it has mapped), so letting go costs nothing for the many shards open with none (a
        window draws its blocks from the whole corpus)."""
        def kept(index: int) -> bool:
            return int(self.units[index]) in keep

        self.tokens.forget(kept)
        if self.loss_mask is not None:
            self.loss_mask.forget(kept)

    @classmethod
    def from_manifest(cls, root: Path, shard: ShardEntry, section: Any,
                      tokenizer: Any) -> RangedShard:
        raise NotImplementedError("a ranged shard opens through its dataset")


def adjacent_runs(spans: list[tuple[int, tuple[int, int]]]
                  ) -> list[list[tuple[int, tuple[int, int]]]]:
    """(unit, (start, stop)) spans of one file grouped into runs whose bytes follow each
    other (each run one GET), in the file's order."""
    runs: list[list[tuple[int, tuple[int, int]]]] = []
    for unit, span in sorted(spans, key=lambda unit_span: unit_span[1]):
        if runs and runs[-1][-1][1][1] == span[0]:
            runs[-1].append((unit, span))
        else:
            runs.append([(unit, span)])
    return runs


class ShardSet:
    """The shards of one format of an output, opened lazily through the registry.

    Local outputs: each opened shard's files are first checked against the manifest (a stat
    each), then its reader's counts. Outputs on object storage: a shard's files come into the
    node-local `cache` (size and sha256 checked on arrival) before its reader opens them;
    `prefetch` fetches shards ahead on background threads while open and pending shards hold
    under PREFETCH_SHARE of the budget, and the least recently used open shards are closed
    past OPEN_SHARE, so eviction can reclaim their space. Given a loader's blocks
    (`use_blocks`: the windowed shuffle's), the units fetched are blocks: a shard of several
    blocks is read a block at a time by ranged reads (`RangedShard`), within the process's
    `hold_bytes`."""

    kind: ClassVar[str] = ""  # the kind of format it opens (raypipe.formats: Format.kind)
    # what a converter reading it as documents should be told (None: nothing)
    read_as_documents_note: ClassVar[str | None] = None

    def __init__(self, root: str | Path | Store, format_name: str, manifest: Manifest,
                 cache: ShardCache | None = None):
        self.store = as_store(root)
        self.root = self.store.uri
        self.manifest = manifest
        if format_name not in manifest.formats:
            raise FormatError(self.store.uri_of(MANIFEST_NAME), f"format {format_name!r} not "
                              "in this dataset", list(manifest.formats), format_name)
        self.format_name = format_name
        self.format = FORMATS[format_name]
        self.section = manifest.formats[format_name]
        self.shards: tuple[ShardEntry, ...] = self.section.shards
        for shard in self.shards:
            self._check_file_names(shard)
        self.tokenizer = manifest.tokenizer_for(format_name)  # its separators, its own
        self.bos_id: int | None = self.tokenizer.bos_id
        self.eos_id: int | None = self.tokenizer.eos_id
        self._readers: OrderedDict[int, Any] = OrderedDict()
        self.cache: ShardCache | None = None
        if self.store.local:
            self.local_root = self.store.root
        else:
            self.cache = cache or ShardCache()
            self.cache.kept_suffixes = tuple(getattr(self.format, "index_suffixes", ()))
            self.key = dataset_key(self.store.uri, json.dumps(
                manifest.to_json(), sort_keys=True).encode())
            self.local_root = self.cache.dataset_dir(self.key)
        self._fetching: dict[int, Future] = {}
        self._opening: int | None = None  # the shard a reader waits for (object storage)
        # object storage: the blocks a loader reads this dataset in (None: whole shards),
        # the blocks this process holds (fetched or on their way), and the one a reader
        # waits for
        self.blocks: ShardBlocks | None = None
        self.hold_bytes = 0  # under blocks: what this process holds and fetches at most
        self._held_blocks: dict[int, HeldBlock] = {}
        self._waited_block: int | None = None
        # blocks a reader fetched itself, no read-ahead having asked for them (a loader
        # asks for a step's blocks ahead: each of these is a fetch on its filling path)
        self.blocks_fetched_on_read = 0
        self._starts_kept: OrderedDict[int, np.ndarray] = OrderedDict()
        self._offsets_kept: OrderedDict[int, np.ndarray] = OrderedDict()  # samples' bytes
        self._decoded: tuple[int, tuple[np.ndarray, np.ndarray | None]] | None = None
        # ranged shards' block files' checksums, by (shard, file) (the latest kept)
        self._sums_kept: dict[tuple[int, str], StreamChecksums] = {}
        self._ranged: dict[int, bool] = {}  # shard -> read a block at a time (`ranged`)
        self._block_files_of: dict[int, tuple[BlockFile, ...]] = {}  # (`_block_files`)
        self.closes = 0  # shards closed so far: holders of shard arrays drop theirs on change
        self._pinned: dict[int, list[Path]] = {}
        self._pool: ThreadPoolExecutor | None = None

    @property
    def num_shards(self) -> int:
        return len(self.shards)

    def share_cache(self, earlier: ShardSet) -> bool:
        """Read through `earlier`'s cache directory (object storage: another manifest of the
        same output, a run's data grown by units) where every file the two both list is the
        same file (path, size, sha256): the files cached for it are this one's, not fetched
        again. True where it now does; O(files)."""
        if self.cache is None or earlier.cache is None or earlier.store.uri != self.store.uri:
            return False
        files = {entry.path: (entry.bytes, entry.sha256)
                 for shard in earlier.shards for entry in shard.files}
        if any(files.get(entry.path, (entry.bytes, entry.sha256)) != (entry.bytes,
                                                                     entry.sha256)
               for shard in self.shards for entry in shard.files):
            return False
        self.key, self.local_root = earlier.key, earlier.local_root
        return True

    def _check_file_names(self, shard: ShardEntry) -> None:
        """Before any shard opens (they open lazily): every file of the shard is
        `<directory>/<shard name><one of the format's suffixes>`, all in one directory inside
        the dataset. String checks only (~1 us a file), so a manifest naming a file its
        shard cannot own is refused when the dataset opens, not mid-epoch."""
        directory = None
        for entry in shard.files:
            head, _, tail = entry.path.rpartition("/")
            suffix = tail[len(shard.name):]
            parts = head.split("/") if head else []
            if (not tail.startswith(shard.name) or suffix not in self.format.suffixes
                    or entry.path.startswith("/") or ".." in parts or "" in parts
                    or (directory is not None and head != directory)):
                raise FormatError(self.store.uri_of(MANIFEST_NAME), f"shard {shard.name!r} "
                                  f"lists file {entry.path!r}", "<directory>/"
                                  f"{shard.name}{{{','.join(self.format.suffixes)}}}",
                                  entry.path)
            directory = head

    def _check_files(self, index: int) -> None:
        """Every file of the shard is the one committed (a stat each: size and modification
        time; a changed time is settled by sha256), so a shard that vanished or was edited
        since the manifest is refused, naming the file."""
        for entry in self.shards[index].files:
            problem = file_problem(self.store, entry)
            if problem is not None:
                raise FormatError(self.store.uri_of(entry.path), problem)

    # ----- object storage: fetching into the cache ---------------------------------------
    def _fetch(self, entries: tuple[FileEntry, ...], refresh: bool = False) -> list[Path]:
        """Fetch files into the cache, pinned (the caller unpins them)."""
        assert self.cache is not None
        paths: list[Path] = []
        try:
            for entry in entries:
                paths.append(self.cache.fetch(self.store, self.key, entry, pin=True,
                                              refresh=refresh))
        except BaseException:
            self.cache.unpin(paths)
            raise
        return paths

    # ----- object storage: blocks ---------------------------------------------------------
    def use_blocks(self, shards: np.ndarray, starts: np.ndarray, hold_bytes: int) -> None:
        """Read this dataset in blocks from now on (object storage): block b begins at
        global document `starts[b]` of shard `shards[b]` (raypipe.sampling.blocks). A shard
        of several blocks whose format finds a block's bytes from its index
        (`DocumentFormat.tokens_at`, or its samples' offsets: `samples`) is fetched a
        block at a time with ranged reads; the others whole. `prefetch`, `close_except`
        and `units_of_documents` then count in blocks, and this process holds at most
        `hold_bytes` of them (its share of the node cache: fetched ahead within it)."""
        if self.cache is None:
            return
        self.close()
        self.blocks = ShardBlocks.of(shards, starts, self.document_offsets)
        self.hold_bytes = hold_bytes
        self._ranged.clear()

    def unit_of_each(self, ids: np.ndarray) -> np.ndarray:
        """The unit of fetch that holds each of these global documents: its block
        (`use_blocks`), or its shard."""
        ids = np.asarray(ids, dtype=np.int64)
        if self.blocks is not None:
            return self.blocks.of_documents(ids)
        return np.searchsorted(self.document_offsets, ids, side="right") - 1

    def units_of_documents(self, ids: np.ndarray) -> np.ndarray:
        """The units of fetch that hold these global documents (each once)."""
        return np.unique(self.unit_of_each(ids))

    def ranged(self, shard: int) -> bool:
        """Shard `shard` is fetched a block at a time (object storage, blocks in use, the
        format ranged: `read_whole_because`, and more than one block, or one checked by
        the shard's `.sums`: its bytes one ranged GET, where fetched whole it would take a
        HEAD and a GET for each of its files; a shard of one block without a `.sums` is
        fetched whole, its sha256 checked); found once a shard (asked for every unit the
        next steps read)."""
        found = self._ranged.get(shard)
        if found is None:
            blocks = self.blocks
            found = self._ranged[shard] = (
                blocks is not None and self.reads_in_blocks(shard)
                and (len(blocks.in_shard(shard)) > 1
                     or lists_file(self.shards[shard], SUMS_SUFFIX)))
        return found

    def reads_in_blocks(self, shard: int) -> bool:
        """A block of the shard can be read without the rest of it (`read_whole_because`
        finds no reason it cannot)."""
        return self.read_whole_because(shard) is None

    def read_whole_because(self, shard: int) -> str | None:
        """Why the shard is read whole, never a block at a time, or None: a block's bytes
        are found from its lengths index (`DocumentFormat.tokens_at`) or from a sidecar of
        its samples' offsets the shard lists (`DocumentFormat.samples`: MDS shards not
        compressed), the shard lists that index (and the `.sums` where the format reads
        blocks only checked), and a loss mask sidecar (chat data) rides along only with
        its `.mask.sums` (outputs written before it had one are read whole)."""
        entry, fmt = self.shards[shard], self.format
        samples = getattr(fmt, "samples", None)
        suffixes = getattr(fmt, "index_suffixes", ())
        if getattr(fmt, "tokens_at", None) is None and samples is None:
            return f"format {self.format_name!r} finds no run of documents' bytes from an index"
        if samples is not None and not lists_file(entry, samples.offsets_suffix):
            return (f"it has no {samples.offsets_suffix} (its samples' bytes: compressed, or "
                    "written before raypipe wrote one)")
        if not self.lists_lengths_index(shard):
            return f"it has no {suffixes[0] if suffixes else 'lengths index'}"
        if lists_file(entry, MASK_SIDECAR) and not lists_file(entry, MASK_SUMS_SIDECAR):
            return (f"its {MASK_SIDECAR} has no {MASK_SUMS_SIDECAR} (written before raypipe "
                    "wrote one)")
        if getattr(fmt, "blocks_need_sums", False) and not lists_file(entry, SUMS_SUFFIX):
            return f"it has no {SUMS_SUFFIX} (written before raypipe wrote one)"
        return None

    def whole_shards_note(self) -> str | None:
        """Where a windowed shuffle fetches whole shards because some cannot be read a
        block at a time: how many, why (the first's reason), and the remedy; None where
        every shard can. O(files)."""
        whole = [(shard, reason) for shard in range(self.num_shards)
                 if (reason := self.read_whole_because(shard)) is not None]
        if not whole:
            return None
        shard, reason = whole[0]
        return (f"{self.root}: the windowed shuffle fetches whole shards, not blocks: "
                f"{len(whole):,} of {self.num_shards:,} shards cannot be read a block at a "
                f"time (the first, {self.shards[shard].name!r}: {reason}), so a window holds "
                "fewer, larger pieces of the corpus; a job rerun with this raypipe, or "
                f"`raypipe convert {self.root} <new output> --format {self.format_name}`, "
                "writes what blocks need")

    def lists_lengths_index(self, shard: int) -> bool:
        """The shard's document lengths can be read without its tokens: its format keeps a
        lengths index (the first of `index_suffixes`), the shard lists it, and the
        manifest counts the shard's tokens."""
        suffixes = getattr(self.format, "index_suffixes", ())
        entry = self.shards[shard]
        return bool(suffixes) and entry.tokens is not None and lists_file(entry, suffixes[0])

    @cached_property
    def reads_blocks_alone(self) -> bool:
        """A block of any shard can be read without the rest of it (on a bucket: by
        ranged GETs): every shard `reads_in_blocks`. O(files), once."""
        return all(self.reads_in_blocks(shard) for shard in range(self.num_shards))

    @cached_property
    def token_entry(self) -> np.dtype:
        """What the shards' token files hold a token (a stream record of 8 bytes; else the
        token: `DocumentFormat.entry_dtype`)."""
        return self.format.entry_dtype(self.section)

    @cached_property
    def block_itemsize(self) -> int:
        """Bytes a token counts for where blocks are cut (raypipe.sampling.blocks): its
        token file's entry where blocks are read alone and no loss mask rides along, so a
        block of `block_bytes` is that many bytes fetched; else (outputs read whole, chat
        data) the token's, the cut their states were saved with."""
        return (self.token_entry.itemsize
                if self.reads_blocks_alone and not getattr(self, "has_loss_mask", False)
                else np.dtype(self.section.dtype).itemsize)

    @cached_property
    def fetched_per_cut_byte(self) -> float:
        """Bytes a block fetches for each byte it counts where cut (`block_itemsize`): its
        token entries' and its loss mask's (a byte a token), where blocks are read alone;
        1 otherwise."""
        if not self.reads_blocks_alone:
            return 1.0
        if getattr(self.format, "samples", None) is not None:  # headers, ids, sources too
            cut = sum(shard.tokens or 0 for shard in self.shards) * self.block_itemsize
            return sum(shard.files[0].bytes for shard in self.shards) / max(cut, 1)
        mask = 1 if getattr(self, "has_loss_mask", False) else 0
        return (self.token_entry.itemsize + mask) / self.block_itemsize

    @cached_property
    def files_a_block(self) -> int:
        """The files a block is read from where blocks are read alone: its tokens', and
        chat data's loss mask sidecar beside them (a format's samples carry their mask)."""
        return 2 if (self.reads_blocks_alone and getattr(self, "has_loss_mask", False)
                     and getattr(self.format, "samples", None) is None) else 1

    def _prefetch_blocks(self, units: list[int]) -> None:
        """Fetch ahead, in the order given, while this process holds at most `hold_bytes`
        (`use_blocks`): the whole shards of blocks that are whole shards, and each run of
        adjacent blocks of a ranged shard in one ranged GET a block file (a task a run, in
        the order the runs are first needed, so blocks of one shard arrive side by side,
        not one after another), pinned here, all at once."""
        assert self.blocks is not None and self.cache is not None
        ranged: dict[int, list[int]] = {}
        held_now: dict[int, HeldBlock] = {}
        held = self._held_bytes()
        for unit in units:
            shard = int(self.blocks.shards[unit])
            if not self.ranged(shard):
                if shard in self._readers or shard in self._fetching:
                    continue
                held += self._open_bytes(shard)
                if held > self.hold_bytes:
                    break
                self._fetching[shard] = self._pool_submit(self._fetch,
                                                          self._files_to_open(shard))
                continue
            if unit in self._held_blocks or unit in held_now:
                continue
            block = self._block_to_hold(unit)
            held += block.bytes
            if held > self.hold_bytes:
                break
            held_now[unit] = block
            ranged.setdefault(shard, []).append(unit)
        if ranged:
            self._hold(held_now)
            self._fetch_blocks(ranged, {unit: at for at, unit in enumerate(units)})

    def _block_to_hold(self, unit: int) -> HeldBlock:
        """What holding block `unit` (its shard ranged) takes: its files' paths."""
        assert self.blocks is not None and self.cache is not None
        files = self._block_files(int(self.blocks.shards[unit]))
        spans = self._block_spans(unit, files)
        return HeldBlock(tuple(self.cache.range_path(self.key, file.entry, *span)
                               for file, span in zip(files, spans, strict=True)),
                         sum(stop - start for start, stop in spans))

    def _hold(self, blocks: dict[int, HeldBlock]) -> None:
        """Hold these blocks: their files pinned (one change of this process's pins)."""
        assert self.cache is not None
        self._held_blocks.update(blocks)
        self.cache.pin([path for block in blocks.values() for path in block.paths])

    def _fetch_blocks(self, ranged: dict[int, list[int]], needed_at: dict[int, int]) -> None:
        """Fetch held blocks of ranged shards: each run of adjacent blocks of a file in
        one ranged GET (a task a run and file, in the order the runs are first needed)."""
        assert self.blocks is not None
        runs = sorted(((shard, run) for shard, wanted in ranged.items()
                       for run in adjacent_runs([(unit, self._block_spans(
                           unit, self._block_files(shard))[0]) for unit in wanted])),
                      key=lambda shard_run: min(needed_at[unit] for unit, _ in shard_run[1]))
        checks = {(shard, file.entry.path): self._range_check(shard, file)  # made here:
                  for shard in ranged for file in self._block_files(shard)}  # no state shared
        for shard, run in runs:
            files = self._block_files(shard)
            spans = [self._block_spans(unit, files) for unit, _ in run]
            for number, file in enumerate(files):
                fetch = self._pool_submit(self._fetch_ranges, file,
                                          [of_unit[number] for of_unit in spans],
                                          checks[(shard, file.entry.path)])
                for unit, _ in run:
                    self._held_blocks[unit].fetches.append(fetch)

    def arrived(self, units: Iterable[int]) -> bool:
        """Every one of these units (blocks, `use_blocks`) is here or not awaited: a
        reader needs no request to read it (locally, always)."""
        if self.cache is None or self.blocks is None:
            return True
        for unit in units:
            shard = int(self.blocks.shards[unit])
            if not self.ranged(shard):
                fetching = self._fetching.get(shard)
                if shard not in self._readers and (fetching is None or not fetching.done()):
                    return False
                continue
            held = self._held_blocks.get(unit)
            if held is None or not held.arrived:
                return False
        return True

    def _fetch_ranges(self, file: BlockFile, ranges: list[tuple[int, int]],
                      check: RangeCheck | None) -> list[Path]:
        """Fetch byte ranges of a shard's block file (pinned by the caller), each checked
        on arrival by `check` (`_range_check`: the file's `.sums`, where it has one)."""
        assert self.cache is not None
        return self.cache.fetch_ranges(self.store, self.key, file.entry, ranges, check)

    def _block_files(self, shard: int) -> tuple[BlockFile, ...]:
        """The files a ranged shard is read from a block at a time: its token file (its
        samples' file, where the format's samples carry their loss mask), and (chat data)
        its loss mask sidecar (found once a shard)."""
        files = self._block_files_of.get(shard)
        if files is None:
            entry = self.shards[shard]
            if getattr(self.format, "samples", None) is not None:
                files = (BlockFile(entry.files[0], int(self._sample_offsets(shard)[0]), 1,
                                   shard_file(entry, SUMS_SUFFIX), samples=True),)
                self._block_files_of[shard] = files
                return files
            files = (BlockFile(entry.files[0], int(self.format.tokens_at),
                               self.token_entry.itemsize, self._sums_entry(shard)),)
            mask = shard_file(entry, MASK_SIDECAR)
            if mask is not None:
                files += (BlockFile(mask, 0, 1, shard_file(entry, MASK_SUMS_SIDECAR)),)
            self._block_files_of[shard] = files
        return files

    def _range_check(self, shard: int, file: BlockFile) -> RangeCheck | None:
        """What checks a fetched byte range of one of the shard's block files (None: its
        length alone, an output without `.sums`)."""
        if file.sums is None:
            return None
        kept = (shard, file.entry.path)
        sums = self._sums_kept.get(kept)
        if sums is None:
            cuts = (self._token_starts(shard) * self.block_itemsize if file.samples
                    else None)  # a format's samples: units cut by their tokens' bytes
            sums = self._stream_checksums(file.sums, file.entry,
                                          self._document_bytes(shard, file) - file.at, cuts)
            if len(self._sums_kept) >= 2 * TOKEN_STARTS_KEPT:
                self._sums_kept.pop(next(iter(self._sums_kept)), None)
            self._sums_kept[kept] = sums
        return lambda data, first: sums.problem(data, first - file.at)

    def _block_spans(self, unit: int, files: tuple[BlockFile, ...]) -> list[tuple[int, int]]:
        """Block `unit`'s bytes in each of its shard's block files."""
        assert self.blocks is not None
        shard = int(self.blocks.shards[unit])
        base = self.document_offsets[shard]
        first, stop = int(self.blocks.starts[unit] - base), int(self.blocks.stops[unit] - base)
        return [self._documents_span(shard, file, first, stop) for file in files]

    def _documents_span(self, shard: int, file: BlockFile, first: int,
                        stop: int) -> tuple[int, int]:
        """The bytes of the shard's documents [first, stop) in its block file `file`."""
        if file.samples:
            offsets = self._sample_offsets(shard)
            return int(offsets[first]), int(offsets[stop])
        starts = self._token_starts(shard)
        return file.span(int(starts[first]), int(starts[stop]))

    def _document_bytes(self, shard: int, file: BlockFile) -> np.ndarray:
        """int64[D + 1]: where each of the shard's documents begins in block file `file`,
        and the file's end."""
        if file.samples:
            return self._sample_offsets(shard)
        return file.at + self._token_starts(shard) * file.itemsize

    def _sample_offsets(self, shard: int) -> np.ndarray:
        """int64[D + 1] byte offsets of a ranged shard's samples in its token file, from
        the sidecar that lists them (`DocumentFormat.samples`; an index file: fetched with
        the lengths, checked against the shard's documents and its file's size; the
        latest TOKEN_STARTS_KEPT shards' kept)."""
        offsets = self._offsets_kept.get(shard)
        if offsets is None:
            entry = shard_file(self.shards[shard], self.format.samples.offsets_suffix)
            offsets = self._read_index(entry, lambda path: np.fromfile(path, "<u4")
                                       ).astype(np.int64)
            count = int(self.document_offsets[shard + 1] - self.document_offsets[shard])
            size = self.shards[shard].files[0].bytes
            if len(offsets) != count + 1 or offsets[-1] != size or np.any(np.diff(offsets) <= 0):
                raise FormatError(self.store.uri_of(entry.path), "sample offsets: increasing, "
                                  "one a document, then the data file's size",
                                  f"{count + 1} ending at {size}", f"{len(offsets)} "
                                  f"ending at {offsets[-1] if offsets.size else None}")
            if len(self._offsets_kept) >= TOKEN_STARTS_KEPT:
                self._offsets_kept.pop(next(iter(self._offsets_kept)))
            self._offsets_kept[shard] = offsets
        return offsets

    def _token_starts(self, shard: int) -> np.ndarray:
        """int64[D + 1] token offsets of a ranged shard's documents (from its index; the
        latest TOKEN_STARTS_KEPT shards' kept)."""
        starts = self._starts_kept.get(shard)
        if starts is None:
            lengths = self.shard_document_lengths(shard)
            starts = np.zeros(len(lengths) + 1, dtype=np.int64)
            np.cumsum(lengths, out=starts[1:])
            if len(self._starts_kept) >= TOKEN_STARTS_KEPT:
                self._starts_kept.pop(next(iter(self._starts_kept)))
            self._starts_kept[shard] = starts
        return starts

    def _block_path(self, unit: int, number: int) -> Path:
        """The local file of block `unit` in its shard's block file `number` (a reader
        needs it now): the prefetch's, else fetched here, each of its files (the training
        thread waits: `fetching_now` names it)."""
        assert self.blocks is not None and self.cache is not None
        held = self._held_blocks.get(unit)
        self._waited_block = unit
        try:
            if held is None:
                held = self._block_to_hold(unit)
                self._hold({unit: held})
                self.blocks_fetched_on_read += 1
                shard = int(self.blocks.shards[unit])
                files = self._block_files(shard)
                for file, span in zip(files, self._block_spans(unit, files), strict=True):
                    self._fetch_ranges(file, [span], self._range_check(shard, file))
            else:
                held.wait()
        finally:
            self._waited_block = None
        return held.paths[number]

    def _release_blocks(self, keep: set[int]) -> None:
        """Unpin the blocks outside `keep` whose fetch ended, and unmap them."""
        assert self.cache is not None
        gone = [unit for unit, held in self._held_blocks.items()
                if unit not in keep and held.arrived]
        if gone:
            self.cache.unpin([path for unit in gone for path in self._held_blocks.pop(unit).paths])
        for reader in self._readers.values():
            if isinstance(reader, RangedShard):
                reader.forget(keep)

    def _held_bytes(self) -> int:
        """Bytes this process holds or fetches: open and pending whole shards, and held
        blocks (a ranged shard's index files are not counted: the window budget set them
        apart for every shard before it sized `hold_bytes`)."""
        return (sum(self._open_bytes(i) for i in (*self._readers, *self._fetching)
                    if not self.ranged(i))
                + sum(held.bytes for held in self._held_blocks.values()))

    def prefetch(self, indices: Iterable[int]) -> None:
        """Start fetching these units (shards, or blocks once `use_blocks` was called) into
        the cache (object storage; no-op locally), while open and pending ones hold at
        most PREFETCH_SHARE of the cache's budget (a windowed shuffle holds the window it
        reads and the next)."""
        if self.cache is None:
            return
        if self.blocks is not None:
            self._prefetch_blocks([int(unit) for unit in indices])
            return
        self._prefetch_shards(indices)

    def _pool_submit(self, task: Any, *args: Any) -> Future:
        if self._pool is None:
            self._pool = ThreadPoolExecutor(PREFETCH_THREADS, "raypipe-fetch")
        return self._pool.submit(task, *args)

    def _prefetch_shards(self, indices: Iterable[int]) -> None:
        held = self._held_bytes()
        for index in indices:
            if index in self._readers or index in self._fetching:
                continue
            held += self._open_bytes(index)
            if held > self.held_bytes(PREFETCH_SHARE):
                break
            self._fetching[index] = self._pool_submit(self._fetch, self._files_to_open(index))

    def held_bytes(self, share: float) -> int:
        """`share` of the cache budget: what this process may hold open or pending (a
        windowed shuffle's windows are sized so that a node's ranks fit together:
        raypipe.sampling.plans)."""
        assert self.cache is not None
        return int(self.cache.budget_bytes * share)

    def fetching_now(self) -> list[str]:
        """The shards being fetched into the cache now: the one a reader waits to open
        first, then those fetched ahead and not done."""
        ahead = [index for index, future in list(self._fetching.items()) if not future.done()]
        waited = [] if self._opening is None else [self._opening]
        names = [self.shards[index].name for index in dict.fromkeys([*waited, *ahead])]
        blocks = [] if self._waited_block is None else [self._waited_block]
        blocks += [unit for unit, held in list(self._held_blocks.items()) if not held.arrived]
        return names + [self._block_name(unit) for unit in dict.fromkeys(blocks)]

    def _block_name(self, unit: int) -> str:
        assert self.blocks is not None
        shard = int(self.blocks.shards[unit])
        return f"{self.shards[shard].name} block {unit - int(self.blocks.in_shard(shard)[0])}"

    def cancel_queued_fetches(self) -> None:
        """Cancel the fetches not begun (a reader waiting on one is let go with a
        CancelledError); those in flight run on: `close` waits for them."""
        if self._pool is not None:
            self._pool.shutdown(wait=False, cancel_futures=True)

    def close(self) -> None:
        """Stop background fetches and close every open shard."""
        if self._pool is not None:
            self._pool.shutdown(wait=True, cancel_futures=True)
            self._pool = None
        for future in self._fetching.values():
            if future.done() and not future.cancelled() and future.exception() is None:
                self.cache.unpin(future.result())
        self._fetching.clear()
        if self.cache is not None:
            self._release_blocks(set())
        while self._readers:
            self._close_oldest()

    def _close_oldest(self) -> None:
        self._close(next(iter(self._readers)))

    def _close(self, index: int) -> None:
        del self._readers[index]
        self.closes += 1
        if self.cache is not None:
            self.cache.unpin(self._pinned.pop(index, []))

    def close_except(self, keep: Iterable[int]) -> None:
        """Close every open unit outside `keep` (object storage: a windowed shuffle's
        shards, or blocks, of windows already read), so the node's cache may evict them."""
        if self.cache is None:
            return
        kept = set(keep)
        if self.blocks is not None:
            self._release_blocks(kept)
            kept = {int(self.blocks.shards[unit]) for unit in kept}
        for index in [index for index in self._readers if index not in kept]:
            self._close(index)

    def lengths_range(self, index: int) -> tuple[FileEntry, int, int, np.dtype] | None:
        """Where the shard's document lengths lie in its lengths index, as one array
        (`DocumentFormat.lengths_at`): the index file, its byte range and dtype; None where
        the format has no such array or the shard lists no such file."""
        at = getattr(self.format, "lengths_at", None)
        entry = None if at is None else shard_file(self.shards[index], at[0])
        if entry is None:
            return None
        dtype = np.dtype(at[2])
        count = int(self.document_offsets[index + 1] - self.document_offsets[index])
        return entry, at[1], at[1] + count * dtype.itemsize, dtype

    def _open_index_entries(self, index: int) -> tuple[FileEntry, ...]:
        """The index files a loader fetches whole for a shard (at the open, and to read it
        a block at a time): every one but a lengths index read by its lengths' range."""
        suffixes = tuple(getattr(self.format, "index_suffixes", ()))
        ranged = self.lengths_range(index)
        skipped = None if ranged is None else ranged[0]
        return tuple(entry for entry in self.shards[index].files
                     if suffixes and entry.path.endswith(suffixes) and entry != skipped)

    def _ranged_lengths(self, index: int, entry: FileEntry, start: int, stop: int,
                        dtype: np.dtype) -> np.ndarray:
        """The shard's lengths from bytes [start, stop) of its index file (one ranged GET,
        cached and kept like the index files), checked against its manifest entry."""
        assert self.cache is not None
        if stop == start:
            return np.empty(0, dtype=dtype)
        path = self.cache.range_path(self.key, entry, start, stop)
        self.cache.pin([path])
        try:
            self.cache.fetch_ranges(self.store, self.key, entry, [(start, stop)])
            lengths = np.fromfile(path, dtype=dtype)
        finally:
            self.cache.unpin([path])
        shard = self.shards[index]
        if lengths.size != shard.documents or lengths.min() < 0 or (
                shard.tokens is not None and int(lengths.sum(dtype=np.int64)) != shard.tokens):
            raise FormatError(self.store.uri_of(entry.path), "document lengths (bytes "
                              f"[{start}, {stop})) against the manifest's documents and tokens",
                              f"{shard.documents} summing to {shard.tokens}",
                              f"{lengths.size} summing to {int(lengths.sum(dtype=np.int64))}")
        return lengths

    @cached_property
    def index_bytes_read(self) -> int:
        """The bytes of index every node reads at the open and keeps (on a bucket; the
        same figure locally, so a local copy sizes the windows a bucket run does): each
        shard's index files, a lengths index by its lengths' range alone."""
        total = 0
        for index in range(self.num_shards):
            ranged = self.lengths_range(index)
            total += sum(entry.bytes for entry in self._open_index_entries(index))
            total += 0 if ranged is None else ranged[2] - ranged[1]
        return total

    def _shard_bytes(self, index: int) -> int:
        return sum(entry.bytes for entry in self.shards[index].files)

    def _files_to_open(self, index: int) -> tuple[FileEntry, ...]:
        """The files a shard's reader needs fetched: all, or a ranged shard's index files
        (`_open_index_entries`: its lengths come from their range)."""
        if not self.ranged(index):
            return self.shards[index].files
        return self._open_index_entries(index)

    def _open_bytes(self, index: int) -> int:
        """Bytes a shard holds open or pending: its files, or a ranged shard's index."""
        return sum(entry.bytes for entry in self._files_to_open(index))

    def reader(self, index: int, refresh: bool = False) -> Any:
        """The shard's reader; with `refresh`, a shard not open yet is fetched from object
        storage again even if cached (each file downloaded and checked once)."""
        reader = self._readers.get(index)
        if reader is not None:
            if self.cache is not None:
                self._readers.move_to_end(index)
            return reader
        return self._open(index, refresh)

    def _open(self, index: int, refresh: bool = False) -> Any:
        shard = self.shards[index]
        if self.cache is None:
            self._check_files(index)
            reader = self.format.reader.from_manifest(self.local_root, shard, self.section,
                                                      self.tokenizer)
        else:
            self._opening = index
            try:
                reader = self._open_cached(index, refresh)
            finally:
                self._opening = None
        self.check_reader(reader, shard)
        if not isinstance(reader, RangedShard):
            self._check_reads(index, reader)
        self._readers[index] = reader
        if self.cache is not None:
            self._close_over_budget()
        return reader

    def _sums_entry(self, index: int) -> FileEntry | None:
        """The shard's `.sums` file (its token file's checksums), where the format finds a
        document's bytes from its index and the shard has one (older outputs do not)."""
        if getattr(self.format, "tokens_at", None) is None:
            return None
        return shard_file(self.shards[index], SUMS_SUFFIX)

    def _stream_checksums(self, sums: FileEntry, checked: FileEntry,
                          document_bytes: np.ndarray,
                          cuts: np.ndarray | None = None) -> StreamChecksums:
        """The checksums `sums` of file `checked`, whose documents start at these bytes
        (`cuts`: where its units are cut, raypipe.io.checksums)."""
        label = self.store.uri_of(checked.path)
        return self._read_index(sums, lambda path: StreamChecksums(path, document_bytes,
                                                                   label, cuts))

    def _read_index(self, entry: FileEntry, read: Callable[[Path], T]) -> T:
        """`read` of an index file's local path (on object storage: cached, checked on
        arrival, evicted last, and pinned until read: a cache whose working set passes
        its budget would otherwise evict it in the fetch's own eviction; fetched again
        where a process that did not see the pin evicted it before it was read)."""
        if self.cache is None:
            return read(self.local_root / entry.path)
        path = self.cache.fetch(self.store, self.key, entry, pin=True)
        try:
            return read(path)
        except FileNotFoundError:
            self.cache.unpin([path])
            path = self.cache.fetch(self.store, self.key, entry, pin=True, refresh=True)
            return read(path)
        finally:
            self.cache.unpin([path])

    def _check_reads(self, index: int, reader: Any) -> None:
        """Check every token (and loss mask byte) the reader serves against the shard's
        `.sums` (`.mask.sums`), each checksum unit on its first read
        (raypipe.io.checksums): an altered byte is refused, naming the file, before it is
        served. A shard without one keeps its open's checks."""
        sums = self._sums_entry(index)
        if sums is None:
            return
        starts = np.zeros(reader.num_documents + 1, dtype=np.int64)
        np.cumsum(reader.document_lengths, out=starts[1:])
        entries = np.asarray(reader.token_entries).view(np.ndarray)
        shard = self.shards[index]
        reader.tokens = CheckedTokens(entries, self._stream_checksums(
            sums, shard.files[0], starts * entries.dtype.itemsize))
        mask, mask_sums = shard_file(shard, MASK_SIDECAR), shard_file(shard, MASK_SUMS_SIDECAR)
        if reader.loss_mask is not None and mask is not None and mask_sums is not None:
            reader.loss_mask = CheckedTokens(np.asarray(reader.loss_mask).view(np.ndarray),
                                             self._stream_checksums(mask_sums, mask, starts))

    def _open_cached(self, index: int, refresh: bool) -> Any:
        """The reader of a shard fetched into the cache. Pins are this process's own, so a
        file another process's eviction removed after the fetch (a prefetched shard waits
        unopened) is fetched again, up to OPEN_TRIES times."""
        assert self.cache is not None
        shard = self.shards[index]
        future = self._fetching.pop(index, None)
        if future is not None and refresh:  # an earlier fetch: fetched again below
            self.cache.unpin(future.result())
            future = None
        paths = (future.result() if future is not None
                 else self._fetch(self._files_to_open(index), refresh))
        for attempt in range(OPEN_TRIES):
            try:
                reader = (self._ranged_reader(index) if self.ranged(index) else
                          self.format.reader.from_manifest(self.local_root, shard,
                                                           self.section, self.tokenizer))
            except (FormatError, FileNotFoundError):
                lost = self.cache.note_lost(paths)
                self.cache.unpin(paths)
                if not lost or attempt == OPEN_TRIES - 1:
                    raise
                paths = self._fetch(shard.files)
                continue
            self._pinned[index] = paths
            return reader
        raise AssertionError("unreachable")

    def _ranged_reader(self, index: int) -> RangedShard:
        """A ranged shard's reader: its index, and its tokens (and loss mask) a block at a
        time: maps of its block files' ranges, or a format's samples decoded."""
        assert self.blocks is not None
        starts = self._token_starts(index)
        units = self.blocks.in_shard(index)
        base = self.document_offsets[index]
        cuts = np.append(starts[self.blocks.starts[units] - base], starts[-1])
        files = self._block_files(index)
        for file in files:
            expected = self._documents_span(index, file, 0, len(starts) - 1)[1]
            if file.entry.bytes != expected:
                raise FormatError(self.store.uri_of(file.entry.path), "file size implied by "
                                  "the index differs from the manifest's", file.entry.bytes,
                                  expected)
        if files[0].samples:
            tokens, mask = (BlockTokens(cuts, dtype, lambda block, count, column=column:
                                        self._decoded_block(int(units[block]), count)[column])
                            for column, dtype in enumerate((np.dtype(self.section.dtype),
                                                            np.dtype(np.uint8))))
            return RangedShard(tokens, starts, units, mask if self.has_loss_mask else None)
        tokens, *masks = (BlockTokens(cuts, token_view(np.empty(0, entry)).dtype,
                                      lambda block, count, number=number, entry=entry:
                                      token_view(map_file(self._block_path(int(units[block]),
                                                                           number),
                                                          entry, 0, count)))
                          for number, entry in enumerate((self.token_entry,
                                                          np.dtype(np.uint8))[:len(files)]))
        return RangedShard(tokens, starts, units, masks[0] if masks else None)

    def _decoded_block(self, unit: int, count: int) -> tuple[np.ndarray, np.ndarray | None]:
        """Block `unit` of a format whose samples interleave headers with tokens: its
        `count` tokens and (chat data) their loss mask, decoded from its samples' bytes."""
        assert self.blocks is not None
        if self._decoded is not None and self._decoded[0] == unit:  # its mask, after tokens
            return self._decoded[1]
        shard = int(self.blocks.shards[unit])
        base = self.document_offsets[shard]
        offsets = self._sample_offsets(shard)[int(self.blocks.starts[unit] - base):
                                              int(self.blocks.stops[unit] - base) + 1]
        path = self._block_path(unit, 0)
        label = self.store.uri_of(self.shards[shard].files[0].path)
        tokens, mask = self.format.samples.decode(
            map_file(path, np.uint8), offsets[:-1] - offsets[0],
            np.dtype(self.section.dtype), self.has_loss_mask, label)
        if tokens.size != count:
            raise FormatError(label, f"tokens of samples [{offsets[0]}, {offsets[-1]}) "
                              "against the shard's lengths", count, tokens.size)
        self._decoded = (unit, (tokens, mask))
        return tokens, mask

    def _close_over_budget(self) -> None:
        assert self.cache is not None
        open_bytes = sum(self._open_bytes(index) for index in self._readers)
        while len(self._readers) > 1 and open_bytes > self.held_bytes(OPEN_SHARE):
            open_bytes -= self._open_bytes(next(iter(self._readers)))
            self._close_oldest()

    def check_reader(self, reader: Any, shard: ShardEntry) -> None:
        """Once per opened shard: its contents match its manifest entry."""
        reader.check_counts(shard, self.store.uri_of(shard.files[0].path))

    @property
    def has_loss_mask(self) -> bool:
        """Its shards carry a per-token loss mask (chat data in a format that holds one)."""
        return (self.manifest.tokenizer.chat_template_sha256 is not None
                and self.format.holds_loss_mask)

    @cached_property
    def fingerprint(self) -> str:
        """Changes whenever the manifest or any shard file of this format changes."""
        payload = {"fingerprint": self.manifest.fingerprint, "format": self.format_name,
                   "shards": [[s.name, [(f.path, f.bytes, f.sha256) for f in s.files]]
                              for s in self.shards]}
        return hashlib.sha256(json.dumps(payload, sort_keys=True).encode()).hexdigest()[:16]


def choose_document_format(root: Store, manifest: Manifest, format_name: str | None) -> str:
    """The document format to read: the one named, else the first the output has."""
    available = [name for name in document_formats() if name in manifest.formats]
    if format_name is None:
        if not available:
            raise FormatError(root.uri_of(MANIFEST_NAME), "no document format to read",
                              list(document_formats()), list(manifest.formats))
        return available[0]
    if format_name not in available:
        raise FormatError(root.uri_of(MANIFEST_NAME), f"format {format_name!r} is not a document "
                          "format of this dataset", available, format_name)
    return format_name


# a document (or a batch format's record) as a converter reads it: its tokens and, for chat
# data, its loss mask
Document = tuple[np.ndarray, np.ndarray | None]


class TokenDataset(ShardSet):
    """The documents of one document format (megatron, nanogpt or stream) of an output."""

    kind = "documents"

    def __init__(self, root: str | Path | Store, format_name: str | None = None,
                 manifest: Manifest | None = None, cache: ShardCache | None = None):
        store = as_store(root)
        manifest = manifest or read_manifest(store)
        super().__init__(store, choose_document_format(store, manifest, format_name),
                         manifest, cache)
        self.format_options = self.format.options(self.section.options)

    def reader(self, index: int, refresh: bool = False) -> ShardReader:
        return super().reader(index, refresh)

    def documents(self) -> TokenDataset:
        """The documents this output's rows are cut from: its own."""
        return self

    def shard_documents(self) -> Iterator[tuple[str, Iterator[Document]]]:
        """(shard name, its documents with their loss masks) per shard, in order."""
        for index in range(self.num_shards):
            yield self.shards[index].name, self._documents_of(self.reader(index))

    @staticmethod
    def _documents_of(reader: ShardReader) -> Iterator[Document]:
        starts, mask = reader.document_starts, reader.loss_mask
        for index in range(reader.num_documents):
            first, stop = int(starts[index]), int(starts[index + 1])
            yield reader.tokens[first:stop], None if mask is None else mask[first:stop]

    @cached_property
    def shard_document_counts(self) -> np.ndarray:
        return np.array([s.documents for s in self.shards], dtype=np.int64)

    @cached_property
    def shard_token_counts(self) -> np.ndarray:
        return np.array([s.tokens for s in self.shards], dtype=np.int64)

    @property
    def num_documents(self) -> int:
        return int(self.shard_document_counts.sum())

    @property
    def num_tokens(self) -> int:
        return int(self.shard_token_counts.sum())

    @property
    def served_tokens(self) -> int:
        """Tokens an epoch over every document serves from: all of them."""
        return self.num_tokens

    def shard_prefix(self, index: int) -> Path:
        """The local path prefix of a shard's files (in the cache for object storage)."""
        if self.cache is not None:
            self.reader(index)
        return shard_prefix(self.local_root, self.shards[index])

    def shard_document_lengths(self, index: int) -> np.ndarray:
        """One shard's document lengths. A shard not open yet is read from its index files
        alone where the shard lists them (Megatron .idx, NanoGPT .bos.idx, stream and MDS
        .lengths: ~1% of its bytes;
        the token file is checked when the shard opens for reading)."""
        shard = self.shards[index]
        if index in self._readers or not self.lists_lengths_index(index):
            return self.reader(index).document_lengths
        if self.cache is None:
            self._check_files(index)
            return self.format.reader.index_document_lengths(self.local_root, shard,
                                                             self.tokenizer)
        paths = self._fetch(self._open_index_entries(index))  # kept for the blocks' reads
        try:
            ranged = self.lengths_range(index)
            if ranged is not None:
                return self._ranged_lengths(index, *ranged)
            return self.format.reader.index_document_lengths(self.local_root, shard,
                                                             self.tokenizer)
        finally:
            self.cache.unpin(paths)

    def document_lengths(self) -> np.ndarray:
        """int64 length of every document, in global order."""
        parts = [self.shard_document_lengths(i) for i in range(self.num_shards)]
        return np.concatenate(parts).astype(np.int64) if parts else np.empty(0, np.int64)

    @cached_property
    def document_offsets(self) -> np.ndarray:
        return np.concatenate([[0], np.cumsum(self.shard_document_counts)]).astype(np.int64)

    def document_starts_global(self, index: int) -> int:
        """Global token offset of document `index`."""
        shard = int(np.searchsorted(self.document_offsets, index, side="right")) - 1
        local = index - int(self.document_offsets[shard])
        return int(self.token_offsets[shard]) + int(self.reader(shard).document_starts[local])

    def document_loss_mask(self, index: int) -> np.ndarray | None:
        """Document `index`'s loss mask (uint8 per token; None: the data has none)."""
        if not self.has_loss_mask:
            return None
        shard = int(np.searchsorted(self.document_offsets, index, side="right")) - 1
        reader = self.reader(shard)
        starts = reader.document_starts
        local = index - int(self.document_offsets[shard])
        return np.asarray(reader.loss_mask[int(starts[local]):int(starts[local + 1])])

    def iter_documents(self) -> Iterator[np.ndarray]:
        for index in range(self.num_shards):
            reader = self.reader(index)
            for doc in range(reader.num_documents):
                yield reader.document(doc)

    @cached_property
    def record_offsets(self) -> np.ndarray:
        """Formats whose windows carry metadata: global id of each shard's first metadata
        record (each shard's count from its manifest entry)."""
        counts = [self.format.metadata_records(shard) for shard in self.shards]
        return np.concatenate([[0], np.cumsum(counts)]).astype(np.int64)

    @cached_property
    def token_offsets(self) -> np.ndarray:
        return np.concatenate([[0], np.cumsum(self.shard_token_counts)]).astype(np.int64)

    def window(self, start: int, length: int) -> StreamWindow:
        """Tokens [start, start + length) of the global stream with their metadata: per
        shard touched, one index read and one data read for the window's records."""
        if start < 0 or length < 0 or start + length > self.num_tokens:
            raise IndexError(f"window [{start}, {start + length}) outside "
                             f"[0, {self.num_tokens})")
        tokens = np.empty(length, dtype=np.int64)
        ids = np.full(length, -1, dtype=np.int64)
        records: dict[int, Any] = {}
        shard = int(np.searchsorted(self.token_offsets, start, side="right")) - 1
        filled = 0
        while filled < length:
            reader = self.reader(shard)
            local = start + filled - int(self.token_offsets[shard])
            count = min(length - filled, reader.num_tokens - local)
            tokens[filled:filled + count] = reader.tokens[local:local + count]
            shard_ids = getattr(reader, "metadata_ids", None)
            if shard_ids is not None and count:
                piece = np.asarray(shard_ids[local:local + count], dtype=np.int64)
                first, last = int(piece.min()), int(piece.max())
                base = int(self.record_offsets[shard])
                ids[filled:filled + count] = piece + base
                records.update(zip(range(base + first, base + last + 1),
                                   reader.read_records(first, last), strict=True))
            filled += count
            shard += 1
        return StreamWindow(tokens, ids, records)


class BatchDataset(ShardSet):
    """The shards of an output's batch format (LLMBATCH), in manifest order: batch i of the
    whole dataset."""

    kind = "batches"
    read_as_documents_note = ("a batch-format source yields its records (packed rows), not "
                              "the original documents")

    def __init__(self, root: str | Path | Store, manifest: Manifest | None = None,
                 cache: ShardCache | None = None, format_name: str | None = None):
        store = as_store(root)
        manifest = manifest or read_manifest(store)
        present = [name for name in batch_formats() if name in manifest.formats]
        if not present or (format_name is not None and format_name not in present):
            wanted = "" if format_name is None else f" {format_name!r}"
            raise FormatError(store.uri_of(MANIFEST_NAME), f"no batch format{wanted} in this "
                              "dataset", list(batch_formats()), list(manifest.formats))
        super().__init__(store, format_name or present[0], manifest, cache)
        self.options = self.format.recorded(self.section)
        self.batch_size, self.record_len = self.options.batch_size, self.options.record_len
        self.padded_tokens = self.options.padded_tokens
        counts = np.array([s.batches for s in self.shards], dtype=np.int64)
        self.batch_offsets = np.concatenate([[0], np.cumsum(counts)])

    def whole_shards_note(self) -> str | None:
        """None: pre-formed batches are read in whole shards by design, not cut into
        blocks of documents."""
        return None

    @property
    def served_tokens(self) -> int:
        """Tokens an epoch serves: the records' real tokens as their packing recorded them
        (0 where the output does not record them)."""
        return int(self.options.used_tokens or 0)

    @property
    def num_batches(self) -> int:
        return int(self.batch_offsets[-1])

    def check_reader(self, reader: Any, shard: ShardEntry) -> None:
        super().check_reader(reader, shard)
        if (reader.batch_size, reader.record_len) != (self.batch_size, self.record_len):
            raise FormatError(reader.path, "(batch_size, record_len) differ from the manifest",
                              (self.batch_size, self.record_len),
                              (reader.batch_size, reader.record_len))

    @cached_property
    def fingerprint(self) -> str:
        """As ShardSet's, in the payload shape it has always had (saved states stay valid)."""
        payload = {"fingerprint": self.manifest.fingerprint, "format": self.format_name,
                   "shards": [[f.path, f.bytes, f.sha256] for s in self.shards
                              for f in s.files]}
        return hashlib.sha256(json.dumps(payload, sort_keys=True).encode()).hexdigest()[:16]

    def _locate(self, index: int) -> tuple[Any, int]:
        """(the reader of batch `index`'s shard, its index there)."""
        shard = int(np.searchsorted(self.batch_offsets, index, side="right")) - 1
        return self.reader(shard), index - int(self.batch_offsets[shard])

    def batch(self, index: int) -> np.ndarray:
        reader, local = self._locate(index)
        return reader.batch(local)

    def padding(self, index: int, batch: np.ndarray | None = None) -> np.ndarray:
        """[B, T] bool: where batch `index`'s records hold padding (the format's rule)."""
        reader, local = self._locate(index)
        return reader.padding(local, batch)

    def pieces(self, index: int) -> Any:
        """Batch `index`'s record pieces (the format's BatchPieces; None where the file
        predates them)."""
        reader, local = self._locate(index)
        return reader.pieces(local)

    def loss_mask(self, index: int) -> np.ndarray | None:
        """[B, T] uint8: batch `index`'s per-token loss mask (chat data; None: every target
        is trained)."""
        reader, local = self._locate(index)
        return reader.loss_mask(local)

    def records(self, index: int) -> list[np.ndarray]:
        """Batch `index`'s records without their padding."""
        reader, local = self._locate(index)
        return reader.records(local)

    def iter_records(self) -> Iterator[np.ndarray]:
        """Every record in order, without its padding."""
        for index in range(self.num_batches):
            yield from self.records(index)

    def documents(self) -> TokenDataset:
        """The documents its records were packed from (the source format's shards)."""
        return TokenDataset(self.store, self.options.source_format, manifest=self.manifest,
                            cache=self.cache)

    def shard_documents(self) -> Iterator[tuple[str, Iterator[Document]]]:
        """(shard name, its records with their loss masks) per shard, in order."""
        for index, shard in enumerate(self.shards):
            batches = range(int(self.batch_offsets[index]), int(self.batch_offsets[index + 1]))
            yield shard.name, (record for batch in batches for record in self._records(batch))

    def _records(self, batch: int) -> Iterator[Document]:
        mask = self.loss_mask(batch)
        for row, record in enumerate(self.records(batch)):
            yield record, None if mask is None else mask[row, :record.size]


# the dataset class of each kind of format: how an output's format is opened
DATASET_KINDS: dict[str, type[TokenDataset] | type[BatchDataset]] = {
    TokenDataset.kind: TokenDataset, BatchDataset.kind: BatchDataset}


def open_kind(root: str | Path | Store, kind: str, format_name: str | None = None,
              manifest: Manifest | None = None, cache: ShardCache | None = None
              ) -> TokenDataset | BatchDataset:
    """An output's format of `kind` (the one named, else its first of that kind), opened."""
    store = as_store(root)
    return DATASET_KINDS[kind](store, format_name=format_name,
                               manifest=manifest or read_manifest(store), cache=cache)


def open_format(root: str | Path | Store, format_name: str, manifest: Manifest | None = None,
                cache: ShardCache | None = None) -> TokenDataset | BatchDataset:
    """Format `format_name` of an output, opened as its kind's dataset."""
    return open_kind(root, get_format(format_name).kind, format_name, manifest, cache)


def open_source(root: str | Path | Store, manifest: Manifest | None = None,
                format_name: str | None = None) -> TokenDataset | BatchDataset:
    """What a converter reads as documents: the format named, else the output's first
    document format, else its batch format (its records)."""
    store = as_store(root)
    manifest = manifest or read_manifest(store)
    if format_name is not None:
        return open_format(store, format_name, manifest)
    has_documents = any(name in manifest.formats for name in document_formats())
    return open_kind(store, TokenDataset.kind if has_documents else BatchDataset.kind,
                     manifest=manifest)
