"""The composition root: builds every service from the config and runs them in order.

Start order: identity -> device -> expert runtime (weights from the newest good
checkpoints) -> libp2p node (host, Kademlia, verbs) -> announcer, checkpointer and
replica averager. Stop order is the reverse and gentle: withdraw the experts from the
DHT, stop taking requests, let queued ones finish (bounded by ``shutdown_grace_s``),
save the changed experts, then close the node.
"""

from __future__ import annotations

import logging
import os
import sqlite3
import time
from collections.abc import AsyncIterator, Awaitable, Callable, Iterator
from contextlib import asynccontextmanager, contextmanager
from dataclasses import dataclass
from functools import partial
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch
import trio

from volunteerd import __version__
from volunteerd.config import Config
from volunteerd.control.server import serve_control
from volunteerd.errors import ResourceUnavailable, VolunteerdError, wire_code
from volunteerd.experts import ExpertBackend, to_wire
from volunteerd.experts.checkpoint_file import encode_checkpoint
from volunteerd.identity import Identity, load_or_create_identity
from volunteerd.net import (
    Announcer,
    Handler,
    Node,
    PeerAddress,
    Reply,
    Request,
    Verb,
    open_node,
)
from volunteerd.net.shard import ShardServer, Snapshot
from volunteerd.net.throttle import Throttle, TransferLedger
from volunteerd.paths import Paths
from volunteerd.runtime import ExpertRuntime, choose_device
from volunteerd.runtime.averaging import ReplicaAverager
from volunteerd.runtime.checkpointer import Checkpointer
from volunteerd.server.contribution import Accountant
from volunteerd.server.control_view import DaemonControls
from volunteerd.server.pausing import Volunteer
from volunteerd.stats import StatsStore
from volunteerd.swarm.download import ShardDownloader
from volunteerd.swarm.joiner import Joiner, capacity_for
from volunteerd.wire import (
    BackwardRequest,
    BatchReply,
    ErrorReply,
    ForwardRequest,
    TensorReply,
    WireTensor,
)
from volunteerd.wire.messages import ParamsReply, ParamsRequest

if TYPE_CHECKING:
    # trio's TaskStatus as libp2p's trio-typing stubs spell it
    from trio_typing import TaskStatus

__all__ = ["Daemon", "bootstrap_only", "expert_handlers"]

logger = logging.getLogger(__name__)


@contextmanager
def data_dir_lock(path: Path) -> Iterator[None]:
    """Hold an exclusive lock on ``path`` while a node uses its data folder.

    Two nodes sharing one data folder would share one identity (and, later, its
    checkpoints and statistics); the second one to start gets ResourceUnavailable. The
    operating system releases the lock when the process dies, even by SIGKILL.
    """
    path.parent.mkdir(parents=True, exist_ok=True)
    fd = os.open(path, os.O_RDWR | os.O_CREAT, 0o600)
    try:
        try:
            _lock(fd)
        except OSError:
            raise ResourceUnavailable(
                f"another volunteerd is using {path.parent} (use --data-dir for a second node)"
            ) from None
        os.ftruncate(fd, 0)
        os.write(fd, f"{os.getpid()}\n".encode())
        yield
    finally:
        os.close(fd)


if os.name == "posix":
    import fcntl

    def _lock(fd: int) -> None:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)

else:  # pragma: no cover - Windows
    import msvcrt

    def _lock(fd: int) -> None:
        msvcrt.locking(fd, msvcrt.LK_NBLCK, 1)  # type: ignore[attr-defined]


