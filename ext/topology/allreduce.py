"""Executing a forest packing: an all-reduce made of point-to-point transfers along its trees.

Rank i of the process group is worker i of the topology. The buffer is cut as `ForestPacking.
chunk_sizes` says; each tree's chunk is cut into sub-chunks of about `sub_chunk_bytes` and moves
through the tree one sub-chunk after the other (Property 2's pipelining). Relay nodes that are not
ranks (switches) cannot add or copy, so every tree is contracted onto the ranks: a rank sends to
its nearest rank ancestor. Inactive ranks relay (they add their children's partial sums, or
forward what they receive) but neither contribute nor receive the result: their tensors stay as
they are.

Order. Every step (one rank, one tree, one sub-chunk) gets a key that exceeds the keys of the steps
it waits for: a reduce step of sub-chunk j at a node of height h gets j + h; a broadcast step gets
the key at which its range is fully reduced at the root, plus 1, plus the node's depth. Every rank
runs its steps in the order of these keys, so a wait is always on a step placed earlier on another
rank, and the schedule cannot deadlock; a sub-chunk's broadcast starts as soon as the root has
reduced it (Sec. V overlaps the stages this way). Receives are posted before the first step, every
message has its own tag, and every send is waited before `all_reduce` returns.
"""
from __future__ import annotations

import itertools
import math
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass

import torch
import torch.distributed as dist

from ..agreement import check_same_on_all_ranks, share_from_first
from ..errors import ConfigError
from .forest import REDUCE, ForestPacking, Tree
from .model import Topology
from .packing import plan_forest

DEFAULT_SUB_CHUNK_BYTES = 4 << 20


@dataclass(frozen=True)
class Step:
    """What `rank` does for elements [start, stop) of one tree: receive from `receive` (peer, tag)
    pairs, then (reduce) add them to its own part and send up, or (broadcast) send on to `send`.
    `holds`: the rank is active, so its tensor takes part (adds its values; receives the result)."""

    kind: str
    rank: int
    start: int
    stop: int
    receive: tuple[tuple[int, int], ...]
    send: tuple[tuple[int, int], ...]
    holds: bool
    key: tuple


@dataclass(frozen=True)
class _RankTree:
    """A tree contracted onto the ranks that take part in it."""

    root: int
    children: dict[int, tuple[int, ...]]

    def parent_of(self) -> dict[int, int]:
        return {child: node for node, kids in self.children.items() for child in kids}

    def height(self, node: int) -> int:
        kids = self.children[node]
        return 1 + max(self.height(kid) for kid in kids) if kids else 0

    def depths(self) -> dict[int, int]:
        depth, frontier = {self.root: 0}, [self.root]
        while frontier:
            node = frontier.pop()
            for kid in self.children[node]:
                depth[kid] = depth[node] + 1
                frontier.append(kid)
        return depth


def contract(tree: Tree, rank_of: dict[str, int], active: set[int]) -> _RankTree:
    """`tree` on ranks only: each rank hangs under its nearest rank ancestor; ranks with no active
    node at or below them are dropped (they would carry nothing).

    Args:
        tree: a reduce or broadcast tree over the topology's nodes (workers and relays).
        rank_of: the rank of each worker, by name; relays have none.
        active: the ranks of the active workers.
    """
    def rank_above(node: str) -> str:
        node = tree.parent[node]
        while node not in rank_of:
            node = tree.parent[node]
        return node

    children: dict[int, list[int]] = {rank_of[tree.root]: []}
    for node in tree.parent:
        if node in rank_of:
            children.setdefault(rank_of[node], [])
            children.setdefault(rank_of[rank_above(node)], []).append(rank_of[node])

    def useful(node: int) -> bool:
        kept = [kid for kid in children[node] if useful(kid)]
        children[node] = kept
        return node in active or bool(kept)

    useful(rank_of[tree.root])
    reachable, frontier = {}, [rank_of[tree.root]]
    while frontier:
        node = frontier.pop()
        reachable[node] = tuple(sorted(children[node]))
        frontier.extend(children[node])
    return _RankTree(rank_of[tree.root], reachable)


