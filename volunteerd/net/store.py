"""One bounded store for the signed records a node keeps for others, of any kind.

Every kind (``net/records.py``: expert records, experiment manifests) is a signed
statement by one *writer* (the announcing peer, the manifest's owner) about one *key*
(``ffn.3.``, an experiment name), checked by its ``RecordKind`` (``net/envelope.py``).
This store knows nothing of what records say: the kind gives their slot, their size,
their validation and, from the config, their caps.

What it bounds, and whom a full store prefers (docs/decisions/0009-bounded-record-store.md):

* per key: at most ``max_per_key`` writers, one record each (the newest);
* per writer: at most ``max_per_writer`` keys;
* per *source*, the connection that stored the records: ``peer_bytes`` for one peer
  and ``prefix_bytes`` for one IP prefix (/24 for IPv4, /48 for IPv6), so a thousand
  identities behind one address share one quota;
* in all: ``budget_bytes`` and ``max_records``.

When a record does not fit, it may take the place of the *lowest-ranked* record in the
scope that is full, if it ranks higher; otherwise it is refused. The rank of a record
is its writer's: this node's own records first, then trusted writers (manifests), then
writers by how long this node has seen them without a gap (first seen earliest first).
A writer is forgotten once it has had no record here for ``forget_s``. So a flood of
fresh identities can fill free room but never displaces writers who were here before
it, and a writer who keeps its records fresh keeps its place.

Sizes are estimates of the Python objects' memory (measured: an expert record with no
children ~1.4 KiB, each child ~40 bytes more), so the budget bounds what a node spends.
"""

from __future__ import annotations

import heapq
import ipaddress
import itertools
import time
from collections import Counter
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field
from typing import Any, Generic, TypeVar

from volunteerd.config import DHTConfig
from volunteerd.errors import InvalidRecord
from volunteerd.net.envelope import RecordKind, SignedRecord

__all__ = [
    "SignedRecordStore",
    "Source",
    "StoreStatistics",
    "ip_prefix",
]

R = TypeVar("R", bound=SignedRecord)


def ip_prefix(host: str) -> str:
    """The network a quota is shared by: the /24 of an IPv4 address, the /48 of an
    IPv6 one; anything unparsable is its own prefix."""
    try:
        address = ipaddress.ip_address(host)
    except ValueError:
        return host[:64]
    if isinstance(address, ipaddress.IPv6Address) and address.ipv4_mapped is not None:
        address = address.ipv4_mapped
    bits = 24 if address.version == 4 else 48
    return str(ipaddress.ip_network(f"{address}/{bits}", strict=False))


@dataclass(frozen=True, slots=True)
class Source:
    """Who stored a record: the peer of the connection, and its address's prefix."""

    peer_id: str
    prefix: str


@dataclass(frozen=True, slots=True)
class StoreStatistics:
    """A snapshot of a store (``SignedRecordStore.statistics``)."""

    keys: int
    records: int
    bytes: int
    budget_bytes: int
    writers: int
    sources: int
    refused: dict[str, int]
    evicted: int
    expired: int


@dataclass(slots=True)
class _Writer:
    first_seen: float
    records: int = 0
    empty_since: float | None = None
    refreshes: int = 0


@dataclass(eq=False, slots=True)
class _Entry(Generic[R]):
    record: R
    key: str
    writer: str
    size: int
    source: Source | None
    rank: tuple[int, int, float]
    alive: bool = True


@dataclass(slots=True)
class _Scope:
    """Records sharing a quota, with a heap that yields the lowest-ranked first."""

    count: int = 0
    bytes: int = 0
    heap: list[tuple[tuple[int, int, float], int, Any]] = field(default_factory=list)


