"""Expert discovery: py-libp2p's Kademlia for routing, our own record protocol for storage.

py-libp2p's KadDHT finds the peers closest to a key well, but its value store keeps
one value per key for 24 h, answers from a local cache first and ignores expiry, and
its provider records never forget a dead provider (see docs/decisions/0002). So the
routing table and iterative lookups are KadDHT's, while signed records live on the
``replication`` closest peers (this node included when it is among them), in a
``SignedRecordStore`` per kind that honours each record's own expiry and keeps one
record per (key, writer).

Both kinds of ``net/records.py`` take one path: ``_put`` stores records on the closest
peers to their key with the kind's store verb (``dht-store``, ``manifest-store``),
``_find`` asks them with its find verb (``dht-find``, ``manifest-find``) and keeps the
newest valid record per (key, writer). Every record that arrives, in a store request or
in a find reply, is checked by its kind's ``validate``: a storing peer cannot forge or
revive another peer's record.
"""

from __future__ import annotations

import ipaddress
import logging
import random
import time
from collections import Counter
from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any, Generic, TypeVar

import trio
from libp2p.abc import IHost
from libp2p.kad_dht.kad_dht import KadDHT
from libp2p.kad_dht.utils import sort_peer_ids_by_distance
from libp2p.peer.id import ID
from libp2p.peer.peerstore import PeerStoreError
from pydantic import BaseModel

from volunteerd.config import DHTConfig, TimeoutsConfig
from volunteerd.errors import InvalidRecord, PeerError, PeerUnreachable, RequestTimeout
from volunteerd.net.clones import CloneWatch
from volunteerd.net.envelope import RecordKind, SignedRecord
from volunteerd.net.lookup import LookupMemory, PeerLookup
from volunteerd.net.peers import PeerAddress, dialable_part, short
from volunteerd.net.protocols import PROTOCOLS, Verb
from volunteerd.net.reachability import observed_ips
from volunteerd.net.records import (
    EXPERT_RECORDS,
    MANIFESTS,
    REFUSAL_CODES,
    ExpertRecord,
    FindRequest,
    ManifestFindRequest,
    ManifestRecord,
    StoreReply,
)
from volunteerd.net.rpc import Handler, Reply, Request, RpcClient
from volunteerd.net.store import SignedRecordStore, Source, StoreStatistics, ip_prefix
from volunteerd.net.swarm_clock import SwarmClock
from volunteerd.net.throttle import URGENT_MAX_BYTES

__all__ = [
    "UNEXPLAINED",
    "DHTStatistics",
    "ExpertDHT",
    "ManifestStoreOutcome",
    "StoreOutcome",
    "admit_after_identify",
]

logger = logging.getLogger(__name__)

R = TypeVar("R", bound=SignedRecord)

# A find reply is one JSON header, and readers refuse headers over wire.max_header_bytes
# (64 KiB by default): a key flooded with hundreds of records must not make the whole
# answer unreadable. Keep it under 48 KiB.
_FIND_REPLY_BYTES = 48 * 1024
# A store request is one JSON header too, refused whole over the same cap: 256 records
# with three addresses each came to ~81 KB, and every storing peer among the closest for
# more than ~140 of a daemon's keys (a small swarm, 128 experts of a 4-D grid) refused
# all of that daemon's records. Requests are cut at this many bytes as well as records.
_STORE_REQUEST_BYTES = 48 * 1024
# Under an upload limit a request's frame of at most URGENT_MAX_BYTES takes turns with
# the bulk reply pieces going out (net/throttle.py) and a larger one queues behind them:
# a limited volunteer's 25-record store (~50 KB in one request) waited out the DHT's
# deadline behind its own replies, and its records reached nobody. Cut smaller then,
# with room for the frame's prefix, the request's fields and an estimate's slack.
_LIMITED_STORE_REQUEST_BYTES = URGENT_MAX_BYTES - 1024
_CLOSEST_CACHE_S = 30.0
# A read-back answer with this many records of the key may have been cut at
# _FIND_REPLY_BYTES before this node's (records with relay addresses run to ~3 KiB): it
# shows nothing. Prefixes of large swarms are checked by their uids' records alone.
_READ_BACK_FULL = 16
# Other peers' routing tables keep a dead peer for long; do not ask it again meanwhile.
_DEAD_PEER_S = 60.0
# Peers whose Kademlia requests came before identify told us their addresses, waiting
# to join the routing table when it does (oldest forgotten first beyond this many).
_AWAITING_IDENTIFY = 256


@dataclass(frozen=True, slots=True)
class _Verbs(Generic[R]):
    """How one kind travels: its store and find verbs (their messages are in
    ``PROTOCOLS``), and how many records or keys one request carries at most."""

    kind: RecordKind[R]
    store: Verb
    find: Verb
    find_request: type[FindRequest] | type[ManifestFindRequest]
    store_batch: int
    find_batch: int
    explains: bool = False  # store replies say why records were refused (``refused``)
    # Its records' ``issued_at`` reads their sender's clock (the swarm clock's samples):
    # expert records, signed afresh every announce period. Not a manifest's, the
    # owner's publish time, stored and found with the same signature for up to its
    # lifetime: a fresh node whose first finds were of a 3-day-old manifest took its
    # clock to be 3 days ahead of the swarm's, and refused every fresh record as one
    # from the future.
    clock_samples: bool = True


