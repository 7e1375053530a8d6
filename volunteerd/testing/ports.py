"""A free TCP port on 127.0.0.1 to give a process that binds it later (a daemon's fixed
control port, kept across its restarts).

A port the kernel handed to a listener on port 0 comes from its ephemeral range, from
which it also takes every outgoing connection's source port: in the time between the
test's probe and the daemon's bind, a connection of the other test worker took it, and
the daemon stopped with "Address already in use" (a CI run). Ports are drawn from below
that range instead, at random, and tried once."""

from __future__ import annotations

import random
import socket
from pathlib import Path

__all__ = ["fixed_port"]

_RANGE = Path("/proc/sys/net/ipv4/ip_local_port_range")
_LOWEST = 10000


def fixed_port() -> int:
    """A port on 127.0.0.1 that binds now and lies outside the ephemeral range."""
    low = _ephemeral_low()
    for _ in range(200):
        port = random.randrange(_LOWEST, low) if low > _LOWEST + 1000 else _any()
        with socket.socket() as probe:
            try:
                probe.bind(("127.0.0.1", port))
            except OSError:
                continue
        return port
    raise OSError("no free port found below the ephemeral range")


def _ephemeral_low() -> int:
    try:
        return int(_RANGE.read_text().split()[0])
    except (OSError, ValueError, IndexError):  # not Linux: the IANA range's start
        return 49152


def _any() -> int:
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        return int(probe.getsockname()[1])
