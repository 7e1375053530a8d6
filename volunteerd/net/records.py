"""The two kinds of signed record in the DHT: expert records and experiment manifests.

Both travel in the envelope of ``net/envelope.py`` and are kept for others by the one
store of ``net/store.py``; this module says only what differs: their fields, their
slot, their size, their caps and their own rules, and the messages of their verbs.

**Expert records.** A server hosting ``ffn.3.17`` announces one record per key in
``uid_prefixes``:

=============  ==========================================================
key            record says
=============  ==========================================================
``ffn.``       this peer hosts experts whose first coordinate is in children
``ffn.3.``     ... whose second coordinate (under ffn.3) is in children
``ffn.3.17``   this peer hosts ffn.3.17 (children is empty)
=============  ==========================================================

Many servers share a key: a storing node keeps one record per (key, peer), the one
issued last. A server that stops cleanly publishes ``active=False`` records so that its
experts vanish at once; one that crashes vanishes when its records expire.

**Experiment manifests.** An experiment's owner signs its manifest with the key its
peer id embeds and stores it under ``experiment/<name>``. The body is an opaque,
size-capped JSON text that ``volunteerd.swarm.manifest`` parses. A storing node keeps
one manifest per (name, owner), so nobody can hide an owner's manifest by storing a
newer one of their own under the same name: a reader asks for the owners it trusts
(``ManifestFindRequest.owner``), or for every owner's and picks. An owner this node
trusts is never displaced by others.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Iterable
from functools import partial
from typing import Annotated, Any, ClassVar, Literal, Self

from pydantic import (
    AfterValidator,
    BaseModel,
    ConfigDict,
    Field,
    SerializerFunctionWrapHandler,
    ValidationError,
    ValidatorFunctionWrapHandler,
    field_validator,
    model_serializer,
)

from volunteerd import uids
from volunteerd.config import DHTConfig
from volunteerd.config.addrs import is_dialable_addr
from volunteerd.errors import InvalidRecord
from volunteerd.identity import Identity
from volunteerd.net.envelope import RecordKind, RecordLimits, SignedRecord
from volunteerd.net.peers import parse_circuit_addr, short

__all__ = [
    "EXPERT_RECORDS",
    "MANIFESTS",
    "MAX_ADDRS",
    "MAX_MANIFEST_BODY",
    "MAX_OWNERS_PER_NAME",
    "NAME_PATTERN",
    "REFUSAL_CODES",
    "ExpertRecord",
    "FindReply",
    "FindRequest",
    "ManifestFindReply",
    "ManifestFindRequest",
    "ManifestRecord",
    "ManifestStoreRequest",
    "StoreReply",
    "StoreRequest",
    "is_record_addr",
    "manifest_key",
    "sign_record",
]

MAX_ADDRS = 8
MAX_CHILDREN = 4096
MAX_MANIFEST_BODY = 16 * 1024
# A wire bound (a find reply lists at most this many owners); dht.max_owners_per_name
# may only lower it.
MAX_OWNERS_PER_NAME = 16
NAME_PATTERN = r"^[a-z0-9][a-z0-9_.-]{0,63}$"
_MIB = 1 << 20

logger = logging.getLogger(__name__)


def _check_key(value: str) -> str:
    if not uids.is_valid_key(value):
        raise ValueError("not a valid DHT key (expected e.g. 'ffn.', 'ffn.3.' or 'ffn.3.17')")
    return value


def is_record_addr(value: str) -> bool:
    """Whether ``value`` is an address a record may carry: what a node announces
    (``net/host.py`` transport_addrs, ``Reachability.announce_addrs``), i.e.
    ``/ip4|ip6/<ip>/tcp/<port>`` or a circuit address through a relay at one, whose
    relay id decodes (``config.addrs.is_dialable_addr``: the configuration's
    ``network.announce_addrs`` is checked by the same rule)."""
    return is_dialable_addr(value, parse_circuit_addr)


def _check_addr(value: str) -> str:
    if not is_record_addr(value):
        raise ValueError(
            "not an /ip4|ip6/<ip>/tcp/<port> address (nor a circuit address through one) "
            "that a peer can dial"
        )
    return value


Key = Annotated[str, Field(max_length=uids.MAX_UID_LENGTH), AfterValidator(_check_key)]
Addr = Annotated[str, Field(max_length=200), AfterValidator(_check_addr)]
Name = Annotated[str, Field(pattern=NAME_PATTERN)]
PeerIdText = Annotated[str, Field(min_length=1, max_length=128)]


def _limits(config: DHTConfig, *, manifests: bool) -> RecordLimits:
    """How ``config`` bounds a kind. Expert records get three quarters of
    ``store_budget_mb`` and a record is as large as its children; manifests get a
    quarter, of which one peer or one IP prefix may fill a quarter at most."""
    if manifests:
        budget = int(config.store_budget_mb * _MIB / 4)
        max_ttl_s, max_records = config.max_manifest_ttl_s, config.max_manifests
        max_per_key, max_per_writer = config.max_owners_per_name, config.max_manifests_per_owner
        largest = 1536 + MAX_MANIFEST_BODY + 256
        source_cap = budget // 4
    else:
        budget = int(config.store_budget_mb * _MIB * 3 / 4)
        max_ttl_s, max_records = config.max_record_ttl_s, config.max_keys
        max_per_key, max_per_writer = config.max_records_per_key, config.max_records_per_writer
        largest = 1536 + 48 * config.max_children_per_record + 2 * MAX_ADDRS * 200
        source_cap = budget  # a quota beyond the whole budget is the budget: no cap
    return RecordLimits(
        max_ttl_s=max_ttl_s,
        max_records=max_records,
        max_record_bytes=largest,
        max_per_key=max_per_key,
        max_per_writer=max_per_writer,
        peer_bytes=min(int(config.peer_quota_mb * _MIB), source_cap),
        prefix_bytes=min(int(config.ip_prefix_quota_mb * _MIB), source_cap),
        budget_bytes=budget,
        forget_s=config.max_record_ttl_s,
    )


# -- expert records ----------------------------------------------------------------------


class _ExpertClaim(BaseModel):
    model_config = ConfigDict(frozen=True, extra="forbid")

    key: Key
    peer_id: PeerIdText
    addrs: Annotated[tuple[Addr, ...], Field(max_length=MAX_ADDRS)]
    children: Annotated[
        tuple[Annotated[int, Field(ge=0, le=uids.MAX_COORDINATE)], ...],
        Field(max_length=MAX_CHILDREN),
    ] = ()
    active: bool = True


class ExpertRecord(SignedRecord, _ExpertClaim):
    """A peer's signed claim to host experts under ``key`` (see the module docstring)."""

    domain: ClassVar[bytes] = b"volunteerd/expert-record/v1\n"

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
    """``peer_id``'s record for ``key``, signed. Of ``addrs``, those a record cannot
    carry (``is_record_addr``) are left out, with a warning the first time, rather than
    making every record this node announces one that peers refuse."""
    issued = time.time() if now is None else now
    given = tuple(addrs)
    carried = tuple(a for a in given if is_record_addr(a))
    if len(carried) < len(given):
        _warn_left_out(peer_id, [a for a in given if a not in carried])
    return ExpertRecord(
        key=key,
        peer_id=peer_id,
        addrs=carried,
        children=tuple(sorted(set(children))),
        active=active,
        issued_at=issued,
        expires_at=issued + ttl_s,
    ).signed(identity)


