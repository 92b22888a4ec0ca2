"""TokenLoader: row contents per mode, exactly-once resume at any world size, state checks,
multi-process DDP-style run (CPU, gloo)."""

from __future__ import annotations

import json
import os
import shutil
import socket

import numpy as np
import pytest
import torch

from raypipe.dataset import TokenDataset
from raypipe.errors import ConfigError, StateError
from raypipe.loader import TokenLoader

T, B = 32, 2


def stream_of(path) -> np.ndarray:
    return np.concatenate(list(TokenDataset(path).iter_documents())).astype(np.int64)


def documents_of(path) -> list[np.ndarray]:
    return [d.astype(np.int64) for d in TokenDataset(path).iter_documents()]


def run_ranks(path, world, state=None, steps=None, **options):
    """Simulate `world` ranks in lockstep; return (observation ids consumed, common state)."""
    loaders = [TokenLoader(path, T, B, rank=r, world_size=world, **options)
               for r in range(world)]
    for loader in loaders:
        if state is not None:
            loader.load_state_dict(state)
    iterators = [iter(loader) for loader in loaders]
    consumed, done = [], 0
    while steps is None or done < steps:
        batches = [next(it, None) for it in iterators]
        if batches[0] is None:
            break
        for batch in batches:
            consumed.extend(batch.observation_ids.tolist())
        done += 1
    for iterator in iterators:
        iterator.close()
    states = [loader.state_dict() for loader in loaders]
    assert all(s == states[0] for s in states)
    return consumed, states[0]


def test_windows_rows_are_slices_of_the_stream(token_dataset):
    stream = stream_of(token_dataset)
    loader = TokenLoader(token_dataset, T, B, mode="windows", seed=3)
    assert TokenDataset(token_dataset).num_shards > 3  # windows cross shard boundaries
    seen = 0
    for batch in loader:
        for row, window in enumerate(batch.observation_ids.tolist()):
            expected = stream[window * T: window * T + T + 1]
            assert batch.inputs[row].tolist() == expected[:-1].tolist()
            assert batch.targets[row].tolist() == expected[1:].tolist()
        seen += 1
    assert seen == (stream.size - 1) // T // B


def test_crop_rows_start_with_bos_and_follow_the_plan(token_dataset):
    documents = documents_of(token_dataset)
    loader = TokenLoader(token_dataset, T, B, mode="bestfit", seed=9, block_documents=128,
                         packing="crop")
    plan = loader.plan()
    for batch in loader:
        rows = plan.rows(batch.positions)
        for row, (row_id, pieces) in enumerate(rows):
            doc_ids, starts, take = pieces.documents, pieces.starts, pieces.take
            tokens = torch.cat([batch.inputs[row], batch.targets[row, -1:]]).tolist()
            assert tokens[0] == 0 and not starts.any()  # BOS
            expected = np.concatenate([documents[d][:n] for d, n in zip(doc_ids, take,
                                                                        strict=True)])
            assert tokens == expected.tolist()  # no padding: exactly the named documents
            assert batch.observation_ids[row] == row_id
        starts = batch.cu_seqlens[:-1].tolist()
        flat_positions = batch.position_ids.reshape(-1).tolist()
        assert all(flat_positions[s] == 0 for s in starts)
        assert sum(1 for p in flat_positions if p == 0) == len(starts)
        assert batch.document_starts.all() and batch.mask.all()
    report = loader.packing_report()
    assert report.padded_tokens == 0
    assert report.used_tokens + report.cropped_tokens + report.dropped_tokens == \
        sum(d.size for d in documents)


