"""Weighted mixtures: exact shares per step, exact elastic resume through the shared harness,
a state that names what changed, one tokenizer for all sources."""

from __future__ import annotations

import json
import logging

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from raypipe.config import load_config
from raypipe.demo.train_tokenizer import SHIPPED
from raypipe.errors import ConfigError, StateError
from raypipe.io.states import SourcePosition
from raypipe.loader import open_loader
from raypipe.preprocess.job import run_job
from raypipe.sampling.mixture import MixtureSchedule, WeightStages, allocate
from tests import test_state_harness as harness
from tests.conftest import write_parquet


@pytest.fixture(scope="module")
def sources(token_dataset, rich_dataset):
    return {"web": str(token_dataset), "code": str(rich_dataset)}


def test_shares_stay_within_half_a_percent_after_1000_steps_at_world_size_2(sources, figure):
    weights = {"web": 0.7, "code": 0.3}
    rows = np.zeros(2)
    for rank in range(2):
        loader = open_loader(sources, 16, 4, weights=weights, rank=rank, world_size=2,
                             mode="documents")
        for step, batch in enumerate(loader):
            rows += np.bincount(batch.source_ids, minlength=2)
            if step == 999:
                break
    shares = rows / rows.sum()  # sources in sorted order: code, web
    assert abs(shares[0] - 0.3) < 0.005 and abs(shares[1] - 0.7) < 0.005
    state = loader.state_dict()["sources"]
    assert state["code"]["consumed"] + state["web"]["consumed"] == 1000 * 8
    assert state["code"]["epoch"] >= 1, "the small source did not cycle its epochs"
    figure("mixture shares after 1000 steps, W=2", f"code {shares[0]:.4f} (0.3), web "
           f"{shares[1]:.4f} (0.7)")


def test_allocation_is_exact_per_step_up_to_rounding():
    weights = np.array([0.5, 0.3, 0.2])
    consumed = np.zeros(3)
    for _ in range(200):
        counts = allocate(weights, consumed, 7)
        assert counts.sum() == 7 and (counts >= 0).all()
        consumed += counts
        assert np.all(np.abs(consumed - weights * consumed.sum()) <= 1.0)


@settings(max_examples=60, deadline=None)
@given(weights=st.lists(st.floats(0.05, 1.0), min_size=1, max_size=4),
       world=st.integers(1, 4), batch=st.integers(1, 5), skipped=st.integers(0, 40),
       sizes=st.lists(st.integers(1, 30), min_size=4, max_size=4),
       stage_at=st.integers(1, 45))
def test_a_schedule_skipped_ahead_serves_the_rows_of_one_walked_step_by_step(
        weights, world, batch, skipped, sizes, stage_at):
    """trace skips to a step by counts alone; the loader walks every step: the same rows,
    each source's rows taken one after another across epochs of their own sizes, across a
    change of weights at step `stage_at` (a stage of the reversed weights)."""
    weights = np.array(weights) / sum(weights)
    stages = WeightStages((0, stage_at), (weights, weights[::-1].copy()))
    epoch_sizes = [lambda epoch, phases=(), n=n: n + epoch % 3 for n in sizes[:len(weights)]]

    def schedule() -> MixtureSchedule:
        return MixtureSchedule(stages, world, batch, epoch_sizes,
                               [SourcePosition("d", 0, 0, 0) for _ in weights])

    walked, jumped = schedule(), schedule()
    served: list[set] = [set() for _ in weights]
    for _ in range(skipped):
        for slot in walked.next_step():
            key = (slot.epoch, slot.position)
            assert key not in served[slot.source], "a row served twice"
            assert slot.position < epoch_sizes[slot.source](slot.epoch)
            served[slot.source].add(key)
    jumped.skip(skipped)
    assert jumped.positions == walked.positions and jumped.step == walked.step == skipped
    assert jumped.next_step() == walked.next_step()


@pytest.mark.parametrize("knobs", [{"mode": "bestfit"}, {"mode": "documents"},
                                   {"mode": "windows"},
                                   {"mode": "bestfit", "balance": "attention",
                                    "balance_hidden": 1}],
                         ids=["bestfit", "documents", "windows", "bestfit-balanced"])
def test_a_mixture_resumes_exactly_from_1_to_2_to_3_ranks(sources, knobs):
    mode = knobs["mode"]
    options = {**knobs, "weights": {"web": 0.6, "code": 0.4}}
    reference, _ = harness.run_segment(sources, options, 1, None, steps=40)
    reference = dict(reference)
    first, state = harness.run_segment(sources, options, 1, None, steps=3)
    second, state = harness.run_segment(sources, options, 2, json.loads(json.dumps(state)),
                                        steps=4)
    third, state = harness.run_segment(sources, options, 3, state, steps=4)
    consumed = first + second + third
    keys = [key for key, _ in consumed]
    assert len(keys) == len(set(keys)), f"{mode}: a row was served twice"
    for source, name in enumerate(sorted(sources)):
        served = sorted(p for s, p in keys if s == source)
        assert served == list(range(state["sources"][name]["consumed"])), \
            f"{mode}: source {name} skipped or repeated a row"
    missing = [key for key, _ in consumed if key not in reference]
    assert not missing, f"{mode}: rows the uninterrupted run never served: {missing[:5]}"
    assert all(reference[key] == tokens for key, tokens in consumed)


