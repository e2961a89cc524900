"""The exact optimum of MG-WFBP's problem (mg-wfbp eq. 23): split the gradients, in backward order,
into contiguous groups, one all-reduce each on one channel, so that the last all-reduce ends earliest.

Model (the simulator's, on one channel): group g holds units i..j of `merge_units` (backward order)
and is ready when its input-most unit j is, at r_j; it starts at max(r_j, E_{g−1}), the previous
op's end, and lasts T_ar(bytes) = cost.allreduce_time (mg-wfbp eqs. 9, 20). The iteration time is
forward time + the last op's end, so minimising that end minimises the iteration.

1. Earliest end, dynamic programme over prefixes: F(0) = 0 and
       F(j) = min over i ≤ j of max(F(i−1), r_j) + T_ar(bytes of units i..j),
   over groups of one element size. Exact: the last group's end max(E, r_j) + T_ar is non-decreasing
   in the previous end E, so any partition's prefix may be swapped for the one ending at F(i−1)
   without delaying the last op.
2. Latest ends, the mirror programme over suffixes: D(U) = F(U) and D(i−1) = max over j ≥ i with
   r_j ≤ D(j) − T_ar(i..j) of D(j) − T_ar(i..j): a prefix ending by D can still finish by F(U).
3. Fewest ops among the optimal partitions: per prefix, the Pareto front of (ops, end) over its
   partitions that end by D. One earliest end per prefix is not enough: a later end costs nothing
   where the next group waits for r_j. Exact as in 1: (max(E, r_j) + T_ar, k + 1) never worsens when
   the prefix's (E, k) improves, so dominated prefixes may be dropped.
Each pass is O(U²) for U units (the third times the front, a handful of states in practice).

Granularity: a unit is one layer's consecutive tensors of one element size. Splitting a unit
never helps: both parts are ready at once, so moving the later part into the earlier op delays
that op by b·x but shortens the next by b·x without changing its ready time (or removes it), so
no end grows. The optimum therefore equals the optimum over every contiguous tensor partition in
backward order, which contains WFBP, MG-WFBP and, when all gradients share one element size, DDP's
buckets.
"""
from __future__ import annotations

import math
from typing import NamedTuple, Sequence

from ..cost import CostModel
from ..plan import Plan
from ..profile import ModelProfile
from .mg_wfbp import MergeUnit, merge_units, plan_from_groups
from . import PlannerSpec
from .options import deferred_if

TIE_TOLERANCE = 1e-12  # relative: end times this close count as equal, and fewer ops win


def plan(profile: ModelProfile, cost: CostModel, *, overlap_forward: bool) -> Plan:
    """The fewest ops among the partitions with the earliest last all-reduce, in backward order.

    Args:
        profile: the model's per-layer times and tensors (ModelProfile).
        cost: the all-reduce cost model; T_ar of every candidate group (only ``a`` and ``b`` count).
        overlap_forward: defer the step's waits to each layer's next forward (us-byte Fig. 1).
    """
    return deferred_if(plan_from_groups(optimal_groups(merge_units(profile), cost)), overlap_forward)


class State(NamedTuple):
    """A partition of a prefix: its last op's end, its op count, and how it was reached."""

    end: float
    ops: int
    first: int  # first unit of the last group
    parent: int  # index of the partition of units[:first] in that prefix's front


class Groups:
    """Units in backward order and the all-reduce time of any contiguous group of them."""

    def __init__(self, units: Sequence[MergeUnit], cost: CostModel) -> None:
        self.units = units
        self.cost = cost
        self.offsets = [0]
        for unit in units:
            self.offsets.append(self.offsets[-1] + unit.nbytes)
        self.run_starts = []  # first unit of each unit's run of one element size
        for index, unit in enumerate(units):
            same = index > 0 and units[index - 1].bytes_per_element == unit.bytes_per_element
            self.run_starts.append(self.run_starts[-1] if same else index)

    def __len__(self) -> int:
        return len(self.units)

    def ready(self, stop: int) -> float:
        """Ready time of a group ending before `stop`: that of its input-most unit."""
        return self.units[stop - 1].ready

    def firsts(self, stop: int) -> range:
        """First units of the allowed groups units[first:stop] (one element size), shortest first."""
        return range(stop - 1, self.run_starts[stop - 1] - 1, -1)

    def duration(self, first: int, stop: int) -> float:
        return self.cost.allreduce_time(self.offsets[stop] - self.offsets[first])


def optimal_groups(units: Sequence[MergeUnit], cost: CostModel) -> list[list[MergeUnit]]:
    """Units (backward order) cut into the groups of an optimal partition with the fewest ops."""
    groups = Groups(units, cost)
    latest = latest_ends(groups, earliest_ends(groups)[-1])
    fronts = fewest_ops_fronts(groups, latest)
    cut: list[list[MergeUnit]] = []
    stop, index = len(units), 0  # fronts are ordered by op count
    while stop > 0:
        state = fronts[stop][index]
        cut.append(list(units[state.first : stop]))
        stop, index = state.first, state.parent
    return cut[::-1]


def earliest_ends(groups: Groups) -> list[float]:
    """F(j), the earliest end of the last op over partitions of units[:j] (pass 1)."""
    end = [0.0] * (len(groups) + 1)
    for stop in range(1, len(groups) + 1):
        ready = groups.ready(stop)
        end[stop] = min(max(end[first], ready) + groups.duration(first, stop) for first in groups.firsts(stop))
    return end


def latest_ends(groups: Groups, deadline: float) -> list[float]:
    """D(i), the latest end of units[:i] from which the rest can still end by `deadline` (pass 2)."""
    latest = [-math.inf] * (len(groups) + 1)
    latest[-1] = deadline
    for stop in range(len(groups), 0, -1):
        ready = groups.ready(stop)
        for first in groups.firsts(stop):
            start_by = latest[stop] - groups.duration(first, stop)
            if not_later(ready, start_by):
                latest[first] = max(latest[first], start_by)
    return latest


def fewest_ops_fronts(groups: Groups, latest: Sequence[float]) -> list[list[State]]:
    """Per prefix, the states ending by D, fewest ops first, each ending strictly earlier than
    every state with fewer ops (pass 3)."""
    fronts: list[list[State]] = [[State(0.0, 0, 0, 0)]]
    for stop in range(1, len(groups) + 1):
        ready = groups.ready(stop)
        candidates = []
        for first in groups.firsts(stop):
            duration = groups.duration(first, stop)
            for parent, state in enumerate(fronts[first]):
                end = max(state.end, ready) + duration
                if not_later(end, latest[stop]):
                    candidates.append(State(end, state.ops + 1, first, parent))
                if state.end <= ready:  # states with more ops would give this same end
                    break
        fronts.append(pareto_front(candidates))
    return fronts


def pareto_front(states: list[State]) -> list[State]:
    """States by op count, keeping one only if it ends clearly earlier than all with fewer ops."""
    front: list[State] = []
    for state in sorted(states, key=lambda s: (s.ops, s.end)):
        if not front or not not_later(front[-1].end, state.end):
            front.append(state)
    return front


def not_later(time: float, limit: float) -> bool:
    """time ≤ limit, up to TIE_TOLERANCE: sums taken in another order may differ in the last bits."""
    return time <= limit + TIE_TOLERANCE * abs(limit)


SPEC = PlannerSpec("optimal_merge", plan, "the exact optimum of MG-WFBP's merging problem (dynamic programming)",
                   source="mg-wfbp §IV")
