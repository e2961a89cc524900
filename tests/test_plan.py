import pytest

from gradsync import ConfigError, Op, Plan, Slice
from gradsync.plan import FORWARD
from gradsync.profile import LayerProfile, ModelProfile, TensorSpec
from helpers import toy_profile

PROFILE = toy_profile([(10, 1, 1), (6, 1, 1)])


def plan_of(*ops):
    return Plan(tuple(ops))


def test_valid_plan_with_split_tensor_round_trips_through_json():
    plan = plan_of(
        Op((Slice("t1", 0, 6),)),
        Op((Slice("t0", 4, 6),), channel=1),
        Op((Slice("t0", 0, 4),), phase=FORWARD, priority=3),
    ).validate(PROFILE)
    again = Plan.from_json(plan.to_json())
    assert again == plan and again.hash == plan.hash
    assert plan.channels == 2


def test_hash_changes_with_the_ops():
    one = plan_of(Op((Slice("t0", 0, 10),)), Op((Slice("t1", 0, 6),)))
    two = plan_of(Op((Slice("t1", 0, 6),)), Op((Slice("t0", 0, 10),)))
    assert one.hash != two.hash


@pytest.mark.parametrize(
    "ops, message",
    [
        ((Op((Slice("t0", 0, 10),)),), "t1.*not covered"),
        ((Op((Slice("t0", 0, 10), Slice("t1", 0, 6))), Op((Slice("t1", 5, 1),))), "t1.*covered twice"),
        ((Op((Slice("t0", 0, 9),)), Op((Slice("t1", 0, 6),))), "t0.*not covered"),
        ((Op((Slice("t0", 0, 11), Slice("t1", 0, 6))),), "outside"),
        ((Op((Slice("zz", 0, 1),)),), "unknown tensor"),
        ((Op((Slice("t0", 0, 10),), channel=1), Op((Slice("t1", 0, 6),), channel=2)), "channels"),
        ((Op((Slice("t0", 0, 10),), phase=FORWARD), Op((Slice("t1", 0, 6),))), "backward op follows"),
        ((Op((Slice("t0", 0, 10), Slice("t1", 0, 6)), phase="later"),), "phase"),
        ((Op((Slice("t0", 0, 10), Slice("t1", 0, 6)), transport="carrier-pigeon"),), "transport"),
        ((Op((Slice("t0", 0, 10), Slice("t1", 0, 6)), phase=FORWARD, deferred=True),), "only backward ops"),
    ],
)
def test_broken_plans_are_rejected(ops, message):
    with pytest.raises(ConfigError, match=message):
        plan_of(*ops).validate(PROFILE)


def test_mixed_element_sizes_never_share_an_op():
    profile = ModelProfile("m", (LayerProfile("l", (TensorSpec("a", 4, 4), TensorSpec("h", 4, 2)), 0.0, 0.0),))
    with pytest.raises(ConfigError, match="mixes element sizes"):
        plan_of(Op((Slice("a", 0, 4), Slice("h", 0, 4)))).validate(profile)


def test_malformed_json():
    with pytest.raises(ConfigError):
        Plan.from_json('{"ops": [{"slices": [["t0", 0]]}]}')
    with pytest.raises(ConfigError, match="'deferred' must be true or false"):
        Plan.from_json('{"ops": [{"slices": [["t0", 0, 10]], "deferred": "yes"}]}')


def test_deferring_the_waits_marks_every_backward_op_and_only_those():
    made = plan_of(Op((Slice("t1", 0, 6),)), Op((Slice("t0", 0, 10),), phase=FORWARD)).validate(PROFILE)
    deferred = made.with_deferred_waits().validate(PROFILE)
    assert [op.deferred for op in deferred.ops] == [True, False]
    assert [op.gates_forward for op in made.ops] == [False, True]
    assert all(op.gates_forward for op in deferred.ops)
    assert deferred.options["overlap_forward"] is True and deferred.hash != made.hash
    again = Plan.from_json(deferred.to_json())
    assert again == deferred and again.hash == deferred.hash
    assert "deferred" not in made.to_json()  # plans without deferred ops keep their JSON and hash


