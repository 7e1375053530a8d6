"""The WAN router: one process that carries every packet between the hosts.

`open_wan` starts it (`router.main`); it reads its configuration as one JSON line on
stdin, creates each host's namespace and TUN device (opened inside the namespace: a TUN
moved there afterwards fails every read with EFAULT), configures the addresses, prints
`ready` and then forwards packets until stdin reaches EOF: so it ends when the process
that started it ends, however that ends, and deletes the namespaces on the way out. Each
further stdin line `stats` is answered with one JSON line of per-host counters.

A packet from host A to host B: A's NAT (if any) -> A's link: loss, uplink queue ->
A's delay (+ jitter) -> B's link: loss, B's NAT, downlink queue -> B's delay (+ jitter)
-> B's TUN. One thread, an epoll over the TUNs and stdin, a heap of release times.
"""

from __future__ import annotations

import contextlib
import ctypes
import fcntl
import heapq
import json
import os
import random
import selectors
import signal
import struct
import subprocess
import sys
import time
from dataclasses import asdict, dataclass
from typing import Any

from volunteerd.testing.wan.link import Link
from volunteerd.testing.wan.nat import Nat
from volunteerd.testing.wan.packet import address_int
from volunteerd.testing.wan.profile import LinkSpec

TUN_NAME = "wan0"
PUBLIC_NETWORK = "10.200.0.0/16"
_TUNSETIFF = 0x400454CA
_IFF_TUN = 0x0001
_IFF_NO_PI = 0x1000
_CLONE_NEWNET = 0x40000000
_NAT_EXPIRY_PERIOD_S = 10.0
_READS_PER_WAKEUP = 256
# stages of a packet on the heap
_AT_CORE = 0
_DELIVER = 1


@dataclass(slots=True)
class Counters:
    """What crossed one host's link; drops are counted on the host whose link dropped."""

    sent_packets: int = 0
    sent_bytes: int = 0
    received_packets: int = 0
    received_bytes: int = 0
    lost: int = 0  # random loss on this host's link
    queue_dropped: int = 0  # its up- or downlink queue was full
    nat_dropped: int = 0  # its NAT had no mapping (or one the sender may not use)
    unroutable: int = 0  # it sent to an address no host has, or not IPv4


class HostLink:
    """A host as the router sees it: the TUN fd its packets come and go through, its
    link's two directions and properties, its NAT, its counters."""

    __slots__ = (
        "counters",
        "delay_s",
        "down",
        "fd",
        "index",
        "jitter_s",
        "loss",
        "nat",
        "public",
        "up",
    )

    def __init__(self, index: int, fd: int, public: int, spec: LinkSpec, mtu: int) -> None:
        self.index = index
        self.fd = fd
        self.public = public
        self.up = Link(spec.up_mbit, spec.queue_ms, mtu)
        self.down = Link(spec.down_mbit, spec.queue_ms, mtu)
        self.delay_s = spec.delay_ms / 1000
        self.jitter_s = spec.jitter_ms / 1000
        self.loss = spec.loss
        self.nat: Nat | None = None
        self.counters = Counters()


