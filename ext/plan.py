"""Plan: the communication ops of one iteration, as data.

Every rank executes the same plan; ``Plan.hash`` lets them check that. Ops on one channel run in
plan order; ops on different channels may run simultaneously.
"""
from __future__ import annotations

import hashlib
import json
from dataclasses import dataclass, field, replace
from typing import Any, Iterable

from .errors import ConfigError
from .profile import ModelProfile

BACKWARD = "backward"
FORWARD = "forward"
PHASES = (BACKWARD, FORWARD)
TRANSPORTS = ("allreduce", "forest")
ALLREDUCE = "allreduce"
REDUCE_SCATTER = "reduce_scatter"
COLLECTIVES = (ALLREDUCE, REDUCE_SCATTER)


@dataclass(frozen=True)
class Slice:
    """Elements [offset, offset + length) of the flattened gradient of `tensor`."""

    tensor: str
    offset: int
    length: int


@dataclass(frozen=True)
class Op:
    """One collective.

    phase: ``backward`` ops launch as soon as their slices are ready and must finish before the
    optimizer step; ``forward`` ops launch after the backward pass and gate the next forward,
    layer by layer (us-byte eqs. 9–11).
    channel: ops on one channel run one after another in plan order.
    priority: the planner's priority (lower is more urgent); informative, plan order rules.
    deferred: a backward op that gates the next forward layer by layer, as forward ops do, instead
    of the optimizer step (us-byte Fig. 1: F_l depends on F_(l−1) and AR_l alone).
    collective: ``allreduce`` (every rank receives the averaged slices) or ``reduce_scatter``
    (each rank receives its own partition of them, as ZeRO's sharded optimizers need).
    """

    slices: tuple[Slice, ...]
    phase: str = BACKWARD
    channel: int = 0
    priority: int = 0
    codec: str = "identity"
    transport: str = "allreduce"
    deferred: bool = False
    collective: str = ALLREDUCE

    @property
    def gates_forward(self) -> bool:
        """Whether the op is waited for at the next forward of its layers (else before the step)."""
        return self.phase == FORWARD or self.deferred

    def numel(self) -> int:
        return sum(s.length for s in self.slices)

    def tensors(self) -> list[str]:
        return list(dict.fromkeys(s.tensor for s in self.slices))


def whole(tensor) -> Slice:
    """The slice covering a whole TensorSpec."""
    return Slice(tensor.name, 0, tensor.numel)


