"""The emulated-cluster testbed: command construction, teardown and launching without root, and
one short real shaped 2-rank run where network namespaces are available."""
import json
import os
import signal
import subprocess
from pathlib import Path

import pytest

from benchmarks.netbed import bed, launcher, rank
from benchmarks.netbed.commands import (parse_links, parse_namespaces, rate_commands, root_handle_command, setup_commands,
                                       teardown_commands)
from benchmarks.netbed.spec import NetSpec, from_matrix, from_topology, uniform
from gradsync import ConfigError
from gradsync.launch import RankFailed
from gradsync.topology import complete, preset

MB = 1 << 20


# -- specs -------------------------------------------------------------------------------------------
def test_uniform_presets_and_numbers():
    assert uniform(2, "1gbit").gbps == 1.0
    assert uniform(8, "10gbit").gbps == 10.0
    assert uniform(3, 2.5).gbps == 2.5


@pytest.mark.parametrize("make, field", [
    (lambda: uniform(1, 1.0), "'hosts'"), (lambda: uniform(9, 1.0), "'hosts'"),
    (lambda: uniform(2, "3gbit"), "1gbit, 10gbit"), (lambda: uniform(2, 0.0), "'gbps'"),
    (lambda: uniform(2, float("inf")), "'gbps'"), (lambda: NetSpec(2, gbps=1e6), "'gbps'"),
    (lambda: NetSpec(2), "exactly one"), (lambda: NetSpec(2, gbps=1.0, pair_gbps=((0, 1), (1, 0))), "exactly one"),
    (lambda: from_matrix([[0, 1, 1], [1, 0, 1]]), "square"), (lambda: from_matrix([[0, 1], [-1, 0]]), ">= 0"),
    (lambda: from_matrix([[0, 1, 0], [1, 0, 0], [0, 0, 0]]), "no path from host 0 to host 2"),
])
def test_bad_specs_name_the_field(make, field):
    with pytest.raises(ConfigError) as error:
        make()
    assert field in str(error.value)


def test_missing_pairs_take_the_widest_path():
    # 0 - 1 at 1 Gbit/s, 1 - 2 at 2 Gbit/s, no 0 - 2 link: 0 → 2 goes through 1 at min(1, 2)
    spec = from_matrix([[0, 1, 0], [1, 0, 2], [0, 2, 0]])
    assert spec.pair_gbps == ((0.0, 1.0, 1.0), (1.0, 0.0, 2.0), (1.0, 2.0, 0.0))


def test_topology_workers_map_to_hosts_in_order():
    assert from_topology(complete(3, 2.0)).pair_gbps == ((0.0, 2.0, 2.0), (2.0, 0.0, 2.0), (2.0, 2.0, 0.0))
    # 2 machines × 2 GPUs: 100 Gbit/s PCIe inside a machine, 1 Gbit/s between machines
    pairs = from_topology(preset("2x2-pcie", inter_gbps=1.0)).pair_gbps
    assert pairs[0] == (0.0, 100.0, 1.0, 1.0)
    assert pairs[3] == (1.0, 1.0, 100.0, 0.0)


# -- commands ----------------------------------------------------------------------------------------
def host_zero_commands(segment: int):
    return [
        ["ip", "netns", "add", "gsnet-0"],
        ["ip", "netns", "exec", "gsnet-0", "sysctl", "-qw", "net.ipv6.conf.all.disable_ipv6=1",
         "net.ipv6.conf.default.disable_ipv6=1", "net.ipv4.tcp_slow_start_after_idle=0"],
        ["ip", "link", "add", "gsnet-0-br", "type", "veth", "peer", "name", "gsnet-0-ns", "netns", "gsnet-0"],
        ["ip", "link", "set", "gsnet-0-br", "master", "gsnet-br", "up"],
        ["ip", "-n", "gsnet-0", "addr", "add", "192.0.2.1/24", "dev", "gsnet-0-ns"],
        ["ip", "-n", "gsnet-0", "link", "set", "gsnet-0-ns", "gso_max_size", str(segment)],
        ["ip", "-n", "gsnet-0", "link", "set", "gsnet-0-ns", "up"],
        ["ip", "-n", "gsnet-0", "link", "set", "lo", "up"],
    ]