@pytest.mark.parametrize("packing", ["split", "fill"])
def test_packed_rows_hold_pieces_each_its_own_sequence_then_masked_padding(token_dataset,
                                                                           packing):
    documents = documents_of(token_dataset)
    loader = TokenLoader(token_dataset, T, B, mode="bestfit", seed=9, block_documents=128,
                         pad_id=7, packing=packing)
    plan = loader.plan()
    padded_rows = 0
    for batch in loader:
        for row, (_, pieces) in enumerate(plan.rows(batch.positions)):
            doc_ids, starts, take = pieces.documents, pieces.starts, pieces.take
            tokens = torch.cat([batch.inputs[row], batch.targets[row, -1:]]).tolist()
            filled = int(take.sum())
            expected = np.concatenate([documents[d][a:a + n] for d, a, n in
                                       zip(doc_ids, starts, take, strict=True)])
            assert tokens[:filled] == expected.tolist()
            assert tokens[filled:] == [7] * (T + 1 - filled)  # padding
            mask = [1] * (filled - 1) + [0] * (T + 1 - filled)
            for column, true in zip(pieces.columns[1:], pieces.true_joins, strict=True):
                mask[column - 1] = int(true)  # the target into a piece: true joins only
            assert batch.mask[row].tolist() == mask
            padded_rows += filled <= T
        flat = batch.position_ids.reshape(-1).tolist()
        starts_flat = batch.cu_seqlens[:-1].tolist()
        assert sum(1 for p in flat if p == 0) == len(starts_flat)  # a sequence per segment
        # a sequence starts a document iff it begins with BOS (pieces and padding do not)
        inputs = batch.inputs.reshape(-1).tolist()
        assert batch.document_starts.tolist() == [inputs[s] == 0 for s in starts_flat]
    report = loader.packing_report()
    assert report.cropped_tokens == report.dropped_tokens == 0
    assert report.used_tokens == sum(d.size for d in documents)
    if packing == "split":
        assert padded_rows > plan.num_blocks
    else:  # fill: every row full but less than one row's worth per block
        assert report.padded_tokens < plan.num_blocks * (T + 1)
        assert padded_rows <= report.padded_tokens


@pytest.mark.parametrize("world", [1, 2, 3])
def test_default_epoch_trains_at_least_99_percent_of_token_positions_once(token_dataset,
                                                                          world):
    """Over one epoch at any world size, the rows served cover every token of the data at
    most once and at least 99% of them (the rest: the drop-last tail)."""
    documents = documents_of(token_dataset)
    seen = [np.zeros(d.size, dtype=np.int64) for d in documents]
    plan = TokenLoader(token_dataset, T, B, mode="bestfit", seed=2).plan()
    consumed, _ = run_ranks(token_dataset, world, mode="bestfit", seed=2)
    for row_id in consumed:  # a global row id names (block, row in the block)
        block = int(np.searchsorted(plan.row_offsets, row_id, side="right")) - 1
        pieces = plan.pack(block).row(row_id - int(plan.row_offsets[block]))
        for doc, start, count in zip(pieces.documents, pieces.starts, pieces.take, strict=True):
            seen[doc][start:start + count] += 1
    counts = np.concatenate(seen)
    assert counts.max() == 1
    assert counts.mean() >= 0.99, f"{counts.mean():.2%} of tokens trained"


def test_documents_mode_pads_and_masks(token_dataset):
    documents = documents_of(token_dataset)
    loader = TokenLoader(token_dataset, T, B, mode="documents", seed=1, pad_id=2,
                         dtype=torch.int32)
    batch = next(iter(loader))
    assert batch.inputs.dtype == torch.int32
    for row, doc in enumerate(batch.observation_ids.tolist()):
        kept = min(documents[doc].size, T + 1)
        tokens = torch.cat([batch.inputs[row], batch.targets[row, -1:]]).tolist()
        assert tokens[:kept] == documents[doc][:kept].tolist()
        assert all(t == 2 for t in tokens[kept:])
        assert batch.mask[row].sum().item() == kept - 1


