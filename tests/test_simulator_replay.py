"""Replaying a head-to-head's stored rows re-predicts them with the simulator."""
import json

import pytest

from benchmarks.simulator_replay import main, replay, replay_record, replayed_prediction
from gradsync import compress, planners
from gradsync.planning import LayoutPlan, predict_cycle, predict_steady
from gradsync.compress.wire import wire_profile
from gradsync.cost import CostModel
from gradsync.profile import ModelProfile, zoo


def stored_row(compressor, cost):
    """A row as head_to_head stores it, and the mean predicted step of the codec's steady cycle."""
    profile = zoo("resnet50")
    codec = compress.build(compressor)
    codec.setup({t.name: t for layer in profile.layers for t in layer.tensors}, 4, seed=0)
    plans, seconds = predict_cycle(profile, cost, planners.bind("mg_wfbp"), codec)
    record = json.loads(json.dumps(replay_record(plans, codec.steady_rounds(), cost)))
    return record, seconds


@pytest.mark.parametrize("compressor", [None, {"type": "powersgd", "rank": 4}, {"type": "acp_sgd", "rank": 4}])
def test_a_stored_row_replays_to_the_prediction_made_from_it(compressor):
    cost = CostModel(a=1e-3, b=8e-9, gamma=1.5, host=2e-4, compute_slowdown=1.2, transfer_slowdown=1.1)
    record, seconds = stored_row(compressor, cost)
    assert replayed_prediction(record) == pytest.approx(seconds, rel=1e-12)
    slower = dict(record, cost=CostModel(a=2e-3, b=16e-9).to_dict())  # the record's own cost is used
    assert replayed_prediction(slower) != pytest.approx(seconds, rel=1e-3)


def test_replay_lists_every_row_and_prints_both_errors(tmp_path, capsys):
    cost = CostModel(a=1e-3, b=8e-9)
    record, seconds = stored_row(None, cost)
    stored = {"setting": {"gradsync mg_wfbp": {"seconds": seconds * 2, "predicted": seconds * 1.5, "replay": record},
                          "torch DDP": {"seconds": seconds, "blocks": [seconds], "predicted": None, "replay": None}}}
    rows = replay(stored)  # the torch row is measured only
    assert len(rows) == 1 and rows[0][:4] == ("setting", "gradsync mg_wfbp", seconds * 2, seconds * 1.5)
    assert rows[0][4] == pytest.approx(seconds)
    path = tmp_path / "head_to_head.json"
    path.write_text(json.dumps(stored))
    main([str(path)])
    output = capsys.readouterr().out
    assert "median |error| stored: 25.0% over 1 rows" in output and "median |error| now: 50.0% over 1 rows" in output


def test_replay_with_other_slowdowns_predicts_as_a_record_made_with_them(tmp_path, capsys):
    slowed = CostModel(a=1e-3, b=8e-9, host=2e-4, compute_slowdown=1.6, transfer_slowdown=1.8)
    record, slowed_seconds = stored_row(None, slowed)
    _, unslowed_seconds = stored_row(None, CostModel(a=1e-3, b=8e-9, host=2e-4))  # the same plan: mg_wfbp
    stored = {"setting": {"gradsync mg_wfbp": {"seconds": unslowed_seconds, "predicted": slowed_seconds,
                                               "replay": record}}}
    assert replay(stored)[0][4] == pytest.approx(slowed_seconds)
    assert replay(stored, (1.0, 1.0))[0][4] == pytest.approx(unslowed_seconds) != pytest.approx(slowed_seconds)
    path = tmp_path / "head_to_head.json"
    path.write_text(json.dumps(stored))
    main([str(path), "--slowdowns", "1", "1"])
    assert "median |error| now: 0.0% over 1 rows" in capsys.readouterr().out


def test_replay_gives_the_median_error_per_number_of_ranks(tmp_path, capsys):
    record, seconds = stored_row(None, CostModel(a=1e-3, b=8e-9))
    stored = {f"CNN (small tensors), {ranks} ranks, 1gbit": {
        f"gradsync {name}": {"seconds": seconds / (1 + error), "predicted": seconds, "replay": record}
        for name, error in errors.items()} for ranks, errors in ((2, {"wfbp": 0.02, "mg_wfbp": -0.04}), (4, {"wfbp": 0.10}))}
    path = tmp_path / "head_to_head.json"
    path.write_text(json.dumps(stored))
    main([str(path)])
    output = capsys.readouterr().out
    assert "median |error| stored: 4.0% over 3 rows; 2 ranks 3.0% over 2; 4 ranks 10.0% over 1" in output


def test_a_record_without_rows_is_refused(tmp_path):
    path = tmp_path / "empty.json"
    path.write_text("{}")
    with pytest.raises(SystemExit, match="no gradsync row"):
        main([str(path)])


def test_a_record_keeps_each_ranks_profile():
    profile = zoo("resnet50")
    ranks = [profile, profile.scaled(2.0)]
    codec = compress.build(None)
    codec.setup({t.name: t for layer in profile.layers for t in layer.tensors}, 2, seed=0)
    cost = CostModel(a=1e-3, b=8e-9)
    plans, _ = predict_cycle(profile, cost, planners.bind("mg_wfbp"), codec)
    record = json.loads(json.dumps(replay_record(plans, codec.steady_rounds(), cost, ranks)))
    assert [ModelProfile.from_dict(data) for data in record["rank_profiles"]] == ranks


def test_a_record_with_rank_profiles_replays_on_the_times_combined_from_them():
    profile = zoo("resnet50")
    slower = profile.scaled(2.0)  # slowest at every layer: the combination is its profile
    codec = compress.build(None)
    codec.setup({t.name: t for layer in profile.layers for t in layer.tensors}, 2, seed=0)
    cost = CostModel(a=1e-3, b=8e-9, compute_slowdown=1.2)
    plans, seconds = predict_cycle(profile, cost, planners.bind("mg_wfbp"), codec)
    record = json.loads(json.dumps(replay_record(plans, codec.steady_rounds(), cost, [profile, slower])))
    on_slower = {layout: LayoutPlan(entry.plan, wire_profile(slower, codec, layout)) for layout, entry in plans.items()}
    assert replayed_prediction(record) == pytest.approx(predict_steady(on_slower, codec.steady_rounds(), cost), rel=1e-12)
    assert replayed_prediction(record) > 1.1 * seconds  # not the stored wire profile's times


def test_a_record_with_compute_scales_replays_each_block_at_its_scale_and_takes_the_median():
    cost = CostModel(a=1e-3, b=8e-9, compute_slowdown=1.2)
    record, seconds = stored_row(None, cost)
    at = {}
    for scale in (1.0, 1.5, 2.0, 3.0):
        at[scale] = replayed_prediction(dict(record, compute_scales=[[scale]]))
    assert at[1.0] == pytest.approx(seconds, rel=1e-12) and at[1.0] < at[1.5] < at[2.0] < at[3.0]
    # blocks [1.5], [1.5, 3.0] (straddling a rescale) and [2.0]: the median of 1.5's, the mean of 1.5's and
    # 3.0's, and 2.0's prediction
    blocks = dict(record, compute_scales=[[1.5], [1.5, 3.0], [2.0]])
    expected = sorted([at[1.5], (at[1.5] + at[3.0]) / 2, at[2.0]])[1]
    assert replayed_prediction(blocks) == pytest.approx(expected, rel=1e-12)
