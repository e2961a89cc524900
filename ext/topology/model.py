"""The inter-GPU network as a directed capacitated graph (the paper's G = (V, E), Sec. III-A).

Nodes are workers (GPUs that may take part in a synchronisation) and relays (switches, NICs: they
forward but never hold gradients). Every link is directed and carries `gbps`, its bandwidth in
Gbit/s per direction — the capacity unit of the whole package — and an optional latency in seconds.
A file or preset gives a full-duplex connection as two links. `group` names the machine of a node
(used by the Blink- and Plink-like baselines and by per-machine active-worker selections).

File format (YAML or JSON)::

    name: two-boxes
    workers: [a0, a1, b0, b1]          # or an integer N: workers 0..N-1
    relays: [switch]                   # optional
    groups: {a0: A, a1: A, b0: B, b1: B}   # optional
    links:
      - {between: [a0, a1], bandwidth: 100 Gbit/s}          # both directions
      - {from: a0, to: switch, bandwidth: 3.125 GB/s, latency_us: 2}
      - {from: switch, to: a0, bandwidth: 25}               # a bare number is Gbit/s
"""
from __future__ import annotations

import hashlib
import json
import math
import re
from dataclasses import dataclass, field
from functools import cached_property
from pathlib import Path

import numpy as np

from ..errors import ConfigError

_UNITS = {"gbit/s": 1.0, "gbps": 1.0, "gb/s": 8.0, "gbyte/s": 8.0, "mbit/s": 1e-3, "mbps": 1e-3}


@dataclass(frozen=True)
class Link:
    """One direction of a connection: `gbps` Gbit/s from `src` to `dst`, `latency` seconds."""

    src: str
    dst: str
    gbps: float
    latency: float = 0.0


@dataclass(frozen=True)
class Topology:
    """Workers, relays and directed links; validated on construction."""

    workers: tuple[str, ...]
    links: tuple[Link, ...]
    relays: tuple[str, ...] = ()
    groups: dict[str, str] = field(default_factory=dict)
    name: str = "topology"

    def __post_init__(self) -> None:
        _validate(self)

    @property
    def nodes(self) -> tuple[str, ...]:
        """Workers first, then relays: the order of every matrix index in this package."""
        return self.workers + self.relays

    @cached_property
    def index(self) -> dict[str, int]:
        return {node: i for i, node in enumerate(self.nodes)}

    @cached_property
    def capacity(self) -> np.ndarray:
        """Dense matrix: capacity[u, v] = Gbit/s of link u→v, 0 where there is none."""
        return self._link_matrix("gbps")

    @cached_property
    def latency(self) -> np.ndarray:
        """Dense matrix: latency[u, v] = seconds of link u→v, 0 where there is none."""
        return self._link_matrix("latency")

    def _link_matrix(self, attribute: str) -> np.ndarray:
        matrix = np.zeros((len(self.nodes), len(self.nodes)))
        for link in self.links:
            matrix[self.index[link.src], self.index[link.dst]] = getattr(link, attribute)
        return matrix

    @cached_property
    def symmetric(self) -> bool:
        """Every link has a reverse twin of equal bandwidth and latency (then reduce ≡ broadcast)."""
        return bool(np.array_equal(self.capacity, self.capacity.T) and np.array_equal(self.latency, self.latency.T))

    def group_of(self, node: str) -> str:
        """The machine of `node`; a node without a group is a machine of its own."""
        return self.groups.get(node, node)

    def machines(self) -> dict[str, list[str]]:
        """Workers per machine, machines in order of first appearance."""
        machines: dict[str, list[str]] = {}
        for worker in self.workers:
            machines.setdefault(self.group_of(worker), []).append(worker)
        return machines

    def active_workers(self, active=None) -> tuple[str, ...]:
        """Validate an active set (names, or None for all workers): known, distinct, mutually reachable."""
        if active is None:
            chosen = self.workers
        else:
            chosen = tuple(active)
            for name in chosen:
                if name not in self.workers:
                    raise ConfigError(f"active worker {name!r} is not a worker of {self.name!r}; "
                                      f"workers: {', '.join(self.workers)}")
            if len(set(chosen)) != len(chosen):
                raise ConfigError(f"active workers listed twice: {', '.join(chosen)}")
            chosen = tuple(w for w in self.workers if w in set(chosen))
        if len(chosen) < 2:
            raise ConfigError(f"active: need at least 2 workers, got {len(chosen)}")
        _check_reachable(self, chosen)
        return chosen

    def to_dict(self) -> dict:
        """The file format (bandwidth in Gbit/s): `from_dict(to_dict())` gives an equal topology."""
        return {
            "name": self.name, "workers": list(self.workers), "relays": list(self.relays),
            "groups": dict(sorted(self.groups.items())),
            "links": [{"from": l.src, "to": l.dst, "bandwidth": l.gbps, "latency_us": l.latency * 1e6}
                      for l in self.links],
        }

    @cached_property
    def hash(self) -> str:
        """SHA-256 of the canonical content (name excluded, links sorted): equal on every rank or a mismatch."""
        content = self.to_dict()
        del content["name"]
        content["links"] = sorted(content["links"], key=lambda l: (l["from"], l["to"]))
        return hashlib.sha256(json.dumps(content, sort_keys=True).encode()).hexdigest()

    @classmethod
    def from_dict(cls, data: dict) -> "Topology":
        if not isinstance(data, dict):
            raise ConfigError("topology: expected a mapping with keys workers, links (relays, groups, name)")
        unknown = set(data) - {"name", "workers", "relays", "groups", "links"}
        if unknown:
            raise ConfigError(f"topology: unknown keys {sorted(unknown)}; valid: name, workers, relays, groups, links")
        workers = data.get("workers")
        if isinstance(workers, int) and not isinstance(workers, bool):
            workers = [str(i) for i in range(workers)]
        if not isinstance(workers, list) or not workers:
            raise ConfigError("topology.workers: give a non-empty list of names or a positive integer")
        links = data.get("links")
        if not isinstance(links, list):
            raise ConfigError("topology.links: give a list of links")
        relays, groups = data.get("relays") or [], data.get("groups") or {}
        if not isinstance(relays, list):
            raise ConfigError(f"topology.relays: give a list of node names, got {relays!r}")
        if not isinstance(groups, dict):
            raise ConfigError(f"topology.groups: give a mapping of node name to group name, got {groups!r}")
        return cls(
            workers=tuple(str(w) for w in workers),
            relays=tuple(str(r) for r in relays),
            groups={str(k): str(v) for k, v in groups.items()},
            links=tuple(link for i, entry in enumerate(links) for link in _parse_link(entry, i)),
            name=str(data.get("name", "topology")),
        )