def expert_handlers(
    runtime: ExpertRuntime,
    shards: ShardServer | None = None,
    accountant: Accountant | None = None,
) -> dict[Verb, Handler]:
    """Bind the runtime's calls to the expert verbs (``shard`` to ``shards``, if given;
    start its ``serve`` so idle snapshots are freed). Each forward and backward call is
    reported to ``accountant``, answered or refused."""

    async def counted(
        kind: str, uid: str, peer: str, tensors: list[WireTensor], call: Awaitable[Result]
    ) -> Result:
        try:
            header, buffers = await call
        except VolunteerdError as exc:
            if accountant is not None:
                accountant.refused(uid, peer, exc)
            raise
        if accountant is not None:
            accountant.served(kind, uid, peer, tensors, Reply(header, buffers))
        return header, buffers

    async def forward_one(item: ForwardRequest, tensors: list[WireTensor], peer: str) -> Result:
        call = runtime.forward(
            item.uid, tensors, retain=item.retain, peer_id=peer, compression=item.compression
        )
        return await counted("forward", item.uid, peer, tensors, call)

    async def backward_one(item: BackwardRequest, tensors: list[WireTensor], peer: str) -> Result:
        call = runtime.backward(
            item.uid, tensors, handle=item.handle, peer_id=peer, compression=item.compression
        )
        return await counted("backward", item.uid, peer, tensors, call)

    async def forward(request: Request) -> Reply:
        return Reply(*await forward_one(request.header, request.tensors, request.peer_id))

    async def backward(request: Request) -> Reply:
        return Reply(*await backward_one(request.header, request.tensors, request.peer_id))

    async def info(request: Request) -> Reply:
        return Reply(runtime.info(request.header.uid))

    async def forward_batch(request: Request) -> Reply:
        return await _batch(forward_one, request)

    async def backward_batch(request: Request) -> Reply:
        return await _batch(backward_one, request)

    async def params(request: Request) -> Reply:
        uid = request.header.uid

        def read(backend: ExpertBackend) -> Reply:
            # Encoded in the worker's turn: one consistent copy, between optimizer steps.
            named = [(name, *to_wire(p)) for name, p in backend.live_parameters().items()]
            header = ParamsReply(
                uid=uid,
                updates=backend.updates,
                names=[name for name, _, _ in named],
                tensors=[meta for _, meta, _ in named],
            )
            return Reply(header, [data for _, _, data in named])

        return await runtime.with_expert(uid, read)

    return {
        Verb.FORWARD: forward,
        Verb.BACKWARD: backward,
        Verb.INFO: info,
        Verb.FORWARD_BATCH: forward_batch,
        Verb.BACKWARD_BATCH: backward_batch,
        Verb.PARAMS: params,
        Verb.SHARD: (shards or ShardServer(shard_snapshot(runtime))).handle,
    }


def shard_snapshot(runtime: ExpertRuntime) -> Snapshot:
    """The ``shard`` verb's snapshots: an expert's state encoded as a checkpoint file."""

    async def snapshot(uid: str) -> bytes:
        # Copied in the worker's turn (consistent, between optimizer steps), encoded in
        # another thread so the worker goes back to batches at once.
        state = await runtime.with_expert(uid, lambda backend: backend.state())
        return await trio.to_thread.run_sync(lambda: b"".join(encode_checkpoint(state)))

    return snapshot


Result = tuple[TensorReply, list[bytes]]


async def _batch(
    run_one: Callable[[Any, list[WireTensor], str], Awaitable[Result]], request: Request
) -> Reply:
    """Run a batch's items concurrently; an item that fails gets its own error reply."""
    items = request.header.items
    results: list[tuple[TensorReply | ErrorReply, list[bytes]]] = [
        (ErrorReply(code="internal"), []) for _ in items
    ]

    async def one(i: int, item: Any, tensors: list[WireTensor]) -> None:
        try:
            results[i] = await run_one(item, tensors, request.peer_id)
        except VolunteerdError as exc:
            results[i] = (ErrorReply(code=wire_code(exc), message=str(exc)[:1000]), [])

    offset = 0
    async with trio.open_nursery() as nursery:
        for i, item in enumerate(items):
            count = len(item.tensors)
            nursery.start_soon(one, i, item, request.tensors[offset : offset + count])
            offset += count
    return Reply(
        BatchReply(items=[header for header, _ in results]),
        [buffer for _, buffers in results for buffer in buffers],
    )


class _SwarmReplicas:
    """The averager's view of the swarm: replicas from the DHT's full-uid records,
    their parameters over this node's RPC client (the connections already open)."""

    def __init__(self, node: Node, lookup_s: float) -> None:
        self._node = node
        self._lookup_s = lookup_s
        self._addresses: dict[str, PeerAddress] = {}

    async def replicas(self, uid: str) -> list[str]:
        with trio.move_on_after(self._lookup_s):
            records = (await self._node.dht.get([uid]))[uid]
            peers = []
            for record in records:
                if record.peer_id != self._node.peer_id:
                    self._addresses[record.peer_id] = PeerAddress(record.peer_id, record.addrs)
                    peers.append(record.peer_id)
            return peers
        return []

    async def fetch(self, peer_id: str, uid: str) -> tuple[ParamsReply, list[WireTensor]]:
        reply, tensors = await self._node.rpc.call(
            self._addresses[peer_id], Verb.PARAMS, ParamsRequest(uid=uid)
        )
        return reply, tensors


