"""One save/load-state harness for every loader mode (in the spirit of torchdata's shared
state tests): run an epoch at world size 1, stop, resume at 2, stop, resume at 3, and check
that every observation of the epoch was consumed exactly once (minus the drop-last tail)
and that each resumed row holds the same tokens as in an uninterrupted run."""

from __future__ import annotations

import numpy as np
import pytest

from raypipe.errors import ConfigError, StateError
from raypipe.loader import MixtureLoader, TokenLoader, open_loader
from raypipe.sampling.modes import get_mode, mode_names

T, B, SEED = 32, 2, 5
# every registered mode at its defaults (a new mode is in the harness as soon as its module
# registers it), then the variants of the knobs that change what a mode serves
MODES = {name: {"mode": name} for name in mode_names()} | {
    "windows+metadata": {"mode": "windows", "format": "stream", "metadata": True},
    "bestfit-split": {"mode": "bestfit", "packing": "split"},
    "bestfit-crop": {"mode": "bestfit", "packing": "crop"},
    "batches-blocks-of-4": {"mode": "batches", "block_batches": 4},
    "batches-shard-local": {"mode": "batches", "shuffle": "shard_local", "group_shards": 2,
                            "block_batches": 4},
    "windows-shard-local": {"mode": "windows", "shuffle": "shard_local", "group_shards": 2},
    "bestfit-shard-local": {"mode": "bestfit", "shuffle": "shard_local", "group_shards": 2},
    "documents-shard-local": {"mode": "documents", "shuffle": "shard_local",
                              "group_shards": 3},
    "bestfit-windowed": {"mode": "bestfit", "shuffle": "windowed", "window_blocks": 1},
    "bestfit-windowed-2-lanes": {"mode": "bestfit", "shuffle": "windowed", "window_blocks": 1,
                                 "lanes": 2},
    "documents-windowed-3-lanes": {"mode": "documents", "shuffle": "windowed", "lanes": 3},
    "bestfit-windowed-2-lanes-of-2-ranks": {"mode": "bestfit", "shuffle": "windowed",
                                            "window_blocks": 1, "lanes": 2, "lane_ranks": 2},
    "documents-windowed-3-lanes-of-2-ranks": {"mode": "documents", "shuffle": "windowed",
                                              "lanes": 3, "lane_ranks": 2},
    "bestfit-windowed-train-split": {"mode": "bestfit", "shuffle": "windowed", "lanes": 2,
                                     "split": "train", "validation_fraction": 0.2},
    "bestfit-train-split": {"mode": "bestfit", "split": "train", "validation_fraction": 0.2},
    "windows-train-split": {"mode": "windows", "split": "train", "validation_fraction": 0.2},
    "documents-validation-split": {"mode": "documents", "split": "validation",
                                   "validation_fraction": 0.3},
    "bestfit-balanced": {"mode": "bestfit", "balance": "attention", "balance_hidden": 1},
    "documents-balanced": {"mode": "documents", "balance": "attention"},
    "windows-balanced": {"mode": "windows", "balance": "attention", "balance_hidden": 2},
    "bestfit-windowed-balanced": {"mode": "bestfit", "shuffle": "windowed", "lanes": 2,
                                  "balance": "attention", "balance_hidden": 1},
    "bestfit-by-cost": {"mode": "bestfit", "balance": "attention", "balance_hidden": 1,
                        "block_order": "by_cost", "block_documents": 40},
}


def make_loader(path, options, rank, world) -> TokenLoader | MixtureLoader:
    """Every loader mode through the one factory (a dict path: a mixture)."""
    if get_mode(options["mode"]).serves == "batches":  # the shape is the pre-formed file's
        return open_loader(path, rank=rank, world_size=world, seed=SEED, **options)
    return open_loader(path, T, B, rank=rank, world_size=world, seed=SEED, **options)


def rows_of(batch, options) -> dict[int, list[int]]:
    """observation id -> the tokens it put in the batch (a whole batch for LLMBATCH; for a
    mixture the id is (source, epoch position))."""
    if batch.source_ids is not None:
        return {(int(s), int(p)): batch.inputs[i].tolist()
                for i, (s, p) in enumerate(zip(batch.source_ids, batch.positions,
                                               strict=True))}
    if get_mode(options["mode"]).serves == "batches":
        return {int(batch.observation_ids[0]): batch.inputs.reshape(-1).tolist()}
    if options.get("metadata"):  # each row's records came with it
        for row, window in enumerate(batch.metadata):
            assert window.tokens[:-1].tolist() == batch.inputs[row].tolist()
            assert all(window.record_of(p) is not None for p in range(T))
    return {int(o): batch.inputs[i].tolist() for i, o in enumerate(batch.observation_ids)
            if o >= 0}  # -1: an empty row padding the validation split's last step


