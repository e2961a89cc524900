"""Channels: one process group each, so collectives on different channels run simultaneously.

NCCL serialises the operations of one communicator and gloo starts those of one process group in
call order, one per worker thread (two by default); more concurrency needs more groups. Every rank
issues the ops of a channel in the same (plan) order, which keeps several NCCL communicators
deadlock-free.

Transport: the backend's all-reduce, or (given a topology) the forest packing's trees, executed
by one `ForestAllReduce` per channel on that channel's group and thread.
"""
from __future__ import annotations

from datetime import timedelta

import torch
import torch.distributed as dist

from ..agreement import waiting_for
from ..errors import ConfigError
from ..topology import Topology
from ..topology.allreduce import ForestAllReduce


def control_group(process_group, timeout: timedelta):
    """A process group over the ranks of `process_group` (None: all) with `timeout`, for gradsync's
    own collectives (settings check, broadcasts, statistics): a rank that never comes fails its
    peers within `timeout`, whatever the caller's group allows."""
    ranks = dist.get_process_group_ranks(process_group or dist.group.WORLD)
    with waiting_for("the start of gradsync.wrap (its process group)", timeout.total_seconds()):
        return dist.new_group(ranks, timeout=timeout)


class Channels:
    """`count` process groups over the ranks of `process_group`; with `forest` (the topology of
    those ranks, rank i = worker i) ops travel over its forest packing instead of the backend's
    all-reduce. `process_group` also carries gradsync's own collectives; with `owns_group` (a
    `control_group`) `destroy` releases it too. Without `new_groups` the one channel is
    `process_group` itself."""

    def __init__(self, count: int, process_group=None, timeout: timedelta | None = None,
                 forest: Topology | None = None, owns_group: bool = False, new_groups: bool = True):
        if isinstance(count, bool) or not isinstance(count, int) or count < 1:
            raise ConfigError(f"'channels' must be an integer >= 1, got {count!r}")
        if not dist.is_available() or not dist.is_initialized():
            raise ConfigError("torch.distributed is not initialised: call init_process_group first")
        self.process_group = process_group
        self.owns_group = owns_group
        self.timeout = (timeout or dist.default_pg_timeout).total_seconds()  # seconds, for messages
        ranks = dist.get_process_group_ranks(process_group or dist.group.WORLD)
        self.world_size = len(ranks)
        self.rank = dist.get_rank(process_group)
        self.new_groups = new_groups
        self.groups = ([dist.new_group(ranks, timeout=timeout) for _ in range(count)] if new_groups
                       else [process_group or dist.group.WORLD])
        self.summing = dist.AllreduceOptions()  # a sum, started asynchronously (`all_reduce`)
        self.summing.reduceOp, self.summing.asyncOp = dist.ReduceOp.SUM, True
        self.forests: list[ForestAllReduce] = []
        if forest is not None:
            first = ForestAllReduce(forest, process_group=self.groups[0])
            self.forests = [first] + [ForestAllReduce(forest, process_group=group, packing=first.packing)
                                      for group in self.groups[1:]]

    @classmethod
    def existing(cls, process_group=None) -> "Channels":
        """One channel that is `process_group` itself (None: the default group): for code called
        inside another library's communication (a DDP comm hook), where ranks cannot make groups."""
        return cls(1, process_group, new_groups=False)

    @property
    def transport(self) -> str:
        """What carries every op: "forest" or the backend's "allreduce"."""
        return "forest" if self.forests else "allreduce"

    @property
    def ops_per_channel(self) -> int:
        """How many ops one channel runs at once: a gloo group's worker threads, else one (an NCCL
        communicator, or the forest's one thread per channel)."""
        if self.forests or dist.get_backend(self.groups[0]) != dist.Backend.GLOO:
            return 1
        return self.groups[0]._get_backend(torch.device("cpu")).options._threads

    @property
    def timed_on_device(self) -> bool:
        """Whether an op's completion is known on the device alone (NCCL, whose works complete on
        the host at launch): its duration then comes from the backend (``Work._get_duration``)."""
        return not self.forests and dist.get_backend(self.groups[0]) == dist.Backend.NCCL

    def __len__(self) -> int:
        return len(self.groups)

    def all_reduce(self, channel: int, tensor):
        """Start a sum all-reduce of `tensor` on `channel`; returns the work handle. The group's own
        call: torch.distributed.all_reduce's checks (a rank outside the group, a complex or
        overloaded tensor, a coalescing context) hold by construction for an op's buffer, and cost
        about 30 µs of the computing thread an op."""
        if self.forests:
            return self.forests[channel].all_reduce(tensor, async_op=True)
        return self.groups[channel].allreduce([tensor], self.summing)

    def reduce_scatter(self, channel: int, inputs):
        """Start a sum reduce-scatter on `channel`, in place: this rank's own part of `inputs`
        becomes the sum over ranks of theirs (the other parts are left undefined); returns the
        work handle. The backends read the inputs before writing the output (gloo copies them into
        one flat buffer first; NCCL's reduce may run in place), so the output is the own part
        itself and needs no buffer of its own.

        Args:
            channel: the channel's index.
            inputs: one tensor per rank (sizes may differ between ranks' parts, alike on every rank).
        """
        if self.forests:
            raise ConfigError("the forest transport runs all-reduces only, not reduce-scatters")
        group = self.groups[channel]
        return dist.reduce_scatter(inputs[dist.get_rank(group)], inputs, group=group, async_op=True)

    def destroy(self) -> None:
        for forest in self.forests:
            forest.close()
        self.forests = []
        for group in self.groups if self.new_groups else ():
            dist.destroy_process_group(group)
        self.groups = []
        if self.owns_group:
            dist.destroy_process_group(self.process_group)
            self.owns_group = False