class Router:
    """Forwards packets between the hosts' TUN fds with their links' properties."""

    def __init__(self, hosts: list[HostLink], seed: int, mtu: int) -> None:
        self._hosts = hosts
        self._by_public = {host.public: host for host in hosts}
        self._rng = random.Random(seed)
        self._mtu = mtu
        # (release time, sequence, stage, source index, destination index, packet)
        self._heap: list[tuple[float, int, int, int, int, bytes]] = []
        self._sequence = 0
        # last release per (stage, source, destination): jitter never reorders a path
        self._last_release: dict[tuple[int, int, int], float] = {}
        self._next_expiry = 0.0

    def receive(self, source: HostLink, packet: bytes, now: float) -> None:
        """A packet `source` sent, read from its TUN at `now`."""
        counters = source.counters
        counters.sent_packets += 1
        counters.sent_bytes += len(packet)
        if len(packet) < 20 or packet[0] >> 4 != 4:
            counters.unroutable += 1  # IPv6 router solicitations and the like
            return
        if source.nat is not None:
            rewritten = bytearray(packet)
            if not source.nat.outbound(rewritten, now):
                counters.nat_dropped += 1
                return
            packet = bytes(rewritten)
        destination = self._by_public.get(int.from_bytes(packet[16:20], "big"))
        if destination is None:
            counters.unroutable += 1
            return
        if source.loss and self._rng.random() < source.loss:
            counters.lost += 1
            return
        left = source.up.admit(now, len(packet))
        if left is None:
            counters.queue_dropped += 1
            return
        release = left + source.delay_s
        if source.jitter_s:
            release = self._monotonic(
                _AT_CORE, source, destination, release + self._rng.random() * source.jitter_s
            )
        self._schedule(release, _AT_CORE, source, destination, packet, now)

    def _at_core(
        self, source: HostLink, destination: HostLink, packet: bytes, at: float, now: float
    ) -> None:
        counters = destination.counters
        if destination.loss and self._rng.random() < destination.loss:
            counters.lost += 1
            return
        if destination.nat is not None:
            rewritten = bytearray(packet)
            if not destination.nat.inbound(rewritten, at):
                counters.nat_dropped += 1
                return
            packet = bytes(rewritten)
        left = destination.down.admit(at, len(packet))
        if left is None:
            counters.queue_dropped += 1
            return
        release = left + destination.delay_s
        if destination.jitter_s:
            release = self._monotonic(
                _DELIVER, source, destination, release + self._rng.random() * destination.jitter_s
            )
        self._schedule(release, _DELIVER, source, destination, packet, now)

    def _deliver(self, destination: HostLink, packet: bytes) -> None:
        try:
            os.write(destination.fd, packet)
        except OSError:
            destination.counters.queue_dropped += 1  # the host's TUN queue is full
            return
        destination.counters.received_packets += 1
        destination.counters.received_bytes += len(packet)

    def _monotonic(
        self, stage: int, source: HostLink, destination: HostLink, release: float
    ) -> float:
        key = (stage, source.index, destination.index)
        release = max(release, self._last_release.get(key, 0.0))
        self._last_release[key] = release
        return release

    def _schedule(
        self,
        release: float,
        stage: int,
        source: HostLink,
        destination: HostLink,
        packet: bytes,
        now: float,
    ) -> None:
        if release <= now:
            self._run(stage, source, destination, packet, release, now)
            return
        self._sequence += 1
        heapq.heappush(
            self._heap, (release, self._sequence, stage, source.index, destination.index, packet)
        )

    def _run(
        self,
        stage: int,
        source: HostLink,
        destination: HostLink,
        packet: bytes,
        at: float,
        now: float,
    ) -> None:
        if stage == _AT_CORE:
            self._at_core(source, destination, packet, at, now)
        else:
            self._deliver(destination, packet)

    def release_due(self, now: float) -> float | None:
        """Move every packet due by `now` on; returns seconds until the next is due."""
        heap = self._heap
        hosts = self._hosts
        while heap and heap[0][0] <= now:
            at, _, stage, source, destination, packet = heapq.heappop(heap)
            self._run(stage, hosts[source], hosts[destination], packet, at, now)
        if now >= self._next_expiry:
            self._next_expiry = now + _NAT_EXPIRY_PERIOD_S
            for host in hosts:
                if host.nat is not None:
                    host.nat.expire(now)
        return heap[0][0] - now if heap else None

    def serve(self, control_fd: int) -> None:
        """Forward until `control_fd` (stdin) reaches EOF; answer its `stats` lines."""
        selector = selectors.EpollSelector()
        for host in self._hosts:
            selector.register(host.fd, selectors.EVENT_READ, host)
        selector.register(control_fd, selectors.EVENT_READ, None)
        pending = b""
        read = os.read
        monotonic = time.monotonic
        size = self._mtu + 64
        timeout: float | None = None
        while True:
            for key, _ in selector.select(timeout):
                host = key.data
                if host is None:
                    chunk = read(control_fd, 4096)
                    if not chunk:
                        return
                    pending += chunk
                    while b"\n" in pending:
                        line, pending = pending.split(b"\n", 1)
                        self._command(line.decode().strip())
                    continue
                now = monotonic()
                for _ in range(_READS_PER_WAKEUP):
                    try:
                        packet = read(host.fd, size)
                    except BlockingIOError:
                        break
                    self.receive(host, packet, now)
            timeout = self.release_due(monotonic())

    def _command(self, line: str) -> None:
        if line == "stats":
            reply = [asdict(host.counters) for host in self._hosts]
            sys.stdout.write(json.dumps(reply) + "\n")
            sys.stdout.flush()


