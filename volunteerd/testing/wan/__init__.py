"""A WAN on one machine: hosts in network namespaces, every packet carried by one
user-space router process that gives each host an internet-like access link. Real
kernel TCP runs on top, so handshakes, congestion control and retransmission behave as
they would between homes.

    from volunteerd.testing.wan import LinkSpec, open_wan, wan_available

    if not (available := wan_available()):
        pytest.skip(available.reason)
    with open_wan("home", hosts=4, seed=0) as wan:
        server = wan.hosts[0].popen(["volunteerd", ...])
        wan.hosts[1].run([...], check=True)        # inside host 1
        wan.stats()                                # per-host packets, bytes, drops

The model: each host has an access link to a core.

* `delay_ms` is one-way host -> core: two hosts are `delay_a + delay_b` apart (RTT twice
  that). `jitter_ms` adds a uniform random 0..jitter per packet, per link; one direction
  of one host pair is never reordered.
* `up_mbit`/`down_mbit`: packets are serialised at that rate behind a drop-tail queue of
  `queue_ms` worth of bytes, so a flood sees up to `queue_ms` of queueing delay and
  then drops, as behind a home router's buffer.
* `loss`: each packet crossing the link (either way) is dropped with this probability,
  so A -> B loses `1 - (1 - loss_a)(1 - loss_b)`.
* path A -> B: A's NAT, A's loss, A's uplink queue, A's delay (+ jitter), B's loss, B's
  NAT, B's downlink queue, B's delay (+ jitter).
* `nat`: `none` (the host has a public address 10.200.x.y), `cone` or `symmetric` (the
  host has a private 192.168.x.2 and the router, acting as its home router, translates
  to its public address; see `nat`). Nothing can dial a NAT'd host first.

Hosts talk only to each other (route 10.200.0.0/16 via the TUN); nothing is attached to
the root namespace. Namespaces are `vdwan<owner pid>w<n>h<index>`; they are deleted on
leaving `open_wan`, on SIGTERM and at exit, by the router when its owner dies, and by the
next `open_wan` if all of that failed.

Profiles (`profile`): built-in `lan`, `home`, `dsl`, `internet`, or a TOML file; or
`LinkSpec(...)` for every host, or one per host.

The router is one single-threaded Python process (epoll over the TUNs, a heap of
release times) at nice -10; a packet costs it 10-20 µs of CPU (50-100k packets/s a
core), well above the ~12k packets/s (data plus ACKs) of a 100 Mbit/s TCP flow at MTU
1500, so links keep the default MTU (`open_wan(mtu=...)` changes it).

By hand: `python -m volunteerd.testing.wan up --profile home --hosts 4 [--nat 1=cone]`
prints the hosts and stays up until Ctrl-C; `... exec [--owner PID] HOST COMMAND` and
`... shell HOST` run inside a host of it; `... profiles` lists the built-in profiles.
"""

from __future__ import annotations

from volunteerd.testing.wan.profile import BUILTIN, LinkSpec, Profile, ProfileError
from volunteerd.testing.wan.world import (
    HostStats,
    Wan,
    WanAvailability,
    WanHost,
    WanUnavailable,
    open_wan,
    wan_available,
)

__all__ = [
    "BUILTIN",
    "HostStats",
    "LinkSpec",
    "Profile",
    "ProfileError",
    "Wan",
    "WanAvailability",
    "WanHost",
    "WanUnavailable",
    "open_wan",
    "wan_available",
]
