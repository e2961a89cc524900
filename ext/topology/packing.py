"""Reduce/broadcast forest packing: problems (4) and (8) of the paper solved by column generation.

Master LP (HiGHS, through its highspy bindings), over the trees generated so far:

- Problem (4) (`problem="separate"`): maximise Σ_v χ_v subject to, for every active root v,
  Σ_{reduce trees at v} w = χ_v (4a) and Σ_{broadcast trees at v} w = χ_v (4b); for every link e,
  Σ reduce w·x_e ≤ b_e (4c) and Σ broadcast w·x_e ≤ b_e (4d); w, χ ≥ 0 (4e).
- Problem (8) (`problem="overlap"`): Σ_{reduce at v} w = χ_v (8a); Σ_{overlapped broadcast at v} w +
  Σ_{pure broadcast at v} w = χ_v (8b); reduce and overlapped broadcast trees share each link,
  Σ ≤ b_e (8d); pure broadcast trees alone, Σ ≤ b_e (8e). (8c) follows from (8a), (8b) and w ≥ 0.

Pricing (the dual of (5), i.e. (6), generalised to the equality rows): with y_e ≥ 0 the duals of a
tree's capacity rows and λ the dual of its root's equality row, a tree improves the master iff its
y-cost is below λ. The cheapest tree rooted at v is a minimum-cost out-arborescence (broadcast) or
in-arborescence (reduce) — Edmonds' algorithm, exact, when every node of the graph is an active
worker; otherwise a directed Steiner tree, found by the shortest-path heuristic and improved by
Edmonds on the nodes it uses (the approximate oracle A of Alg. 1). Column generation replaces
Alg. 1's ellipsoid method: both only need the oracle, and the LP gives exact duals. The first
columns come from multiplicative weights (Garg–Könemann) with the same oracle; the master is one
HiGHS model that new columns are appended to and re-solved from its basis by primal simplex.

Exactness and bounds. With the exact oracle, the loop stops when no tree has negative reduced cost,
or when X reaches the cut bound below: the optimum of (4)/(8) over *all* trees. A deterministic
round budget can stop it earlier on large graphs; the packing then reports its gap to the cut bound.
With relays or inactive workers, the result is a lower bound, reported with an upper bound on X: the directed-cut (multicommodity flow) relaxation of Steiner
packing — root v's trees become link loads z^v with Σ_v z^v ≤ b, each terminal receiving a flow χ_v
inside z^v (for reduce, on the reversed graph) — when it is small enough to solve, and always the cut
bound (N − 1)·X ≤ Σ_{t active} (capacity out of t), and into t except in (8).

Few trees: weights below `prune` × the largest are dropped and the master re-solved on the rest.
"""
from __future__ import annotations

import os
import sys
from contextlib import contextmanager
from dataclasses import dataclass

import numpy as np
from scipy.optimize import linprog
from scipy.sparse import coo_matrix, csr_matrix
from scipy.sparse.csgraph import shortest_path

from highspy import Highs as _Highs, HighsModelStatus as _ModelStatus  # HiGHS, re-solved as columns arrive

from ..errors import ConfigError
from .arborescence import min_out_arborescence
from .forest import BROADCAST, KINDS, OVERLAP, PROBLEMS, REDUCE, ForestPacking, Tree
from .model import Topology

ROUND_BUDGET = 1_000_000  # roots × links × rounds of the default pricing budget
FLOW_BOUND_LIMIT = 10_000  # commodity-edge variables of the flow relaxation above which it is skipped
_TOL = 1e-9


@dataclass
class _Column:
    kind: str
    root: int  # position in the active list
    parent: np.ndarray  # over graph nodes, -1 for the root and for nodes outside the tree
    edges: np.ndarray  # link ids