def build_schedule(packing: ForestPacking, workers: tuple[str, ...], numel: int, element_size: int,
                   sub_chunk_bytes: int = DEFAULT_SUB_CHUNK_BYTES) -> list[Step]:
    """Every rank's steps for one all-reduce of `numel` elements, in the global order (see module).

    Args:
        packing: the forest packing to execute.
        workers: the topology's workers; worker i is rank i.
        numel: the number of elements of the flat buffer.
        element_size: bytes per element.
        sub_chunk_bytes: the approximate size (bytes) of the pieces each tree's chunk is pipelined in.
    """
    rank_of = {name: rank for rank, name in enumerate(workers)}
    active = {rank_of[name] for name in packing.active}
    sizes = packing.chunk_sizes(numel)
    starts = _tree_starts(packing, sizes)
    steps: list[Step] = []
    reduced_at: dict[int, list[tuple[int, int, int]]] = {}  # root -> (start, stop, key) of reduced sub-chunks
    tags = itertools.count()  # one tag per message of the call
    ordered = sorted(range(len(packing.trees)), key=lambda i: packing.trees[i].kind != REDUCE)
    for index in ordered:
        tree, size = packing.trees[index], sizes[index]
        if size == 0:
            continue
        ranks = contract(tree, rank_of, active)
        bounds = _sub_chunks(starts[index], size, element_size, sub_chunk_bytes)
        if tree.kind == REDUCE:
            steps += _reduce_steps(ranks, index, bounds, active, tags, reduced_at.setdefault(ranks.root, []))
        else:
            steps += _broadcast_steps(ranks, index, bounds, active, tags, reduced_at[ranks.root])
    return sorted(steps, key=lambda step: step.key)


def _tree_starts(packing: ForestPacking, sizes: list[int]) -> list[int]:
    """Where each tree's chunk begins: roots' ranges C_v follow one another; inside C_v, reduce trees
    tile it in order, and so do broadcast trees (forest.py's layout)."""
    starts, root_start = [0] * len(sizes), 0
    for root in packing.root_weights():
        members = [i for i, t in enumerate(packing.trees) if t.root == root]
        reduce_cursor = broadcast_cursor = root_start
        for i in members:
            if packing.trees[i].kind == REDUCE:
                starts[i], reduce_cursor = reduce_cursor, reduce_cursor + sizes[i]
            else:
                starts[i], broadcast_cursor = broadcast_cursor, broadcast_cursor + sizes[i]
        root_start = reduce_cursor
    return starts


