"""Hostile peers against the DHT's record layer: replayed refreshes, addresses that are
not the ones a node announces, answers that a reader cannot read, Kademlia's provider
records, and quotas of callers who come through a relay."""

from __future__ import annotations

import json
import logging
import time
from types import SimpleNamespace
from typing import Any

import multiaddr
import pytest
import trio
from libp2p.peer.id import ID
from pydantic import ValidationError

from volunteerd.config import DHTConfig, TimeoutsConfig
from volunteerd.errors import (
    InvalidRecord,
    PeerError,
    PeerUnreachable,
    RemoteError,
    RequestTimeout,
)
from volunteerd.identity import Identity
from volunteerd.net.dht import ExpertDHT, fit_reply, fit_reply_header
from volunteerd.net.peers import PeerAddress, peer_id_for
from volunteerd.net.protocols import Verb
from volunteerd.net.records import (
    EXPERT_RECORDS,
    ExpertRecord,
    FindReply,
    FindRequest,
    ManifestFindReply,
    ManifestRecord,
    sign_record,
)
from volunteerd.net.store import SignedRecordStore, Source, ip_prefix

NOW = 1_800_000_000.0
ADDR = "/ip4/127.0.0.1/tcp/1"


def make(identity: Identity, key: str = "ffn.", **kw: Any) -> ExpertRecord:
    kw.setdefault("children", [3] if key.endswith(".") else [])
    kw.setdefault("ttl_s", 60)
    kw.setdefault("now", NOW)
    kw.setdefault("addrs", [ADDR])
    return sign_record(identity, str(peer_id_for(identity)), key=key, **kw)


# -- a refused refresh ---------------------------------------------------------------------


def quota_filled_by_its_writer() -> tuple[
    SignedRecordStore[ExpertRecord], ExpertRecord, Identity, Source, Source
]:
    """A store whose writer filled a connection's (``filler``'s) quota with its own
    records after a first one stored from ``first``, and a larger refresh of that first
    record, which the quota refuses: (store, refresh, writer, first, filler)."""
    config = DHTConfig(max_record_ttl_s=600, peer_quota_mb=0.05)
    s = SignedRecordStore(EXPERT_RECORDS, config, clock=lambda: NOW)
    writer = Identity.generate()
    first, filler = Source("first", ip_prefix("10.0.0.1")), Source("filler", ip_prefix("10.0.1.1"))
    assert s.put(make(writer, key="ffn.9999."), first)
    fat = list(range(256))
    k = 0
    while s.offer(make(writer, key=f"ffn.{k}.", children=fat), filler) is None:
        k += 1
    return s, make(writer, key="ffn.9999.", children=fat, now=NOW + 1), writer, first, filler


def test_a_replayed_refused_refresh_leaves_the_store_as_it_was() -> None:
    """One writer fills a connection's quota with its own records, then replays a larger
    refresh of its first record, which that quota refuses every time: the store's heaps
    stay one item per live record, however often the refresh is replayed."""
    s, refresh, writer, first, filler = quota_filled_by_its_writer()
    assert s.offer(refresh, filler) == "peer_quota"
    before = s.statistics()
    for _ in range(500):
        assert s.offer(refresh, filler) == "peer_quota"
    after = s.statistics()
    assert (after.records, after.bytes, after.writers) == (before.records, before.bytes, 1)
    assert [r.children for r in s.get("ffn.9999.")] == [(3,)]
    heaps = [s._all, *s._scopes.values()]
    assert all(len(scope.heap) <= 2 * scope.count + 64 for scope in heaps)
    assert len(s._all.heap) == len(s), "one heap item per live record"
    # A refresh that fits still replaces the record.
    assert s.put(make(writer, key="ffn.9999.", children=[4], now=NOW + 2), first)
    assert [r.children for r in s.get("ffn.9999.")] == [(4,)]
    assert len(s._all.heap) <= 2 * len(s) + 64


# -- addresses ---------------------------------------------------------------------------

RELAY_ID = "12D3KooWD3eckifWpRn9wQpMG9R9hX3sD158z7EqHWmweQAJU5SA"  # any valid peer id