_EXPERT_VERBS = _Verbs(EXPERT_RECORDS, Verb.DHT_STORE, Verb.DHT_FIND, FindRequest, 256, 64)
_MANIFEST_VERBS = _Verbs(
    MANIFESTS,
    Verb.MANIFEST_STORE,
    Verb.MANIFEST_FIND,
    ManifestFindRequest,
    4,
    1,
    explains=True,
    clock_samples=False,
)

# The store's refusal reasons (net/store.py) as ``StoreReply.refused`` names them; every
# other reason is "other". The wire keeps its own few names so that renaming a quota
# inside the store changes nothing a peer reads.
_WIRE_REASONS = {"key_full": "name_full", "future": "future", "stale": "stale"}
# A peer that answered but kept nothing without saying why (older than the field).
UNEXPLAINED = "unexplained"


def admit_after_identify(host: IHost, kad: KadDHT) -> None:
    """Let a peer whose first Kademlia request came before identify finished join the
    routing table once identify has run.

    KadDHT adds whoever sends it a request to its routing table, but only if the
    peerstore already holds that peer's addresses, which identify (run in the
    background on each new connection) puts there. A node that joins dials its
    bootstrap peer and asks it for its own neighbourhood at once; when that request
    wins the race the bootstrap peer skips it for good, and it never hands that node
    to anyone who joins later. Such peers are noted here and added when identify on
    their connection completes (the request itself is answered at once, as before)."""
    add_peer = kad.add_peer
    identify = getattr(host, "_identify_peer", None)
    if identify is None:  # another host than py-libp2p's BasicHost: nothing to wrap
        return
    peerstore = host.get_peerstore()
    waiting: dict[ID, None] = {}

    def has_addrs(peer_id: ID) -> bool:
        try:
            return bool(peerstore.addrs(peer_id))
        except PeerStoreError:
            return False

    async def add_or_wait(peer_id: ID, *, skip_server_mode_check: bool = False) -> bool:
        added = await add_peer(peer_id, skip_server_mode_check=skip_server_mode_check)
        # Only requesters come with the check skipped: they speak Kademlia.
        if not added and skip_server_mode_check and not has_addrs(peer_id):
            waiting[peer_id] = None
            while len(waiting) > _AWAITING_IDENTIFY:
                del waiting[next(iter(waiting))]
        return added

    async def identify_then_add(peer_id: ID, *, reason: str) -> None:
        await identify(peer_id, reason=reason)
        if peer_id in waiting and has_addrs(peer_id):
            del waiting[peer_id]
            # identify runs as a trio system task, where an exception would end the
            # whole event loop: a failure here costs this peer its place, no more
            try:
                await add_peer(peer_id, skip_server_mode_check=True)
            except Exception:
                logger.debug("could not add %s to the routing table", short(peer_id), exc_info=True)

    kad.add_peer = add_or_wait  # type: ignore[method-assign]
    host._identify_peer = identify_then_add  # type: ignore[attr-defined]


def fit_reply(
    per_key: Sequence[Iterable[R]], budget_bytes: int, wire_size_of: Callable[[R], int]
) -> list[R]:
    """Records of several keys within ``budget_bytes`` of JSON: round-robin over the
    keys, each key's best-ranked records first (the store lists writers seen longest
    first), so every key keeps its best writers when a flooded key would fill it. Each
    key's records are taken one by one (``SignedRecordStore.ranked``): no more are read
    than the reply holds, and one more per key."""
    keys = [iter(records) for records in per_key]
    out: list[R] = []
    used = 0
    while keys:
        going = []
        for records in keys:
            record = next(records, None)
            if record is None:
                continue
            size = wire_size_of(record)
            if used + size > budget_bytes:
                return out
            used += size
            out.append(record)
            going.append(records)
        keys = going
    return out


def store_chunks(
    records: Sequence[R], most: int, budget_bytes: int, wire_size_of: Callable[[R], int]
) -> list[list[R]]:
    """``records`` in order, cut into requests of at most ``most`` records and
    ``budget_bytes`` of JSON by the kind's estimate (a record alone over the budget
    goes alone: the receiver's cap, not this one, decides it)."""
    chunks: list[list[R]] = []
    chunk: list[R] = []
    used = 0
    for record in records:
        size = wire_size_of(record)
        if chunk and (len(chunk) >= most or used + size > budget_bytes):
            chunks.append(chunk)
            chunk, used = [], 0
        chunk.append(record)
        used += size
    if chunk:
        chunks.append(chunk)
    return chunks


