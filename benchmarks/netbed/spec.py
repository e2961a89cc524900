"""What the emulated cluster looks like: hosts, their names and addresses, and their link rates.

Host i lives in network namespace ``gsnet-<i>`` with interface ``gsnet-<i>-ns`` at 192.0.2.<i+1>/24;
its veth peer ``gsnet-<i>-br`` joins the bridge ``gsnet-br`` in the root namespace. A uniform spec
gives every host a NIC of `gbps` in each direction (full duplex on a non-blocking switch); a pair
spec gives a rate for every ordered pair (host i → host j), for heterogeneous topologies.
"""
from __future__ import annotations

import re
from dataclasses import dataclass

import numpy as np

from gradsync import ConfigError
from gradsync.topology import Topology

PREFIX = "gsnet-"
BRIDGE = "gsnet-br"
ROOT_HANDLE = "gsnet-root"  # a name for the root namespace, so that a rank can reach the bridge ports from its own
SUBNET = "192.0.2"
MIN_HOSTS, MAX_HOSTS = 2, 8
RATE_PRESETS = {"1gbit": 1.0, "10gbit": 10.0}
MIN_GBPS = 0.001  # 1 Mbit/s: below this tc's rate tables lose precision
MAX_GBPS = 400.0  # beyond any link a veth pair on one machine could carry
QUEUE_LATENCY_MS = 20  # tbf's queue: 20 ms of traffic at the rate, beyond the burst


def namespace(host: int) -> str:
    return f"{PREFIX}{host}"


def inner_interface(host: int) -> str:
    """The host's interface, inside its namespace: the one gloo binds to (GLOO_SOCKET_IFNAME)."""
    return f"{PREFIX}{host}-ns"


def bridge_port(host: int) -> str:
    """The host's veth peer in the root namespace, a port of the bridge."""
    return f"{PREFIX}{host}-br"


def address(host: int) -> str:
    return f"{SUBNET}.{host + 1}"


def is_own_namespace(name: str) -> bool:
    return name == ROOT_HANDLE or re.fullmatch(rf"{PREFIX}\d+", name) is not None


def is_own_link(name: str) -> bool:
    return name == BRIDGE or re.fullmatch(rf"{PREFIX}\d+-br", name) is not None


def kbit(gbps: float) -> str:
    """A rate in tc's syntax, in kbit/s so that fractional Gbit/s stay exact."""
    return f"{round(gbps * 1e6)}kbit"


MIN_SEGMENT_BYTES = 4096  # two full-size TCP segments at a 1500-byte MTU
MAX_SEGMENT_BYTES = 65536  # TCP's largest segmentation offload


def millisecond_bytes(gbps: float) -> int:
    return round(gbps * 1e9 / 8 * 1e-3)