def run_segment(path, options, world, state, steps=None):
    """`world` ranks in lockstep from `state` for `steps` steps (None: to the epoch's end);
    returns (observation id -> tokens, in consumption order; the common state after)."""
    loaders = [make_loader(path, options, r, world) for r in range(world)]
    for loader in loaders:
        if state is not None:
            loader.load_state_dict(state)
    iterators = [iter(loader) for loader in loaders]
    consumed: list[tuple[int, list[int]]] = []
    done = 0
    while steps is None or done < steps:
        batches = [next(it, None) for it in iterators]
        if batches[0] is None:
            assert all(b is None for b in batches)
            break
        for batch in batches:
            consumed.extend(rows_of(batch, options).items())
        done += 1
    for iterator in iterators:
        iterator.close()
    states = [loader.state_dict() for loader in loaders]
    assert all(s == states[0] for s in states), "ranks disagree on the state"
    return consumed, states[0]


def check_resume_1_2_3(path, mode: str, first_stop: int, reference_path=None) -> None:
    """Stop after `first_stop` steps at 1 rank, resume 2 steps at 2 ranks, finish at 3; the
    epoch is served exactly once (less the drop-last tail), each row as in an uninterrupted
    run over `reference_path` (default: `path` itself)."""
    options = MODES[mode]
    first, state = run_segment(path, options, 1, None, steps=first_stop)
    # the reference runs under the shuffle the run resolved (auto: windowed on a bucket)
    resolved = {name: state["knobs"][name] for name in ("shuffle", "window_blocks")
                if name in state.get("knobs", {})}
    whole, end_state = run_segment(reference_path or path, {**options, **resolved}, 1, None)
    reference = dict(whole)
    assert end_state["epoch"] == 1 and end_state["position"] == 0
    second, state = run_segment(path, options, 2, state, steps=2)
    third, final = run_segment(path, options, 3, state)
    consumed = first + second + third
    ids = [observation for observation, _ in consumed]
    assert len(ids) == len(set(ids)), f"{mode}: an observation was served twice"
    assert set(ids) <= set(reference), f"{mode}: an observation outside the epoch"
    for observation, tokens in consumed:
        assert tokens == reference[observation], f"{mode}: resumed row {observation} differs"
    probe = make_loader(path, options, 0, 3)
    size, per_step = probe.plan(0).size, probe.global_batch
    missing = size - len(ids)
    assert 0 <= missing < per_step, f"{mode}: {missing} observations lost beyond the tail"
    assert final["epoch"] == 1 and final["position"] == 0


@pytest.mark.parametrize("first_stop", [0, 1, 3])
@pytest.mark.parametrize("mode", sorted(MODES))
def test_every_mode_resumes_exactly_once_from_1_to_2_to_3_ranks(rich_dataset, mode,
                                                                first_stop):
    check_resume_1_2_3(rich_dataset, mode, first_stop)


@pytest.mark.parametrize("mode", sorted(MODES))
def test_state_round_trips_through_json_in_every_mode(rich_dataset, mode):
    import json

    options = MODES[mode]
    _, state = run_segment(rich_dataset, options, 2, None, steps=1)
    loader = make_loader(rich_dataset, options, 1, 3)
    loader.load_state_dict(json.loads(json.dumps(state)))
    assert loader.state_dict()["position"] == state["position"] > 0
    assert np.all(next(iter(loader)).positions >= state["position"])


