"""One envelope for every signed record a node stores for others, and what a kind is.

A signed record is a statement by one *writer* (the peer whose Ed25519 key its id
embeds) about one *key*, valid from ``issued_at`` until ``expires_at``. Every kind
(``net/records.py``: expert records, experiment manifests) is checked here, the same
way, by ``RecordKind.validate``:

1. the times: finite, not expired, not issued more than ``dht.max_clock_skew_s`` in
   the future, not expiring before issued, not living longer than the kind allows;
2. the kind's own rules (cheap, so before the signature);
3. the signature: base64 Ed25519, by the writer, over the kind's domain line and the
   record's canonical JSON (every field but ``signature``, keys sorted, no spaces).

The domain line makes a signature of one kind worthless as another's. The JSON a
record travels as is its model's: the kind's own fields first, then ``issued_at``,
``expires_at`` and ``signature`` (a kind's model derives from ``SignedRecord`` and then
from its payload model, which puts the payload's fields first); nothing here changes
those bytes (tests/unit/test_signed_records.py pins them).
"""

from __future__ import annotations

import base64
import json
import math
from collections.abc import Callable
from dataclasses import dataclass
from typing import Annotated, ClassVar, Generic, Self, TypeVar

from pydantic import BaseModel, ConfigDict, Field, ValidationError

from volunteerd.config import DHTConfig
from volunteerd.errors import InvalidRecord
from volunteerd.identity import Identity, verify_signature
from volunteerd.net.peers import public_key_of

__all__ = ["RecordKind", "RecordLimits", "SignedRecord"]


class SignedRecord(BaseModel):
    """The envelope's fields and signing. ``domain`` names the kind in what is signed."""

    model_config = ConfigDict(frozen=True, extra="forbid")
    domain: ClassVar[bytes]

    issued_at: float
    expires_at: float
    signature: Annotated[str, Field(max_length=128)] = ""

    def signing_bytes(self) -> bytes:
        payload = self.model_dump(mode="json", exclude={"signature"})
        return self.domain + json.dumps(payload, sort_keys=True, separators=(",", ":")).encode()

    def signed(self, identity: Identity) -> Self:
        """This record with ``identity``'s signature (the writer's key)."""
        signature = base64.b64encode(identity.sign(self.signing_bytes())).decode()
        return self.model_copy(update={"signature": signature})


R = TypeVar("R", bound=SignedRecord)


@dataclass(frozen=True, slots=True)
class RecordLimits:
    """What a node accepts of one kind and keeps of it for others (``net/store.py``)."""

    max_ttl_s: float
    max_records: int
    max_record_bytes: int
    max_per_key: int
    max_per_writer: int
    peer_bytes: int
    prefix_bytes: int
    budget_bytes: int
    forget_s: float


def _no_rules(record: SignedRecord, config: DHTConfig) -> None:
    return None


@dataclass(frozen=True, slots=True)
class RecordKind(Generic[R]):
    """One kind of signed record: its model, its slot and how it is bounded.

    ``key_of``/``writer_of`` name a record's slot (one record per key and writer is
    kept); ``dht_key`` maps a key to the DHT key whose closest peers store it;
    ``size_of`` estimates a stored record's memory, ``wire_size_of`` bounds its JSON;
    ``limits`` are the kind's caps under a config; ``rules`` raises InvalidRecord for
    what the kind forbids beyond the envelope.
    """

    name: str
    model: type[R]
    key_of: Callable[[R], str]
    writer_of: Callable[[R], str]
    dht_key: Callable[[str], str]
    size_of: Callable[[R], int]
    wire_size_of: Callable[[R], int]
    limits: Callable[[DHTConfig], RecordLimits]
    rules: Callable[[R, DHTConfig], None] = _no_rules

    def decode(self, raw: bytes | str) -> R:
        """A record from its JSON; InvalidRecord when it is not one (never another error)."""
        try:
            return self.model.model_validate_json(raw)
        except ValidationError as exc:
            raise InvalidRecord(f"malformed {self.name}: {exc.errors()[0]['msg']}") from None
        except ValueError as exc:  # should pydantic ever not wrap a decoding error
            raise InvalidRecord(f"malformed {self.name}: {exc}") from None

    def validate(self, record: R, config: DHTConfig, *, now: float) -> None:
        """Raise InvalidRecord unless ``record`` is current, within the kind's rules and
        signed by its writer. Checks that need no signature come first."""
        what = f"{self.name} {self.key_of(record)!r}"
        issued, expires = record.issued_at, record.expires_at
        if not (math.isfinite(issued) and math.isfinite(expires)):
            # NaN compares false with everything and would slip past the checks below.
            raise InvalidRecord(f"{what} has a time that is not finite")
        if expires <= now:
            raise InvalidRecord(f"{what} expired {now - expires:.1f}s ago")
        if issued > now + config.max_clock_skew_s:
            raise InvalidRecord(f"{what} is issued in the future")
        if expires < issued:
            raise InvalidRecord(f"{what} expires before it is issued")
        max_ttl_s = self.limits(config).max_ttl_s
        if expires - issued > max_ttl_s:
            raise InvalidRecord(f"{what} lives longer than {max_ttl_s:.0f}s")
        self.rules(record, config)
        public_key = public_key_of(self.writer_of(record))
        if public_key is None:
            raise InvalidRecord(f"{what}: the writer's peer id does not embed an Ed25519 key")
        try:
            signature = base64.b64decode(record.signature, validate=True)
        except ValueError:
            raise InvalidRecord(f"{what}: the signature is not base64") from None
        if base64.b64encode(signature).decode() != record.signature:
            # The last character's unused bits (and such) spell the same bytes several
            # ways: one signed record would pass as several different ones.
            raise InvalidRecord(f"{what}: the signature is not in canonical base64")
        if not verify_signature(public_key, record.signing_bytes(), signature):
            raise InvalidRecord(f"bad signature on {what}")