_warned: set[str] = set()


def _warn_left_out(peer_id: str, addrs: list[str]) -> None:
    new = [a for a in addrs if a not in _warned]
    if new and len(_warned) < 64:
        _warned.update(new)
        logger.warning(
            "%s: records do not carry %s (only /ip4|ip6/<ip>/tcp/<port> addresses peers "
            "can dial, or circuit addresses through them)",
            short(peer_id),
            ", ".join(repr(a[:80]) for a in new),
        )


def _expert_rules(record: ExpertRecord, config: DHTConfig) -> None:
    """A prefix record lists at most ``max_children_per_record`` next coordinates, an
    active one at least one; a uid record lists none."""
    if len(record.children) > config.max_children_per_record:
        raise InvalidRecord(
            f"record {record.key!r} lists {len(record.children)} children; at most "
            f"{config.max_children_per_record}"
        )
    if record.is_uid and record.children:
        raise InvalidRecord(f"record for uid {record.key!r} must not list children")
    if not record.is_uid and record.active and not record.children:
        raise InvalidRecord(f"active record for prefix {record.key!r} lists no children")


def _expert_bytes(record: ExpertRecord) -> int:
    """Estimated memory of a stored record (measured with tracemalloc: ~1.4 KiB with
    no children, ~40 bytes a child)."""
    return 1536 + 48 * len(record.children) + 2 * sum(len(a) for a in record.addrs)


def _expert_wire_bytes(record: ExpertRecord) -> int:
    """An upper bound of its JSON: fields' names and times, up to 8 bytes a child."""
    size = 320 + len(record.peer_id) + len(record.key) + 8 * len(record.children)
    return size + sum(len(a) + 3 for a in record.addrs)


EXPERT_RECORDS: RecordKind[ExpertRecord] = RecordKind(
    name="record",
    model=ExpertRecord,
    key_of=lambda r: r.key,
    writer_of=lambda r: r.peer_id,
    dht_key=lambda key: key,
    size_of=_expert_bytes,
    wire_size_of=_expert_wire_bytes,
    limits=partial(_limits, manifests=False),
    rules=_expert_rules,
)


class StoreRequest(BaseModel):
    model_config = ConfigDict(frozen=True, extra="forbid")
    records: Annotated[list[ExpertRecord], Field(max_length=256)]