class _Graph:
    """Index structures of a topology: link ids, capacities, and the direction of each tree kind."""

    def __init__(self, topology: Topology, active: tuple[str, ...]):
        self.topology = topology
        self.n = len(topology.nodes)
        self.capacity = topology.capacity
        self.src, self.dst = np.nonzero(self.capacity)
        self.b = self.capacity[self.src, self.dst]
        self.edge_id = -np.ones((self.n, self.n), dtype=np.int64)
        self.edge_id[self.src, self.dst] = np.arange(len(self.b))
        self.active = np.array([topology.index[w] for w in active])
        self.active_names = tuple(active)
        self.spanning = len(self.active) == self.n

    def cost_matrix(self, y: np.ndarray, kind: str) -> np.ndarray:
        """Dense costs with inf for missing links, transposed for reduce trees so that every oracle
        call builds an out-arborescence whose parent pointers lead towards the root."""
        matrix = np.full((self.n, self.n), np.inf)
        matrix[self.src, self.dst] = y
        return matrix.T if kind == REDUCE else matrix

    def tree_edges(self, parent: np.ndarray, kind: str) -> np.ndarray:
        children = np.flatnonzero(parent >= 0)
        if kind == REDUCE:
            return self.edge_id[children, parent[children]]
        return self.edge_id[parent[children], children]


def plan_forest(topology: Topology, active=None, problem: str = "overlap", prune: float = 1e-4,
                seed_rounds: int = 10, max_rounds: int | None = None,
                flow_bound_limit: int = FLOW_BOUND_LIMIT) -> ForestPacking:
    """Solve problem (4) (`separate`) or (8) (`overlap`) for the active workers (names; None = all).

    The packing minimises what `ForestPacking.time` predicts. For (4) that is maximising X (T =
    2|C|/X). For (8) a packing with pure broadcast trees takes 2|C|/X, and one whose broadcast trees
    all overlap the reduce stage |C|/X, so both are solved, (8) itself and (8) without pure
    broadcast trees, and the faster one kept (the first on a tie).
    On a symmetric topology (every link has an equal reverse) both problems have the optimum of (5):
    reversing an optimal broadcast packing gives reduce trees with the same χ_v, and (8) can never
    beat the reduce packing alone. There the master is (5) and each tree is used both ways.
    `max_rounds` (default: fewer on larger graphs, `ROUND_BUDGET` / (roots × links), clamped to
    6..1000) caps the pricing rounds deterministically, so every rank computes the same packing.

    Args:
        topology: the network.
        active: the active workers' names (None: all workers).
        problem: "separate" (problem (4)) or "overlap" (problem (8)).
        prune: drop trees whose weight is at most this fraction of the heaviest, in [0, 1), unless
            that lowers X by more than 1e-9 of it; 0 keeps every tree.
        seed_rounds: rounds of multiplicative weights for the first columns (per tree kind, each
            round visiting every root).
        max_rounds: the most pricing rounds (None: the default above).
        flow_bound_limit: the most commodity-edge variables (N(N − 1) × links) for which the flow
            relaxation bounds a packing that is not exact; above it only the cut bound is used.
    """
    if problem not in PROBLEMS:
        raise ConfigError(f"problem: unknown {problem!r}; valid: {', '.join(PROBLEMS)}")
    if not 0 <= prune < 1:
        raise ConfigError(f"prune must be in [0, 1), got {prune}")
    active = topology.active_workers(active)
    graph = _Graph(topology, active)
    if max_rounds is None:
        max_rounds = int(np.clip(ROUND_BUDGET / (len(active) * len(graph.b)), 6, 1000))
    if topology.symmetric:
        return _solve(graph, problem, "single", prune, seed_rounds, max_rounds, flow_bound_limit)
    packing = _solve(graph, problem, problem, prune, seed_rounds, max_rounds, flow_bound_limit)
    if problem == "overlap" and any(tree.kind == BROADCAST for tree in packing.trees):
        overlapped = _solve(graph, problem, OVERLAPPED_ONLY, prune, seed_rounds, max_rounds, flow_bound_limit)
        if overlapped.throughput > packing.throughput * (1 + 1e-9):
            return overlapped
    return packing