def fit_reply_header(reply: Callable[..., BaseModel], records: Sequence[R]) -> BaseModel:
    """``reply(records=...)`` with as many of ``records`` (best first) as keep its JSON
    within ``_FIND_REPLY_BYTES``. ``fit_reply`` sizes records by their kind's estimate;
    this checks the real bytes, so an estimate that falls short (a record made of
    characters JSON escapes) costs the last records, never the whole answer."""
    header = reply(records=list(records))
    while records and len(header.model_dump_json().encode()) > _FIND_REPLY_BYTES:
        records = records[: len(records) * 3 // 4]
        header = reply(records=list(records))
    return header


def merge_answers(kind: RecordKind[R], answers: Iterable[tuple[int, R]]) -> list[R]:
    """One record per (key, writer), the newest (a withdrawal beats the announcement it
    follows), ordered by the best position any storing peer gave that writer in its
    answer: ``answers`` are (position, record) pairs."""
    best: dict[tuple[str, str], tuple[int, R]] = {}
    for position, record in answers:
        slot = (kind.key_of(record), kind.writer_of(record))
        old = best.get(slot)
        if old is None:
            best[slot] = (position, record)
        else:
            newest = record if record.issued_at > old[1].issued_at else old[1]
            best[slot] = (min(position, old[0]), newest)
    return [record for _, record in sorted(best.values(), key=lambda item: item[0])]


# What one peer did with a key's records in a store or find (``_put``, ``_find``).
_ASKED = "asked"  # its answer is awaited
_FAILED = "failed"  # it did not answer (or not readably)
_EMPTY = "empty"  # it answered, but kept none (a store) or had none (a find)
_FOUND = "found"  # it kept all (a store) or had some (a find)


def _to_ask(
    candidates: Sequence[ID], outcome: Mapping[ID, str], replication: int, *, widen: bool
) -> list[ID]:
    """The candidates to ask next for one key, in order: each not asked yet until
    ``replication`` of them (twice that when ``widen``) have answered, are awaited or
    are chosen here, and never more than twice ``replication`` asked in all."""
    want, most = replication * (2 if widen else 1), 2 * replication
    chosen: list[ID] = []
    asked = live = 0
    for peer in candidates:
        if live + len(chosen) >= want or asked + len(chosen) >= most:
            break
        state = outcome.get(peer)
        if state is None:
            chosen.append(peer)
            continue
        asked += 1
        live += state != _FAILED
    return chosen


def _answered(candidates: Sequence[ID], outcome: Mapping[ID, str], replication: int) -> list[ID]:
    """A key's closest set after a store: the first ``replication`` candidates that
    answered."""
    return [p for p in candidates if outcome.get(p) in (_EMPTY, _FOUND)][:replication]


def _failed(outcomes: dict[str, dict[ID, str]], peer_id: ID, keys: Iterable[str]) -> None:
    """``peer_id`` failed to answer: each of ``keys`` not answered yet failed."""
    for key in keys:
        if outcomes[key].get(peer_id) == _ASKED:
            outcomes[key][peer_id] = _FAILED


@dataclass(frozen=True, slots=True)
class StoreOutcome:
    """How many peers (this node included) accepted each key's record."""

    acks: dict[str, int]

    @property
    def min_acks(self) -> int:
        return min(self.acks.values(), default=0)


@dataclass(frozen=True, slots=True)
class ManifestStoreOutcome:
    """``ExpertDHT.store_manifest``: how many of the closest peers (this node included)
    stored the manifest, and of the other peers that answered without storing it, how
    many gave each reason (``REFUSAL_CODES``; ``UNEXPLAINED`` when they gave none)."""

    acks: int
    refused: dict[str, int]


@dataclass(frozen=True, slots=True)
class DHTStatistics:
    """``ExpertDHT.statistics()``: the expert record store and the manifest store."""

    records: StoreStatistics
    manifests: StoreStatistics


class ExpertDHT:
    """Stores and finds expert records and experiment manifests. Constructed by
    ``open_node``; no I/O here."""

    def __init__(
        self,
        host: IHost,
        kad: KadDHT,
        rpc: RpcClient,
        config: DHTConfig,
        timeouts: TimeoutsConfig,
        *,
        trusted_owners: Iterable[str] = (),
    ) -> None:
        self._host = host
        self._kad = kad
        self._rpc = rpc
        self._config = config
        self._timeouts = timeouts
        self._self_id = host.get_id()
        # records' times are read on the swarm's clock (net/swarm_clock.py); the stores'
        # budgets and memory on the monotonic one (their default)
        self.clock = SwarmClock()
        # another daemon signing records with this node's key (a copied identity.key)
        self.clones = CloneWatch(
            str(self._self_id),
            started_at=time.time(),
            margin_s=config.max_clock_skew_s,
            offset=lambda: self.clock.offset,
        )
        self.records = SignedRecordStore(EXPERT_RECORDS, config, record_clock=self.clock.now)
        self.manifests = SignedRecordStore(
            MANIFESTS, config, trusted_writers=trusted_owners, record_clock=self.clock.now
        )
        self._dead_until: dict[ID, float] = {}
        # What the node's lookups (net/lookup.py, installed by open_node) found silent:
        # one record of silence for both, so a peer one found out the other skips too.
        routing = getattr(getattr(kad, "peer_routing", None), "find_closest_peers_network", None)
        lookup = getattr(routing, "__self__", None)
        self._lookup_memory: LookupMemory | None = (
            lookup.memory if isinstance(lookup, PeerLookup) else None
        )
        # key -> (routing table size then, valid until, closest peers)
        self._closest_cache: dict[str, tuple[int, float, list[ID]]] = {}
        # record key -> the closest peers that accepted this node's last record for it
        self._holders: dict[str, set[ID]] = {}
        # Peers serve at most 12 concurrent Kademlia streams and reset the rest.
        self._lookups = trio.CapacityLimiter(4)
        admit_after_identify(host, kad)

    def _store_of(self, kind: RecordKind[R]) -> SignedRecordStore[R]:
        store: SignedRecordStore[Any] = self.records if kind is EXPERT_RECORDS else self.manifests
        return store

    # -- serving other peers ----------------------------------------------------------

    def handlers(self) -> dict[Verb, Handler]:
        return {**self._handlers(_EXPERT_VERBS), **self._handlers(_MANIFEST_VERBS)}

    def _handlers(self, verbs: _Verbs[R]) -> dict[Verb, Handler]:
        """The kind's store verb (records validated into this node's store, counted
        against the storing connection's quotas) and its find verb."""
        store = self._store_of(verbs.kind)

        async def on_store(request: Request) -> Reply:
            records: list[R] = request.header.records
            source = self._source(request.peer_id)
            # a peer storing its own records sends them as it signs them: its clock
            writer_of = verbs.kind.writer_of
            if verbs.clock_samples:
                self.clock.observe(
                    _voter(source),
                    (r.issued_at for r in records if writer_of(r) == request.peer_id),
                )
            # A record repeated within one request is offered once and its outcome
            # counted for every copy (a second copy would be a repeat of the stored
            # record, or refused again): a forged record sent 196 times in one request
            # costs one signature check, not 196. The store budgets failed checks per
            # source across requests (net/store.py).
            outcomes: dict[R, str | None] = {}
            refused: Counter[str] = Counter()
            for record in records:
                if record not in outcomes:
                    outcomes[record] = store.keep(record, source)
                reason = outcomes[record]
                if reason is not None:
                    refused[_WIRE_REASONS.get(reason, "other")] += 1
            stored = len(records) - refused.total()
            return Reply(
                StoreReply(
                    stored=stored,
                    rejected=len(records) - stored,
                    refused=dict(refused) if verbs.explains else {},
                )
            )

        async def on_find(request: Request) -> Reply:
            keys, writer = request.header.query()
            per_key = [store.ranked(key, writer) for key in dict.fromkeys(keys)]
            fitted = fit_reply(per_key, _FIND_REPLY_BYTES, verbs.kind.wire_size_of)
            return Reply(fit_reply_header(PROTOCOLS[verbs.find].reply, fitted))

        return {verbs.store: on_store, verbs.find: on_find}

    def _source(self, peer_id: str) -> Source:
        """Who stores: the requesting peer and the IP prefix of its direct connection (a
        quota that a thousand identities behind one address share).

        A peer that reaches this node only through a relay circuit has no IP of its own
        here: the circuit's remote address is the relay's. Charging it to the relay's
        prefix would let whoever comes first through a relay fill the quota of everyone
        after, so it gets a prefix quota of its own (as a connection closing under us
        does); its records still count against its peer quota, the store's budget and
        the ranks that keep writers seen earlier in place, and the relay bounds what one
        circuit carries."""
        try:
            hosts = observed_ips(self._host, peer_id)
        except Exception:  # a malformed id or a connection closing under us: none seen
            hosts = []
        return Source(peer_id, ip_prefix(hosts[0]) if hosts else f"peer:{peer_id}")

    def statistics(self) -> DHTStatistics:
        """What this node stores for others now, and what it refused (by reason)."""
        return DHTStatistics(self.records.statistics(), self.manifests.statistics())

    def expire(self) -> None:
        """Drop expired records and manifests (the node calls this every few seconds)."""
        self.records.expire()
        self.manifests.expire()

    # -- membership -------------------------------------------------------------------

    async def bootstrap(self, peers: Sequence[PeerAddress]) -> int:
        """Connect to ``peers`` and fill the routing table; returns how many answered."""
        joined = 0

        async def join(peer: PeerAddress) -> None:
            nonlocal joined
            try:
                with trio.fail_after(self._timeouts.connect_s):
                    await self._host.connect(peer.peer_info())
                    self._answered(ID.from_base58(peer.peer_id))
                    if await self._kad.routing_table.add_peer(ID.from_base58(peer.peer_id)):
                        joined += 1
            except trio.TooSlowError:
                # its text is empty: the warning ended at "did not answer: " (audit-join)
                logger.warning(
                    "bootstrap peer %s did not answer within %g s", peer, self._timeouts.connect_s
                )
            except Exception as exc:
                # An exception is always true, so "exc or its type" was the exception, and
                # printed nothing when its text was empty.
                reason = str(exc) or type(exc).__name__
                logger.warning("bootstrap peer %s did not answer: %s", peer, reason)

        async with trio.open_nursery() as nursery:
            for peer in peers:
                if peer.peer_id != str(self._self_id):
                    nursery.start_soon(join, peer)
        if joined:
            with trio.move_on_after(self._timeouts.dht_lookup_s):
                await self._kad.peer_routing.find_closest_peers_network(self._self_id.to_bytes())
        return joined

    def routing_table_size(self) -> int:
        return int(self._kad.get_routing_table_size())

    def knows(self, peer_id: str) -> bool:
        """Whether ``peer_id`` is in the routing table."""
        try:
            return bool(self._kad.routing_table.peer_in_table(ID.from_base58(peer_id)))
        except Exception:  # a malformed peer id is known to nobody
            return False

    def forget_peer(self, peer_id: str) -> None:
        """Stop routing through a peer that failed to answer."""
        try:
            pid = ID.from_base58(peer_id)
            self._dead_until[pid] = time.monotonic() + _DEAD_PEER_S
            if self._lookup_memory is not None:
                self._lookup_memory.mark_silent(pid, _DEAD_PEER_S)
            self._kad.routing_table.remove_peer(pid)
            # Kademlia falls back to every peerstore address while the routing table
            # is small; a dead peer's addresses would be dialled on every lookup.
            self._host.get_peerstore().clear_addrs(pid)
        except Exception:  # unknown or malformed peer id: nothing to forget
            pass
        self._rpc.forget(peer_id)
        self._closest_cache.clear()

    def silent(self, peer_id: str) -> bool:
        """Whether ``peer_id`` failed to answer this node lately (see ``_gone``)."""
        try:
            return self._gone(ID.from_base58(peer_id))
        except Exception:  # a malformed peer id: never heard of
            return False

    def _answered(self, peer_id: ID) -> None:
        """``peer_id`` answered on a connection (the node joined through it again): it
        is asked again at once. A bootstrap peer forgotten when the node's old connection
        to it stopped answering (this computer's address changed), or a bootstrap node
        that restarted, was asked nothing for ``_DEAD_PEER_S`` after the node had joined
        through it again, and the node's records reached no other peer meanwhile (55 to
        70 s in an outside probe; a node that knew no other peer announced to nobody)."""
        self._dead_until.pop(peer_id, None)
        if self._lookup_memory is not None and self._lookup_memory.silent(peer_id):
            self._lookup_memory.mark_silent(peer_id, 0.0)  # silent until now: no longer
        self._closest_cache.clear()

    def _gone(self, peer_id: ID) -> bool:
        """Whether ``peer_id`` failed to answer this node lately (``forget_peer``, or a
        lookup that found it silent): it is asked nothing meanwhile."""
        memory = self._lookup_memory
        return peer_id in self._dead_until or (memory is not None and memory.silent(peer_id))

    async def _closest(self, key: str) -> list[ID]:
        """The ``replication`` closest peers to ``key``, this node included: the first of
        ``_candidates``, where this node stores and looks first."""
        return (await self._candidates(key))[: self._config.replication]

    async def _candidates(self, key: str) -> list[ID]:
        """Peers known to run this DHT that may hold ``key``'s records, best first: at
        most twice ``replication``, the closest set first and the next-closest after it
        (what a store or find moves on to when one of the set fails it).

        Candidates are the peers that answered the lookup and the routing table's
        closest (which hold peers that answered a lookup or asked this node a Kademlia
        question), and this node; of those, only peers this node holds a connection to
        and has not found silent. A bare connection is no candidate: 300 strangers that
        made one find each and held their connections were the closest "peers" to every
        key of the daemon they were connected to, and stores to them failed for as long
        as they stayed (0 acks for 133 s, and a reader connected to them found nothing
        for ~55 s). The routing table's closest come twice ``replication`` deep, so a
        lookup cut short (timeouts, streams reset under load) still leaves writer and
        reader the same real peers to meet on. ``_spread`` then keeps at most a minority
        of the set on one network.

        A lookup is reused while the routing table keeps its size (for at most 30 s):
        one made while the table was still filling would keep records away from the
        peers that readers ask, so any change of membership means a fresh lookup. A
        peer that fails a request is forgotten (``forget_peer``), which drops every
        cached set; one found silent meanwhile is left out of a cached set when read.
        """
        now = time.monotonic()
        size = self.routing_table_size()
        cached = self._closest_cache.get(key)
        if cached is not None and cached[0] == size and cached[1] > now:
            return [p for p in cached[2] if p == self._self_id or not self._gone(p)]
        found: list[ID] = []
        replication = self._config.replication
        # The bound covers the wait for a lookup slot too: after a change of membership
        # every key is looked up again, and queued lookups would make an announcement
        # round last several lookups long, past its records' lifetime. A key that gets
        # no slot in time takes the routing table's closest peers, and is looked up
        # again next time.
        with trio.move_on_after(self._timeouts.dht_lookup_s):
            async with self._lookups:
                found = await self._kad.peer_routing.find_closest_peers_network(
                    key.encode(), count=replication
                )
        if self._dead_until:
            self._dead_until = {p: t for p, t in self._dead_until.items() if t > now}
        local = self._kad.routing_table.find_local_closest_peers(key.encode(), 2 * replication)
        connections = self._host.get_network().connections
        candidates = [
            p
            for p in dict.fromkeys([*found, *local, self._self_id])
            if p == self._self_id or (connections.get(p) and not self._gone(p))
        ]
        spread = self._spread(key, candidates)[: 2 * replication]
        if found or not size:
            # A lookup that found nobody (timed out, or streams reset under load) is
            # not remembered: caching [self] would keep records on this node alone.
            self._closest_cache[key] = (size, now + _CLOSEST_CACHE_S, spread)
        return spread

    def _spread(self, key: str, peers: Iterable[ID]) -> list[ID]:
        """``peers`` closest to ``key`` first, except that a peer whose network
        (``_network_of``) already has a minority of ``replication`` before it (2 of 5)
        goes to the end, still in order: the closest set then holds peers of at least
        three networks wherever there are, and only fills up from one network when no
        other is left. Five identities ground near a key (12 bits took ~16 s of CPU)
        from one address that took records and answered every find empty hid the key
        from every reader, and its writers counted 5 acks. Writer and reader apply the
        same rule to the same peers, so they still meet."""
        cap = max(1, (self._config.replication - 1) // 2)
        taken: Counter[str] = Counter()
        first: list[ID] = []
        last: list[ID] = []
        for peer in sort_peer_ids_by_distance(key.encode(), list(peers)):
            network = "self" if peer == self._self_id else self._network_of(peer)
            if taken[network] < cap:
                taken[network] += 1
                first.append(peer)
            else:
                last.append(peer)
        return first + last

    def _network_of(self, peer_id: ID) -> str:
        """The network ``peer_id`` is counted in for ``_spread``: the IP prefix of this
        node's direct connection to it (a /24, a /48), as the store's quotas count;
        a peer on loopback, a private network (a LAN, a test's swarm) or reached only
        through a relay counts alone, as the swarm clock's voters do (``_voter``): a
        LAN's peers share one /24, and a cap on it would keep its records on two."""
        return _voter(self._source(str(peer_id)))

    def _address(self, peer_id: ID) -> PeerAddress:
        """The peer's known addresses; none when the peerstore has forgotten it.

        py-libp2p raises PeerStoreError for a peer whose entry was removed (it drops
        peers whose connections closed): a lookup's answer may name one that left a
        moment ago. That is a peer we cannot dial, never an error of ours."""
        try:
            addrs = self._host.get_peerstore().addrs(peer_id)
        except PeerStoreError:
            addrs = []
        return PeerAddress(str(peer_id), tuple(dialable_part(str(a)) for a in addrs))

    async def _candidates_of(self, verbs: _Verbs[R], keys: Iterable[str]) -> dict[str, list[ID]]:
        """``_candidates`` of each key (a kind's key is looked up as its DHT key)."""
        candidates: dict[str, list[ID]] = {}

        async def lookup(key: str) -> None:
            candidates[key] = await self._candidates(verbs.kind.dht_key(key))

        async with trio.open_nursery() as nursery:
            for key in dict.fromkeys(keys):
                nursery.start_soon(lookup, key)
        return candidates

    def _next_round(
        self,
        candidates: Mapping[str, list[ID]],
        outcomes: dict[str, dict[ID, str]],
        widen: Callable[[str], bool] = lambda key: False,
    ) -> dict[ID, list[str]]:
        """The peers to ask next and the keys to ask each for (``_to_ask``); a peer found
        silent meanwhile (it failed another key's request) is marked failed unasked."""
        by_peer: dict[ID, list[str]] = {}
        for key, peers in candidates.items():
            outcome = outcomes[key]
            while True:
                chosen = _to_ask(peers, outcome, self._config.replication, widen=widen(key))
                gone = [p for p in chosen if p != self._self_id and self._gone(p)]
                if not gone:
                    break
                outcome.update(dict.fromkeys(gone, _FAILED))
            for peer_id in chosen:
                outcome[peer_id] = _ASKED
                by_peer.setdefault(peer_id, []).append(key)
        return by_peer

    # -- storing and finding, for every kind --------------------------------------------

    async def _ask(
        self, peer_id: ID, verb: Verb, request: BaseModel, timeout_s: float | None = None
    ) -> Any:
        """``peer_id``'s reply to ``request`` within ``timeout_s`` (default
        ``dht_rpc_s``); None when it failed to answer.

        A peer that could not be reached or did not answer in time is forgotten (it is
        gone, or as good as gone). One that answered, but with a typed error or a reply
        this node cannot read (too large, malformed, cut off), is alive and stays in the
        routing table: what made its answer unreadable may be what others stored on it,
        so forgetting it would let them empty a reader's table of honest peers."""
        try:
            with trio.fail_after(timeout_s or self._timeouts.dht_rpc_s):
                reply, _ = await self._rpc.call(self._address(peer_id), verb, request)
        except (PeerUnreachable, RequestTimeout, trio.TooSlowError) as exc:
            logger.debug("%s on %s failed: %s", verb, short(peer_id), exc)
            self.forget_peer(str(peer_id))
            return None
        except PeerError as exc:
            logger.debug("%s on %s answered unusably: %s", verb, short(peer_id), exc)
            return None
        return reply

    async def _put(
        self,
        verbs: _Verbs[R],
        records: Sequence[R],
        refused: dict[str, Counter[str]] | None = None,
    ) -> dict[str, int]:
        """Store each record on the closest peers to its key; returns, per key, how many
        of them (this node included) accepted all of that key's records. ``refused``,
        when given, gets per key how many other peers refused it for each reason their
        replies gave (a reply's reasons count for every key of its request it refused).

        A peer of a key's closest set that fails to answer gives its place to the next
        candidate (``_candidates``), until ``replication`` peers answered or twice that
        many were asked: the key's closest set is then the first ``replication`` that
        answered, the peers a reader also ends up asking.

        The peers holding this node's previous record for a key get the new one at
        once, while the closest peers are looked up: after any change of membership
        that lookup goes over the network, and under load it can take longer than
        what is left of the previous record's life. Waiting for it would let a live
        server's records lapse."""
        kind, store = verbs.kind, self._store_of(verbs.kind)
        by_key: dict[str, list[R]] = {}
        for record in records:
            by_key.setdefault(kind.key_of(record), []).append(record)
        # key -> peer -> _ASKED, _FAILED, _EMPTY (answered, kept not all), _FOUND (kept all)
        outcomes: dict[str, dict[ID, str]] = {key: {} for key in by_key}

        async def store_on(peer_id: ID, keys: list[str]) -> None:
            batch = [r for k in keys for r in by_key[k]]
            if peer_id == self._self_id:
                accepted = {kind.key_of(r) for r in batch if store.put(r)}
                for key in keys:
                    outcomes[key][peer_id] = _FOUND if key in accepted else _EMPTY
                return
            budget = (
                _LIMITED_STORE_REQUEST_BYTES if self._rpc.upload_limited else _STORE_REQUEST_BYTES
            )
            chunks = store_chunks(batch, verbs.store_batch, budget, kind.wire_size_of)
            for chunk in chunks:
                request = PROTOCOLS[verbs.store].request(records=chunk)
                reply = await self._ask(peer_id, verbs.store, request)
                if reply is None:
                    _failed(outcomes, peer_id, keys)
                    return
                took = isinstance(reply, StoreReply) and reply.stored == len(chunk)
                for key in {kind.key_of(r) for r in chunk}:
                    if took or outcomes[key][peer_id] == _FOUND:
                        outcomes[key][peer_id] = _FOUND
                    else:
                        outcomes[key][peer_id] = _EMPTY
                if not took and isinstance(reply, StoreReply) and refused is not None:
                    codes = {c if c in REFUSAL_CODES else "other" for c in reply.refused}
                    for key in {kind.key_of(r) for r in chunk}:
                        refused.setdefault(key, Counter()).update(codes or {UNEXPLAINED})

        def start_round(nursery: trio.Nursery, by_peer: Mapping[ID, list[str]]) -> None:
            for peer_id, keys in by_peer.items():
                nursery.start_soon(store_on, peer_id, keys)

        holding: dict[ID, list[str]] = {}
        for key in by_key:
            for peer_id in self._holders.get(key, ()):
                if not self._gone(peer_id):
                    holding.setdefault(peer_id, []).append(key)
                    outcomes[key][peer_id] = _ASKED
        async with trio.open_nursery() as nursery:
            start_round(nursery, holding)
            candidates = await self._candidates_of(verbs, by_key)
            start_round(nursery, self._next_round(candidates, outcomes))
        # Peers that failed give way to the next candidates: each round asks at least
        # one more peer per key short of its set, within twice ``replication`` a key.
        while by_peer := self._next_round(candidates, outcomes):
            async with trio.open_nursery() as nursery:
                start_round(nursery, by_peer)
        acks: dict[str, int] = {}
        for key, outcome in outcomes.items():
            # Earlier holders no longer among the closest keep their copy until it
            # expires; readers do not ask them, so they neither count nor get the next.
            closest = _answered(candidates[key], outcome, self._config.replication)
            self._holders[key] = {p for p in closest if outcome[p] == _FOUND}
            acks[key] = len(self._holders[key])
        return acks

    async def _find(
        self, verbs: _Verbs[R], keys: Sequence[str], writer: str | None = None
    ) -> dict[str, list[R]]:
        """Valid, unexpired records per key (only ``writer``'s when given) from the
        closest peers: the newest per writer, in the storing peers' order (they list the
        writers they have seen longest first).

        As in ``_put``, a peer of a key's closest set that fails to answer gives its
        place to the next candidate. When every peer that answered for a key had none
        of its records, the next ``replication`` candidates are asked once more: peers
        that take records and answer every find empty (or newcomers not filled yet)
        must not be where a reader's search ends.

        Answers are kept as they come, and the find returns what the peers that
        answered gave: each storing peer has half of ``dht_rpc_s`` per request (a
        find is a small read) and all of them together ``dht_rpc_s``. A reader bounds
        a find by a few seconds (the trainer's directory refresh, 5 s at least): one
        silent peer among the closest, connected but answering nothing, must be found
        out (``_ask`` forgets it) before that bound ends the whole find, so that this
        find returns the others' answers and the next ones skip it."""
        kind, store = verbs.kind, self._store_of(verbs.kind)
        peer_s = self._timeouts.dht_rpc_s / 2
        keys = list(dict.fromkeys(keys))
        # (position in the storing peer's answer for its key, record)
        found: list[tuple[int, R]] = []
        # key -> peer -> _ASKED, _FAILED, _EMPTY (answered with none), _FOUND
        outcomes: dict[str, dict[ID, str]] = {key: {} for key in keys}

        def take(peer_id: ID, asked: list[str], records: Iterable[R]) -> None:
            position: dict[str, int] = {}
            for record in records:
                key = kind.key_of(record)
                position[key] = position.get(key, -1) + 1
                found.append((position[key], record))
            for key in asked:
                outcomes[key][peer_id] = _FOUND if key in position else _EMPTY

        async def find_on(peer_id: ID, peer_keys: list[str]) -> None:
            if peer_id == self._self_id:
                take(peer_id, peer_keys, (r for k in peer_keys for r in store.get(k, writer)))
                return
            for start in range(0, len(peer_keys), verbs.find_batch):
                chunk = peer_keys[start : start + verbs.find_batch]
                reply = await self._ask(
                    peer_id, verbs.find, verbs.find_request.asking(chunk, writer), peer_s
                )
                if reply is None:
                    _failed(outcomes, peer_id, peer_keys)
                    return
                if verbs.clock_samples:
                    self.clock.observe(
                        _voter(self._source(str(peer_id))), (r.issued_at for r in reply.records)
                    )
                wanted = set(chunk)
                take(
                    peer_id,
                    chunk,
                    (
                        r
                        for r in reply.records
                        if kind.key_of(r) in wanted
                        and writer in (None, kind.writer_of(r))
                        and self._valid(kind, r)
                    ),
                )

        def empty(key: str) -> bool:
            """Every peer asked for ``key`` answered, and none had a record of it."""
            states = outcomes[key].values()
            return _EMPTY in states and all(s in (_EMPTY, _FAILED) for s in states)

        candidates = await self._candidates_of(verbs, keys)
        with trio.move_on_after(self._timeouts.dht_rpc_s):
            while by_peer := self._next_round(candidates, outcomes, empty):
                async with trio.open_nursery() as nursery:
                    for peer_id, peer_keys in by_peer.items():
                        nursery.start_soon(find_on, peer_id, peer_keys)
        result: dict[str, list[R]] = {key: [] for key in keys}
        for record in merge_answers(kind, found):
            result[kind.key_of(record)].append(record)
        return result

    def _valid(self, kind: RecordKind[R], record: R) -> bool:
        try:
            kind.validate(record, self._config, now=self.clock.now())
        except InvalidRecord as exc:
            logger.debug("dropped a %s from the DHT: %s", kind.name, exc)
            return False
        return True

    # -- expert records ---------------------------------------------------------------

    async def read_back(self, record: ExpertRecord) -> bool | None:
        """Whether a peer holding ``record`` (this node's, after its ``put``) gives it
        back when asked: the holders are asked one by one, in random order, until one
        does (usually the first), each within ``dht_rpc_s`` (a check nobody waits on:
        a busy holder is not to be forgotten for it). None when nothing could be
        checked: no other peer holds it, none of them answered, or it has expired (a
        round slower than its records' lifetime). False: every holder that answered
        withheld it, as peers that take records and answer every find empty do (their
        acks count like anyone's); an answer of ``_READ_BACK_FULL`` records of the key
        or more counts as no answer."""
        key, writer = record.key, str(self._self_id)
        holders = [p for p in self._holders.get(key, ()) if p != self._self_id]
        request = FindRequest.asking([key], writer)
        answered = False
        for peer_id in random.sample(holders, len(holders)):
            if record.expires_at <= self.clock.now():
                return None
            reply = await self._ask(peer_id, Verb.DHT_FIND, request)
            if reply is None:
                continue
            held = [r for r in reply.records if r.key == key]
            # Records under this node's id count (as held, or as a copy's) only when
            # signed by its key: a stranger's forgery under this id made the volunteer
            # warn of a copy at an address of the stranger's choosing (a re-check).
            mine = self._signed_by_me(held)
            self.clones.check(mine)
            if mine:
                return True
            # an answer this full may have been cut short before this node's record (a
            # prefix many servers share): it shows nothing either way
            answered = answered or len(held) < _READ_BACK_FULL
        return False if answered and record.expires_at > self.clock.now() else None

    async def look_for_copies(self, key: str) -> None:
        """Ask one peer holding this node's record for ``key`` (stored a round ago) for
        the record under this node's id it holds now, and show it to ``clones``: a
        daemon using this node's identity too (a copied identity.key) has replaced it
        there by then. A read-back just after a store gives this node's own back."""
        holders = [p for p in self._holders.get(key, ()) if p != self._self_id]
        if not holders:
            return
        request = FindRequest.asking([key], str(self._self_id))
        reply = await self._ask(random.choice(holders), Verb.DHT_FIND, request)
        if reply is not None:
            self.clones.check(self._signed_by_me(r for r in reply.records if r.key == key))

    def _signed_by_me(self, records: Iterable[ExpertRecord]) -> list[ExpertRecord]:
        """The valid records (signature, expiry, not from the future) under this node's
        peer id among ``records``: a find's answer is not validated as a whole."""
        writer = str(self._self_id)
        return [r for r in records if r.peer_id == writer and self._valid(EXPERT_RECORDS, r)]

    async def put(self, records: Sequence[ExpertRecord]) -> StoreOutcome:
        """Store each record on the closest peers to its key; returns the acks per key."""
        self.clones.signed(records)
        return StoreOutcome(await self._put(_EXPERT_VERBS, records))

    async def get(self, keys: Sequence[str]) -> dict[str, list[ExpertRecord]]:
        """Active, valid, unexpired records per key, newest per peer, from the closest
        peers, the writers they have seen longest first."""
        found = await self._find(_EXPERT_VERBS, keys)
        self.clones.check(r for records in found.values() for r in records)
        return {key: [r for r in records if r.active] for key, records in found.items()}

    # -- experiment manifests (docs/protocol.md, "Experiment manifests") --------------

    async def put_manifest(self, record: ManifestRecord) -> int:
        """Store ``record`` on the closest peers to its name; returns how many accepted."""
        return (await self.store_manifest(record)).acks

    async def store_manifest(self, record: ManifestRecord) -> ManifestStoreOutcome:
        """Like ``put_manifest``, with why the peers that refused it did."""
        refused: dict[str, Counter[str]] = {}
        acks = (await self._put(_MANIFEST_VERBS, [record], refused))[record.name]
        return ManifestStoreOutcome(acks, dict(refused.get(record.name, Counter())))

    async def get_manifests(self, name: str, owner: str | None = None) -> list[ManifestRecord]:
        """Every owner's newest valid manifest for experiment ``name``; only ``owner``'s
        when given (storing peers then answer with that owner's alone, so strangers'
        manifests under the same name cannot crowd it out of the answer)."""
        return (await self._find(_MANIFEST_VERBS, [name], owner))[name]

    async def find_expert(self, uid: str) -> list[PeerAddress]:
        """Servers announcing ``uid`` now."""
        records = (await self.get([uid]))[uid]
        return [PeerAddress(r.peer_id, tuple(dict.fromkeys(r.addrs))) for r in records]

    async def children(self, prefix: str) -> Mapping[int, list[PeerAddress]]:
        """For a prefix key (``"ffn."``, ``"ffn.3."``): alive next coordinates, and who
        announces them."""
        out: dict[int, list[PeerAddress]] = {}
        for record in (await self.get([prefix]))[prefix]:
            for child in record.children:
                out.setdefault(child, []).append(
                    PeerAddress(record.peer_id, tuple(dict.fromkeys(record.addrs)))
                )
        return out


def _voter(source: Source) -> str:
    """Whose clock a record shows, for ``SwarmClock``: on a public network the prefix a
    peer connects from (a thousand identities behind one address are one voter), on a
    private or loopback one (a LAN, a test's swarm) the peer itself."""
    try:
        network = ipaddress.ip_network(source.prefix)
    except ValueError:  # "peer:<id>": reached through a relay
        return f"peer:{source.peer_id}"
    address = network.network_address
    if network.is_private or address.is_loopback or address.is_unspecified or network.is_link_local:
        return f"peer:{source.peer_id}"
    return source.prefix
