"""The output of forest planning: reduce and broadcast trees with weights, ready to execute.

Units. A tree's weight w is the bandwidth it occupies on each of its links, in Gbit/s (Property 2:
its effective bandwidth). χ_v is the aggregate weight of the reduce trees rooted at v, and
X = Σ_v χ_v. Problem (4) gives an all-reduce of |C| in T = 2|C|/X (Eq. (2) with (3a)): a reduce
stage, then a broadcast stage. In problem (8) (Sec. V) the broadcast trees that share the links
with the reduce trees run during the reduce stage; only pure broadcast trees add a second stage, so
T = 2|C|/X with pure broadcast trees and |C|/X without. The all-reduce *throughput* |C|/T (the
paper's data size over time) is X / stages, in the links' capacity unit: with unit links, K4 → 2
means |C| bytes take |C|/2 time units.

Data layout for execution. The buffer of `numel` elements is cut into one contiguous range C_v per
root, |C_v| ∝ χ_v. Inside C_v, the reduce trees of v take consecutive ranges ∝ their weights, and so
do the broadcast trees of v (overlapped ones first, then pure ones: Sec. V broadcasts the head of
C_v while the reduce stage still runs). Every split rounds by largest remainder (`chunk_sizes`).
A reduce tree's `parent[u]` is the node u sends its partial sum to; a broadcast tree's `parent[u]` is
the node u receives from. Sub-chunk pipelining (Property 2) is the executor's: `time` predicts it.
"""
from __future__ import annotations

import hashlib
import json
from dataclasses import dataclass

from ..errors import ConfigError

REDUCE, BROADCAST, OVERLAP = "reduce", "broadcast", "overlap_broadcast"
KINDS = (REDUCE, OVERLAP, BROADCAST)
PROBLEMS = {"separate": "problem (4): reduce stage, then broadcast stage",
            "overlap": "problem (8): broadcast overlapped with the reduce stage"}


@dataclass(frozen=True)
class Tree:
    """One reduce or broadcast tree. `parent` maps every non-root node to its neighbour towards the
    root; `depth` is its height in hops, `latency` the largest root-to-node sum of link latencies."""

    root: str
    kind: str
    parent: dict[str, str]
    weight: float
    depth: int
    latency: float = 0.0

    def edges(self) -> list[tuple[str, str]]:
        """Links (src, dst) in the direction data moves."""
        if self.kind == REDUCE:
            return [(child, up) for child, up in self.parent.items()]
        return [(up, child) for child, up in self.parent.items()]

    def to_dict(self) -> dict:
        return {"root": self.root, "kind": self.kind, "parent": dict(sorted(self.parent.items())),
                "weight": self.weight, "depth": self.depth, "latency": self.latency}