OVERLAPPED_ONLY = "overlapped_only"  # the master of (8) without pure broadcast trees


def _solve(graph: _Graph, problem: str, master_problem: str, prune: float, seed_rounds: int, max_rounds: int,
           flow_bound_limit: int) -> ForestPacking:
    """One master (`master_problem`: "separate", "overlap", OVERLAPPED_ONLY or "single") solved
    by column generation, as a packing of `problem`."""
    cut = _cut_bound(graph, problem)
    master = _Master(graph, master_problem, seed_rounds)
    converged = master.generate(max_rounds, cut if graph.spanning else np.inf)
    if prune > 0:
        master.prune(prune)
    exact = converged and graph.spanning
    if exact:
        bound, bound_kind = master.value, "exact"
    else:
        bound, bound_kind = _upper_bound(graph, problem, cut, master.value, flow_bound_limit)
    trees = _trees(graph, master)
    return ForestPacking(problem, graph.active_names, trees, max(bound, master.value), exact,
                         graph.topology.hash, bound_kind)


def max_packing(topology: Topology, active, kind: str = BROADCAST) -> float:
    """Problem (5): the largest total weight of `kind` trees (any roots) spanning the active workers,
    each link's load within its bandwidth — the bandwidth of one reduce or broadcast stage alone.

    Args:
        topology: the network.
        active: the active workers' names (None: all workers).
        kind: REDUCE or BROADCAST, the trees' direction.

    Returns:
        the total weight in Gbit/s (the links' capacity unit); a lower bound on the optimum where the
        round budget ends the search or the oracle is the Steiner heuristic (relays or inactive workers).
    """
    graph = _Graph(topology, topology.active_workers(active))
    master = _Master(graph, "single", 10, single_kind=kind)
    rounds = int(np.clip(ROUND_BUDGET / (len(graph.active) * len(graph.b)), 10, 1000))
    master.generate(rounds, _cut_bound(graph) if graph.spanning else np.inf)
    return master.value