@dataclass(slots=True)
class Running:
    """What a started daemon exposes to its owner (the CLI, tests)."""

    node: Node
    runtime: ExpertRuntime
    announcer: Announcer
    checkpointer: Checkpointer
    averager: ReplicaAverager
    joiner: Joiner | None = None  # when joined to an experiment (experiments.join)
    volunteer: Volunteer | None = None  # pause, resume, snooze, limits (Daemon sets it)
    controls: DaemonControls | None = None  # what the control API sees (Daemon sets it)
    control_url: str | None = None  # http://127.0.0.1:PORT while the control API serves


class Daemon:
    """``volunteerd serve``. Start with ``await nursery.start(daemon.serve)``; stop with
    ``request_stop()`` (graceful) or by cancelling (the same, without waiting for a
    second signal)."""

    def __init__(self, config: Config, paths: Paths, identity: Identity | None = None) -> None:
        self.config = config
        self.paths = paths
        self._identity = identity
        self._stop = trio.Event()

    def request_stop(self) -> None:
        self._stop.set()

    async def serve(self, *, task_status: TaskStatus[Running] = trio.TASK_STATUS_IGNORED) -> None:
        with data_dir_lock(self.paths.lock_file):
            await self._serve(task_status)

    async def _serve(self, task_status: TaskStatus[Running]) -> None:
        config = self.config
        identity = self._identity or load_or_create_identity(self.paths.identity_file)
        device = choose_device(config.runtime.device)
        if config.runtime.torch_threads:
            torch.set_num_threads(config.runtime.torch_threads)
        # Joining an experiment: the joiner chooses the experts once the node is up.
        joining = bool(config.experiments.join)
        uids = [] if joining else config.experts.uid_list()
        runtime = ExpertRuntime(
            uids, config.experts, config.runtime, config.wire, device, guard=config.guard
        )
        checkpointer = Checkpointer(runtime, self.paths.checkpoints_dir, config.checkpoints)
        if config.checkpoints.enabled:
            await checkpointer.restore()
        throttle = Throttle(config.limits, TransferLedger(self.paths.transfer_file))
        volunteer = Volunteer(
            runtime,
            throttle,
            config.limits,
            state_file=self.paths.state_file,
            limits_file=self.paths.limits_file,
            grace_s=config.timeouts.shutdown_grace_s,
        )
        volunteer.restore()  # a daemon paused before its restart starts paused
        store = await trio.to_thread.run_sync(
            partial(open_stats, self.paths.stats_file, config.stats.keep_hourly_days)
        )
        accountant = Accountant(
            store, runtime, throttle, config.stats, serving=lambda: volunteer.state.serving
        )
        shards = ShardServer(shard_snapshot(runtime))
        handlers = accountant.wrap(
            volunteer.gate.wrap(expert_handlers(runtime, shards, accountant))
        )
        async with (
            _closing(store),
            open_node(identity, config, handlers, throttle) as node,
            trio.open_nursery() as compute,
        ):
            await compute.start(runtime.serve)
            averager = ReplicaAverager(
                runtime, _SwarmReplicas(node, config.timeouts.dht_lookup_s), config.replicas
            )
            announcer = Announcer(
                node.dht, identity, node.peer_id, node.addrs, config.dht, config.timeouts
            )
            announcer.set_uids(uids)
            if node.reachability is not None:  # moved to or from a relay: re-announce
                node.reachability.watch_addrs(announcer.set_addrs)
            volunteer.attach(announcer)
            try:
                async with trio.open_nursery() as serving:
                    await serving.start(accountant.serve)
                    await serving.start(announcer.serve)
                    await serving.start(shards.serve)
                    await serving.start(volunteer.serve)
                    if config.checkpoints.enabled:
                        await serving.start(checkpointer.serve)
                    if config.replicas.enabled:
                        await serving.start(averager.serve)
                    joiner = None
                    if joining:
                        joiner = Joiner(
                            node,
                            runtime,
                            announcer,
                            checkpointer if config.checkpoints.enabled else None,
                            ShardDownloader.for_node(
                                node.rpc, self.paths.downloads_dir, config.timeouts
                            ),
                            config.experiments,
                            capacity_for(config, device),
                        )
                        await serving.start(joiner.serve)
                        uids = runtime.uids
                    logger.info(
                        "volunteerd %s serving %d %s experts on %s as %s",
                        __version__,
                        len(uids),
                        joiner.manifest.expert_type
                        if joiner is not None and joiner.manifest is not None
                        else config.experts.type,
                        device,
                        node.peer_id,
                    )
                    for addr in node.multiaddrs:
                        logger.info("reachable at %s", addr)
                    manifest_of = joiner
                    controls = DaemonControls(
                        node=node,
                        runtime=runtime,
                        volunteer=volunteer,
                        checkpointer=checkpointer if config.checkpoints.enabled else None,
                        accountant=accountant,
                        experiment=lambda: (
                            manifest_of.manifest.name
                            if manifest_of is not None and manifest_of.manifest is not None
                            else None
                        ),
                        request_stop=self.request_stop,
                    )
                    await serving.start(controls.serve)
                    control_url = None
                    if config.control.enabled:
                        control_url = await serving.start(
                            partial(
                                serve_control,
                                controls,
                                port=config.control.port,
                                token_file=self.paths.token_file,
                                control_file=self.paths.control_file,
                            )
                        )
                    task_status.started(
                        Running(
                            node,
                            runtime,
                            announcer,
                            checkpointer,
                            averager,
                            joiner,
                            volunteer=volunteer,
                            controls=controls,
                            control_url=control_url,
                        )
                    )
                    await self._stop.wait()
                    serving.cancel_scope.cancel()  # withdraws the announcements
            finally:
                runtime.close()
                with (
                    trio.CancelScope(shield=True),
                    trio.move_on_after(config.timeouts.shutdown_grace_s),
                ):
                    await runtime.drained()
                if config.checkpoints.enabled:
                    # The final save: after the queued work, before the node closes.
                    with trio.CancelScope(shield=True):
                        await checkpointer.save_changed()
                compute.cancel_scope.cancel()
        logger.info("stopped")


