"""One envelope, one store, two kinds: expert records and experiment manifests are
checked by the same rules, kept under caps from the config, and read from the bytes
that daemons of this version write. Hostile bytes, decoded the way the RPC server
decodes a store request, end as a typed error or a valid record, never another
exception."""

from __future__ import annotations

import base64
import json
from typing import Any

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from volunteerd.config import DHTConfig
from volunteerd.errors import InvalidRecord, MalformedFrame
from volunteerd.identity import Identity
from volunteerd.net.envelope import RecordKind, SignedRecord
from volunteerd.net.peers import peer_id_for
from volunteerd.net.protocols import PROTOCOLS, Verb
from volunteerd.net.records import (
    EXPERT_RECORDS,
    MANIFESTS,
    ExpertRecord,
    ManifestRecord,
    sign_record,
)
from volunteerd.net.store import SignedRecordStore, Source
from volunteerd.wire.frames import decode_header

NOW = 1_800_000_000.0
CONFIG = DHTConfig(max_record_ttl_s=600, max_clock_skew_s=30, max_manifest_ttl_s=86400)
WRITER = Identity.generate()
WRITER_ID = str(peer_id_for(WRITER))
FUZZ = settings(max_examples=150, deadline=None, suppress_health_check=[HealthCheck.too_slow])


def expert(issued: float = NOW, ttl_s: float = 60, **kw: Any) -> ExpertRecord:
    kw.setdefault("key", "ffn.3.")
    kw.setdefault("children", [1, 7])
    return sign_record(
        WRITER, WRITER_ID, addrs=["/ip4/127.0.0.1/tcp/1"], ttl_s=ttl_s, now=issued, **kw
    )


def manifest(issued: float = NOW, ttl_s: float = 3600, name: str = "exp") -> ManifestRecord:
    return ManifestRecord(
        name=name, owner=WRITER_ID, body='{"a":1}', issued_at=issued, expires_at=issued + ttl_s
    ).signed(WRITER)


def make(kind: RecordKind[Any], issued: float = NOW, ttl_s: float = 60) -> SignedRecord:
    return expert(issued, ttl_s) if kind is EXPERT_RECORDS else manifest(issued, ttl_s)


KINDS = pytest.mark.parametrize("kind", [EXPERT_RECORDS, MANIFESTS], ids=lambda k: k.name)


# -- the bytes of this version ----------------------------------------------------------


# As daemons of this version write them: the kind's fields first, then the envelope's.
OLD_EXPERT = (
    '{"key":"ffn.3.","peer_id":"<id>","addrs":["/ip4/127.0.0.1/tcp/1"],"children":[1,7],'
    '"active":true,"issued_at":1800000000.0,"expires_at":1800000060.0,"signature":"<sig>"}'
)
OLD_MANIFEST = (
    '{"name":"exp","owner":"<id>","body":"{\\"a\\":1}","issued_at":1800000000.0,'
    '"expires_at":1800003600.0,"signature":"<sig>"}'
)


@pytest.mark.parametrize(
    ("kind", "verb", "domain", "template"),
    [
        (EXPERT_RECORDS, Verb.DHT_STORE, b"volunteerd/expert-record/v1\n", OLD_EXPERT),
        (MANIFESTS, Verb.MANIFEST_STORE, b"volunteerd/experiment-manifest/v1\n", OLD_MANIFEST),
    ],
    ids=["record", "manifest"],
)
def test_records_written_by_this_versions_daemons_are_read_and_written_alike(
    kind: RecordKind[Any], verb: Verb, domain: bytes, template: str
) -> None:
    fields = json.loads(template.replace("<id>", WRITER_ID))
    del fields["signature"]
    # how the code before the one envelope signed: domain line + sorted compact JSON
    signed = domain + json.dumps(fields, sort_keys=True, separators=(",", ":")).encode()
    signature = base64.b64encode(WRITER.sign(signed)).decode()
    wire = template.replace("<id>", WRITER_ID).replace("<sig>", signature)
    record = kind.decode(wire)
    kind.validate(record, CONFIG, now=NOW)
    request = decode_header(PROTOCOLS[verb].request, b'{"records":[%s]}' % wire.encode())
    assert request.records == [record]
    # and this version writes the same bytes, and signs the same content
    assert record.model_dump_json() == wire
    assert record == (expert() if kind is EXPERT_RECORDS else manifest(ttl_s=3600))


