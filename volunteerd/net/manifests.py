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
newer one of their own under the same name: a reader asks for the owners it trusts
(``ManifestFindRequest.owner``), or for every owner's and picks. The store is bounded
(``net/store.py``): per owner, per name, per peer and IP prefix, and in memory; an
owner this node trusts is never displaced by others, and otherwise owners seen for
longer are kept before newcomers.
"""

from __future__ import annotations

import base64
import json
import math
import time
from collections.abc import Callable, Iterable
from typing import Annotated, Literal

from pydantic import BaseModel, ConfigDict, Field

from volunteerd.config import DHTConfig
from volunteerd.errors import InvalidRecord
from volunteerd.identity import Identity, verify_signature
from volunteerd.net.store import RecordLimits, SignedRecordStore

__all__ = [
    "MAX_MANIFEST_BODY",
    "ManifestFindReply",
    "ManifestFindRequest",
    "ManifestRecord",
    "ManifestStore",
    "ManifestStoreReply",
    "ManifestStoreRequest",
    "manifest_bytes",
    "manifest_key",
    "manifest_limits",
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
    """Asks for ``name``'s manifests: only ``owner``'s when given (what a trainer or a
    daemon that trusts an owner asks), else every owner's."""

    model_config = ConfigDict(frozen=True, extra="forbid")
    name: Name
    owner: Annotated[str, Field(min_length=1, max_length=128)] | None = None


class ManifestFindReply(BaseModel):
    model_config = ConfigDict(frozen=True, extra="forbid")
    status: Literal["ok"] = "ok"
    records: Annotated[list[ManifestRecord], Field(max_length=MAX_OWNERS_PER_NAME)]


def manifest_bytes(record: ManifestRecord) -> int:
    """Estimated memory of a stored manifest: its texts plus the objects around them."""
    return 1536 + len(record.body) + len(record.owner) + len(record.name)


def manifest_limits(config: DHTConfig) -> RecordLimits:
    """The manifest store's share of ``config``'s budget: 1/4, of which one peer or one
    IP prefix may fill a quarter at most."""
    mib = 1 << 20
    budget = int(config.store_budget_mb * mib / 4)
    return RecordLimits(
        max_records=MAX_NAMES,
        max_record_bytes=1536 + MAX_MANIFEST_BODY + 256,
        max_per_key=MAX_OWNERS_PER_NAME,
        max_per_writer=config.max_manifests_per_owner,
        peer_bytes=min(int(config.peer_quota_mb * mib), budget // 4),
        prefix_bytes=min(int(config.ip_prefix_quota_mb * mib), budget // 4),
        budget_bytes=budget,
        forget_s=config.max_record_ttl_s,
    )


class ManifestStore(SignedRecordStore[ManifestRecord]):
    """Manifests this node keeps for the swarm: one per (name, owner), the newest,
    each until it expires, within the bounds of ``SignedRecordStore``: at most
    ``MAX_NAMES`` manifests, ``MAX_OWNERS_PER_NAME`` owners a name and
    ``max_manifests_per_owner`` names an owner. Owners in ``trusted_owners`` (this
    node's own ``experiments.trusted_owners``) are never displaced by others."""

    def __init__(
        self,
        config: DHTConfig,
        public_key_of: Callable[[str], bytes | None],
        clock: Callable[[], float] = time.time,
        trusted_owners: Iterable[str] = (),
    ) -> None:
        trusted = frozenset(trusted_owners)

        def validate(record: ManifestRecord, now: float) -> None:
            validate_manifest_record(
                record,
                public_key_of=public_key_of,
                now=now,
                max_ttl_s=config.max_manifest_ttl_s,
                max_clock_skew_s=config.max_clock_skew_s,
            )

        super().__init__(
            manifest_limits(config),
            validate=validate,
            key_of=lambda r: r.name,
            writer_of=lambda r: r.owner,
            size_of=manifest_bytes,
            trusted=trusted.__contains__,
            clock=clock,
        )
