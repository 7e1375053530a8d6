"""DHT records: signatures, expiry, sizes and keys are checked; the store keeps one
record per (key, peer), the newest, until it expires."""

from __future__ import annotations

import base64
import json

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from volunteerd.config import DHTConfig
from volunteerd.errors import InvalidRecord
from volunteerd.identity import Identity
from volunteerd.net.peers import peer_id_for, public_key_of
from volunteerd.net.records import (
    ExpertRecord,
    RecordStore,
    merge_newest,
    parse_record,
    sign_record,
    validate_record,
)

NOW = 1_800_000_000.0
CONFIG = DHTConfig(max_record_ttl_s=600, max_clock_skew_s=30, max_records_per_key=3, max_keys=4)


def make(identity: Identity, key: str = "ffn.", **kw) -> ExpertRecord:  # type: ignore[no-untyped-def]
    kw.setdefault("children", [3] if key.endswith(".") else [])
    kw.setdefault("ttl_s", 60)
    kw.setdefault("now", NOW)
    return sign_record(
        identity, str(peer_id_for(identity)), key=key, addrs=["/ip4/127.0.0.1/tcp/1"], **kw
    )


def check(record: ExpertRecord, now: float = NOW) -> None:
    validate_record(
        record, public_key_of=public_key_of, now=now, max_ttl_s=600, max_clock_skew_s=30
    )


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
        parse_record(json.dumps(data))


@settings(max_examples=200, deadline=None)
@given(st.binary(max_size=512))
def test_random_bytes_never_crash_the_validator(raw: bytes) -> None:
    try:
        check(parse_record(raw))
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
        check(parse_record(json.dumps(data)))
    except InvalidRecord:
        return
    # The only way through is leaving the signed content as it was.
    assert parse_record(json.dumps(data)) == original


def store(now: list[float]) -> RecordStore:
    return RecordStore(CONFIG, public_key_of, clock=lambda: now[0])


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


def test_store_refuses_forged_records() -> None:
    s = store([NOW])
    record = make(Identity.generate())
    forged = record.model_copy(
        update={"signature": base64.b64encode(Identity.generate().sign(b"x")).decode()}
    )
    assert not s.put(forged)
    assert s.get("ffn.") == []


def test_store_is_bounded_in_keys_and_records_per_key() -> None:
    s = store([NOW])
    peers = [Identity.generate() for _ in range(5)]
    for i, peer in enumerate(peers[:3]):
        assert s.put(make(peer, ttl_s=30 + i))
    # A full key makes room only for a record that outlives the soonest-expiring one.
    assert not s.put(make(peers[3], ttl_s=10))
    assert s.put(make(peers[4], ttl_s=100))
    assert len(s.get("ffn.")) == 3
    for key in ("a.", "b.", "c."):
        assert s.put(make(peers[0], key=key))
    assert not s.put(make(peers[0], key="d."))


def test_merge_keeps_withdrawals_newer_than_announcements() -> None:
    a = Identity.generate()
    announced = make(a, children=[1])
    withdrawn = make(a, children=[], active=False, now=NOW + 1)
    assert merge_newest([announced, withdrawn]) == [withdrawn]