def test_signatures_are_domain_separated_between_kinds() -> None:
    assert expert().signing_bytes().startswith(b"volunteerd/expert-record/v1\n")
    assert manifest().signing_bytes().startswith(b"volunteerd/experiment-manifest/v1\n")
    record = manifest()
    as_expert = base64.b64encode(
        WRITER.sign(b"volunteerd/expert-record/v1\n" + record.signing_bytes().split(b"\n", 1)[1])
    ).decode()
    with pytest.raises(InvalidRecord, match="bad signature on manifest 'exp'"):
        MANIFESTS.validate(record.model_copy(update={"signature": as_expert}), CONFIG, now=NOW)


# -- one envelope: the same time and signature rules for every kind ----------------------


@KINDS
def test_every_kind_is_refused_when_expired_early_or_overlong(kind: RecordKind[Any]) -> None:
    kind.validate(make(kind), CONFIG, now=NOW)
    kind.validate(make(kind, issued=NOW + 29), CONFIG, now=NOW)  # within the skew
    with pytest.raises(InvalidRecord, match="expired"):
        kind.validate(make(kind), CONFIG, now=NOW + 60)
    with pytest.raises(InvalidRecord, match="issued in the future"):
        kind.validate(make(kind, issued=NOW + 31), CONFIG, now=NOW)
    max_ttl_s = kind.limits(CONFIG).max_ttl_s
    with pytest.raises(InvalidRecord, match="lives longer than"):
        kind.validate(make(kind, ttl_s=max_ttl_s + 1), CONFIG, now=NOW)


@KINDS
@pytest.mark.parametrize(
    ("change", "why"),
    [
        ({"issued_at": float("nan")}, "not finite"),
        ({"expires_at": float("inf")}, "not finite"),
        ({"expires_at": NOW - 20}, "expired"),
        ({"signature": "***"}, "not base64"),
        ({"signature": base64.b64encode(b"x" * 64).decode()}, "bad signature"),
    ],
)
def test_every_kind_is_refused_when_its_envelope_is_broken(
    kind: RecordKind[Any], change: dict[str, Any], why: str
) -> None:
    with pytest.raises(InvalidRecord, match=why):
        kind.validate(make(kind).model_copy(update=change), CONFIG, now=NOW - 10)


def test_a_record_that_expires_before_it_is_issued_is_refused_even_when_signed() -> None:
    record = ExpertRecord(
        key="ffn.1", peer_id=WRITER_ID, addrs=(), issued_at=NOW + 20, expires_at=NOW + 10
    ).signed(WRITER)
    with pytest.raises(InvalidRecord, match="expires before it is issued"):
        EXPERT_RECORDS.validate(record, CONFIG, now=NOW)


@KINDS
def test_a_writer_whose_id_embeds_no_key_is_refused(kind: RecordKind[Any]) -> None:
    field = "peer_id" if kind is EXPERT_RECORDS else "owner"
    with pytest.raises(InvalidRecord, match="does not embed an Ed25519 key"):
        kind.validate(make(kind).model_copy(update={field: "QmNotEd25519"}), CONFIG, now=NOW)


# -- one store: caps from the config, for either kind ------------------------------------


def test_manifest_caps_come_from_the_config() -> None:
    config = DHTConfig(max_owners_per_name=2, max_manifests=3, max_manifests_per_owner=2)
    store = SignedRecordStore(MANIFESTS, config, clock=lambda: NOW)
    owners = [Identity.generate() for _ in range(4)]

    def signed(owner: Identity, name: str) -> ManifestRecord:
        return ManifestRecord(
            name=name, owner=str(peer_id_for(owner)), body="{}", issued_at=NOW, expires_at=NOW + 9
        ).signed(owner)

    source = Source("p", "203.0.113.0/24")
    assert [store.offer(signed(o, "a"), source) for o in owners[:3]] == [None, None, "key_full"]
    assert store.offer(signed(owners[0], "b"), source) is None
    assert store.offer(signed(owners[0], "c"), source) == "writer_quota"
    assert store.offer(signed(owners[3], "d"), source) == "budget"  # 3 manifests in all
    limits = store.limits
    assert (limits.max_per_key, limits.max_records, limits.max_per_writer) == (2, 3, 2)
    assert limits.max_ttl_s == config.max_manifest_ttl_s


