"""Floods against what a storing node spends on records it will never keep: forged
records (each a signature check) repeated within a request or varied across requests,
refreshes that cannot fit, and writers churned through short-lived records (each a
remembered writer)."""

from __future__ import annotations

import base64
import itertools
import time
from types import SimpleNamespace
from typing import Any

import pytest

import volunteerd.net.envelope as envelope
import volunteerd.net.store as store_module
from tests.unit.test_dht_hardening import quota_filled_by_its_writer
from volunteerd.config import DHTConfig, TimeoutsConfig
from volunteerd.identity import Identity
from volunteerd.net.dht import ExpertDHT
from volunteerd.net.peers import peer_id_for
from volunteerd.net.protocols import Verb
from volunteerd.net.records import (
    EXPERT_RECORDS,
    ExpertRecord,
    StoreReply,
    StoreRequest,
    sign_record,
)
from volunteerd.net.rpc import Request
from volunteerd.net.store import SignedRecordStore, Source, ip_prefix, remembered_caps

NOW = 1_800_000_000.0
ADDR = "/ip4/127.0.0.1/tcp/1"
BAD_SIGNATURE = base64.b64encode(b"\x01" * 64).decode()


def make(identity: Identity, key: str = "ffn.", **kw: Any) -> ExpertRecord:
    kw.setdefault("children", [3] if key.endswith(".") else [])
    kw.setdefault("ttl_s", 60)
    kw.setdefault("now", NOW)
    return sign_record(identity, str(peer_id_for(identity)), key=key, addrs=[ADDR], **kw)


def forge(record: ExpertRecord, **update: Any) -> ExpertRecord:
    return record.model_copy(update={"signature": BAD_SIGNATURE, **update})


@pytest.fixture
def checks(monkeypatch: pytest.MonkeyPatch) -> list[bool]:
    """Every Ed25519 verification made, by its outcome."""
    made: list[bool] = []
    verify = envelope.verify_signature

    def counted(*args: Any) -> bool:
        made.append(bool(verify(*args)))
        return made[-1]

    monkeypatch.setattr(envelope, "verify_signature", counted)
    return made


# -- forged records --------------------------------------------------------------------


async def test_a_forged_record_repeated_in_one_request_is_checked_once(
    checks: list[bool],
) -> None:
    """The audit's request: one forged record (for a slot nobody holds) 196 times."""
    host = SimpleNamespace(
        get_id=lambda: peer_id_for(Identity.generate()),
        get_network=lambda: SimpleNamespace(connections={}),
    )
    kad = SimpleNamespace(add_peer=None)
    dht = ExpertDHT(host, kad, None, DHTConfig(), TimeoutsConfig())  # type: ignore[arg-type]
    on_store = dht.handlers()[Verb.DHT_STORE]
    writer = Identity.generate()
    forged = forge(make(writer, key="ffn.4.", now=None))
    attacker = str(peer_id_for(Identity.generate()))
    request = StoreRequest(records=[forged] * 196)
    reply = (await on_store(Request(attacker, request, []))).header
    assert reply == StoreReply(stored=0, rejected=196)
    assert checks == [False]
    # Valid records, repeated or not, are stored as before; a repeat counts as stored.
    good = [make(writer, key=f"ffn.{k}.", now=None) for k in range(3)]
    request = StoreRequest(records=[good[0], good[1], good[0], good[2], good[0]])
    reply = (await on_store(Request(attacker, request, []))).header
    assert reply == StoreReply(stored=5, rejected=0)
    assert checks == [False, True, True, True]
    assert len(dht.records) == 3


def test_forged_records_cost_a_bounded_number_of_checks_per_peer_and_prefix(
    checks: list[bool],
) -> None:
    """Forged records that all differ (so no repeat to spot) from one source: checked
    up to its budget, then refused unchecked until the budget refills; another source
    is checked as before; valid records are never charged."""
    clock = [NOW]
    s = SignedRecordStore(EXPERT_RECORDS, DHTConfig(max_record_ttl_s=600), clock=lambda: clock[0])
    base = make(Identity.generate(), key="ffn.4.")
    forged = (forge(base, issued_at=NOW - i / 1000) for i in itertools.count())
    attacker = Source("attacker", ip_prefix("203.0.113.9"))
    reasons = [s.offer(next(forged), attacker) for _ in range(1000)]
    assert reasons.count("invalid") == len(checks) == 64
    assert reasons.count("verify_budget") == 1000 - 64
    assert s.statistics().refused == {}, "offer counts nothing; put does"
    clock[0] += 1.0  # refills 8 a second
    reasons = [s.offer(next(forged), attacker) for _ in range(100)]
    assert reasons.count("invalid") == 8
    assert len(checks) == 72
    # Fresh identities on the same /24 share its budget: 4 peers' worth.
    sybils = [Source(f"sybil-{i}", ip_prefix(f"203.0.113.{i}")) for i in range(100)]
    reasons = [s.offer(next(forged), sybil) for sybil in sybils for _ in range(16)]
    assert len(checks) - 72 <= 4 * 64
    assert reasons.count("verify_budget") >= 1600 - 4 * 64
    # Another address is checked (and its valid records stored) as before.
    honest = Source("honest", ip_prefix("198.51.100.7"))
    assert s.offer(make(Identity.generate(), key="ffn.5."), honest) is None
    assert s.offer(next(forged), honest) == "invalid"
    # A source whose records are all valid is never charged.
    valid = [make(Identity.generate(), key=f"ffn.{k}.") for k in range(200)]
    assert all(s.offer(r, honest) is None for r in valid)
    # Refilled sources are forgotten by the sweep.
    clock[0] += 120
    s.expire()
    assert s._failures == {}


