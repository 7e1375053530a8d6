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

Writers with no record left are remembered (for their rank) within a memory budget too:
at most ``remembered_caps(limits)`` of them, in all and per IP prefix of the source that
last stored for them; beyond, the least senior (first seen latest) are forgotten first,
so churning fresh identities forgets fresh identities, not the servers seen long before.

Signature checks that fail are budgeted per source (peer and IP prefix, token buckets):
a source whose records keep failing the Ed25519 check has its further records refused
unchecked (``verify_budget``) until its budget refills, so forged records cost a node a
bounded number of verifications a second per source. Valid records are never charged.
Budgets and forgetting run on the monotonic clock; records' times on the swarm's.

Sizes are estimates of the Python objects' memory (measured: an expert record with no
children ~1.4 KiB, each child ~40 bytes more), so the budget bounds what a node spends.
"""

from __future__ import annotations

import heapq
import ipaddress
import itertools
import time
from collections import Counter
from collections.abc import Callable, Iterable, Iterator
from dataclasses import dataclass, field
from typing import Any, Generic, TypeVar

from volunteerd.config import DHTConfig
from volunteerd.errors import InvalidRecord
from volunteerd.net.envelope import RecordKind, RecordLimits, SignedRecord

__all__ = [
    "SignedRecordStore",
    "Source",
    "StoreStatistics",
    "ip_prefix",
    "remembered_caps",
]

R = TypeVar("R", bound=SignedRecord)

# Failed signature checks a source may cost this node: per peer, a token bucket of this
# rate and burst; per IP prefix, ``_PREFIX_SHARE`` peers' worth (the ratio of the default
# prefix and peer quotas). ~80 us a check: a prefix costs at most ~2.6 ms a second.
_FAILED_CHECKS_PER_S = 8.0
_FAILED_CHECK_BURST = 64.0
_PREFIX_SHARE = 4
# Sources whose failures are remembered at once (least recently failed forgotten first;
# a source is forgotten anyway once its bucket has refilled).
_FAILURE_SOURCES = 4096
# Estimated memory of one remembered writer with no record (its peer id, its ``_Writer``
# and its places in two dicts; tracemalloc ~250 B), and the share of the kind's budget
# such writers may take.
_WRITER_BYTES = 256
_WRITER_BUDGET_SHARE = 16


def remembered_caps(limits: RecordLimits) -> tuple[int, int]:
    """How many writers with no record a store remembers at most: in all, and per IP
    prefix of the source that last stored for them. In all: 1/16 of the kind's budget
    at ``_WRITER_BYTES`` each (expert records by default: 12,288, ~3 MiB; manifests:
    4,096, ~1 MiB); per prefix: a peer quota's share of that (1,024 for both)."""
    total = max(64, limits.budget_bytes // _WRITER_BUDGET_SHARE // _WRITER_BYTES)
    per_prefix = max(16, total * limits.peer_bytes // max(1, limits.budget_bytes))
    return total, min(total, per_prefix)


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
    forgotten_writers: int = 0  # writers with no record forgotten early, for the caps


@dataclass(slots=True)
class _Writer:
    first_seen: float
    records: int = 0
    empty_since: float | None = None  # set while it has no record here
    refreshes: int = 0
    prefix: str = ""  # the IP prefix of the source that last stored for it ("": this node)


@dataclass(slots=True)
class _Bucket:
    """Failed signature checks a source may still cost (a token bucket)."""

    tokens: float
    at: float

    def level(self, now: float, rate: float, burst: float) -> float:
        return min(burst, self.tokens + max(0.0, now - self.at) * rate)


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
        clock: Callable[[], float] | None = None,
        record_clock: Callable[[], float] | None = None,
    ) -> None:
        """``clock`` paces the store's own budgets and memory (``time.monotonic``
        unless given: on the wall clock, one set back 3 h left a /24 whose budget of
        failed checks was spent refused for 3 h, as nothing refilled while the clock
        was behind); ``record_clock`` (the node's ``SwarmClock.now``; else ``clock``,
        else ``time.time``) is what records' times are checked against."""
        self.kind = kind
        self.limits = kind.limits(config)
        self._config = config
        self._key_of = kind.key_of
        self._writer_of = kind.writer_of
        self._size_of = kind.size_of
        self._trusted = frozenset(trusted_writers)
        self._clock = time.monotonic if clock is None else clock
        self._record_clock = record_clock or clock or time.time
        self._keys: dict[str, dict[str, _Entry[R]]] = {}
        # key -> its entries best-ranked first, built by ``ranked`` when read and dropped
        # when the key's entries change: a find reads a flooded key for the price of the
        # records it sends, not a sort of every writer each time
        self._ranked: dict[str, list[_Entry[R]]] = {}
        self._writers: dict[str, _Writer] = {}
        self._all = _Scope()
        self._scopes: dict[tuple[str, str], _Scope] = {}
        self._seq = itertools.count()
        self._refused: Counter[str] = Counter()
        self._evicted = 0
        self._expired = 0
        # Writers with no record, per prefix of their last source (insertion ordered).
        self._empty: dict[str, dict[str, None]] = {}
        self._empty_count = 0
        self._overfull: set[str] = set()
        self._remember_all, self._remember_per_prefix = remembered_caps(self.limits)
        self._forgotten = 0  # writers forgotten early for the caps above
        # ("peer" | "prefix", name) -> what its failed signature checks may still cost
        self._failures: dict[tuple[str, str], _Bucket] = {}

    def __len__(self) -> int:
        return self._all.count

    # -- writing ----------------------------------------------------------------------

    def put(self, record: R, source: Source | None = None) -> bool:
        """Keep ``record`` (stored by ``source``; None: this node's own); False when
        refused (the reason is counted in ``statistics().refused``)."""
        return self.keep(record, source) is None

    def keep(self, record: R, source: Source | None = None) -> str | None:
        """Like ``put``; returns why the record was refused (counted as by ``put``), or
        None when stored."""
        reason = self.offer(record, source)
        if reason is not None:
            self._refused[reason] += 1
        return reason

    def offer(self, record: R, source: Source | None = None) -> str | None:
        """Like ``put``; returns why the record was refused, or None when stored."""
        try:
            return self._offer(record, source)
        finally:
            self._bound_remembered()

    def _offer(self, record: R, source: Source | None) -> str | None:
        # Every refusal that needs no signature comes first: a flood that cannot get in
        # costs this node a dictionary lookup per record, not an Ed25519 verification.
        now = self._clock()
        if self._size_of(record) > self.limits.max_record_bytes:
            return "too_large"
        key, writer_id = self._key_of(record), self._writer_of(record)
        per_key = self._keys.get(key)
        old = per_key.get(writer_id) if per_key else None
        if old is not None and old.record.issued_at >= record.issued_at:
            if old.record == record:
                return None  # a repeat is fine
            if not self._from_the_future(old.record):
                return "stale"  # an older one is not stored
            # The stored one is issued past the clock's tolerance: its writer's clock (or
            # this node's, corrected since by net/swarm_clock.py) was ahead. It is no
            # longer valid and does not hold the slot against the writer's next record.
        if self._from_the_future(record):
            # Named apart from "invalid" (and before the quotas) for its writer's sake:
            # an owner whose clock ran ahead was told nothing but a guess (audit-join).
            # It needs no signature check, so it is not charged to the source either.
            return "future"
        if self._spent(source, now):
            # Whatever else would refuse it, this record would need a check the source
            # has no budget for: refused before planning room for it.
            return "verify_budget"
        if old is not None:
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
        reason = self._checked(record, source, now)
        if reason is not None:
            return reason
        for victim in victims:
            self._remove(victim)
            self._evicted += 1
        self._insert(entry, now)
        return None

    def _from_the_future(self, record: R) -> bool:
        return record.issued_at > self._record_clock() + self._config.max_clock_skew_s

    def _spent(self, source: Source | None, now: float) -> bool:
        """Whether ``source`` (its peer or its prefix) has no failed check left."""
        rate, burst = _FAILED_CHECKS_PER_S, _FAILED_CHECK_BURST
        for name, share in self._buckets_of(source):
            bucket = self._failures.get(name)
            if bucket is not None and bucket.level(now, rate * share, burst * share) < 1:
                return True
        return False

    def _checked(self, record: R, source: Source | None, now: float) -> str | None:
        """Validate ``record`` (its signature too) unless ``source`` has spent its budget
        of failed checks; None when valid. Only a failed check is charged."""
        if self._spent(source, now):
            return "verify_budget"
        buckets = self._buckets_of(source)
        rate, burst = _FAILED_CHECKS_PER_S, _FAILED_CHECK_BURST
        try:
            self.kind.validate(record, self._config, now=self._record_clock())
        except InvalidRecord:
            for name, share in buckets:
                bucket = self._failures.pop(name, None)  # re-inserted last: recently failed
                tokens = (
                    burst * share
                    if bucket is None
                    else bucket.level(now, rate * share, burst * share)
                )
                self._failures[name] = _Bucket(tokens - 1, now)
            while len(self._failures) > _FAILURE_SOURCES:
                del self._failures[next(iter(self._failures))]
            return "invalid"
        return None

    @staticmethod
    def _buckets_of(source: Source | None) -> list[tuple[tuple[str, str], int]]:
        if source is None:  # this node's own records
            return []
        return [(("peer", source.peer_id), 1), (("prefix", source.prefix), _PREFIX_SHARE)]

    def _replace(self, old: _Entry[R], record: R, source: Source | None, now: float) -> str | None:
        """A writer's newer record in its own slot: it keeps the slot's rank, and only
        growth has to fit the quotas."""
        entry = _Entry(record, old.key, old.writer, self._size_of(record), source, old.rank)
        # Planned as if the old record were gone, but it stays until the new one fits: a
        # refused refresh leaves the store (and every scope's heap) exactly as it was.
        # The signature is checked after the quotas: a refresh that cannot fit is refused
        # for the price of a plan, however often it is replayed.
        reason, victims = self._plan_room(entry, replacing=old)
        if reason is not None:
            return reason
        reason = self._checked(record, source, now)
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
        self._ranked.pop(entry.key, None)
        writer = self._writers.get(entry.writer)
        if writer is None:
            writer = self._writers[entry.writer] = _Writer(first_seen=now)
        elif writer.empty_since is not None:
            self._unmark_empty(entry.writer, writer)
        writer.records += 1
        writer.empty_since = None
        writer.refreshes += refresh
        writer.prefix = entry.source.prefix if entry.source is not None else ""
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
        self._ranked.pop(entry.key, None)
        per_key = self._keys.get(entry.key)
        if per_key is not None and per_key.get(entry.writer) is entry:
            del per_key[entry.writer]
            if not per_key:
                del self._keys[entry.key]
        writer = self._writers.get(entry.writer)
        if writer is not None:
            writer.records -= 1
            if writer.records <= 0 and writer.empty_since is None:
                writer.empty_since = self._clock()
                empty = self._empty.setdefault(writer.prefix, {})
                empty[entry.writer] = None
                self._empty_count += 1
                if len(empty) > self._remember_per_prefix:
                    self._overfull.add(writer.prefix)
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

    # -- writers with no record ---------------------------------------------------------

    def _unmark_empty(self, writer_id: str, writer: _Writer) -> None:
        empty = self._empty.get(writer.prefix)
        if empty is not None and writer_id in empty:
            del empty[writer_id]
            self._empty_count -= 1
            if not empty:
                del self._empty[writer.prefix]

    def _forget(self, writer_ids: Iterable[str]) -> None:
        for writer_id in writer_ids:
            writer = self._writers.pop(writer_id, None)
            if writer is not None:
                self._unmark_empty(writer_id, writer)

    def _least_senior(self, writer_ids: Iterable[str], count: int) -> list[str]:
        writers = self._writers
        return heapq.nlargest(count, writer_ids, key=lambda w: writers[w].first_seen)

    def _bound_remembered(self) -> None:
        """Forget the least senior writers with no record beyond the caps (per prefix,
        then in all), an eighth of a cap at a time so that the work is amortised."""
        if self._overfull:
            cap = self._remember_per_prefix
            for prefix in list(self._overfull):
                empty = self._empty.get(prefix, {})
                if len(empty) > cap:
                    excess = len(empty) - (cap - cap // 8)
                    victims = self._least_senior(empty, excess)
                    self._forget(victims)
                    self._forgotten += len(victims)
            self._overfull.clear()
        if self._empty_count > self._remember_all:
            cap = self._remember_all
            excess = self._empty_count - (cap - cap // 8)
            every = itertools.chain.from_iterable(self._empty.values())
            victims = self._least_senior(every, excess)
            self._forget(victims)
            self._forgotten += len(victims)

    # -- reading ----------------------------------------------------------------------

    def get(self, key: str, writer: str | None = None) -> list[R]:
        """Unexpired records for ``key`` (only ``writer``'s when given), best-ranked
        writers first: readers verify in this order. Records issued past the clock's
        tolerance (stored before this node's clock was corrected) are left out."""
        per_key = self._keys.get(key)
        if not per_key:
            return []
        now = self._record_clock()
        for entry in [e for e in per_key.values() if e.record.expires_at <= now]:
            self._remove(entry)
            self._expired += 1
        self._bound_remembered()
        if writer is not None:
            entries = [per_key[writer]] if writer in per_key else []
        else:
            entries = list(per_key.values())
        entries.sort(key=lambda e: e.rank, reverse=True)
        latest = now + self._config.max_clock_skew_s
        return [e.record for e in entries if e.record.issued_at <= latest]

    def ranked(self, key: str, writer: str | None = None) -> Iterator[R]:
        """Like ``get``, lazily: unexpired records for ``key`` (only ``writer``'s when
        given; none issued past the clock's tolerance), best-ranked writers first, read
        one by one as the caller takes them (expired ones are skipped, and left to
        ``expire``). A ``dht-find`` naming 64 keys
        of 400 writers each cost ~14-25 ms of the event loop when every key was swept and
        sorted in full for a reply that holds ~120 records."""
        per_key = self._keys.get(key)
        if not per_key:
            return iter(())
        entries: list[_Entry[R]]
        if writer is not None:
            entries = [per_key[writer]] if writer in per_key else []
        elif (cached := self._ranked.get(key)) is not None:
            entries = cached
        else:
            entries = sorted(per_key.values(), key=lambda e: e.rank, reverse=True)
            self._ranked[key] = entries
        now = self._record_clock()
        latest = now + self._config.max_clock_skew_s
        return (
            e.record for e in entries if e.record.expires_at > now and e.record.issued_at <= latest
        )

    def keys(self) -> Iterable[str]:
        return list(self._keys)

    def expire(self) -> int:
        """Drop expired records, and writers gone for ``forget_s``; returns how many
        records were dropped."""
        now, records_now = self._clock(), self._record_clock()
        dropped = 0
        for per_key in list(self._keys.values()):
            for entry in [e for e in per_key.values() if e.record.expires_at <= records_now]:
                self._remove(entry)
                dropped += 1
        self._expired += dropped
        forget_before = now - self.limits.forget_s
        self._forget(
            [
                w
                for empty in self._empty.values()
                for w in empty
                if (since := self._writers[w].empty_since) is not None and since <= forget_before
            ]
        )
        self._bound_remembered()
        rate, burst = _FAILED_CHECKS_PER_S, _FAILED_CHECK_BURST
        for (scope, name), bucket in list(self._failures.items()):
            share = _PREFIX_SHARE if scope == "prefix" else 1
            if bucket.level(now, rate * share, burst * share) >= burst * share:
                del self._failures[(scope, name)]
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
            forgotten_writers=self._forgotten,
        )
