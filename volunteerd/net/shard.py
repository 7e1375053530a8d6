"""Shards: an expert's whole state, downloaded from a replica in chunks, verified by
SHA-256, resumable after a dropped connection or a restart.

A shard is a snapshot of an expert's state as bytes (a checkpoint file,
``volunteerd.experts.checkpoint_file``: a replica's holds its weights, a trainer's its
optimizer state too); this module only moves bytes.

Server: ``ShardServer(snapshot)`` answers the ``shard`` verb. A request without a
``sha256`` gets a fresh snapshot (the callback), which is then kept, keyed by its
SHA-256, while it is being downloaded; later requests name that ``sha256`` and get their
chunks from the same bytes, so a download never mixes two versions of the weights. A
snapshot nobody asked for in ``keep_idle_s`` is dropped; beyond ``max_cache_bytes`` the
least recently used snapshots go first, but never one still in use (asked for within
``in_use_s``): a full cache answers new downloads ``busy`` rather than starve running
ones. A request for a dropped snapshot gets ``expired``: the client asks for a fresh
one and goes on from its partial file if the bytes are the same (same SHA-256 and size:
a replica restarted with the same state, as ``server.pipeline.shard_snapshot`` makes
them), else starts again.

Client: ``download_shard`` writes the chunks to ``<dest>.partial`` with a sidecar
``<dest>.partial.json`` (uid, sha256, total). A later call for the same ``dest``, after
a dropped connection, a cancellation or a process restart, resumes from the bytes on
disk. The whole file's SHA-256 is checked at the end before it is renamed to ``dest``.

``fetch_shard`` downloads a (small) snapshot into memory instead, with the same checks
and no partial file: trainers fetch each other's parameters this way every round.

Every byte travels over the RPC client's streams, so the node's per-stream bandwidth
limits apply; chunks of 1 MiB keep throttling smooth.
"""

from __future__ import annotations

import hashlib
import logging
import math
import os
import time
from collections import OrderedDict
from collections.abc import Awaitable, Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Annotated, Protocol

import trio
from libp2p.exceptions import BaseLibp2pError
from pydantic import BaseModel, ConfigDict, Field, ValidationError

from volunteerd.atomic import STATE_MAX_BYTES, fsync_dir, read_small, write_atomic
from volunteerd.errors import (
    Busy,
    MalformedFrame,
    PeerError,
    RemoteError,
    ReplyTooLarge,
    RequestTimeout,
    ShardError,
    ShardTooSlow,
    SnapshotExpired,
)
from volunteerd.net.peers import PeerAddress, short
from volunteerd.net.protocols import Verb
from volunteerd.net.rpc import Handler, Reply, Request, RpcClient
from volunteerd.wire.messages import MAX_SHARD_CHUNK, Sha256, ShardReply, ShardRequest, Uid

__all__ = [
    "FIRST_CHUNK_BYTES",
    "HELD_PER_REQUESTER",
    "MAX_SHARD_CHUNK",
    "STALE_S",
    "ShardResult",
    "ShardServer",
    "ShardStats",
    "Snapshot",
    "download_shard",
    "fetch_shard",
    "partial_paths",
    "sweep_downloads",
]

if TYPE_CHECKING:
    # trio's TaskStatus as libp2p's trio-typing stubs spell it
    from trio_typing import TaskStatus

logger = logging.getLogger(__name__)

Snapshot = Callable[[str], Awaitable[bytes]]
"""``snapshot(uid)``: the expert's state as bytes; raises UnknownExpert."""

# Restarts from zero (expired snapshot, bad bytes on disk) within one call.
_MAX_RESTARTS = 3
# Server answers worth waiting for and asking again.
_RETRY_CODES = frozenset({"busy", "rate_limited"})
# the first chunk ``fetch_shard`` asks for when the peer's first answer has a deadline:
# 64 KiB take half a second at 1 Mbit/s
FIRST_CHUNK_BYTES = 64 << 10
_HASH_BLOCK = 4 << 20
# Snapshots one requester (an address; a peer id over a relay or on loopback) keeps "in
# use" at once (a joining daemon may download a few experts from one peer together),
# and requesters remembered. Without it, one peer asking for a byte of a fresh snapshot
# every second held 44 of them (1 GiB) in a trainer's cache, and every other trainer's
# download was refused busy.
HELD_PER_REQUESTER = 4
_MAX_REQUESTERS = 4096


# --------------------------------------------------------------------------- server


