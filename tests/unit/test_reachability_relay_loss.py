"""What a relayed node announces while it has lost its relay: the state machine of
``net/reachability.py`` with a fake host, a fake relay and a fake awake clock."""

from __future__ import annotations

from dataclasses import dataclass, field

import pytest
from libp2p.peer.id import ID
from multiaddr import Multiaddr

from volunteerd.config import ReachabilityConfig, TimeoutsConfig
from volunteerd.errors import PeerUnreachable
from volunteerd.identity import Identity
from volunteerd.net import reachability
from volunteerd.net.peers import PeerAddress, peer_id_for
from volunteerd.net.reachability import Reachability

ME = peer_id_for(Identity.generate())
RELAY = str(peer_id_for(Identity.generate()))
RELAY_ADDR = f"/ip4/203.0.113.5/tcp/4001/p2p/{RELAY}"
CIRCUIT = [f"/ip4/203.0.113.5/tcp/4001/p2p/{RELAY}/p2p-circuit"]
OWN = ["/ip4/192.168.1.2/tcp/38400"]  # behind NAT: nobody outside can dial it


@dataclass
class _Network:
    connections: dict[ID, object] = field(default_factory=dict)


class _Host:
    def __init__(self) -> None:
        self.network = _Network()

    def get_id(self) -> ID:
        return ME

    def get_addrs(self) -> list[Multiaddr]:
        return [Multiaddr(f"{a}/p2p/{ME}") for a in OWN]

    def get_transport_addrs(self) -> list[Multiaddr]:
        return [Multiaddr(a) for a in OWN]

    def get_network(self) -> _Network:
        return self.network


class _Relaying:
    """A relay that takes reservations while ``up``."""

    def __init__(self) -> None:
        self.up = True

    async def reserve(self, relay: PeerAddress) -> float:
        if not self.up:
            raise PeerUnreachable(f"relay {relay.peer_id}: connection refused")
        return 3600.0

    def holds_reservation(self, peer_id: ID) -> bool:
        return self.up

    def reserved_over(self, peer_id: ID) -> str | None:
        return None  # the relay's addresses are announced in their listed order


class _Clock:
    def __init__(self) -> None:
        self.now = 1000.0

    def __call__(self) -> float:
        return self.now


@pytest.fixture
def clock(monkeypatch: pytest.MonkeyPatch) -> _Clock:
    fake = _Clock()
    monkeypatch.setattr(reachability, "awake_time", fake)
    return fake


def _reachability(relaying: _Relaying, **config: object) -> Reachability:
    return Reachability(
        _Host(),  # type: ignore[arg-type]
        None,  # type: ignore[arg-type]  # no dial-back checks here
        relaying,  # type: ignore[arg-type]
        ReachabilityConfig.model_validate({"relays": [RELAY_ADDR], **config}),
        TimeoutsConfig(),
    )


async def test_a_relayed_node_that_lost_its_relay_keeps_announcing_its_circuit(
    clock: _Clock,
) -> None:
    """The relay restarts: the node is unreachable until it reserves again, and keeps
    announcing the circuit rather than its private address, which trainers failed to
    dial and banned it for (outside probe mini1: 10 of 10 experts 52 s after the relay
    was back). When the relay is back, the same circuit is announced, so nothing moved."""
    relaying = _Relaying()
    node = _reachability(relaying)
    told: list[list[str]] = []
    await node._set_mode("relayed")
    node.watch_addrs(told.append)
    assert node.mode == "relayed"
    assert node.announce_addrs == CIRCUIT

    relaying.up = False
    await node._set_mode("relayed")
    assert node.mode == "unreachable"
    assert node.announce_addrs == CIRCUIT
    assert told == []  # nothing to re-announce

    clock.now += 60.0
    relaying.up = True
    await node._set_mode("relayed")
    assert node.mode == "relayed"
    assert node.announce_addrs == CIRCUIT
    assert told == []


async def test_a_node_that_finds_no_relay_for_long_announces_its_own_addresses(
    clock: _Clock,
) -> None:
    """Kept for ``_KEEP_CIRCUITS_S``: a node that really lost every way in goes back to
    its own addresses, as one that never held a relay does."""
    relaying = _Relaying()
    node = _reachability(relaying)
    await node._set_mode("relayed")
    relaying.up = False
    await node._set_mode("relayed")
    clock.now += reachability._KEEP_CIRCUITS_S - 1.0
    await node._set_mode("relayed")  # a retry that failed keeps the time it was lost
    assert node.announce_addrs == CIRCUIT
    told: list[list[str]] = []
    node.watch_addrs(told.append)
    clock.now += 2.0
    assert node.announce_addrs == OWN
    node._notify_if_changed()  # what the serve loop does each round
    assert told == [OWN]


async def test_a_node_that_never_held_a_relay_announces_its_own_addresses(
    clock: _Clock,
) -> None:
    """On a LAN-only swarm, or with no relay up from the start, the node's own addresses
    are all it has (and on a LAN they work)."""
    relaying = _Relaying()
    relaying.up = False
    node = _reachability(relaying)
    await node._set_mode("relayed")
    assert node.mode == "unreachable"
    assert node.announce_addrs == OWN


async def test_a_node_reached_directly_keeps_no_old_circuit(clock: _Clock) -> None:
    """Relayed, then dialled back directly, then unreachable again with no relay: the
    circuit it announced before it was direct is not announced again."""
    relaying = _Relaying()
    node = _reachability(relaying)
    await node._set_mode("relayed")
    await node._set_mode("direct")
    relaying.up = False
    await node._set_mode("relayed")
    assert node.mode == "unreachable"
    assert node.announce_addrs == OWN