@pytest.mark.parametrize("mode", sorted(MODES))
def test_every_mode_excludes_documents_on_resume_or_refuses_naming_why(rich_dataset, mode):
    """Documents excluded on a resume: the state records them from that step, the steps
    after (as trace replays them from that state) hold none of them and serve the rest of
    the epoch, at 2 ranks and at 3 (a windowed shuffle of several lanes: each lane's
    rest planned again); a mode that cannot plan without them refuses in one line naming
    itself, and one that cannot plan the rest of several lanes names the lanes."""
    from raypipe import trace

    options, excluded = MODES[mode], list(range(0, 80, 3))
    _, state = run_segment(rich_dataset, options, 2, None, steps=1)
    if not get_mode(options["mode"]).excludes:
        with pytest.raises(ConfigError, match=f"mode '{options['mode']}' cannot plan an epoch "
                           "without some of its documents"):
            make_loader(rich_dataset, {**options, "exclude": excluded}, 0, 2)
        return
    loader = make_loader(rich_dataset, {**options, "exclude": excluded}, 0, 2)
    if loader.spec.lanes > 1 and not loader.spec.loader_mode.continues_lanes:
        with pytest.raises(StateError, match=f"windowed shuffle of {loader.spec.lanes} lanes"):
            loader.load_state_dict(state)
        assert "exclusions" not in loader.state_dict() or not loader.state_dict()[
            "exclusions"], "a refused exclusion was kept"
        return
    loader.load_state_dict(state)
    resumed = loader.state_dict()
    record = resumed["exclusions"][0]
    assert record["step"] == 1 and record["named"] == len(excluded)
    assert set(record["documents"]) <= set(excluded)
    steps = len(loader)
    pieces = list(trace(rich_dataset, state=resumed, steps=steps, seed=SEED, batch_size=B))
    assert {piece.step for piece in pieces} == set(range(1, 1 + steps))
    assert not {piece.document for piece in pieces} & set(record["documents"])
    consumed, final = run_segment(rich_dataset, {**options, "exclude": excluded}, 3, state)
    assert final["epoch"] == 1 and len(consumed) >= steps


@pytest.mark.parametrize("mode, first_world", [("documents-windowed-3-lanes-of-2-ranks", 2),
                                               ("bestfit-windowed-2-lanes-of-2-ranks", 3)])
def test_lanes_each_read_by_two_ranks_plan_their_rest_from_what_their_ranks_served(
        rich_dataset, mode, first_world):
    """Lanes each read by 2 ranks in turn, stopped where the ranks' cycle is cut (a world
    of 2 or 3 over a layout for 2 x lanes) and resumed at the other with documents
    excluded: each lane's rest starts where its ranks stopped, so no token comes twice,
    none of an excluded document after the exclusion, and every other one once (less the
    drop-last tail), as `raypipe trace` of both segments shows."""
    from raypipe import trace

    options, excluded = MODES[mode], set(range(0, 80, 3))
    _, state = run_segment(rich_dataset, options, first_world, None, steps=1)
    assert state["knobs"]["lane_ranks"] == 2 and state["position"] % (2 * options["lanes"])
    loader = make_loader(rich_dataset, {**options, "exclude": sorted(excluded)},
                         0, 5 - first_world)
    loader.load_state_dict(state)
    resumed, steps = loader.state_dict(), len(loader)
    knobs = {name: value for name, value in options.items() if name != "mode"}
    before = list(trace(rich_dataset, 0, world_size=first_world, seed=SEED, batch_size=B,
                        seq_len=T, mode=options["mode"], **knobs))
    after = list(trace(rich_dataset, state=resumed, steps=steps, seed=SEED, batch_size=B))
    assert not {piece.document for piece in after} & excluded
    served: dict[int, list[tuple[int, int]]] = {}
    for piece in before + after:
        served.setdefault(piece.document, []).append((piece.token_start, piece.token_end))
    for spans in served.values():  # a document's pieces never overlap
        spans.sort()
        assert all(a[1] <= b[0] for a, b in zip(spans, spans[1:], strict=False)), spans
    probe = make_loader(rich_dataset, options, 0, 5 - first_world)
    plan = probe.plan(0)
    lengths = np.asarray(plan.lengths[np.arange(len(plan.lengths))])
    if options["mode"] == "documents":  # a row of each document, cropped to the row
        lengths = np.minimum(lengths, T + 1)
    owed = (int(lengths.sum()) - int(lengths[sorted(excluded)].sum())  # an excluded one's
            + sum(piece.token_end - piece.token_start for piece in before  # pieces before
                  if piece.document in excluded))
    got = sum(end - start for spans in served.values() for start, end in spans)
    assert 0 <= owed - got < probe.global_batch * (T + 1)  # the drop-last tail's
