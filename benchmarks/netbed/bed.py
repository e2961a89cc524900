"""Build, inspect and remove the emulated cluster on this machine (needs root).

`netbed(spec)` is the way in: it checks the requirements before creating anything, removes any
stale testbed state, builds `spec`, and removes everything again on exit — after an exception,
Ctrl-C, SIGTERM or SIGHUP too. Only names this testbed owns (``gsnet-*``) are ever deleted.
"""
from __future__ import annotations

import fcntl
import os
import shutil
import signal
import subprocess
import tempfile
import threading
from contextlib import contextmanager
from pathlib import Path

from .commands import Command, parse_links, parse_namespaces, root_handle_command, setup_commands, teardown_commands
from .spec import NetSpec, is_own_link, is_own_namespace

TOOLS = ("ip", "tc", "sysctl")
CAPABILITIES = {"CAP_NET_ADMIN": 12, "CAP_SYS_ADMIN": 21}  # bit numbers in /proc/<pid>/status CapEff
TEARDOWN_SIGNALS = (signal.SIGTERM, signal.SIGHUP)
LOCK_PATH = Path(tempfile.gettempdir()) / "gsnet.lock"


class NetbedUnavailable(RuntimeError):
    """This machine cannot host the testbed: not root, a tool missing, or no namespace capability."""


class NetbedBusy(NetbedUnavailable):
    """Another process holds the testbed (its setup would tear down that process's namespaces)."""


class NetbedError(RuntimeError):
    """An `ip` or `tc` command failed; the message holds the command and its error output."""


def missing_requirements(euid: int, found_tools: dict[str, bool], effective_capabilities: int) -> list[str]:
    """What stops this process from building namespaces, in words (empty when nothing does)."""
    missing = [] if euid == 0 else [f"root (running as uid {euid})"]
    missing += [f"the '{tool}' command" for tool, found in found_tools.items() if not found]
    missing += [name for name, bit in CAPABILITIES.items() if not effective_capabilities >> bit & 1]
    return missing


def effective_capabilities(status_text: str) -> int:
    """The CapEff bit mask of a /proc/<pid>/status text (0 when absent)."""
    for line in status_text.splitlines():
        if line.startswith("CapEff:"):
            return int(line.split()[1], 16)
    return 0


def check_available() -> None:
    """Raise NetbedUnavailable, naming what is missing, unless namespaces can be built here."""
    missing = missing_requirements(os.geteuid(), {tool: shutil.which(tool) is not None for tool in TOOLS},
                                   effective_capabilities(Path("/proc/self/status").read_text()))
    if missing:
        raise NetbedUnavailable("the network testbed needs " + ", ".join(missing) +
                                ": run it as root on a machine that allows network namespaces")


def run_commands(commands: list[Command], run=subprocess.run) -> None:
    for command in commands:
        try:
            run(command, check=True, capture_output=True, text=True)
        except subprocess.CalledProcessError as failure:
            raise NetbedError(f"`{' '.join(command)}` failed: {(failure.stderr or '').strip()}") from failure


def read_state(run=subprocess.run) -> tuple[list[str], list[str]]:
    """(namespaces, root-namespace links) of this testbed that exist now."""
    namespaces = parse_namespaces(run(["ip", "netns", "list"], check=True, capture_output=True, text=True).stdout)
    links = parse_links(run(["ip", "-o", "link", "show"], check=True, capture_output=True, text=True).stdout)
    return [n for n in namespaces if is_own_namespace(n)], [link for link in links if is_own_link(link)]


def teardown(run=subprocess.run) -> None:
    """Remove every namespace and link of this testbed (idempotent)."""
    run_commands(teardown_commands(*read_state(run)), run)


def up(spec: NetSpec, run=subprocess.run) -> None:
    """Build `spec` after removing stale state; on a failure remove what was built and re-raise."""
    teardown(run)
    try:
        run_commands([*setup_commands(spec), root_handle_command(os.getpid())], run)
    except BaseException:
        teardown(run)
        raise


def status(run=subprocess.run) -> str:
    namespaces, links = read_state(run)
    if not namespaces and not links:
        return "netbed: down"
    lines = [f"netbed: namespaces {', '.join(namespaces) or '-'}; links {', '.join(links) or '-'}"]
    for name in namespaces:
        qdiscs = run(["tc", "-n", name, "qdisc", "show"], check=True, capture_output=True, text=True).stdout
        lines += [f"  {name}: {line.strip()}" for line in qdiscs.splitlines() if f" dev {name}-ns root " in line]
    return "\n".join(lines)


@contextmanager
def teardown_on_signals():
    """Turn SIGTERM and SIGHUP into SystemExit inside the block (SIGINT already raises), so that
    `finally` clauses run; the previous handlers come back afterwards. Main thread only."""
    if threading.current_thread() is not threading.main_thread():
        yield
        return

    def leave(signum, _frame):
        raise SystemExit(128 + signum)

    previous = {sig: signal.signal(sig, leave) for sig in TEARDOWN_SIGNALS}
    try:
        yield
    finally:
        for sig, handler in previous.items():
            signal.signal(sig, handler)


@contextmanager
def exclusive(lock: Path, wait: bool):
    """Hold the testbed's lock file for the block: one testbed user at a time on this machine."""
    with open(lock, "w") as handle:
        try:
            fcntl.flock(handle, fcntl.LOCK_EX | (0 if wait else fcntl.LOCK_NB))
        except BlockingIOError:
            raise NetbedBusy(f"another process is using the network testbed (lock {lock})") from None
        yield


@contextmanager
def netbed(spec: NetSpec, run=subprocess.run, wait: bool = True, lock: Path = LOCK_PATH):
    """The testbed of `spec` for the duration of the block; always torn down afterwards (nothing
    is created, and nothing torn down, when the requirements are missing). Waits for another
    user's testbed to go, or raises NetbedBusy without `wait`."""
    check_available()
    with exclusive(lock, wait), teardown_on_signals():
        try:
            up(spec, run)
            yield spec
        finally:
            teardown(run)
