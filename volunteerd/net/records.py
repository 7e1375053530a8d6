"""Signed, expiring DHT records for expert discovery, and the store that keeps them.

A server hosting ``ffn.3.17`` announces one record per key in ``uid_prefixes``:

=============  ==========================================================
key            record says
=============  ==========================================================
``ffn.``       this peer hosts experts whose first coordinate is in children
``ffn.3.``     ... whose second coordinate (under ffn.3) is in children
``ffn.3.17``   this peer hosts ffn.3.17 (children is empty)
=============  ==========================================================

Many servers share a key: a storing node keeps one record per (key, peer), the one
issued last. A record is signed by the announcing peer's Ed25519 key (the key is
embedded in its peer id), carries its own expiry, and is refused when the signature,
the times, the sizes or the key are wrong. A server that stops cleanly publishes
``active=False`` records so that its experts vanish at once; one that crashes
vanishes when its records expire.
"""

from __future__ import annotations

import base64
import json
import math
import time
from collections.abc import Callable, Iterable
from typing import Annotated, Literal

from pydantic import AfterValidator, BaseModel, ConfigDict, Field, ValidationError

from volunteerd import uids
from volunteerd.config import DHTConfig
from volunteerd.errors import InvalidRecord
from volunteerd.identity import Identity, verify_signature
from volunteerd.net.peers import parse_circuit_addr

__all__ = [
    "ExpertRecord",
    "FindReply",
    "FindRequest",
    "RecordStore",
    "StoreReply",
    "StoreRequest",
    "merge_newest",
    "parse_record",
    "sign_record",
    "validate_record",
]

_DOMAIN = b"volunteerd/expert-record/v1\n"
MAX_ADDRS = 8
MAX_CHILDREN = 4096


def _check_key(value: str) -> str:
    if not uids.is_valid_key(value):
        raise ValueError("not a valid DHT key (expected e.g. 'ffn.', 'ffn.3.' or 'ffn.3.17')")
    return value


def _check_addr(value: str) -> str:
    """A transport multiaddr (no /p2p/), or a circuit address through a relay:
    ``<relay transport>/p2p/<relay id>/p2p-circuit`` (docs/protocol.md)."""
    if value.startswith("/") and "/p2p/" not in value and "p2p-circuit" not in value:
        return value
    if parse_circuit_addr(value) is None:
        raise ValueError("not a transport multiaddr or a circuit address")
    return value


Key = Annotated[str, Field(max_length=uids.MAX_UID_LENGTH), AfterValidator(_check_key)]
Addr = Annotated[str, Field(max_length=200), AfterValidator(_check_addr)]


class ExpertRecord(BaseModel):
    model_config = ConfigDict(frozen=True, extra="forbid")

    key: Key
    peer_id: Annotated[str, Field(min_length=1, max_length=128)]
    addrs: Annotated[tuple[Addr, ...], Field(max_length=MAX_ADDRS)]
    children: Annotated[
        tuple[Annotated[int, Field(ge=0, le=uids.MAX_COORDINATE)], ...],
        Field(max_length=MAX_CHILDREN),
    ] = ()
    active: bool = True
    issued_at: float
    expires_at: float
    signature: Annotated[str, Field(max_length=128)] = ""

    def signing_bytes(self) -> bytes:
        payload = self.model_dump(mode="json", exclude={"signature"})
        return _DOMAIN + json.dumps(payload, sort_keys=True, separators=(",", ":")).encode()

    @property
    def is_uid(self) -> bool:
        return not self.key.endswith(".")


def sign_record(
    identity: Identity,
    peer_id: str,
    *,
    key: str,
    addrs: Iterable[str],
    children: Iterable[int] = (),
    ttl_s: float,
    active: bool = True,
    now: float | None = None,
) -> ExpertRecord:
    issued = time.time() if now is None else now
    unsigned = ExpertRecord(
        key=key,
        peer_id=peer_id,
        addrs=tuple(addrs),
        children=tuple(sorted(set(children))),
        active=active,
        issued_at=issued,
        expires_at=issued + ttl_s,
    )
    signature = base64.b64encode(identity.sign(unsigned.signing_bytes())).decode()
    return unsigned.model_copy(update={"signature": signature})


