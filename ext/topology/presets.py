"""Preset topologies: the paper's Fig. 3 clusters, the DGX-1 hybrid cube-mesh, rings, complete graphs.

Fig. 3 clusters (Sec. VI-A): A machines × B GPUs. Inside a machine, 4 GPUs are fully connected
(Fig. 3(a)) and 8 GPUs form the DGX-1 hybrid cube-mesh (Fig. 3(b)), each link at `intra_gbps`
(PCIe ≈ 100 Gbit/s, NVLink ≈ 300 Gbit/s per direction; a doubled cube-mesh link counts twice).
Between machines, Fig. 3(d) abstracts the rack as direct paths of `inter_gbps` per direction between
every pair of GPUs on different machines — the reading under which the paper's remark holds that, with
inter = intra = 100 Gbit/s, one one-hop tree per worker (the sharded PS) is optimal (Sec. VI-B).
"""
from __future__ import annotations

import re
import string

from ..errors import ConfigError
from .model import Link, Topology, check_rate

# NVLink count between GPU i and j in a DGX-1 (its hybrid cube-mesh), 25 GB/s = 200 Gbit/s per link.
DGX1_LINKS = (
    (0, 2, 1, 1, 2, 0, 0, 0), (2, 0, 1, 2, 0, 1, 0, 0), (1, 1, 0, 2, 0, 0, 2, 0), (1, 2, 2, 0, 0, 0, 0, 1),
    (2, 0, 0, 0, 0, 2, 1, 1), (0, 1, 0, 0, 2, 0, 1, 2), (0, 0, 2, 0, 1, 1, 0, 2), (0, 0, 0, 1, 1, 2, 2, 0),
)
INTRA_GBPS = {"pcie": 100.0, "nvlink": 300.0}
# The paper's Fig. 6 labels for per-machine active sets: 2G = {A, G}, 3G = {A, B, G}, 4H = {A, B, G, H}.
PAPER_LABELS = {"2G": "AG", "3G": "ABG", "4H": "ABGH"}


def check_count(value, what: str, least: int) -> int:
    """A number of workers, machines or GPUs: an integer >= `least`.

    Args:
        value: the number to check (returned unchanged).
        what: what it counts, for the error message.
        least: the smallest value allowed.
    """
    if isinstance(value, bool) or not isinstance(value, int) or value < least:
        raise ConfigError(f"{what} must be an integer >= {least}, got {value!r}")
    return value


def complete(n: int, gbps: float = 1.0) -> Topology:
    """K_n: a link of `gbps` each way between every pair of workers 0..n-1."""
    check_count(n, "complete: the number of workers", 2)
    workers = tuple(str(i) for i in range(n))
    links = tuple(Link(u, v, gbps) for u in workers for v in workers if u != v)
    return Topology(workers, links, name=f"complete-{n}")


def ring(n: int, gbps: float = 1.0, bidirectional: bool = True) -> Topology:
    """Workers 0..n-1 on a ring: i→i+1, and i+1→i too when bidirectional.

    Args:
        n: the number of workers (>= 2).
        gbps: each link's bandwidth (Gbit/s).
        bidirectional: add the reverse links (named ring-N; one-way: oneway-ring-N).
    """
    check_count(n, "ring: the number of workers", 2)
    workers = tuple(str(i) for i in range(n))
    links = [Link(workers[i], workers[(i + 1) % n], gbps) for i in range(n)]
    if bidirectional:
        links += [Link(workers[(i + 1) % n], workers[i], gbps) for i in range(n)]
    return Topology(workers, tuple(links), name=f"{'ring' if bidirectional else 'oneway-ring'}-{n}")


def dgx1(link_gbps: float = 200.0) -> Topology:
    """One DGX-1: 8 GPUs, hybrid cube-mesh NVLink, `link_gbps` per NVLink per direction."""
    check_rate(link_gbps, "dgx1: link_gbps")
    workers = tuple(str(i) for i in range(8))
    links = tuple(Link(workers[i], workers[j], count * link_gbps)
                  for i, row in enumerate(DGX1_LINKS) for j, count in enumerate(row) if count)
    return Topology(workers, links, name="dgx1")


