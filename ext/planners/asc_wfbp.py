"""ASC-WFBP: each layer's all-reduce is normal, merged into the next one, or run simultaneously
beside the one in flight (asc-wfbp §V, Theorem 1, Algorithms 1 and 2).

Paper layers are numbered 1..L from input to output and backward runs L → 1; here they are the
profile's layers 0..L−1 that own gradients, so the paper's "l+1" is the layer backward computes
before l and "l−1" the one it computes after. Times start with the backward pass (τ_b(L) = 0,
Algorithm 1 lines 2–5); ready(l) = τ_b(l) + t_b(l).

Algorithm 1 (DetermineLayerType) sweeps l = L → 2 with l provisionally normal, evaluates
  Q1 (eq. 21)  τ_c(l) + t_c(l) ≤ ready(l−1),
  Q2 (eq. 24)  ready(l−1) < τ_c(l) + a,
  Q3 (eq. 27)  ready(l) + t_c(l) + penalty(l+1, l) < ready(l−1),
and sets e(l) by eq. 40: normal if Q1, merged if ¬Q1 ∧ Q2 ∧ ¬Q3, simultaneous (SC) otherwise;
layer 1 is SC (line 18). The printed pseudo-code is partly garbled; it is read as follows:
- line 8 prints τ_b[l] + t_b[l−1]; it is eq. 21's τ_b(l−1) + t_b(l−1) = ready(l−1);
- Q3 (line 12 and eq. 27) prints τ_c(l) + t_b(l); the SC finish it bounds is the first argument
  of eq. 17 (and eq. 29), ready(l) + t_c(l) + penalty, because an SC layer starts when its
  gradients are ready (Definition 3); eq. 13's τ_c^(2) is that same start;
- CALCCOMMTIME (lines 20–36, whose body is lost) sweeps l = L → 1 and carries the bytes of merged
  layers: a merged layer gets t_c = 0 and its bytes travel with the next op (mg-wfbp eqs. 14–16);
  a normal layer starts at max{ready(l), end of the previous op} (Definition 1, eq. 15) and lasts
  t_AR(merged bytes + m(l)) (eqs. 3, 16); an SC layer starts at ready(l) and lasts that plus the
  penalty of eq. 13 against the op in flight (the last op of the busy channel), whose overlapped
  bytes (eq. 12) are clamped to [0, its size] since it may have started after ready(l) or been
  stretched past a + b·m by its own penalty.
Recomputing CALCCOMMTIME after each decision (line 17) only changes layers not yet decided, so
one sweep that decides each layer and then schedules it gives the same τ_c and t_c in O(L).

SC needs an op in flight (Definition 3). Where eq. 40 says SC and nothing is in flight, SC and
normal are the same schedule and the layer is recorded as normal (so e(L) ∈ {n, m}, §IV). Where
every channel is busy, SC is impossible and MG-WFBP's rule decides (eq. 25): merged if Q2, else
normal.

Channels (option `channels`, k ≥ 1, default 2 as in the paper): an SC layer may start when fewer
than k ops are in flight, on the lowest-numbered free channel; a normal layer queues behind the
previous op on its channel; merged layers travel in the op of the next unmerged layer (Algorithm 2,
lines 19–24). For k > 2 the penalty of joining n ops in flight is the sum of eq. 13 over them,
which is (s(n+1) − 1)·b·m, s(k) = 1 + (γ − 1)(k − 1), when they overlap equally; for n = 1 it is
eq. 13. k = 1 allows no SC layer and gives MG-WFBP's merges.

The Q-conditions rest on eq. 10 (two simultaneous all-reduces beat two sequential ones), which
fails for large γ, and on a penalty that slows only the later op. So the planner runs Algorithm 1
for every k' = 1..k and returns the plan with the smallest simulated iteration time (the fewest
channels on a tie): more channels are never worse, and the k' = 1 plan (normal and merged
layers on one channel) is never worse than WFBP: a layer's tensors, ready together, share one op,
and each merge ends the merged op earlier (mg-wfbp Theorem 1).
"""
from __future__ import annotations

