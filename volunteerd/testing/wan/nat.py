"""The home router of one host: NAT done by the WAN router itself (no iptables).

The host has a private address; everything it sends leaves from its public address.

* `cone`: one mapping per internal port (endpoint-independent), the external port the
  same as the internal one where free, and anyone may send to a mapping once it exists
  (endpoint-independent filtering: a full cone).
* `symmetric`: a new external port for each (internal port, destination address, port),
  and only that destination may answer through it.

Inbound packets with no mapping are dropped, so a host behind either NAT cannot be
dialled first. Only TCP and UDP cross; ICMP and fragments do not (the router counts them
as NAT drops). Mappings idle longer than the UDP or TCP timeout are forgotten.
"""

from __future__ import annotations

import random
from dataclasses import dataclass

from volunteerd.testing.wan.packet import (
    PROTO_TCP,
    PROTO_UDP,
    is_fragment,
    ports,
    rewrite_destination,
    rewrite_source,
)
from volunteerd.testing.wan.profile import NatKind

UDP_TIMEOUT_S = 120.0
TCP_TIMEOUT_S = 7200.0
_FIRST_PORT = 1024


@dataclass(slots=True)
class _Mapping:
    protocol: int
    internal_port: int
    external_port: int
    # symmetric NAT: the only (address, port) that may use the mapping; None: anyone
    remote: tuple[int, int] | None
    last_used: float


class Nat:
    """Translates one private host (`private`) to one public address (`public`)."""

    def __init__(self, kind: NatKind, private: int, public: int, rng: random.Random) -> None:
        if kind == "none":
            raise ValueError("a Nat is cone or symmetric")
        self.kind = kind
        self.private = private
        self.public = public
        self._outbound: dict[tuple[int, ...], _Mapping] = {}
        self._inbound: dict[tuple[int, int], _Mapping] = {}
        # symmetric NATs hand out ports from a counter; where it starts is arbitrary
        self._next_port = rng.randrange(20000, 60000)

    def outbound(self, packet: bytearray, now: float) -> bool:
        """Rewrite a packet the host sends to leave from the public address; False: drop."""
        protocol = packet[9]
        if protocol not in (PROTO_TCP, PROTO_UDP) or is_fragment(packet):
            return False
        source_port, destination_port = ports(packet)
        destination = int.from_bytes(packet[16:20], "big")
        if self.kind == "cone":
            key: tuple[int, ...] = (protocol, source_port)
        else:
            key = (protocol, source_port, destination, destination_port)
        mapping = self._outbound.get(key)
        if mapping is None:
            remote = None if self.kind == "cone" else (destination, destination_port)
            external = self._free_port(protocol, source_port if self.kind == "cone" else None)
            mapping = _Mapping(protocol, source_port, external, remote, now)
            self._outbound[key] = mapping
            self._inbound[(protocol, external)] = mapping
        mapping.last_used = now
        rewrite_source(packet, self.public, mapping.external_port)
        return True

    def inbound(self, packet: bytearray, now: float) -> bool:
        """Rewrite a packet sent to the public address for the host; False: drop (no
        mapping, or one this sender may not use)."""
        protocol = packet[9]
        if protocol not in (PROTO_TCP, PROTO_UDP) or is_fragment(packet):
            return False
        source_port, destination_port = ports(packet)
        mapping = self._inbound.get((protocol, destination_port))
        if mapping is None:
            return False
        if mapping.remote is not None:
            source = int.from_bytes(packet[12:16], "big")
            if mapping.remote != (source, source_port):
                return False
        mapping.last_used = now
        rewrite_destination(packet, self.private, mapping.internal_port)
        return True

    def expire(self, now: float) -> None:
        """Forget mappings idle past their protocol's timeout."""
        for key, mapping in list(self._outbound.items()):
            timeout_s = TCP_TIMEOUT_S if mapping.protocol == PROTO_TCP else UDP_TIMEOUT_S
            if now - mapping.last_used > timeout_s:
                del self._outbound[key]
                del self._inbound[(mapping.protocol, mapping.external_port)]

    def mappings(self) -> int:
        return len(self._outbound)

    def _free_port(self, protocol: int, preferred: int | None) -> int:
        if preferred is not None and (protocol, preferred) not in self._inbound:
            return preferred
        for _ in range(65536 - _FIRST_PORT):
            port = self._next_port
            self._next_port = port + 1 if port < 65535 else _FIRST_PORT
            if (protocol, port) not in self._inbound:
                return port
        raise RuntimeError("NAT out of ports")
