"""Executes one Plan per iteration: fusion buffers, launch in plan order per channel, unpack.

Every tensor passes through the codec (the identity when nothing is compressed): when the first
op carrying a tensor launches, the codec encodes its gradient into a wire tensor, and ops carry
slices of wire tensors. Each op's buffer holds its slices, one "used" flag per tensor and a last
"non-finite" flag: a rank whose backward passes since the last synchronisation (no_sync ones
included) never produced a gradient contributes zeros and used flag 0, and a rank whose share sums
to inf or NaN sets the non-finite flag to NaN (its sum times 0, which a sum over ranks keeps NaN;
on the device, at launch, where the check overlaps the ops already in flight; each rank sends its
share of the mean, whose partial sums cannot overflow, so the reduced data holds an inf or a NaN
only where a share does).
After the collective a used-flag sum of 0 means no rank used the tensor and its gradient is left
untouched, as torch DDP does with ``find_unused_parameters`` (or, with `unused_as_zeros`, set to
zeros where it is None, as DeepSpeed's engine does); otherwise, once every op of a tensor
is done, the codec writes the averaged gradient (an uncompressed tensor that one op carries whole
needs no writing: its span of the buffer becomes the gradient). The engine never looks at which
planner made the plan: phase, channel and order are all it needs.
"""
from __future__ import annotations

import math
import operator
import time
from contextlib import nullcontext
from dataclasses import dataclass, field
from typing import Callable

import torch
import torch.distributed as dist
from torch.profiler import record_function

from ..agreement import waiting_for
from ..compress import Codec
from ..compress.gradients import checksum, decoded_may_overflow, every_element_finite
from ..errors import ConfigError
from ..plan import BACKWARD, REDUCE_SCATTER, Plan, ops_by_channel
from .channels import Channels
from .in_flight import GradientVersions
from .op_buffers import SharedOpBuffers
from .partition import Partition

# An op whose slices are all whole gradients sent as they are, at most this many bytes a tensor on
# average, is packed by one copy of them all and one scaling of its data: on the CPU, per-tensor
# scaling costs about 2.5 µs of dispatch a tensor, more than a second pass over this many bytes
# (158 tensors of 4.7 KB: 100 µs instead of 400; at 180 KB a tensor the two tie; over a 17M-parameter
# transformer's 68 MB the second pass costs 45% more). On a GPU the copy is one multi-tensor kernel.
FUSED_PACK_MEAN_BYTES = 16 * 1024


@dataclass
class _OpState:
    slices: list[tuple[str, int, int, int]]  # (tensor, offset in its wire, length, position in buffer)
    tensors: list[str]  # tensors carried, in flag order
    phase: str
    gates_forward: bool  # waited for at the next forward of its layers, not before the step
    channel: int
    buffer: torch.Tensor
    views: list[torch.Tensor]  # the buffer's span of each slice
    label: str  # "op<index in the plan>", in torch.profiler's ranges
    flags: list[torch.Tensor]  # the buffer's flag spans: one, or one after each rank's segment
    # a reduce-scatter's: each rank's (start, end) of the buffer, this rank's segment (reduced in
    # place), and the slices it lands from there (tensor, offset, length, position in `received`)
    segments: list[tuple[int, int]] | None = None
    received: torch.Tensor | None = None
    own_slices: list[tuple[str, int, int, int]] | None = None
    own_views: list[torch.Tensor] | None = None  # the received buffer's span of each own slice
    gathered: list[torch.Tensor] | None = None
    used: dict[str, float] = field(default_factory=dict)  # after unpacking: the summed used flag of each tensor
    waiting_for: set[str] = field(default_factory=set)
    work: object = None
    launched_at: float = 0.0
    done: bool = False
    all_used: torch.Tensor | None = None  # the flags of a rank that used every tensor (non-finite flag 0)
    # per slice, the buffer's span in its parameter's shape where the gradient travels as it is and
    # whole (``_direct_spans``), else None
    direct: list[torch.Tensor | None] = field(default_factory=list)
    # where every slice is direct and small (FUSED_PACK_MEAN_BYTES): the buffer's data, scaled at once
    fused_data: torch.Tensor | None = None
    parameters: list[torch.nn.Parameter] = field(default_factory=list)  # of `tensors`, in order
    # an all-reduce's reduced flags where every rank used every tensor and every share was finite, and
    # the summed used flags they give (the check after the collective is then one comparison)
    reduced_flags_all_used: torch.Tensor | None = None
    used_by_every_rank: dict[str, float] = field(default_factory=dict)
    # found complete when first waited for, while its completion was timed: from then on its future's
    # callback times it (``PlanExecutor._note_completion``)
    completes_unwatched: bool = False


