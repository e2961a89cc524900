"""``python -m benchmarks.netbed up|down|status``: build, remove or show the emulated cluster.

    up --hosts 4 --rate 1gbit              every host a 1 Gbit/s NIC (or 10gbit, or a number of Gbit/s)
    up --topology 2x2-pcie --inter-gbps 1  per-pair rates of a gradsync topology preset or file
"""
from __future__ import annotations

import argparse
import sys
from pathlib import Path

from gradsync import ConfigError
from gradsync.topology import load, preset

from .bed import LOCK_PATH, NetbedError, NetbedUnavailable, check_available, exclusive, status, teardown, up
from .spec import RATE_PRESETS, from_topology, uniform


def rate(text: str) -> float | str:
    return text if text in RATE_PRESETS else float(text)


def parser() -> argparse.ArgumentParser:
    cli = argparse.ArgumentParser(prog="python -m benchmarks.netbed", description=__doc__.splitlines()[0])
    commands = cli.add_subparsers(dest="command", required=True)
    build = commands.add_parser("up", help="build the testbed (removing any stale one first)")
    build.add_argument("--hosts", type=int, default=2, help="namespaces, 2 to 8 (uniform NICs)")
    build.add_argument("--rate", type=rate, default="1gbit", help=f"NIC rate: {', '.join(RATE_PRESETS)} or Gbit/s")
    build.add_argument("--topology", help="a gradsync topology preset (e.g. 2x2-pcie) or file: per-pair rates")
    build.add_argument("--inter-gbps", type=float, default=10.0, help="inter-machine Gbit/s of a cluster preset")
    commands.add_parser("down", help="remove every gsnet-* namespace and link")
    commands.add_parser("status", help="list the testbed's namespaces, links and root qdiscs")
    return cli


def spec_of(args):
    if args.topology is None:
        return uniform(args.hosts, args.rate)
    topology = load(args.topology) if Path(args.topology).exists() else preset(args.topology, args.inter_gbps)
    return from_topology(topology)


def main(argv=None) -> int:
    args = parser().parse_args(argv)
    try:
        check_available()
        if args.command == "status":
            print(status())
            return 0
        with exclusive(LOCK_PATH, wait=False):  # never pull a running benchmark's testbed away
            if args.command == "up":
                spec = spec_of(args)
                up(spec)
                print(f"netbed up: {spec.describe()}")
            else:
                teardown()
                print("netbed down")
    except (ConfigError, NetbedUnavailable, NetbedError) as error:
        print(f"error: {error}", file=sys.stderr)
        return 2
    return 0


if __name__ == "__main__":
    sys.exit(main())