def test_the_tensors_launching_early_are_those_of_every_backward_op_but_a_single_channels_last():
    ops = [Op((Slice("t1", 0, 6),)), Op((Slice("t0", 4, 6), Slice("t2", 0, 3))), Op((Slice("t0", 0, 4),)),
           Op((Slice("t3", 0, 2),), phase=FORWARD)]
    assert plan_of(*ops).tensors_launching_early() == {"t0", "t1", "t2"}  # t0 also in the middle op
    assert plan_of(*ops[1:]).tensors_launching_early() == {"t0", "t2"}
    assert plan_of(ops[0], ops[3]).tensors_launching_early() == set()
    two_channels = [ops[0], Op((Slice("t0", 0, 10),), channel=1), ops[3]]
    assert plan_of(*two_channels).tensors_launching_early() == {"t0", "t1"}


@pytest.mark.parametrize(
    "op, message",
    [
        ({"slices": [["t0", 0.9, 10.7]]}, r"ops\[0\].*'slices\[0\]\.offset' must be an integer, got 0\.9"),
        ({"slices": [["t0", 0, 10.7]]}, r"ops\[0\].*'slices\[0\]\.length' must be an integer, got 10\.7"),
        ({"slices": [["t0", 0, "10"]]}, r"ops\[0\].*'slices\[0\]\.length' must be an integer, got '10'"),
        ({"slices": [["t0", False, 10]]}, r"ops\[0\].*'slices\[0\]\.offset' must be an integer, got False"),
        ({"slices": [[0, 0, 10]]}, r"ops\[0\].*'slices\[0\]\.tensor' must be a string, got 0"),
        ({"slices": [["t0", 0, 10]], "channel": 0.5}, r"ops\[0\].*'channel' must be an integer, got 0\.5"),
        ({"slices": [["t0", 0, 10]], "channel": True}, r"ops\[0\].*'channel' must be an integer, got True"),
        ({"slices": [["t0", 0, 10]], "priority": "7"}, r"ops\[0\].*'priority' must be an integer, got '7'"),
        ({"slices": [["t0", 0, 10]], "codec": 5}, r"ops\[0\].*'codec' must be a string, got 5"),
    ],
)
def test_json_fields_are_never_converted(op, message):
    """A plan file's numbers are taken as they are: 10.7 elements is an error, not 10."""
    plan = {"ops": [op, {"slices": [["t1", 0, 6]]}]}
    with pytest.raises(ConfigError, match=message):
        Plan.from_dict(plan)


@pytest.mark.parametrize(
    "op, message",
    [
        (Op((Slice("t0", 0.0, 10), Slice("t1", 0, 6))), r"op 0: 'slices\[0\]\.offset' must be an integer"),
        (Op((Slice("t0", 0, 10), Slice("t1", 0, 6.0))), r"op 0: 'slices\[1\]\.length' must be an integer"),
        (Op((Slice("t0", 0, 10), Slice("t1", 0, 6)), channel=0.0), r"op 0: 'channel' must be an integer"),
        (Op((Slice("t0", 0, 10), Slice("t1", 0, 6)), priority="7"), r"op 0: 'priority' must be an integer"),
        (Op((Slice("t0", 0, 10), Slice("t1", 0, 6)), codec=5), r"op 0: 'codec' must be a string, got 5"),
    ],
)
def test_validate_refuses_fields_of_the_wrong_type(op, message):
    with pytest.raises(ConfigError, match=message):
        plan_of(op).validate(PROFILE)


def test_reduce_scatter_ops_round_trip_and_change_the_hash():
    plan = Plan((Op((Slice("w", 0, 4),)),))
    scattered = plan.with_collective("reduce_scatter")
    assert "collective" not in plan.to_json() and '"collective": "reduce_scatter"' in scattered.to_json()
    assert Plan.from_json(scattered.to_json()) == scattered and scattered.hash != plan.hash


@pytest.mark.parametrize("op, needle", [
    (Op((Slice("w", 0, 4),), collective="broadcast"), "'collective' must be one of"),
    (Op((Slice("w", 0, 4),), collective="reduce_scatter", transport="forest"), "transport 'allreduce' only"),
])
def test_bad_collectives_are_refused(op, needle):
    profile = ModelProfile("one", (LayerProfile("l", (TensorSpec("w", 4),), 0.0, 0.0),))
    with pytest.raises(ConfigError, match=needle):
        Plan((op,)).validate(profile)
