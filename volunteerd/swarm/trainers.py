"""Trainers of one experiment on the network: finding each other, serving and fetching
the trainer-side state (docs/protocol.md, "Trainers").

Every trainer of an experiment announces one DHT key, its **rendezvous key**: the
manifest's ``rendezvous`` when it names one, else ``rendezvous_key(experiment name)``.
``peers()`` lists the other trainers announcing it now. A trainer publishes its state
(``publish``, from the torch thread) and serves it to the others over the ``shard``
verb, under two uids:

* ``trainer.0`` (``TRAINER_PARAMS_UID``): the trainer-side parameters only; what an
  averaging round fetches from each peer (``fetch_params``, into memory);
* ``trainer.1`` (``TRAINER_STATE_UID``): parameters and optimizer state; what a late
  joiner downloads (``download_state``, to a file, resumable).

Both are expert checkpoints (``experts/checkpoint_file.py``) with
``expert_type="trainer"``. The ``trainer-info`` verb answers the trainer's latest
``TrainerInfo`` (version, tokens, rate, rounds, data shard) to trainers of the same
experiment only.

Every call to another trainer is bounded by its ``timeout_s`` and raises a
``VolunteerdError`` (``PeerError`` and its subclasses) for every failure, so a peer that
is slow, gone or lying costs one caller at most ``timeout_s`` and is left out.
"""

from __future__ import annotations

import hashlib
import logging
import threading
from collections.abc import Awaitable, Callable
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, TypeVar

import trio

from volunteerd.config import Config
from volunteerd.errors import (
    Busy,
    CheckpointError,
    PeerUnreachable,
    RequestTimeout,
    ShuttingDown,
    TrainerStateError,
    UnknownExpert,
    VolunteerdError,
)
from volunteerd.experts.checkpoint_file import (
    ExpertState,
    decode_checkpoint,
    encode_checkpoint,
    read_checkpoint,
)
from volunteerd.net import Node
from volunteerd.net.announce import Announcer
from volunteerd.net.peers import PeerAddress, short
from volunteerd.net.protocols import Verb
from volunteerd.net.rpc import Handler, Reply, Request
from volunteerd.net.shard import ShardServer, download_shard, fetch_shard
from volunteerd.runtime.averaging import FIRST_REPLY_S, MIN_REPLY_RATE
from volunteerd.uids import is_valid_uid
from volunteerd.wire import TrainerInfo, TrainerInfoRequest

if TYPE_CHECKING:
    # trio's TaskStatus as libp2p's trio-typing stubs spell it
    from trio_typing import TaskStatus

__all__ = [
    "TRAINER_EXPERT_TYPE",
    "TRAINER_PARAMS_UID",
    "TRAINER_STATE_UID",
    "TrainerInfo",
    "TrainerNetStats",
    "TrainerPeer",
    "TrainerSwarm",
    "rendezvous_key",
]

logger = logging.getLogger(__name__)

TRAINER_PARAMS_UID = "trainer.0"
TRAINER_STATE_UID = "trainer.1"
TRAINER_EXPERT_TYPE = "trainer"
_CHUNK_BYTES = 1 << 20
# Every publish makes new snapshots: a finished download's bytes go soon, while one
# in progress (a request at least every _IN_USE_S) keeps its snapshot.
_KEEP_IDLE_S = 30.0
_IN_USE_S = 20.0

T = TypeVar("T")


def rendezvous_key(experiment_name: str) -> str:
    """The DHT key the trainers of ``experiment_name`` announce when the manifest names
    none: a valid uid derived from the name (``trainers_<20 hex of its SHA-256>.0``),
    the same on every machine."""
    digest = hashlib.sha256(experiment_name.encode()).hexdigest()[:20]
    return f"trainers_{digest}.0"


@dataclass(frozen=True, slots=True)
class TrainerPeer:
    """Another trainer of the experiment, as its record in the DHT names it."""

    peer_id: str
    addrs: tuple[str, ...]

    @property
    def address(self) -> PeerAddress:
        return PeerAddress(self.peer_id, self.addrs)


@dataclass(frozen=True, slots=True)
class TrainerNetStats:
    """What a TrainerSwarm has moved: state and info bytes sent to other trainers and
    received from them, snapshots taken for them and info requests answered."""

    bytes_sent: int
    bytes_received: int
    snapshots_served: int
    infos_served: int