class NonFiniteGradient(FloatingPointError):
    """A reduced gradient holds inf or NaN; raised on every rank alike (the sum is the same)."""


class PlanExecutor:
    """Runs `plan` (made on the codec's wire sizes) over `parameters` on `channels`. A plan of
    reduce-scatters delivers each rank the elements `partition` gives it, read with
    ``reduced_partition``: the sharded optimizer needs no others, so, as DeepSpeed's own ZeRO-2
    copies each gradient into its bucket and frees it, each gradient is copied into its ops'
    buffers as soon as it is final and released (``.grad`` set to None); those buffers are carved
    from `shared_buffers`, where given, which the executors of the model's other plans share."""

    def __init__(self, plan: Plan, parameters: dict, channels: Channels, codec: Codec | None = None,
                 layout: str = "plain", nonfinite: str = "raise", trace=None, partition: Partition | None = None,
                 shared_buffers: SharedOpBuffers | None = None, unused_as_zeros: bool = False):
        if plan.channels > len(channels):
            raise ConfigError(f"plan uses {plan.channels} channels but only {len(channels)} were created "
                              "(raise 'channels')")
        self.plan = plan
        self.parameters = parameters
        self.channels = channels
        self.codec = codec or Codec()
        self.layout = layout
        self.nonfinite = nonfinite
        self.trace = trace
        self.partition = partition
        self.unused_as_zeros = unused_as_zeros
        self.as_they_are = _carries_gradients_as_they_are(self.codec)
        # each rank's share of the mean is its gradient times 1/world size, as torch DDP scales; a 0-dim
        # tensor rather than a Python number, which torch wraps into a new tensor at every call (2 µs a tensor)
        self.share = torch.tensor(1.0 / channels.world_size, dtype=torch.float64)
        self.ops = [self._op_state(op, index, buffer)
                    for index, (op, buffer) in enumerate(zip(plan.ops, self._buffers(plan, shared_buffers)))]
        self.buffer_bytes = sum(state.buffer.numel() * state.buffer.element_size() for state in self.ops)
        self.decode_seconds = 0.0  # time spent in the codec's finish, in all (inside the waits)
        self.encode_seconds = 0.0  # time spent in the codec's encode in the current step
        self.ops_of_tensor: dict[str, list[int]] = {}
        for index, state in enumerate(self.ops):
            for name in state.tensors:
                self.ops_of_tensor.setdefault(name, []).append(index)
        self.states_of_tensor = {name: [self.ops[i] for i in indices] for name, indices in self.ops_of_tensor.items()}
        self.op_counts = {name: len(indices) for name, indices in self.ops_of_tensor.items()}
        self.releases_gradients = bool(self.ops) and all(state.segments is not None for state in self.ops)
        self.spans_of_tensor: dict[str, list[tuple[int, int, torch.Tensor]]] = {}  # (offset, length, buffer view)
        for state in self.ops if self.releases_gradients else ():
            for (name, offset, length, _), view in zip(state.slices, state.views):
                self.spans_of_tensor.setdefault(name, []).append((offset, length, view))
        # gradients the flags cannot vouch for: decoded from a wire whose values may lie past their range
        self.decoded_checked = {name for state in self.ops for name in state.tensors
                                if decoded_may_overflow(state.buffer.dtype, self.parameters[name].dtype)}
        self.order = ops_by_channel(plan.ops)
        self.times_ops = False  # time the communication for the cost watch (`time_ops`)
        # where set, called (and raising) with the op's label when an op's gradients changed in flight
        # (``runtime.in_flight``): a backward pass no hook saw (``output_start``), or the gradients changed
        # in place (clipped) before they were averaged
        self.in_flight_watch: Callable[[str], None] | None = None
        self.versions: GradientVersions | None = None  # read as the backward pass ended, where watched
        self.busy_times: list[float] = []  # per finished iteration, its communication's busy time, until taken
        self.done_at: list[float] = []  # when each op of the iteration under way completed (0: not yet)
        self.start_iteration(0)

    def time_ops(self) -> None:
        """From now on, time each iteration's communication (``take_busy_times``)."""
        self.timed_on_device = self.channels.timed_on_device
        self.times_ops = True

    def take_busy_times(self) -> list[float]:
        """The busy time of the communication of each iteration finished since the last call
        (recorded once the next iteration starts, when every op of the previous one is in)."""
        taken, self.busy_times = self.busy_times, []
        return taken

    def _record_busy_time(self) -> None:
        """The finished iteration's busy time into `busy_times` (``measure.cost_watch``, step 1):
        the time during which some op was in flight (the union of the ops' spans from launch to
        completion; ops that share the link, or queue behind one another, count once). On NCCL,
        the sum of the backend's own durations of the ops (with TORCH_NCCL_ENABLE_TIMING=1, else
        none are recorded)."""
        if any(state.work is None for state in self.ops):  # the iteration never reached some op
            return
        if self.timed_on_device:
            try:
                self.busy_times.append(sum(state.work._get_duration() for state in self.ops) / 1e3)
            except RuntimeError:  # NCCL's timing is off: no samples from this rank
                self.times_ops = False
            return
        spans = sorted((state.launched_at, done) for state, done in zip(self.ops, self.done_at))
        if not spans or not all(done for _, done in spans):
            return
        busy, covered = 0.0, -math.inf
        for start, end in spans:
            busy += max(0.0, end - max(start, covered))
            covered = max(covered, end)
        self.busy_times.append(busy)

    def _note_completion(self, index: int, work) -> None:
        """Record when op `index`'s collective completes, for an op that completes while the
        iterating thread is elsewhere (``wait``; where the thread waits for it, its wait's return
        records it, as a callback would, less than a millisecond later: a Python callback on the
        backend's thread takes the interpreter, a new thread state and a switch, each time, which on
        8 ranks sharing 2 cores cost 2% of the iteration). The callback runs on the backend's thread,
        into this iteration's list: a late one cannot write into the next one's; it holds nothing
        else, so it never keeps a process group alive. A work without a future (gloo's
        reduce-scatter) is recorded when it is found complete (``collected``)."""
        done_at = self.done_at

        def note(_future) -> None:
            done_at[index] = time.perf_counter()
        try:
            future = work.get_future()
        except RuntimeError:  # "Work::getFuture not implemented"
            return
        future.add_done_callback(note)

    def _buffers(self, plan: Plan, shared: SharedOpBuffers | None) -> list[torch.Tensor]:
        """Each op's buffer: its slices' elements and its flags (a reduce-scatter's flags once per
        rank's segment); carved from `shared` for a plan of reduce-scatters."""
        specs = [self._buffer_spec(op) for op in plan.ops]
        self.carved_from = None  # the shared allocation this executor's buffers are views of
        if shared is not None and plan.ops and all(op.collective == REDUCE_SCATTER for op in plan.ops):
            devices = {device for _, _, device in specs}
            if len(devices) == 1:
                self.carved_from = shared
                return shared.carve([(numel, dtype) for numel, dtype, _ in specs], devices.pop())
        return [torch.empty(numel, dtype=dtype, device=device) for numel, dtype, device in specs]

    def _buffer_spec(self, op) -> tuple[int, torch.dtype, torch.device]:
        """(elements, dtype, device) of `op`'s buffer, once the op is checked against the runtime."""
        tensors = op.tensors()
        if op.transport != self.channels.transport:
            raise ConfigError(f"an op asks for transport {op.transport!r} but the channels run "
                              f"{self.channels.transport!r} (set wrap's 'transport')")
        if op.codec not in ("identity", self.codec.name):
            raise ConfigError(f"an op asks for codec {op.codec!r} but the runtime runs {self.codec.name!r}")
        if op.collective == REDUCE_SCATTER and (self.partition is None or self.codec.name != Codec.name):
            raise ConfigError("a reduce_scatter op needs a partition of the gradients and no compressor (a "
                              "compressor's wire is not the gradient's elements)")
        dtypes = {self.parameters[name].dtype for name in tensors}
        if len(dtypes) > 1:
            raise ConfigError(f"an op mixes gradient dtypes {sorted(map(str, dtypes))} ({tensors[:4]}): "
                              "they cannot share a fusion buffer")
        flag_copies = self.channels.world_size if op.collective == REDUCE_SCATTER else 1
        numel = sum(s.length for s in op.slices) + flag_copies * (len(tensors) + 1)
        return numel, self.codec.wire_dtype(self.layout, dtypes.pop()), self.parameters[tensors[0]].device

    def _op_state(self, op, index: int, buffer: torch.Tensor) -> _OpState:
        tensors = op.tensors()
        label = f"op{index}"
        if op.collective == REDUCE_SCATTER:
            state = self._reduce_scatter_state(op, tensors, buffer, label)
        else:
            slices, position = [], 0
            for s in op.slices:
                slices.append((s.tensor, s.offset, s.length, position))
                position += s.length
            views = [buffer[position:position + length] for _, _, length, position in slices]
            state = _OpState(slices, tensors, op.phase, op.gates_forward, op.channel, buffer, views, label,
                             [buffer[position:]])
        state.all_used = torch.tensor([1.0] * len(tensors) + [0.0], dtype=buffer.dtype, device=buffer.device)
        state.parameters = [self.parameters[name] for name in tensors]
        if op.collective != REDUCE_SCATTER and self.codec.collective != "allgather":
            world_size = self.channels.world_size
            state.reduced_flags_all_used = state.all_used * world_size
            state.used_by_every_rank = dict.fromkeys(tensors, float(world_size))
        state.direct = self._direct_spans(state)
        data = sum(view.numel() for view in state.views)
        small = data * buffer.element_size() <= FUSED_PACK_MEAN_BYTES * len(state.direct)
        if state.direct and None not in state.direct and small:
            state.fused_data = buffer[:data]
        return state

    def _direct_spans(self, state: _OpState) -> list[torch.Tensor | None]:
        """Per slice of an all-reduce, its span of the buffer in the parameter's shape where the
        codec sends each gradient as it is and the slice is the whole of a contiguous parameter:
        the gradient is scaled straight into it, and the span becomes the gradient after the
        reduction, with none of the codec's per-tensor steps (None for the other slices)."""
        if not self.as_they_are or state.segments is not None:
            return [None] * len(state.slices)
        direct = []
        for (name, offset, length, _), view in zip(state.slices, state.views):
            parameter = self.parameters[name]
            whole = offset == 0 and length == parameter.numel() and parameter.is_contiguous()
            direct.append(view.view(parameter.shape) if whole else None)
        return direct

    def _reduce_scatter_state(self, op, tensors: list[str], buffer: torch.Tensor, label: str) -> _OpState:
        """A reduce-scatter's buffer: each rank's segment (the parts of the op's slices it owns, in
        slice order) followed by the flags, so that every rank also receives the summed flags."""
        parts = [[] for _ in range(self.channels.world_size)]
        for s in op.slices:
            for rank, start, length in self.partition.split(s.tensor, s.offset, s.length):
                parts[rank].append((s.tensor, start, length))
        flag_count = len(tensors) + 1
        slices, segments, position = [], [], 0
        for rank_parts in parts:
            begin = position
            for name, start, length in rank_parts:
                slices.append((name, start, length, position))
                position += length
            segments.append((begin, position + flag_count))
            position += flag_count
        views = [buffer[at:at + length] for _, _, length, at in slices]
        flags = [buffer[end - flag_count:end] for _, end in segments]
        begin, end = segments[self.channels.rank]
        own = [(name, start, length, at - begin) for name, start, length, at in slices if begin <= at < end]
        received = buffer[begin:end]  # reduced in place (Channels.reduce_scatter)
        return _OpState(slices, tensors, op.phase, op.gates_forward, op.channel, buffer, views, label, flags,
                        segments, received, own, [received[at:at + length] for _, _, length, at in own])

    # -- one iteration ---------------------------------------------------------------------------
    def start_iteration(self, step: int, ready: set[str] | None = None, ends_step: bool = False,
                        zeroed_in_place: set[str] | None = None) -> None:
        """Reset for a synchronised iteration.

        Args:
            step: the codec's step (synchronised iterations with finite gradients before it).
            ready: tensors already produced (in the no_sync backward passes before this one, or in
                the step's earlier round).
            ends_step: this is the step's last round: once its ops are all in and decoded, the
                codec settles the step (``Codec.settle``).
            zeroed_in_place: tensors whose gradients a zero_grad asked to set to None zeroed in
                place instead (``zero_gradients_in_place``): set to None if no rank uses them.
        """
        if self.times_ops:
            self._record_busy_time()
        if self.carved_from is not None:  # released after the last step's delivery, perhaps
            self.carved_from.hold()
        self.done_at = [0.0] * len(self.ops)
        self.step = step
        self.ends_step = ends_step
        self.ops_open = len(self.ops)
        self.encode_seconds = 0.0
        for state in self.ops:
            state.waiting_for = set(state.tensors)
            state.work, state.done = None, False
        self.cursor = {channel: 0 for channel in self.order}
        self.ready: set[str] = set(ready or ())
        self.zeroed_in_place = zeroed_in_place or set()
        self.wires: dict[str, torch.Tensor | None] = {}
        self.versions = None
        # per tensor, its ops not yet unpacked (where the codec decodes) and not yet packed (where packing releases)
        self.ops_left = {} if self.as_they_are else dict(self.op_counts)
        self.packs_left = dict(self.op_counts) if self.releases_gradients else {}
        self.released: set[str] = set()  # gradients in the buffers and released (plans of reduce-scatters)
        self.backward_over = False
        self.skip_step = False
        self.nonfinite_seen = False  # an averaged gradient held inf or NaN (skipped, let through or raised)
        self.finishable: list[str] = []

    def mark_ready(self, name: str) -> None:
        """Called from the gradient hook of parameter `name`."""
        self.ready.add(name)
        if self.releases_gradients:
            self._copy_in(name)
        completes_an_op = False  # only an op that stops waiting can let ops launch (in plan order per channel)
        for state in self.states_of_tensor[name]:
            state.waiting_for.discard(name)
            completes_an_op = completes_an_op or not state.waiting_for
        if completes_an_op:
            self._launch_ready()

    def end_backward(self) -> None:
        """The backward pass is over: unused tensors count as ready; forward-phase ops launch."""
        self.backward_over = True
        for state in self.ops:
            state.waiting_for.clear()
        self._launch_ready()
        if self.in_flight_watch is not None and not self.releases_gradients and not self.channels.forests:
            self.versions = GradientVersions()
            for index, state in enumerate(self.ops):
                if _resident(state):
                    self.versions.hold_buffer(index, state.buffer)
                else:
                    self.versions.hold_gradients(index, state.parameters)

    def _launch_ready(self) -> None:
        for channel, indices in self.order.items():
            while self.cursor[channel] < len(indices):
                state = self.ops[indices[self.cursor[channel]]]
                if state.waiting_for or (state.phase != BACKWARD and not self.backward_over):
                    break
                self._launch(indices[self.cursor[channel]])
                self.cursor[channel] += 1

    def _used(self, name: str) -> bool:
        """Whether this rank has a gradient of `name` to send: produced in this synchronised
        backward or in the no_sync ones before it (it holds their sum)."""
        return name in self.ready and (name in self.released or self.parameters[name].grad is not None)

    def _copy_in(self, name: str) -> None:
        """Copy `name`'s final gradient (its hook has run) into its ops' buffers, each rank's share
        of the mean, and release it."""
        if self.parameters[name].grad is None:
            return
        wire = self._wire(name)
        for offset, length, view in self.spans_of_tensor[name]:
            torch.mul(_span(wire, offset, length), self.share, out=view)
        self._release(name)

    def _release(self, name: str) -> None:
        self.wires.pop(name, None)
        self.parameters[name].grad = None
        self.released.add(name)

    def _wire(self, name: str) -> torch.Tensor | None:
        if name not in self.wires:
            grad = self.parameters[name].grad if self._used(name) else None
            started = time.perf_counter()
            self.wires[name] = self.codec.encode(name, grad, self.step)
            self.encode_seconds += time.perf_counter() - started
        return self.wires[name]

    def _launch(self, index: int) -> None:
        state = self.ops[index]
        with _profiled(f"gradsync::encode {state.label}"):
            self._pack(state)
        state.launched_at = time.perf_counter()
        with _profiled(f"gradsync::launch {state.label}"):
            if self.codec.collective == "allgather":
                state.gathered = [torch.empty_like(state.buffer) for _ in range(self.channels.world_size)]
                state.work = dist.all_gather(state.gathered, state.buffer, group=self.channels.groups[state.channel],
                                             async_op=True)
            elif state.segments is not None:
                state.work = self.channels.reduce_scatter(state.channel,
                                                          [state.buffer[start:end] for start, end in state.segments])
            else:
                state.work = self.channels.all_reduce(state.channel, state.buffer)
        if self.times_ops and not self.timed_on_device and state.completes_unwatched:
            self._note_completion(index, state.work)

    def refuse_changed_in_flight(self, after_step: list[int] | None = None) -> None:
        """Call `in_flight_watch` (which raises) with the first op in flight whose gradients changed
        since the backward pass ended (``runtime.in_flight``), before the step or a read of the
        gradients collects any; `after_step`: the ops to look at once the step's have landed (those
        a deferred update waits for), less those carrying a part of a tensor that others carry too
        (their landings wrote into its gradient). Once an iteration: after a refusal the ops land as
        they are (the next zero_grad waits for them)."""
        if self.in_flight_watch is None or self.versions is None:
            return
        if after_step is None:
            indices, changed = range(len(self.ops)), self.versions.changed
        else:
            indices = [i for i in after_step if all(self.op_counts[name] == 1 for name in self.ops[i].tensors)]
            changed = self.versions.changed_since_landings
        for index in indices:
            state = self.ops[index]
            if state.work is not None and not state.done and changed(index, state):
                watch, self.in_flight_watch = self.in_flight_watch, None
                watch(state.label)

    def _pack(self, state: _OpState) -> None:
        """Encode the op's tensors into its buffer, then the used flags and the non-finite flag."""
        buffer = state.buffer
        grads = self._every_gradient(state) if state.fused_data is not None else None
        if grads is not None:
            self._pack_fused(state, grads)
            flags = state.all_used
        else:
            used = [self._used(name) for name in state.tensors]
            self._pack_slices(state, dict(zip(state.tensors, used)))
            flags = state.all_used if all(used) else torch.tensor(used + [False], dtype=buffer.dtype)
        for span in state.flags:
            span.copy_(flags)
        if buffer.is_floating_point():  # the used flags are 0 or 1: the sum is not finite only for the data
            nonfinite = checksum(buffer) * 0  # 0, or NaN where an element is inf or NaN: summed, it stays NaN
            for span in state.flags:
                span[-1].copy_(nonfinite)
        for name in state.tensors if self.releases_gradients else ():
            self.packs_left[name] -= 1
            if self.packs_left[name] == 0 and name not in self.released:
                self._release(name)

    def _every_gradient(self, state: _OpState) -> list[torch.Tensor] | None:
        """The gradients of the op's tensors, in slice order, where this rank used every one (`_used`,
        for a plan of all-reduces); else None."""
        if not self.ready.issuperset(state.tensors):
            return None
        grads = [parameter.grad for parameter in state.parameters]
        return None if any(grad is None for grad in grads) else grads

    def _pack_fused(self, state: _OpState, grads: list[torch.Tensor]) -> None:
        """Every slice a whole gradient, every one used: one copy of them all into their spans (none
        where the backward pass accumulated them there: ``zero_gradients_in_place``), then the op's
        data scaled to this rank's share of the mean in one pass. The gradients are held, as in
        `_pack_slices`, until the next iteration starts."""
        if not _in_their_spans(state, grads):
            torch._foreach_copy_(state.direct, grads)
        state.fused_data.mul_(self.share)
        self.wires.update(zip(state.tensors, grads))

    def _pack_slices(self, state: _OpState, used_of: dict[str, bool]) -> None:
        """Each slice encoded into its span: a used gradient scaled to this rank's share of the mean
        (sent as it is, or through the codec's wire), an unused one zeros."""
        gathering = self.codec.collective == "allgather"
        for (name, offset, length, _), target, direct in zip(state.slices, state.views, state.direct):
            if name in self.released:  # copied in already
                continue
            if direct is not None:
                if used_of[name]:  # the gradient is held, as a wire is, until the next iteration starts: freed
                    # then, its memory goes to the backward pass's new gradients rather than to the forward's
                    # activations (which left the new gradients fresh pages: +3-5 ms a step, benchmarks.overhead)
                    grad = self.wires[name] = self.parameters[name].grad
                    torch.mul(grad, self.share, out=direct)
                else:
                    direct.zero_()
                continue
            wire = self._wire(name)
            if wire is None:
                target.zero_()
            elif gathering:
                target.copy_(_span(wire, offset, length))
            else:  # the all-reduce sums each rank's share of the mean: copy and scale in one pass
                torch.mul(_span(wire, offset, length), self.share, out=target)

    # -- completion --------------------------------------------------------------------------------
    def wait(self, index: int) -> None:
        """Wait for op `index`; once all ops of a tensor are done, the codec writes its gradient."""
        state = self.ops[index]
        if state.done:
            return
        if state.work is None:
            raise RuntimeError(f"op {index} was never launched: the backward pass has not ended")
        if self.times_ops and not self.timed_on_device and not self.done_at[index] and state.work.is_completed():
            state.completes_unwatched = True  # its completion, unseen here (recorded late by `collected`)
        with _profiled(f"gradsync::wait {state.label}"), waiting_for(
                f"the gradients' communication ({state.label} of the plan)", self.channels.timeout):
            state.work.wait()
        self.collected(index)

    def future(self, index: int) -> torch.futures.Future:
        """The future of launched op `index`'s collective; its callback calls `collected`
        (a gloo work must not be waited for inside its own future's callback)."""
        return self.ops[index].work.get_future()

    def collected(self, index: int) -> None:
        """Op `index`'s collective has completed: unpack it and let the codec write the tensors
        whose ops are all done."""
        state = self.ops[index]
        state.done = True
        self.ops_open -= 1
        if self.times_ops and not self.done_at[index]:  # its future's callback has not run, or there is none
            self.done_at[index] = time.perf_counter()
        if self.trace is not None:
            self.trace.op(index, state.channel, state.launched_at, time.perf_counter(),
                          state.buffer.numel() * state.buffer.element_size())
        with _profiled(f"gradsync::unpack {state.label}"):
            self._unpack(state)
        if self.nonfinite != "skip":  # else finish once every op is in: a skip must not commit half a step
            self._finish()

    def _unpack(self, state: _OpState) -> None:
        """The reduced buffer's flags checked and its spans landed where the codec takes them."""
        flag_count = len(state.tensors) + 1
        if state.gathered is not None:
            data = torch.stack([b[:-flag_count] for b in state.gathered])
            flags = sum(b[-flag_count:] for b in state.gathered)
        else:
            reduced = state.buffer if state.received is None else state.received
            data, flags = reduced[:-flag_count], reduced[-flag_count:]
        if state.reduced_flags_all_used is not None and torch.equal(flags, state.reduced_flags_all_used):
            used, nonfinite = state.used_by_every_rank, False  # the usual case, in one comparison
        else:
            flags = flags.tolist()
            used, nonfinite = dict(zip(state.tensors, flags)), flags[-1]
        if nonfinite:  # a rank's share summed to inf or NaN; an overflowing sum of finite values names none,
            # except in a reduce-scatter, where this rank holds its own segment alone: every rank takes the flag
            bad = state.tensors if state.received is not None else [
                name for name, _, length, position in state.slices
                if not bool(torch.isfinite(data[..., position:position + length]).all())]
            if bad:
                self._non_finite(bad)
        state.used = used
        if state.received is None:  # a reduce-scatter's elements stay in its buffer (reduced_partition)
            self._land(state, data, used)
        for name in state.tensors if not self.as_they_are else ():  # else there is nothing to decode
            self.ops_left[name] -= 1
            if self.ops_left[name] == 0 and used[name]:
                self.finishable.append(name)

    def _land(self, state: _OpState, data: torch.Tensor, used: dict[str, float]) -> None:
        """Each used tensor's reduced span where the codec takes it (or adopted as its gradient)."""
        if used is state.used_by_every_rank and _resident(state):
            return  # every gradient is its span of the buffer already
        for (name, offset, length, position), view, direct in zip(state.slices, state.views, state.direct):
            parameter = self.parameters[name]
            if not used[name]:
                if self.unused_as_zeros:
                    if parameter.grad is None:
                        parameter.grad = torch.zeros_like(parameter)
                elif name in self.zeroed_in_place:  # as the zero_grad asked
                    parameter.grad = None
                continue
            if direct is not None and parameter.is_contiguous():  # (as made, unless its layout changed since)
                if parameter.grad is not direct:
                    parameter.grad = direct
                continue
            target = self.codec.reduced_target(name, parameter, self.step)
            if state.gathered is not None:
                _span(target, offset, length).copy_(data[..., position:position + length])
            elif not _adopt_as_gradient(parameter, target, view):
                _span(target, offset, length).copy_(view)

    def _finish(self) -> None:
        """Let the codec write the gradients of the tensors whose ops are all done."""
        names, self.finishable = self.finishable, []
        started = time.perf_counter()
        with _profiled("gradsync::decode"):
            for name in names:
                if self.skip_step:
                    break
                self.codec.finish(name, self.parameters[name], self.step)
                grad = self.parameters[name].grad
                if name in self.decoded_checked and not every_element_finite(grad):
                    self._non_finite([name])
            if self.ends_step and not self.ops_open:  # every gradient of the step is decoded (or skipped)
                self.ends_step = False
                self.codec.settle(applied=not self.nonfinite_seen)
        self.decode_seconds += time.perf_counter() - started

    def _non_finite(self, bad: list[str]) -> None:
        self.nonfinite_seen = True
        if self.nonfinite == "skip":
            self.skip_step = True
        if self.nonfinite != "raise":
            return
        raise NonFiniteGradient(f"non-finite averaged gradient in parameter(s) {sorted(set(bad))}")

    def zero_gradients_in_place(self) -> set[str]:
        """Zero in place, with one pass over each op's data, the gradients that are all spans of a
        fused op's buffer (as `_land` leaves them), of ops that are done: the next backward pass
        accumulates into them, and packing them copies nothing. Returns the tensors zeroed."""
        zeroed = set()
        for state in self.ops:
            if state.done and _resident(state):
                state.fused_data.zero_()
                zeroed.update(state.tensors)
        return zeroed

    def copy_gradients_out(self) -> None:
        """Give each gradient that is a span of an op's buffer a copy of its own, as the next iteration
        of this plan packs into the buffer (zeros into the span of a tensor it does not use)."""
        for state in self.ops:
            buffer = state.buffer.untyped_storage().data_ptr()
            for parameter in state.parameters:
                grad = parameter.grad
                if grad is not None and grad.untyped_storage().data_ptr() == buffer:
                    parameter.grad = grad.clone()

    def watchable(self) -> bool:
        """Whether a backward pass that writes the gradients of an op in flight shows at the step
        (``in_flight_watch``; ``runtime.output_start``, step 3): every slice a whole gradient sent as it is
        (the buffer's span stands in for it, or holds its scaled copy), none released."""
        return not self.releases_gradients and all(None not in state.direct for state in self.ops)

    def wait_before_step(self) -> None:
        """Wait for the ops the optimizer step waits for (those that do not gate the forward)."""
        for index, state in enumerate(self.ops):
            if not state.gates_forward:
                self.wait(index)

    def wait_all(self) -> None:
        for index in range(len(self.ops)):
            self.wait(index)
        self._finish()

    def release_buffers(self) -> None:
        """Give the memory of the shared op buffers back once this step's partition is read
        (``reduced_partition``): idle until the next iteration, whose start holds it again."""
        if self.carved_from is not None:
            self.carved_from.release()

    def reduced_partition(self):
        """This rank's elements of the averaged gradients, as a plan of reduce-scatters received
        them: (tensor, start, values) for elements [start, start + len(values)) of the flattened
        gradient, of every tensor some rank used. Read once the ops are waited for, before the
        next iteration's ops launch."""
        for state in self.ops:
            for (name, start, _, _), values in zip(state.own_slices, state.own_views):
                if state.used[name]:
                    yield name, start, values

    def complete(self, name: str) -> bool:
        return all(self.ops[i].done for i in self.ops_of_tensor[name])

    def pending_ops(self, names) -> list[int]:
        return sorted({i for n in names for i in self.ops_of_tensor[n] if not self.ops[i].done})

    def wire_bytes(self) -> int:
        return self.buffer_bytes


