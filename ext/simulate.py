"""One discrete-event model of a training iteration, for any plan.

Time 0 is the start of the backward pass (us-byte §3). Layers run backward from output to input
(us-byte eq. 2). An op becomes ready when all its slices are computed (and, for forward-phase ops,
when the backward pass has ended: us-byte eq. 9); it starts once ready, once the op before it on
its channel has started and once its channel runs fewer than the cost model's `ops_per_channel`
ops: with one (the papers' model), once the op before it has finished (eq. 3). An op lasts ``a``
(start-up) and then transmits ``b·bytes`` of work, with the a and b of its collective (an
all-reduce's, or a reduce-scatter's); while k ops transmit at once each progresses at
1/s(k) of its solo rate, s(k) = 1 + (γ − 1)(k − 1), which for k = 2 is the a + γ·b·m of asc-wfbp
eq. 9 and for one op the a + b·m of eq. 3. The next forward starts when the backward pass and the
backward-phase ops that are not deferred are done and the update of the layers they carry
(optimizer step, decoding) has run; a layer whose gradients travel in forward-phase (or deferred)
ops is updated just before its forward, and its forward also waits for every such op carrying its
gradients (us-byte eq. 11).
The iteration time is the end of the next forward of layer L (us-byte eq. 12). The timeline also
gives the computing thread's busy time (its work, slowed as below), the runtime's measured
iteration time less its wait on communication.
Two terms are not in the papers, whose ops cost the computation nothing. With a cost model's
`host` > 0, each op takes `host` seconds of the computing thread when it launches: a backward-phase
op in the gradient hook of the layer that completes it (or later, as ops launch in channel order),
which delays every layer computed after it; forward-phase ops when the backward pass ends. With its
`compute_slowdown` σ > 1, the computing thread's work (layers, updates, launches) progresses at
1/σ of its rate while any op transmits (not while ops only start up: waiting on the network takes
no processor), and with its `transfer_slowdown` τ > 1 the ops'
transmissions progress at 1/τ of their rate while the thread computes: the two share the ranks'
processors.
Compressed plans are simulated on their wire profile (gradsync.compress.wire_profile): tensor
sizes as they travel, codec compute folded into the layers' times.
"""
from __future__ import annotations

import math
from dataclasses import dataclass

from .cost import CostModel
from .plan import ALLREDUCE, BACKWARD, FORWARD, Plan, ops_by_channel
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
    busy_time: float  # the computing thread's time at work: layers, updates, op launches, slowdowns included
    backward_busy: float  # the part of busy_time up to backward_end
    backward_end: float
    comm_end: float
    ops: tuple[OpSpan, ...]
    layers: tuple[LayerSpan, ...]

    @property
    def noncovered_comm(self) -> float:
        """Communication not hidden behind compute: iteration time minus forward, backward and update."""
        return max(0.0, self.iteration_time - self.compute_time)


def contention_slowdown(gamma: float, transmitting: int) -> float:
    """s(k) = 1 + (γ − 1)(k − 1): per-op slowdown when k ops transmit at once (asc-wfbp eq. 9 at k = 2)."""
    return 1.0 + (gamma - 1.0) * max(0, transmitting - 1)