class _Master:
    """The restricted master LP, kept in one HiGHS model: columns are appended and re-solved from
    the previous basis (minimising −Σχ, so the duals follow linprog's sign convention)."""

    def __init__(self, graph: _Graph, problem: str, seed_rounds: int, single_kind: str = BROADCAST):
        self.graph = graph
        self.single = problem == "single"
        if problem == "separate":
            self.kinds = {REDUCE: (0, 0), BROADCAST: (1, 1)}  # kind -> (capacity group, equality group)
        elif problem == "overlap":
            self.kinds = {REDUCE: (0, 0), OVERLAP: (0, 1), BROADCAST: (1, 1)}
        elif problem == OVERLAPPED_ONLY:
            self.kinds = {REDUCE: (0, 0), OVERLAP: (0, 1)}
        else:
            self.kinds = {single_kind: (0, 0)}
        self.cap_groups = 1 + max(g for g, _ in self.kinds.values())
        self.eq_groups = 1 + max(e for _, e in self.kinds.values())
        self.columns: list[_Column] = []
        self.seen: set[tuple] = set()
        self.weights = np.zeros(0)
        self.value = 0.0
        self.lp = _new_model(graph, self.eq_groups, self.cap_groups)
        self._seed(seed_rounds)

    @property
    def n_roots(self) -> int:
        return len(self.graph.active)

    def _seed(self, rounds: int, eps: float = 0.5) -> None:
        """Initial columns by multiplicative weights (Garg–Könemann): each root in turn takes its
        cheapest tree under lengths exp(ε·load_e/b_e)/b_e and loads it by its bottleneck, so the
        pool spreads over all links and the first master is already close to the optimum."""
        for kind in self.kinds:
            load = np.zeros(len(self.graph.b))
            for _ in range(rounds):
                for r in range(self.n_roots):
                    exponent = eps * load / self.graph.b
                    cost = self.graph.cost_matrix(np.exp(exponent - exponent.max()) / self.graph.b, kind)
                    parent = _cheapest_tree(self.graph, cost, r, None if self.graph.spanning else _paths(cost))
                    edges = self.graph.tree_edges(parent, kind)
                    load[edges] += self.graph.b[edges].min()
                    self._add(kind, r, parent)
        self._flush()

    def _add(self, kind: str, root: int, parent: np.ndarray) -> bool:
        key = (kind, root, parent.tobytes())
        if key in self.seen:
            return False
        self.seen.add(key)
        self.columns.append(_Column(kind, root, parent, self.graph.tree_edges(parent, kind)))
        return True

    def _flush(self) -> None:
        """Append the columns not yet in the HiGHS model."""
        new = self.columns[self.lp.getNumCol() - self.n_roots:]
        if not new:
            return
        n_edges = len(self.graph.b)
        entries = []
        for column in new:
            cap_group, eq_group = self.kinds[column.kind]
            entries.append(np.concatenate([[eq_group * self.n_roots + column.root],
                                           self.eq_groups * self.n_roots + cap_group * n_edges + column.edges]))
        starts = np.cumsum([0] + [len(e) for e in entries[:-1]]).astype(np.int32)
        index = np.concatenate(entries).astype(np.int32)
        self.lp.addCols(len(new), np.zeros(len(new)), np.zeros(len(new)), np.full(len(new), np.inf),
                        len(index), starts, index, np.ones(len(index)))

    def generate(self, max_rounds: int, bound: float) -> bool:
        """Alternate master solves and pricing; True when no improving tree remains or the value
        reaches `bound` (a proven upper bound: optimal either way)."""
        for _ in range(max_rounds):
            y, lam = self.solve()
            if self.value >= bound * (1 - 1e-9) or not self._price(y, lam):
                return True
            self._flush()
        self.solve()
        return False

    def _price(self, y: np.ndarray, lam: np.ndarray) -> bool:
        added = False
        for kind, (cap_group, eq_group) in self.kinds.items():
            edge_cost = y[cap_group] + 1e-12 * (1.0 + y[cap_group].max())  # ties: prefer fewer links
            cost = self.graph.cost_matrix(edge_cost, kind)
            paths = None if self.graph.spanning else _paths(cost)
            for r in range(self.n_roots):
                parent = _cheapest_tree(self.graph, cost, r, paths)
                tree_cost = y[cap_group][self.graph.tree_edges(parent, kind)].sum()
                threshold = lam[eq_group * self.n_roots + r]
                if tree_cost < threshold - 1e-9 * max(1.0, abs(threshold)):
                    added |= self._add(kind, r, parent)
        return added

    def solve(self) -> tuple[np.ndarray, np.ndarray]:
        """Re-solve; return capacity duals y ≥ 0 (one row per group) and equality duals λ."""
        self.lp.run()
        status = self.lp.getModelStatus()
        if status != _ModelStatus.kOptimal:
            raise RuntimeError(f"forest master LP failed: {self.lp.modelStatusToString(status)}")
        solution = self.lp.getSolution()
        self.weights = np.array(solution.col_value)[self.n_roots:]
        self.value = -self.lp.getInfo().objective_function_value
        duals = np.array(solution.row_dual)
        split = self.eq_groups * self.n_roots
        y = np.maximum(-duals[split:], 0.0).reshape(self.cap_groups, len(self.graph.b))
        return y, duals[:split]

    def prune(self, fraction: float) -> None:
        """Drop trees lighter than `fraction` × the heaviest (upper bound 0) and re-solve on the rest;
        keep them after all if that costs more than 1e-9 of the value."""
        drop = (self.n_roots + np.flatnonzero(self.weights <= fraction * self.weights.max())).astype(np.int32)
        if not len(drop):
            return
        before = self.value
        self.lp.changeColsBounds(len(drop), drop, np.zeros(len(drop)), np.zeros(len(drop)))
        self.solve()
        if self.value < before * (1 - 1e-9):
            self.lp.changeColsBounds(len(drop), drop, np.zeros(len(drop)), np.full(len(drop), np.inf))
            self.solve()