@pytest.mark.parametrize("mode", ["windows", "bestfit"])
@pytest.mark.parametrize("new_world", [1, 2, 3, 4, 8])
def test_exactly_once_across_resume_at_any_world_size(token_dataset, mode, new_world):
    probe = TokenLoader(token_dataset, T, B, mode=mode, seed=11, world_size=2)
    plan, size, last = probe.plan(), probe.plan().size, probe.steps_in_epoch()
    for stop in sorted({0, 1, last // 2, last - 1, last}):
        first, state = run_ranks(token_dataset, 2, steps=stop, mode=mode, seed=11)
        rest, final = run_ranks(token_dataset, new_world, state=state, mode=mode, seed=11)
        consumed = first + rest
        assert len(consumed) == len(set(consumed)), f"duplicate after stop at {stop}"
        end = stop * 2 * B + (size - stop * 2 * B) // (new_world * B) * new_world * B
        positions = np.arange(end)
        expected = (plan.window_starts(positions)[0] if mode == "windows"
                    else np.array([r[0] for r in plan.rows(positions)]))
        assert sorted(consumed) == sorted(expected.tolist())
        assert size - end < max(2, new_world) * B  # only the drop-last tail is missing
        assert final["epoch"] == 1 and final["position"] == 0


def test_shared_lanes_resume_at_a_world_their_lane_ranks_do_not_divide(token_dataset):
    """lane_ranks=2 at 2 ranks (one lane), resumed at 3: lane_ranks given again is refused,
    naming the remedy; left out, the state's lanes and lane_ranks resume the epoch, every
    observation once."""
    knobs = {"mode": "bestfit", "seed": 3, "shuffle": "windowed", "window_blocks": 1}
    first, state = run_ranks(token_dataset, 2, steps=3, lane_ranks=2, **knobs)
    assert state["knobs"]["lane_ranks"] == 2 and state["knobs"]["lanes"] == 1
    with pytest.raises(ConfigError, match="must divide the world size 3.*leave lane_ranks out"):
        TokenLoader(token_dataset, T, B, rank=0, world_size=3, lane_ranks=2, **knobs)
    rest, _ = run_ranks(token_dataset, 3, state=state, **knobs)
    size = TokenLoader(token_dataset, T, B, world_size=2, lane_ranks=2, **knobs).plan().size
    consumed = first + rest
    assert len(consumed) == len(set(consumed))
    assert size - len(consumed) < 3 * B  # only the drop-last tail is missing


def test_resume_twice_in_a_row_still_advances(token_dataset):
    first, state = run_ranks(token_dataset, 2, steps=3, mode="bestfit")
    second, state2 = run_ranks(token_dataset, 3, state=state, steps=1, mode="bestfit")
    third, state3 = run_ranks(token_dataset, 1, state=state2, steps=1, mode="bestfit")
    assert state["position"] < state2["position"] < state3["position"]
    assert not set(first) & set(second) and not set(second) & set(third)


def test_resumed_rows_equal_uninterrupted_rows(token_dataset):
    def rows_by_position(world, state=None, steps=None):
        loaders = [TokenLoader(token_dataset, T, B, rank=r, world_size=world, seed=4)
                   for r in range(world)]
        out = {}
        for loader in loaders:
            if state:
                loader.load_state_dict(state)
            for step, batch in enumerate(loader):
                if steps is not None and step >= steps:
                    break
                for row, position in enumerate(batch.positions.tolist()):
                    out[position] = batch.inputs[row].tolist()
        return out, loaders[0].state_dict()

    whole, _ = rows_by_position(1)
    head, state = rows_by_position(2, steps=5)
    tail, _ = rows_by_position(3, state=state)
    for position, row in {**head, **tail}.items():
        assert whole[position] == row


def test_state_is_small_json_and_checked(token_dataset, tmp_path):
    loader = TokenLoader(token_dataset, T, B, mode="windows")
    state = loader.state_dict()
    assert len(json.dumps(state)) < 4096
    TokenLoader(token_dataset, T + 1, B, mode="windows").load_state_dict(state)  # epoch start
    next(iter(loader))
    with pytest.raises(StateError, match=f"seq_len: {T} -> {T + 1} inside epoch 0 .* mode "
                                         "'windows' cannot"):
        TokenLoader(token_dataset, T + 1, B, mode="windows").load_state_dict(
            loader.state_dict())
    with pytest.raises(StateError, match="mode: saved 'windows', now 'bestfit'"):
        TokenLoader(token_dataset, T, B, mode="bestfit").load_state_dict(state)
    with pytest.raises(StateError, match="version"):
        loader.load_state_dict({**state, "version": 99})
    copy = tmp_path / "copy"
    shutil.copytree(token_dataset, copy)
    shard = sorted((copy / "megatron").glob("*.bin"))[0]
    data = bytearray(shard.read_bytes())
    data[0] ^= 1
    shard.write_bytes(bytes(data))
    manifest = json.loads((copy / "manifest.json").read_text())
    import hashlib

    for entry in manifest["formats"]["megatron"]["shards"][0]["files"]:
        entry["sha256"] = hashlib.sha256((copy / entry["path"]).read_bytes()).hexdigest()
    (copy / "manifest.json").write_text(json.dumps(manifest))
    with pytest.raises(StateError, match=r"unit part-0-\S+ of the run's data was rewritten "
                       "since the checkpoint"):  # its files differ from the kept digests
        TokenLoader(copy, T, B, mode="windows").load_state_dict(state)


def test_nanogpt_format_gives_the_same_rows_for_a_whole_epoch(token_dataset):
    def epoch(fmt):
        return [batch.inputs.clone() for batch in TokenLoader(token_dataset, T, B,
                                                                mode="bestfit", format=fmt)]

    megatron, nanogpt = epoch("megatron"), epoch("nanogpt")
    assert len(megatron) == len(nanogpt) > 1
    assert all(torch.equal(a, b) for a, b in zip(megatron, nanogpt, strict=True))


def _ddp_worker(rank, world, path, queue, port):
    import torch.distributed as dist

    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank,
                            world_size=world)
    loader = TokenLoader(path, T, B, mode="bestfit", seed=2)  # rank/world from torch.distributed
    ids = []
    for batch in loader:
        ids.extend(batch.observation_ids.tolist())
        dist.barrier()
    gathered = [None] * world
    dist.all_gather_object(gathered, ids)
    if rank == 0:
        queue.put((gathered, loader.plan().size))
    dist.destroy_process_group()


def _spawned_ranks(target, rank_args: list[tuple], answers: int) -> list:
    """`target(*args, queue, port)` in a spawned process for each args of `rank_args` (a
    gloo group on a free loopback port); the first `answers` things they put on the queue."""
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        port = sock.getsockname()[1]
    context = torch.multiprocessing.get_context("spawn")
    queue = context.Queue()
    processes = [context.Process(target=target, args=(*args, queue, port))
                 for args in rank_args]
    for process in processes:
        process.start()
    got = [queue.get(timeout=120) for _ in range(answers)]
    for process in processes:
        process.join(timeout=60)
    return got


def test_ddp_style_spawned_ranks_partition_the_epoch(token_dataset):
    [(gathered, size)] = _spawned_ranks(_ddp_worker, [(r, 2, str(token_dataset))
                                                      for r in range(2)], 1)
    ids = gathered[0] + gathered[1]
    assert not set(gathered[0]) & set(gathered[1])
    assert len(ids) == len(set(ids)) == size // (2 * B) * 2 * B


NODE_CACHE = 80_000  # a node cache whose windows hold a few blocks of token_dataset's


def _layout(knobs: dict) -> dict:
    return {name: knobs[name] for name in ("block_bytes", "window_blocks", "lanes")}


def _uneven_node_worker(rank, world, path, local_world_size, queue, port):
    """A rank of an uneven placement (its node's LOCAL_WORLD_SIZE given): its layout, its
    observations and what rank 0 warned."""
    import logging

    import torch.distributed as dist

    os.environ["LOCAL_WORLD_SIZE"] = str(local_world_size)
    warned = []
    handler = logging.Handler()
    handler.emit = lambda record: warned.append(record.getMessage())
    logging.getLogger("raypipe").addHandler(handler)
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank,
                            world_size=world)
    try:
        loader = TokenLoader(path, T, B, mode="bestfit", seed=2, shuffle="windowed",
                             cache_bytes=NODE_CACHE)
        ids = [i for batch in loader for i in batch.observation_ids.tolist()]
        queue.put((rank, _layout(loader.state_dict()["knobs"]), ids,
                   [text for text in warned if "the nodes differ" in text]))
    except Exception as error:  # said, not left to a timeout
        queue.put((rank, repr(error), [], []))
        raise
    finally:
        dist.destroy_process_group()