@dataclass(frozen=True, slots=True)
class _Published:
    generation: int
    state: ExpertState
    info: TrainerInfo


class TrainerSwarm:
    """One trainer's side of its experiment's trainers, on ``node``.

    ``experiment``: the experiment's name (``TrainerInfoRequest.experiment``);
    ``key``: the rendezvous key (a valid uid); ``config``: the node's configuration
    (its ``dht`` and ``timeouts`` sections drive the announcements; defaults when None).
    Start ``serve`` in the node's trio loop; the other methods run there too, except
    ``publish`` and ``statistics``, which any thread may call.
    """

    def __init__(
        self,
        node: Node,
        experiment: str,
        key: str,
        config: Config | None = None,
        *,
        chunk_bytes: int = _CHUNK_BYTES,
        max_cache_bytes: int = 1 << 30,
    ) -> None:
        if not is_valid_uid(key):
            raise ValueError(f"rendezvous key {key!r} is not a valid uid (e.g. 'trainers.0')")
        TrainerInfoRequest(experiment=experiment)  # a name the wire carries, or ValueError
        self._node = node
        self._experiment = experiment
        self._key = key
        self._config = config or Config()
        self._chunk_bytes = chunk_bytes
        self._lock = threading.Lock()
        self._published: _Published | None = None
        # uid -> (generation, encoded bytes): one encoding per publish and uid.
        self._encoded: dict[str, tuple[int, bytes]] = {}
        self._encoding = trio.Lock()
        self._shards = ShardServer(
            self._snapshot,
            reuse_s=0.0,  # always the latest published state; unchanged bytes are one entry
            keep_idle_s=_KEEP_IDLE_S,
            in_use_s=_IN_USE_S,
            max_cache_bytes=max_cache_bytes,
        )
        self._serving = False
        self._bytes_received = 0
        self._info_bytes_sent = 0
        self._infos_served = 0

    @property
    def key(self) -> str:
        return self._key

    @property
    def experiment(self) -> str:
        return self._experiment

    # -- serving --------------------------------------------------------------------

    def handlers(self) -> dict[Verb, Handler]:
        """``shard`` (``trainer.0`` / ``trainer.1``) and ``trainer-info``."""
        return {Verb.SHARD: self._handle_shard, Verb.TRAINER_INFO: self._handle_info}

    async def serve(self, *, task_status: TaskStatus[None] = trio.TASK_STATUS_IGNORED) -> None:
        """Serve this trainer's verbs on the node and announce the rendezvous key until
        cancelled; then withdraw the announcement (shielded, within the timeouts'
        ``shutdown_grace_s``) and answer ``shutting_down``. Ready (``started``) once the
        first announcement was made. Requests arriving before the first ``publish`` are
        refused (``unknown_expert`` for state, ``busy`` for info). Raises ValueError when
        the node serves one of the verbs already (one TrainerSwarm per node)."""
        node = self._node
        node.server.add(self.handlers())
        announcer = Announcer(
            node.dht,
            node.identity,
            node.peer_id,
            node.addrs,
            self._config.dht,
            self._config.timeouts,
        )
        announcer.set_uids([self._key])
        self._serving = True
        try:
            async with trio.open_nursery() as nursery:
                nursery.start_soon(self._refuse_when_cancelled)
                await nursery.start(self._shards.serve)
                await nursery.start(announcer.serve)
                logger.info("trainer %s announced under %s", short(node.peer_id), self._key)
                task_status.started()
        finally:
            self._serving = False
            self._shards.clear()

    async def _refuse_when_cancelled(self) -> None:
        # Stop handing out state at once, not after the announcer's withdrawal.
        try:
            await trio.sleep_forever()
        finally:
            self._serving = False

    def publish(self, state: ExpertState, info: TrainerInfo) -> None:
        """Serve ``state`` (CPU tensors no one changes any more: copies) and ``info``
        from now on. Thread-safe: the torch thread calls it."""
        if info.experiment != self._experiment:
            raise ValueError(f"info of experiment {info.experiment!r}, not {self._experiment!r}")
        with self._lock:
            generation = 1 if self._published is None else self._published.generation + 1
            self._published = _Published(generation, state, info)

    def _latest(self) -> _Published | None:
        with self._lock:
            return self._published

    async def _handle_shard(self, request: Request) -> Reply:
        self._check_serving()
        return await self._shards.handle(request)

    async def _handle_info(self, request: Request) -> Reply:
        self._check_serving()
        asked: TrainerInfoRequest = request.header
        if asked.experiment != self._experiment:
            raise UnknownExpert(f"this trainer trains another experiment, not {asked.experiment!r}")
        published = self._latest()
        if published is None:
            raise Busy("this trainer has published nothing yet")
        self._infos_served += 1
        self._info_bytes_sent += len(published.info.model_dump_json())
        return Reply(published.info)

    def _check_serving(self) -> None:
        if not self._serving:
            raise ShuttingDown("this trainer is not serving its state")

    async def _snapshot(self, uid: str) -> bytes:
        """The ShardServer's callback: the latest published state as checkpoint bytes,
        encoded once per publish (in a worker thread)."""
        if uid not in (TRAINER_PARAMS_UID, TRAINER_STATE_UID):
            raise UnknownExpert(f"{uid}: a trainer serves only {TRAINER_PARAMS_UID} and "
                                f"{TRAINER_STATE_UID}")  # fmt: skip
        published = self._latest()
        if published is None:  # not retried by the asker: it picks another trainer
            raise UnknownExpert(f"{uid}: this trainer has published no state yet")
        async with self._encoding:
            cached = self._encoded.get(uid)
            if cached is not None and cached[0] == published.generation:
                return cached[1]
            data = await trio.to_thread.run_sync(_encode, uid, published.state)
            self._encoded[uid] = (published.generation, data)
            return data

    def statistics(self) -> TrainerNetStats:
        shards = self._shards.statistics()
        return TrainerNetStats(
            bytes_sent=shards.bytes_out + self._info_bytes_sent,
            bytes_received=self._bytes_received,
            snapshots_served=shards.snapshots + shards.reused,
            infos_served=self._infos_served,
        )

    # -- other trainers ---------------------------------------------------------------

    async def peers(self) -> list[TrainerPeer]:
        """The other trainers announcing the rendezvous key now (not this one)."""
        records = (await self._node.dht.get([self._key]))[self._key]
        seen: dict[str, TrainerPeer] = {}
        for record in records:
            if record.peer_id != self._node.peer_id and record.peer_id not in seen:
                seen[record.peer_id] = TrainerPeer(record.peer_id, tuple(record.addrs))
        return list(seen.values())

    async def info(self, peer: TrainerPeer, timeout_s: float) -> TrainerInfo:
        """``peer``'s latest info. Raises RequestTimeout after ``timeout_s``, PeerError
        (RemoteError, PeerUnreachable, ...) when it fails or refuses, TrainerStateError
        when it answers for another experiment."""

        async def ask() -> TrainerInfo:
            reply, _ = await self._node.rpc.call(
                peer.address, Verb.TRAINER_INFO, TrainerInfoRequest(experiment=self._experiment)
            )
            info: TrainerInfo = reply
            self._bytes_received += len(info.model_dump_json())
            if info.experiment != self._experiment:
                raise TrainerStateError(
                    f"trainer {short(peer.peer_id)} answered for experiment {info.experiment!r}"
                )
            return info

        return await self._bounded(f"trainer-info from {short(peer.peer_id)}", timeout_s, ask)

    async def fetch_params(
        self,
        peer: TrainerPeer,
        timeout_s: float,
        max_bytes: int,
        *,
        first_reply_s: float | None = None,
    ) -> ExpertState:
        """``peer``'s published parameters (``trainer.0``), downloaded into memory.

        Raises RequestTimeout after ``timeout_s``, or after ``first_reply_s`` when the
        peer has not answered by then (``fetch_shard``); ShardError when the snapshot is over
        ``max_bytes`` (refused before it is downloaded) or its bytes do not match their
        SHA-256; RemoteError/PeerError when the peer refuses or cannot be reached;
        TrainerStateError when the bytes are not a trainer's parameters."""
        where = f"{TRAINER_PARAMS_UID} from {short(peer.peer_id)}"
        received = 0

        def on_chunk(offset: int, total: int) -> None:
            nonlocal received
            self._bytes_received += offset - received
            received = offset

        async def fetch() -> ExpertState:
            data = await fetch_shard(
                self._node.rpc,
                peer.address,
                TRAINER_PARAMS_UID,
                max_bytes=max_bytes,
                chunk_bytes=self._chunk_bytes,
                on_chunk=on_chunk,
                first_reply_s=first_reply_s,
            )
            state = await _decode(data, where)
            return _checked(state, TRAINER_PARAMS_UID, where)

        return await self._bounded(where, timeout_s, fetch)

    async def download_state(
        self, peer: TrainerPeer, dest: Path, timeout_s: float, max_bytes: int
    ) -> ExpertState:
        """``peer``'s full published state (``trainer.1``: parameters and optimizer
        state), downloaded to ``dest`` and read back. The download is resumable: after a
        failure, a later call for the same ``dest`` and peer resumes from the partial file
        (``net.shard.partial_paths``) if the peer still keeps that snapshot.

        Raises as ``fetch_params`` does."""
        where = f"{TRAINER_STATE_UID} from {short(peer.peer_id)}"
        received = 0

        def on_chunk(offset: int, total: int) -> None:
            nonlocal received
            self._bytes_received += max(0, offset - received)
            received = offset

        async def download() -> ExpertState:
            await download_shard(
                self._node.rpc,
                peer.address,
                TRAINER_STATE_UID,
                dest,
                chunk_bytes=self._chunk_bytes,
                max_bytes=max_bytes,
                on_chunk=on_chunk,
                # it must keep sending, as a replica must: one that sent 100 bytes and
                # stalled held a late joiner's start for the whole timeout_s x 4, each
                # attempt (an outside probe: 40 s at timeout_s 10; 120 s by default)
                min_rate=MIN_REPLY_RATE,
                grace_s=FIRST_REPLY_S,
            )
            try:
                state = await trio.to_thread.run_sync(read_checkpoint, dest)
            except (CheckpointError, OSError) as exc:
                raise TrainerStateError(f"{where}: {exc}") from None
            return _checked(state, TRAINER_STATE_UID, where)

        return await self._bounded(where, timeout_s, download)

    async def _bounded(self, where: str, timeout_s: float, call: Callable[[], Awaitable[T]]) -> T:
        """``call()`` within ``timeout_s``; every failure a VolunteerdError."""
        try:
            with trio.fail_after(timeout_s):
                return await call()
        except trio.TooSlowError:
            raise RequestTimeout(f"{where}: not done within {timeout_s:g}s") from None
        except VolunteerdError:
            raise
        except (OSError, trio.BrokenResourceError, trio.ClosedResourceError) as exc:
            raise PeerUnreachable(f"{where}: {exc!r}") from None