def test_both_kinds_share_the_budget_three_quarters_to_one() -> None:
    config = DHTConfig(store_budget_mb=8)
    records, manifests = EXPERT_RECORDS.limits(config), MANIFESTS.limits(config)
    assert records.budget_bytes == 6 << 20
    assert manifests.budget_bytes == 2 << 20
    assert records.max_per_key == config.max_records_per_key
    assert manifests.max_per_writer == config.max_manifests_per_owner


# -- fuzzing the decoder the RPC server uses ---------------------------------------------

STORE_VERBS = [(Verb.DHT_STORE, EXPERT_RECORDS), (Verb.MANIFEST_STORE, MANIFESTS)]


def offer_header(verb: Verb, kind: RecordKind[Any], raw: bytes) -> list[Any]:
    """What a storing node does with a store request's header: decode it as the RPC
    server does, then offer each record to the store. Returns the records stored."""
    try:
        request = decode_header(PROTOCOLS[verb].request, raw)
    except MalformedFrame:
        return []
    store = SignedRecordStore(kind, CONFIG, clock=lambda: NOW)
    return [r for r in request.records if store.put(r, Source("p", "198.51.100.0/24"))]


@FUZZ
@given(raw=st.binary(max_size=600), which=st.sampled_from(STORE_VERBS))
def test_arbitrary_bytes_are_a_typed_error_or_a_record(
    raw: bytes, which: tuple[Verb, RecordKind[Any]]
) -> None:
    verb, kind = which
    assert offer_header(verb, kind, raw) == []  # nothing unsigned gets in
    for text in (raw, b'{"records":[%s]}' % raw):
        try:
            record = kind.decode(text)
        except InvalidRecord:
            continue
        with pytest.raises(InvalidRecord):
            kind.validate(record, CONFIG, now=NOW)


json_values = st.recursive(
    st.none() | st.booleans() | st.integers() | st.floats() | st.text(max_size=20),
    lambda inner: st.lists(inner, max_size=4) | st.dictionaries(st.text(max_size=8), inner),
    max_leaves=8,
)
expert_fields = ["key", "peer_id", "addrs", "children", "active", "issued_at", "expires_at"]
manifest_fields = ["name", "owner", "body", "issued_at", "expires_at"]


@FUZZ
@given(
    which=st.sampled_from(STORE_VERBS),
    changes=st.dictionaries(
        st.sampled_from([*expert_fields, *manifest_fields, "signature"]) | st.text(max_size=6),
        json_values | st.sampled_from([float("nan"), -1.0, NOW + 1e9, "A" * 300, [1] * 300]),
        min_size=1,
        max_size=3,
    ),
)
def test_mutated_envelopes_are_refused_unless_unchanged(
    which: tuple[Verb, RecordKind[Any]], changes: dict[str, Any]
) -> None:
    verb, kind = which
    original = make(kind)
    data = json.loads(original.model_dump_json()) | changes
    raw = json.dumps({"records": [data]}).encode()  # NaN travels as a JSON extension
    stored = offer_header(verb, kind, raw)
    assert stored in ([], [original])
    try:
        record = kind.decode(json.dumps(data))
        kind.validate(record, CONFIG, now=NOW)
    except InvalidRecord:
        assert stored == []
        return
    assert record == original  # only the signed content keeps a valid signature


@FUZZ
@given(
    which=st.sampled_from(STORE_VERBS),
    flips=st.lists(
        st.tuples(st.integers(min_value=0), st.integers(min_value=0, max_value=255)),
        min_size=1,
        max_size=4,
    ),
)
def test_byte_flipped_store_requests_are_refused_unless_unchanged(
    which: tuple[Verb, RecordKind[Any]], flips: list[tuple[int, int]]
) -> None:
    verb, kind = which
    original = make(kind)
    raw = bytearray(b'{"records":[%s]}' % original.model_dump_json().encode())
    for position, value in flips:
        raw[position % len(raw)] = value
    assert offer_header(verb, kind, bytes(raw)) in ([], [original])