@pytest.mark.parametrize(
    "addr",
    [
        "/ip4/0.0.0.0/tcp/1",  # the dialler's own machine
        "/ip6/::/tcp/1",
        "/ip6/::ffff:0.0.0.0/tcp/1",
        "/ip4/224.0.0.1/tcp/80",  # multicast
        "/ip6/ff02::1/tcp/80",
        "/ip4/255.255.255.255/tcp/9",  # broadcast
        "/ip4/1.2.3.4/tcp/0",
        "/ip4/1.2.3.4/tcp/65536",
        "/ip4/1.2.3.4/udp/53",
        "/dns4/victim.example/tcp/80",
        "/unix/tmp/x.sock",
        "/not-a-multiaddr",
        "/" + "\x01" * 199,  # six bytes of JSON a character
        "/ip4/1.2.3.4/tcp/1\u00e9",
        f"/ip4/0.0.0.0/tcp/1/p2p/{RELAY_ID}/p2p-circuit",
    ],
)
def test_a_record_with_an_address_no_peer_should_dial_is_refused(addr: str) -> None:
    data = make(Identity.generate()).model_dump(mode="json") | {"addrs": [ADDR, addr]}
    with pytest.raises(InvalidRecord, match="malformed"):
        EXPERT_RECORDS.decode(json.dumps(data))


@pytest.mark.parametrize(
    "addr",
    [
        "/ip4/127.0.0.1/tcp/38400",
        "/ip4/192.168.1.20/tcp/38400",
        "/ip4/203.0.113.5/tcp/1",
        "/ip6/::1/tcp/65535",
        "/ip6/2001:db8::7/tcp/38400",
        f"/ip4/198.51.100.1/tcp/38400/p2p/{RELAY_ID}/p2p-circuit",
    ],
)
def test_the_addresses_nodes_announce_are_carried(addr: str) -> None:
    record = make(Identity.generate(), addrs=[addr])
    assert record.addrs == (addr,)
    decoded = EXPERT_RECORDS.decode(record.model_dump_json())
    EXPERT_RECORDS.validate(decoded, DHTConfig(max_record_ttl_s=600), now=NOW)


def test_a_node_signs_only_the_addresses_records_carry(caplog: pytest.LogCaptureFixture) -> None:
    """An address a record cannot carry (a DNS name) is left out of the record, with a
    warning, instead of making every record refused. (``network.announce_addrs`` is
    checked with the configuration: tests/unit/test_config.py.)"""
    record = make(Identity.generate(), addrs=["/dns4/me.example/tcp/38400", ADDR])
    assert record.addrs == (ADDR,)
    assert "me.example" in caplog.text
    EXPERT_RECORDS.decode(record.model_dump_json())


def test_an_unparsable_record_in_a_find_reply_costs_only_itself() -> None:
    """A storing node (of an earlier version) holding a record this one refuses: the
    other records of its answer are still read."""
    good = [make(Identity.generate()) for _ in range(2)]
    bad = good[0].model_dump(mode="json") | {"addrs": ["not-a-multiaddr"]}
    text = json.dumps(
        {"status": "ok", "records": [good[0].model_dump(mode="json"), bad, good[1].model_dump()]}
    )
    assert FindReply.model_validate_json(text).records == good
    with pytest.raises(ValidationError):
        FindReply.model_validate_json(json.dumps({"status": "ok", "records": [bad] * 16385}))


def test_a_find_reply_stays_within_its_bytes_when_the_estimate_falls_short() -> None:
    """Records whose estimated size is far below their JSON (characters JSON escapes,
    as records of an earlier version's store may hold): the answer is cut to fit."""
    records = [
        make(Identity.generate(), key="ffn.0.").model_copy(update={"addrs": ("/" + "\x01" * 199,)})
        for _ in range(60)
    ]
    fitted = fit_reply([records], 48 * 1024, EXPERT_RECORDS.wire_size_of)
    header = fit_reply_header(FindReply, fitted)
    assert 0 < len(header.records) < len(fitted)  # type: ignore[attr-defined]
    assert len(header.model_dump_json().encode()) <= 48 * 1024
    assert header.records == fitted[: len(header.records)]  # type: ignore[attr-defined]


# -- readers and storing nodes, with a faked host ------------------------------------------


class _RoutingTable:
    def __init__(self) -> None:
        self.removed: list[str] = []

    def remove_peer(self, peer_id: ID) -> None:
        self.removed.append(str(peer_id))


class _Kad:
    def __init__(self) -> None:
        self.routing_table = _RoutingTable()

    async def add_peer(self, peer_id: ID, *, skip_server_mode_check: bool = False) -> bool:
        return True


