"""The WAN emulator against its own profile: real kernel TCP/UDP between namespaces,
measured round trip, throughput, loss, queueing and NAT behaviour.

Delay and rate are emulated, so CPU load beside can only add a little to what is
measured: round trips are judged by their minimum, throughput by bulk transfers past
slow start against the shaper's cap (a starved router can only fall below it), loss by
enough datagrams that 10 % of the expected loss is > 3 sigma.
"""

from __future__ import annotations

import json
import os
import signal
import statistics
import subprocess
import sys
import textwrap
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from volunteerd.testing.wan import LinkSpec, Profile, WanHost, open_wan, wan_available

pytestmark = pytest.mark.slow

PROBES = Path(__file__).with_name("probes.py")


@pytest.fixture(autouse=True)
def _needs_wan() -> None:
    available = wan_available()
    if not available:
        pytest.skip(available.reason)


def start(host: WanHost, *args: str) -> subprocess.Popen[str]:
    """Start a probe inside `host`, its stdout a pipe."""
    return host.popen([sys.executable, str(PROBES), *args], stdout=subprocess.PIPE, text=True)


def serve(host: WanHost, *args: str) -> subprocess.Popen[str]:
    """Start a probe server inside `host`; returns once it is bound."""
    process = start(host, *args)
    assert process.stdout is not None
    assert process.stdout.readline().strip() == "ready"
    return process


def probe(host: WanHost, *args: str) -> Any:
    """Run a probe client inside `host` to its end; its JSON result."""
    done = host.run(
        [sys.executable, str(PROBES), *args], capture_output=True, text=True, timeout=90
    )
    assert done.returncode == 0, done.stderr
    return json.loads(done.stdout.splitlines()[-1])


def result_of(process: subprocess.Popen[str]) -> Any:
    assert process.stdout is not None
    return json.loads(process.stdout.readline())


def wan_namespaces() -> set[str]:
    listed = subprocess.run(["ip", "netns", "list"], capture_output=True, text=True, check=True)
    return {line.split()[0] for line in listed.stdout.splitlines() if line.startswith("vdwan")}


def test_round_trip_is_twice_the_sum_of_both_delays() -> None:
    with open_wan([LinkSpec(delay_ms=15), LinkSpec(delay_ms=25)], seed=1) as wan:
        a, b = wan.hosts
        serve(b, "udp-echo", "7000")
        rtt_ms = probe(a, "udp-ping", b.public_address, "7000", "40")["rtt_ms"]
    assert min(rtt_ms) == pytest.approx(2 * (15 + 25), rel=0.1)


@pytest.mark.parametrize(
    ("sender", "receiver", "total", "expected_mbit"),
    [(0, 1, 10_000_000, 20.0), (1, 0, 2_500_000, 5.0)],
    ids=["uplink-bound", "downlink-bound"],
)
def test_tcp_throughput_is_the_narrower_of_uplink_and_downlink(
    sender: int, receiver: int, total: int, expected_mbit: float
) -> None:
    links = [
        LinkSpec(delay_ms=10, up_mbit=20, down_mbit=5),
        LinkSpec(delay_ms=10, up_mbit=50, down_mbit=50),
    ]
    with open_wan(links, seed=1) as wan:
        sink = serve(wan.hosts[receiver], "tcp-sink", "7001", str(total))
        probe(wan.hosts[sender], "tcp-send", wan.hosts[receiver].public_address, "7001", str(total))
        measured = result_of(sink)
    assert measured["bytes"] == total
    # payload rate: TCP/IP headers take 52 of every 1500 bytes on the link. The shaper
    # caps the rate, so that side is held tight; a CPU-heavy process beside can starve
    # the user-space router below it (14 of 19.3 Mbit/s was seen in CI), so the floor
    # only tells the links apart: the uplink-bound run is well above the 5 Mbit/s
    # downlink, and the downlink-bound one well below the 20 Mbit/s uplink.
    payload_mbit = expected_mbit * 1448 / 1500
    assert measured["mbit_s"] <= payload_mbit * 1.1
    assert measured["mbit_s"] >= payload_mbit * 0.5


def test_udp_loss_is_the_profile_loss() -> None:
    # 20000 datagrams at 5 % loss: sigma 0.15 %, so the 10 % band (0.5 %) is 3.2 sigma
    count = 20_000
    with open_wan([LinkSpec(loss=0.05), LinkSpec()], seed=3) as wan:
        a, b = wan.hosts
        counter = serve(b, "udp-count", "7002", "2")
        probe(a, "udp-blast", b.public_address, "7002", str(count), "2500", "200")
        received = result_of(counter)["received"]
        lost_by_router = wan.stats()[0].lost
    assert (count - received) / count == pytest.approx(0.05, rel=0.1)
    assert count - received == lost_by_router


