import json

import pytest

from gradsync import ConfigError
from gradsync.profile import LayerProfile, ModelProfile, TensorSpec
from helpers import MS, toy_profile


def test_backward_times_follow_us_byte_eq2():
    profile = toy_profile([(10, 1, 3), (10, 1, 2), (10, 1, 5)])
    # backward runs layer 2 (0..5 ms), layer 1 (5..7 ms), layer 0 (7..10 ms)
    assert profile.backward_start_times() == pytest.approx([7 * MS, 5 * MS, 0.0])
    assert profile.backward_ready_times() == pytest.approx([10 * MS, 7 * MS, 5 * MS])
    assert profile.backward_time == pytest.approx(10 * MS)


def test_counts_and_bytes():
    layer = LayerProfile("l", (TensorSpec("w", 6), TensorSpec("b", 2, 2)), 0.0, 0.0)
    profile = ModelProfile("m", (layer,))
    assert (profile.num_parameters, profile.num_tensors, profile.total_bytes) == (8, 2, 28)


def test_json_round_trip(tmp_path):
    profile = toy_profile([(10, 1, 3), (20, 2, 2)]).with_update_time(0.006)
    path = tmp_path / "p.json"
    profile.save(path)
    assert ModelProfile.load(path) == profile
    # shared by gradient bytes: 10 and 20 elements
    assert [layer.update_time for layer in profile.layers] == pytest.approx([0.002, 0.004])
    data = profile.to_dict()
    for layer in data["layers"]:
        del layer["update_time"]  # profiles written before the field: no update time
    assert ModelProfile.from_dict(data).update_time == 0.0


@pytest.mark.parametrize(
    "mutate, field",
    [
        (lambda d: d.update(layers=[]), "layers"),
        (lambda d: d["layers"][0].pop("backward_time"), "backward_time"),
        (lambda d: d["layers"][0].update(forward_time=-1), "forward_time"),
        (lambda d: d["layers"][0]["tensors"][0].update(numel=0), "numel"),
        (lambda d: d["layers"][0]["tensors"][0].update(bytes_per_element=3), "bytes_per_element"),
        (lambda d: d["layers"][1]["tensors"][0].update(name="t0"), "appears twice"),
        (lambda d: d["layers"][0].update(update_time=-0.1), "update_time"),
        (lambda d: d["layers"][1].update(update_time=float("nan")), "update_time"),
        (lambda d: d["layers"][0]["tensors"][0].update(numel=True), "numel"),
        (lambda d: d.update(metadata=5), "metadata"),
    ],
)
def test_bad_profiles_name_the_field(mutate, field):
    data = toy_profile([(10, 1, 3), (20, 2, 2)]).to_dict()
    mutate(data)
    with pytest.raises(ConfigError, match=field):
        ModelProfile.from_dict(data)


def test_malformed_and_empty_json(tmp_path):
    bad = tmp_path / "bad.json"
    bad.write_text("{not json")
    with pytest.raises(ConfigError, match="malformed"):
        ModelProfile.load(bad)
    empty = tmp_path / "empty.json"
    empty.write_text(json.dumps({"name": "x", "layers": []}))
    with pytest.raises(ConfigError, match="layers"):
        ModelProfile.load(empty)
