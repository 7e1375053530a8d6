"""Signed experiment manifests in the DHT: the envelope, its validation, and the store.

An experiment's owner signs its manifest with the owner's Ed25519 key (the one its
peer id embeds) and stores it under ``experiment/<name>`` on the ``replication``
closest peers, with the ``manifest-store`` and ``manifest-find`` verbs. This module
does not know what a manifest says: the body is an opaque, size-capped JSON text that
``volunteerd.swarm.manifest`` parses. Here we check only what any storing peer can:
the form, the times, the sizes and the owner's signature.

A storing node keeps one envelope per (name, owner), the one issued last, until it
expires (lifetimes of days, capped by ``dht.max_manifest_ttl_s``). Keeping one per
owner rather than one per name means nobody can hide an owner's manifest by storing a
newer one of their own under the same name: a reader gets every owner's and picks
the ones it trusts.
"""

from __future__ import annotations

import base64
import json
import math
import time
from collections.abc import Callable
from typing import Annotated, Literal

from pydantic import BaseModel, ConfigDict, Field

from volunteerd.config import DHTConfig
from volunteerd.errors import InvalidRecord
from volunteerd.identity import Identity, verify_signature

__all__ = [
    "MAX_MANIFEST_BODY",
    "ManifestFindReply",
    "ManifestFindRequest",
    "ManifestRecord",
    "ManifestStore",
    "ManifestStoreReply",
    "ManifestStoreRequest",
    "manifest_key",
    "sign_manifest_record",
    "validate_manifest_record",
]

_DOMAIN = b"volunteerd/experiment-manifest/v1\n"
MAX_MANIFEST_BODY = 16 * 1024
MAX_OWNERS_PER_NAME = 16
MAX_NAMES = 1024
NAME_PATTERN = r"^[a-z0-9][a-z0-9_.-]{0,63}$"

Name = Annotated[str, Field(pattern=NAME_PATTERN)]


def manifest_key(name: str) -> str:
    """The DHT key whose closest peers store experiment ``name``'s manifests."""
    return f"experiment/{name}"


class ManifestRecord(BaseModel):
    """One owner's signed manifest for one experiment name."""

    model_config = ConfigDict(frozen=True, extra="forbid")

    name: Name
    owner: Annotated[str, Field(min_length=1, max_length=128)]  # the owner's peer id
    body: Annotated[str, Field(max_length=MAX_MANIFEST_BODY)]
    issued_at: float
    expires_at: float
    signature: Annotated[str, Field(max_length=128)] = ""

    def signing_bytes(self) -> bytes:
        payload = self.model_dump(mode="json", exclude={"signature"})
        return _DOMAIN + json.dumps(payload, sort_keys=True, separators=(",", ":")).encode()


def sign_manifest_record(
    identity: Identity,
    owner: str,
    *,
    name: str,
    body: str,
    issued_at: float,
    expires_at: float,
) -> ManifestRecord:
    """The envelope for ``body``, signed by ``identity`` (whose peer id is ``owner``)."""
    unsigned = ManifestRecord(
        name=name, owner=owner, body=body, issued_at=issued_at, expires_at=expires_at
    )
    signature = base64.b64encode(identity.sign(unsigned.signing_bytes())).decode()
    return unsigned.model_copy(update={"signature": signature})


def validate_manifest_record(
    record: ManifestRecord,
    *,
    public_key_of: Callable[[str], bytes | None],
    now: float,
    max_ttl_s: float,
    max_clock_skew_s: float,
) -> None:
    """Raise InvalidRecord unless ``record`` is current and signed by its owner."""
    if not (math.isfinite(record.issued_at) and math.isfinite(record.expires_at)):
        raise InvalidRecord(f"manifest {record.name!r} has a time that is not finite")
    if record.expires_at <= now:
        raise InvalidRecord(f"manifest {record.name!r} expired {now - record.expires_at:.0f}s ago")
    if record.issued_at > now + max_clock_skew_s:
        raise InvalidRecord(f"manifest {record.name!r} is issued in the future")
    if record.expires_at < record.issued_at:
        raise InvalidRecord(f"manifest {record.name!r} expires before it is issued")
    if record.expires_at - record.issued_at > max_ttl_s:
        raise InvalidRecord(f"manifest {record.name!r} lives longer than {max_ttl_s:.0f}s")
    public_key = public_key_of(record.owner)
    if public_key is None:
        raise InvalidRecord("manifest's owner is not a peer id with an Ed25519 key")
    try:
        signature = base64.b64decode(record.signature, validate=True)
    except ValueError:
        raise InvalidRecord("manifest signature is not base64") from None
    if not verify_signature(public_key, record.signing_bytes(), signature):
        raise InvalidRecord(f"bad signature on manifest {record.name!r}")


class ManifestStoreRequest(BaseModel):
    model_config = ConfigDict(frozen=True, extra="forbid")
    records: Annotated[list[ManifestRecord], Field(min_length=1, max_length=4)]


class ManifestStoreReply(BaseModel):
    model_config = ConfigDict(frozen=True, extra="forbid")
    status: Literal["ok"] = "ok"
    stored: int = 0
    rejected: int = 0


class ManifestFindRequest(BaseModel):
    model_config = ConfigDict(frozen=True, extra="forbid")
    name: Name


class ManifestFindReply(BaseModel):
    model_config = ConfigDict(frozen=True, extra="forbid")
    status: Literal["ok"] = "ok"
    records: Annotated[list[ManifestRecord], Field(max_length=MAX_OWNERS_PER_NAME)]


class ManifestStore:
    """Manifests this node keeps for the swarm: one per (name, owner), the newest,
    each until it expires. At most ``MAX_NAMES`` names and ``MAX_OWNERS_PER_NAME``
    owners a name (when full, the envelope expiring first makes room)."""

    def __init__(
        self,
        config: DHTConfig,
        public_key_of: Callable[[str], bytes | None],
        clock: Callable[[], float] = time.time,
    ) -> None:
        self._config = config
        self._public_key_of = public_key_of
        self._clock = clock
        self._records: dict[str, dict[str, ManifestRecord]] = {}

    def put(self, record: ManifestRecord) -> bool:
        """Validate and keep ``record``; False if refused. Raises nothing."""
        now = self._clock()
        try:
            validate_manifest_record(
                record,
                public_key_of=self._public_key_of,
                now=now,
                max_ttl_s=self._config.max_manifest_ttl_s,
                max_clock_skew_s=self._config.max_clock_skew_s,
            )
        except InvalidRecord:
            return False
        per_name = self._records.get(record.name)
        if per_name is None:
            if len(self._records) >= MAX_NAMES:
                self.expire()
                if len(self._records) >= MAX_NAMES:
                    return False
            per_name = self._records[record.name] = {}
        old = per_name.get(record.owner)
        if old is not None and old.issued_at >= record.issued_at:
            return old == record
        if old is None and len(per_name) >= MAX_OWNERS_PER_NAME:
            soonest = min(per_name.values(), key=lambda r: r.expires_at)
            if soonest.expires_at >= record.expires_at:
                return False
            del per_name[soonest.owner]
        per_name[record.owner] = record
        return True

    def get(self, name: str) -> list[ManifestRecord]:
        """Unexpired envelopes for ``name``, one per owner."""
        self.expire()
        return list(self._records.get(name, {}).values())

    def expire(self) -> int:
        now = self._clock()
        dropped = 0
        for name in list(self._records):
            per_name = self._records[name]
            for owner in [o for o, r in per_name.items() if r.expires_at <= now]:
                del per_name[owner]
                dropped += 1
            if not per_name:
                del self._records[name]
        return dropped