class _Peerstore:
    def addrs(self, peer_id: ID) -> list[Any]:
        return [multiaddr.Multiaddr("/ip4/127.0.0.1/tcp/1")]

    def clear_addrs(self, peer_id: ID) -> None:
        pass


class _Conn:
    """A connection as ``observed_ips`` and ``ExpertDHT._source`` see one."""

    def __init__(self, remote_ip: str, circuit_via: str | None = None) -> None:
        self.muxed_conn = SimpleNamespace(get_remote_address=lambda: (remote_ip, 4001))
        local = "/ip4/127.0.0.1/tcp/2"
        self._addrs = (
            [f"/ip4/{remote_ip}/tcp/4001/p2p/{circuit_via}/p2p-circuit"] if circuit_via else [local]
        )

    def get_transport_addresses(self) -> list[multiaddr.Multiaddr]:
        return [multiaddr.Multiaddr(a) for a in self._addrs]


class _Host:
    def __init__(self, connections: dict[ID, list[_Conn]] | None = None) -> None:
        self._connections = connections or {}

    def get_id(self) -> ID:
        return ID.from_base58(RELAY_ID)

    def get_peerstore(self) -> _Peerstore:
        return _Peerstore()

    def get_network(self) -> Any:
        return SimpleNamespace(connections=self._connections)


class _Rpc:
    def __init__(self, error: Exception) -> None:
        self.error = error
        self.forgotten: list[str] = []

    async def call(self, peer: PeerAddress, verb: Verb, request: Any) -> Any:
        raise self.error

    def forget(self, peer_id: str) -> None:
        self.forgotten.append(peer_id)


def _dht(host: _Host, rpc: _Rpc | None = None) -> tuple[ExpertDHT, _Kad]:
    kad = _Kad()
    dht = ExpertDHT(
        host,  # type: ignore[arg-type]
        kad,  # type: ignore[arg-type]
        rpc or _Rpc(PeerError("unused")),  # type: ignore[arg-type]
        DHTConfig(),
        TimeoutsConfig(),
    )
    return dht, kad


@pytest.mark.parametrize(
    "error",
    [
        PeerError("dht-find: bad reply: header of 237231 bytes exceeds the cap of 65536"),
        PeerError("dht-find: malformed reply header: Input should be a valid string"),
        RemoteError("rate_limited", "slow down"),
    ],
)
async def test_a_storing_peer_whose_answer_is_unreadable_is_not_forgotten(
    error: Exception,
) -> None:
    """What others stored on a peer can make its answer unreadable: that peer is alive,
    and forgetting it would let them empty a reader's routing table."""
    peer = ID.from_base58(str(peer_id_for(Identity.generate())))
    dht, kad = _dht(_Host(), _Rpc(error))
    assert await dht._ask(peer, Verb.DHT_FIND, FindRequest(keys=["ffn.0."])) is None
    assert kad.routing_table.removed == []
    assert peer not in dht._dead_until


@pytest.mark.parametrize(
    "error", [PeerUnreachable("connection refused"), RequestTimeout("no reply within 5s")]
)
async def test_a_storing_peer_that_does_not_answer_is_forgotten(error: Exception) -> None:
    peer = ID.from_base58(str(peer_id_for(Identity.generate())))
    dht, kad = _dht(_Host(), _Rpc(error))
    assert await dht._ask(peer, Verb.DHT_FIND, FindRequest(keys=["ffn.0."])) is None
    assert kad.routing_table.removed == [str(peer)]


def test_a_caller_through_a_relay_is_not_charged_to_the_relays_prefix() -> None:
    relayed, direct, both = (str(peer_id_for(Identity.generate())) for _ in range(3))
    host = _Host(
        {
            ID.from_base58(relayed): [_Conn("198.51.100.9", circuit_via=RELAY_ID)],
            ID.from_base58(direct): [_Conn("203.0.113.7")],
            ID.from_base58(both): [
                _Conn("198.51.100.9", circuit_via=RELAY_ID),
                _Conn("192.0.2.44"),
            ],
        }
    )
    dht, _ = _dht(host)
    assert dht._source(relayed) == Source(relayed, f"peer:{relayed}")
    assert dht._source(direct) == Source(direct, "203.0.113.0/24")
    assert dht._source(both) == Source(both, "192.0.2.0/24")


class _SilentHost(_Host):
    """A host whose dials hang (``hang``) or fail with an exception of no text."""

    def __init__(self, hang: bool) -> None:
        super().__init__()
        self.hang = hang

    async def connect(self, peer_info: Any) -> None:
        if self.hang:
            await trio.sleep_forever()
        raise ConnectionError()