def _encode(uid: str, state: ExpertState) -> bytes:
    """The published state as the checkpoint served under ``uid``: parameters only for
    ``trainer.0``, with the optimizer state for ``trainer.1``."""
    served = ExpertState(
        uid=uid,
        expert_type=TRAINER_EXPERT_TYPE,
        hidden_dim=state.hidden_dim,
        optimizer=state.optimizer,
        updates=state.updates,
        params=state.params,
        optimizer_state=state.optimizer_state if uid == TRAINER_STATE_UID else {},
    )
    return b"".join(encode_checkpoint(served))


async def _decode(data: bytearray, where: str) -> ExpertState:
    try:
        return await trio.to_thread.run_sync(decode_checkpoint, data, where)
    except CheckpointError as exc:
        raise TrainerStateError(str(exc)) from None


def _checked(state: ExpertState, uid: str, where: str) -> ExpertState:
    """Refuse a checkpoint that is not the trainer state asked for."""
    if state.uid != uid or state.expert_type != TRAINER_EXPERT_TYPE:
        raise TrainerStateError(
            f"{where}: holds {state.expert_type!r} state {state.uid!r}, not a trainer's {uid}"
        )
    if uid == TRAINER_PARAMS_UID and state.optimizer_state:
        raise TrainerStateError(f"{where}: parameters came with optimizer state")
    return state
