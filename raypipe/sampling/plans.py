"""What every epoch plan shares: its packing report, the layout of its shuffle, the
document permutation, and the knobs of the planner's cost.

Invariant: observation g of an epoch is the same on every rank and machine (each mode's
plan, raypipe.sampling.modes, is a pure function of (dataset, seed, epoch)); ranks never
communicate. Shuffles:
- `global` touches every shard in every stretch of the epoch.
- `windowed` (ShardWindows; raypipe.sampling.permute.WindowedPermutation) cuts the shards
  into blocks of whole documents of about `block_bytes` (raypipe.sampling.blocks), puts
  the blocks in a Feistel order and cuts it into windows of `window_blocks`, sized from
  the node cache's budget; the documents of a window are permuted among themselves
  (bestfit's packing blocks end where windows do), and the windows, split into `lanes`
  lanes (LaneOrder), are read a lane a rank (or, `lane_ranks` k, a lane by k consecutive
  ranks in turn, their node holding its windows once). A rank holds the window it reads
  and the next while every block is equally likely in any window: a node fetches each block of its
  ranks' lanes once per epoch (about its share of the dataset), and a step mixes
  documents of lanes x window_blocks blocks drawn from the whole corpus.
- `shard_local` (ShardGroups) cuts the shards into groups of consecutive shards; the
  observations of a group are contiguous positions (groups in a Feistel order,
  observations inside a group in another). Its statistical cost: a batch mixes documents
  of only G neighbouring shards, and consecutive batches stay in one group for (group
  tokens / global batch tokens) steps; windows also drop the < T + 1 tail tokens of each
  group instead of the stream's.
- `auto` (the default) is `global` for a local dataset (nothing to fetch) and `windowed`
  for one on object storage, resolved when the dataset opens from its URI alone (every
  rank resolves the same; a loader state records the resolved shuffle).
Every plan reports what it trains, crops and drops of the tokens and how many positions it
pads (`report()`); the loader and the LLMBATCH writer warn once when the untrained tokens
or the padding pass 5%, with a hint (from the mode) that names another packing or mode.
Cost: ~70 ns per observation to permute.
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Iterable
from dataclasses import dataclass, replace
from typing import Any

import numpy as np

from raypipe.errors import ConfigError
from raypipe.sampling.blocks import Blocks
from raypipe.sampling.pack import continued_pieces
from raypipe.sampling.permute import (
    AppendedWindows,
    FeistelPermutation,
    GroupedPermutation,
    JoinedOrder,
    WindowedPermutation,
)

logger = logging.getLogger("raypipe")
SumsMemo = Callable[[tuple, Callable[[], np.ndarray]], np.ndarray]
WASTE_WARNING = 0.05  # warn once when an epoch would not train this share of the tokens


@dataclass(frozen=True, repr=False)
class PackingReport:
    """What one epoch's rows make of the data: tokens trained (used), not trained (cropped
    from documents, dropped with whole rows), and positions that hold no token (padding).
    used + cropped + dropped = total_tokens; the rows hold used + padded positions."""

    rows: int
    used_tokens: int
    cropped_tokens: int
    padded_tokens: int
    dropped_tokens: int
    total_tokens: int
    loss_mask_tokens: int | None = None  # chat data: tokens its loss mask trains (mask 1)
    # chat data: pieces of conversations longer than a row that begin a row (their first
    # token, trained or not, is no target)
    continued_pieces: int | None = None
    # overlong `split`: the token before each later piece of a document longer than a row,
    # placed again as that piece's first input (a position, no second target)
    repeated_tokens: int = 0

    @classmethod
    def from_options(cls, options: dict[str, Any]) -> PackingReport:
        """The report an LLMBATCH manifest section records (see `as_options`)."""
        used, cropped, dropped = (int(options[key]) for key in
                                  ("used_tokens", "cropped_tokens", "dropped_tokens"))
        rows = int(options.get("num_batches", 0)) * int(options.get("batch_size", 0))
        return cls(rows, used, cropped, int(options["padded_tokens"]), dropped,
                   used + cropped + dropped,
                   repeated_tokens=int(options.get("repeated_tokens", 0)))

    def as_options(self) -> dict[str, int]:
        repeated = {"repeated_tokens": self.repeated_tokens} if self.repeated_tokens else {}
        return {"used_tokens": self.used_tokens, "cropped_tokens": self.cropped_tokens,
                "padded_tokens": self.padded_tokens, "dropped_tokens": self.dropped_tokens,
                **repeated}

    @property
    def untrained_tokens(self) -> int:
        return self.cropped_tokens + self.dropped_tokens

    @property
    def untrained_fraction(self) -> float:
        """Tokens of the data not trained this epoch, per token of the data."""
        return self.untrained_tokens / self.total_tokens if self.total_tokens else 0.0

    @property
    def positions(self) -> int:
        return self.used_tokens + self.repeated_tokens + self.padded_tokens

    @property
    def padding_fraction(self) -> float:
        """Positions of the rows that hold no token (GPU time spent on nothing)."""
        return self.padded_tokens / self.positions if self.positions else 0.0

    def warn_if_wasteful(self, what: str, hint: Callable[[str], str],
                         threshold: float = WASTE_WARNING) -> bool:
        """Log one warning when untrained tokens or padding pass `threshold` (each on its
        own line of the warning), with `hint(waste)` for each (waste: cropped, dropped or
        padding; raypipe.sampling.modes.waste_hints); True when it warned."""
        problems = []
        if self.untrained_fraction > threshold:
            cause = "cropped" if self.cropped_tokens >= self.dropped_tokens else "dropped"
            problems.append(
                f"{self.untrained_fraction:.1%} of the tokens are not trained (cropped "
                f"{self.cropped_tokens:,}, dropped {self.dropped_tokens:,} of "
                f"{self.total_tokens:,}); hint: {hint(cause)}")
        if self.padding_fraction > threshold:
            problems.append(
                f"{self.padding_fraction:.1%} of the positions are padding "
                f"({self.padded_tokens:,} of {self.positions:,}); hint: "
                f"{hint('padding')}")
        if not problems:
            return False
        logger.warning("%s: %s", what, "; ".join(problems))
        return True

    def lines(self) -> list[str]:
        total, positions = max(self.total_tokens, 1), max(self.positions, 1)
        return [
            f"rows            {self.rows:,}",
            f"tokens in data  {self.total_tokens:,}",
            f"trained         {self.used_tokens:,} ({self.used_tokens / total:.2%} of the "
            "tokens)",
            f"untrained       {self.untrained_tokens:,} ({self.untrained_tokens / total:.2%}"
            f" of the tokens): cropped {self.cropped_tokens:,}, dropped "
            f"{self.dropped_tokens:,}",
            f"padding         {self.padded_tokens:,} ({self.padded_tokens / positions:.2%} "
            "of the positions)",
        ] + ([] if self.loss_mask_tokens is None else [
            f"loss mask 1     {self.loss_mask_tokens:,} ({self.loss_mask_tokens / total:.2%} "
            "of the tokens: the targets chat data trains)"]) + (
            [] if not self.continued_pieces else [
                f"row starts inside a conversation {self.continued_pieces:,} (pieces of "
                "conversations longer than a row: each one's first token is no target)"]) + (
            [] if not self.repeated_tokens else [
                f"repeated        {self.repeated_tokens:,} (each later piece of a document "
                "longer than a row starts with the token before it, as an input)"])

    def render(self) -> str:
        return "\n".join(self.lines())

    def __str__(self) -> str:
        return self.render()

    def __repr__(self) -> str:  # what a REPL shows for `loader.packing_report()`
        return "PackingReport\n" + "\n".join("  " + line for line in self.lines())

    def with_loss_mask(self, trained: int | None, lengths: Iterable[np.ndarray], packing: str,
                       seq_len: int, overlong: str = "cut") -> PackingReport:
        """The report of chat data: its loss mask's trained tokens and, under split
        packing with overlong `cut`, the row starts that fall inside a conversation
        (`lengths`: the documents' lengths, in chunks)."""
        if trained is None:
            return self
        continued = (sum(continued_pieces(chunk, seq_len + 1) for chunk in lengths)
                     if packing == "split" and overlong == "cut" else None)
        return replace(self, loss_mask_tokens=trained, continued_pieces=continued)

    def summary_line(self) -> str:
        """The report in one line (the tokenize summary, inspect)."""
        total, positions = max(self.total_tokens, 1), max(self.positions, 1)
        return (f"trained {self.used_tokens / total:.2%} of the tokens, untrained "
                f"{self.untrained_tokens / total:.2%} (cropped {self.cropped_tokens / total:.2%}"
                f", dropped {self.dropped_tokens / total:.2%}), padding "
                f"{self.padded_tokens / positions:.2%} of the positions")


SHUFFLES = ("auto", "global", "windowed", "shard_local")
LANE_ENDS_AUTO, NEARBY_LANE_ENDS, SPREAD_LANE_ENDS = "auto", "nearby", "spread"
# how a windowed shuffle's lanes end (auto: a resumed state's, else nearby)
LANE_ENDS = (LANE_ENDS_AUTO, NEARBY_LANE_ENDS, SPREAD_LANE_ENDS)
WINDOWS_PER_EPOCH = 32  # windowed, window_blocks 0: 1/32 of a lane's blocks a window
GROUP_SHARDS_DEFAULT = 4  # shard_local, group_shards 0: where no cache sizes the groups


def window_blocks_for(blocks: int, window_blocks: int, lanes: int = 1) -> int:
    """Blocks a window holds: `window_blocks` (a lane's blocks at most), or (0: a state of
    the releases that windowed whole shards) about 1/WINDOWS_PER_EPOCH of a lane's blocks;
    at least one."""
    lane = max(1, blocks // max(lanes, 1))
    return min(window_blocks, lane) if window_blocks else max(
        1, blocks // (WINDOWS_PER_EPOCH * max(lanes, 1)))


@dataclass(frozen=True)
class ShardWindows:
    """The windowed shuffle's layout: its blocks (raypipe.sampling.blocks), blocks per
    window, lanes, and how lanes of unequal length end (`nearby`: windows spread evenly
    over a multiple of the lanes, the longer lanes' rest read by the ranks beside them;
    else spread over every rank: LaneOrder)."""

    blocks: Blocks
    window_blocks: int
    lanes: int = 1
    nearby: bool = False
    ranks_per_lane: int = 1  # consecutive ranks that read a lane in turn (LaneOrder)

    @property
    def layout_lanes(self) -> int:
        """The lanes the windows are laid out for (0: windows of window_blocks as they
        come, the layout before lanes ended nearby)."""
        return self.lanes if self.nearby else 0

    @property
    def block_documents(self) -> np.ndarray:
        return self.blocks.documents


class LaneOrder:
    """Observations [0, n) read in `lanes` lanes side by side, each by `ranks_per_lane` (k)
    consecutive ranks: lane l is the contiguous run [bounds[l], bounds[l + 1]) of the
    plan's observations (whole windows of a windowed shuffle). Positions come in cycles of
    W = lanes x k; position p < lanes x S (S: the shortest lane's length, down to a
    multiple of k) is observation bounds[(p % W) // k] + (p // W) x k + p % k. So rank r
    of a world W divides (positions p + i*W' + r, p a multiple of W') reads lane r // k
    alone, its k ranks in turn (k = 1: lane r % lanes), until the rest the longer lanes
    hold past S. That rest, laid out lane after lane, is cut into W runs of (nearly) equal
    length: `nearby`, the positions keep cycling and the rank of slot j reads run j, which
    lies over its lane's own rest and its neighbours', so each lane's rest is read by the
    ranks beside it (the blocks stay on the node that holds them); else (the layout
    before) the positions read it lane after lane, so every rank reads every lane's rest.
    Either way each lane serves a prefix of its observations at every position
    (`served`). A bijection on [0, n); O(W) memory and, `nearby`, O(runs a lane's rest
    spans) vector operations a call. k > 1 lets a node's ranks share their lane's
    windows: a node holds k times fewer windows, so its cache holds windows k times
    larger.
    """

    def __init__(self, bounds: np.ndarray, nearby: bool = False, ranks_per_lane: int = 1):
        self.bounds = np.asarray(bounds, dtype=np.int64)
        self.lanes = len(self.bounds) - 1
        self.nearby = nearby
        self.ranks_per_lane = max(int(ranks_per_lane), 1)
        self.slots = max(self.lanes, 1) * self.ranks_per_lane  # positions a cycle
        sizes = np.diff(self.bounds)
        smallest = int(sizes.min()) if self.lanes else 0
        self.side = smallest - smallest % self.ranks_per_lane
        self.even = self.lanes * self.side  # positions read side by side
        left = sizes - self.side  # what each lane holds past the side-by-side part
        self.left_starts = np.concatenate([[0], np.cumsum(left)]).astype(np.int64)
        rest = int(self.left_starts[-1])
        # nearby: run j of the rest (laid out lane after lane) is [run_starts[j],
        # run_starts[j + 1]), read by the positions of slot j, one a cycle
        counts = rest // self.slots + (np.arange(self.slots) < rest % self.slots)
        self.run_starts = np.concatenate([[0], np.cumsum(counts)]).astype(np.int64)

    def __call__(self, positions: np.ndarray) -> np.ndarray:
        positions = np.asarray(positions, dtype=np.int64)
        if self.lanes <= 1:
            return positions
        even = positions < self.even
        out = np.empty_like(positions)
        cycle, slot = positions[even] // self.slots, positions[even] % self.slots
        lane, turn = slot // self.ranks_per_lane, slot % self.ranks_per_lane
        out[even] = self.bounds[:-1][lane] + cycle * self.ranks_per_lane + turn
        later = positions[~even] - self.even
        if self.nearby:
            out[~even] = self._nearby(later)
            return out
        lane = np.searchsorted(self.left_starts, later, side="right") - 1
        out[~even] = self.bounds[:-1][lane] + self.side + later - self.left_starts[lane]
        return out

    def _nearby(self, later: np.ndarray) -> np.ndarray:
        """The observations of positions `later` past the side-by-side part: the one of
        cycle c and slot j reads the lane that holds place run_starts[j] + c of the rest,
        and within that lane's rest the next observation it has not served (its count of
        places served before, over the runs that share it)."""
        cycle, slot = later // self.slots, later % self.slots
        place = self.run_starts[slot] + cycle
        lane = np.searchsorted(self.left_starts, place, side="right") - 1
        first_run = np.searchsorted(self.run_starts, self.left_starts[lane],
                                    side="right") - 1
        last_run = np.searchsorted(self.run_starts, self.left_starts[lane + 1] - 1,
                                   side="right") - 1
        index = np.zeros_like(later)
        for offset in range(int((last_run - first_run).max(initial=0)) + 1):
            run = first_run + offset
            shares = run <= last_run
            run = np.minimum(run, self.slots - 1)
            begin, end = self._run_share(run, lane)
            served = np.clip(cycle - begin + (run < slot), 0, end - begin)
            index += np.where(shares, served, 0)
        return self.bounds[:-1][lane] + self.side + index

    def _run_share(self, run: np.ndarray, lane: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        """The cycles [begin, end) in which run `run` reads lane `lane`'s rest."""
        low = np.maximum(self.run_starts[run], self.left_starts[lane])
        high = np.minimum(self.run_starts[run + 1], self.left_starts[lane + 1])
        return low - self.run_starts[run], np.maximum(high, low) - self.run_starts[run]

    def lane_of(self, observation: int) -> int:
        return int(np.searchsorted(self.bounds, observation, side="right")) - 1

    def served(self, position: int) -> np.ndarray:
        """int64[lanes]: the observations of each lane that positions [0, position) read
        (each a prefix of its lane)."""
        if self.lanes <= 1:
            return np.array([position], dtype=np.int64)
        side_by_side = min(position, self.even)
        cycles, partial = divmod(side_by_side, self.slots)
        first_slots = np.arange(self.lanes, dtype=np.int64) * self.ranks_per_lane
        served = (cycles * self.ranks_per_lane
                  + np.clip(partial - first_slots, 0, self.ranks_per_lane))
        later = position - self.even
        if later <= 0:
            return served
        if not self.nearby:
            return served + np.clip(later - self.left_starts[:-1], 0,
                                    np.diff(self.left_starts))
        # places of the rest served: run j's first min(its length, cycles it took)
        slots = np.arange(self.slots, dtype=np.int64)
        taken = np.minimum(np.diff(self.run_starts),
                           later // self.slots + (slots < later % self.slots))
        done = np.concatenate([[0], np.cumsum(taken)]).astype(np.int64)

        def below(place: np.ndarray) -> np.ndarray:  # places served before `place`
            run = np.clip(np.searchsorted(self.run_starts, place, side="right") - 1, 0,
                          self.slots - 1)
            return done[run] + np.minimum(place - self.run_starts[run], taken[run])

        return served + below(self.left_starts[1:]) - below(self.left_starts[:-1])


def lane_starts(window_starts: np.ndarray, lanes: int) -> np.ndarray:
    """The order positions where each of `lanes` lanes of whole windows begins (and the
    end): windows split as evenly as whole windows allow."""
    windows = len(window_starts) - 1
    return window_starts[(np.arange(lanes + 1, dtype=np.int64) * windows) // max(lanes, 1)]


def lane_bounds(window_starts: np.ndarray, lanes: int, observation_at: Any) -> np.ndarray:
    """The observations where each lane begins (and the end, `lane_starts`);
    `observation_at(order positions)` says which observation each window's first document
    begins."""
    return np.asarray(observation_at(lane_starts(window_starts, lanes)), dtype=np.int64)


@dataclass(frozen=True)
class ShardGroups:
    """The shard-local shuffle's groups of `group_shards` consecutive shards: the global
    token and document offsets where each group starts, and the totals at the end."""

    tokens: np.ndarray
    documents: np.ndarray

    @classmethod
    def of(cls, shard_tokens: np.ndarray, shard_documents: np.ndarray,
           group_shards: int) -> ShardGroups:
        if group_shards < 1:
            raise ValueError(f"group_shards must be >= 1, got {group_shards}")
        count = len(shard_tokens)
        bounds = np.append(np.arange(0, count, group_shards), count)
        tokens = np.concatenate([[0], np.cumsum(shard_tokens)]).astype(np.int64)
        documents = np.concatenate([[0], np.cumsum(shard_documents)]).astype(np.int64)
        return cls(tokens[bounds], documents[bounds])

    @property
    def document_counts(self) -> np.ndarray:
        return np.diff(self.documents)


DocumentOrder = (FeistelPermutation | GroupedPermutation | WindowedPermutation | JoinedOrder
                 | AppendedWindows)
JOIN_SALT = 4096  # the Feistel salts of joined orders: this plus the documents after the join


def next_window_blocks(order: Any, order_position: int, lanes: LaneOrder | None = None,
                       observation: int = 0, end: int | None = None) -> np.ndarray | None:
    """The blocks of the window after the one holding position `order_position` of a
    windowed document order (what a reader fetches while it reads this window), within the
    lane of `observation` (None: one lane) and before order position `end` (None: the
    order's end); empty at a lane's or the epoch's last window and past the end; None for
    an order without windows."""
    if not hasattr(order, "window_block_ids"):  # (windowed, or windows appended to one)
        return None
    if not 0 <= order_position < len(order):
        return np.empty(0, dtype=np.int64)
    window = int(np.searchsorted(order.window_starts, order_position, side="right")) - 1
    last = order.num_windows
    if lanes is not None and lanes.lanes > 1:
        lane = lanes.lane_of(observation)
        last = int((lane + 1) * order.num_windows // lanes.lanes)
    if window + 1 >= last or (end is not None and order.window_starts[window + 1] >= end):
        return np.empty(0, dtype=np.int64)
    return order.window_block_ids(window + 1)


def document_permutation(count: int, seed: int, epoch: int, salt: int,
                         groups: ShardGroups | ShardWindows | None) -> DocumentOrder:
    """The epoch's document order under a shuffle's layout (None: global)."""
    if groups is None:
        return FeistelPermutation(count, seed, epoch, salt=salt)
    if isinstance(groups, ShardWindows):
        return WindowedPermutation(groups.block_documents, groups.window_blocks, seed, epoch,
                                   salt=salt, lanes=groups.layout_lanes)
    return GroupedPermutation(groups.document_counts, seed, epoch, salt=salt)


def continued_order(before: DocumentOrder, first: int, count: int, seed: int, epoch: int,
                    groups: ShardGroups | ShardWindows | None) -> DocumentOrder:
    """The document order the rest of an epoch continues in from order position `first`:
    `before`'s, or, where documents [len(before), count) joined the epoch (units added to
    the output: raypipe.sampling.growth), those and before's unserved ones shuffled
    together (permute.JoinedOrder, salted by `count`, which grows with every join). A
    windowed shuffle reads a window of blocks at a time, which a document joined anywhere
    would break: the joined units' blocks are windows of their own after before's
    (permute.AppendedWindows; a mode that reads lanes shares them out between its lanes).
    A shard-local shuffle's groups are refused, naming the way out."""
    if count == len(before):
        return before
    salt = JOIN_SALT + count
    if isinstance(groups, ShardWindows) and hasattr(before, "window_starts"):
        blocks = before.num_blocks
        return AppendedWindows(before, WindowedPermutation(
            groups.block_documents[blocks:], groups.window_blocks, seed, epoch, salt,
            groups.layout_lanes),
            blocks, salt)
    if groups is not None:
        raise ConfigError("units joining the epoch in progress under shuffle 'shard_local': "
                          "give units_join='next_epoch' (served from the next epoch), or "
                          "shuffle 'global' or 'windowed'")
    return JoinedOrder(before, first, count, seed, epoch, salt)


class LanedPlan:
    """The rest of an epoch read in lanes side by side (a windowed shuffle of several lanes
    after a change inside the epoch): lane l is `plans[l]`, the rest of the plan before's
    lane l, read through a LaneOrder over the lanes' sizes, so rank r of a world that the
    lanes divide still reads the lane it read. A lane serves a prefix of its rows, so each
    lane's rest is planned again on its own (`lane_remainders`). A mode's subclass reads
    its rows lane by lane (`by_lane`). Cost: every rank builds every lane's rest (their
    sizes place its positions), once per change: bestfit packs each lane's partly served
    block and its head, ~5 ms a lane under fill (bench/lanes_bench.py)."""

    def __init__(self, plans: list[Any], nearby: bool = False, ranks_per_lane: int = 1):
        self.plans = plans
        self.lengths, self.capacity = plans[0].lengths, plans[0].capacity
        self.offsets = np.concatenate([[0], np.cumsum([plan.size for plan in plans])]
                                      ).astype(np.int64)
        self.lanes = LaneOrder(self.offsets, nearby, ranks_per_lane)

    @property
    def size(self) -> int:
        return int(self.offsets[-1])

    @property
    def document_order(self) -> Any:
        return self.plans[0].document_order

    def by_lane(self, positions: np.ndarray) -> list[tuple[int, np.ndarray, np.ndarray]]:
        """(lane, where in `positions`, the lane's own positions) of each lane read."""
        observations = self.lanes(np.asarray(positions, dtype=np.int64))
        lanes = np.searchsorted(self.offsets, observations, side="right") - 1
        return [(lane, np.flatnonzero(lanes == lane),
                 observations[lanes == lane] - self.offsets[lane])
                for lane in np.unique(lanes).tolist()]

    def report(self) -> PackingReport:
        reports = [plan.report() for plan in self.plans]
        return PackingReport(*(sum(getattr(report, name) for report in reports)
                               for name in ("rows", "used_tokens", "cropped_tokens",
                                            "padded_tokens", "dropped_tokens",
                                            "total_tokens")),
                             repeated_tokens=sum(report.repeated_tokens
                                                 for report in reports))

    def counted_tokens(self, positions: np.ndarray) -> int:
        return sum(self.plans[lane].counted_tokens(local)
                   for lane, _, local in self.by_lane(positions))

    def remaining(self, position: int) -> Any:
        raise ValueError("a plan of several lanes: lane_remainders")

    def lane_remainders(self, position: int) -> list[Any]:
        """What each lane has not served once positions [0, position) are."""
        served = self.lanes.served(position)
        return [plan.remaining(int(count)) for plan, count in zip(self.plans, served.tolist(),
                                                                   strict=True)]

    def units_ahead(self, position: int) -> np.ndarray | None:
        """The next window of the lane of `position` (past the end: none)."""
        if position >= self.size:
            return np.empty(0, dtype=np.int64)
        (lane, _, local), = self.by_lane(np.array([position], dtype=np.int64))
        return self.plans[lane].units_ahead(int(local[0]))


def continued_runs(runs: np.ndarray, first: int, base: Any, order: Any, lane: int,
                   lanes: int) -> np.ndarray:
    """The runs of `order` the rest of lane `lane` (of `lanes`) reads: those of `base` it
    had not served (`runs`; `first`: the first place not served), then, where units joined
    under a windowed shuffle, the lane's share of the joined windows; a joined global order
    (permute.JoinedOrder) shuffles the joined documents into [first, end)."""
    if order is base:
        return runs
    if not hasattr(order, "window_starts"):
        return np.array([[first, len(order)]], dtype=np.int64)
    starts, joined = order.window_starts, base.num_windows
    added = len(starts) - 1 - joined
    begin, stop = joined + added * lane // lanes, joined + added * (lane + 1) // lanes
    share = (np.array([[starts[begin], starts[stop]]], dtype=np.int64) if stop > begin
             else np.zeros((0, 2), dtype=np.int64))
    return np.concatenate([np.asarray(runs, dtype=np.int64).reshape(-1, 2), share]
                          ).astype(np.int64)
