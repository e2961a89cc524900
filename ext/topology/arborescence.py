"""Minimum-cost spanning arborescence (Chu–Liu / Edmonds) on a dense cost matrix.

The pricing oracle of the column generation (packing.py): with the master LP's capacity duals as
edge costs, the cheapest out-arborescence rooted at v is the broadcast tree with the most negative
reduced cost, and the cheapest in-arborescence (the same on the transposed matrix) the reduce tree.

Each round picks every node's cheapest entering edge (one vectorised argmin), contracts the cycles
these edges form — costs entering a cycle node lowered by that node's chosen edge — and recurses on
the contracted matrix; expanding keeps each cycle's edges except the one its entering edge replaces.
O(n) rounds of O(n²) numpy work; graphs here have at most a few hundred nodes.
"""
from __future__ import annotations

import numpy as np


def min_out_arborescence(cost: np.ndarray, root: int) -> np.ndarray | None:
    """Parent vector of a minimum-cost spanning arborescence rooted at `root`, edges parent → child.

    `cost[u, v]` is the cost of edge u → v, `inf` where there is no edge. Returns an int array with
    parent[root] = -1, or None when some node cannot be reached from the root.
    """
    cost = np.array(cost, dtype=float)
    np.fill_diagonal(cost, np.inf)
    cost[:, root] = np.inf
    return _solve(cost, root)


def min_in_arborescence(cost: np.ndarray, root: int) -> np.ndarray | None:
    """Parent vector of a minimum-cost in-arborescence: every node's path of edges u → parent[u] ends at
    `root` (the shape of a reduce tree). `cost[u, v]` is the cost of edge u → v."""
    return min_out_arborescence(np.asarray(cost).T, root)


def _solve(cost: np.ndarray, root: int) -> np.ndarray | None:
    n = len(cost)
    parent = cost.argmin(axis=0)
    parent[root] = -1
    entering = cost[parent, np.arange(n)]
    entering[root] = 0.0
    if np.isinf(entering).any():
        return None
    cycles = _cycles(parent, root)
    if not cycles:
        return parent
    component, singles, members = _components(n, cycles)
    reduced = cost - entering[None, :]
    reduced[:, root] = np.inf
    contracted, source, target = _contract(reduced, singles, members)
    contracted_parent = _solve(contracted, component[root])
    if contracted_parent is None:
        return None
    for group, group_parent in enumerate(contracted_parent):
        if group_parent >= 0:
            child = target[group_parent, group]
            parent[child] = source[group_parent, child]
    return parent


def _cycles(parent: np.ndarray, root: int) -> list[list[int]]:
    """The cycles of the functional graph v → parent[v] (root excluded)."""
    state = np.zeros(len(parent), dtype=np.int64)  # 0 unvisited, 1 on current walk, 2 done
    state[root] = 2
    cycles = []
    for start in range(len(parent)):
        walk = []
        node = start
        while state[node] == 0:
            state[node] = 1
            walk.append(node)
            node = parent[node]
        if state[node] == 1:
            cycles.append(walk[walk.index(node):])
        for visited in walk:
            state[visited] = 2
    return cycles


def _components(n: int, cycles: list[list[int]]) -> tuple[np.ndarray, np.ndarray, list[np.ndarray]]:
    """Component id per node: the nodes on no cycle first (one each), then one per cycle."""
    in_cycle = np.zeros(n, dtype=bool)
    for cycle in cycles:
        in_cycle[cycle] = True
    singles = np.flatnonzero(~in_cycle)
    component = np.empty(n, dtype=np.int64)
    component[singles] = np.arange(len(singles))
    members = [np.array(cycle) for cycle in cycles]
    for offset, cycle in enumerate(members):
        component[cycle] = len(singles) + offset
    return component, singles, members


def _contract(reduced: np.ndarray, singles: np.ndarray, cycles: list[np.ndarray]):
    """Contracted cost matrix over the groups (the nodes `singles` first, then one per cycle), with the
    original edge behind each entry: for groups (a, b) the cheapest edge u → v with u in a, v in b is
    source[a, v] → target[a, b]."""
    s, n = len(singles), len(reduced)
    m = s + len(cycles)
    rows = np.empty((m, n))
    source = np.empty((m, n), dtype=np.int64)
    rows[:s] = reduced[singles]
    source[:s] = singles[:, None]
    for offset, members in enumerate(cycles):
        pick = reduced[members].argmin(axis=0)
        rows[s + offset] = reduced[members[pick], np.arange(n)]
        source[s + offset] = members[pick]
    contracted = np.empty((m, m))
    target = np.empty((m, m), dtype=np.int64)
    contracted[:, :s] = rows[:, singles]
    target[:, :s] = singles[None, :]
    for offset, members in enumerate(cycles):
        pick = rows[:, members].argmin(axis=1)
        contracted[:, s + offset] = rows[np.arange(m), members[pick]]
        target[:, s + offset] = members[pick]
    np.fill_diagonal(contracted, np.inf)
    return contracted, source, target