def test_uniform_setup_shapes_both_directions_of_every_host():
    commands = setup_commands(uniform(2, "1gbit"))
    assert commands[:2] == [["ip", "link", "add", "gsnet-br", "type", "bridge"],
                            ["ip", "link", "set", "gsnet-br", "arp", "off", "up"]]
    # 1 Gbit/s: packets of half a millisecond at the rate, a bucket of one millisecond
    tbf = ["tbf", "rate", "1000000kbit", "burst", "125000", "latency", "20ms"]
    assert commands[2:12] == host_zero_commands(62500) + [
        ["tc", "-n", "gsnet-0", "qdisc", "add", "dev", "gsnet-0-ns", "root", *tbf],
        ["tc", "qdisc", "add", "dev", "gsnet-0-br", "root", *tbf]]
    assert ["ip", "-n", "gsnet-1", "addr", "add", "192.0.2.2/24", "dev", "gsnet-1-ns"] in commands
    assert len(commands) == 2 + 2 * 10


def test_rate_commands_replace_every_hosts_shaping_from_any_namespace():
    # built at 1 Gbit/s: the hosts' connections keep packets of 62 500 bytes, and the bucket two of them
    commands = rate_commands(uniform(2, 1.0), 0.25)
    tbf = ["tbf", "rate", "250000kbit", "burst", "125000", "latency", "20ms"]
    assert commands == [["tc", "-n", "gsnet-0", "qdisc", "replace", "dev", "gsnet-0-ns", "root", *tbf],
                        ["tc", "-n", "gsnet-root", "qdisc", "replace", "dev", "gsnet-0-br", "root", *tbf],
                        ["tc", "-n", "gsnet-1", "qdisc", "replace", "dev", "gsnet-1-ns", "root", *tbf],
                        ["tc", "-n", "gsnet-root", "qdisc", "replace", "dev", "gsnet-1-br", "root", *tbf]]
    # the handle of the root namespace is the testbed's own: made by `up`, removed by the teardown
    assert root_handle_command(42) == ["ip", "netns", "attach", "gsnet-root", "42"]
    assert teardown_commands(["gsnet-root", "other"], []) == [["ip", "netns", "del", "gsnet-root"]]


def test_fast_links_get_a_millisecond_of_burst():
    commands = setup_commands(uniform(2, "10gbit"))
    assert commands[7][-2:] == ["gso_max_size", "65536"]
    assert commands[10][-6:] == ["rate", "10000000kbit", "burst", "1250000", "latency", "20ms"]


def test_slow_links_send_small_packets_so_a_pause_buys_no_burst():
    # 31.25 Mbit/s: 64 KiB packets would need a 128 KiB bucket, 34 ms of traffic sent at once after a pause
    commands = setup_commands(uniform(2, 0.03125))
    assert commands[7][-2:] == ["gso_max_size", "4096"]
    assert commands[10][-6:] == ["rate", "31250kbit", "burst", "8192", "latency", "20ms"]


