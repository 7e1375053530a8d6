"""``net.dht.admit_after_identify``: a Kademlia requester whose addresses were not known
yet joins the routing table once identify has run (py-libp2p's host and KadDHT stood in
for by the few methods the wrapper uses; the real race is in
tests/integration/test_discovery.py)."""

from __future__ import annotations

from libp2p.peer.id import ID
from libp2p.peer.peerstore import PeerStoreError

from volunteerd.identity import Identity
from volunteerd.net.dht import _AWAITING_IDENTIFY, admit_after_identify
from volunteerd.net.peers import peer_id_for


class Peerstore:
    def __init__(self) -> None:
        self.known: dict[ID, list[str]] = {}

    def addrs(self, peer_id: ID) -> list[str]:
        if peer_id not in self.known:
            raise PeerStoreError("peer ID not found")
        return self.known[peer_id]


class Host:
    def __init__(self) -> None:
        self.peerstore = Peerstore()
        self.identified: list[ID] = []

    def get_peerstore(self) -> Peerstore:
        return self.peerstore

    async def _identify_peer(self, peer_id: ID, *, reason: str) -> None:
        self.identified.append(peer_id)
        self.peerstore.known[peer_id] = ["/ip4/127.0.0.1/tcp/4001"]


class Kad:
    """KadDHT's add_peer as far as it matters here: only peers with known addresses."""

    def __init__(self, host: Host) -> None:
        self.host = host
        self.table: list[ID] = []
        self.fail = False

    async def add_peer(self, peer_id: ID, *, skip_server_mode_check: bool = False) -> bool:
        if self.fail:
            raise RuntimeError("routing table broke")
        try:
            if not self.host.peerstore.addrs(peer_id):
                return False
        except PeerStoreError:
            return False
        self.table.append(peer_id)
        return True


def peer(n: int) -> ID:
    return peer_id_for(Identity(n.to_bytes(32, "big")))


def wrapped() -> tuple[Host, Kad]:
    host = Host()
    kad = Kad(host)
    admit_after_identify(host, kad)  # type: ignore[arg-type]
    return host, kad


async def test_a_requester_identified_later_joins_the_table() -> None:
    host, kad = wrapped()
    early = peer(1)
    assert await kad.add_peer(early, skip_server_mode_check=True) is False
    assert kad.table == []
    await host._identify_peer(early, reason="notifee-connected")
    assert kad.table == [early]


async def test_only_requesters_wait_and_only_once() -> None:
    host, kad = wrapped()
    looked_up, requester = peer(1), peer(2)
    # a peer met in a lookup (the server-mode check not skipped) is not a requester
    assert await kad.add_peer(looked_up) is False
    assert await kad.add_peer(requester, skip_server_mode_check=True) is False
    await host._identify_peer(looked_up, reason="connect")
    await host._identify_peer(requester, reason="connect")
    await host._identify_peer(requester, reason="connect")  # identified again: no re-add
    assert kad.table == [requester]


async def test_waiting_requesters_are_bounded_oldest_forgotten_first() -> None:
    host, kad = wrapped()
    peers = [peer(n) for n in range(1, _AWAITING_IDENTIFY + 11)]
    for p in peers:
        await kad.add_peer(p, skip_server_mode_check=True)
    for p in peers:
        await host._identify_peer(p, reason="connect")
    assert kad.table == peers[10:]


async def test_a_failing_routing_table_does_not_escape_identify() -> None:
    # identify runs as a trio system task: an exception there would end the event loop
    host, kad = wrapped()
    requester = peer(1)
    await kad.add_peer(requester, skip_server_mode_check=True)
    kad.fail = True
    await host._identify_peer(requester, reason="connect")
    assert kad.table == []
    kad.fail = False
    await host._identify_peer(requester, reason="connect")  # given up, not kept for later
    assert kad.table == []