def test_ranks_on_nodes_of_different_sizes_plan_one_windowed_layout(token_dataset,
                                                                    monkeypatch):
    """Ray Train places workers unevenly (8 + 4 on nodes of 8 GPUs): LOCAL_WORLD_SIZE
    differs, and each rank alone would size the windows for its own node. Under
    torch.distributed the ranks agree on the most ranks a node has, so both plan one layout
    and the epoch is served once, partitioned."""
    own = {}
    for local_world_size in (1, 4):
        monkeypatch.setenv("LOCAL_WORLD_SIZE", str(local_world_size))
        own[local_world_size] = _layout(TokenLoader(
            token_dataset, T, B, mode="bestfit", seed=2, shuffle="windowed", rank=0,
            world_size=2, cache_bytes=NODE_CACHE).state_dict()["knobs"])
    assert own[1] != own[4]  # what each rank would plan alone
    results = sorted(_spawned_ranks(_uneven_node_worker, [(0, 2, str(token_dataset), 1),
                                                          (1, 2, str(token_dataset), 4)], 2))
    (_, layout_0, ids_0, warned), (_, layout_1, ids_1, _) = results
    assert layout_0 == layout_1 == own[4]  # the most ranks a node has: windows fit it
    assert not set(ids_0) & set(ids_1)
    assert len(ids_0) == len(ids_1) > 0
    assert len(warned) == 1 and "node ranks 1-4" in warned[0]