class InFlight:
    """All-reduces in flight under the model above: each lasts `a` of start-up, then transmits
    b·bytes of solo time at 1/s(k) of its solo rate while k ops transmit (and at a further 1/pace
    beside computation)."""

    def __init__(self, cost: CostModel):
        self.cost = cost
        self.starting: dict[int, float] = {}  # op -> remaining start-up time
        self.transmitting: dict[int, float] = {}  # op -> remaining solo transmission time
        self.work: dict[int, float] = {}

    def start(self, op: int, nbytes: int, collective: str = ALLREDUCE) -> None:
        """An op starts: its start-up, then its transmission, with the cost model's terms for it.

        Args:
            op: the op's index in the plan.
            nbytes: the bytes it carries.
            collective: its collective (``Op.collective``).
        """
        a, b = self.cost.terms(collective)
        self.starting[op] = a
        self.work[op] = b * nbytes

    @property
    def active(self) -> bool:
        """Whether any op is in flight (starting up or transmitting)."""
        return bool(self.starting or self.transmitting)

    @property
    def transmits(self) -> bool:
        """Whether any op is past its start-up (the computation is slowed only then)."""
        return bool(self.transmitting)

    def next_event(self, clock: float, pace: float = 1.0) -> float:
        """When the next op ends its start-up or its transmission (inf with none in flight), the
        transmissions progressing `pace` times slower than alone."""
        slowdown = contention_slowdown(self.cost.gamma, len(self.transmitting))
        events = [clock + rest for rest in self.starting.values()]
        events += [clock + rest * slowdown * pace for rest in self.transmitting.values()]
        return min(events, default=math.inf)

    def advance(self, clock: float, step: float, pace: float = 1.0) -> list[int]:
        """Let `step` seconds pass from `clock` at `pace`; the ops that finished, in no particular order.

        Args:
            clock: the current time (seconds), which scales the tolerance for an op counted as done.
            step: seconds to let pass; at most ``next_event(clock, pace) - clock``, since an op whose
                start-up ends within the step transmits only from the next call on.
            pace: how many times slower than alone the transmissions progress (the cost model's
                `transfer_slowdown` while the computing thread works, else 1).
        """
        slowdown = contention_slowdown(self.cost.gamma, len(self.transmitting))
        tolerance = 1e-12 * max(1.0, clock + step)
        finished = []
        for op in list(self.transmitting):
            self.transmitting[op] -= step / (slowdown * pace)
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
class ThreadTask:
    """Work of the computing thread, in order: `work` solo seconds, begun once the ops in `gate`
    are done; `launches` an op when it ends; `span` (layer, kind) names a layer's computation."""

    work: float
    gate: tuple[int, ...] = ()
    launches: int | None = None
    span: tuple[int, str] | None = None


def launch_positions(plan: Plan, layer_of: dict[str, int], layers: int) -> list[int]:
    """The hook each backward-phase op launches in, as a backward position (0: layer L, computed
    first): the hook of the layer that completes it or, as ops launch in channel order, a later one.

    Args:
        plan: the plan; only its backward-phase ops get a position (the others' entries are 0).
        layer_of: the index of the layer owning each tensor, by tensor name.
        layers: L, the number of layers of the profile.
    """
    last = layers - 1
    position = [0] * len(plan.ops)
    for indices in ops_by_channel(plan.ops).values():
        previous = 0
        for index in indices:
            op = plan.ops[index]
            if op.phase == BACKWARD:
                previous = position[index] = max(previous, *(last - layer_of[s.tensor] for s in op.slices))
    return position


def thread_tasks(plan: Plan, profile: ModelProfile, layer_of: dict[str, int], host: float) -> list[ThreadTask]:
    """The computing thread's iteration (module docstring): backward layers, each followed by the
    launches in its hook (`host` each, in plan order); the forward-phase ops' launches; the wait for
    the ops that gate the step and the update of the layers they carry; each layer's forward, after
    the ops that gate it (forward-phase and deferred ones) and its deferred update.

    Args:
        plan: the plan whose ops are launched.
        profile: the layers' forward, backward and update times (seconds).
        layer_of: the index of the layer owning each tensor, by tensor name.
        host: seconds of the computing thread per op launch (the cost model's `host`).
    """
    last = len(profile.layers) - 1
    position = launch_positions(plan, layer_of, len(profile.layers))
    in_hook: dict[int, list[int]] = {}
    for index, op in enumerate(plan.ops):
        if op.phase == BACKWARD:
            in_hook.setdefault(position[index], []).append(index)
    tasks = []
    for p in range(last + 1):
        tasks.append(ThreadTask(profile.layers[last - p].backward_time, span=(last - p, "backward")))
        tasks += [ThreadTask(host, launches=index) for index in in_hook.get(p, ())]
    tasks += [ThreadTask(host, launches=index) for index, op in enumerate(plan.ops) if op.phase == FORWARD]
    carried: dict[int, set[int]] = {}
    for index, op in enumerate(plan.ops):
        if op.gates_forward:
            for s in op.slices:
                carried.setdefault(layer_of[s.tensor], set()).add(index)
    before_step = tuple(index for index, op in enumerate(plan.ops) if not op.gates_forward)
    tasks.append(ThreadTask(sum(l.update_time for i, l in enumerate(profile.layers) if i not in carried),
                            gate=before_step))
    for i, layer in enumerate(profile.layers):
        gate = tuple(sorted(carried.get(i, ())))
        if gate:
            tasks.append(ThreadTask(layer.update_time, gate=gate))
        tasks.append(ThreadTask(layer.forward_time, span=(i, "forward")))
    return tasks


