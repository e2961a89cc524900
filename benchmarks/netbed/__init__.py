"""An emulated cluster on one machine: one network namespace per rank, joined by a bridge, with
`tc` rate limits per host (uniform NICs) or per pair of hosts (heterogeneous topologies).

    with netbed(uniform(4, "1gbit")):
        results = launch("benchmarks.head_to_head:rank_main", 4, settings)

Needs root; `check_available` says what is missing before anything is created. Command line:
``python -m benchmarks.netbed up|down|status``.
"""
from .bed import NetbedBusy, NetbedError, NetbedUnavailable, check_available, netbed, status, teardown, up
from .commands import rate_commands, setup_commands
from .launcher import launch
from .spec import RATE_PRESETS, NetSpec, from_matrix, from_topology, uniform

__all__ = ["NetSpec", "NetbedBusy", "NetbedError", "NetbedUnavailable", "RATE_PRESETS", "check_available",
           "from_matrix", "from_topology", "launch", "netbed", "rate_commands", "setup_commands", "status", "teardown",
           "uniform", "up"]
