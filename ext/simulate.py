"""One discrete-event model of a training iteration, for any plan.

Time 0 is the start of the backward pass (us-byte §3). Layers run backward from output to input
(us-byte eq. 2). An op becomes ready when all its slices are computed (and, for forward-phase ops,
when the backward pass has ended: us-byte eq. 9); it starts once ready and once the op before it on
its channel has finished (eq. 3). An op lasts ``a`` (start-up) and then transmits ``b·bytes`` of
work; while k ops transmit at once each progresses at 1/s(k) of its solo
rate, s(k) = 1 + (γ − 1)(k − 1), which for k = 2 is the a + γ·b·m of asc-wfbp eq. 9 and for one op
the a + b·m of eq. 3. The next forward starts when the backward pass and all backward-phase ops are
done and the update of the layers they carry (optimizer step, decoding) has run; a layer whose
gradients travel in forward-phase ops is updated just before its forward, and its forward also
waits for every forward-phase op carrying its gradients (us-byte eq. 11).
The iteration time is the end of the next forward of layer L (us-byte eq. 12).
With a cost model's `host` > 0 (not in the papers: their ops cost the computation nothing), each
op also takes `host` seconds of the computing thread when it launches: a backward-phase op in the
gradient hook of the layer that completes it (or later, as ops launch in channel order), which
delays every layer computed after it; forward-phase ops when the backward pass ends.
Compressed plans are simulated on their wire profile (gradsync.compress.wire_profile): tensor
sizes as they travel, codec compute folded into the layers' times.
"""
from __future__ import annotations

import math
from dataclasses import dataclass

from .cost import CostModel
from .plan import BACKWARD, FORWARD, Plan, ops_by_channel
from .profile import ModelProfile


@dataclass(frozen=True)
class OpSpan:
    op: int
    channel: int
    phase: str
    nbytes: int
    ready: float
    start: float
    end: float


@dataclass(frozen=True)
class LayerSpan:
    layer: int
    name: str
    kind: str  # "backward" or "forward"
    start: float
    end: float


@dataclass(frozen=True)
class Timeline:
    """The simulated iteration: spans of every op and layer, and summary numbers in seconds."""

    iteration_time: float
    compute_time: float
    backward_end: float
    comm_end: float
    ops: tuple[OpSpan, ...]
    layers: tuple[LayerSpan, ...]

    @property
    def noncovered_comm(self) -> float:
        """Communication not hidden behind compute: iteration time minus forward, backward and update."""
        return max(0.0, self.iteration_time - self.compute_time)

    @property
    def num_ops(self) -> int:
        return len(self.ops)

    @property
    def comm_bytes(self) -> int:
        return sum(span.nbytes for span in self.ops)


def contention_slowdown(gamma: float, transmitting: int) -> float:
    """s(k) = 1 + (γ − 1)(k − 1): per-op slowdown when k ops transmit at once (asc-wfbp eq. 9 at k = 2)."""
    return 1.0 + (gamma - 1.0) * max(0, transmitting - 1)


class InFlight:
    """All-reduces in flight under the model above: each lasts `a` of start-up, then transmits
    b·bytes of solo time at 1/s(k) of its solo rate while k ops transmit."""

    def __init__(self, cost: CostModel):
        self.cost = cost
        self.starting: dict[int, float] = {}  # op -> remaining start-up time
        self.transmitting: dict[int, float] = {}  # op -> remaining solo transmission time
        self.work: dict[int, float] = {}

    def start(self, op: int, nbytes: int) -> None:
        self.starting[op] = self.cost.a
        self.work[op] = self.cost.b * nbytes

    def next_event(self, clock: float) -> float:
        """When the next op ends its start-up or its transmission (inf with none in flight)."""
        slowdown = contention_slowdown(self.cost.gamma, len(self.transmitting))
        events = [clock + rest for rest in self.starting.values()]
        events += [clock + rest * slowdown for rest in self.transmitting.values()]
        return min(events, default=math.inf)

    def advance(self, clock: float, step: float) -> list[int]:
        """Let `step` seconds pass from `clock`; the ops that finished, in no particular order."""
        slowdown = contention_slowdown(self.cost.gamma, len(self.transmitting))
        tolerance = 1e-12 * max(1.0, clock + step)
        finished = []
        for op in list(self.transmitting):
            self.transmitting[op] -= step / slowdown
            if self.transmitting[op] <= tolerance:
                del self.transmitting[op]
                finished.append(op)
        for op in list(self.starting):
            self.starting[op] -= step
            if self.starting[op] <= tolerance:
                del self.starting[op]
                self.transmitting[op] = self.work.pop(op)
        return finished


@dataclass(frozen=True)
class HostCharges:
    """Where launching ops delays the computing thread (see the module docstring): each layer's
    shift, when each op can start, when the backward pass ends, and when the thread is free after
    launching the forward-phase ops."""

    layer_shift: list[float]
    op_ready: list[float]
    backward_end: float
    launched: float


