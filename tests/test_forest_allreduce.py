"""ForestAllReduce: the schedule (every rank, one process) and the real thing on 3–5 gloo ranks,
both checked against the plain sum (torch.distributed.all_reduce on the same tensors)."""
import re

import pytest
import torch
import torch.distributed as dist

from gradsync.errors import ConfigError
from gradsync.launch import run_local
from gradsync.topology import Topology, plan_forest, preset
from gradsync.topology.allreduce import REDUCE, ForestAllReduce, build_schedule

SWITCHED = {"workers": 4, "relays": ["s"], "links": [
    {"between": ["0", "s"], "bandwidth": 10}, {"between": ["1", "s"], "bandwidth": 10},
    {"between": ["2", "s"], "bandwidth": 10}, {"between": ["3", "s"], "bandwidth": 10},
    {"between": ["0", "1"], "bandwidth": 5}]}


def run_schedule(packing, topology, tensors, sub_chunk_bytes):
    """Every rank's steps, each rank on its own cursor, round-robin; a step runs only once all its
    messages have arrived. Returns the tensors after the all-reduce; fails on deadlock, a tag used
    twice, or a message nobody receives."""
    ranks = range(len(topology.workers))
    schedule = build_schedule(packing, topology.workers, tensors[0].numel(), 4, sub_chunk_bytes)
    steps = {r: [s for s in schedule if s.rank == r] for r in ranks}
    flats, mailbox, tags, cursor = [t.clone() for t in tensors], {}, set(), dict.fromkeys(ranks, 0)
    moved = True
    while moved:
        moved = False
        for r in ranks:
            while cursor[r] < len(steps[r]) and all((p, r, t) in mailbox for p, t in steps[r][cursor[r]].receive):
                step = steps[r][cursor[r]]
                region = flats[r][step.start:step.stop]
                if step.kind == REDUCE:
                    payload = region if step.holds else None
                    for peer, tag in step.receive:
                        part = mailbox.pop((peer, r, tag))
                        payload = part.clone() if payload is None else payload.add_(part)
                elif step.receive:
                    payload = mailbox.pop((step.receive[0][0], r, step.receive[0][1]))
                    if step.holds:
                        region.copy_(payload)
                else:
                    payload = region
                for peer, tag in step.send:
                    assert tag not in tags
                    tags.add(tag)
                    mailbox[(r, peer, tag)] = payload.clone()
                cursor[r] += 1
                moved = True
    assert all(cursor[r] == len(steps[r]) for r in ranks), "the schedule deadlocks"
    assert not mailbox, "a message is never received"
    return flats


def expected(tensors, topology, packing):
    active = [topology.workers.index(name) for name in packing.active]
    total = sum(tensors[i].double() for i in active).float()
    return [total if r in active else tensors[r] for r in range(len(tensors))]


@pytest.mark.parametrize("topology,active", [
    (preset("complete-4"), None), (preset("ring-5"), None), (preset("oneway-ring-5"), None),
    (preset("2x2-pcie", inter_gbps=10), None), (preset("2x2-pcie", inter_gbps=10), ["m0g0", "m1g1"]),
    (preset("ring-5"), ["0", "2", "3"]), (Topology.from_dict(SWITCHED), None),
    (Topology.from_dict(SWITCHED), ["0", "2", "3"]),
])
def test_schedule_sums_over_active_ranks_and_leaves_relays_alone(topology, active):
    packing = plan_forest(topology, active)
    for numel, sub_chunk_bytes in ((1, 4), (7, 4), (1000, 64), (12347, 4096)):
        generator = torch.Generator().manual_seed(numel)
        tensors = [torch.randn(numel, generator=generator) for _ in topology.workers]
        for got, want in zip(run_schedule(packing, topology, tensors, sub_chunk_bytes),
                             expected(tensors, topology, packing)):
            torch.testing.assert_close(got, want, atol=1e-5, rtol=1e-5)


def test_sub_chunks_pipeline_and_broadcast_waits_only_for_its_own_range():
    topology = preset("ring-5")
    packing = plan_forest(topology)
    schedule = build_schedule(packing, topology.workers, 100_000, 4, sub_chunk_bytes=4000)
    reduce_ranges = {(s.start, s.stop) for s in schedule if s.kind == REDUCE}
    assert len(reduce_ranges) >= 100  # 400 kB in sub-chunks of about 4 kB
    first_broadcast = min(s.key for s in schedule if s.kind != REDUCE)
    last_reduce = max(s.key for s in schedule if s.kind == REDUCE)
    assert first_broadcast < last_reduce  # broadcasts start while later sub-chunks are still reduced


def _forest_matches_all_reduce(rank, world_size, topology_dict, active, sizes, sub_chunk_bytes):
    topology = Topology.from_dict(topology_dict)
    forest = ForestAllReduce(topology, active, sub_chunk_bytes=sub_chunk_bytes)
    worst = 0.0
    for numel in sizes:
        generator = torch.Generator().manual_seed(1000 * numel + rank)
        mine = torch.randn(numel, generator=generator)
        mask = torch.zeros(1) + (rank in forest.active_ranks)
        reference = mine * mask
        dist.all_reduce(reference)
        want = reference if rank in forest.active_ranks else mine
        got = mine.clone()
        forest.all_reduce(got)
        worst = max(worst, (got - want).abs().max().item() if numel else 0.0)
    return worst


