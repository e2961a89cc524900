"""US-Byte: unequal-sized tensor blocks scheduled in a near-optimal order (us-byte §3–4).

Each layer's gradient (each gradient group, see partition.py) is cut into basic blocks of S_p
bytes; an op merges several neighbouring blocks of one layer, the two-tuple <O_num, O_lay>.
- Phase one, overlapping backward: Algorithm 1 turns the priorities P1 into ops (eqs. 3–8), until
  layer 1's backward ends, the backward of layers without parameters included (eqs. 2, 9).
- Phase two, overlapping the next forward: the blocks left of each layer form one op, layers in
  order 1..L (Theorem 1: P2^(l) = l), launched after backward (eqs. 9–10).
- The objective is the iteration time of eqs. 9–12 in closed form. For these one-channel plans it
  equals gradsync.simulate of the plan under the papers' model (a cost with host = 0; asserted in
  the tests), and costs O(ops) instead of a full event simulation, which keeps the O(L)
  evaluations of the greedy cheap.
- Algorithm 2 searches P1 greedily from sequential priorities. Its result is compared with one
  more point of the same search space, WFBP's order with whole-layer ops, so that the plan is never
  slower than WFBP (Algorithm 1 alone can be: see `wfbp_equivalent`).
All ops run on one channel, in the order Algorithm 3 of us-byte launches them.
"""
from __future__ import annotations

import heapq
import math
from bisect import bisect_left
from dataclasses import dataclass, field

from ..cost import CostModel
from ..plan import BACKWARD, FORWARD, Op, Plan
from ..profile import ModelProfile
from . import OVERLAP_FORWARD, PlannerSpec
from .options import PARTITION_BYTES, deferred_if
from .partition import GradientGroup, gradient_groups


@dataclass
class PhaseOneOp:
    """<O_num, O_lay> of a phase-one all-reduce: `blocks` blocks of `group` from `first_block`,
    starting at τ_ar (eq. 3). Mutable because Algorithm 1 lines 13–14 merge into the last op."""

    group: int
    first_block: int
    blocks: int
    start: float


@dataclass
class Schedule:
    """Algorithm 1's output: phase-one ops, blocks left per group (m_re), and `end`, the earliest
    start of the next op (τ_ar^(δ1) + T_ar(O_num^(δ1)) of eq. 9 when phase one ends busy)."""

    ops: list[PhaseOneOp]
    remaining: list[int]
    end: float
    first_start: dict[int, float] = field(default_factory=dict)  # group -> τ_ar of its first op


@dataclass
class Candidate:
    """A point of US-Byte's search space: block sizes (groups), P1, Algorithm 1's schedule, t_iter."""

    groups: list[GradientGroup]
    priorities: list[int]
    schedule: Schedule
    time: float


def plan(profile: ModelProfile, cost: CostModel, *, partition_bytes: int, overlap_forward: bool) -> Plan:
    """US-Byte's plan: Algorithm 2's P1 and Algorithm 1's phase-one ops, then phase two by Theorem 1;
    the WFBP-equivalent point of the same search space where that is faster (see `wfbp_equivalent`).

    Args:
        profile: the model's per-layer times and tensors (ModelProfile).
        cost: the all-reduce cost model; the closed-form t_iter uses its ``a`` and ``b`` only.
        partition_bytes: S_p, the size of a basic block (bytes; rounded down to whole elements, at least one).
        overlap_forward: defer the step's waits to each layer's next forward (us-byte Fig. 1).
    """
    greedy = greedy_priorities(gradient_groups(profile, partition_bytes), profile, cost)
    best = min(greedy, wfbp_equivalent(profile, cost), key=lambda candidate: candidate.time)
    ordered = Plan(tuple(candidate_ops(best)), options={"partition_bytes": partition_bytes})
    return deferred_if(ordered, overlap_forward)


def candidate_ops(candidate: Candidate) -> list[Op]:
    """Phase-one ops in Algorithm 1's order, then one op per layer with blocks left, layers 1..L (eq. 10)."""
    groups, schedule = candidate.groups, candidate.schedule
    backward_ops = [
        Op(groups[op.group].slices(op.first_block, op.blocks), BACKWARD, priority=candidate.priorities[op.group])
        for op in schedule.ops
    ]
    forward_ops = [
        Op(group.slices(group.num_blocks - left, left), FORWARD, priority=index)
        for index, (group, left) in enumerate(zip(groups, schedule.remaining))
        if left
    ]
    return backward_ops + forward_ops