def test_node_ranks_sizes_the_windows_in_place_of_local_world_size(token_dataset,
                                                                   monkeypatch):
    """With tensor parallelism a node's processes (LOCAL_WORLD_SIZE) are fewer data ranks:
    node_ranks, given, sizes the windows as that many ranks a node share the cache."""
    def layout(local_world_size: int, **given) -> dict:
        monkeypatch.setenv("LOCAL_WORLD_SIZE", str(local_world_size))
        return _layout(TokenLoader(token_dataset, T, B, mode="bestfit", seed=2,
                                   shuffle="windowed", rank=0, world_size=2,
                                   cache_bytes=NODE_CACHE, **given).state_dict()["knobs"])

    assert layout(4, node_ranks=1) == layout(1) != layout(4)
    with pytest.raises(ConfigError, match="node_ranks: 0 must be an int >= 1"):
        TokenLoader(token_dataset, T, B, node_ranks=0)


def test_windows_boundaries_follow_bos_when_asked(token_dataset):
    loader = TokenLoader(token_dataset, T, B, mode="windows", seed=5, boundaries=True)
    for batch in loader:
        flat_inputs = batch.inputs.reshape(-1)
        expected = sorted({i for i in range(B * T) if flat_inputs[i] == 0 or i % T == 0})
        assert batch.cu_seqlens[:-1].tolist() == expected
        assert batch.cu_seqlens[-1].item() == B * T
        positions = batch.position_ids.reshape(-1).tolist()
        for start, stop in zip(expected, expected[1:] + [B * T], strict=True):
            assert positions[start:stop] == list(range(stop - start))
    plain = next(iter(TokenLoader(token_dataset, T, B, mode="windows", seed=5)))
    assert plain.cu_seqlens.tolist() == [i * T for i in range(B + 1)]


def test_pack_report_cli(token_dataset, capsys):
    from raypipe.cli import main

    assert main(["pack-report", str(token_dataset), "--seq-len", str(T)]) == 0
    printed = capsys.readouterr().out
    report = TokenLoader(token_dataset, T, B, mode="bestfit").packing_report()
    assert "bestfit (fill)" in printed and "cropped 0, dropped 0" in printed
    assert f"padding         {report.padded_tokens:,} (" in printed
    assert main(["pack-report", str(token_dataset), "--seq-len", str(T), "--packing",
                 "crop"]) == 0
    crop = TokenLoader(token_dataset, T, B, mode="bestfit", packing="crop").packing_report()
    assert f"cropped {crop.cropped_tokens:,}, dropped" in capsys.readouterr().out