def validate_record(
    record: ExpertRecord,
    *,
    public_key_of: Callable[[str], bytes | None],
    now: float,
    max_ttl_s: float,
    max_clock_skew_s: float,
) -> None:
    """Raise InvalidRecord unless ``record`` is well-formed, current and truly signed.

    ``public_key_of`` maps a peer id to the Ed25519 public key it embeds.
    """
    if not (math.isfinite(record.issued_at) and math.isfinite(record.expires_at)):
        # NaN compares false with everything and would slip past the checks below.
        raise InvalidRecord(f"record for {record.key!r} has a time that is not finite")
    if record.expires_at <= now:
        raise InvalidRecord(f"record for {record.key!r} expired {now - record.expires_at:.1f}s ago")
    if record.issued_at > now + max_clock_skew_s:
        raise InvalidRecord(f"record for {record.key!r} is issued in the future")
    if record.expires_at - record.issued_at > max_ttl_s:
        raise InvalidRecord(f"record for {record.key!r} lives longer than {max_ttl_s}s")
    if record.expires_at < record.issued_at:
        raise InvalidRecord("record expires before it is issued")
    if record.is_uid and record.children:
        raise InvalidRecord(f"record for uid {record.key!r} must not list children")
    if not record.is_uid and record.active and not record.children:
        raise InvalidRecord(f"active record for prefix {record.key!r} lists no children")
    public_key = public_key_of(record.peer_id)
    if public_key is None:
        raise InvalidRecord("record's peer id does not embed an Ed25519 key")
    try:
        signature = base64.b64decode(record.signature, validate=True)
    except ValueError:
        raise InvalidRecord("record signature is not base64") from None
    if not verify_signature(public_key, record.signing_bytes(), signature):
        raise InvalidRecord(f"bad signature on record for {record.key!r}")


def parse_record(raw: bytes | str) -> ExpertRecord:
    try:
        return ExpertRecord.model_validate_json(raw)
    except ValidationError as exc:
        raise InvalidRecord(f"malformed record: {exc.errors()[0]['msg']}") from None


class StoreRequest(BaseModel):
    model_config = ConfigDict(frozen=True, extra="forbid")
    records: Annotated[list[ExpertRecord], Field(max_length=256)]


class StoreReply(BaseModel):
    model_config = ConfigDict(frozen=True, extra="forbid")
    status: Literal["ok"] = "ok"
    stored: int = 0
    rejected: int = 0


class FindRequest(BaseModel):
    model_config = ConfigDict(frozen=True, extra="forbid")
    keys: Annotated[list[Key], Field(min_length=1, max_length=64)]


class FindReply(BaseModel):
    model_config = ConfigDict(frozen=True, extra="forbid")
    status: Literal["ok"] = "ok"
    records: Annotated[list[ExpertRecord], Field(max_length=16384)]


class RecordStore:
    """Records this node keeps for the swarm: one per (key, peer), each until it expires.

    Bounded: at most ``max_keys`` keys and ``max_records_per_key`` records a key; when a
    key is full, the record expiring first makes room for one that expires later.
    """

    def __init__(
        self,
        config: DHTConfig,
        public_key_of: Callable[[str], bytes | None],
        clock: Callable[[], float] = time.time,
    ) -> None:
        self._config = config
        self._public_key_of = public_key_of
        self._clock = clock
        self._records: dict[str, dict[str, ExpertRecord]] = {}

    def __len__(self) -> int:
        return sum(len(v) for v in self._records.values())

    def put(self, record: ExpertRecord) -> bool:
        """Validate and keep ``record``; False if refused. Raises nothing."""
        now = self._clock()
        try:
            validate_record(
                record,
                public_key_of=self._public_key_of,
                now=now,
                max_ttl_s=self._config.max_record_ttl_s,
                max_clock_skew_s=self._config.max_clock_skew_s,
            )
        except InvalidRecord:
            return False
        per_key = self._records.get(record.key)
        if per_key is None:
            if len(self._records) >= self._config.max_keys:
                self.expire()
                if len(self._records) >= self._config.max_keys:
                    return False
            per_key = self._records[record.key] = {}
        old = per_key.get(record.peer_id)
        if old is not None and old.issued_at >= record.issued_at:
            return old == record  # a repeat is fine; an older one is not stored
        if old is None and len(per_key) >= self._config.max_records_per_key:
            soonest = min(per_key.values(), key=lambda r: r.expires_at)
            if soonest.expires_at >= record.expires_at and soonest.expires_at > now:
                return False
            del per_key[soonest.peer_id]
        per_key[record.peer_id] = record
        return True

    def get(self, key: str) -> list[ExpertRecord]:
        """Unexpired records for ``key``, withdrawn ones included (they hide older copies)."""
        per_key = self._records.get(key)
        if not per_key:
            return []
        now = self._clock()
        alive = [r for r in per_key.values() if r.expires_at > now]
        if len(alive) != len(per_key):
            for record in list(per_key.values()):
                if record.expires_at <= now:
                    del per_key[record.peer_id]
            if not per_key:
                del self._records[key]
        return alive

    def expire(self) -> int:
        """Drop expired records; returns how many."""
        now = self._clock()
        dropped = 0
        for key in list(self._records):
            per_key = self._records[key]
            for peer_id in [p for p, r in per_key.items() if r.expires_at <= now]:
                del per_key[peer_id]
                dropped += 1
            if not per_key:
                del self._records[key]
        return dropped


def merge_newest(records: Iterable[ExpertRecord]) -> list[ExpertRecord]:
    """One record per (key, peer): the newest. Withdrawn records are kept (callers filter)."""
    newest: dict[tuple[str, str], ExpertRecord] = {}
    for record in records:
        slot = (record.key, record.peer_id)
        old = newest.get(slot)
        if old is None or record.issued_at > old.issued_at:
            newest[slot] = record
    return list(newest.values())