def test_a_flood_waits_queue_ms_in_the_queue_then_is_dropped() -> None:
    # 8 Mbit/s into a 2 Mbit/s uplink whose queue holds 200 ms: queueing delay levels off
    # at 200 ms and three quarters of the datagrams are dropped, rather than the delay
    # growing for as long as the flood lasts
    link = LinkSpec(delay_ms=5, up_mbit=2, down_mbit=100, queue_ms=200)
    with open_wan([link, LinkSpec(delay_ms=5)], seed=1) as wan:
        a, b = wan.hosts
        counter = serve(b, "udp-count", "7003", "2")
        probe(a, "udp-blast", b.public_address, "7003", "3000", "1000", "1000")
        delay_ms = result_of(counter)["delay_ms"]
        dropped = wan.stats()[0].queue_dropped
    settled = delay_ms[len(delay_ms) // 2 :]
    # the queue bounds the wait from below; the router's own work under load adds a
    # little on top, never another queue's worth, and it does not grow with the flood
    bound = 5 + 200 + 5
    assert 0.9 * bound <= statistics.median(settled) <= 1.25 * bound
    assert statistics.median(delay_ms[3 * len(delay_ms) // 4 :]) <= 1.25 * bound
    # Not every datagram: on a loaded machine (a CI run beside other work) the router
    # process was once descheduled for ~300 ms, and the datagrams that waited in the
    # TUN device meanwhile arrived 502 ms late (the maximum this test asserted on).
    late = [d for d in settled if d >= 2 * bound]
    assert len(late) <= 0.1 * len(settled), sorted(settled)[-10:]
    assert dropped > 3000 / 2
    assert len(delay_ms) + dropped == 3000


def test_behind_symmetric_nat_a_host_dials_out_but_cannot_be_dialled() -> None:
    profile = Profile.of(LinkSpec(delay_ms=2)).override(1, nat="symmetric")
    with open_wan(profile, hosts=2, seed=1) as wan:
        public, hidden = wan.hosts
        assert hidden.address != hidden.public_address
        serve(hidden, "tcp-observe", "7100")
        inbound = probe(public, "tcp-connect", hidden.public_address, "7100", "2")
        serve(public, "tcp-observe", "7101")
        outbound = probe(hidden, "tcp-connect", public.public_address, "7101", "5")
        nat_dropped = wan.stats()[1].nat_dropped
    assert inbound == {"connected": False, "error": "TimeoutError"}
    assert nat_dropped > 0
    assert outbound["connected"]
    assert outbound["local"][0] == hidden.address
    # the peer sees the NAT's public address, not the private one
    assert json.loads(outbound["echo"])[0] == hidden.public_address


def test_cone_nat_keeps_the_port_of_a_tcp_connection() -> None:
    profile = Profile.of(LinkSpec(delay_ms=2)).override(1, nat="cone")
    with open_wan(profile, hosts=2, seed=1) as wan:
        public, hidden = wan.hosts
        serve(public, "tcp-observe", "7102")
        outbound = probe(hidden, "tcp-connect", public.public_address, "7102", "5")
    observed = json.loads(outbound["echo"])
    assert observed == [hidden.public_address, outbound["local"][1]]


@pytest.mark.parametrize(("nat", "reachable"), [("cone", True), ("symmetric", False)])
def test_a_third_host_reaches_a_udp_mapping_only_through_a_cone(nat: str, reachable: bool) -> None:
    # host 1 sends from port 7300 to host 0, which reports the public address and port it
    # saw; host 2 then sends to that address and port
    profile = Profile.of(LinkSpec(delay_ms=2)).override(1, nat=nat)
    with open_wan(profile, hosts=3, seed=1) as wan:
        observer, hidden, third = wan.hosts
        serve(observer, "udp-observe", "7200")
        hello = start(hidden, "udp-hello", observer.public_address, "7200", "7300", "3")
        assert hello.stdout is not None
        observed = json.loads(hello.stdout.readline())["observed"]
        assert observed[0] == hidden.public_address
        probe(third, "udp-knock", observed[0], str(observed[1]), "5")
        knock = result_of(hello)["knock"]
    if reachable:
        assert observed[1] == 7300  # a cone keeps the port where it is free
        assert knock == ["knock", third.public_address, knock[2]]
    else:
        assert knock is None


def test_no_namespace_outlives_the_block() -> None:
    with open_wan("home", hosts=3, seed=0) as wan:
        names = {host.namespace for host in wan.hosts}
        assert names <= wan_namespaces()
        wan.hosts[1].popen(["sleep", "600"])
    assert not names & wan_namespaces()


def _wait_for(condition: Any, timeout_s: float) -> bool:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if condition():
            return True
        time.sleep(0.2)
    return condition()


@pytest.mark.timeout(180)
def test_a_killed_owner_leaves_no_namespace_behind() -> None:
    owner_code = textwrap.dedent(
        """
        import sys, time
        from volunteerd.testing.wan import open_wan
        with open_wan("lan", hosts=2) as wan:
            wan.hosts[0].popen(["sleep", "600"])
            print(" ".join(host.namespace for host in wan.hosts), flush=True)
            time.sleep(600)
        """
    )
    owner = subprocess.Popen([sys.executable, "-c", owner_code], stdout=subprocess.PIPE, text=True)
    assert owner.stdout is not None
    try:
        names = set(owner.stdout.readline().split())
        assert len(names) == 2
        assert names <= wan_namespaces()
    finally:
        os.kill(owner.pid, signal.SIGKILL)
        owner.wait()
        owner.stdout.close()
    # the router sees its owner's end of the control pipe close and cleans up
    assert _wait_for(lambda: not names & wan_namespaces(), timeout_s=30)


def test_a_new_wan_sweeps_what_a_dead_owner_left() -> None:
    dead = subprocess.Popen(["true"])
    dead.wait()
    stale = f"vdwan{dead.pid}w0h0"
    subprocess.run(["ip", "netns", "add", stale], check=True)
    try:
        with open_wan("lan", hosts=1):
            assert stale not in wan_namespaces()
    finally:
        subprocess.run(["ip", "netns", "delete", stale], capture_output=True, check=False)


@pytest.fixture(autouse=True)
def _no_leftovers() -> Iterator[None]:
    yield
    # other processes may run WANs of their own meanwhile: only ours are checked
    assert not {name for name in wan_namespaces() if name.startswith(f"vdwan{os.getpid()}w")}