def cluster(machines: int, gpus: int, inter_gbps: float, intra: str = "pcie",
            intra_gbps: float | None = None) -> Topology:
    """The paper's Fig. 3 cluster: `machines` × `gpus`, workers named m<machine>g<gpu>.

    Args:
        machines: the number of machines (>= 1).
        gpus: GPUs per machine (>= 1); 8 are linked as a DGX-1 cube-mesh, other counts fully.
        inter_gbps: each direct path between two GPUs on different machines (Gbit/s per direction).
        intra: "pcie" or "nvlink", the intra-machine link type (sets the default `intra_gbps`).
        intra_gbps: each intra-machine link (Gbit/s per direction; a doubled cube-mesh link counts
            twice); None: 100 for PCIe, 300 for NVLink.
    """
    check_count(machines, "cluster: machines", 1)
    check_count(gpus, "cluster: gpus", 1)
    if intra not in INTRA_GBPS:
        raise ConfigError(f"cluster.intra: unknown {intra!r}; valid: {', '.join(INTRA_GBPS)}")
    check_rate(inter_gbps, "cluster.inter_gbps")
    per_link = INTRA_GBPS[intra] if intra_gbps is None else check_rate(intra_gbps, "cluster.intra_gbps")
    names = [[f"m{m}g{g}" for g in range(gpus)] for m in range(machines)]
    links = []
    for m in range(machines):
        for i in range(gpus):
            for j in range(gpus):
                count = DGX1_LINKS[i][j] if gpus == 8 else int(i != j)
                if count:
                    links.append(Link(names[m][i], names[m][j], count * per_link))
            for other in range(machines):
                if other != m:
                    links.extend(Link(names[m][i], names[other][j], inter_gbps) for j in range(gpus))
    groups = {name: f"m{m}" for m in range(machines) for name in names[m]}
    return Topology(tuple(n for row in names for n in row), tuple(links), groups=groups,
                    name=f"{machines}x{gpus}-{intra}@{inter_gbps:g}")


def preset(name: str, inter_gbps: float = 10.0, gbps: float = 1.0) -> Topology:
    """A preset by name: 'AxB-pcie', 'AxB-nvlink' (at `inter_gbps`), 'dgx1', 'complete-N', 'ring-N',
    'oneway-ring-N' (links of `gbps`).

    Args:
        name: the preset's name, one of the forms above (A, B, N whole numbers).
        inter_gbps: the inter-machine bandwidth of 'AxB-*' clusters (Gbit/s).
        gbps: each link's bandwidth in 'complete-N' and the rings (Gbit/s); 'dgx1' has its own.
    """
    if match := re.fullmatch(r"(\d+)x(\d+)-(pcie|nvlink)", name):
        return cluster(int(match.group(1)), int(match.group(2)), inter_gbps, match.group(3))
    if name == "dgx1":
        return dgx1()
    if match := re.fullmatch(r"(complete|ring|oneway-ring)-(\d+)", name):
        n = int(match.group(2))
        if match.group(1) == "complete":
            return complete(n, gbps)
        return ring(n, gbps, bidirectional=match.group(1) == "ring")
    raise ConfigError(f"unknown preset {name!r}; valid: AxB-pcie, AxB-nvlink (e.g. 4x4-pcie), dgx1, "
                      "complete-N, ring-N, oneway-ring-N")


def active_from_spec(topology: Topology, spec: str | None) -> tuple[str, ...]:
    """Active workers from text: per-machine tokens 'a,b,...' (one per machine; a count k = its first k
    GPUs, letters = those GPUs (A = GPU 0), or a Fig. 6 label 2G/3G/4H), or worker names 'w1,w2,...'."""
    if spec is None or spec == "all":
        return topology.active_workers()
    tokens = [t.strip() for t in spec.split(",") if t.strip()]
    if all(t in topology.workers for t in tokens):
        return topology.active_workers(tokens)
    machines = list(topology.machines().values())
    if len(tokens) != len(machines):
        raise ConfigError(f"active: {spec!r} is neither worker names nor one token per machine "
                          f"({len(machines)} machines); workers: {', '.join(topology.workers[:8])} ...")
    chosen = [w for token, gpus in zip(tokens, machines) for w in _machine_selection(token, gpus)]
    return topology.active_workers(chosen)


def _machine_selection(token: str, gpus: list[str]) -> list[str]:
    letters = PAPER_LABELS.get(token.upper(), token.upper())
    if token.isdigit():
        count = int(token)
        if count > len(gpus):
            raise ConfigError(f"active: {count} workers asked on a machine with {len(gpus)}")
        return gpus[:count]
    if not all(c in string.ascii_uppercase[:len(gpus)] for c in letters):
        raise ConfigError(f"active: token {token!r}: give a count, GPU letters A..{string.ascii_uppercase[len(gpus) - 1]}"
                          f" or one of {', '.join(PAPER_LABELS)}")
    return [gpus[string.ascii_uppercase.index(c)] for c in letters]
