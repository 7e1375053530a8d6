"""What the simulator charges for moving bytes and for computing, in virtual time.

Links (``sim.links``): every host has an access link with an upload and a download rate
and a round trip to the internet's core. A message of ``n`` bytes from ``a`` to ``b``
occupies ``a``'s uplink for ``8n / up_a`` and ``b``'s downlink for ``8n / down_b``; each
link carries one message at a time, first come first served (a flow model of a home
connection's queue: a large reply holds up the next one), and the message arrives one
way's latency after both are done. Nothing is lost in transit: a host that is gone does
not answer (sim.world).

Compute (``Cpu``): a host's device runs one call at a time, in order of arrival (a
daemon's executor: one worker per device). Where hosts share one machine (the validation
run: 8 daemons and a trainer on 2 cores), each host is one worker (a Python process
does one thing at a time) that also needs one of the machine's cores.
"""

from __future__ import annotations

from collections import Counter
from dataclasses import dataclass, field

import trio

from volunteerd.sim.links import Link, one_way_s

__all__ = ["Cpu", "Host", "Network", "Traffic"]


@dataclass(slots=True)
class Traffic:
    """Bytes and messages one host sent and received, by what they were for."""

    bytes_up: Counter[str] = field(default_factory=Counter)
    bytes_down: Counter[str] = field(default_factory=Counter)
    messages_up: Counter[str] = field(default_factory=Counter)
    messages_down: Counter[str] = field(default_factory=Counter)

    def sent(self, what: str, nbytes: float, messages: float = 1) -> None:
        self.bytes_up[what] += int(nbytes)
        self.messages_up[what] += int(messages)

    def received(self, what: str, nbytes: float, messages: float = 1) -> None:
        self.bytes_down[what] += int(nbytes)
        self.messages_down[what] += int(messages)


class Cpu:
    """``slots`` workers taking calls in order of arrival. With a ``machine``, each
    call also needs one of the machine's cores: a process (one worker) among others
    on one computer."""

    def __init__(self, slots: int = 1, machine: Cpu | None = None) -> None:
        self._free = [0.0] * max(1, slots)
        self._machine = machine
        self.busy_s = 0.0

    def _earliest(self) -> int:
        return min(range(len(self._free)), key=self._free.__getitem__)

    def reserve(self, seconds: float) -> float:
        """Book ``seconds`` of work arriving now; returns when it will be done."""
        now = trio.current_time()
        i = self._earliest()
        start = max(now, self._free[i])
        machine = self._machine
        if machine is not None:
            j = machine._earliest()
            start = max(start, machine._free[j])
            machine._free[j] = start + seconds
            machine.busy_s += seconds
        end = start + seconds
        self._free[i] = end
        self.busy_s += seconds
        return end

    async def run(self, seconds: float) -> None:
        """Wait for a worker, then ``seconds`` of work."""
        if seconds > 0:
            await trio.sleep_until(self.reserve(seconds))


@dataclass(slots=True, eq=False)
class Host:
    """A machine on the network: its link, its device, what it sent and received."""

    name: str
    link: Link
    cpu: Cpu
    traffic: Traffic = field(default_factory=Traffic)
    up_free: float = 0.0
    down_free: float = 0.0


class Network:
    """Delivery times of messages between hosts (see the module docstring)."""

    def __init__(self) -> None:
        self.messages = 0
        self.bytes = 0

    def arrival(self, src: Host, dst: Host, nbytes: int, what: str) -> float:
        """When ``nbytes`` sent now from ``src`` reach ``dst``; counts them for both."""
        now = trio.current_time()
        bits = 8.0 * nbytes
        up_done = max(now, src.up_free) + bits / (src.link.up_mbps * 1e6)
        down_done = max(now, dst.down_free) + bits / (dst.link.down_mbps * 1e6)
        done = max(up_done, down_done)
        src.up_free = up_done
        dst.down_free = down_done
        src.traffic.sent(what, nbytes)
        dst.traffic.received(what, nbytes)
        self.messages += 1
        self.bytes += nbytes
        return done + one_way_s(src.link, dst.link)

    async def send(self, src: Host, dst: Host, nbytes: int, what: str) -> None:
        await trio.sleep_until(self.arrival(src, dst, nbytes, what))
