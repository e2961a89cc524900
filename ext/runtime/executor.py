"""Executes one Plan per iteration: fusion buffers, launch in plan order per channel, unpack.

Each op owns a flat buffer holding its slices followed by one "used" flag per tensor it carries.
A rank whose backward never produced a tensor's gradient contributes zeros and flag 0; after the
sum all-reduce a flag of 0 means no rank used the tensor, and its gradient is left untouched, as
torch DDP does with ``find_unused_parameters``. The engine never looks at which planner made the
plan: phase, channel and order are all it needs.
"""
from __future__ import annotations

import time
from dataclasses import dataclass, field

import torch

from ..errors import ConfigError
from ..plan import BACKWARD, Plan, ops_by_channel
from .channels import Channels

SUPPORTED_TRANSPORTS = ("allreduce",)
SUPPORTED_CODECS = ("identity",)


@dataclass
class _OpState:
    slices: list[tuple[str, int, int, int]]  # (tensor, offset, length, position in buffer)
    tensors: list[str]  # tensors carried, in flag order
    phase: str
    channel: int
    buffer: torch.Tensor
    waiting_for: set[str] = field(default_factory=set)
    work: object = None
    launched_at: float = 0.0
    done: bool = False


class NonFiniteGradient(FloatingPointError):
    """A reduced gradient holds inf or NaN; raised on every rank alike (the sum is the same)."""


class PlanExecutor:
    """Runs `plan` over `parameters` (name -> Parameter) on `channels`, averaging by world size."""

    def __init__(self, plan: Plan, parameters: dict, channels: Channels, nonfinite: str = "raise", trace=None):
        if plan.channels > len(channels):
            raise ConfigError(f"plan uses {plan.channels} channels but only {len(channels)} were created "
                              "(raise 'channels')")
        self.plan = plan
        self.parameters = parameters
        self.channels = channels
        self.nonfinite = nonfinite
        self.trace = trace
        self.ops = [self._op_state(op) for op in plan.ops]
        self.ops_of_tensor: dict[str, list[int]] = {}
        for index, state in enumerate(self.ops):
            for name in state.tensors:
                self.ops_of_tensor.setdefault(name, []).append(index)
        self.order = ops_by_channel(plan.ops)
        self.cursor = {channel: 0 for channel in self.order}
        self.ready: set[str] = set()
        self.backward_over = False
        self.skip_step = False

    def _op_state(self, op) -> _OpState:
        tensors = op.tensors()
        if op.transport not in SUPPORTED_TRANSPORTS or op.codec not in SUPPORTED_CODECS:
            raise ConfigError(f"the runtime executes transports {SUPPORTED_TRANSPORTS} and codecs "
                              f"{SUPPORTED_CODECS}; an op asks for transport {op.transport!r}, codec {op.codec!r}")
        dtypes = {self.parameters[name].dtype for name in tensors}
        if len(dtypes) > 1:
            raise ConfigError(f"an op mixes gradient dtypes {sorted(map(str, dtypes))} ({tensors[:4]}): "
                              "they cannot share a fusion buffer")
        numel = op.numel()
        dtype = dtypes.pop()
        device = self.parameters[tensors[0]].device
        slices, position = [], 0
        for s in op.slices:
            slices.append((s.tensor, s.offset, s.length, position))
            position += s.length
        buffer = torch.zeros(numel + len(tensors), dtype=dtype, device=device)
        return _OpState(slices, tensors, op.phase, op.channel, buffer)

    # -- one iteration ---------------------------------------------------------------------------
    def start_iteration(self) -> None:
        for state in self.ops:
            state.waiting_for = set(state.tensors)
            state.work, state.done = None, False
        self.cursor = {channel: 0 for channel in self.order}
        self.ready = set()
        self.backward_over = False
        self.skip_step = False

    def mark_ready(self, name: str) -> None:
        """Called from the gradient hook of parameter `name`."""
        self.ready.add(name)
        for index in self.ops_of_tensor[name]:
            self.ops[index].waiting_for.discard(name)
        self._launch_ready()

    def end_backward(self) -> None:
        """The backward pass is over: unused tensors count as ready; forward-phase ops launch."""
        self.backward_over = True
        for state in self.ops:
            state.waiting_for.clear()
        self._launch_ready()

    def _launch_ready(self) -> None:
        for channel, indices in self.order.items():
            while self.cursor[channel] < len(indices):
                state = self.ops[indices[self.cursor[channel]]]
                if state.waiting_for or (state.phase != BACKWARD and not self.backward_over):
                    break
                self._launch(state)
                self.cursor[channel] += 1

    def _launch(self, state: _OpState) -> None:
        buffer = state.buffer
        for name, offset, length, position in state.slices:
            grad = self.parameters[name].grad
            target = buffer[position:position + length]
            if name in self.ready and grad is not None:
                target.copy_(grad.reshape(-1)[offset:offset + length])
            else:
                target.zero_()
        flags = buffer[buffer.numel() - len(state.tensors):]
        for index, name in enumerate(state.tensors):
            flags[index] = 1.0 if name in self.ready and self.parameters[name].grad is not None else 0.0
        buffer[: buffer.numel() - len(state.tensors)].div_(self.channels.world_size)
        state.launched_at = time.perf_counter()
        state.work = self.channels.all_reduce(state.channel, buffer)

    # -- completion --------------------------------------------------------------------------------
    def wait(self, index: int) -> None:
        """Wait for op `index` and write its averaged slices into the gradients."""
        state = self.ops[index]
        if state.done:
            return
        if state.work is None:
            raise RuntimeError(f"op {index} was never launched: the backward pass has not ended")
        state.work.wait()
        state.done = True
        if self.trace is not None:
            self.trace.op(index, state.channel, state.launched_at, time.perf_counter(), state.buffer.numel())
        data_end = state.buffer.numel() - len(state.tensors)
        used = dict(zip(state.tensors, state.buffer[data_end:].tolist()))
        data = state.buffer[:data_end]
        if self.nonfinite != "ignore" and not bool(torch.isfinite(data).all()):
            self._non_finite(state, data)
        for name, offset, length, position in state.slices:
            if used[name] == 0:
                continue
            parameter = self.parameters[name]
            if parameter.grad is None:
                parameter.grad = torch.zeros_like(parameter)
            parameter.grad.view(-1)[offset:offset + length].copy_(data[position:position + length])

    def _non_finite(self, state: _OpState, data: torch.Tensor) -> None:
        bad = [name for name, _, length, position in state.slices
               if not bool(torch.isfinite(data[position:position + length]).all())]
        if self.nonfinite == "skip":
            self.skip_step = True
            return
        raise NonFiniteGradient(f"non-finite averaged gradient in parameter(s) {sorted(set(bad))}")

    def wait_phase(self, phase: str) -> None:
        for index, state in enumerate(self.ops):
            if state.phase == phase:
                self.wait(index)

    def wait_all(self) -> None:
        for index in range(len(self.ops)):
            self.wait(index)

    def complete(self, name: str) -> bool:
        return all(self.ops[i].done for i in self.ops_of_tensor[name])

    def pending_ops(self, names) -> list[int]:
        return sorted({i for n in names for i in self.ops_of_tensor[n] if not self.ops[i].done})

    def buffer_bytes(self) -> int:
        return sum(state.buffer.numel() * state.buffer.element_size() for state in self.ops)


def check_nonfinite_mode(mode: str) -> str:
    modes = ("raise", "skip", "ignore")
    if mode not in modes:
        raise ConfigError(f"'nonfinite' must be one of {modes}, got {mode!r}")
    return mode