def test_the_retired_name_llmbatch_selects_the_batches_mode_and_its_states_load(
        rich_dataset, caplog):
    """Before 0.7 the `batches` mode was `llmbatch`: that name still selects it, with one
    deprecation line per process, and a state saved under it resumes a `batches` loader
    at the same position (and a `batches` state an `llmbatch` loader)."""
    import logging

    from raypipe.sampling import state_compat

    state_compat._warned.discard("llmbatch")
    with caplog.at_level(logging.WARNING, logger="raypipe"):
        old = [TokenLoader(rich_dataset, mode="llmbatch", seed=3, block_batches=4)
               for _ in range(2)]
    renamed = [r.getMessage() for r in caplog.records if "now called" in r.getMessage()]
    assert renamed == ["loader mode 'llmbatch' is now called 'batches'; the old name keeps "
                       "working"]
    assert old[0].spec.mode == "batches"
    iterator = iter(old[0])
    for _ in range(3):
        next(iterator)
    state = old[0].state_dict()
    expected = next(iterator).observation_ids.tolist()  # what the run served next
    iterator.close()
    state_as_0_6 = {**state, "knobs": {**state["knobs"], "mode": "llmbatch"}}  # 0.6 wrote this
    for loader, saved in ((TokenLoader(rich_dataset, mode="batches", seed=3, block_batches=4),
                           state_as_0_6), (old[1], state_as_0_6), (old[1], state)):
        loader.load_state_dict(saved)
        assert next(iter(loader)).observation_ids.tolist() == expected


def test_batches_mode_serves_preformed_batches_exactly_once(rich_dataset):
    from raypipe.dataset import BatchDataset

    batches = BatchDataset(rich_dataset)
    probe = TokenLoader(rich_dataset, mode="batches", world_size=2, seed=3, block_batches=4)
    assert (probe.seq_len, probe.batch_size) == (32, 2)
    first, state = [], None
    loaders = [TokenLoader(rich_dataset, mode="batches", rank=r, world_size=2, seed=3,
                           block_batches=4) for r in range(2)]
    iterators = [iter(loader) for loader in loaders]
    for _ in range(5):
        for iterator in iterators:
            batch = next(iterator)
            index = int(batch.observation_ids[0])
            record = batches.batch(index)
            assert torch.equal(batch.inputs, torch.from_numpy(record[:, :-1].astype(np.int64)))
            assert torch.equal(batch.targets, torch.from_numpy(record[:, 1:].astype(np.int64)))
            first.append(index)
    state = loaders[0].state_dict()
    for iterator in iterators:
        iterator.close()
    rest = []
    resumed = TokenLoader(rich_dataset, mode="batches", seed=3, block_batches=4, world_size=3)
    resumed.load_state_dict(state)
    for batch in resumed:
        rest.extend(batch.observation_ids.tolist())
    for rank in (1, 2):
        other = TokenLoader(rich_dataset, mode="batches", seed=3, block_batches=4, rank=rank,
                            world_size=3)
        other.load_state_dict(state)
        rest.extend(i for b in other for i in b.observation_ids.tolist())
    consumed = first + rest
    assert len(consumed) == len(set(consumed))
    assert batches.num_batches - len(consumed) < 3  # the drop-last tail of a 3-rank step
    epoch0 = probe.plan(0).batches(np.arange(batches.num_batches))
    epoch1 = probe.plan(1).batches(np.arange(batches.num_batches))
    assert sorted(epoch0.tolist()) == list(range(batches.num_batches))
    assert not np.array_equal(epoch0, epoch1)  # blocks reshuffled per epoch
    assert (np.diff(epoch0[:4]) == 1).all()  # inside a block, file order


def test_windows_batches_carry_stream_metadata(rich_dataset):
    loader = TokenLoader(rich_dataset, T, B, mode="windows", format="stream", metadata=True)
    batch = next(iter(loader))
    assert len(batch.metadata) == B
    for row, window in enumerate(batch.metadata):
        assert window.tokens[:-1].tolist() == batch.inputs[row].tolist()
        for position in range(T):
            record = window.record_of(position)
            assert set(record) == {"source", "row", "id"}
    with pytest.raises(ConfigError, match="metadata=True needs"):
        TokenLoader(rich_dataset, T, B, mode="bestfit", format="stream", metadata=True)