from dataclasses import dataclass

from ..cost import CostModel
from ..plan import Op, Plan, whole
from ..profile import ModelProfile
from ..simulate import simulate
from ..registry import Option, positive_int
from . import OVERLAP_FORWARD, PlannerSpec
from .options import deferred_if

NORMAL = "normal"
MERGED = "merged"
SIMULTANEOUS = "simultaneous"


@dataclass(frozen=True)
class ScheduledOp:
    """One all-reduce as CALCCOMMTIME times it: its layers (backward order), channel, τ_c and
    end τ_c + t_c."""

    layers: tuple[int, ...]
    channel: int
    start: float
    end: float
    nbytes: int


@dataclass(frozen=True)
class Schedule:
    """Algorithm 1's result: e(l) for every layer with gradients, and the ops it implies."""

    kinds: dict[int, str]
    ops: tuple[ScheduledOp, ...]


class _CommClock:
    """CALCCOMMTIME's state while sweeping from the output layer to the input layer."""

    def __init__(self, cost: CostModel, channels: int) -> None:
        self.cost = cost
        self.last_on: list[ScheduledOp | None] = [None] * channels
        self.previous_channel = 0
        self.pending: list[int] = []  # merged layers waiting for the next op
        self.pending_bytes = 0
        self.ops: list[ScheduledOp] = []

    def in_flight(self, time: float) -> list[ScheduledOp]:
        """The last op of every channel still busy at `time`."""
        return [op for op in self.last_on if op is not None and op.end > time]

    def free_channel(self, time: float) -> int | None:
        """The lowest-numbered channel idle at `time`, if an op is in flight and one is idle."""
        busy = self.in_flight(time)
        if not busy or len(busy) == len(self.last_on):
            return None
        return next(c for c, op in enumerate(self.last_on) if op is None or op.end <= time)

    def normal_timing(self, ready: float, nbytes: int) -> tuple[float, float]:
        """τ_c and t_c of the layer as a normal layer (Definition 1, eqs. 3 and 15–16)."""
        last = self.last_on[self.previous_channel]
        start = max(ready, last.end if last else 0.0)
        return start, self.cost.allreduce_time(self.pending_bytes + nbytes)

    def penalty(self, time: float) -> float:
        """Eq. 13 summed over the ops in flight when an SC op starts at `time` (eq. 12 clamped)."""
        total = 0.0
        for op in self.in_flight(time):
            elapsed = (time - op.start) / self.cost.allreduce_time(op.nbytes)
            total += self.cost.penalty(op.nbytes * min(1.0, max(0.0, 1.0 - elapsed)))
        return total

    def schedule(self, layer: int, kind: str, ready: float, nbytes: int) -> None:
        """Time layer `layer` as `kind` and launch its op unless it is merged."""
        if kind == MERGED:
            self.pending.append(layer)
            self.pending_bytes += nbytes
            return
        if kind == SIMULTANEOUS:
            channel, start = self.free_channel(ready), ready
            duration = self.cost.allreduce_time(self.pending_bytes + nbytes) + self.penalty(ready)
        else:
            channel = self.previous_channel
            start, duration = self.normal_timing(ready, nbytes)
        layers = (*self.pending, layer)
        op = ScheduledOp(layers, channel, start, start + duration, self.pending_bytes + nbytes)
        self.ops.append(op)
        self.last_on[channel] = op
        self.previous_channel = channel
        self.pending, self.pending_bytes = [], 0


