"""A newcomer's download of an expert's current state from a live replica.

The replica serves its state as a checkpoint file over the ``shard`` verb
(``net.shard``: chunked, SHA-256-checked, resumable); the file lands in the downloads
folder, is read back with the checkpoint reader (header and payload checksums, schema)
and is deleted once loaded. The SHA-256 of every file downloaded is kept by uid for
logs and tests.

Before each download, and when the daemon starts, what earlier downloads left behind
long ago is deleted (``net.shard.sweep_downloads``), and a joiner that gives up on an
expert's replicas deletes what their downloads left (``discard``): partial files of up
to four times the weights, kept for an hour, took the disk budget from the checkpoints
(an outside probe: every save skipped).

A replica must keep sending: its bytes at ``MIN_REPLY_RATE`` at least after
``FIRST_REPLY_S`` (as for replica averaging), else the download fails at once
(``download_shard``'s ``min_rate``: ShardTooSlow, the partial file kept). Its first
reply may also wait ``BULK_QUEUE_S`` in the replica's queue for bulk replies: a
replica answers ``BULK_AT_ONCE`` (4) shard and params requests at once and keeps the
others waiting their turn. Counting that wait in the 5 s failed every newcomer beyond
the fourth at a seed (an outside audit: 59 of 72 experts of 12 joiners seeded).

The whole download is bounded too, by the time its bytes take at that least rate
(``download_bound_s``): ``download_s`` (10 request timeouts, 600 s by default) plus
the queue, the grace and the expert's snapshot (its weights: a replica serves no
optimizer state, ``server.pipeline.shard_snapshot``) at ``MIN_REPLY_RATE``. The 600 s
alone, whatever the size, cut a trained expert of width 2048 (403 MB with Adam's
moments) at 141 MiB over a 2 Mbit/s uplink, every try (an outside audit); an expert
of width 2048 now has ~80 min, one of width 256 (2 MB) ~12 min.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass
from pathlib import Path

import trio

from volunteerd.config import TimeoutsConfig
from volunteerd.errors import CheckpointError
from volunteerd.experts import ExpertBackend
from volunteerd.experts.checkpoint_file import ExpertState, read_checkpoint
from volunteerd.net import PeerAddress, RpcClient
from volunteerd.net.shard import ShardResult, download_shard, partial_paths, sweep_downloads
from volunteerd.runtime.averaging import FIRST_REPLY_S, MIN_REPLY_RATE
from volunteerd.shown import span

__all__ = ["BULK_QUEUE_S", "DownloadProgress", "ShardDownloader"]

logger = logging.getLogger(__name__)

# How long a replica keeps a shard request waiting for one of its bulk slots before it
# answers ``busy``: ``net.rpc`` waits half of its ``timeouts.request_s`` (which has no
# constant of its own), 30 s with the defaults. A replica's timeouts are its own; the
# defaults are what a newcomer can expect.
BULK_QUEUE_S = TimeoutsConfig().request_s / 2


@dataclass(frozen=True, slots=True)
class DownloadProgress:
    """A download under way: ``received`` of its ``total`` bytes (with those an earlier
    try left on disk), at ``rate`` bytes a second since its first chunk (0 until a
    second chunk came)."""

    uid: str
    received: int
    total: int
    rate: float

    def shown(self) -> str:
        """For the volunteer: "downloading ffn.3.1: 41 of 72 MiB at 2.0 Mbit/s, ~2 min
        left"."""
        done = f"downloading {self.uid}: {self.received >> 20} of {self.total >> 20} MiB"
        if self.rate <= 0:
            return done
        left = span((self.total - self.received) / self.rate)
        return f"{done} at {self.rate * 8 / 1e6:.1f} Mbit/s, ~{left} left"


class ShardDownloader:
    """Downloads into ``directory`` through ``rpc``; a whole download is bounded by
    ``download_bound_s``, ``download_s`` at least. ``progress(uid)`` tells how one
    under way goes."""

    def __init__(self, rpc: RpcClient, directory: Path, download_s: float) -> None:
        self._rpc = rpc
        self._directory = directory
        self._download_s = download_s
        self.results: dict[str, ShardResult] = {}  # uid -> its last completed download
        self._under_way: dict[str, DownloadProgress] = {}

    @classmethod
    def for_node(cls, rpc: RpcClient, directory: Path, timeouts: TimeoutsConfig) -> ShardDownloader:
        # A shard is many requests: several request timeouts at least, whatever its size.
        return cls(rpc, directory, 10 * timeouts.request_s)

    def download_bound_s(self, backend: ExpertBackend) -> float:
        """How long a download of ``backend``'s state may take in all: ``download_s``,
        plus the queue and the grace before the first reply, plus its snapshot's bytes
        (the weights and a MiB for the header) at ``MIN_REPLY_RATE``. A replica that
        keeps up with that rate finishes within it; one that does not is cut sooner by
        the rate itself."""
        snapshot = backend.weights_bytes() + (1 << 20)
        return self._download_s + BULK_QUEUE_S + FIRST_REPLY_S + snapshot / MIN_REPLY_RATE

    def progress(self, uid: str) -> DownloadProgress | None:
        """How the download of ``uid`` goes, while one is under way."""
        return self._under_way.get(uid)

    async def download(self, peer: PeerAddress, backend: ExpertBackend) -> ExpertState:
        """``peer``'s state of ``backend.uid``, read from the downloaded file. Raises
        what ``download_shard`` raises (ShardTooSlow, its partial file kept for the
        next call), trio.TooSlowError past ``download_bound_s`` (kept too), and
        CheckpointError for a file that is not this expert's state."""
        uid = backend.uid
        await trio.to_thread.run_sync(sweep_downloads, self._directory)
        await trio.to_thread.run_sync(lambda: self._directory.mkdir(parents=True, exist_ok=True))
        dest = self._directory / f"{uid}.ckpt"
        first: tuple[float, int] | None = None  # trio time and offset of the first chunk

        def on_chunk(received: int, total: int) -> None:
            nonlocal first
            now = trio.current_time()
            if first is None or received < first[1]:  # started again: counted afresh
                first = (now, received)
            took = now - first[0]
            rate = (received - first[1]) / took if took > 0 else 0.0
            self._under_way[uid] = DownloadProgress(uid, received, total, rate)

        try:
            with trio.fail_after(self.download_bound_s(backend)):
                result = await download_shard(
                    self._rpc,
                    peer,
                    uid,
                    dest,
                    max_bytes=backend.largest_state_bytes(),
                    on_chunk=on_chunk,
                    min_rate=MIN_REPLY_RATE,
                    grace_s=FIRST_REPLY_S,
                    queue_s=BULK_QUEUE_S,
                )
        finally:
            self._under_way.pop(uid, None)
        try:
            state = await trio.to_thread.run_sync(read_checkpoint, dest)
        finally:
            await trio.to_thread.run_sync(lambda: dest.unlink(missing_ok=True))
        if state.uid != uid:
            raise CheckpointError(f"{peer} sent the state of {state.uid!r} for {uid!r}")
        self.results[uid] = result
        logger.debug("%s: %d bytes from %s, sha256 %.12s", uid, result.size, peer, result.sha256)
        return state

    async def discard(self, uid: str) -> None:
        """Delete what downloads of ``uid`` left unfinished (no replica will finish it)."""

        def delete() -> None:
            for path in partial_paths(self._directory / f"{uid}.ckpt"):
                try:
                    path.unlink(missing_ok=True)
                except OSError as exc:
                    logger.warning("%s: not deleted (%s)", path, exc)

        await trio.to_thread.run_sync(delete)