def test_an_options_record_and_keywords_make_the_same_loader(token_dataset):
    from raypipe.loader import LoaderOptions

    options = LoaderOptions.of(seq_len=T, batch_size=B, mode="windows", seed=5)
    by_record = TokenLoader(token_dataset, options=options)
    by_keywords = TokenLoader(token_dataset, T, B, mode="windows", seed=5)
    assert by_record.state_dict() == by_keywords.state_dict()
    first, second = next(iter(by_record)), next(iter(by_keywords))
    assert torch.equal(first.inputs, second.inputs)
    overridden = TokenLoader(token_dataset, options=options, seed=6)
    assert overridden.state_dict()["knobs"]["seed"] == 6


def test_an_unknown_loader_option_is_named_with_the_known_ones(token_dataset):
    with pytest.raises(ConfigError, match="unknown loader option.*seqlen.*the options are"):
        TokenLoader(token_dataset, B, seqlen=T)


def test_the_default_device_follows_the_machine(token_dataset):
    loader = TokenLoader(token_dataset, T, B, mode="windows")
    expected = "cuda" if torch.cuda.is_available() else "cpu"
    assert loader.device.type == expected
    assert next(iter(loader)).inputs.device.type == expected


@pytest.mark.parametrize("prefetch", [1, 2, 4])
def test_a_batch_stays_intact_while_prefetch_more_are_taken(token_dataset, prefetch):
    """The ring hands batches over a few at a time; a batch the trainer keeps is not
    rewritten before it has taken `prefetch` more, wherever the hand-off chunks begin."""
    import copy

    loader = TokenLoader(token_dataset, T, B, seed=2, prefetch=prefetch)
    kept, copies = [], []
    for index, batch in enumerate(loader):
        kept.append(batch)
        copies.append(copy.deepcopy(batch))
        if index >= prefetch:
            old = index - prefetch
            assert torch.equal(kept[old].inputs, copies[old].inputs), f"batch {old} rewritten"
        if index == 14:
            break


def test_a_packing_report_shows_as_its_lines_in_print_and_in_a_repl(token_dataset):
    report = TokenLoader(token_dataset, T, B, mode="bestfit").packing_report()
    assert str(report) == report.render() and str(report).startswith("rows ")
    assert repr(report).startswith("PackingReport\n  rows ")
    assert "PackingReport(rows=" not in repr(report)  # not the dataclass's field dump


@pytest.mark.parametrize("kind", ["dataset", "mixture"])
def test_both_loaders_keep_one_contract_iterate_save_and_resume_at_the_next_step(
        token_dataset, rich_dataset, kind):
    from raypipe.loader import Loader, open_loader

    source = (str(token_dataset) if kind == "dataset"
              else {"web": str(token_dataset), "code": str(rich_dataset)})
    first = open_loader(source, 16, 4, seed=3)
    assert isinstance(first, Loader)
    taken = iter(first)
    for _ in range(2):
        next(taken)
    state = json.loads(json.dumps(first.state_dict()))
    expected = next(taken)
    resumed = open_loader(source, 16, 4, seed=3)
    resumed.load_state_dict(state)
    following = next(iter(resumed))
    assert following.step == expected.step and (first.global_batch, first.seq_len) == (
        resumed.global_batch, resumed.seq_len) == (4, 16)
    assert torch.equal(following.inputs, expected.inputs)