def segment_bytes(gbps: float) -> int:
    """The largest packet a host hands its link (its interface's ``gso_max_size``): half a
    millisecond at `gbps`, from 4 KiB to 64 KiB. Unlimited, TCP hands the link 64 KiB packets and
    the token bucket must hold two of them: at 31 Mbit/s that is 34 ms of traffic, sent at once
    after every pause (an 8-rank all-reduce of 200 KB ran in 65 ms after a pause, 94 ms back to back)."""
    return min(MAX_SEGMENT_BYTES, max(MIN_SEGMENT_BYTES, millisecond_bytes(gbps) // 2))


def burst_bytes(gbps: float, segment: int) -> int:
    """Token-bucket depth: one millisecond at the rate (so the kernel timer can keep the rate up),
    and at least two of the host's largest packets (`segment` bytes; a smaller bucket would split
    or hold back every such packet)."""
    return max(millisecond_bytes(gbps), 2 * segment)


@dataclass(frozen=True)
class NetSpec:
    """`hosts` namespaces; either one NIC rate `gbps` for all, or `pair_gbps[i][j]` for i → j."""

    hosts: int
    gbps: float | None = None
    pair_gbps: tuple[tuple[float, ...], ...] | None = None

    def __post_init__(self) -> None:
        if isinstance(self.hosts, bool) or not isinstance(self.hosts, int) or not MIN_HOSTS <= self.hosts <= MAX_HOSTS:
            raise ConfigError(f"netbed 'hosts' must be an integer from {MIN_HOSTS} to {MAX_HOSTS}, got {self.hosts!r}")
        if (self.gbps is None) == (self.pair_gbps is None):
            raise ConfigError("netbed: give exactly one of 'gbps' (every host's NIC) or 'pair_gbps' (a rate per pair)")
        if self.gbps is not None:
            _check_rate("gbps", self.gbps)
        else:
            _check_pairs(self.pair_gbps, self.hosts)

    @property
    def heterogeneous(self) -> bool:
        return self.pair_gbps is not None

    @property
    def segment_bytes(self) -> int:
        """Every host's largest packet, for the slowest link: set when the cluster is built, it
        stays for the connections made on it when the rates change later (``rate_commands``)."""
        if not self.heterogeneous:
            return segment_bytes(self.gbps)
        return segment_bytes(min(rate for i, row in enumerate(self.pair_gbps) for j, rate in enumerate(row) if i != j))

    def describe(self) -> str:
        if not self.heterogeneous:
            return f"{self.hosts} hosts, {self.gbps:g} Gbit/s NICs"
        rates = sorted({rate for i, row in enumerate(self.pair_gbps) for j, rate in enumerate(row) if i != j})
        return f"{self.hosts} hosts, per-pair rates {', '.join(f'{r:g}' for r in rates)} Gbit/s"


def uniform(hosts: int, rate: float | str) -> NetSpec:
    """Every host with one NIC of `rate` (Gbit/s, or a preset name: 1gbit, 10gbit) each way."""
    if isinstance(rate, str):
        if rate not in RATE_PRESETS:
            raise ConfigError(f"netbed rate: unknown preset {rate!r}; valid: {', '.join(RATE_PRESETS)}")
        rate = RATE_PRESETS[rate]
    return NetSpec(hosts, gbps=float(rate))


def from_matrix(matrix) -> NetSpec:
    """Per-pair rates from a square matrix of Gbit/s (row = sender, column = receiver). A pair
    without a direct link (0) gets the rate of its widest path through the other hosts."""
    array = np.asarray(matrix, dtype=float)
    if array.ndim != 2 or array.shape[0] != array.shape[1]:
        raise ConfigError(f"netbed matrix: must be square (one row and column per host), got shape {array.shape}")
    if (array < 0).any() or not np.isfinite(array).all():
        raise ConfigError("netbed matrix: rates must be finite and >= 0 Gbit/s")
    widest = widest_paths(array)
    hosts = array.shape[0]
    for i, j in zip(*np.nonzero(widest == 0)):
        if i != j:
            raise ConfigError(f"netbed matrix: no path from host {i} to host {j}; every host must reach every other")
    return NetSpec(hosts, pair_gbps=tuple(tuple(float(widest[i, j]) if i != j else 0.0 for j in range(hosts))
                                          for i in range(hosts)))


def from_topology(topology: Topology) -> NetSpec:
    """Per-pair rates for a topology whose workers map to hosts in order; paths through relays
    (switches) and other workers count at their bottleneck rate. Per-pair limits cannot model two
    paths sharing a relayed link: the emulation is exact for topologies of direct links."""
    widest = widest_paths(topology.capacity)
    workers = len(topology.workers)
    return from_matrix(widest[:workers, :workers])


def widest_paths(capacity: np.ndarray) -> np.ndarray:
    """Bottleneck capacity of the widest path between every pair (max-min Floyd–Warshall)."""
    widest = np.array(capacity, dtype=float)
    for middle in range(len(widest)):
        through = np.minimum(widest[:, middle, None], widest[None, middle, :])
        widest = np.maximum(widest, through)
    return widest


def _check_rate(field: str, value) -> None:
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not MIN_GBPS <= value <= MAX_GBPS:
        raise ConfigError(f"netbed {field!r} must be a number of Gbit/s from {MIN_GBPS} to {MAX_GBPS:g}, got {value!r}")


def _check_pairs(pairs, hosts: int) -> None:
    if len(pairs) != hosts or any(len(row) != hosts for row in pairs):
        raise ConfigError(f"netbed 'pair_gbps' must be {hosts}x{hosts} (one row and column per host)")
    for i, row in enumerate(pairs):
        for j, rate in enumerate(row):
            if i != j:
                _check_rate(f"pair_gbps[{i}][{j}]", rate)