def _resident(state: _OpState) -> bool:
    """Whether the op is fused and every gradient is its span of the buffer (as `_land` and
    ``zero_gradients_in_place`` leave them): a backward pass accumulates into the buffer."""
    return state.fused_data is not None and _in_their_spans(state)


def _in_their_spans(state: _OpState, grads=None) -> bool:
    """Whether every gradient of a fused op (`grads`, in slice order, where the caller has read them
    already) is its span of the op's buffer (``zero_gradients_in_place``)."""
    if grads is None:
        grads = (parameter.grad for parameter in state.parameters)
    return all(map(operator.is_, grads, state.direct))


def _carries_gradients_as_they_are(codec: Codec) -> bool:
    """Whether `codec` sends each gradient as it is and lands the average in it, with nothing to
    decode: the identity's encode, reduced_target and finish, over an all-reduce."""
    steps = ("encode", "reduced_target", "finish")
    return codec.collective == "allreduce" and all(getattr(type(codec), step) is getattr(Codec, step) for step in steps)


def _profiled(name: str):
    """``record_function(name)``, a range in torch.profiler's trace, while a profiler records; else
    no scope at all (one costs about 6 µs of the iterating thread, several per op)."""
    return record_function(name) if torch.autograd._profiler_enabled() else nullcontext()