def test_a_dropped_tail_of_pre_formed_batches_counts_their_real_tokens(rich_dataset):
    """Ranks over LLMBATCH batches leave the epoch's last batches (under one global step)
    untrained: `dropped_tail` counts their tokens, padding aside, which are the dataset's
    real tokens less those of every batch the ranks served."""
    from raypipe.dataset import BatchDataset

    batches = BatchDataset(rich_dataset)
    real = [int((~batches.padding(index)).sum()) for index in range(batches.num_batches)]
    world = next(size for size in (3, 4, 5, 7) if batches.num_batches % size)
    served, tails = [], []
    for rank in range(world):
        loader = TokenLoader(rich_dataset, mode="batches", seed=3, rank=rank,
                             world_size=world, block_batches=4)
        served += [int(b.observation_ids.reshape(-1)[0]) for b in loader]
        tails.append(loader.dropped_tail)
    dropped = batches.num_batches % world
    assert len(served) == batches.num_batches - dropped == len(set(served))
    expected = sum(real) - sum(real[index] for index in served)
    assert tails == [(0, dropped, expected)] * world and expected > 0


def test_a_resume_under_auto_adopts_the_states_shuffle_in_the_run_it_opened(token_dataset):
    """A run asked for shuffle "auto" (global, locally) that resumes a windowed state plans
    under the state's shuffle and layout, in the PlannedDataset it opened (only its plans
    are made again), and serves what the windowed run would have."""
    windowed = TokenLoader(token_dataset, 32, 4, seed=5, shuffle="windowed", lanes=2)
    batches = iter(windowed)
    next(batches)
    state = windowed.state_dict()
    expected = [batch.inputs.numpy().tobytes() for batch in batches]
    resumed = TokenLoader(token_dataset, 32, 4, seed=5)
    planned = resumed.run.planned
    assert planned.spec.shuffle == "global"
    resumed.load_state_dict(state)
    assert resumed.run.planned is planned
    assert (planned.spec.shuffle, planned.spec.lanes) == ("windowed", 2)
    assert [batch.inputs.numpy().tobytes() for batch in resumed] == expected


def test_a_windowed_state_saved_without_lane_ends_resumes_with_lanes_spread(token_dataset):
    """A windowed state that records no `lane_ends` (saved before the knob: its lanes'
    rest read by every rank) resumes in that layout, batch for batch, under a run whose
    default is nearby; a nearby run's state records its layout."""
    spread = TokenLoader(token_dataset, 32, 4, seed=5, shuffle="windowed", lanes=2,
                         lane_ends="spread")
    batches = iter(spread)
    next(batches)
    state = spread.state_dict()
    assert "lane_ends" not in state["knobs"]
    expected = [batch.inputs.numpy().tobytes() for batch in batches]
    nearby = TokenLoader(token_dataset, 32, 4, seed=5, shuffle="windowed", lanes=2)
    assert nearby.state_dict()["knobs"]["lane_ends"] == "nearby"
    assert [batch.inputs.numpy().tobytes() for batch in nearby][1:] != expected
    resumed = TokenLoader(token_dataset, 32, 4, seed=5, shuffle="windowed", lanes=2)
    resumed.load_state_dict(state)
    assert [batch.inputs.numpy().tobytes() for batch in resumed] == expected


@pytest.mark.parametrize("shuffle, knobs, needs", [
    ("global", {"block_bytes": 8192, "window_blocks": 3}, "shuffle='windowed'"),
    ("windowed", {"group_shards": 3}, "shuffle='shard_local'"),
    ("shard_local", {"lanes": 2}, "shuffle='windowed'"),
])
def test_a_layout_knob_of_another_shuffle_than_the_one_named_is_refused_not_ignored(
        token_dataset, shuffle, knobs, needs):
    """block_bytes under shuffle='global' was ignored without a word; it is one line
    naming the knob and the shuffle it needs. Under 'auto' such knobs are taken (they
    apply where auto resolves to their shuffle), and a default value is no complaint."""
    with pytest.raises(ConfigError) as refused:
        TokenLoader(token_dataset, 32, 4, shuffle=shuffle, **knobs)
    message = str(refused.value)
    assert all(f"{name}={value!r}" in message for name, value in knobs.items())
    assert needs in message and f"shuffle={shuffle!r} would ignore" in message
    assert "\n" not in message
    TokenLoader(token_dataset, 32, 4, shuffle="auto", **knobs).close()
    TokenLoader(token_dataset, 32, 4, shuffle=shuffle,
                **{name: 0 for name in knobs}).close()