def test_pair_setup_has_a_class_and_filter_per_destination():
    commands = setup_commands(from_matrix([[0, 1, 0], [1, 0, 2], [0, 2, 0]]))
    tc = ["tc", "-n", "gsnet-1"]
    host_one = [c for c in commands if c[:3] == tc]

    def htb(kbit, burst):
        return ["htb", "rate", kbit, "ceil", kbit, "burst", burst, "cburst", burst, "quantum", "60000"]

    assert host_one == [
        [*tc, "qdisc", "add", "dev", "gsnet-1-ns", "root", "handle", "1:", "htb", "default", "1"],
        [*tc, "class", "add", "dev", "gsnet-1-ns", "parent", "1:", "classid", "1:1", *htb("2000000kbit", "250000")],
        [*tc, "class", "add", "dev", "gsnet-1-ns", "parent", "1:", "classid", "1:10", *htb("1000000kbit", "125000")],
        [*tc, "filter", "add", "dev", "gsnet-1-ns", "parent", "1:", "protocol", "ip", "prio", "1", "u32",
         "match", "ip", "dst", "192.0.2.1/32", "flowid", "1:10"],
        [*tc, "class", "add", "dev", "gsnet-1-ns", "parent", "1:", "classid", "1:12", *htb("2000000kbit", "250000")],
        [*tc, "filter", "add", "dev", "gsnet-1-ns", "parent", "1:", "protocol", "ip", "prio", "1", "u32",
         "match", "ip", "dst", "192.0.2.3/32", "flowid", "1:12"],
    ]
    assert not any(c[0] == "tc" and "tbf" in c for c in commands)


def test_teardown_deletes_only_its_own_names_ports_first():
    namespaces = ["gsnet-0", "other", "gsnet-12", "gsnet-x", "gsnet-1-ns"]
    links = ["lo", "eth0", "gsnet-br", "gsnet-0-br", "gsnet-brx", "gsnet-0-ns", "docker0"]
    assert teardown_commands(namespaces, links) == [
        ["ip", "link", "del", "gsnet-0-br"],
        ["ip", "netns", "del", "gsnet-0"], ["ip", "netns", "del", "gsnet-12"],
        ["ip", "link", "del", "gsnet-br"],
    ]
    assert teardown_commands(["other"], ["eth0"]) == []


def test_parsing_of_ip_listings():
    assert parse_namespaces("gsnet-1 (id: 1)\ngsnet-0 (id: 0)\nblue\n\n") == ["gsnet-1", "gsnet-0", "blue"]
    listing = ("1: lo: <LOOPBACK,UP,LOWER_UP> mtu 65536 qdisc noqueue\\    link/loopback 00:00:00:00:00:00\n"
               "6: gsnet-0-br@if2: <BROADCAST,MULTICAST,UP> mtu 1500 qdisc tbf master gsnet-br\\    link/ether\n")
    assert parse_links(listing) == ["lo", "gsnet-0-br"]


# -- setup and teardown with a fake `ip` -----------------------------------------------------------
class FakeIp:
    """Stands in for subprocess.run: records commands and keeps the namespaces and root links they
    create, so that listings reflect them; fails the command numbered `fail_at` if given."""

    def __init__(self, namespaces=(), links=("lo", "eth0"), fail_at=None):
        self.namespaces, self.links = list(namespaces), list(links)
        self.commands, self.fail_at = [], fail_at

    def __call__(self, command, check=True, capture_output=True, text=True):
        self.commands.append(command)
        if len(self.commands) == self.fail_at:
            raise subprocess.CalledProcessError(2, command, stderr="RTNETLINK answers: Operation not permitted")
        output = ""
        if command == ["ip", "netns", "list"]:
            output = "".join(f"{n} (id: {i})\n" for i, n in enumerate(self.namespaces))
        elif command == ["ip", "-o", "link", "show"]:
            output = "".join(f"{i}: {name}: <UP> mtu 1500\n" for i, name in enumerate(self.links))
        else:
            self.apply(command)
        return subprocess.CompletedProcess(command, 0, stdout=output, stderr="")

    def apply(self, command):
        if command[:3] == ["ip", "netns", "add"]:
            self.namespaces.append(command[3])
        elif command[:3] == ["ip", "netns", "del"]:
            self.namespaces.remove(command[3])
        elif command[:3] == ["ip", "link", "add"]:
            self.links.append(command[3])
        elif command[:3] == ["ip", "link", "del"]:
            self.links.remove(command[3])

    def deletions(self):
        return [c for c in self.commands if c[:2] in (["ip", "link"], ["ip", "netns"]) and c[2] == "del"]


