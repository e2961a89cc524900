"""ByteScheduler: fixed-size partitions, input-side-first priority and credit-based sending
(the baseline of us-byte §2.2–2.3, Fig. 2c and Fig. 3b).

Every layer's gradient is cut into basic blocks of S_p bytes; a block's priority is its layer index
(input side first), then its position in the layer. ByteScheduler decides at run time: whenever one
of its `credit` slots is free, it sends the most urgent block that backward has produced. That
decision process is emulated here on the simulator's model of an op (start-up ``a``, then
``b·bytes`` of transmission slowed by s(k) while k ops transmit) and its launch order is written as
a plan: each slot is a channel; blocks launched before the backward pass ends are backward-phase
ops, the others forward-phase ops that gate only their own layer's next forward (us-byte eq. 11).
"""
from __future__ import annotations

import heapq
from dataclasses import dataclass

from ..cost import CostModel
from ..plan import BACKWARD, FORWARD, Op, Plan
from ..profile import ModelProfile
from ..simulate import InFlight
from ..registry import Option, positive_int
from . import OVERLAP_FORWARD, PlannerSpec
from .options import PARTITION_BYTES, deferred_if
from .partition import GradientGroup, gradient_groups

# Partitions in flight, as credit size 2 in us-byte Fig. 3b and §6.7 (ByteScheduler's own credit
# counts bytes in flight; with equal partitions that is the same bound).
DEFAULT_CREDIT = 2


@dataclass(frozen=True)
class Block:
    """A basic block of a gradient group; `rank` is its priority (0 is the most urgent)."""

    group: GradientGroup
    index: int
    rank: int

    @property
    def nbytes(self) -> int:
        return min(self.group.block_bytes, self.group.nbytes - self.index * self.group.block_bytes)


@dataclass(frozen=True)
class Launch:
    """When the emulation sends a block, and on which slot (channel)."""

    block: Block
    slot: int
    start: float


def plan(profile: ModelProfile, cost: CostModel, *, partition_bytes: int, credit: int, overlap_forward: bool) -> Plan:
    """ByteScheduler's launch order as a plan: one op per basic block, channel = credit slot.

    Args:
        profile: the model's per-layer times and tensors (ModelProfile).
        cost: the all-reduce cost model the emulation times the blocks with.
        partition_bytes: S_p, the size of a basic block (bytes; rounded down to whole elements, at least one).
        credit: how many blocks may be in flight at once, one slot (channel) each.
        overlap_forward: defer the step's waits to each layer's next forward (us-byte Fig. 1).
    """
    backward_end = profile.backward_time
    ops = tuple(
        Op(
            launch.block.group.slices(launch.block.index, 1),
            BACKWARD if launch.start < backward_end else FORWARD,
            channel=launch.slot,
            priority=launch.block.rank,
        )
        for launch in emulate(profile, cost, partition_bytes, credit)
    )
    blocks = Plan(ops, options={"partition_bytes": partition_bytes, "credit": credit})
    return deferred_if(blocks, overlap_forward)


def blocks_by_priority(profile: ModelProfile, partition_bytes: int) -> list[Block]:
    """Every basic block, most urgent first: layer index (input side first), then position."""
    blocks = []
    for group in gradient_groups(profile, partition_bytes):
        blocks += [Block(group, index, len(blocks) + index) for index in range(group.num_blocks)]
    return blocks


def emulate(profile: ModelProfile, cost: CostModel, partition_bytes: int, credit: int) -> list[Launch]:
    """Credit-based priority sending, event by event; returns the launches in time order.

    A block becomes ready when its layer's backward ends (us-byte eq. 2). Whenever a slot is free,
    the most urgent ready block starts on the lowest free slot; ops progress as in the simulator.

    Args:
        profile: the model's per-layer times and tensors: the blocks and their ready times.
        cost: the all-reduce cost model: start-up ``a``, ``b`` per byte and contention γ (its host
            time, slowdowns and ops per channel are not emulated).
        partition_bytes, credit: as in ``plan``.
    """
    by_priority = blocks_by_priority(profile, partition_bytes)
    waiting = sorted(by_priority, key=lambda b: (b.group.ready, b.rank), reverse=True)  # pop(): next ready
    ready: list[tuple[int, Block]] = []  # heap of (rank, block)
    slots: list[int | None] = [None] * credit  # launch index per busy slot
    launches: list[Launch] = []
    in_flight = InFlight(cost)
    clock = 0.0
    while waiting or ready:
        while waiting and waiting[-1].group.ready <= clock:
            block = waiting.pop()
            heapq.heappush(ready, (block.rank, block))
        for slot, busy in enumerate(slots):
            if busy is None and ready:
                slots[slot] = len(launches)
                block = heapq.heappop(ready)[1]
                in_flight.start(len(launches), block.nbytes)
                launches.append(Launch(block, slot, clock))
        upcoming = [waiting[-1].group.ready] if waiting and None in slots else []
        step = min([in_flight.next_event(clock), *upcoming]) - clock
        for index in in_flight.advance(clock, step):
            slots[launches[index].slot] = None
        clock += step
    return launches


SPEC = PlannerSpec(
    "bytescheduler", plan, "ByteScheduler: fixed-size partitions sent input side first, credit-bounded",
    options=(PARTITION_BYTES, Option("credit", DEFAULT_CREDIT, positive_int, "partitions in flight (one channel each)"),
             OVERLAP_FORWARD),
    source="ByteScheduler")