def _sub_chunks(start: int, size: int, element_size: int, sub_chunk_bytes: int) -> list[tuple[int, int]]:
    count = max(1, min(size, math.ceil(size * element_size / sub_chunk_bytes)))
    edges = [start + size * j // count for j in range(count + 1)]
    return list(zip(edges[:-1], edges[1:]))


def _reduce_steps(tree: _RankTree, index: int, bounds, active, tags, reduced: list) -> list[Step]:
    parent = tree.parent_of()
    heights = {node: tree.height(node) for node in tree.children}
    steps = []
    for j, (start, stop) in enumerate(bounds):
        up = {node: next(tags) for node in parent}  # the tag of node -> parent for this sub-chunk
        for node, kids in tree.children.items():
            key = (j + heights[node], 0, index, j, node)
            receive = tuple((kid, up[kid]) for kid in kids)
            send = ((parent[node], up[node]),) if node in parent else ()
            steps.append(Step(REDUCE, node, start, stop, receive, send, node in active, key))
        reduced.append((start, stop, j + heights[tree.root]))
    return steps


def _broadcast_steps(tree: _RankTree, index: int, bounds, active, tags, reduced: list) -> list[Step]:
    parent = tree.parent_of()
    depths = tree.depths()
    steps = []
    for j, (start, stop) in enumerate(bounds):
        ready = max(key for lo, hi, key in reduced if lo < stop and start < hi)
        down = {node: next(tags) for node in parent}  # the tag of parent -> node for this sub-chunk
        for node, kids in tree.children.items():
            key = (ready + 1 + depths[node], 1, index, j, node)
            receive = ((parent[node], down[node]),) if node in parent else ()
            send = tuple((kid, down[kid]) for kid in kids)
            steps.append(Step("broadcast", node, start, stop, receive, send, node in active, key))
    return steps


class ForestWork:
    """The handle of an asynchronous forest all-reduce (like a torch.distributed Work)."""

    def __init__(self, future):
        self._future = future

    def wait(self) -> bool:
        self._future.result()
        return True

    def is_completed(self) -> bool:
        return self._future.done()

    def get_future(self):
        """The all-reduce's future (``concurrent.futures.Future``: ``add_done_callback`` as a torch one)."""
        return self._future


class ForestAllReduce:
    """Sum all-reduce over the trees of a forest packing of `topology` among `active_ranks`.

    Rank i of `process_group` (None: the default group) is worker i of the topology; the group must
    hold exactly the topology's workers. Rank 0 plans problem `problem` (or takes `packing`) and
    shares it, after every rank has checked that all hold the same topology and active set.
    """

    def __init__(self, topology: Topology, active_ranks=None, process_group=None, problem: str = "overlap",
                 packing: ForestPacking | None = None, sub_chunk_bytes: int = DEFAULT_SUB_CHUNK_BYTES):
        if not dist.is_available() or not dist.is_initialized():
            raise ConfigError("torch.distributed is not initialised: call init_process_group first")
        if not isinstance(topology, Topology):
            raise ConfigError(f"topology must be a gradsync.topology.Topology, got {type(topology).__name__}")
        check_group_size(topology, dist.get_world_size(process_group))
        if isinstance(sub_chunk_bytes, bool) or not isinstance(sub_chunk_bytes, int) or sub_chunk_bytes < 1:
            raise ConfigError(f"sub_chunk_bytes must be a positive integer, got {sub_chunk_bytes!r}")
        names = topology.active_workers(None if active_ranks is None else _active_names(topology, active_ranks))
        self.topology, self.process_group, self.sub_chunk_bytes = topology, process_group, sub_chunk_bytes
        self.rank = dist.get_rank(process_group)
        check_same_on_all_ranks((topology.hash, names, problem), "topology, active set or problem",
                                "give every rank the same topology file and active ranks", process_group)
        self.packing = _shared_packing(topology, names, problem, packing, process_group)
        self._schedules: dict[tuple[int, int], list[Step]] = {}
        self._scratch: dict[tuple, torch.Tensor] = {}  # receive space for partial sums and relayed data
        self._thread: ThreadPoolExecutor | None = None

    @property
    def active_ranks(self) -> tuple[int, ...]:
        return tuple(self.topology.workers.index(name) for name in self.packing.active)

    def predicted_time(self, nbytes: int) -> float:
        """Seconds for one all-reduce of `nbytes` on the topology's links (Property 2), with the
        pipeline fill of the fewest sub-chunks any tree is cut into at this size (fp32 elements)."""
        numel = max(1, nbytes // 4)
        fewest = min((len(_sub_chunks(0, size, 4, self.sub_chunk_bytes))
                      for size in self.packing.chunk_sizes(numel) if size), default=1)
        return self.packing.time(nbytes, sub_chunks=fewest)

    def all_reduce(self, tensor: torch.Tensor, async_op: bool = False):
        """Sum `tensor` (contiguous, same size on every rank) over the active ranks, in place. With
        `async_op`, runs on this object's thread (calls keep their order) and returns a ForestWork."""
        if not tensor.is_contiguous():
            raise ConfigError("forest all_reduce needs a contiguous tensor")
        if not async_op:
            self._run(tensor.view(-1))
            return None
        if self._thread is None:
            self._thread = ThreadPoolExecutor(max_workers=1, thread_name_prefix="gradsync-forest")
        return ForestWork(self._thread.submit(self._run, tensor.view(-1)))

    def close(self) -> None:
        """Finish queued all-reduces and stop the thread."""
        if self._thread is not None:
            self._thread.shutdown(wait=True)
            self._thread = None

    def _my_steps(self, numel: int, element_size: int) -> list[Step]:
        key = (numel, element_size)
        if key not in self._schedules:
            schedule = build_schedule(self.packing, self.topology.workers, numel, element_size, self.sub_chunk_bytes)
            self._schedules[key] = [step for step in schedule if step.rank == self.rank]
        return self._schedules[key]

    def _scratch_for(self, flat: torch.Tensor, steps: list[Step]) -> torch.Tensor:
        """One buffer per buffer size, dtype and device, kept between calls (fresh memory would be
        paged in on every all-reduce): room for every receive that does not land in the tensor."""
        key = (flat.numel(), flat.dtype, flat.device)
        if key not in self._scratch:
            size = sum((step.stop - step.start) * len(step.receive) for step in steps if not _lands_in_place(step))
            self._scratch[key] = flat.new_empty(size)
        return self._scratch[key]

    def _run(self, flat: torch.Tensor) -> None:
        steps = self._my_steps(flat.numel(), flat.element_size())
        group = self.process_group
        scratch, used, incoming = self._scratch_for(flat, steps), 0, {}
        for step in steps:
            for peer, tag in step.receive:
                if _lands_in_place(step):
                    buffer = flat[step.start:step.stop]
                else:
                    buffer, used = scratch[used:used + step.stop - step.start], used + step.stop - step.start
                incoming[tag] = (dist.irecv(buffer, group=group, group_src=peer, tag=tag), buffer)
        outgoing = []
        for step in steps:
            if step.kind == REDUCE:
                payload = flat[step.start:step.stop] if step.holds else None
                for _, tag in step.receive:
                    partial = _received(incoming, tag)
                    payload = partial if payload is None else payload.add_(partial)
            elif step.receive:
                payload = _received(incoming, step.receive[0][1])
            else:
                payload = flat[step.start:step.stop]
            outgoing += [dist.isend(payload, group=group, group_dst=peer, tag=tag) for peer, tag in step.send]
        for work in outgoing:
            work.wait()


def _lands_in_place(step: Step) -> bool:
    """An active rank receives broadcast data straight into its tensor."""
    return step.kind != REDUCE and step.holds


def check_group_size(topology: Topology, size: int) -> None:
    """Rank i runs worker i: the process group must hold exactly the topology's workers."""
    if size != len(topology.workers):
        raise ConfigError(f"the process group has {size} ranks but topology {topology.name!r} has "
                          f"{len(topology.workers)} workers: rank i runs worker i, so they must match")


def _received(incoming: dict, tag: int) -> torch.Tensor:
    work, buffer = incoming.pop(tag)
    work.wait()
    return buffer


def _active_names(topology: Topology, active_ranks) -> list[str]:
    names = []
    for rank in active_ranks:
        if isinstance(rank, bool) or not isinstance(rank, int) or not 0 <= rank < len(topology.workers):
            raise ConfigError(f"active rank {rank!r} is outside the topology (ranks 0..{len(topology.workers) - 1})")
        names.append(topology.workers[rank])
    return names


def _shared_packing(topology: Topology, names, problem: str, packing, process_group) -> ForestPacking:
    """Rank 0's packing on every rank (or rank 0's planning error, raised everywhere)."""
    if dist.get_rank(process_group) == 0:
        try:
            mine = packing or plan_forest(topology, names, problem)
            if mine.topology_hash != topology.hash or tuple(mine.active) != tuple(names):
                raise ConfigError("the packing given was planned for another topology or active set")
            message = ("ok", mine.to_json())
        except ConfigError as exc:
            message = ("error", str(exc))
    else:
        message = None
    status, text = share_from_first(message, process_group)
    if status == "error":
        raise ConfigError(text)
    return ForestPacking.from_json(text)