@dataclass(frozen=True)
class Plan:
    """Ordered ops plus the planner's name and options (for the record; the runtime ignores them)."""

    ops: tuple[Op, ...]
    planner: str = "custom"
    options: dict[str, Any] = field(default_factory=dict, compare=False)

    @property
    def channels(self) -> int:
        return 1 + max((op.channel for op in self.ops), default=0)

    def with_transport(self, transport: str) -> "Plan":
        """The same plan with every op carried by `transport` (a runtime choice, not a planner's)."""
        return replace(self, ops=tuple(replace(op, transport=transport) for op in self.ops))

    def with_collective(self, collective: str) -> "Plan":
        """The same plan with every op a `collective` (planned with that collective's cost:
        ``CostModel.for_collective``)."""
        return replace(self, ops=tuple(replace(op, collective=collective) for op in self.ops))

    def with_deferred_waits(self) -> "Plan":
        """The same plan with every backward op deferred: the next forward waits for each layer's
        ops, the step for none (``overlap_forward`` in the options)."""
        return replace(self, ops=tuple(replace(op, deferred=op.phase == BACKWARD) for op in self.ops),
                       options={**self.options, "overlap_forward": True})

    def tensors_launching_early(self) -> set[str]:
        """The tensors whose gradients may let an op launch before the backward pass ends. A
        forward-phase op launches once the pass is over; on a single channel the plan's last
        backward-phase op launches after every op before it, so no earlier than the one holding the
        pass's last gradient: at its end. Only the other backward-phase ops' tensors need to say
        when their gradients are final (every backward-phase op's, where several channels run)."""
        backward = [op for op in self.ops if op.phase == BACKWARD]
        early = backward[:-1] if self.channels == 1 else backward
        return {name for op in early for name in op.tensors()}

    def op_bytes(self, op: Op, profile: ModelProfile) -> int:
        tensors = profile.tensor_map()
        return sum(s.length * tensors[s.tensor].bytes_per_element for s in op.slices)

    # -- serialisation ------------------------------------------------------------------------
    def to_dict(self) -> dict[str, Any]:
        return {
            "planner": self.planner,
            "options": self.options,
            "ops": [
                {
                    "slices": [[s.tensor, s.offset, s.length] for s in op.slices],
                    "phase": op.phase,
                    "channel": op.channel,
                    "priority": op.priority,
                    "codec": op.codec,
                    "transport": op.transport,
                    **({"deferred": True} if op.deferred else {}),
                    **({"collective": op.collective} if op.collective != ALLREDUCE else {}),
                }
                for op in self.ops
            ],
        }

    def to_json(self, indent: int | None = None) -> str:
        return json.dumps(self.to_dict(), indent=indent, sort_keys=True)

    @classmethod
    def from_dict(cls, data: Any) -> "Plan":
        if not isinstance(data, dict) or not isinstance(data.get("ops"), list):
            raise ConfigError("plan JSON: needs an 'ops' list")
        ops = []
        for index, entry in enumerate(data["ops"]):
            try:
                op = Op(
                    tuple(Slice(t, o, n) for t, o, n in entry["slices"]),
                    entry.get("phase", BACKWARD),
                    entry.get("channel", 0),
                    entry.get("priority", 0),
                    entry.get("codec", "identity"),
                    entry.get("transport", "allreduce"),
                    _flag(entry.get("deferred", False), "deferred"),
                    entry.get("collective", ALLREDUCE),
                )
            except (KeyError, TypeError, ValueError) as exc:
                raise ConfigError(f"plan JSON: ops[{index}] is malformed: {exc}") from exc
            problem = _type_problem(op)
            if problem:
                raise ConfigError(f"plan JSON: ops[{index}] is malformed: {problem}")
            ops.append(op)
        return cls(tuple(ops), str(data.get("planner", "custom")), dict(data.get("options") or {}))

    @classmethod
    def from_json(cls, text: str) -> "Plan":
        try:
            return cls.from_dict(json.loads(text))
        except json.JSONDecodeError as exc:
            raise ConfigError(f"plan JSON is malformed: {exc}") from exc

    @property
    def hash(self) -> str:
        """SHA-256 of the ops alone: equal on every rank that executes the same communication."""
        ops_only = json.dumps(self.to_dict()["ops"], sort_keys=True, separators=(",", ":"))
        return hashlib.sha256(ops_only.encode()).hexdigest()

    # -- validation ---------------------------------------------------------------------------
    def validate(self, profile: ModelProfile) -> "Plan":
        """Check the plan against the profile; return it unchanged, or raise ConfigError.

        - every gradient element is covered by exactly one slice, and slices lie in their tensor;
        - an op carries one element size (fp32/fp16/bf16 gradients never share a buffer);
        - offsets, lengths, channels and priorities are integers, codecs strings;
        - phases, transports, collectives and channels are valid, channels numbered 0..C-1 with
          none unused, and forest ops all-reduces (its trees reduce and broadcast);
        - on each channel, no backward op follows a forward op: forward ops only launch once the
          backward pass is over, so a backward op queued behind one could not start when its
          slices are ready.
        """
        tensors = profile.tensor_map()
        covered: dict[str, list[tuple[int, int]]] = {name: [] for name in tensors}
        for index, op in enumerate(self.ops):
            where = f"plan op {index}"
            if not op.slices:
                raise ConfigError(f"{where}: has no slices")
            if op.phase not in PHASES:
                raise ConfigError(f"{where}: 'phase' must be one of {PHASES}, got {op.phase!r}")
            if op.transport not in TRANSPORTS:
                raise ConfigError(f"{where}: 'transport' must be one of {TRANSPORTS}, got {op.transport!r}")
            if op.collective not in COLLECTIVES:
                raise ConfigError(f"{where}: 'collective' must be one of {COLLECTIVES}, got {op.collective!r}")
            if op.collective != ALLREDUCE and op.transport != "allreduce":
                raise ConfigError(f"{where}: a {op.collective} runs on transport 'allreduce' only (the forest's "
                                  "trees all-reduce)")
            if op.deferred and op.phase != BACKWARD:
                raise ConfigError(f"{where}: only backward ops can be 'deferred' (forward ops always gate the forward)")
            problem = _type_problem(op)
            if problem:
                raise ConfigError(f"{where}: {problem}")
            if op.channel < 0:
                raise ConfigError(f"{where}: 'channel' must be >= 0, got {op.channel}")
            sizes = set()
            for s in op.slices:
                if s.tensor not in tensors:
                    raise ConfigError(f"{where}: unknown tensor {s.tensor!r}")
                spec = tensors[s.tensor]
                if s.offset < 0 or s.length <= 0 or s.offset + s.length > spec.numel:
                    raise ConfigError(
                        f"{where}: slice ({s.tensor!r}, offset {s.offset}, length {s.length}) "
                        f"lies outside the tensor's {spec.numel} elements"
                    )
                covered[s.tensor].append((s.offset, s.offset + s.length))
                sizes.add(spec.bytes_per_element)
            if len(sizes) > 1:
                raise ConfigError(f"{where}: mixes element sizes {sorted(sizes)} in one buffer")
        for name, spans in covered.items():
            position = 0
            for start, end in sorted(spans):
                if start != position:
                    problem = "covered twice" if start < position else "not covered"
                    raise ConfigError(f"plan: elements of tensor {name!r} from {min(start, position)} are {problem}")
                position = end
            if position != tensors[name].numel:
                raise ConfigError(f"plan: elements of tensor {name!r} from {position} are not covered")
        used = sorted({op.channel for op in self.ops})
        if used != list(range(len(used))):
            raise ConfigError(f"plan: channels must be numbered 0..C-1 with none unused, got {used}")
        seen_forward: set[int] = set()
        for index, op in enumerate(self.ops):
            if op.phase == FORWARD:
                seen_forward.add(op.channel)
            elif op.channel in seen_forward:
                raise ConfigError(f"plan op {index}: a backward op follows a forward op on channel {op.channel}")
        return self