@dataclass(frozen=True)
class ForestPacking:
    """A solved packing: trees (grouped by root, then kind in `KINDS` order), the problem it solves,
    and an upper bound on X = Σ_v χ_v (equal to X when `exact`)."""

    problem: str
    active: tuple[str, ...]
    trees: tuple[Tree, ...]
    upper_bound: float
    exact: bool
    topology_hash: str
    bound_kind: str = "lp"

    @property
    def aggregate(self) -> float:
        """X = Σ_v χ_v in Gbit/s (the objective of (4) and (8))."""
        return sum(tree.weight for tree in self.trees if tree.kind == REDUCE)

    @property
    def stages(self) -> int:
        """Consecutive stages of |C|/X each that `time` charges: 1 when every broadcast tree
        overlaps the reduce stage (problem (8) without pure broadcast trees), else 2."""
        overlapped = self.problem == "overlap" and not any(tree.kind == BROADCAST for tree in self.trees)
        return 1 if overlapped else 2

    @property
    def throughput(self) -> float:
        """All-reduce throughput |C|/T = X / `stages` in Gbit/s (capacity units), the limit of
        `time` for large all-reduces."""
        return self.aggregate / self.stages

    @property
    def gap(self) -> float:
        """Relative distance to the upper bound: 1 − X / bound (0 when exact)."""
        return max(0.0, 1.0 - self.aggregate / self.upper_bound)

    def root_weights(self) -> dict[str, float]:
        """χ_v per active root."""
        weights = {root: 0.0 for root in self.active}
        for tree in self.trees:
            if tree.kind == REDUCE:
                weights[tree.root] += tree.weight
        return weights

    def chunk_sizes(self, numel: int) -> list[int]:
        """Elements carried by each tree (aligned with `trees`): roots get ∝ χ_v, then each root's
        reduce trees and its broadcast trees split C_v ∝ weight; largest-remainder rounding, so each
        kind's sizes sum to exactly `numel`."""
        if numel < 0:
            raise ConfigError(f"numel must be >= 0, got {numel}")
        roots = list(self.root_weights().items())
        per_root = dict(zip([r for r, _ in roots], largest_remainder(numel, [w for _, w in roots])))
        sizes = [0] * len(self.trees)
        for root in per_root:
            for kinds in ((REDUCE,), (OVERLAP, BROADCAST)):
                members = [i for i, t in enumerate(self.trees) if t.root == root and t.kind in kinds]
                for i, size in zip(members, largest_remainder(per_root[root], [self.trees[i].weight for i in members])):
                    sizes[i] = size
        return sizes

    def time(self, nbytes: float, sub_chunks: int | None = None) -> float:
        """Predicted seconds for one all-reduce of `nbytes` (Property 2 and 3): every tree moves its
        chunk in nbytes/X; with s sub-chunks a tree of depth d needs (s + d − 1)/s of that (pipeline
        fill), plus its path latency. Problem (4): slowest reduce tree + slowest broadcast tree;
        problem (8): slowest of reduce and overlapped trees + slowest pure broadcast tree.
        `sub_chunks=None` is the paper's limit s → ∞."""
        if nbytes <= 0:
            return 0.0
        if sub_chunks is not None and sub_chunks < 1:
            raise ConfigError(f"sub_chunks must be >= 1, got {sub_chunks}")
        stage = nbytes * 8 / (self.aggregate * 1e9)

        def tree_time(tree: Tree) -> float:
            fill = 1.0 if sub_chunks is None else (sub_chunks + tree.depth - 1) / sub_chunks
            return stage * fill + tree.latency

        first = [tree_time(t) for t in self.trees if t.kind in (REDUCE, OVERLAP)]
        second = [tree_time(t) for t in self.trees if t.kind == BROADCAST]
        return max(first, default=0.0) + max(second, default=0.0)

    def to_dict(self) -> dict:
        return {"problem": self.problem, "active": list(self.active), "upper_bound": self.upper_bound,
                "exact": self.exact, "bound_kind": self.bound_kind, "topology_hash": self.topology_hash,
                "trees": [tree.to_dict() for tree in self.trees]}

    def to_json(self) -> str:
        return json.dumps(self.to_dict(), sort_keys=True)

    @classmethod
    def from_dict(cls, data: dict) -> "ForestPacking":
        try:
            trees = tuple(Tree(t["root"], t["kind"], dict(t["parent"]), float(t["weight"]), int(t["depth"]),
                               float(t.get("latency", 0.0))) for t in data["trees"])
            packing = cls(data["problem"], tuple(data["active"]), trees, float(data["upper_bound"]),
                          bool(data["exact"]), data["topology_hash"], data.get("bound_kind", "lp"))
        except (KeyError, TypeError) as exc:
            raise ConfigError(f"forest packing JSON: missing or malformed field {exc}") from exc
        if packing.problem not in PROBLEMS:
            raise ConfigError(f"forest packing JSON: problem {packing.problem!r}; valid: {', '.join(PROBLEMS)}")
        bad = [t.kind for t in trees if t.kind not in KINDS]
        if bad:
            raise ConfigError(f"forest packing JSON: tree kind {bad[0]!r}; valid: {', '.join(KINDS)}")
        return packing

    @classmethod
    def from_json(cls, text: str) -> "ForestPacking":
        return cls.from_dict(json.loads(text))

    @property
    def hash(self) -> str:
        """SHA-256 of the canonical JSON: ranks compare it before executing."""
        return hashlib.sha256(self.to_json().encode()).hexdigest()


def largest_remainder(total: int, weights: list[float]) -> list[int]:
    """Integers ∝ `weights` summing to `total`: floors of the quotas, then one more to the largest
    fractional parts (earlier index first on ties)."""
    mass = sum(weights)
    if not weights:
        return []
    if mass <= 0:
        return [total] + [0] * (len(weights) - 1)
    quotas = [total * w / mass for w in weights]
    sizes = [int(q) for q in quotas]
    order = sorted(range(len(weights)), key=lambda i: (-(quotas[i] - sizes[i]), i))
    for i in order[: total - sum(sizes)]:
        sizes[i] += 1
    return sizes