@pytest.fixture
def as_root(monkeypatch):
    monkeypatch.setattr(bed, "check_available", lambda: None)


def test_netbed_removes_stale_state_builds_and_tears_down(as_root, tmp_path):
    fake = FakeIp(namespaces=["gsnet-5", "blue"], links=["lo", "eth0", "gsnet-br"])
    with bed.netbed(uniform(2, 1.0), run=fake, lock=tmp_path / "lock"):
        assert sorted(fake.namespaces) == ["blue", "gsnet-0", "gsnet-1"]
        assert fake.deletions() == [["ip", "netns", "del", "gsnet-5"], ["ip", "link", "del", "gsnet-br"]]
    assert fake.namespaces == ["blue"] and fake.links == ["lo", "eth0"]


def test_teardown_runs_when_the_block_raises(as_root, tmp_path):
    fake = FakeIp()
    with pytest.raises(KeyError):
        with bed.netbed(uniform(3, 1.0), run=fake, lock=tmp_path / "lock"):
            raise KeyError("a failing benchmark")
    assert fake.namespaces == [] and fake.links == ["lo", "eth0"]


def test_a_failing_setup_command_is_reported_and_undone(as_root, tmp_path):
    fake = FakeIp(fail_at=8)  # two listings, the bridge (2 commands), then host 0's fourth command
    with pytest.raises(bed.NetbedError, match="Operation not permitted"):
        with bed.netbed(uniform(2, 1.0), run=fake, lock=tmp_path / "lock"):
            pytest.fail("the block must not run")
    assert fake.namespaces == [] and fake.links == ["lo", "eth0"]


def test_without_root_nothing_is_created(monkeypatch, tmp_path):
    monkeypatch.setattr(bed.os, "geteuid", lambda: 1000)
    fake = FakeIp()
    with pytest.raises(bed.NetbedUnavailable, match=r"root \(running as uid 1000\)"):
        with bed.netbed(uniform(2, 1.0), run=fake, lock=tmp_path / "lock"):
            pytest.fail("the block must not run")
    assert fake.commands == []


def test_a_second_user_is_told_the_testbed_is_busy(as_root, tmp_path):
    with bed.exclusive(tmp_path / "lock", wait=False):
        with pytest.raises(bed.NetbedBusy, match="another process"):
            with bed.netbed(uniform(2, 1.0), run=FakeIp(), wait=False, lock=tmp_path / "lock"):
                pytest.fail("the block must not run")


def test_missing_requirements_are_named():
    assert bed.missing_requirements(1000, {"ip": True, "tc": False}, 0) == [
        "root (running as uid 1000)", "the 'tc' command", "CAP_NET_ADMIN", "CAP_SYS_ADMIN"]
    # bits 12 (CAP_NET_ADMIN) and 21 (CAP_SYS_ADMIN) set
    assert bed.missing_requirements(0, {"ip": True}, (1 << 12) | (1 << 21)) == []
    assert bed.effective_capabilities("CapInh:\t0000000000000000\nCapEff:\t000001fffeffffff\n") == 0x1fffeffffff


def test_sigterm_inside_the_block_becomes_system_exit():
    before = signal.getsignal(signal.SIGTERM)
    with pytest.raises(SystemExit) as leaving:
        with bed.teardown_on_signals():
            os.kill(os.getpid(), signal.SIGTERM)
    assert leaving.value.code == 128 + signal.SIGTERM
    assert signal.getsignal(signal.SIGTERM) is before