class SignedRecordStore(Generic[R]):
    """Valid records of one ``kind``, one per (key, writer), each until it expires,
    within the kind's limits under ``config``.

    Records of ``trusted_writers`` are never displaced by others' (a daemon's
    ``experiments.trusted_owners``). Nothing here raises on bad input.
    """

    def __init__(
        self,
        kind: RecordKind[R],
        config: DHTConfig,
        *,
        trusted_writers: Iterable[str] = (),
        clock: Callable[[], float] = time.time,
    ) -> None:
        self.kind = kind
        self.limits = kind.limits(config)
        self._config = config
        self._key_of = kind.key_of
        self._writer_of = kind.writer_of
        self._size_of = kind.size_of
        self._trusted = frozenset(trusted_writers)
        self._clock = clock
        self._keys: dict[str, dict[str, _Entry[R]]] = {}
        self._writers: dict[str, _Writer] = {}
        self._all = _Scope()
        self._scopes: dict[tuple[str, str], _Scope] = {}
        self._seq = itertools.count()
        self._refused: Counter[str] = Counter()
        self._evicted = 0
        self._expired = 0

    def __len__(self) -> int:
        return self._all.count

    # -- writing ----------------------------------------------------------------------

    def put(self, record: R, source: Source | None = None) -> bool:
        """Keep ``record`` (stored by ``source``; None: this node's own); False when
        refused (the reason is counted in ``statistics().refused``)."""
        reason = self.offer(record, source)
        if reason is not None:
            self._refused[reason] += 1
        return reason is None

    def offer(self, record: R, source: Source | None = None) -> str | None:
        """Like ``put``; returns why the record was refused, or None when stored."""
        # Every refusal that needs no signature comes first: a flood that cannot get in
        # costs this node a dictionary lookup per record, not an Ed25519 verification.
        now = self._clock()
        if self._size_of(record) > self.limits.max_record_bytes:
            return "too_large"
        key, writer_id = self._key_of(record), self._writer_of(record)
        per_key = self._keys.get(key)
        old = per_key.get(writer_id) if per_key else None
        if old is not None:
            if old.record.issued_at >= record.issued_at:
                # a repeat is fine; an older one is not stored
                return None if old.record == record else "stale"
            if not self._valid(record, now):
                return "invalid"
            return self._replace(old, record, source, now)
        writer = self._writers.get(writer_id)
        if writer is not None and writer.records >= self.limits.max_per_writer:
            return "writer_quota"
        entry = _Entry(
            record, key, writer_id, self._size_of(record), source, self._rank(writer_id, source)
        )
        reason, victims = self._plan_room(entry)
        if reason is not None:
            return reason
        if not self._valid(record, now):
            return "invalid"
        for victim in victims:
            self._remove(victim)
            self._evicted += 1
        self._insert(entry, now)
        return None

    def _valid(self, record: R, now: float) -> bool:
        try:
            self.kind.validate(record, self._config, now=now)
        except InvalidRecord:
            return False
        return True

    def _replace(self, old: _Entry[R], record: R, source: Source | None, now: float) -> str | None:
        """A writer's newer record in its own slot: it keeps the slot's rank, and only
        growth has to fit the quotas."""
        entry = _Entry(record, old.key, old.writer, self._size_of(record), source, old.rank)
        # Planned as if the old record were gone, but it stays until the new one fits: a
        # refused refresh leaves the store (and every scope's heap) exactly as it was.
        reason, victims = self._plan_room(entry, replacing=old)
        if reason is not None:
            return reason
        self._remove(old)
        for victim in victims:
            self._remove(victim)
            self._evicted += 1
        self._insert(entry, now, refresh=True)
        return None

    def _rank(self, writer_id: str, source: Source | None) -> tuple[int, int, float]:
        """Higher is better: own records, then trusted writers, then the longest seen."""
        writer = self._writers.get(writer_id)
        first_seen = writer.first_seen if writer is not None else self._clock()
        return (int(source is None), int(writer_id in self._trusted), -first_seen)

    def _plan_room(
        self, entry: _Entry[R], replacing: _Entry[R] | None = None
    ) -> tuple[str | None, list[_Entry[R]]]:
        """The lower-ranked records to evict so that ``entry`` fits every quota, or the
        quota it cannot fit (then nothing is to be evicted), counting ``replacing`` (the
        record ``entry`` takes the place of) as gone already. Changes nothing."""
        # ``replacing`` is planned like a victim (it frees its room and is never picked
        # as one), and left out of the plan returned: the caller removes it itself.
        victims: set[int] = set()
        plan: list[_Entry[R]] = []
        if replacing is not None:
            victims.add(id(replacing))
            plan.append(replacing)

        def fits(scope: _Scope | None, count_cap: int | None, byte_cap: int | None) -> bool:
            if scope is None:
                return True
            count = scope.count - sum(1 for v in plan if self._in(v, scope))
            size = scope.bytes - sum(v.size for v in plan if self._in(v, scope))
            return (count_cap is None or count + 1 <= count_cap) and (
                byte_cap is None or size + entry.size <= byte_cap
            )

        limits = self.limits
        checks: list[tuple[str, _Scope | None, int | None, int | None]] = [
            ("key_full", self._scopes.get(("key", entry.key)), limits.max_per_key, None),
        ]
        if entry.source is not None:
            checks += [
                (
                    "peer_quota",
                    self._scopes.get(("peer", entry.source.peer_id)),
                    None,
                    limits.peer_bytes,
                ),
                (
                    "prefix_quota",
                    self._scopes.get(("prefix", entry.source.prefix)),
                    None,
                    limits.prefix_bytes,
                ),
            ]
        checks.append(("budget", self._all, limits.max_records, limits.budget_bytes))
        if entry.size > limits.budget_bytes:
            return "budget", []
        for reason, scope, count_cap, byte_cap in checks:
            while scope is not None and not fits(scope, count_cap, byte_cap):
                victim = self._lowest(scope, victims)
                if victim is None or victim.rank >= entry.rank:
                    return reason, []
                victims.add(id(victim))
                plan.append(victim)
        return None, [v for v in plan if v is not replacing]

    def _in(self, entry: _Entry[R], scope: _Scope) -> bool:
        return scope is self._all or any(
            self._scopes.get(name) is scope for name in self._scope_names(entry)
        )

    def _lowest(self, scope: _Scope, skip: set[int]) -> _Entry[R] | None:
        """The lowest-ranked live record of ``scope`` not in ``skip``."""
        heap = scope.heap
        while heap and not heap[0][2].alive:
            heapq.heappop(heap)
        if not heap:
            return None
        if id(heap[0][2]) not in skip:
            entry: _Entry[R] = heap[0][2]
            return entry
        wanted = len(skip) + 1
        while True:
            for _, _, candidate in heapq.nsmallest(wanted, heap):
                if candidate.alive and id(candidate) not in skip:
                    found: _Entry[R] = candidate
                    return found
            if wanted >= len(heap):
                return None
            wanted *= 2

    @staticmethod
    def _scope_names(entry: _Entry[R]) -> list[tuple[str, str]]:
        names = [("key", entry.key)]
        if entry.source is not None:
            names += [("peer", entry.source.peer_id), ("prefix", entry.source.prefix)]
        return names

    def _insert(self, entry: _Entry[R], now: float, refresh: bool = False) -> None:
        entry.alive = True
        self._keys.setdefault(entry.key, {})[entry.writer] = entry
        writer = self._writers.get(entry.writer)
        if writer is None:
            writer = self._writers[entry.writer] = _Writer(first_seen=now)
        writer.records += 1
        writer.empty_since = None
        writer.refreshes += refresh
        item = (entry.rank, next(self._seq), entry)
        for scope in [self._all, *(self._scope(n) for n in self._scope_names(entry))]:
            scope.count += 1
            scope.bytes += entry.size
            heapq.heappush(scope.heap, item)
            if len(scope.heap) > 2 * scope.count + 64:
                # Dead entries pile up behind live ones: compact, to one item per live
                # entry, so the heap stays bounded by the live records even if an entry
                # were ever pushed twice (items of one entry share its rank).
                one_each = {id(i[2]): i for i in scope.heap if i[2].alive}
                scope.heap = list(one_each.values())
                heapq.heapify(scope.heap)

    def _scope(self, name: tuple[str, str]) -> _Scope:
        scope = self._scopes.get(name)
        if scope is None:
            scope = self._scopes[name] = _Scope()
        return scope

    def _remove(self, entry: _Entry[R]) -> None:
        entry.alive = False
        per_key = self._keys.get(entry.key)
        if per_key is not None and per_key.get(entry.writer) is entry:
            del per_key[entry.writer]
            if not per_key:
                del self._keys[entry.key]
        writer = self._writers.get(entry.writer)
        if writer is not None:
            writer.records -= 1
            if writer.records <= 0:
                writer.empty_since = self._clock()
        self._all.count -= 1
        self._all.bytes -= entry.size
        for name in self._scope_names(entry):
            scope = self._scopes.get(name)
            if scope is None:
                continue
            scope.count -= 1
            scope.bytes -= entry.size
            if scope.count <= 0:
                del self._scopes[name]

    # -- reading ----------------------------------------------------------------------

    def get(self, key: str, writer: str | None = None) -> list[R]:
        """Unexpired records for ``key`` (only ``writer``'s when given), best-ranked
        writers first: readers verify in this order."""
        per_key = self._keys.get(key)
        if not per_key:
            return []
        now = self._clock()
        for entry in [e for e in per_key.values() if e.record.expires_at <= now]:
            self._remove(entry)
            self._expired += 1
        if writer is not None:
            entries = [per_key[writer]] if writer in per_key else []
        else:
            entries = list(per_key.values())
        entries.sort(key=lambda e: e.rank, reverse=True)
        return [e.record for e in entries]

    def keys(self) -> Iterable[str]:
        return list(self._keys)

    def expire(self) -> int:
        """Drop expired records, and writers gone for ``forget_s``; returns how many
        records were dropped."""
        now = self._clock()
        dropped = 0
        for per_key in list(self._keys.values()):
            for entry in [e for e in per_key.values() if e.record.expires_at <= now]:
                self._remove(entry)
                dropped += 1
        self._expired += dropped
        forget_before = now - self.limits.forget_s
        for writer_id in [
            w
            for w, writer in self._writers.items()
            if writer.records <= 0
            and writer.empty_since is not None
            and writer.empty_since <= forget_before
        ]:
            del self._writers[writer_id]
        return dropped

    def statistics(self) -> StoreStatistics:
        return StoreStatistics(
            keys=len(self._keys),
            records=self._all.count,
            bytes=self._all.bytes,
            budget_bytes=self.limits.budget_bytes,
            writers=len(self._writers),
            sources=sum(1 for kind, _ in self._scopes if kind == "peer"),
            refused=dict(self._refused),
            evicted=self._evicted,
            expired=self._expired,
        )