@dataclass(frozen=True, slots=True)
class ShardStats:
    """What a ShardServer has done; a snapshot of its counters."""

    snapshots: int  # fresh snapshots taken
    reused: int  # fresh requests answered with a recent snapshot instead
    chunks: int
    bytes_out: int
    expired: int  # requests for a snapshot no longer kept
    busy: int  # fresh requests refused: snapshots in use filled the cache
    cached: int  # snapshots kept now
    cached_bytes: int


@dataclass(slots=True)
class _Kept:
    uid: str
    data: bytes
    taken_at: float
    used_at: float
    holders: set[str] = field(default_factory=set)  # requesters counting it in use
    anonymous: bool = False  # used by a caller that named no requester


class ShardServer:
    """Answers the ``shard`` verb from snapshots taken by ``snapshot(uid)``.

    ``reuse_s``: a fresh request within this long of the uid's last snapshot gets that
    snapshot instead of a new one (many newcomers joining at once cost one snapshot).
    ``keep_idle_s``: a snapshot is dropped after this long without a request.
    ``max_cache_bytes``: snapshots kept, in all (a soft cap: it may be passed by one
    snapshot); beyond it the least recently used go first, except those asked for within
    ``in_use_s`` by a requester that counts it among its latest ``HELD_PER_REQUESTER``
    (4) snapshots (one requester cannot pin more). When those alone fill the cache, a
    fresh request gets Busy.
    ``max_chunk_bytes``: larger requests get shorter replies. ``clock`` is for tests.
    A snapshot superseded by a newer one of its uid is dropped once no download uses it
    (one peer asking for a byte of each fresh snapshot kept the cache full with them).

    Idle snapshots are dropped when a request comes, and by ``serve`` as time passes
    (start it next to the node, or a finished download's bytes stay in memory until the
    next request).
    """

    def __init__(
        self,
        snapshot: Snapshot,
        *,
        reuse_s: float = 5.0,
        keep_idle_s: float = 600.0,
        in_use_s: float = 60.0,
        max_cache_bytes: int = 512 << 20,
        max_chunk_bytes: int = MAX_SHARD_CHUNK,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self._snapshot = snapshot
        self._reuse_s = reuse_s
        self._keep_idle_s = keep_idle_s
        self._in_use_s = in_use_s
        self._max_cache_bytes = max_cache_bytes
        self._max_chunk_bytes = min(max_chunk_bytes, MAX_SHARD_CHUNK)
        self._clock = clock
        self._kept: OrderedDict[str, _Kept] = OrderedDict()  # by sha256, LRU first
        self._latest: dict[str, str] = {}  # uid -> sha256 of its newest snapshot
        self._taking = trio.Lock()
        self._held: OrderedDict[str, list[str]] = OrderedDict()  # requester -> its sha256s
        self._snapshots = self._reused = self._chunks = self._bytes_out = self._expired = 0
        self._busy = 0

    def handlers(self) -> dict[Verb, Handler]:
        return {Verb.SHARD: self.handle}

    async def serve(self, *, task_status: TaskStatus[None] = trio.TASK_STATUS_IGNORED) -> None:
        """Drop snapshots idle for ``keep_idle_s`` as time passes, until cancelled."""
        task_status.started()
        while True:
            await trio.sleep(max(1.0, min(self._keep_idle_s, 120.0) / 4))
            self._drop_idle()

    async def handle(self, request: Request) -> Reply:
        """The ``shard`` verb's handler."""
        requester = request.address or request.peer_id
        header, chunk = await self.chunk(request.header, requester=requester)
        return Reply(header, [chunk])

    async def chunk(
        self, request: ShardRequest, *, requester: str | None = None
    ) -> tuple[ShardReply, memoryview]:
        """The reply to ``request`` and its body. Raises UnknownExpert (from the
        snapshot callback), SnapshotExpired for a ``sha256`` no longer kept, Busy when
        snapshots in use fill the cache, and MalformedFrame for an offset past the end.
        ``requester`` keeps at most ``HELD_PER_REQUESTER`` snapshots in use at once (None:
        no limit)."""
        self._drop_idle()
        if request.sha256 is None:
            sha256, kept = await self._fresh(request.uid)
        else:
            sha256 = request.sha256
            found = self._kept.get(sha256)
            if found is None or found.uid != request.uid:
                self._expired += 1
                raise SnapshotExpired(f"{request.uid}: snapshot {sha256[:12]} is no longer kept")
            kept = found
        kept.used_at = self._clock()
        self._kept.move_to_end(sha256)
        self._hold(requester, sha256, kept)
        if request.sha256 is None:  # what the requester let go may make room now
            self._make_room(keep=sha256)
        total = len(kept.data)
        if request.offset > total:
            raise MalformedFrame(f"offset {request.offset} is past the end ({total} bytes)")
        length = min(request.length, self._max_chunk_bytes, total - request.offset)
        body = memoryview(kept.data)[request.offset : request.offset + length]
        self._chunks += 1
        self._bytes_out += length
        reply = ShardReply(
            uid=request.uid, sha256=sha256, total=total, offset=request.offset, length=length
        )
        return reply, body

    async def _fresh(self, uid: str) -> tuple[str, _Kept]:
        # One snapshot at a time: each costs a copy of the expert on the device worker.
        async with self._taking:
            latest = self._latest.get(uid)
            recent = self._kept.get(latest) if latest is not None else None
            fresh_enough = recent is not None and self._clock() - recent.taken_at <= self._reuse_s
            if latest is not None and recent is not None and fresh_enough:
                self._reused += 1
                return latest, recent
            self._make_room()
            if self._cached_bytes() >= self._max_cache_bytes:
                self._busy += 1
                raise Busy(f"{uid}: snapshots of running downloads fill the cache; try later")
            data = await self._snapshot(uid)
            if latest is not None and recent is not None and recent.data is data:  # hashed
                sha256 = latest
            else:
                sha256 = await trio.to_thread.run_sync(_sha256_hex, data)
            now = self._clock()
            kept = self._kept.get(sha256) or _Kept(uid, data, now, now)
            kept.taken_at = now
            self._kept[sha256] = kept
            self._latest[uid] = sha256
            self._snapshots += 1
            for old, older in list(self._kept.items()):
                if older.uid == uid and old != sha256 and not self._in_use(older, now):
                    self._forget(old)  # superseded, and nobody downloads it
            self._make_room(keep=sha256)
            logger.debug("%s: snapshot %s of %d bytes", uid, sha256[:12], len(data))
            return sha256, kept

    def _hold(self, requester: str | None, sha256: str, kept: _Kept) -> None:
        """Count ``kept`` in use for ``requester``, which lets go of its oldest snapshot
        beyond ``HELD_PER_REQUESTER``."""
        if requester is None:
            kept.anonymous = True
            return
        held = self._held.pop(requester, [])
        self._held[requester] = held
        if sha256 in held:
            held.remove(sha256)
        held.append(sha256)
        kept.holders.add(requester)
        while len(held) > HELD_PER_REQUESTER:
            self._let_go(requester, held.pop(0))
        while len(self._held) > _MAX_REQUESTERS:
            gone, shas = self._held.popitem(last=False)
            for old in shas:
                self._let_go(gone, old)

    def _let_go(self, requester: str, sha256: str) -> None:
        kept = self._kept.get(sha256)
        if kept is not None:
            kept.holders.discard(requester)
            superseded = self._latest.get(kept.uid) != sha256
            if superseded and not self._in_use(kept, self._clock()):
                self._forget(sha256)

    def _in_use(self, kept: _Kept, now: float) -> bool:
        held = kept.anonymous or bool(kept.holders)
        return held and now - kept.used_at <= self._in_use_s

    def _drop_idle(self) -> None:
        now = self._clock()
        for sha256 in [s for s, k in self._kept.items() if now - k.used_at > self._keep_idle_s]:
            self._forget(sha256)

    def _make_room(self, keep: str | None = None) -> None:
        """Drop least recently used snapshots not in use (nor ``keep``) while the cache
        is over its cap."""
        total = self._cached_bytes()
        now = self._clock()
        for sha256, kept in list(self._kept.items()):
            if total <= self._max_cache_bytes:
                break
            if sha256 != keep and not self._in_use(kept, now):
                total -= len(kept.data)
                self._forget(sha256)

    def _cached_bytes(self) -> int:
        return sum(len(k.data) for k in self._kept.values())

    def _forget(self, sha256: str) -> None:
        kept = self._kept.pop(sha256)
        if self._latest.get(kept.uid) == sha256:
            del self._latest[kept.uid]

    def clear(self) -> None:
        """Drop every kept snapshot (downloads in progress get ``expired``)."""
        self._kept.clear()
        self._latest.clear()

    def statistics(self) -> ShardStats:
        return ShardStats(
            snapshots=self._snapshots,
            reused=self._reused,
            chunks=self._chunks,
            bytes_out=self._bytes_out,
            expired=self._expired,
            busy=self._busy,
            cached=len(self._kept),
            cached_bytes=self._cached_bytes(),
        )


def _sha256_hex(data: bytes | memoryview) -> str:
    return hashlib.sha256(data).hexdigest()


# --------------------------------------------------------------------------- client


@dataclass(frozen=True, slots=True)
class ShardResult:
    """A completed download: ``path`` holds ``size`` bytes whose SHA-256 is ``sha256``.

    ``resumed_from``: bytes that were already on disk from an earlier call and were
    kept (0 for a download from scratch). ``fetched``: bytes this call received.
    ``restarts``: times this call started again from zero (the snapshot expired on the
    server, or the bytes on disk turned out to be wrong).
    """

    uid: str
    sha256: str
    size: int
    path: Path
    resumed_from: int
    fetched: int
    restarts: int


# The least a chunk before the end may hold, unless less was asked for.
MIN_SHARD_REPLY = 64 << 10

# A partial download resumes only while its replica keeps the snapshot (``keep_idle_s``,
# 10 minutes): six times that, and a restart still finds what it had.
STALE_S = 3600.0


def sweep_downloads(directory: Path, *, now: float | None = None) -> list[Path]:
    """Delete the files in a downloads folder untouched for ``STALE_S``: the partial
    files of downloads cut short (a daemon killed, a project left since) and whole ones
    never loaded. They are no use by then, and counted against the disk budget for ever.
    Returns what was deleted; a file that cannot be is logged and left."""
    cutoff = (time.time() if now is None else now) - STALE_S
    try:
        entries = list(directory.iterdir())
    except OSError:  # no folder (yet): nothing left behind
        return []
    swept = []
    for entry in entries:
        try:
            if entry.is_dir() or entry.lstat().st_mtime > cutoff:
                continue
            entry.unlink()
        except OSError as exc:
            logger.warning("%s: not deleted (%s)", entry, exc)
            continue
        swept.append(entry)
    if swept:
        logger.info(
            "deleted %d unfinished download files of over an hour ago from %s",
            len(swept),
            directory,
        )
    return swept


def partial_paths(dest: Path) -> tuple[Path, Path]:
    """Where ``download_shard`` keeps an unfinished ``dest``: the bytes so far and the
    JSON sidecar naming the snapshot they belong to."""
    return dest.with_name(dest.name + ".partial"), dest.with_name(dest.name + ".partial.json")


class _Sidecar(BaseModel):
    model_config = ConfigDict(frozen=True, extra="forbid")

    uid: Uid
    sha256: Sha256
    total: Annotated[int, Field(ge=0)]


async def download_shard(
    rpc: RpcClient,
    peer: PeerAddress,
    uid: str,
    dest: Path,
    *,
    chunk_bytes: int = 1 << 20,
    expected_sha256: str | None = None,
    max_bytes: int = 16 << 30,
    retries: int = 4,
    backoff_s: float = 0.5,
    on_chunk: Callable[[int, int], None] | None = None,
    min_rate: float | None = None,
    grace_s: float = 5.0,
    queue_s: float = 0.0,
) -> ShardResult:
    """Download the state of expert ``uid`` from ``peer`` into ``dest``.

    Chunks of ``chunk_bytes`` (at most 4 MiB and at most the client's
    ``wire.max_body_bytes``) are written to ``<dest>.partial``; a later call resumes from
    them (see ``partial_paths``) if the peer still keeps the same snapshot, or serves the
    same bytes again (asked for afresh once it answers ``expired``: a replica restarted
    with the same state), else starts again (a restart, at most 3 in a call). At the end
    the whole file's SHA-256 is checked, the file is fsynced and renamed to ``dest``
    (replacing it), and the partial files are gone. With ``expected_sha256`` the peer
    must serve exactly that snapshot; a snapshot over ``max_bytes`` is refused before
    anything is written. ``on_chunk(received, total)`` is called after each chunk is
    written. ``dest``'s folder must exist; run one download per ``dest`` at a time.

    A dropped connection, a timeout (the RPC client's ``request_s`` per chunk) or a
    ``busy``/``rate_limited`` answer is retried ``retries`` times in a row, waiting
    ``backoff_s``, then twice that, and so on; one whose ``retry_after_s`` is longer
    than all those waits left (a quota's share used up until midnight) is not retried
    (ShardError, its ``__cause__`` the RemoteError). Bound the whole download with
    ``trio.fail_after`` at the call site; on cancellation the partial files stay for a
    later call to resume. With ``min_rate`` (bytes a second), the bytes received must
    keep up with it after ``grace_s``, whatever the replies and retries in between, or
    ShardTooSlow (a ``resumable`` ShardError; ``fetched``: the bytes this call got): a
    replica that answered each request with one byte just before the RPC's
    ``request_s`` held a newcomer's start ten of those, 600 s, for 13 bytes (an outside
    probe), whatever the expert's size. ``queue_s`` is how long the
    peer may keep a request waiting for one of its bulk slots before it answers
    (``net.rpc``: half of its ``request_s``): the first reply may take ``queue_s`` plus
    ``grace_s``, and the pace is counted from that reply on, its bytes included. A
    5 s grace that counted the queue failed every download beyond the 4 a seed answers
    at once (an outside audit: 59 of 72 joiners' experts seeded). When the pace fails
    before any byte came, its ``__cause__`` is a RequestTimeout: the peer only kept the
    request waiting.

    Raises RemoteError (``unknown_expert``: the peer does not host ``uid``;
    ``shutting_down``), and ShardError when the peer keeps failing (``resumable``: the
    partial file is kept), when its replies contradict each other or one declares more
    bytes than its request asked for (refused from its prefix, before they are read; not
    retried), or when the bytes do not match their SHA-256 (the partial file is deleted).
    """
    if chunk_bytes < 1:
        raise ValueError("chunk_bytes must be positive")
    chunk_bytes = min(chunk_bytes, MAX_SHARD_CHUNK)
    where = f"shard {uid} from {short(peer.peer_id)}"
    partial = _Partial(*partial_paths(dest), uid, expected_sha256)
    failures = 0
    restarts = 0
    fetched = 0
    rejoin = False  # the snapshot expired: are the peer's current bytes the same?
    started = trio.current_time()
    pace = trio.CancelScope()  # the deadline ``min_rate`` sets, moved on by each chunk
    try:
        await trio.to_thread.run_sync(partial.resume)
        if partial.kept:
            logger.info("%s: resuming at %d of %d bytes", where, partial.kept, partial.total)
        paced_from = started + queue_s  # the first reply's time once it came
        with pace:
            while True:
                if min_rate is not None:
                    pace.deadline = paced_from + grace_s + fetched / min_rate
                if partial.sha256 is not None and partial.offset == partial.total:
                    pace.deadline = math.inf  # all there: the check is not the peer's time
                    from_disk = partial.kept
                    if await trio.to_thread.run_sync(partial.finish, dest):
                        logger.info(
                            "%s: %d bytes, sha256 %.12s", where, partial.total, partial.sha256
                        )
                        return ShardResult(
                            uid,
                            partial.sha256,
                            partial.offset,
                            dest,
                            resumed_from=partial.kept,
                            fetched=fetched,
                            restarts=restarts,
                        )
                    if not from_disk:
                        raise ShardError(
                            f"{where}: the bytes received do not match their sha256",
                            resumable=False,
                        )
                    # Bytes left on disk by an earlier call were wrong: fetch everything.
                    logger.warning("%s: the partial file was damaged; downloading it again", where)
                    restarts = _restart(restarts, where)
                    continue
                if rejoin:  # a fresh snapshot's first bytes: its sha256 and total
                    request = ShardRequest(
                        uid=uid, offset=0, length=min(FIRST_CHUNK_BYTES, chunk_bytes, max_bytes)
                    )
                else:
                    request = ShardRequest(
                        uid=uid,
                        sha256=partial.sha256,
                        offset=partial.offset,
                        # Before the size is known, never ask for more than max_bytes.
                        length=min(chunk_bytes, partial.remaining(max_bytes)),
                    )
                try:
                    reply, body = await rpc.call_raw(
                        peer, Verb.SHARD, request, max_body_bytes=request.length
                    )
                except ReplyTooLarge as exc:  # more than asked for: a peer not to retry
                    raise ShardError(f"{where}: {exc}", resumable=True) from exc
                except RemoteError as exc:
                    if exc.code == "expired" and partial.sha256 is not None and not rejoin:
                        rejoin = True
                        continue
                    if exc.code not in _RETRY_CODES:
                        raise
                    failures = await _backoff(failures, retries, backoff_s, where, exc)
                    continue
                except (PeerError, BaseLibp2pError) as exc:  # a dropped stream or connection
                    failures = await _backoff(failures, retries, backoff_s, where, exc)
                    continue
                if rejoin:
                    rejoin = False
                    if (reply.sha256, reply.total) == (partial.sha256, partial.total):
                        # The same state gives the same bytes (a replica restarted from
                        # its checkpoint, or that took it again): the partial file stays.
                        # 151 MiB were downloaded again after such a restart.
                        logger.info(
                            "%s: snapshot expired on the peer, which serves the same bytes "
                            "again; resuming at %d of %d bytes",
                            where,
                            partial.offset,
                            partial.total,
                        )
                        continue
                    logger.info("%s: snapshot expired on the peer; starting again", where)
                    await trio.to_thread.run_sync(partial.reset)
                    restarts = _restart(restarts, where)
                _check_reply(reply, body, request, partial, where)
                if partial.sha256 is None:
                    if reply.total > max_bytes:
                        raise ShardError(
                            f"{where}: {reply.total} bytes, more than {max_bytes}", resumable=False
                        )
                    await trio.to_thread.run_sync(partial.start, reply.sha256, reply.total)
                await trio.to_thread.run_sync(partial.write, body)
                if not fetched:
                    paced_from = trio.current_time()
                fetched += body.nbytes
                failures = 0
                if on_chunk is not None:
                    on_chunk(partial.offset, reply.total)
        waited = trio.current_time() - started
        slow = ShardTooSlow(
            f"{where}: {fetched} bytes in {waited:.1f} s, slower than "
            f"{min_rate:.0f} bytes a second",
            fetched=fetched,
        )
        if fetched:
            raise slow
        raise slow from RequestTimeout(f"{where}: no reply within {waited:.1f} s")
    finally:
        partial.close()


async def fetch_shard(
    rpc: RpcClient,
    peer: PeerAddress,
    uid: str,
    *,
    max_bytes: int,
    chunk_bytes: int = 1 << 20,
    retries: int = 2,
    backoff_s: float = 0.25,
    on_chunk: Callable[[int, int], None] | None = None,
    first_reply_s: float | None = None,
) -> bytearray:
    """Download the snapshot ``uid`` from ``peer`` into memory and return its bytes.

    Like ``download_shard`` without a file: every chunk comes from one snapshot (the
    ``sha256`` of the first reply), a snapshot over ``max_bytes`` is refused from the
    first reply's ``total`` (that first chunk is at most ``max_bytes`` too), before more
    is asked for; memory grows with the bytes received, never with the size a peer
    declares; and the whole SHA-256 is checked at the end.
    A dropped stream, a timeout or a ``busy``/``rate_limited`` answer is retried
    ``retries`` times in a row (not one whose ``retry_after_s`` outlasts those retries);
    an ``expired`` snapshot starts the download again.
    ``on_chunk(received, total)`` is called after each chunk. Bound the whole call with
    ``trio.fail_after``.

    With ``first_reply_s``, the peer must answer (a chunk or an error) within that time
    of each request until it first has, and the first chunk asked for is at most
    ``FIRST_CHUNK_BYTES``: a record whose address accepts and never answers fails in
    seconds (RequestTimeout, not retried), where it held the whole call's deadline,
    and a peer with a large snapshot on a slow link is not cut short.

    Raises RemoteError (e.g. ``unknown_expert``), PeerError when the peer cannot be
    reached, and ShardError when it keeps failing, when its replies contradict each
    other or one declares more bytes than asked for (refused before they are read), when
    the snapshot is larger than ``max_bytes`` or its bytes do not match their SHA-256.
    """
    if chunk_bytes < 1:
        raise ValueError("chunk_bytes must be positive")
    chunk_bytes = min(chunk_bytes, MAX_SHARD_CHUNK)
    where = f"shard {uid} from {short(peer.peer_id)}"
    progress = _InMemory(uid)
    failures = restarts = 0
    answered = first_reply_s is None
    while progress.total is None or progress.offset < progress.total:
        # Before the size is known, never ask for more than max_bytes.
        length = min(chunk_bytes, progress.remaining(max_bytes))
        request = ShardRequest(
            uid=uid,
            sha256=progress.sha256,
            offset=progress.offset,
            length=length if answered else min(length, FIRST_CHUNK_BYTES),
        )
        try:
            with trio.move_on_after(math.inf if first_reply_s is None else first_reply_s) as first:
                reply, body = await rpc.call_raw(
                    peer, Verb.SHARD, request, max_body_bytes=request.length
                )
            if first.cancelled_caught:
                raise RequestTimeout(f"{where}: no answer within {first_reply_s:g} s")
        except ReplyTooLarge as exc:  # more than asked for: a peer not to retry
            raise ShardError(f"{where}: {exc}", resumable=False) from exc
        except RequestTimeout as exc:
            if not answered:
                raise
            failures = await _backoff(failures, retries, backoff_s, where, exc)
            continue
        except RemoteError as exc:
            answered = True
            if exc.code == "expired" and progress.sha256 is not None:
                logger.info("%s: snapshot expired on the peer; starting again", where)
                progress = _InMemory(uid)
                restarts = _restart(restarts, where)
                continue
            if exc.code not in _RETRY_CODES:
                raise
            failures = await _backoff(failures, retries, backoff_s, where, exc)
            continue
        except (PeerError, BaseLibp2pError) as exc:  # a dropped stream or connection
            failures = await _backoff(failures, retries, backoff_s, where, exc)
            continue
        if progress.sha256 is None and reply.total > max_bytes:
            too_large = f"{where}: {reply.total} bytes, more than {max_bytes}"
            raise ShardError(too_large, resumable=False)
        _check_reply(reply, body, request, progress, where)
        if progress.sha256 is None:
            progress.start(reply.sha256, reply.total)
        progress.write(body)
        failures, answered = 0, True
        if on_chunk is not None:
            on_chunk(progress.offset, reply.total)
    data = progress.finish()
    if await trio.to_thread.run_sync(_sha256_hex, data) != progress.sha256:
        raise ShardError(f"{where}: the bytes received do not match their sha256", resumable=False)
    return data


class _Progress(Protocol):
    """What ``_check_reply`` needs to know of a download in progress."""

    sha256: str | None
    total: int | None
    expected: str | None


class _InMemory:
    """``fetch_shard``'s download so far: the bytes received, in one buffer that grows
    with them. It is not allocated at the size the first reply declares: a peer that
    declares 1 GiB and then stalls would cost the downloader that memory (zero-filled
    while holding the GIL) for the price of one chunk."""

    def __init__(self, uid: str) -> None:
        self.uid = uid
        self.expected: str | None = None
        self.sha256: str | None = None
        self.total: int | None = None
        self.offset = 0
        self._buffer = bytearray()

    def remaining(self, default: int) -> int:
        return default if self.total is None else self.total - self.offset

    def start(self, sha256: str, total: int) -> None:
        self.sha256, self.total = sha256, total

    def write(self, data: memoryview) -> None:
        self._buffer += data  # chunks arrive in order: each at the current offset
        self.offset += data.nbytes

    def finish(self) -> bytearray:
        data, self._buffer = self._buffer, bytearray()
        return data


def _restart(restarts: int, where: str) -> int:
    if restarts >= _MAX_RESTARTS:
        raise ShardError(f"{where}: started again {restarts} times; giving up", resumable=False)
    return restarts + 1


async def _backoff(
    failures: int, retries: int, backoff_s: float, where: str, exc: BaseException
) -> int:
    if failures >= retries:
        raise ShardError(
            f"{where}: failed {failures + 1} times in a row: {exc}", resumable=True
        ) from exc
    # A refusal that says it lasts longer than every retry left would wait (a quota's
    # share used up until midnight): retrying only spends requests and time.
    later = getattr(exc, "retry_after_s", None)
    if later is not None and later > backoff_s * (2**retries - 2**failures):
        raise ShardError(f"{where}: {exc} (for {later:.0f} s)", resumable=True) from exc
    logger.info("%s: %s; retrying", where, str(exc) or type(exc).__name__)
    await trio.sleep(backoff_s * 2**failures)
    return failures + 1


def _check_reply(
    reply: ShardReply, body: memoryview, request: ShardRequest, partial: _Progress, where: str
) -> None:
    """Refuse a reply that does not continue the download it answers."""
    problem = None
    if reply.uid != request.uid:
        problem = f"reply for {reply.uid}"
    elif reply.length != body.nbytes:
        problem = f"header says {reply.length} bytes, body has {body.nbytes}"
    elif reply.offset != request.offset:
        problem = f"chunk at {reply.offset}, asked for {request.offset}"
    elif reply.length > request.length:
        problem = f"{reply.length} bytes, asked for at most {request.length}"
    elif reply.length < min(request.length, MIN_SHARD_REPLY) and reply.offset + reply.length < (
        reply.total
    ):
        # A server sends what was asked for, up to its cap (MAX_SHARD_CHUNK) and the end:
        # a peer answering a byte a request made a trainer spend a whole RPC of its
        # node's loop on each byte, halving its training speed while it fetched (an
        # outside probe: ~1,500 requests an attempt).
        problem = f"{reply.length} bytes before the end, asked for {request.length}"
    elif partial.sha256 is not None and reply.sha256 != partial.sha256:
        problem = f"snapshot {reply.sha256[:12]}, asked for {partial.sha256[:12]}"
    elif partial.total is not None and reply.total != partial.total:
        problem = f"{reply.total} bytes in all, earlier {partial.total}"
    elif partial.expected is not None and reply.sha256 != partial.expected:
        problem = f"serves snapshot {reply.sha256[:12]}, expected {partial.expected[:12]}"
    if problem is not None:
        raise ShardError(f"{where}: {problem}", resumable=True)


class _Partial:
    """The unfinished download on disk: bytes so far, the sidecar naming their snapshot,
    and the running SHA-256 of those bytes. Blocking calls: run them in a thread."""

    def __init__(self, path: Path, sidecar: Path, uid: str, expected: str | None) -> None:
        self.path = path
        self.sidecar = sidecar
        self.uid = uid
        self.expected = expected
        self.sha256: str | None = None
        self.total: int | None = None
        self.offset = 0
        self.kept = 0  # bytes found on disk and kept for this round
        self._digest = hashlib.sha256()
        self._fd: int | None = None

    def remaining(self, default: int) -> int:
        return default if self.total is None else self.total - self.offset

    def resume(self) -> None:
        """Take up the bytes an earlier call left, if the sidecar vouches for them."""
        try:
            side = _Sidecar.model_validate_json(read_small(self.sidecar, STATE_MAX_BYTES))
            size = self.path.stat().st_size
        except (OSError, ValidationError, ValueError):
            self.reset()
            return
        if (
            side.uid != self.uid
            or size > side.total
            or (self.expected is not None and side.sha256 != self.expected)
        ):
            self.reset()
            return
        digest = hashlib.sha256()
        with self.path.open("rb") as f:
            while block := f.read(_HASH_BLOCK):
                digest.update(block)
        self._fd, self._digest = os.open(self.path, os.O_RDWR), digest
        self.sha256, self.total, self.offset, self.kept = side.sha256, side.total, size, size

    def start(self, sha256: str, total: int) -> None:
        """Begin the snapshot ``sha256`` of ``total`` bytes: sidecar first, then data."""
        self.reset()
        side = _Sidecar(uid=self.uid, sha256=sha256, total=total)
        write_atomic(self.sidecar, side.model_dump_json())
        self._fd = os.open(self.path, os.O_RDWR | os.O_CREAT | os.O_TRUNC, 0o600)
        self.sha256, self.total = sha256, total

    def _open_fd(self) -> int:
        if self._fd is None:
            raise RuntimeError(f"{self.path}: no download in progress (start or resume first)")
        return self._fd

    def write(self, data: memoryview) -> None:
        fd = self._open_fd()
        view = data
        while view.nbytes:
            written = os.pwrite(fd, view, self.offset + (data.nbytes - view.nbytes))
            view = view[written:]
        self._digest.update(data)
        self.offset += data.nbytes

    def finish(self, dest: Path) -> bool:
        """Rename the complete file to ``dest`` if its SHA-256 is right; else delete it
        and return False."""
        fd = self._open_fd()
        if self._digest.hexdigest() != self.sha256:
            self.reset()
            return False
        os.fsync(fd)
        self.close()
        os.replace(self.path, dest)
        fsync_dir(dest.parent)
        self.sidecar.unlink(missing_ok=True)
        return True

    def reset(self) -> None:
        """Forget the bytes so far, on disk too."""
        self.close()
        self.path.unlink(missing_ok=True)
        self.sidecar.unlink(missing_ok=True)
        self.sha256 = self.total = None
        self.offset = self.kept = 0
        self._digest = hashlib.sha256()

    def close(self) -> None:
        if self._fd is not None:
            os.close(self._fd)
            self._fd = None