# Why a storing peer did not keep records (``StoreReply.refused``, manifest-store only):
# the other owners fill the name, issued ahead of the peer's clock, older than the one it
# holds, anything else. Readers take a code they do not know for "other".
REFUSAL_CODES = ("name_full", "future", "stale", "other")
RefusalCode = Annotated[str, Field(pattern=r"^[a-z_]{1,32}$")]


class StoreReply(BaseModel):
    """The reply to ``dht-store`` and to ``manifest-store``.

    ``refused`` counts the records not kept by reason (``REFUSAL_CODES``); only
    ``manifest-store`` replies set it, and it is left out of the JSON when empty: peers
    older than the field refuse a header with it (extra fields forbidden), so a reply
    that stored everything reads the same to every version."""

    model_config = ConfigDict(frozen=True, extra="forbid")
    status: Literal["ok"] = "ok"
    stored: int = 0
    rejected: int = 0
    refused: Annotated[dict[RefusalCode, int], Field(max_length=8)] = Field(default_factory=dict)

    @model_serializer(mode="wrap")
    def _leave_out_empty_refused(self, handler: SerializerFunctionWrapHandler) -> Any:
        data = handler(self)
        if isinstance(data, dict) and not data.get("refused"):
            data.pop("refused", None)
        return data


class FindRequest(BaseModel):
    model_config = ConfigDict(frozen=True, extra="forbid")
    keys: Annotated[list[Key], Field(min_length=1, max_length=64)]

    @classmethod
    def asking(cls, keys: list[str], writer: str | None) -> Self:
        """Expert records are asked for by key alone: readers keep whose they want."""
        return cls(keys=keys)

    def query(self) -> tuple[list[str], str | None]:
        return self.keys, None


class FindReply(BaseModel):
    model_config = ConfigDict(frozen=True, extra="forbid")
    status: Literal["ok"] = "ok"
    records: Annotated[list[ExpertRecord], Field(max_length=16384)]

    @field_validator("records", mode="wrap")
    @classmethod
    def _drop_unparsable(cls, value: Any, handler: ValidatorFunctionWrapHandler) -> Any:
        """A record that does not parse costs itself, not the records listed with it: a
        storing node of an earlier version may still hold records this one refuses
        (e.g. with addresses it no longer carries). Every kept record is checked by the
        reader as usual."""
        try:
            return handler(value)
        except ValidationError:
            if not isinstance(value, list) or len(value) > 16384:
                raise
        kept = []
        for item in value:
            try:
                kept.append(ExpertRecord.model_validate(item))
            except ValidationError:
                continue
        return kept


# -- experiment manifests ----------------------------------------------------------------


def manifest_key(name: str) -> str:
    """The DHT key whose closest peers store experiment ``name``'s manifests."""
    return f"experiment/{name}"


class _ManifestText(BaseModel):
    model_config = ConfigDict(frozen=True, extra="forbid")

    name: Name
    owner: PeerIdText
    body: Annotated[str, Field(max_length=MAX_MANIFEST_BODY)]


class ManifestRecord(SignedRecord, _ManifestText):
    """One owner's signed manifest for one experiment name; ``body`` is the manifest."""

    domain: ClassVar[bytes] = b"volunteerd/experiment-manifest/v1\n"


def _manifest_bytes(record: ManifestRecord) -> int:
    """Estimated memory of a stored manifest: its texts plus the objects around them."""
    return 1536 + len(record.body) + len(record.owner) + len(record.name)


MANIFESTS: RecordKind[ManifestRecord] = RecordKind(
    name="manifest",
    model=ManifestRecord,
    key_of=lambda r: r.name,
    writer_of=lambda r: r.owner,
    dht_key=manifest_key,
    size_of=_manifest_bytes,
    # exact: a body is JSON text, and escaping it again may nearly double it
    wire_size_of=lambda r: len(r.model_dump_json().encode()),
    limits=partial(_limits, manifests=True),
)


class ManifestStoreRequest(BaseModel):
    model_config = ConfigDict(frozen=True, extra="forbid")
    records: Annotated[list[ManifestRecord], Field(min_length=1, max_length=4)]


class ManifestFindRequest(BaseModel):
    """Asks for ``name``'s manifests: only ``owner``'s when given (what a trainer or a
    daemon that trusts an owner asks), else every owner's."""

    model_config = ConfigDict(frozen=True, extra="forbid")
    name: Name
    owner: PeerIdText | None = None

    @classmethod
    def asking(cls, names: list[str], owner: str | None) -> Self:
        """One name a request (``find_batch`` 1)."""
        return cls(name=names[0], owner=owner)

    def query(self) -> tuple[list[str], str | None]:
        return [self.name], self.owner


class ManifestFindReply(BaseModel):
    model_config = ConfigDict(frozen=True, extra="forbid")
    status: Literal["ok"] = "ok"
    records: Annotated[list[ManifestRecord], Field(max_length=MAX_OWNERS_PER_NAME)]
