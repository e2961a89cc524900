"""The paper's baselines (Sec. VI-A) on a Topology: seconds for one all-reduce of `nbytes`.

One fluid model for all of them: a phase is a set of concurrent transfers (src, dst, bytes); each
goes along a widest path of the topology (fewest hops among the widest), links are shared by the
transfers crossing them, so a phase takes max_link(load / bandwidth) plus its longest path latency.
Pipelined schemes (trees) put both directions of a tree in one phase, as NCCL does.

- ring: Ring AllReduce over the active workers in topology order, 2(N − 1) steps of |C|/N.
- nccl_tree: NCCL's double binary tree (`nccl_double_tree`), each tree carrying |C|/2 up and down.
- parameter_server: sharded PS on the active workers (one one-hop tree per worker): push |C|/N to
  every server, then pull.
- blink: per machine, packed spanning trees (problem (5) on the machine's nodes) reduce to the
  machine, a ring all-reduce runs among one leader per machine, then the trees broadcast.
- plink: per machine, one widest tree to the leader; NCCL double binary tree among the leaders.
"""
from __future__ import annotations

import heapq

import numpy as np

from ..errors import ConfigError, unknown_name
from .forest import BROADCAST, REDUCE
from .model import Topology
from .packing import max_packing


def nccl_double_tree(nranks: int) -> tuple[list[int], list[int]]:
    """Parent vectors of NCCL's two trees (ncclGetDtree): tree 0 is the binary tree of ncclGetBtree;
    tree 1 mirrors it (rank → nranks−1−rank) when nranks is even, and shifts it by one otherwise."""
    if nranks < 1:
        raise ConfigError(f"nranks must be >= 1, got {nranks}")
    first = [_btree_parent(nranks, rank) for rank in range(nranks)]
    if nranks % 2 == 0:
        second = [_mirror(_btree_parent(nranks, nranks - 1 - rank), nranks) for rank in range(nranks)]
    else:
        second = [_shift(_btree_parent(nranks, (rank - 1) % nranks), nranks) for rank in range(nranks)]
    return first, second


def _btree_parent(nranks: int, rank: int) -> int:
    """ncclGetBtree's parent: clear the lowest set bit's position and set the next one up, or just
    clear it when that is out of range; rank 0 is the root."""
    if rank == 0:
        return -1
    bit = rank & -rank
    up = (rank ^ bit) | (bit << 1)
    return up if up < nranks else rank ^ bit


def _mirror(parent: int, nranks: int) -> int:
    return -1 if parent == -1 else nranks - 1 - parent


def _shift(parent: int, nranks: int) -> int:
    return -1 if parent == -1 else (parent + 1) % nranks


class _Network:
    """Widest-path routing and phase times on a topology."""

    def __init__(self, topology: Topology):
        self.topology = topology
        self.capacity = topology.capacity
        self.routes: dict[int, list[int]] = {}

    def _predecessors(self, source: int) -> list[int]:
        if source not in self.routes:
            self.routes[source] = _widest_tree(self.capacity, source)
        return self.routes[source]

    def path(self, src: str, dst: str) -> list[tuple[int, int]]:
        index = self.topology.index
        before = self._predecessors(index[src])
        hops, node = [], index[dst]
        while node != index[src]:
            hops.append((before[node], node))
            node = before[node]
        return hops

    def phase_time(self, transfers: list[tuple[str, str, float]]) -> float:
        load = np.zeros_like(self.capacity)
        latency = 0.0
        for src, dst, nbytes in transfers:
            if src == dst or nbytes <= 0:
                continue
            hops = self.path(src, dst)
            for u, v in hops:
                load[u, v] += nbytes
            latency = max(latency, sum(self.topology.latency[u, v] for u, v in hops))
        used = load > 0
        return float((load[used] * 8 / (self.capacity[used] * 1e9)).max(initial=0.0)) + latency


def _widest_tree(capacity: np.ndarray, source: int) -> list[int]:
    """Predecessors of a widest-path tree from `source` (max bottleneck, then fewest hops)."""
    n = len(capacity)
    best = [(-np.inf, 0)] * n  # (bottleneck, -hops), larger is better
    best[source] = (np.inf, 0)
    before = [-1] * n
    heap = [(-np.inf, 0, source)]
    done = [False] * n
    while heap:
        neg_width, hops, node = heapq.heappop(heap)
        if done[node]:
            continue
        done[node] = True
        for nxt in np.flatnonzero(capacity[node] > 0):
            candidate = (min(-neg_width, capacity[node, nxt]), -(hops + 1))
            if not done[nxt] and candidate > best[nxt]:
                best[nxt], before[nxt] = candidate, node
                heapq.heappush(heap, (-candidate[0], hops + 1, int(nxt)))
    return before