def _flag(value: Any, name: str) -> bool:
    if not isinstance(value, bool):
        raise TypeError(f"{name!r} must be true or false, got {value!r}")
    return value


def _is_integer(value: Any) -> bool:
    """A real integer: not a bool, a float or a string that would convert to one (and lose data)."""
    return isinstance(value, int) and not isinstance(value, bool)


def _type_problem(op: Op) -> str | None:
    """The first field of `op` of the wrong type: integers where the runtime indexes and counts
    (never converted, so 10.7 elements is an error rather than 10), strings for names."""
    fields = [(f"slices[{i}].{name}", getattr(s, name)) for i, s in enumerate(op.slices) for name in ("offset", "length")]
    for name, value in [*fields, ("channel", op.channel), ("priority", op.priority)]:
        if not _is_integer(value):
            return f"{name!r} must be an integer, got {value!r}"
    strings = [(f"slices[{i}].tensor", s.tensor) for i, s in enumerate(op.slices)] + [("codec", op.codec),
                                                                                       ("collective", op.collective)]
    for name, value in strings:
        if not isinstance(value, str):
            return f"{name!r} must be a string, got {value!r}"
    return None


def ops_by_channel(ops: Iterable[Op]) -> dict[int, list[int]]:
    """Op indices per channel, in plan order."""
    channels: dict[int, list[int]] = {}
    for index, op in enumerate(ops):
        channels.setdefault(op.channel, []).append(index)
    return channels