_highs_made = False  # whether this process has created a HiGHS instance (and so had its banner)


def _quiet_highs() -> _Highs:
    """A HiGHS instance with output off. The first one in a process writes HiGHS's banner to file
    descriptor 1 from C++, before any option can silence it (it would corrupt `--json` output), so
    that one is created with descriptor 1 muted."""
    global _highs_made
    if _highs_made:
        lp = _Highs()
    else:
        with _descriptor_1_muted():
            lp = _Highs()
        _highs_made = True
    lp.setOptionValue("output_flag", False)
    return lp


@contextmanager
def _descriptor_1_muted():
    """File descriptor 1 (C-level stdout) pointed at /dev/null inside the block, restored after."""
    if sys.stdout is not None:
        sys.stdout.flush()  # Python's pending output goes out before the redirection
    try:
        saved = os.dup(1)
    except OSError:  # no descriptor 1: nothing to keep clean
        yield
        return
    null = os.open(os.devnull, os.O_WRONLY)
    try:
        os.dup2(null, 1)
        yield
    finally:
        os.dup2(saved, 1)
        os.close(saved)
        os.close(null)


def _new_model(graph: _Graph, eq_groups: int, cap_groups: int):
    """HiGHS model with the rows of the master and the χ_v columns: equality rows
    Σ w − χ_v = 0 per (group, root), then capacity rows Σ w x_e ≤ b_e per (group, link)."""
    lp = _quiet_highs()
    lp.setOptionValue("presolve", "off")
    lp.setOptionValue("solver", "simplex")
    lp.setOptionValue("simplex_strategy", 4)  # primal: appended columns keep the basis primal feasible
    n_roots, n_edges = len(graph.active), len(graph.b)
    n_eq = eq_groups * n_roots
    lower = np.concatenate([np.zeros(n_eq), np.full(cap_groups * n_edges, -np.inf)])
    upper = np.concatenate([np.zeros(n_eq), np.tile(graph.b, cap_groups)])
    lp.addRows(len(lower), lower, upper, 0, np.zeros(0, dtype=np.int32), np.zeros(0, dtype=np.int32), np.zeros(0))
    index = np.array([g * n_roots + r for r in range(n_roots) for g in range(eq_groups)], dtype=np.int32)
    starts = (np.arange(n_roots) * eq_groups).astype(np.int32)
    lp.addCols(n_roots, -np.ones(n_roots), np.zeros(n_roots), np.full(n_roots, np.inf), len(index), starts,
               index, -np.ones(len(index)))
    return lp


def _paths(cost: np.ndarray):
    """All-pairs shortest distances and predecessors (for the Steiner heuristic)."""
    finite = np.where(np.isinf(cost), 0.0, cost)
    return shortest_path(csr_matrix(finite), method="D", return_predecessors=True)


def _cheapest_tree(graph: _Graph, cost: np.ndarray, r: int, paths) -> np.ndarray:
    """Parent vector of the cheapest (or, for Steiner trees, a cheap) tree rooted at active root r."""
    root = int(graph.active[r])
    if graph.spanning:
        return min_out_arborescence(cost, root)
    return _steiner_tree(cost, root, graph.active, paths)


def _steiner_tree(cost: np.ndarray, root: int, terminals: np.ndarray, paths) -> np.ndarray:
    """Directed Steiner arborescence from `root` to `terminals`: the shortest-path heuristic
    (grow from the root by the nearest terminal's shortest path), then Edmonds on the nodes it uses
    and on the terminals alone, pruned of non-terminal leaves; the cheapest candidate wins."""
    n = len(cost)
    grown = _shortest_path_heuristic(root, terminals, paths, n)
    candidates = [grown, _restricted(cost, root, terminals, np.flatnonzero((grown >= 0) | (np.arange(n) == root)))]
    candidates.append(_restricted(cost, root, terminals, np.unique(np.append(terminals, root))))
    feasible = [c for c in candidates if c is not None]

    def total(parent):
        children = np.flatnonzero(parent >= 0)
        return cost[parent[children], children].sum()

    return min(feasible, key=total)


