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
(``download_shard``'s ``min_rate``); the whole is still bounded by ``download_s``. Its
first reply may also wait ``BULK_QUEUE_S`` in the replica's queue for bulk replies: a
replica answers ``BULK_AT_ONCE`` (4) shard and params requests at once and keeps the
others waiting their turn. Counting that wait in the 5 s failed every newcomer beyond
the fourth at a seed (an outside audit: 59 of 72 experts of 12 joiners seeded).
"""

from __future__ import annotations

import logging
from pathlib import Path

import trio

from volunteerd.config import TimeoutsConfig
from volunteerd.errors import CheckpointError
from volunteerd.experts import ExpertBackend
from volunteerd.experts.checkpoint_file import ExpertState, read_checkpoint
from volunteerd.net import PeerAddress, RpcClient
from volunteerd.net.shard import ShardResult, download_shard, partial_paths, sweep_downloads
from volunteerd.runtime.averaging import FIRST_REPLY_S, MIN_REPLY_RATE

__all__ = ["BULK_QUEUE_S", "ShardDownloader"]

logger = logging.getLogger(__name__)

# How long a replica keeps a shard request waiting for one of its bulk slots before it
# answers ``busy``: ``net.rpc`` waits half of its ``timeouts.request_s`` (which has no
# constant of its own), 30 s with the defaults. A replica's timeouts are its own; the
# defaults are what a newcomer can expect.
BULK_QUEUE_S = TimeoutsConfig().request_s / 2


class ShardDownloader:
    """Downloads into ``directory`` through ``rpc``; a whole download is bounded by
    ``download_s``."""

    def __init__(self, rpc: RpcClient, directory: Path, download_s: float) -> None:
        self._rpc = rpc
        self._directory = directory
        self._download_s = download_s
        self.results: dict[str, ShardResult] = {}  # uid -> its last completed download

    @classmethod
    def for_node(cls, rpc: RpcClient, directory: Path, timeouts: TimeoutsConfig) -> ShardDownloader:
        # A shard is many requests; allow several request timeouts for the whole.
        return cls(rpc, directory, 10 * timeouts.request_s)

    async def download(self, peer: PeerAddress, backend: ExpertBackend) -> ExpertState:
        uid = backend.uid
        await trio.to_thread.run_sync(sweep_downloads, self._directory)
        await trio.to_thread.run_sync(lambda: self._directory.mkdir(parents=True, exist_ok=True))
        dest = self._directory / f"{uid}.ckpt"
        with trio.fail_after(self._download_s):
            result = await download_shard(
                self._rpc,
                peer,
                uid,
                dest,
                max_bytes=backend.largest_state_bytes(),
                min_rate=MIN_REPLY_RATE,
                grace_s=FIRST_REPLY_S,
                queue_s=BULK_QUEUE_S,
            )
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