def _open_tun_in(namespace: str) -> int:
    """A TUN fd whose device lives in `namespace` (entered for the open, then left)."""
    libc = ctypes.CDLL(None, use_errno=True)
    own = os.open("/proc/self/ns/net", os.O_RDONLY)
    target = os.open(f"/run/netns/{namespace}", os.O_RDONLY)
    try:
        if libc.setns(target, _CLONE_NEWNET) != 0:
            raise OSError(ctypes.get_errno(), f"setns into {namespace}")
        try:
            # IPv6 would only add router solicitations: the WAN carries IPv4
            for scope in ("all", "default"):
                with (
                    contextlib.suppress(OSError),
                    open(f"/proc/sys/net/ipv6/conf/{scope}/disable_ipv6", "w") as knob,
                ):
                    knob.write("1")
            fd = os.open("/dev/net/tun", os.O_RDWR | os.O_NONBLOCK)
            fcntl.ioctl(
                fd, _TUNSETIFF, struct.pack("16sH22x", TUN_NAME.encode(), _IFF_TUN | _IFF_NO_PI)
            )
        finally:
            if libc.setns(own, _CLONE_NEWNET) != 0:
                raise OSError(ctypes.get_errno(), "setns back")
    finally:
        os.close(own)
        os.close(target)
    return fd


def _ip(*args: str, stdin: str | None = None) -> None:
    result = subprocess.run(["ip", *args], input=stdin, capture_output=True, text=True, check=False)
    if result.returncode != 0:
        raise RuntimeError(f"ip {' '.join(args)}: {result.stderr.strip()}")


def delete_namespace(namespace: str) -> None:
    """Kill what still runs in `namespace` and delete it; quiet if it is already gone."""
    listed = subprocess.run(
        ["ip", "netns", "pids", namespace], capture_output=True, text=True, check=False
    )
    for pid in listed.stdout.split():
        try:
            os.kill(int(pid), signal.SIGKILL)
        except (ProcessLookupError, ValueError):
            pass
    subprocess.run(["ip", "netns", "delete", namespace], capture_output=True, check=False)


def _set_up(config: dict[str, Any]) -> list[HostLink]:
    mtu = int(config["mtu"])
    seed = int(config["seed"])
    hosts: list[HostLink] = []
    for index, entry in enumerate(config["hosts"]):
        namespace = entry["namespace"]
        _ip("netns", "add", namespace)
        fd = _open_tun_in(namespace)
        spec = LinkSpec(**entry["spec"])
        host = HostLink(index, fd, address_int(entry["public_address"]), spec, mtu)
        if spec.nat != "none":
            host.nat = Nat(
                spec.nat,
                address_int(entry["address"]),
                host.public,
                random.Random(seed * 1_000_003 + index),
            )
        hosts.append(host)
        _ip(
            "-n",
            namespace,
            "-batch",
            "-",
            stdin=(
                "link set lo up\n"
                f"link set {TUN_NAME} mtu {mtu} txqueuelen 5000 up\n"
                f"addr add {entry['address']}/32 dev {TUN_NAME}\n"
                f"route add {PUBLIC_NETWORK} dev {TUN_NAME}\n"
            ),
        )
    return hosts


def _read_line(fd: int) -> bytes:
    # unbuffered, so that nothing after the line is read away from `Router.serve`
    line = b""
    while not line.endswith(b"\n"):
        chunk = os.read(fd, 1)
        if not chunk:
            raise SystemExit("wan router: no configuration on stdin")
        line += chunk
    return line


def _terminate(signum: int, frame: object) -> None:
    raise SystemExit(128 + signum)


def main() -> int:
    # the owner cleans up on Ctrl-C and then closes our stdin; SIGTERM still cleans up
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    signal.signal(signal.SIGTERM, _terminate)
    # the emulated network should not slow down because the CPUs are busy
    with contextlib.suppress(OSError):
        os.setpriority(os.PRIO_PROCESS, 0, -10)
    config = json.loads(_read_line(sys.stdin.fileno()))
    namespaces = [entry["namespace"] for entry in config["hosts"]]
    hosts: list[HostLink] = []
    try:
        hosts = _set_up(config)
        router = Router(hosts, int(config["seed"]), int(config["mtu"]))
        sys.stdout.write("ready\n")
        sys.stdout.flush()
        router.serve(sys.stdin.fileno())
    except Exception as exc:  # reported to the owner, who raises it
        sys.stderr.write(f"wan router: {exc}\n")
        return 1
    finally:
        for host in hosts:
            os.close(host.fd)
        for namespace in namespaces:
            delete_namespace(namespace)
    return 0


if __name__ == "__main__":
    sys.exit(main())