def _shortest_path_heuristic(root: int, terminals: np.ndarray, paths, n: int) -> np.ndarray:
    distance, predecessor = paths
    parent = -np.ones(n, dtype=np.int64)
    in_tree = np.zeros(n, dtype=bool)
    in_tree[root] = True
    remaining = [t for t in terminals if t != root]
    while remaining:
        tree_nodes = np.flatnonzero(in_tree)
        block = distance[np.ix_(tree_nodes, remaining)]
        source_pos, target_pos = np.unravel_index(np.argmin(block), block.shape)
        source, target = int(tree_nodes[source_pos]), int(remaining[target_pos])
        node = target
        while not in_tree[node]:
            step = int(predecessor[source, node])
            parent[node] = step
            in_tree[node] = True
            node = step
        remaining = [t for t in remaining if not in_tree[t]]
    return parent


def _restricted(cost: np.ndarray, root: int, terminals: np.ndarray, nodes: np.ndarray) -> np.ndarray | None:
    """Edmonds on the subgraph induced by `nodes`, mapped back and pruned of non-terminal leaves."""
    local = min_out_arborescence(cost[np.ix_(nodes, nodes)], int(np.flatnonzero(nodes == root)[0]))
    if local is None:
        return None
    parent = -np.ones(len(cost), dtype=np.int64)
    has_parent = local >= 0
    parent[nodes[has_parent]] = nodes[local[has_parent]]
    return _prune_leaves(parent, terminals)


def _prune_leaves(parent: np.ndarray, terminals: np.ndarray) -> np.ndarray:
    keep = np.zeros(len(parent), dtype=bool)
    keep[terminals] = True
    for t in terminals:
        node = t
        while parent[node] >= 0 and not keep[parent[node]]:
            keep[parent[node]] = True
            node = parent[node]
    return np.where(keep, parent, -1)


def _trees(graph: _Graph, master: _Master) -> tuple[Tree, ...]:
    """Trees of positive weight; a column of the symmetric master (5) is one reduce and one broadcast tree."""
    nodes = graph.topology.nodes
    entries = []
    for i, column in enumerate(master.columns):
        if master.weights[i] > _TOL:
            kinds = (REDUCE, BROADCAST) if master.single else (column.kind,)
            entries += [(kind, column, float(master.weights[i])) for kind in kinds]
    entries.sort(key=lambda e: (e[1].root, KINDS.index(e[0]), -e[2]))
    trees = []
    for kind, column, weight in entries:
        depth, latency = _depth_and_latency(graph, column.parent, kind)
        trees.append(Tree(nodes[graph.active[column.root]], kind,
                          {nodes[c]: nodes[p] for c, p in enumerate(column.parent) if p >= 0}, weight, depth, latency))
    return tuple(trees)


def _depth_and_latency(graph: _Graph, parent: np.ndarray, kind: str) -> tuple[int, float]:
    latency_matrix = graph.topology.latency
    depth, latency = 0, 0.0
    for start in np.flatnonzero(parent >= 0):
        hops, delay, node = 0, 0.0, start
        while parent[node] >= 0:
            up = parent[node]
            delay += latency_matrix[node, up] if kind == REDUCE else latency_matrix[up, node]
            hops, node = hops + 1, up
        depth, latency = max(depth, hops), max(latency, delay)
    return depth, latency