def _layer_type(clock: _CommClock, ready: float, nbytes: int, next_ready: float | None) -> str:
    """e(l) by Theorem 1 (eq. 40); `next_ready` is ready(l−1), None for the input layer."""
    can_join = clock.free_channel(ready) is not None
    if next_ready is None:  # Algorithm 1, line 18
        return SIMULTANEOUS if can_join else NORMAL
    start, duration = clock.normal_timing(ready, nbytes)
    if start + duration <= next_ready:  # Q1, eq. 21
        return NORMAL
    q2 = next_ready < start + clock.cost.a  # eq. 24
    if not can_join:  # eq. 25
        return MERGED if q2 else NORMAL
    q3 = ready + duration + clock.penalty(ready) < next_ready  # eq. 27
    return MERGED if q2 and not q3 else SIMULTANEOUS


def determine_layer_types(profile: ModelProfile, cost: CostModel, channels: int = 2) -> Schedule:
    """Algorithm 1 with CALCCOMMTIME on `channels` channels (see the module docstring).

    Args:
        profile: the model's per-layer times and tensors; layers without gradients are skipped.
        cost: the all-reduce cost model: a + b·m (eq. 3) and the penalty of γ (eq. 13).
        channels: k, how many ops may be in flight at once (>= 1; 1 allows no SC layer).
    """
    ready_times = profile.backward_ready_times()
    layers = [i for i in range(len(profile.layers) - 1, -1, -1) if profile.layers[i].tensors]
    clock = _CommClock(cost, channels)
    kinds: dict[int, str] = {}
    for position, layer in enumerate(layers):
        next_ready = ready_times[layers[position + 1]] if position + 1 < len(layers) else None
        nbytes = profile.layers[layer].nbytes
        kinds[layer] = _layer_type(clock, ready_times[layer], nbytes, next_ready)
        clock.schedule(layer, kinds[layer], ready_times[layer], nbytes)
    return Schedule(kinds, tuple(clock.ops))


def plan_from_schedule(schedule: Schedule, profile: ModelProfile, channels: int) -> Plan:
    """Ops in CALCCOMMTIME's launch order, each on its channel; an op whose layers mix element
    sizes becomes one op per size on the same channel, since sizes never share a buffer.

    Args:
        schedule: Algorithm 1's result (``determine_layer_types``).
        profile: the profile it was made for, whose layers' tensors fill the ops.
        channels: the planner's `channels` option, recorded in the plan's options (the ops keep the
            channels the schedule gave them).
    """
    ops: list[Op] = []
    for scheduled in schedule.ops:
        by_size: dict[int, list] = {}
        for layer in scheduled.layers:
            for tensor in reversed(profile.layers[layer].tensors):
                by_size.setdefault(tensor.bytes_per_element, []).append(whole(tensor))
        for slices in by_size.values():
            ops.append(Op(tuple(slices), channel=scheduled.channel, priority=len(ops)))
    return Plan(tuple(ops), options={"channels": channels})


def plan(profile: ModelProfile, cost: CostModel, *, channels: int, overlap_forward: bool) -> Plan:
    """The fastest simulated plan of Algorithm 1 over 1..`channels` channels.

    Args:
        profile: the model's per-layer times and tensors (ModelProfile).
        cost: the all-reduce cost model, for Algorithm 1 and for simulating each candidate.
        channels: the most process groups the plan may use (k >= 1); every k' = 1..k is tried and
            the fewest channels win a tie.
        overlap_forward: defer the step's waits to each layer's next forward (us-byte Fig. 1).
    """
    best, best_time = None, float("inf")
    # L ops at most, so more than L channels are never all busy and change nothing
    for concurrency in range(1, min(channels, len(profile.layers)) + 1):
        candidate = plan_from_schedule(determine_layer_types(profile, cost, concurrency), profile, channels)
        time = simulate(candidate, profile, cost).iteration_time
        if time < best_time:
            best, best_time = candidate, time
    return deferred_if(best, overlap_forward)


SPEC = PlannerSpec(
    "asc_wfbp", plan, "ASC-WFBP: normal, merged or simultaneous all-reduce per layer",
    options=(Option("channels", 2, positive_int, "process groups for simultaneous all-reduces"), OVERLAP_FORWARD),
    source="asc-wfbp Algorithm 1")