def host_charges(plan: Plan, profile: ModelProfile, layer_of: dict[str, int], host: float) -> HostCharges:
    """Launch positions in backward order (ops launch in channel order, each in the hook of the
    layer that completes it and its predecessors on the channel; those of one hook in plan order),
    and the compute shift they cause. `layer_of`: profile.layer_of_tensor()."""
    last = len(profile.layers) - 1
    position = [0] * len(plan.ops)  # backward order: 0 is layer L, computed first
    for indices in ops_by_channel(plan.ops).values():
        previous = 0
        for index in indices:
            op = plan.ops[index]
            if op.phase == BACKWARD:
                previous = position[index] = max(previous, *(last - layer_of[s.tensor] for s in op.slices))
    backward = [i for i, op in enumerate(plan.ops) if op.phase == BACKWARD]
    launched_before = [0] * (last + 2)  # ops launched in the hooks of positions < p
    for index in backward:
        launched_before[position[index] + 1] += 1
    for p in range(1, last + 2):
        launched_before[p] += launched_before[p - 1]
    layer_shift = [host * launched_before[last - layer] for layer in range(last + 1)]
    ready_times = profile.backward_ready_times()
    backward_end = profile.backward_time + host * len(backward)
    op_ready = [0.0] * len(plan.ops)
    order_in_hook: dict[int, int] = {}
    forward = 0
    for index, op in enumerate(plan.ops):
        if op.phase == BACKWARD:
            p = position[index]
            order_in_hook[p] = order_in_hook.get(p, 0) + 1
            op_ready[index] = ready_times[last - p] + layer_shift[last - p] + host * order_in_hook[p]
        else:
            forward += 1
            op_ready[index] = backward_end + host * forward  # launched once the backward pass is over
    return HostCharges(layer_shift, op_ready, backward_end, backward_end + host * forward)


def simulate(plan: Plan, profile: ModelProfile, cost: CostModel) -> Timeline:
    """Simulate one iteration of `plan` (see the module docstring for the model)."""
    layer_of = profile.layer_of_tensor()
    tensors = profile.tensor_map()
    charges = host_charges(plan, profile, layer_of, cost.host)
    backward_end = charges.backward_end

    count = len(plan.ops)
    ready = list(charges.op_ready)
    nbytes = [0] * count
    for index, op in enumerate(plan.ops):
        nbytes[index] = sum(s.length * tensors[s.tensor].bytes_per_element for s in op.slices)

    queues = {channel: list(reversed(indices)) for channel, indices in ops_by_channel(plan.ops).items()}
    start = [0.0] * count
    end = [0.0] * count
    in_flight = InFlight(cost)
    busy: set[int] = set()
    clock = 0.0
    done = 0
    while done < count:
        for channel, queue in queues.items():
            if channel not in busy and queue and ready[queue[-1]] <= clock:
                index = queue.pop()
                busy.add(channel)
                start[index] = clock
                in_flight.start(index, nbytes[index])
        upcoming = [ready[q[-1]] for c, q in queues.items() if q and c not in busy]
        step = min([in_flight.next_event(clock), *upcoming]) - clock
        for index in in_flight.advance(clock, step):
            busy.discard(plan.ops[index].channel)
            end[index] = clock + step
            done += 1
        clock += step

    forward_gate = [0.0] * len(profile.layers)
    backward_done = max([charges.launched] + [end[i] for i, op in enumerate(plan.ops) if op.phase == BACKWARD])
    for index, op in enumerate(plan.ops):
        if op.phase == FORWARD:
            for s in op.slices:
                layer = layer_of[s.tensor]
                forward_gate[layer] = max(forward_gate[layer], end[index])

    layer_spans = [
        LayerSpan(i, layer.name, "backward", s + shift, s + shift + layer.backward_time)
        for i, (layer, s, shift) in enumerate(zip(profile.layers, profile.backward_start_times(), charges.layer_shift))
    ]
    deferred = {layer_of[s.tensor] for op in plan.ops if op.phase == FORWARD for s in op.slices}
    forward_clock = backward_done + sum(l.update_time for i, l in enumerate(profile.layers) if i not in deferred)
    for i, layer in enumerate(profile.layers):
        forward_clock = max(forward_clock, forward_gate[i]) + (layer.update_time if i in deferred else 0.0)
        layer_spans.append(LayerSpan(i, layer.name, "forward", forward_clock, forward_clock + layer.forward_time))
        forward_clock += layer.forward_time

    op_spans = tuple(
        OpSpan(i, op.channel, op.phase, nbytes[i], ready[i], start[i], end[i]) for i, op in enumerate(plan.ops)
    )
    return Timeline(
        iteration_time=forward_clock,
        compute_time=profile.forward_time + profile.backward_time + profile.update_time,
        backward_end=backward_end,
        comm_end=max(end, default=0.0),
        ops=op_spans,
        layers=tuple(layer_spans),
    )
