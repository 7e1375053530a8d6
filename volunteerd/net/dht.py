"""Expert discovery: py-libp2p's Kademlia for routing, our own record protocol for storage.

py-libp2p's KadDHT finds the peers closest to a key well, but its value store keeps
one value per key for 24 h, answers from a local cache first and ignores expiry, and
its provider records never forget a dead provider (see docs/decisions/0002). So the
routing table and iterative lookups are KadDHT's, while records live on the
``replication`` closest peers (this node included when it is among them) through the
``dht-store`` and ``dht-find`` verbs, in a ``RecordStore`` that honours each
record's own expiry and keeps one record per (key, peer).

Every record that arrives, whether in a store request or in a find reply, is checked
by ``validate_record``: a storing peer cannot forge or revive another peer's record.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass

import trio
from libp2p.abc import IHost
from libp2p.kad_dht.kad_dht import KadDHT
from libp2p.kad_dht.utils import sort_peer_ids_by_distance
from libp2p.peer.id import ID
from libp2p.peer.peerstore import PeerStoreError

from volunteerd.config import DHTConfig, TimeoutsConfig
from volunteerd.errors import InvalidRecord, PeerError
from volunteerd.net.manifests import (
    ManifestFindReply,
    ManifestFindRequest,
    ManifestRecord,
    ManifestStore,
    ManifestStoreReply,
    ManifestStoreRequest,
    manifest_key,
    validate_manifest_record,
)
from volunteerd.net.peers import PeerAddress, dialable_part, public_key_of, short
from volunteerd.net.protocols import Verb
from volunteerd.net.records import (
    ExpertRecord,
    FindReply,
    FindRequest,
    RecordStore,
    StoreReply,
    StoreRequest,
    merge_newest,
    validate_record,
)
from volunteerd.net.rpc import Handler, Reply, Request, RpcClient
from volunteerd.net.store import Source, StoreStatistics, ip_prefix

__all__ = ["DHTStatistics", "ExpertDHT", "StoreOutcome"]

logger = logging.getLogger(__name__)

_FIND_BATCH = 64
# A find reply is one JSON header, and readers refuse headers over wire.max_header_bytes
# (64 KiB by default): a key flooded with hundreds of records must not make the whole
# answer unreadable. Keep it under 48 KiB.
_FIND_REPLY_BYTES = 48 * 1024
_CLOSEST_CACHE_S = 30.0
# Other peers' routing tables keep a dead peer for long; do not ask it again meanwhile.
_DEAD_PEER_S = 60.0


def fit_reply(per_key: Sequence[Sequence[ExpertRecord]], budget_bytes: int) -> list[ExpertRecord]:
    """Records of several keys within ``budget_bytes`` of JSON: round-robin over the
    keys, each key's best-ranked records first (the store lists writers seen longest
    first), so every key keeps its best writers when a flooded key would fill it."""
    out: list[ExpertRecord] = []
    used = 0
    for position in range(max((len(records) for records in per_key), default=0)):
        for records in per_key:
            if position >= len(records):
                continue
            record = records[position]
            # an upper bound of its JSON: fields' names and times, up to 8 bytes a child
            size = 320 + len(record.peer_id) + len(record.key) + 8 * len(record.children)
            size += sum(len(a) + 3 for a in record.addrs)
            if used + size > budget_bytes:
                return out
            used += size
            out.append(record)
    return out


@dataclass(frozen=True, slots=True)
class DHTStatistics:
    """``ExpertDHT.statistics()``: the expert record store and the manifest store."""

    records: StoreStatistics
    manifests: StoreStatistics


@dataclass(frozen=True, slots=True)
class StoreOutcome:
    """How many peers (this node included) accepted each key's record."""

    acks: dict[str, int]

    @property
    def min_acks(self) -> int:
        return min(self.acks.values(), default=0)