def test_a_spent_budget_refills_on_the_monotonic_clock_whatever_the_wall_clock_does(
    checks: list[bool], monkeypatch: pytest.MonkeyPatch
) -> None:
    """The store as ExpertDHT builds it (records read on the swarm's clock, nothing
    else given) paces its budgets on the monotonic clock: a /24 that spent its budget
    of failed checks is checked again 20 s later though the wall clock was set back
    3 h meanwhile. On the wall clock, the /24 (an honest neighbour of the forger's
    too) stayed refused for the whole 3 h (an outside audit)."""
    wall, ticks = [time.time()], [5000.0]
    monkeypatch.setattr(
        store_module, "time", SimpleNamespace(time=lambda: wall[0], monotonic=lambda: ticks[0])
    )
    host = SimpleNamespace(
        get_id=lambda: peer_id_for(Identity.generate()),
        get_network=lambda: SimpleNamespace(connections={}),
    )
    kad = SimpleNamespace(add_peer=None)
    dht = ExpertDHT(host, kad, None, DHTConfig(), TimeoutsConfig())  # type: ignore[arg-type]
    s = dht.records
    base = make(Identity.generate(), key="ffn.4.", now=None)
    forged = (forge(base, issued_at=base.issued_at - i / 1000) for i in itertools.count())
    sybils = [Source(f"sybil-{i}", ip_prefix(f"203.0.113.{i}")) for i in range(8)]
    reasons = [s.offer(next(forged), sybil) for sybil in sybils for _ in range(64)]
    assert reasons[-1] == "verify_budget"
    neighbour = Source("neighbour", ip_prefix("203.0.113.200"))
    good = make(Identity.generate(), key="ffn.5.", now=None)
    assert s.offer(good, neighbour) == "verify_budget"
    wall[0] -= 3 * 3600
    ticks[0] += 20
    assert s.offer(good, neighbour) is None


def test_a_forged_refresh_of_a_held_slot_is_budgeted_too(checks: list[bool]) -> None:
    """Newer forged records for a slot an honest writer holds: checked within the
    sender's budget, and never displace the honest record."""
    clock = [NOW]
    s = SignedRecordStore(EXPERT_RECORDS, DHTConfig(max_record_ttl_s=600), clock=lambda: clock[0])
    honest = make(Identity.generate(), key="ffn.4.")
    assert s.put(honest, Source("honest", ip_prefix("198.51.100.7")))
    attacker = Source("attacker", ip_prefix("203.0.113.9"))
    reasons = [s.offer(forge(honest, issued_at=NOW + i / 100), attacker) for i in range(1, 500)]
    assert reasons.count("invalid") == 64
    assert reasons.count("verify_budget") == 499 - 64
    assert checks.count(False) == 64
    assert s.get("ffn.4.") == [honest]


def test_a_refresh_that_cannot_fit_is_refused_before_its_signature_is_checked(
    checks: list[bool],
) -> None:
    """A valid refresh refused by a quota, replayed: the quota is decided first, so a
    replay costs no verification (before: one each)."""
    s, refresh, writer, first, filler = quota_filled_by_its_writer()
    checks.clear()
    for _ in range(100):
        assert s.offer(refresh, filler) == "peer_quota"
    assert checks == []
    assert s.put(make(writer, key="ffn.9999.", children=[4], now=NOW + 2), first)
    assert checks == [True]


# -- remembered writers ------------------------------------------------------------------

# Small caps: 64 remembered writers with no record in all, 17 per IP prefix.
SMALL = DHTConfig(
    max_record_ttl_s=600, store_budget_mb=0.25, peer_quota_mb=0.05, ip_prefix_quota_mb=0.05
)


def test_the_default_caps_on_remembered_writers() -> None:
    assert remembered_caps(EXPERT_RECORDS.limits(DHTConfig())) == (12_288, 1_024)
    assert remembered_caps(EXPERT_RECORDS.limits(SMALL)) == (64, 17)


