"""DHT records: signatures, expiry, sizes and keys are checked; the store keeps one
record per (key, peer), the newest, until it expires, within caps that a flood of
fresh identities cannot use to displace the servers seen before it."""

from __future__ import annotations

import base64
import json
import tracemalloc

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from volunteerd.config import DHTConfig
from volunteerd.errors import InvalidRecord
from volunteerd.identity import Identity
from volunteerd.net.dht import fit_reply, merge_answers
from volunteerd.net.peers import peer_id_for
from volunteerd.net.records import EXPERT_RECORDS, ExpertRecord, FindReply, sign_record
from volunteerd.net.store import SignedRecordStore, Source, ip_prefix

NOW = 1_800_000_000.0
CONFIG = DHTConfig(max_record_ttl_s=600, max_clock_skew_s=30, max_records_per_key=3, max_keys=4)
CHECKS = DHTConfig(max_record_ttl_s=600, max_clock_skew_s=30, max_children_per_record=4096)


def make(identity: Identity, key: str = "ffn.", **kw) -> ExpertRecord:  # type: ignore[no-untyped-def]
    kw.setdefault("children", [3] if key.endswith(".") else [])
    kw.setdefault("ttl_s", 60)
    kw.setdefault("now", NOW)
    return sign_record(
        identity, str(peer_id_for(identity)), key=key, addrs=["/ip4/127.0.0.1/tcp/1"], **kw
    )


def check(record: ExpertRecord, now: float = NOW) -> None:
    EXPERT_RECORDS.validate(record, CHECKS, now=now)


def test_a_signed_record_validates() -> None:
    check(make(Identity.generate()))


def test_record_signed_by_another_key_is_rejected() -> None:
    honest, forger = Identity.generate(), Identity.generate()
    forged = sign_record(
        forger, str(peer_id_for(honest)), key="ffn.", addrs=[], children=[1], ttl_s=60, now=NOW
    )
    with pytest.raises(InvalidRecord, match="bad signature"):
        check(forged)


def test_tampered_fields_break_the_signature() -> None:
    record = make(Identity.generate())
    for change in ({"children": (7,)}, {"expires_at": NOW + 500}, {"addrs": ("/ip4/6.6.6.6",)}):
        with pytest.raises(InvalidRecord):
            check(record.model_copy(update=change))


def test_expired_and_future_and_overlong_records_are_rejected() -> None:
    identity = Identity.generate()
    with pytest.raises(InvalidRecord, match="expired"):
        check(make(identity), now=NOW + 61)
    with pytest.raises(InvalidRecord, match="future"):
        check(make(identity, now=NOW + 3600, ttl_s=60))
    with pytest.raises(InvalidRecord, match="longer than"):
        check(make(identity, ttl_s=10_000))


def test_uid_records_list_no_children_and_prefix_records_do() -> None:
    identity = Identity.generate()
    with pytest.raises(InvalidRecord, match="must not list children"):
        check(make(identity, key="ffn.3.17", children=[1]))
    with pytest.raises(InvalidRecord, match="no children"):
        check(make(identity, key="ffn.3.", children=[]))


def test_peer_id_without_embedded_key_is_rejected() -> None:
    record = make(Identity.generate()).model_copy(update={"peer_id": "QmNotAnEd25519Id"})
    with pytest.raises(InvalidRecord):
        check(record)


def test_bad_signature_encoding_is_rejected() -> None:
    record = make(Identity.generate()).model_copy(update={"signature": "***"})
    with pytest.raises(InvalidRecord, match="base64"):
        check(record)


@pytest.mark.parametrize(
    "change",
    [
        {"key": "../../etc"},
        {"key": "ffn"},
        {"key": "x" * 100 + "."},
        {"addrs": ["/ip4/1.2.3.4/tcp/1"] * 9},
        {"addrs": ["not-a-multiaddr"]},
        {"children": list(range(5000))},
        {"unexpected": True},
    ],
)
def test_malformed_or_oversized_records_do_not_parse(change: dict) -> None:  # type: ignore[type-arg]
    data = make(Identity.generate()).model_dump(mode="json") | change
    with pytest.raises(InvalidRecord, match="malformed"):
        EXPERT_RECORDS.decode(json.dumps(data))


@settings(max_examples=200, deadline=None)
@given(st.binary(max_size=512))
def test_random_bytes_never_crash_the_validator(raw: bytes) -> None:
    try:
        check(EXPERT_RECORDS.decode(raw))
    except InvalidRecord:
        pass