@pytest.mark.parametrize("world_size,topology,active", [
    (3, preset("complete-3"), None),
    (4, preset("2x2-pcie", inter_gbps=10), None),
    (5, preset("ring-5"), [0, 2, 3]),
    (4, Topology.from_dict(SWITCHED), [0, 2, 3]),
])
def test_forest_all_reduce_equals_torch_all_reduce(world_size, topology, active):
    sizes = [0, 1, 5, 997, 65_537, 300_001]
    worst = run_local(_forest_matches_all_reduce, world_size, topology.to_dict(), active, sizes, 16_384)
    assert max(worst) < 1e-4


def _async_calls_keep_their_order(rank, world_size):
    forest = ForestAllReduce(preset("complete-3"))
    tensors = [torch.full((10_000 + i,), float(rank + i)) for i in range(4)]
    works = [forest.all_reduce(t, async_op=True) for t in tensors]
    for work in works:
        work.wait()
    forest.close()
    return [t.unique().tolist() for t in tensors]


def test_async_all_reduces_complete_in_order():
    for values in run_local(_async_calls_keep_their_order, 3):
        assert values == [[float(sum(r + i for r in range(3)))] for i in range(4)]


BAD_INPUT = [
    (preset("complete-4").to_dict(), None, "process group has 3 ranks but topology"),
    (preset("complete-3").to_dict(), [0, 3], "active rank 3 is outside the topology"),
    ({"workers": 3, "links": [{"from": "0", "to": "1", "bandwidth": 1}, {"from": "1", "to": "0", "bandwidth": 1}]},
     None, "cannot reach each other: 0->2"),
    ({**preset("ring-3").to_dict(), "name": "per-rank"}, None, r"ranks \[1\] have a different topology"),
]


def _errors_of_bad_input(rank, world_size):
    messages = []
    for topology_dict, active, _ in BAD_INPUT:
        topology = Topology.from_dict(topology_dict)
        if topology_dict.get("name") == "per-rank" and rank == 1:
            topology = preset("ring-3", gbps=2.0)
        try:
            ForestAllReduce(topology, active)
            messages.append("built")
        except ConfigError as exc:
            messages.append(str(exc))
    return messages


def test_bad_input_fails_on_every_rank_with_a_clear_error():
    for messages in run_local(_errors_of_bad_input, 3):
        for (_, _, pattern), message in zip(BAD_INPUT, messages):
            assert re.search(pattern, message), (pattern, message)


def test_non_positive_bandwidth_is_refused():
    with pytest.raises(ConfigError, match="bandwidth"):
        Topology.from_dict({"workers": 2, "links": [{"between": ["0", "1"], "bandwidth": 0}]})


def _acp_sgd_over_both_transports(rank, world_size):
    """Six ACP-SGD steps with measured profile and cost, over the backend's all-reduce and over the
    forest of the complete graph; the final parameters of both runs."""
    import gradsync
    from gradsync.runtime import attached
    from runtime_models import TiedNet, batch

    finals = {}
    for transport in ("allreduce", "forest"):
        torch.manual_seed(3)
        model = TiedNet()
        model, optimizer = gradsync.wrap(model, torch.optim.SGD(model.parameters(), lr=0.1), "optimal_merge",
                                         {"type": "acp_sgd", "rank": 2, "min_compression_rate": 1.0, "seed": 5},
                                         transport=transport)
        for step in range(6):
            optimizer.zero_grad()
            tokens, targets = batch(rank, step)
            torch.nn.functional.cross_entropy(model(tokens), targets).backward()
            optimizer.step()
        optimizer.synchronize()
        sync = attached(model)
        assert {op.transport for plan in sync.installed.plans.values() for op in plan.ops} == {transport}
        # at most one per gloo worker thread, as measured; the forest's one thread
        assert sync.installed.cost.ops_per_channel in ((1, 2) if transport == "allreduce" else (1,))
        finals[transport] = [p.detach().clone() for p in model.parameters()]
        sync.detach()
    return max((a - b).abs().max().item() for a, b in zip(finals["allreduce"], finals["forest"]))


def test_wrap_with_forest_transport_trains_like_the_backend_all_reduce():
    assert max(run_local(_acp_sgd_over_both_transports, 3)) < 1e-5


@pytest.mark.parametrize("arguments,message", [
    ({"transport": "tree"}, "unknown transport 'tree'; valid: allreduce, forest"),
    ({"topology": "ring-4"}, "'topology' is used by transport 'forest' only"),
    ({"transport": "forest", "compressor": "signsgd"}, "compressor 'signsgd' all-gathers"),
    ({"transport": "forest", "topology": "missing.yaml"}, "no such file 'missing.yaml'"),
    ({"transport": "forest", "topology": "torus-9"}, "unknown preset 'torus-9'"),
])
def test_wrap_refuses_bad_transport_arguments_before_any_collective(arguments, message):
    from gradsync.runtime import check_wrap_arguments

    with pytest.raises(ConfigError, match=re.escape(message)):
        check_wrap_arguments(**arguments)


def _wrap_on_a_topology_of_another_size(rank, world_size):
    import gradsync

    model = torch.nn.Linear(4, 2)
    try:
        gradsync.wrap(model, torch.optim.SGD(model.parameters(), lr=0.1), "wfbp", transport="forest",
                      topology="ring-3")
    except ConfigError as exc:
        return str(exc)
    return "wrapped"


def test_wrap_refuses_a_topology_that_does_not_match_the_ranks():
    for message in run_local(_wrap_on_a_topology_of_another_size, 2, timeout=120):
        assert "process group has 2 ranks but topology 'ring-3' has 3 workers" in message