STAGED = {"weights": {"web": 0.7, "code": 0.3}, "stages": [(40, {"web": 0.3, "code": 0.7})]}


def test_each_weight_stage_holds_its_shares_within_1_percent_of_its_own_rows(sources, figure):
    rows = np.zeros((2, 2))  # [stage, source (code, web)]
    for rank in range(2):
        loader = open_loader(sources, 16, 4, rank=rank, world_size=2, mode="documents",
                             **STAGED)
        for batch in loader:
            rows[int(batch.step >= 40)] += np.bincount(batch.source_ids, minlength=2)
            if batch.step == 79:
                break
    for stage, code_share in ((0, 0.3), (1, 0.7)):
        total = rows[stage].sum()
        assert total == 40 * 8
        assert abs(rows[stage][0] - code_share * total) <= 0.01 * total, rows
    figure("mixture stages 0.7/0.3 -> 0.3/0.7 at step 40, W=2", f"code share {rows[0][0] / 320:.4f}"
           f" then {rows[1][0] / 320:.4f}")


@pytest.mark.parametrize("stops", [(25, 20), (45, 10), (40, 5)])
def test_a_staged_mixture_resumes_exactly_inside_either_stage(sources, stops):
    options = {"mode": "documents", **STAGED}
    whole, _ = harness.run_segment(sources, options, 2, None, steps=sum(stops) + 10)
    first, state = harness.run_segment(sources, options, 2, None, steps=stops[0])
    second, state = harness.run_segment(sources, options, 2, json.loads(json.dumps(state)),
                                        steps=stops[1])
    third, _ = harness.run_segment(sources, options, 2, json.loads(json.dumps(state)),
                                   steps=10)
    assert first + second + third == whole


def test_new_weights_on_resume_hold_their_shares_over_the_rows_after_it(sources):
    options = {"mode": "documents", "weights": {"web": 0.7, "code": 0.3}}
    _, state = harness.run_segment(sources, options, 2, None, steps=30)
    reweighted = {"mode": "documents", "weights": {"web": 0.2, "code": 0.8}}
    after, _ = harness.run_segment(sources, reweighted, 2, state, steps=30)
    code = sum(1 for (source, _), _ in after if source == 0)
    assert abs(code - 0.8 * len(after)) <= 0.01 * len(after), (code, len(after))


def test_a_changed_source_or_none_in_common_is_refused_naming_it(sources, tmp_path, caplog):
    loader = open_loader(sources, 16, 4, weights={"web": 0.5, "code": 0.5})
    next(iter(loader))
    state = loader.state_dict()
    other = open_loader({"other": sources["web"]}, 16, 4)
    with pytest.raises(StateError, match=r"holds sources \['code', 'web'\], this mixture has "
                       r"\['other'\]: none in common"):
        other.load_state_dict(state)
    changed = json.loads(json.dumps(state))
    changed["sources"]["code"]["dataset"] = "0" * 16
    with pytest.raises(StateError, match="source 'code' .* changed"):
        open_loader(sources, 16, 4).load_state_dict(changed)
    with caplog.at_level(logging.INFO, logger="raypipe"):
        reweighted = open_loader(sources, 16, 4, weights={"web": 0.9, "code": 0.1})
        reweighted.load_state_dict(state)
    assert "weights changed" in caplog.text
    resumed = reweighted.state_dict()["sources"]  # every source where it stood, and the new
    assert resumed == {name: {**where, "stage_base": where["consumed"]}  # weights' stage
                       for name, where in state["sources"].items()}  # begun there


def test_sources_with_different_tokenizers_are_refused_naming_both(sources, tmp_path):
    corpus = write_parquet(tmp_path / "c" / "c.parquet", ["hello world"] * 50)
    config = load_config(None, inputs=[str(corpus)], output=str(tmp_path / "other"),
                         tokenizer=str(SHIPPED), formats=["megatron"])
    run_job(config)
    with pytest.raises(ConfigError, match="different tokenizers") as caught:
        open_loader({"code": sources["code"], "other": str(tmp_path / "other")}, 16, 2)
    assert "'code'" in str(caught.value) and "'other'" in str(caught.value)