# -- launcher ----------------------------------------------------------------------------------------
def test_rank_command_and_environment():
    assert launcher.rank_command(1, Path("/tmp/job.json"), "/venv/python") == [
        "ip", "netns", "exec", "gsnet-1", "/venv/python", "-m", "benchmarks.netbed.rank", "/tmp/job.json", "1"]
    environment = launcher.rank_environment(1, 4, {"PATH": "/bin", "RANK": "7"})
    assert environment == {"PATH": "/bin", "GLOO_SOCKET_IFNAME": "gsnet-1-ns", "RANK": "1", "WORLD_SIZE": "4",
                           "MASTER_ADDR": "192.0.2.1", "MASTER_PORT": "29500"}


def test_collect_returns_values_or_names_the_failed_ranks(tmp_path):
    launcher.result_path(tmp_path, 0).write_text(json.dumps({"status": "ok", "value": [1, 2]}))
    launcher.result_path(tmp_path, 1).write_text(json.dumps({"status": "ok", "value": {"a": 3}}))
    assert launcher.collect(tmp_path, 2, [0, 0]) == [[1, 2], {"a": 3}]
    launcher.result_path(tmp_path, 1).write_text(json.dumps({"status": "error", "error": "ValueError: bad"}))
    (tmp_path / "rank-2.log").write_text("Killed")
    with pytest.raises(RankFailed) as failed:
        launcher.collect(tmp_path, 3, [0, 1, -9])
    assert str(failed.value) == "rank 1: ValueError: bad\nrank 2: no result (exit code -9); output:\nKilled"


def test_a_rank_writes_its_result_or_its_error(tmp_path, monkeypatch):
    monkeypatch.setenv("GLOO_SOCKET_IFNAME", "lo")
    monkeypatch.setattr(rank.torch, "set_num_threads", lambda threads: None)  # keep this process's setting

    def job_file(target, args, name):
        path = tmp_path / f"{name}.json"
        path.write_text(json.dumps({"target": target, "args": args, "world_size": 1, "threads": 1, "timeout": 30,
                                    "rendezvous": str(tmp_path / f"{name}-rendezvous"), "results": str(tmp_path)}))
        return str(path)

    # target(rank, world_size, *args): max(0, 1, 5) on the only rank
    assert rank.main(job_file("builtins:max", [5], "good"), "0") == 0
    assert json.loads(launcher.result_path(tmp_path, 0).read_text()) == {"status": "ok", "value": 5}
    assert rank.main(job_file("operator:getitem", [], "bad"), "0") == 1
    outcome = json.loads(launcher.result_path(tmp_path, 0).read_text())
    assert outcome["status"] == "error" and outcome["error"].startswith("TypeError: 'int' object is not subscriptable")


# -- one real shaped run -------------------------------------------------------------------------------
def test_a_shaped_link_holds_two_ranks_to_its_rate():
    """8 MiB all-reduced by 2 ranks: each sends 8 MiB, which a 1 Gbit/s token bucket of 128 KiB
    cannot pass in less than (8 MiB − 128 KiB)·8 / 1e9 s = 66.1 ms (unshaped veth takes ~20 ms)."""
    try:
        with bed.netbed(uniform(2, "1gbit"), wait=False):
            seconds = launcher.launch("benchmarks.netbed.probe:allreduce_seconds", 2, 8 * MB, 2, timeout=50)
            # an idle connection keeps its congestion window, as in training (no slow start per block)
            idle_restart = subprocess.run(["ip", "netns", "exec", "gsnet-1", "sysctl", "-n",
                                           "net.ipv4.tcp_slow_start_after_idle"], capture_output=True, text=True)
    except (bed.NetbedUnavailable, bed.NetbedBusy) as reason:
        pytest.skip(str(reason))
    except bed.NetbedError as failure:
        if "not permitted" not in str(failure).lower():
            raise
        pytest.skip(f"network namespaces cannot be created here: {failure}")
    assert seconds[0] == seconds[1]  # both report the slower rank's time
    assert idle_restart.stdout.strip() == "0"
    assert 0.95 * (8 * MB - 128 * 1024) * 8 / 1e9 <= seconds[0] < 0.5
    assert bed.read_state() == ([], [])