def open_stats(path: Path, keep_hourly_days: int) -> StatsStore:
    """The contribution store at ``path``. A damaged file (or one from a newer version)
    is moved aside, never deleted, and counting starts afresh: statistics must not stop
    a volunteer from contributing."""
    try:
        return StatsStore.open(path, keep_hourly_days=keep_hourly_days)
    except (sqlite3.DatabaseError, RuntimeError) as exc:
        aside = path.with_name(f"{path.name}.unreadable-{int(time.time())}")
        logger.error("%s is unreadable (%s); moved to %s, counting afresh", path, exc, aside)
        for suffix in ("", "-wal", "-shm"):
            part = path.with_name(path.name + suffix)
            if part.exists():
                part.replace(aside.with_name(aside.name + suffix))
        return StatsStore.open(path, keep_hourly_days=keep_hourly_days)


@asynccontextmanager
async def _closing(store: StatsStore) -> AsyncIterator[StatsStore]:
    try:
        yield store
    finally:
        with trio.CancelScope(shield=True):
            await trio.to_thread.run_sync(store.close)


async def bootstrap_only(
    config: Config,
    paths: Paths,
    *,
    task_status: TaskStatus[Node] = trio.TASK_STATUS_IGNORED,
) -> None:
    """``volunteerd bootstrap``: a DHT node with no experts, for others to join through."""
    with data_dir_lock(paths.lock_file):
        identity = load_or_create_identity(paths.identity_file)
        # Bootstrap nodes also relay circuits for peers that cannot be dialled.
        async with open_node(identity, config, relay=True) as node:
            logger.info("bootstrap node %s", node.peer_id)
            for addr in node.multiaddrs:
                logger.info("join with --bootstrap %s", addr)
            task_status.started(node)
            await trio.sleep_forever()