def test_weights_must_name_every_source(sources):
    with pytest.raises(ConfigError, match="weights"):
        open_loader(sources, 16, 2, weights={"web": 1.0})


def write_mixture(tmp_path, sources, weights=None):
    entries = {name: {"path": path, **({"weight": weights[name]} if weights else {})}
               for name, path in sources.items()}
    path = tmp_path / "mixture.yaml"
    path.write_text(json.dumps({"sources": entries}))  # JSON is YAML
    return path


def test_a_mixture_yaml_drives_the_loader_pack_report_and_inspect(sources, tmp_path, capsys):
    from raypipe.cli import main

    spec = write_mixture(tmp_path, sources, {"web": 3, "code": 1})
    loader = open_loader(str(spec), 16, 4)
    assert loader.weights_by_name == {"code": 0.25, "web": 0.75}
    assert main(["pack-report", str(spec), "--seq-len", "16"]) == 0
    report = capsys.readouterr().out
    assert "0.2500" in report and "0.7500" in report and "== source web" in report
    assert main(["inspect", str(spec), "--samples", "0"]) == 0
    shown = capsys.readouterr().out
    assert "mixture" in shown and "== source code" in shown
    by_tokens = open_loader(str(write_mixture(tmp_path, sources)), 16, 4)
    tokens = {n: s.dataset.num_tokens for n, s in zip(by_tokens.names, by_tokens.sources,
                                                       strict=True)}
    assert by_tokens.weights_by_name["web"] == pytest.approx(
        tokens["web"] / sum(tokens.values()))


def test_a_mixture_yaml_with_some_weights_missing_is_refused(sources, tmp_path):
    path = tmp_path / "bad.yaml"
    path.write_text(json.dumps({"sources": {"web": {"path": sources["web"], "weight": 1},
                                            "code": {"path": sources["code"]}}}))
    with pytest.raises(ConfigError, match="every source a weight, or none"):
        open_loader(str(path), 16, 4)


def test_token_loader_refuses_a_mixture_and_names_open_loader(sources, tmp_path):
    from raypipe.loader import TokenLoader

    for mixture in (sources, str(write_mixture(tmp_path, sources))):
        with pytest.raises(ConfigError, match="open_loader"):
            TokenLoader(mixture, 16, 4)


def test_the_example_trainer_reports_where_a_mixture_or_a_dataset_stands(sources):
    """jobs/train.py on a mixture YAML: the trainer's metrics and resume line name the
    mixture's steps (a MixtureLoader has no single epoch or position)."""
    from raypipe.examples.gpt_train import position_metrics
    from raypipe.loader import TokenLoader, open_loader

    mixture = open_loader(sources, 16, 2, device="cpu")
    next(iter(mixture))
    assert position_metrics(mixture) == {"mixture_steps": 1}
    single = TokenLoader(next(iter(sources.values())), 16, 2, device="cpu")
    assert position_metrics(single) == {"epoch": 0, "position": 0, "seq_len": 16}


def test_a_mixture_yaml_s_stages_drive_the_loader_and_trace_follows_them(sources, tmp_path):
    from raypipe import trace

    path = write_mixture(tmp_path, sources, STAGED["weights"])
    spec = json.loads(path.read_text())
    spec["stages"] = [{"step": 40, "weights": {"web": 0.3, "code": 0.7}}]
    path.write_text(json.dumps(spec))
    loaded = {}
    for rank in range(2):
        loader = open_loader(str(path), 16, 4, rank=rank, world_size=2, mode="documents")
        for batch in loader:
            if batch.step in (39, 41):
                loaded[batch.step, rank] = [sorted(sources)[s] for s in batch.source_ids]
            if batch.step == 41:
                break
    assert loaded[41, 0].count("code") + loaded[41, 1].count("code") >= 5  # 0.7 of 8
    for step in (39, 41):
        traced = {(r.rank, r.row): r.source for r in trace(str(path), step, world_size=2,
                                                           batch_size=4, seq_len=16,
                                                           mode="documents")}
        for rank in range(2):
            assert [traced[rank, row] for row in range(4)] == loaded[step, rank]


def test_stages_must_start_at_increasing_steps_and_follow_weights(sources, tmp_path):
    with pytest.raises(ConfigError, match="increasing steps"):
        open_loader(sources, 16, 4, weights={"web": 1, "code": 1},
                    stages=[(10, {"web": 1, "code": 2}), (10, {"web": 2, "code": 1})])
    path = write_mixture(tmp_path, sources)  # weights by tokens: no stage 0 to follow
    spec = json.loads(path.read_text())
    spec["stages"] = [{"step": 5, "weights": {"web": 0.5, "code": 0.5}}]
    path.write_text(json.dumps(spec))
    with pytest.raises(ConfigError, match="stages need the sources' own weights"):
        open_loader(str(path), 16, 4)
