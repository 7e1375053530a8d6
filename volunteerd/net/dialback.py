"""The ``dial-back`` verb's messages and the rules a node applies before dialling.

A node asks a peer it is connected to: "dial me back at these addresses". The peer
opens a *new* TCP connection to each address and runs the Noise handshake, which
succeeds only if the listener there holds the requesting peer's key. The reply names
the first address that worked, and the IP the request came from (how a node behind
NAT learns its public address).

So that the verb cannot turn a node into a port scanner or a dialler of third parties:

* the peer id dialled is always the requester's own (taken from the connection, never
  from the request); an address ending in ``/p2p/<another id>`` is refused;
* at most ``MAX_DIALBACK_ADDRS`` addresses, each a plain ``/ip4|ip6/<ip>/tcp/<port>``;
* only the IP the request came from is dialled: an address at that IP (or at a loopback
  IP when the request came over loopback) as it is, an address at another IP at the
  observed IP with the same port (a node behind NAT learns whether its forwarded port
  works), an address of another IP family not at all. A request that came over a relay
  circuit has no observed IP: nothing is dialled.
"""

from __future__ import annotations

import ipaddress
from collections.abc import Iterable
from typing import Annotated, Literal

from pydantic import BaseModel, ConfigDict, Field

from volunteerd.config.addrs import tcp_endpoint
from volunteerd.errors import Rejected

__all__ = [
    "MAX_DIALBACK_ADDRS",
    "DialBackReply",
    "DialBackRequest",
    "dialable_addrs",
    "tcp_endpoint",
]

MAX_DIALBACK_ADDRS = 4


class DialBackRequest(BaseModel):
    model_config = ConfigDict(frozen=True, extra="forbid")
    addrs: Annotated[
        list[Annotated[str, Field(max_length=200)]],
        Field(min_length=1, max_length=MAX_DIALBACK_ADDRS),
    ]


class DialBackReply(BaseModel):
    model_config = ConfigDict(frozen=True, extra="forbid")
    status: Literal["ok"] = "ok"
    # The first address at which the requester answered, or None.
    reachable: str | None = None
    # How many addresses were dialled (the others were skipped by the IP rule).
    dialled: int = 0
    # The IP the request came from, as this peer saw it: behind NAT, the router's
    # public address (None over a relay circuit).
    observed: Annotated[str, Field(max_length=64)] | None = None


def dialable_addrs(
    addrs: Iterable[str], requester_id: str, observed_ips: Iterable[str]
) -> list[str]:
    """What this node may dial for ``requester_id``, who sent ``addrs`` over connections
    from ``observed_ips``: each address, moved to the observed IP (module docstring).

    Raises Rejected when an address names another peer id or is not a TCP address.
    """
    observed = [ipaddress.ip_address(ip) for ip in observed_ips]
    out = []
    for addr in addrs:
        transport, sep, peer_id = addr.partition("/p2p/")
        if sep and peer_id != requester_id:
            raise Rejected("dial-back dials only the requesting peer's own addresses")
        endpoint = tcp_endpoint(transport)
        if endpoint is None:
            raise Rejected(f"dial-back dials only /ip4|ip6/<ip>/tcp/<port> addresses: {addr!r}")
        ip = ipaddress.ip_address(endpoint[0])
        same_family = [o for o in observed if o.version == ip.version]
        if not same_family:
            continue
        if ip in same_family or (ip.is_loopback and any(o.is_loopback for o in same_family)):
            out.append(transport)
        else:
            family = "ip4" if ip.version == 4 else "ip6"
            out.append(f"/{family}/{same_family[0]}/tcp/{endpoint[1]}")
    return list(dict.fromkeys(out))