def simulate(plan: Plan, profile: ModelProfile, cost: CostModel) -> Timeline:
    """Simulate one iteration of `plan` (see the module docstring for the model).

    Args:
        plan: the ops to run.
        profile: the model's per-layer times and tensors (ModelProfile) the plan was made for; for a
            compressed plan, its wire profile.
        cost: the all-reduce cost model, with its contention, host time, slowdowns and ops per channel.
    """
    layer_of = profile.layer_of_tensor()
    tensors = profile.tensor_map()
    tasks = thread_tasks(plan, profile, layer_of, cost.host)
    backward_tasks = len(profile.layers) + sum(1 for op in plan.ops if op.phase == BACKWARD)

    count = len(plan.ops)
    nbytes = [sum(s.length * tensors[s.tensor].bytes_per_element for s in op.slices) for op in plan.ops]
    queues = {channel: list(reversed(indices)) for channel, indices in ops_by_channel(plan.ops).items()}
    ready = [math.inf] * count
    start = [0.0] * count
    end = [0.0] * count
    finished = [False] * count
    in_flight = InFlight(cost)
    running_on: dict[int, int] = {channel: 0 for channel in queues}  # ops in flight per channel
    layer_spans: list[LayerSpan] = []
    clock = backward_end = busy = backward_busy = 0.0
    task, remaining, begun = 0, (tasks[0].work if tasks else 0.0), None
    waiting = set(tasks[0].gate) if tasks else set()  # the current task's ops not yet done
    done = 0
    while task < len(tasks) or done < count:
        for channel, queue in queues.items():
            while running_on[channel] < cost.ops_per_channel and queue and ready[queue[-1]] <= clock:
                index = queue.pop()
                running_on[channel] += 1
                start[index] = clock
                in_flight.start(index, nbytes[index], plan.ops[index].collective)
        running = task < len(tasks) and not waiting
        slowdown = cost.compute_slowdown if in_flight.transmits else 1.0
        pace = cost.transfer_slowdown if running and remaining > 0 else 1.0
        if running and begun is None:
            begun = clock
        step = (remaining * slowdown if running else math.inf)
        if in_flight.active:
            step = min(step, in_flight.next_event(clock, pace) - clock)
        elif not running:
            raise RuntimeError(f"simulation stalled at {clock:.6f} s: task {task} waits for ops never launched")
        for index in in_flight.advance(clock, step, pace) if in_flight.active else ():
            running_on[plan.ops[index].channel] -= 1
            end[index], finished[index] = clock + step, True
            waiting.discard(index)
            done += 1
        clock += step
        if not running:
            continue
        busy += step
        remaining -= step / slowdown
        if remaining > 1e-12 * max(1.0, clock):
            continue
        current = tasks[task]
        if current.launches is not None:
            ready[current.launches] = clock
        if current.span is not None:
            layer = current.span[0]
            layer_spans.append(LayerSpan(layer, profile.layers[layer].name, current.span[1], begun, clock))
        task += 1
        if task == backward_tasks:
            backward_end, backward_busy = clock, busy
        remaining, begun = (tasks[task].work if task < len(tasks) else 0.0), None
        waiting = {op for op in tasks[task].gate if not finished[op]} if task < len(tasks) else set()

    op_spans = tuple(
        OpSpan(i, op.channel, op.phase, nbytes[i], ready[i], start[i], end[i]) for i, op in enumerate(plan.ops)
    )
    return Timeline(
        iteration_time=clock,
        compute_time=profile.forward_time + profile.backward_time + profile.update_time,
        busy_time=busy,
        backward_busy=backward_busy,
        backward_end=backward_end,
        comm_end=max(end, default=0.0),
        ops=op_spans,
        layers=tuple(sorted(layer_spans, key=lambda span: (span.kind != "backward", span.layer))),
    )