def wfbp_equivalent(profile: ModelProfile, cost: CostModel) -> Candidate:
    """Every layer in one op (O_num = m^(l)), output layer first (P1 reversed).

    Algorithm 1's cases can split a layer into an op more, whose start-up ``a`` may cost more than
    the overlap gains, so the greedy alone can end slower than WFBP. At this point of the search
    space phase one, which runs until the whole backward pass ends (eq. 9's τ_b^(1) + t_b^(1), also
    when the input-side layers have no parameters), sends what WFBP starts during backward, in the
    same order and no later (eq. 3), and phase two sends the rest in Theorem 1's order from where
    WFBP would send it (eqs. 9–11), so its t_iter is at most WFBP's.
    """
    groups = gradient_groups(profile, profile.total_bytes)
    priorities = list(range(len(groups) - 1, -1, -1))
    schedule = phase_one(groups, priorities, cost, profile)
    return Candidate(groups, priorities, schedule, iteration_time(schedule, groups, profile, cost))


# -- the model: eqs. 1 and 3–12 ---------------------------------------------------------------
def shortfall(group: GradientGroup, cost: CostModel) -> float:
    """Δt = (m^(l) − M^(l)/S_p)·b·S_p (eq. 8): the time the short last block does not take."""
    return (group.num_blocks * group.block_bytes - group.nbytes) * cost.b


def op_seconds(group: GradientGroup, blocks: int, takes_last_block: bool, cost: CostModel) -> float:
    """T_ar(O_num) − Δt (eq. 1, Algorithm 1 lines 23–24): a + b·(the op's bytes).

    Args:
        group: the gradient group the op's blocks belong to.
        blocks: O_num, the op's number of blocks.
        takes_last_block: the op holds the group's last block, which may be short by Δt's bytes.
        cost: the all-reduce cost model.
    """
    return cost.allreduce_time(blocks * group.block_bytes) - (shortfall(group, cost) if takes_last_block else 0.0)


def blocks_to_send(gap: float, carried: int, available: int, group: GradientGroup, cost: CostModel) -> int:
    """O_num of an op that starts `gap` before the current layer's backward ends (eqs. 4–7).

    `carried` blocks are already in the op (Algorithm 1 lines 13–14 merge a second op of the same
    layer into the first, which keeps its start, so eqs. 4–7 size the whole op); `available` more
    may join. The op takes at least one new block: eq. 6 gives 0 when the gap is exactly `a`.

    Args:
        gap: seconds from the op's start to the end of the current layer's backward.
        carried: blocks already in the op.
        available: the group's blocks not yet sent (>= 1).
        group: the gradient group being sent.
        cost: the all-reduce cost model.

    Returns:
        the op's new O_num, carried blocks included.
    """
    total = carried + available
    if gap < cost.a:  # Case 1, eq. 4
        wanted = 1
    elif gap < cost.allreduce_time(total * group.block_bytes):  # Case 2, eqs. 5–6
        wanted = math.ceil((gap - cost.a) / (cost.b * group.block_bytes))
    else:  # Case 3, eq. 7
        wanted = total
    return min(total, max(carried + 1, wanted))


def phase_one(groups: list[GradientGroup], priorities: list[int], cost: CostModel,
              profile: ModelProfile) -> Schedule:
    """Algorithm 1: the phase-one ops for priorities P1 (lower is more urgent).

    Every layer of `profile` is visited output → input (line 7), parameter-less ones included: while
    its backward runs, until τ_b^(l) + t_b^(l) (eq. 2), ops send the most urgent blocks already
    computed (lines 8–9, a heap in place of CALCULATE_O_lay's scan); the channel idles when none are
    left (lines 10–12); the layer's groups join at its end (line 27; a layer without parameters adds
    none). Phase one thus lasts until layer 1's backward ends (the split of eq. 9), also when layer 1
    has no gradients: the backward of parameter-less layers on the input side still hides ops.

    Args:
        groups: the gradient groups, input → output (``gradient_groups``).
        priorities: P1 of each group, by group index; a permutation of 0..len(groups)−1.
        cost: the all-reduce cost model.
        profile: the profile the groups come from, for every layer's backward end.
    """
    ends = profile.backward_ready_times()  # τ_b^(l) + t_b^(l), eq. 2
    joining: dict[int, list[int]] = {}  # layer -> its groups
    for index, group in enumerate(groups):
        joining.setdefault(group.layer, []).append(index)
    remaining = [0] * len(groups)
    urgent: list[tuple[int, int]] = []  # heap of (P1, group) over groups with blocks left
    ops: list[PhaseOneOp] = []
    first_start: dict[int, float] = {}
    next_start = ends[-1]  # line 6
    for layer in range(len(ends) - 1, -1, -1):  # line 7
        ready = ends[layer]
        while ready - next_start > 0:  # line 8
            if not urgent:  # lines 10–12
                next_start = ready
                break
            chosen = urgent[0][1]  # line 9
            group = groups[chosen]
            if not (ops and ops[-1].group == chosen):  # lines 13–14: otherwise merge into the last op
                ops.append(PhaseOneOp(chosen, group.num_blocks - remaining[chosen], 0, next_start))
                first_start.setdefault(chosen, next_start)
            op = ops[-1]
            total = blocks_to_send(ready - op.start, op.blocks, remaining[chosen], group, cost)  # lines 15–21
            remaining[chosen] -= total - op.blocks  # line 22
            op.blocks = total
            if not remaining[chosen]:
                heapq.heappop(urgent)
            next_start = op.start + op_seconds(group, total, not remaining[chosen], cost)  # lines 23–24
        for index in joining.get(layer, ()):  # line 27
            remaining[index] = groups[index].num_blocks
            heapq.heappush(urgent, (priorities[index], index))
    return Schedule(ops, remaining, next_start, first_start)