def load(path: str | Path) -> Topology:
    """Read a topology file (.json, or YAML for any other suffix); ConfigError naming the file, and
    the line and column where it cannot be parsed, for a file that is not a topology."""
    import yaml

    try:
        text = Path(path).read_text(encoding="utf-8")
    except UnicodeDecodeError as exc:
        raise ConfigError(f"topology file {str(path)!r}: not UTF-8 text (byte {exc.start}: {exc.reason})") from exc
    except OSError as exc:
        raise ConfigError(f"topology file {str(path)!r}: cannot read it ({exc.strerror or exc})") from exc
    try:
        data = json.loads(text) if str(path).endswith(".json") else yaml.safe_load(text)
    except json.JSONDecodeError as exc:
        raise ConfigError(f"topology file {str(path)!r}: invalid JSON at line {exc.lineno}, column {exc.colno}: "
                          f"{exc.msg}") from exc
    except yaml.YAMLError as exc:
        mark = getattr(exc, "problem_mark", None)
        where = f" at line {mark.line + 1}, column {mark.column + 1}" if mark is not None else ""
        raise ConfigError(f"topology file {str(path)!r}: invalid YAML{where}: "
                          f"{getattr(exc, 'problem', None) or exc}") from exc
    try:
        return Topology.from_dict(data)
    except ConfigError as exc:
        raise ConfigError(f"topology file {str(path)!r}: {exc}") from exc


def parse_bandwidth(value, where: str) -> float:
    """A bandwidth in Gbit/s from a number (Gbit/s) or text such as '100 Gbit/s' or '25 GB/s'."""
    if isinstance(value, (int, float)) and not isinstance(value, bool):
        gbps = float(value)
    else:
        match = re.fullmatch(r"\s*([0-9.eE+-]+)\s*([A-Za-z/]+)\s*", str(value))
        unit = match.group(2).lower() if match else None
        if unit not in _UNITS:
            raise ConfigError(f"{where}.bandwidth: cannot read {value!r}; give a number (Gbit/s) or "
                              f"a value with a unit: {', '.join(_UNITS)}")
        gbps = float(match.group(1)) * _UNITS[unit]
    return check_rate(gbps, f"{where}.bandwidth")