def test_remembered_writers_stay_within_their_caps_under_churn() -> None:
    """Fresh identities with 1 s records, swept every 10 s (the audit's churn): the
    writers remembered stay within the caps, in all and per prefix (before: every one
    of them for 600 s)."""
    clock = [NOW]
    s = SignedRecordStore(EXPERT_RECORDS, SMALL, clock=lambda: clock[0])
    total, per_prefix = remembered_caps(s.limits)
    sources = [Source(f"churn-{p}", ip_prefix(f"203.0.{p}.9")) for p in range(6)]
    stored = 0
    for _ in range(6):
        for source in sources:
            for i in range(20):
                record = make(Identity.generate(), key=f"ffn.{i}.", ttl_s=1, now=clock[0])
                stored += s.put(record, source)
        clock[0] += 10
        s.expire()
        assert s.statistics().writers <= total
        assert all(len(writers) <= per_prefix for writers in s._empty.values())
    assert stored == 6 * 6 * 20, "the churn itself is stored as before"
    assert s.statistics().forgotten_writers >= stored - total


def test_churn_forgets_fresh_identities_before_the_servers_seen_long_before() -> None:
    """Servers whose records lapsed stay remembered while a churn of fresh identities,
    from their own prefix and from others, overflows the caps; when they come back they
    keep their rank and displace the newcomers of a full key."""
    clock = [NOW]
    config = SMALL.model_copy(update={"max_records_per_key": 3})
    s = SignedRecordStore(EXPERT_RECORDS, config, clock=lambda: clock[0])
    home = Source("home", ip_prefix("198.51.100.7"))
    servers = [Identity.generate() for _ in range(3)]
    for server in servers:
        assert s.put(make(server, key="ffn.7.", ttl_s=5, now=clock[0]), home)
    clock[0] += 30
    s.expire()  # lapsed: remembered, with no record
    sources = [home, *(Source(f"churn-{p}", ip_prefix(f"203.0.{p}.9")) for p in range(6))]
    for _ in range(4):
        for source in sources:
            for i in range(20):
                s.put(make(Identity.generate(), key=f"ffn.{i}.", ttl_s=1, now=clock[0]), source)
        clock[0] += 10
        s.expire()
    assert s.statistics().forgotten_writers > 0
    newcomers = [Identity.generate() for _ in range(3)]
    for newcomer in newcomers:
        assert s.put(make(newcomer, key="ffn.7.", ttl_s=60, now=clock[0]), home)
    for server in servers:
        assert s.put(make(server, key="ffn.7.", ttl_s=60, now=clock[0]), home)
    held = {r.peer_id for r in s.get("ffn.7.")}
    assert held == {str(peer_id_for(server)) for server in servers}


def test_a_find_over_flooded_keys_reads_only_the_records_it_sends() -> None:
    """A 640-byte find naming 64 keys of 400 writers each cost a node ~14-25 ms: every
    key swept and sorted in full for a reply of ~120 records. The reply is the same as
    from full sorted lists; no more records are read than it holds, and one more per
    key; an expired record is never sent; a change to a key is seen by the next find."""
    from volunteerd.net.dht import _FIND_REPLY_BYTES, fit_reply

    clock = [NOW]
    s = SignedRecordStore(EXPERT_RECORDS, DHTConfig(max_record_ttl_s=600), clock=lambda: clock[0])
    keys = [f"ffn.{i}." for i in range(8)]
    writers = [Identity.generate() for _ in range(40)]
    for w, identity in enumerate(writers):
        source = Source(f"p{w}", f"10.0.{w}.0/24")
        for key in keys:
            assert s.put(make(identity, key=key, ttl_s=5 if w == 0 else 60), source)
    read = [0]

    def counted(records: Any) -> Any:
        for record in records:
            read[0] += 1
            yield record

    size_of = EXPERT_RECORDS.wire_size_of
    lazy = fit_reply([counted(s.ranked(k)) for k in keys], _FIND_REPLY_BYTES, size_of)
    assert lazy == fit_reply([s.get(k) for k in keys], _FIND_REPLY_BYTES, size_of)
    assert 0 < len(lazy) < 8 * 40  # the reply is full before the keys are
    assert read[0] <= len(lazy) + len(keys)
    clock[0] += 10  # the first writer's records expired (none swept yet)
    oldest = str(peer_id_for(writers[0]))
    assert all(r.peer_id != oldest for k in keys for r in s.ranked(k))
    newcomer = make(Identity.generate(), key="ffn.0.", now=clock[0])
    assert s.put(newcomer, Source("new", "10.9.9.0/24"))
    assert newcomer in list(s.ranked("ffn.0."))
