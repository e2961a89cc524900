"""The `ip` and `tc` commands that build and remove an emulated cluster (pure functions: no I/O).

Setup per host: a namespace (IPv6 off, so gloo binds the IPv4 address; TCP keeps a connection's
congestion window across idle spells: a training job's connections idle for less than an iteration,
but the benchmarks' interleaved rows leave each other's idle for whole blocks, and restarting from
the initial window slowed the first iterations of each block), a veth pair created with its inner
end already in the namespace, the outer end on the bridge, the address, the largest packet the host
sends (`NetSpec.segment_bytes`), then shaping.
Uniform spec: `tbf` on the inner end (the host's sending) and on the bridge port (its receiving).
Pair spec: `htb` on the inner end with one class per destination, chosen by a u32 filter on the
destination address; unmatched traffic (ARP) takes a default class at the host's fastest rate.
"""
from __future__ import annotations

from .spec import (BRIDGE, QUEUE_LATENCY_MS, ROOT_HANDLE, NetSpec, address, bridge_port, burst_bytes, inner_interface,
                   is_own_link, is_own_namespace, kbit, namespace)

Command = list[str]
DEFAULT_CLASS = 1
HTB_QUANTUM = 60000  # bytes a class may send per round; classes never borrow, so it only needs to exceed the MTU


def setup_commands(spec: NetSpec) -> list[Command]:
    """Every command that builds `spec` from a clean state, in order."""
    # ARP off on the bridge: the root namespace must never answer for a host (it may own an address
    # in 192.0.2.0/24 itself, and would claim it for the bridge's MAC)
    commands = [["ip", "link", "add", BRIDGE, "type", "bridge"], ["ip", "link", "set", BRIDGE, "arp", "off", "up"]]
    for host in range(spec.hosts):
        commands += host_commands(host, spec.segment_bytes)
        commands += shaping_commands(spec, host)
    return commands


def host_commands(host: int, segment: int) -> list[Command]:
    ns, inner, port = namespace(host), inner_interface(host), bridge_port(host)
    return [
        ["ip", "netns", "add", ns],
        ["ip", "netns", "exec", ns, "sysctl", "-qw", "net.ipv6.conf.all.disable_ipv6=1",
         "net.ipv6.conf.default.disable_ipv6=1", "net.ipv4.tcp_slow_start_after_idle=0"],
        ["ip", "link", "add", port, "type", "veth", "peer", "name", inner, "netns", ns],
        ["ip", "link", "set", port, "master", BRIDGE, "up"],
        ["ip", "-n", ns, "addr", "add", f"{address(host)}/24", "dev", inner],
        ["ip", "-n", ns, "link", "set", inner, "gso_max_size", str(segment)],
        ["ip", "-n", ns, "link", "set", inner, "up"],
        ["ip", "-n", ns, "link", "set", "lo", "up"],
    ]


def shaping_commands(spec: NetSpec, host: int) -> list[Command]:
    if spec.heterogeneous:
        return pair_shaping(spec.pair_gbps[host], host, spec.segment_bytes)
    return uniform_shaping(host, spec.gbps, spec.segment_bytes, "add")


def uniform_shaping(host: int, gbps: float, segment: int, verb: str, root: Command = ("tc",)) -> list[Command]:
    """`tbf` at `gbps` on the host's sending (inner end) and receiving (bridge port, reached by
    `root`), by tc's `verb`, for packets of at most `segment` bytes."""
    shaper = tbf(gbps, segment)
    return [["tc", "-n", namespace(host), "qdisc", verb, "dev", inner_interface(host), "root", *shaper],
            [*root, "qdisc", verb, "dev", bridge_port(host), "root", *shaper]]


def root_handle_command(pid: int) -> Command:
    """Name the network namespace of process `pid` (the root one) `ROOT_HANDLE`, so that commands
    run inside a host's namespace can reach the bridge ports (``rate_commands``)."""
    return ["ip", "netns", "attach", ROOT_HANDLE, str(pid)]


def rate_commands(spec: NetSpec, gbps: float) -> list[Command]:
    """The commands that set every link of a running uniform cluster, built from `spec`, to
    `gbps`, from any namespace (a rank's included): a network whose rate changes under a job. The
    hosts' packets keep the size `spec` gave them."""
    return [command for host in range(spec.hosts)
            for command in uniform_shaping(host, gbps, spec.segment_bytes, "replace", root=["tc", "-n", ROOT_HANDLE])]


def tbf(gbps: float, segment: int) -> Command:
    return ["tbf", "rate", kbit(gbps), "burst", str(burst_bytes(gbps, segment)), "latency", f"{QUEUE_LATENCY_MS}ms"]


def pair_shaping(rates: tuple[float, ...], host: int, segment: int) -> list[Command]:
    """An htb class per destination j at `rates[j]` (rate = ceil: no borrowing), filtered on j's address."""
    ns, device = namespace(host), inner_interface(host)
    tc = ["tc", "-n", ns]
    fastest = max(rate for j, rate in enumerate(rates) if j != host)
    default_class = f"1:{DEFAULT_CLASS}"
    commands = [[*tc, "qdisc", "add", "dev", device, "root", "handle", "1:", "htb", "default", str(DEFAULT_CLASS)],
                [*tc, "class", "add", "dev", device, "parent", "1:", "classid", default_class, *htb(fastest, segment)]]
    for destination, rate in enumerate(rates):
        if destination == host:
            continue
        classid = f"1:{destination_class(destination)}"
        commands += [[*tc, "class", "add", "dev", device, "parent", "1:", "classid", classid, *htb(rate, segment)],
                     [*tc, "filter", "add", "dev", device, "parent", "1:", "protocol", "ip", "prio", "1", "u32",
                      "match", "ip", "dst", f"{address(destination)}/32", "flowid", classid]]
    return commands


def destination_class(destination: int) -> int:
    """htb minor class id of traffic to `destination` (10 + host; 1 is the default class)."""
    return 10 + destination


def htb(gbps: float, segment: int) -> Command:
    burst = str(burst_bytes(gbps, segment))
    return ["htb", "rate", kbit(gbps), "ceil", kbit(gbps), "burst", burst, "cburst", burst,
            "quantum", str(HTB_QUANTUM)]


def teardown_commands(namespaces: list[str], links: list[str]) -> list[Command]:
    """Delete this testbed's bridge ports, namespaces and bridge among those given, nothing else.
    Ports go first: deleting a veth end removes the pair at once, while a namespace's own links
    are removed asynchronously after `ip netns del` returns."""
    ports = sorted(link for link in links if is_own_link(link) and link != BRIDGE)
    commands = [["ip", "link", "del", port] for port in ports]
    commands += [["ip", "netns", "del", name] for name in sorted(n for n in namespaces if is_own_namespace(n))]
    if BRIDGE in links:
        commands.append(["ip", "link", "del", BRIDGE])
    return commands


def parse_namespaces(ip_netns_list: str) -> list[str]:
    """Names from `ip netns list` ("name" or "name (id: 3)" per line)."""
    return [line.split()[0] for line in ip_netns_list.splitlines() if line.strip()]


def parse_links(ip_link_show: str) -> list[str]:
    """Names from `ip -o link show` ("3: name@peer: <FLAGS> ..." per line)."""
    names = []
    for line in ip_link_show.splitlines():
        fields = line.split(":", 2)
        if len(fields) == 3:
            names.append(fields[1].strip().split("@")[0])
    return names
