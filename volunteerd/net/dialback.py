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

from volunteerd.config.addrs import is_dialable_addr, tcp_endpoint
from volunteerd.errors import Rejected

__all__ = [
    "MAX_DIALBACK_ADDRS",
    "DialBackReply",
    "DialBackRequest",
    "believable",
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
    reachable: Annotated[str, Field(max_length=200, pattern=r"^[!-~]+$")] | None = None
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
        if not (ip in same_family or (ip.is_loopback and any(o.is_loopback for o in same_family))):
            ip = same_family[0]
        # written anew from what was parsed, never the requester's text as it came
        family = "ip4" if ip.version == 4 else "ip6"
        out.append(f"/{family}/{ip}/tcp/{endpoint[1]}")
    return list(dict.fromkeys(out))


def believable(reply: DialBackReply, sent: Iterable[str]) -> str | None:
    """The address ``reply`` says it reached this node at, if it is one the dialling
    rules above could have produced from the addresses ``sent``: a TCP address at a
    port that was sent, at the IP of a sent address or the IP the peer says it saw.
    Else None: a peer's word goes into this node's signed expert records (a stranger's
    ``/ip4/6.6.6.6/tcp/1`` was announced first, before the node's own addresses)."""
    if reply.reachable is None:
        return None
    endpoint = tcp_endpoint(reply.reachable)
    if endpoint is None or not is_dialable_addr(reply.reachable, lambda _: None):
        return None
    ends = [e for e in (tcp_endpoint(a.partition("/p2p/")[0]) for a in sent) if e is not None]
    ips = {ip for ip, _ in ends} | ({reply.observed} if reply.observed else set())
    ports = {port for _, port in ends}
    try:
        ip = str(ipaddress.ip_address(endpoint[0]))
        known = {str(ipaddress.ip_address(i)) for i in ips}
    except ValueError:
        return None
    return reply.reachable if ip in known and endpoint[1] in ports else None