@pytest.mark.parametrize(
    ("hang", "reason"), [(True, "did not answer within 0.05 s"), (False, "ConnectionError")]
)
async def test_a_bootstrap_peer_that_does_not_answer_is_named_with_a_reason(
    caplog: pytest.LogCaptureFixture, hang: bool, reason: str
) -> None:
    """A timeout's text is empty: the warning ended at "did not answer: " (audit-join)."""
    kad = _Kad()
    dht = ExpertDHT(
        _SilentHost(hang),  # type: ignore[arg-type]
        kad,  # type: ignore[arg-type]
        _Rpc(PeerError("unused")),  # type: ignore[arg-type]
        DHTConfig(),
        TimeoutsConfig(connect_s=0.05),
    )
    peer = PeerAddress(str(peer_id_for(Identity.generate())), ("/ip4/127.0.0.1/tcp/1",))
    with caplog.at_level(logging.WARNING, logger="volunteerd.net.dht"):
        assert await dht.bootstrap([peer]) == 0
    (warning,) = [r.getMessage() for r in caplog.records if "bootstrap peer" in r.getMessage()]
    assert reason in warning
    assert not warning.endswith(": ")


class _Answers:
    """An RPC client whose every find is answered with ``records``."""

    def __init__(self, reply: Any) -> None:
        self.reply = reply
        self.asked: list[str] = []

    async def call(self, peer: PeerAddress, verb: Verb, request: Any) -> Any:
        self.asked.append(peer.peer_id)
        return self.reply, []

    def forget(self, peer_id: str) -> None:
        pass


def _fresh_reader(reply: Any) -> tuple[ExpertDHT, list[ID]]:
    """A node just started, with 4 peers (4 voters: each from its own /24) that answer
    every find with ``reply``; its swarm clock estimates at every sample."""
    peers = [ID.from_base58(str(peer_id_for(Identity.generate()))) for _ in range(4)]
    host = _Host({p: [_Conn(f"203.0.{i}.7")] for i, p in enumerate(peers)})
    dht, _ = _dht(host, _Answers(reply))  # type: ignore[arg-type]
    ticks = iter(range(1000, 10**6, 2))
    dht.clock._ticking = lambda: float(next(ticks))  # 2 s between samples: each estimates

    async def candidates(key: str) -> list[ID]:
        return list(peers)

    dht._candidates = candidates  # type: ignore[method-assign]
    return dht, peers


async def test_a_manifest_days_old_found_first_does_not_set_a_fresh_nodes_clock() -> None:
    """A manifest's ``issued_at`` is its owner's publish time, found with the same
    signature for its whole lifetime: a fresh node whose first finds brought a 3-day-old
    one read every answering peer's clock as 3 days behind, took an offset of
    -259,200 s ("this computer's clock is ... ahead of the swarm's") and refused fresh
    records as from the future (a 45-minute soak: 6 of ~17 starts). Only expert
    records, signed afresh every announce period, are samples of a peer's clock."""
    owner = Identity.generate()
    issued = time.time() - 3 * 86400
    manifest = ManifestRecord(
        name="exp",
        owner=str(peer_id_for(owner)),
        body='{"a":1}',
        issued_at=issued,
        expires_at=issued + 7 * 86400,
    ).signed(owner)
    dht, peers = _fresh_reader(ManifestFindReply(records=[manifest]))
    assert await dht.get_manifests("exp") == [manifest]
    assert len(dht._rpc.asked) == 4  # type: ignore[attr-defined]
    assert dht.clock.agreed is None
    assert dht.clock.offset == 0.0
    assert abs(dht.clock.now() - time.time()) < 5

    # Expert records are still samples: 4 peers whose records say this clock is an hour
    # behind theirs move it.
    dht, peers = _fresh_reader(None)
    writers = [Identity.generate() for _ in peers]
    ahead = [
        sign_record(
            w,
            str(peer_id_for(w)),
            key="ffn.",
            addrs=[ADDR],
            children=[0],
            ttl_s=30,
            now=time.time() + 3600,
        )
        for w in writers
    ]
    dht._rpc.reply = FindReply(records=ahead)  # type: ignore[attr-defined]
    await dht.get(["ffn."])
    assert dht.clock.offset == pytest.approx(3600, abs=30)