def iteration_time(schedule: Schedule, groups: list[GradientGroup], profile: ModelProfile, cost: CostModel) -> float:
    """t_iter of eq. 12, with phase two in sequential order (Theorem 1).

    Phase two starts when backward and phase one are done (eq. 9) and sends each group's remaining
    blocks in one op (eq. 10); layer l's forward waits for layer l−1's and for its own ops (eq. 11).
    A layer without a phase-two op waits for no op, which for sequential order is eq. 11's bound.

    Args:
        schedule: phase one's result for `groups` (``phase_one``).
        groups: the gradient groups, input → output.
        profile: the profile they come from: backward and forward times (seconds).
        cost: the all-reduce cost model.
    """
    backward_done = max(profile.backward_time, schedule.end)
    clock = backward_done
    gates = [0.0] * len(profile.layers)
    for group, left in zip(groups, schedule.remaining):
        if left:
            clock += op_seconds(group, left, True, cost)
            gates[group.layer] = clock
    forward = backward_done
    for layer, gate in zip(profile.layers, gates):
        forward = max(forward, gate) + layer.forward_time
    return forward


# -- Algorithm 2 ------------------------------------------------------------------------------
def greedy_priorities(groups: list[GradientGroup], profile: ModelProfile, cost: CostModel) -> Candidate:
    """Algorithm 2: from sequential P1, for l = L..2 raise layer l's priority to the layer k of
    eq. 13 and keep the change when t_iter (eqs. 9–12) drops.

    Here a "layer" is a gradient group (one per layer in the usual case).

    Args:
        groups: the gradient groups, input → output (``gradient_groups``).
        profile: the profile they come from.
        cost: the all-reduce cost model.
    """
    priorities = list(range(len(groups)))  # lines 1–2
    schedule = phase_one(groups, priorities, cost, profile)
    best = iteration_time(schedule, groups, profile, cost)  # line 3
    ascending_ready = [group.ready for group in reversed(groups)]
    layer = len(groups) - 1
    while layer >= 1:  # line 5; the first layer cannot be raised above itself
        if layer in schedule.first_start:  # lines 6–14: skip layers sent only in phase two
            finish = schedule.first_start[layer] + op_seconds(groups[layer], groups[layer].num_blocks, True, cost)
            target = len(groups) - bisect_left(ascending_ready, finish)  # lines 16–21, eq. 13
            if target < layer:
                trial = raise_priority(priorities, layer, target)
                trial_schedule = phase_one(groups, trial, cost, profile)
                trial_time = iteration_time(trial_schedule, groups, profile, cost)  # line 22
                if trial_time < best:  # lines 23–24
                    best, priorities, schedule, layer = trial_time, trial, trial_schedule, target
        layer -= 1  # line 25
    return Candidate(groups, priorities, schedule, best)


def raise_priority(priorities: list[int], layer: int, target: int) -> list[int]:
    """ADJUSTPRIORITY (Algorithm 2 lines 27–31): layer takes target's priority, target..layer−1 move down one.

    Args:
        priorities: P1 of each group (lower is more urgent); not modified, a new list is returned.
        layer: the index of the group whose priority is raised.
        target: the index of the group whose priority it takes (target < layer).
    """
    raised = list(priorities)
    raised[layer] = priorities[target]
    for index in range(target, layer):
        raised[index] = priorities[index] + 1
    return raised


SPEC = PlannerSpec("us_byte", plan, "US-Byte: unequal-sized blocks overlapping backward and the next forward",
                   options=(PARTITION_BYTES, OVERLAP_FORWARD), source="us-byte Algorithms 1–2, Theorem 1")