class ExpertDHT:
    """Stores and finds expert records. Constructed by ``open_node``; no I/O here."""

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
        self.store = RecordStore(config, public_key_of)
        self.manifests = ManifestStore(config, public_key_of, trusted_owners=trusted_owners)
        self._dead_until: dict[ID, float] = {}
        # key -> (routing table size then, valid until, closest peers)
        self._closest_cache: dict[str, tuple[int, float, list[ID]]] = {}
        # Peers serve at most 12 concurrent Kademlia streams and reset the rest.
        self._lookups = trio.CapacityLimiter(4)

    # -- serving other peers ----------------------------------------------------------

    def handlers(self) -> dict[Verb, Handler]:
        return {
            Verb.DHT_STORE: self._on_store,
            Verb.DHT_FIND: self._on_find,
            Verb.MANIFEST_STORE: self._on_manifest_store,
            Verb.MANIFEST_FIND: self._on_manifest_find,
        }

    def _source(self, peer_id: str) -> Source:
        """Who stores: the requesting peer and the IP prefix of its connection (a quota
        that a thousand identities behind one address share)."""
        host = ""
        try:
            for conn in self._host.get_network().connections.get(ID.from_base58(peer_id), []):
                remote = conn.muxed_conn.get_remote_address()  # type: ignore[attr-defined]
                if remote:
                    host = str(remote[0])
                    break
        except Exception:  # a connection closing under us: no address, its own quota
            host = ""
        return Source(peer_id, ip_prefix(host) if host else f"peer:{peer_id}")

    async def _on_manifest_store(self, request: Request) -> Reply:
        body: ManifestStoreRequest = request.header
        source = self._source(request.peer_id)
        stored = sum(self.manifests.put(record, source) for record in body.records)
        return Reply(ManifestStoreReply(stored=stored, rejected=len(body.records) - stored))

    async def _on_manifest_find(self, request: Request) -> Reply:
        body: ManifestFindRequest = request.header
        return Reply(ManifestFindReply(records=self.manifests.get(body.name, body.owner)))

    async def _on_store(self, request: Request) -> Reply:
        body: StoreRequest = request.header
        source = self._source(request.peer_id)
        stored = sum(self.store.put(record, source) for record in body.records)
        return Reply(StoreReply(stored=stored, rejected=len(body.records) - stored))

    async def _on_find(self, request: Request) -> Reply:
        body: FindRequest = request.header
        per_key = [self.store.get(key) for key in dict.fromkeys(body.keys)]
        return Reply(FindReply(records=fit_reply(per_key, _FIND_REPLY_BYTES)))

    def statistics(self) -> DHTStatistics:
        """What this node stores for others now, and what it refused (by reason)."""
        return DHTStatistics(self.store.statistics(), self.manifests.statistics())

    def expire(self) -> None:
        """Drop expired records and manifests (the node calls this every few seconds)."""
        self.store.expire()
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
                    if await self._kad.routing_table.add_peer(ID.from_base58(peer.peer_id)):
                        joined += 1
            except (trio.TooSlowError, Exception) as exc:
                logger.warning("bootstrap peer %s did not answer: %s", peer, exc or type(exc))

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

    def forget_peer(self, peer_id: str) -> None:
        """Stop routing through a peer that failed to answer."""
        try:
            pid = ID.from_base58(peer_id)
            self._dead_until[pid] = time.monotonic() + _DEAD_PEER_S
            self._kad.routing_table.remove_peer(pid)
            # Kademlia falls back to every peerstore address while the routing table
            # is small; a dead peer's addresses would be dialled on every lookup.
            self._host.get_peerstore().clear_addrs(pid)
        except Exception:  # unknown or malformed peer id: nothing to forget
            pass
        self._rpc.forget(peer_id)
        self._closest_cache.clear()

    async def _closest(self, key: str) -> list[ID]:
        """The ``replication`` closest peers to ``key``, this node included.

        A lookup is reused while the routing table keeps its size (for at most 30 s):
        one made while the table was still filling would keep records away from the
        peers that readers ask, so any change of membership means a fresh lookup.
        """
        now = time.monotonic()
        size = self.routing_table_size()
        cached = self._closest_cache.get(key)
        if cached is not None and cached[0] == size and cached[1] > now:
            return cached[2]
        found: list[ID] = []
        async with self._lookups:
            with trio.move_on_after(self._timeouts.dht_lookup_s):
                found = await self._kad.peer_routing.find_closest_peers_network(
                    key.encode(), count=self._config.replication
                )
        if self._dead_until:
            self._dead_until = {p: t for p, t in self._dead_until.items() if t > now}
        # The routing table's own closest peers are candidates too: a lookup cut short
        # (timeouts, streams reset under load) must not shrink the set to a few peers.
        local = self._kad.routing_table.find_local_closest_peers(
            key.encode(), self._config.replication
        )
        candidates = [
            p for p in dict.fromkeys([*found, *local, self._self_id]) if p not in self._dead_until
        ]
        closest: list[ID] = sort_peer_ids_by_distance(key.encode(), candidates)[
            : self._config.replication
        ]
        if found or not size:
            # A lookup that found nobody (timed out, or streams reset under load) is
            # not remembered: caching [self] would keep records on this node alone.
            self._closest_cache[key] = (size, now + _CLOSEST_CACHE_S, closest)
        return closest

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

    async def _group_by_peer(self, keys: Iterable[str]) -> dict[ID, list[str]]:
        keys = list(dict.fromkeys(keys))
        closest: dict[str, list[ID]] = {}

        async def lookup(key: str) -> None:
            closest[key] = await self._closest(key)

        async with trio.open_nursery() as nursery:
            for key in keys:
                nursery.start_soon(lookup, key)
        by_peer: dict[ID, list[str]] = {}
        for key in keys:
            for peer_id in closest[key]:
                by_peer.setdefault(peer_id, []).append(key)
        return by_peer

    # -- storing and finding ----------------------------------------------------------

    async def put(self, records: Sequence[ExpertRecord]) -> StoreOutcome:
        """Store each record on the closest peers to its key; returns the acks per key."""
        by_key: dict[str, list[ExpertRecord]] = {}
        for record in records:
            by_key.setdefault(record.key, []).append(record)
        by_peer = await self._group_by_peer(by_key)
        acks = dict.fromkeys(by_key, 0)

        async def store_on(peer_id: ID, keys: list[str]) -> None:
            batch = [r for k in keys for r in by_key[k]]
            if peer_id == self._self_id:
                accepted = {r.key for r in batch if self.store.put(r)}
            else:
                accepted = set()
                for start in range(0, len(batch), 256):
                    chunk = batch[start : start + 256]
                    try:
                        with trio.fail_after(self._timeouts.dht_rpc_s):
                            reply, _ = await self._rpc.call(
                                self._address(peer_id), Verb.DHT_STORE, StoreRequest(records=chunk)
                            )
                    except (PeerError, trio.TooSlowError) as exc:
                        logger.debug("store on %s failed: %s", short(peer_id), exc)
                        self.forget_peer(str(peer_id))
                        return
                    if isinstance(reply, StoreReply) and reply.stored == len(chunk):
                        accepted.update(r.key for r in chunk)
            for key in keys:
                if key in accepted:
                    acks[key] += 1

        async with trio.open_nursery() as nursery:
            for peer_id, keys in by_peer.items():
                nursery.start_soon(store_on, peer_id, keys)
        return StoreOutcome(acks)

    async def get(self, keys: Sequence[str]) -> dict[str, list[ExpertRecord]]:
        """Active, valid, unexpired records per key, newest per peer, from the closest peers."""
        by_peer = await self._group_by_peer(keys)
        # (position in the storing peer's answer for its key, record): storing peers
        # list the writers they have seen longest first, and readers keep that order.
        found: list[tuple[int, ExpertRecord]] = []

        def take(records: Iterable[ExpertRecord]) -> None:
            position: dict[str, int] = {}
            for record in records:
                rank = position.get(record.key, 0)
                position[record.key] = rank + 1
                found.append((rank, record))

        async def find_on(peer_id: ID, peer_keys: list[str]) -> None:
            if peer_id == self._self_id:
                take(r for k in peer_keys for r in self.store.get(k))
                return
            for start in range(0, len(peer_keys), _FIND_BATCH):
                chunk = peer_keys[start : start + _FIND_BATCH]
                try:
                    with trio.fail_after(self._timeouts.dht_rpc_s):
                        reply, _ = await self._rpc.call(
                            self._address(peer_id), Verb.DHT_FIND, FindRequest(keys=chunk)
                        )
                except (PeerError, trio.TooSlowError) as exc:
                    logger.debug("find on %s failed: %s", short(peer_id), exc)
                    self.forget_peer(str(peer_id))
                    return
                wanted = set(chunk)
                take(r for r in reply.records if r.key in wanted and self._valid(r))

        async with trio.open_nursery() as nursery:
            for peer_id, peer_keys in by_peer.items():
                nursery.start_soon(find_on, peer_id, peer_keys)
        best: dict[tuple[str, str], int] = {}
        for rank, record in found:
            slot = (record.key, record.peer_id)
            best[slot] = min(rank, best.get(slot, rank))
        result: dict[str, list[ExpertRecord]] = {key: [] for key in keys}
        for record in merge_newest(r for _, r in found):
            if record.active:
                result[record.key].append(record)
        for records in result.values():
            records.sort(key=lambda r: best[(r.key, r.peer_id)])
        return result

    def _valid(self, record: ExpertRecord) -> bool:
        try:
            validate_record(
                record,
                public_key_of=public_key_of,
                now=time.time(),
                max_ttl_s=self._config.max_record_ttl_s,
                max_clock_skew_s=self._config.max_clock_skew_s,
                max_children=self._config.max_children_per_record,
            )
        except InvalidRecord as exc:
            logger.debug("dropped a record from the DHT: %s", exc)
            return False
        return True

    # -- experiment manifests (docs/protocol.md, "Experiment manifests") --------------

    async def put_manifest(self, record: ManifestRecord) -> int:
        """Store ``record`` on the closest peers to its name; returns how many accepted."""
        acks = 0

        async def store_on(peer_id: ID) -> None:
            nonlocal acks
            if peer_id == self._self_id:
                acks += self.manifests.put(record)
                return
            try:
                with trio.fail_after(self._timeouts.dht_rpc_s):
                    reply, _ = await self._rpc.call(
                        self._address(peer_id),
                        Verb.MANIFEST_STORE,
                        ManifestStoreRequest(records=[record]),
                    )
            except (PeerError, trio.TooSlowError) as exc:
                logger.debug("manifest store on %s failed: %s", short(peer_id), exc)
                self.forget_peer(str(peer_id))
                return
            acks += isinstance(reply, ManifestStoreReply) and reply.stored == 1

        async with trio.open_nursery() as nursery:
            for peer_id in await self._closest(manifest_key(record.name)):
                nursery.start_soon(store_on, peer_id)
        return acks

    async def get_manifests(self, name: str, owner: str | None = None) -> list[ManifestRecord]:
        """Every owner's newest valid manifest for experiment ``name``; only ``owner``'s
        when given (storing peers then answer with that owner's alone, so strangers'
        manifests under the same name cannot crowd it out of the answer)."""
        found: list[ManifestRecord] = []

        async def find_on(peer_id: ID) -> None:
            if peer_id == self._self_id:
                found.extend(self.manifests.get(name, owner))
                return
            try:
                with trio.fail_after(self._timeouts.dht_rpc_s):
                    reply, _ = await self._rpc.call(
                        self._address(peer_id),
                        Verb.MANIFEST_FIND,
                        ManifestFindRequest(name=name, owner=owner),
                    )
            except (PeerError, trio.TooSlowError) as exc:
                logger.debug("manifest find on %s failed: %s", short(peer_id), exc)
                self.forget_peer(str(peer_id))
                return
            for record in reply.records:
                try:
                    validate_manifest_record(
                        record,
                        public_key_of=public_key_of,
                        now=time.time(),
                        max_ttl_s=self._config.max_manifest_ttl_s,
                        max_clock_skew_s=self._config.max_clock_skew_s,
                    )
                except InvalidRecord as exc:
                    logger.info("dropped a manifest from the DHT: %s", exc)
                    continue
                if record.name == name and owner in (None, record.owner):
                    found.append(record)

        async with trio.open_nursery() as nursery:
            for peer_id in await self._closest(manifest_key(name)):
                nursery.start_soon(find_on, peer_id)
        newest: dict[str, ManifestRecord] = {}
        for record in found:
            old = newest.get(record.owner)
            if old is None or record.issued_at > old.issued_at:
                newest[record.owner] = record
        return list(newest.values())

    async def find_expert(self, uid: str) -> list[PeerAddress]:
        """Servers announcing ``uid`` now."""
        records = (await self.get([uid]))[uid]
        return [PeerAddress(r.peer_id, r.addrs) for r in records]

    async def children(self, prefix: str) -> Mapping[int, list[PeerAddress]]:
        """For a prefix key (``"ffn."``, ``"ffn.3."``): alive next coordinates, and who
        announces them."""
        out: dict[int, list[PeerAddress]] = {}
        for record in (await self.get([prefix]))[prefix]:
            for child in record.children:
                out.setdefault(child, []).append(PeerAddress(record.peer_id, record.addrs))
        return out