def _cut_bound(graph: _Graph, problem: str = "separate") -> float:
    """(N − 1)·X ≤ capacity out of the active workers (every other active worker sends on each root's
    reduce tree), and into them where the broadcast trees share one copy of the links with
    themselves only or, spanning every node, the reduce trees too. Not in (8) with relays: its
    reduce trees may enter relays, and its pure broadcast trees have their own copy (8e)."""
    out_of = graph.capacity[graph.active, :].sum()
    if problem == "overlap" and not graph.spanning:
        return out_of / (len(graph.active) - 1)
    into = graph.capacity[:, graph.active].sum()
    return min(into, out_of) / (len(graph.active) - 1)


def _upper_bound(graph: _Graph, problem: str, cut: float, value: float, flow_bound_limit: int) -> tuple[float, str]:
    """min of the cut bound and, when small enough and the cut bound is not yet reached, the flow
    relaxation (reduce direction for (8), both directions for (4))."""
    n_active = len(graph.active)
    bound, kind = cut, "cut"
    if value >= cut * (1 - 1e-9) or n_active * (n_active - 1) * len(graph.b) > flow_bound_limit:
        return bound, kind
    directions = [REDUCE] if problem == "overlap" or graph.topology.symmetric else [REDUCE, BROADCAST]
    flow = min(_flow_relaxation(graph, direction) for direction in directions)
    return (flow, "flow") if flow < bound else (bound, kind)


def _flow_relaxation(graph: _Graph, kind: str) -> float:
    """Directed-cut relaxation of Steiner packing (5): max Σ_v χ_v with loads z^v (Σ_v z^v ≤ b) and,
    for each root v and terminal t, a flow of χ_v from v to t (t to v for reduce) bounded by z^v."""
    src, dst = (graph.dst, graph.src) if kind == REDUCE else (graph.src, graph.dst)
    n, m, roots = graph.n, len(graph.b), graph.active
    pairs = [(r, t) for r in range(len(roots)) for t in roots if t != roots[r]]
    n_chi, n_z = len(roots), len(roots) * m
    f0 = n_chi + n_z
    n_vars = f0 + len(pairs) * m
    rows, cols, vals = [], [], []
    for k, (r, t) in enumerate(pairs):  # conservation: out − in − χ_r [u = root] + χ_r [u = t] = 0
        base, row0 = f0 + k * m, k * n
        rows += [row0 + src, row0 + dst, [row0 + roots[r], row0 + t]]
        cols += [base + np.arange(m), base + np.arange(m), [r, r]]
        vals += [np.ones(m), -np.ones(m), [-1.0, 1.0]]
    a_eq = coo_matrix((np.concatenate(vals), (np.concatenate(rows), np.concatenate(cols))),
                      shape=(len(pairs) * n, n_vars))
    k_index = np.repeat(np.arange(len(pairs)), m)
    edge_index = np.tile(np.arange(m), len(pairs))
    root_of = np.array([r for r, _ in pairs])[k_index]
    coupling_rows = np.arange(len(pairs) * m)
    capacity_rows = len(pairs) * m + np.tile(np.arange(m), len(roots))
    a_ub = coo_matrix((np.concatenate([np.ones(len(pairs) * m), -np.ones(len(pairs) * m), np.ones(n_z)]),
                       (np.concatenate([coupling_rows, coupling_rows, capacity_rows]),
                        np.concatenate([f0 + coupling_rows, n_chi + root_of * m + edge_index, n_chi + np.arange(n_z)]))),
                      shape=(len(pairs) * m + m, n_vars))
    b_ub = np.concatenate([np.zeros(len(pairs) * m), graph.b])
    objective = np.zeros(n_vars)
    objective[:n_chi] = -1.0
    result = linprog(objective, A_ub=csr_matrix(a_ub), b_ub=b_ub, A_eq=csr_matrix(a_eq), b_eq=np.zeros(len(pairs) * n),
                     bounds=(0, None), method="highs")
    if result.status != 0:
        raise RuntimeError(f"flow relaxation LP failed: {result.message}")
    return -result.fun