@settings(max_examples=100, deadline=None)
@given(
    field=st.sampled_from(["key", "peer_id", "signature", "issued_at", "expires_at"]),
    value=st.one_of(st.text(max_size=40), st.floats(allow_nan=True), st.integers()),
)
def test_fuzzed_fields_are_rejected_or_valid_never_crash(field: str, value: object) -> None:
    original = make(Identity.generate())
    data = original.model_dump(mode="json")
    data[field] = value
    try:
        check(EXPERT_RECORDS.decode(json.dumps(data)))
    except InvalidRecord:
        return
    # The only way through is leaving the signed content as it was.
    assert EXPERT_RECORDS.decode(json.dumps(data)) == original


def store(now: list[float]) -> SignedRecordStore[ExpertRecord]:
    return SignedRecordStore(EXPERT_RECORDS, CONFIG, clock=lambda: now[0])


def test_store_keeps_newest_record_per_peer_and_drops_expired() -> None:
    now = [NOW]
    s = store(now)
    a, b = Identity.generate(), Identity.generate()
    assert s.put(make(a, children=[1]))
    assert s.put(make(b, children=[2]))
    assert s.put(make(a, children=[5], now=NOW + 1))
    assert not s.put(make(a, children=[9], now=NOW - 1)), "older record must not win"
    children = sorted(c for r in s.get("ffn.") for c in r.children)
    assert children == [2, 5]
    now[0] = NOW + 60.5
    assert [r.children for r in s.get("ffn.")] == [(5,)]
    now[0] = NOW + 62
    assert s.get("ffn.") == []


def test_a_record_issued_past_the_tolerance_does_not_hold_its_slot_once_the_clock_is_set() -> None:
    """A node two hours ahead stored its own records on its own clock; once the swarm's
    time corrects it (net/swarm_clock.py), they are issued in the future and invalid:
    no longer served, and its next records, issued earlier than them, replace them
    (they were refused as stale until the future ones expired). A valid newer record
    still wins over an older one."""
    records_now = [NOW + 7200]
    s = SignedRecordStore(
        EXPERT_RECORDS, CONFIG, clock=lambda: NOW, record_clock=lambda: records_now[0]
    )
    me = Identity.generate()
    assert s.put(make(me, children=[1], now=NOW + 7200))
    records_now[0] = NOW  # the swarm's time, read from peers' records
    assert s.get("ffn.") == []  # invalid now: not served
    assert list(s.ranked("ffn.")) == []
    assert s.put(make(me, children=[2], now=NOW))
    assert [r.children for r in s.get("ffn.")] == [(2,)]
    assert not s.put(make(me, children=[3], now=NOW - 1)), "older record must not win"
    assert s.put(make(me, children=[4], now=NOW + 20))  # ahead, within the tolerance
    assert not s.put(make(me, children=[5], now=NOW + 10)), "nor older than a tolerated one"
    assert [r.children for r in s.get("ffn.")] == [(4,)]


def test_store_refuses_forged_records() -> None:
    s = store([NOW])
    record = make(Identity.generate())
    forged = record.model_copy(
        update={"signature": base64.b64encode(Identity.generate().sign(b"x")).decode()}
    )
    assert not s.put(forged)
    assert s.get("ffn.") == []


def test_a_full_key_keeps_the_writers_seen_longest() -> None:
    now = [NOW]
    config = DHTConfig(max_record_ttl_s=600, max_clock_skew_s=30, max_records_per_key=3)
    s = SignedRecordStore(EXPERT_RECORDS, config, clock=lambda: now[0])
    incumbents = [Identity.generate() for _ in range(3)]
    for peer in incumbents:
        assert s.put(make(peer, ttl_s=30))
    now[0] += 5
    # A newcomer never displaces a writer seen before it, however long its record lives.
    newcomer = Identity.generate()
    assert not s.put(make(newcomer, ttl_s=600, now=now[0]))
    assert s.statistics().refused == {"key_full": 1}
    # Incumbents keep refreshing their own slots.
    assert all(s.put(make(p, ttl_s=30, now=now[0])) for p in incumbents)
    assert {r.peer_id for r in s.get("ffn.")} == {str(peer_id_for(p)) for p in incumbents}
    # A writer seen longer than the newest one displaces it on another key.
    assert s.put(make(newcomer, key="a.", now=now[0]))
    for peer in incumbents[1:]:
        s.put(make(peer, key="a.", now=now[0]))
    now[0] += 1
    assert s.put(make(incumbents[0], key="a.", now=now[0]))
    assert str(peer_id_for(newcomer)) not in {r.peer_id for r in s.get("a.")}
    assert s.statistics().evicted == 1