def ring_time(topology: Topology, active: tuple[str, ...], nbytes: float) -> float:
    """Seconds of Ring AllReduce: 2(N − 1) phases, each worker sending |C|/N to the next in `active`.

    Args:
        topology: the network.
        active: the N workers taking part, by name, checked (``Topology.active_workers``); the ring
            visits them in this order.
        nbytes: |C|, the all-reduce's size (bytes).
    """
    n = len(active)
    step = _Network(topology).phase_time([(active[i], active[(i + 1) % n], nbytes / n) for i in range(n)])
    return 2 * (n - 1) * step


def nccl_tree_time(topology: Topology, active: tuple[str, ...], nbytes: float) -> float:
    """Seconds of NCCL's double binary tree over `active` (rank i = active[i]): each tree moves |C|/2
    up and down its edges, all in one pipelined phase.

    Args: as ``ring_time``.
    """
    return _Network(topology).phase_time(_double_tree_transfers(active, nbytes))


def _double_tree_transfers(ranks: tuple[str, ...], nbytes: float) -> list[tuple[str, str, float]]:
    transfers = []
    for parents in nccl_double_tree(len(ranks)):
        for rank, parent in enumerate(parents):
            if parent >= 0:
                transfers += [(ranks[rank], ranks[parent], nbytes / 2), (ranks[parent], ranks[rank], nbytes / 2)]
    return transfers


def parameter_server_time(topology: Topology, active: tuple[str, ...], nbytes: float) -> float:
    """Seconds of a parameter server sharded over `active`: every worker pushes |C|/N to each other
    worker, then pulls it back.

    Args: as ``ring_time``.
    """
    network, share = _Network(topology), nbytes / len(active)
    push = network.phase_time([(w, s, share) for w in active for s in active if w != s])
    pull = network.phase_time([(s, w, share) for w in active for s in active if w != s])
    return push + pull


def _machine_view(topology: Topology, active: tuple[str, ...]) -> list[tuple[Topology, tuple[str, ...]]]:
    """Per machine with active workers: the sub-topology of its nodes, and its active workers."""
    views = []
    for machine, workers in topology.machines().items():
        chosen = tuple(w for w in workers if w in active)
        if not chosen:
            continue
        nodes = set(workers) | {r for r in topology.relays if topology.group_of(r) == machine}
        links = tuple(link for link in topology.links if link.src in nodes and link.dst in nodes)
        views.append((Topology(tuple(workers), links, tuple(r for r in topology.relays if r in nodes),
                               name=f"{topology.name}:{machine}"), chosen))
    return views


def blink_time(topology: Topology, active: tuple[str, ...], nbytes: float) -> float:
    """Seconds of the Blink-like scheme: the slowest machine's packed reduce trees (problem (5), link
    latency left out), a ring among each machine's first active worker, the slowest broadcast.

    Args: as ``ring_time``; the topology's groups name the machines (an ungrouped worker is one alone).
    """
    reduce, broadcast = 0.0, 0.0
    for machine, chosen in _machine_view(topology, active):
        if len(chosen) > 1:
            reduce = max(reduce, nbytes * 8 / (max_packing(machine, chosen, REDUCE) * 1e9))
            broadcast = max(broadcast, nbytes * 8 / (max_packing(machine, chosen, BROADCAST) * 1e9))
    leaders = tuple(chosen[0] for _, chosen in _machine_view(topology, active))
    across = ring_time(topology, leaders, nbytes) if len(leaders) > 1 else 0.0
    return reduce + across + broadcast


def plink_time(topology: Topology, active: tuple[str, ...], nbytes: float) -> float:
    """Seconds of the Plink-like scheme: per machine, a pipelined widest tree between its active
    workers and the first of them (its slowest path), NCCL's double binary tree among those leaders,
    then the broadcast down the trees.

    Args: as ``ring_time``; the topology's groups name the machines (an ungrouped worker is one alone).
    """
    reduce, broadcast = 0.0, 0.0
    for machine, chosen in _machine_view(topology, active):
        network = _Network(machine)  # the tree is pipelined: its time is that of its narrowest path
        broadcast = max([broadcast] + [network.phase_time([(chosen[0], w, nbytes)]) for w in chosen[1:]])
        reduce = max([reduce] + [network.phase_time([(w, chosen[0], nbytes)]) for w in chosen[1:]])
    leaders = tuple(chosen[0] for _, chosen in _machine_view(topology, active))
    across = nccl_tree_time(topology, leaders, nbytes) if len(leaders) > 1 else 0.0
    return reduce + across + broadcast


BASELINES = {"ring": ring_time, "nccl_tree": nccl_tree_time, "parameter_server": parameter_server_time,
             "blink": blink_time, "plink": plink_time}


def baseline_time(name: str, topology: Topology, active, nbytes: float) -> float:
    """Seconds for one all-reduce of `nbytes` among `active` (names; None = all) with baseline `name`.

    Args:
        name: a key of `BASELINES`: "ring", "nccl_tree", "parameter_server", "blink" or "plink".
        topology, nbytes: as ``ring_time``.
        active: the workers taking part, by name (None: all); checked here.
    """
    if name not in BASELINES:
        raise unknown_name("baseline", name, BASELINES)
    return BASELINES[name](topology, topology.active_workers(active), nbytes)