def _span(tensor: torch.Tensor, offset: int, length: int) -> torch.Tensor:
    """``tensor[..., offset:offset + length]``, or `tensor` itself where that is all of it (most
    slices carry a whole tensor: one dispatch less each, as for the buffer's precomputed views)."""
    return tensor if offset == 0 and length == tensor.shape[-1] else tensor[..., offset:offset + length]


def _adopt_as_gradient(parameter: torch.nn.Parameter, target: torch.Tensor, reduced: torch.Tensor) -> bool:
    """Make the reduced span the parameter's gradient, instead of copying it there, where `target`
    (the codec's landing place) is that whole gradient: as torch DDP's ``gradient_as_bucket_view``,
    the gradient then lives in the op's buffer until the next backward pass replaces it (or, with
    ``zero_grad(set_to_none=False)``, accumulates into it). Returns whether it did."""
    grad = parameter.grad
    if (grad is None or target.data_ptr() != grad.data_ptr() or reduced.numel() != grad.numel()
            or reduced.dtype != grad.dtype or not parameter.is_contiguous()):
        return False
    parameter.grad = reduced.view_as(parameter)
    return True


def check_nonfinite_mode(mode: str) -> str:
    modes = ("raise", "skip", "ignore")
    if mode not in modes:
        raise ConfigError(f"'nonfinite' must be one of {modes}, got {mode!r}")
    return mode