def test_answers_list_the_writers_seen_longest_first() -> None:
    now = [NOW]
    s = store(now)
    peers = [Identity.generate() for _ in range(3)]
    for i, peer in enumerate(peers):
        now[0] = NOW + i
        assert s.put(make(peer, now=now[0]))
    # refreshing does not make an old writer new
    assert s.put(make(peers[0], now=now[0] + 1))
    assert [r.peer_id for r in s.get("ffn.")] == [str(peer_id_for(p)) for p in peers]


def test_a_record_with_4096_children_is_refused_before_its_signature_is_checked() -> None:
    s = SignedRecordStore(EXPERT_RECORDS, DHTConfig(max_record_ttl_s=600), clock=lambda: NOW)
    fat = make(Identity.generate(), children=list(range(4096)))
    assert not s.put(fat.model_copy(update={"signature": "bm90IGNoZWNrZWQ="}))
    assert s.statistics().refused == {"too_large": 1}
    assert s.put(make(Identity.generate(), children=list(range(256))))
    with pytest.raises(InvalidRecord, match="at most 256"):
        EXPERT_RECORDS.validate(fat, DHTConfig(max_record_ttl_s=600), now=NOW)


def test_identities_behind_one_address_share_one_quota() -> None:
    config = DHTConfig(max_record_ttl_s=600, peer_quota_mb=0.01, ip_prefix_quota_mb=0.02)
    s = SignedRecordStore(EXPERT_RECORDS, config, clock=lambda: NOW)
    honest = Source("honest", ip_prefix("198.51.100.7"))
    kept = make(Identity.generate(), key="ffn.0.")
    assert s.put(kept, honest)
    refused: list[str | None] = []
    for i in range(200):  # 200 identities through 20 connections from one /24
        source = Source(f"attacker-{i % 20}", ip_prefix(f"203.0.113.{i % 20}"))
        refused.append(s.offer(make(Identity.generate(), key="ffn.0."), source))
    stored = refused.count(None)
    assert 0 < stored * 1600 <= 0.02 * (1 << 20)
    assert set(refused) == {None, "prefix_quota"}
    # One connection alone fills its own, smaller quota; another network has its room.
    alone = Source("one", ip_prefix("192.0.2.1"))
    outcomes = [s.offer(make(Identity.generate(), key="ffn.1."), alone) for _ in range(20)]
    assert outcomes[0] is None
    assert outcomes[-1] == "peer_quota"
    assert kept in s.get("ffn.0.")
    assert ip_prefix("2001:db8:1:2::5") == ip_prefix("2001:db8:1:ffff::9") == "2001:db8:1::/48"


def test_memory_stays_within_the_budget_under_a_flood_of_fat_records() -> None:
    budget_mb = 1.0
    config = DHTConfig(max_record_ttl_s=600, store_budget_mb=budget_mb)
    identities = [Identity.generate() for _ in range(60)]
    flood = [
        make(identity, key=f"ffn.{k}.", children=list(range(256)))
        for identity in identities
        for k in range(10)
    ]
    tracemalloc.start()
    s = SignedRecordStore(EXPERT_RECORDS, config, clock=lambda: NOW)
    for i, record in enumerate(flood):
        s.put(record.model_copy(), Source(f"p{i}", ip_prefix(f"10.{i % 250}.{i // 250}.1")))
    held, _ = tracemalloc.get_traced_memory()
    tracemalloc.stop()
    stats = s.statistics()
    budget = budget_mb * (1 << 20) * 3 / 4
    assert stats.bytes <= budget
    assert stats.refused["budget"] > 0
    # The estimate bounds what the records really hold (flood list itself excluded:
    # its copies are what the store keeps).
    assert held <= budget * 1.25


def test_merge_keeps_withdrawals_newer_than_announcements() -> None:
    a = Identity.generate()
    announced = make(a, children=[1])
    withdrawn = make(a, children=[], active=False, now=NOW + 1)
    assert merge_answers(EXPERT_RECORDS, [(0, announced), (1, withdrawn)]) == [withdrawn]
    assert merge_answers(EXPERT_RECORDS, [(1, withdrawn), (0, announced)]) == [withdrawn]


def test_a_find_reply_fits_the_header_cap_and_keeps_every_keys_best_writers() -> None:
    flooded = [make(Identity.generate(), key="ffn.0.") for _ in range(600)]
    quiet = [make(Identity.generate(), key="ffn.1.") for _ in range(2)]
    records = fit_reply([flooded, quiet], 48 * 1024, EXPERT_RECORDS.wire_size_of)
    reply = FindReply(records=records).model_dump_json()
    assert len(reply) <= 48 * 1024
    assert records[:4] == [flooded[0], quiet[0], flooded[1], quiet[1]]
    assert len(records) < 602