def check_rate(gbps, what: str) -> float:
    """A bandwidth in Gbit/s: a finite number > 0."""
    if isinstance(gbps, bool) or not isinstance(gbps, (int, float)) or not 0 < gbps < math.inf:
        raise ConfigError(f"{what} must be positive and finite (Gbit/s), got {gbps!r}")
    return float(gbps)


def _check_latency(value, what: str) -> float:
    """A latency: a finite number >= 0."""
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not 0 <= value < math.inf:
        raise ConfigError(f"{what} must be a finite number >= 0, got {value!r}")
    return float(value)


def _parse_link(entry, position: int) -> list[Link]:
    where = f"topology.links[{position}]"
    if not isinstance(entry, dict):
        raise ConfigError(f"{where}: expected a mapping")
    unknown = set(entry) - {"from", "to", "between", "bandwidth", "latency_us"}
    if unknown:
        raise ConfigError(f"{where}: unknown keys {sorted(unknown)}; valid: from, to, between, bandwidth, latency_us")
    if "bandwidth" not in entry:
        raise ConfigError(f"{where}: missing bandwidth")
    gbps = parse_bandwidth(entry["bandwidth"], where)
    latency = _check_latency(entry.get("latency_us", 0.0), f"{where}.latency_us") * 1e-6
    if "between" in entry:
        pair = entry["between"]
        if not isinstance(pair, list) or len(pair) != 2 or "from" in entry or "to" in entry:
            raise ConfigError(f"{where}: 'between' takes a list of two nodes (and no from/to)")
        return [Link(str(pair[0]), str(pair[1]), gbps, latency), Link(str(pair[1]), str(pair[0]), gbps, latency)]
    if "from" not in entry or "to" not in entry:
        raise ConfigError(f"{where}: give either 'between: [u, v]' or both 'from' and 'to'")
    return [Link(str(entry["from"]), str(entry["to"]), gbps, latency)]


def _validate(topology: Topology) -> None:
    nodes = topology.workers + topology.relays
    if not topology.workers:
        raise ConfigError("topology.workers: at least one worker is required")
    if len(set(nodes)) != len(nodes):
        repeated = sorted({n for n in nodes if nodes.count(n) > 1})
        raise ConfigError(f"topology: node names used twice (workers and relays must be distinct): {repeated}")
    known = set(nodes)
    seen = set()
    for link in topology.links:
        for end in (link.src, link.dst):
            if end not in known:
                raise ConfigError(f"topology.links: node {end!r} is neither a worker nor a relay")
        if link.src == link.dst:
            raise ConfigError(f"topology.links: self-loop on {link.src!r}")
        check_rate(link.gbps, f"topology.links: bandwidth of {link.src}->{link.dst}")
        _check_latency(link.latency, f"topology.links: latency of {link.src}->{link.dst}")
        if (link.src, link.dst) in seen:
            raise ConfigError(f"topology.links: link {link.src}->{link.dst} given twice (sum the bandwidths)")
        seen.add((link.src, link.dst))
    stray = set(topology.groups) - known
    if stray:
        raise ConfigError(f"topology.groups: unknown nodes {sorted(stray)}")


def _check_reachable(topology: Topology, active: tuple[str, ...]) -> None:
    """Every active worker must reach every other one (through any nodes); name the pairs that cannot."""
    reach = topology.capacity > 0
    closure = reach | np.eye(len(reach), dtype=bool)
    for _ in range(int(np.ceil(np.log2(max(len(reach), 2)))) + 1):
        closure = closure | ((closure.astype(np.int32) @ closure.astype(np.int32)) > 0)
    idx = [topology.index[w] for w in active]
    missing = [f"{u}->{v}" for u, i in zip(active, idx) for v, j in zip(active, idx) if not closure[i, j]]
    if missing:
        shown = ", ".join(missing[:10]) + (" ..." if len(missing) > 10 else "")
        raise ConfigError(f"active workers cannot reach each other: {shown}")
