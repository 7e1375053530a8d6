"""The composition root: builds every service from the config and runs them in order;
no request passes through here (the serving side is ``server``).

Start: identity, device, expert runtime (newest good checkpoints), pause controls,
contribution counting and the request pipeline, libp2p node, announcer, checkpointer,
averager, joiner, events, control API. Stop, gently and in reverse: withdraw from the
DHT, stop taking requests, finish queued ones (``shutdown_grace_s``), save, close.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass
from functools import partial
from typing import TYPE_CHECKING

import torch
import trio

from volunteerd import __version__
from volunteerd.config import Config
from volunteerd.control.events import EventLog
from volunteerd.control.server import serve_control
from volunteerd.identity import Identity, load_or_create_identity
from volunteerd.net import Announcer, Node, ShardServer, open_node
from volunteerd.net.throttle import Throttle, TransferLedger
from volunteerd.paths import DataDirLock, Paths
from volunteerd.runtime import ExpertRuntime, choose_device
from volunteerd.runtime.averaging import ReplicaAverager
from volunteerd.runtime.checkpointer import Checkpointer
from volunteerd.server.contribution import Accountant, opened_stats
from volunteerd.server.control_view import ControlView
from volunteerd.server.events import open_events
from volunteerd.server.pausing import Volunteer
from volunteerd.server.pipeline import expert_handlers, shard_snapshot
from volunteerd.server.replicas import SwarmReplicas
from volunteerd.swarm.download import ShardDownloader
from volunteerd.swarm.joiner import Joiner, capacity_for

if TYPE_CHECKING:
    # trio's TaskStatus as libp2p's trio-typing stubs spell it
    from trio_typing import TaskStatus

__all__ = ["Daemon", "Running", "bootstrap_only"]

logger = logging.getLogger(__name__)


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
    controls: ControlView | None = None  # what the control API sees (Daemon sets it)
    control_url: str | None = None  # http://127.0.0.1:PORT while the control API serves

    def experiment(self) -> str | None:
        """The name of the experiment joined (None: none, or its manifest not found)."""
        manifest = self.joiner.manifest if self.joiner is not None else None
        return manifest.name if manifest is not None else None


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
        with DataDirLock(self.paths.lock_file):
            await self._serve(task_status)

    async def _serve(self, task_status: TaskStatus[Running]) -> None:
        config, paths = self.config, self.paths
        identity = self._identity or load_or_create_identity(paths.identity_file)
        device = choose_device(config.runtime.device)
        if config.runtime.torch_threads:
            torch.set_num_threads(config.runtime.torch_threads)
        # Joining an experiment: the joiner chooses the experts once the node is up.
        joining = bool(config.experiments.join)
        uids = [] if joining else config.experts.uid_list()
        runtime = ExpertRuntime(
            uids, config.experts, config.runtime, config.wire, device, guard=config.guard
        )
        checkpointer = Checkpointer(runtime, paths.checkpoints_dir, config.checkpoints)
        if config.checkpoints.enabled:
            await checkpointer.restore()
        events = EventLog()
        throttle = Throttle(config.limits, TransferLedger(paths.transfer_file))
        volunteer = Volunteer(
            runtime,
            throttle,
            config.limits,
            state_file=paths.state_file,
            limits_file=paths.limits_file,
            grace_s=config.timeouts.shutdown_grace_s,
            events=events,
        )
        volunteer.restore()  # a daemon paused before its restart starts paused
        async with opened_stats(paths.stats_file, config.stats.keep_hourly_days) as store:
            accountant = Accountant(
                store,
                runtime,
                throttle,
                config.stats,
                serving=lambda: volunteer.state.serving,
                events=events,
            )
            shards = ShardServer(shard_snapshot(runtime))
            handlers = expert_handlers(
                runtime, gate=volunteer.gate, accountant=accountant, shards=shards
            )
            async with (
                open_node(identity, config, handlers, throttle) as node,
                trio.open_nursery() as compute,
            ):
                await compute.start(runtime.serve)
                try:
                    async with trio.open_nursery() as serving:
                        await serving.start(accountant.serve)
                        await serving.start(shards.serve)
                        running = await self._start_services(
                            serving, node, runtime, checkpointer, volunteer, device, joining
                        )
                        open_events(events, node, runtime, volunteer.described)
                        running.controls = ControlView(
                            node=node,
                            runtime=runtime,
                            volunteer=volunteer,
                            checkpointer=checkpointer if config.checkpoints.enabled else None,
                            accountant=accountant,
                            experiment=running.experiment,
                            request_stop=self.request_stop,
                            events=events,
                        )
                        await serving.start(running.controls.serve)
                        if config.control.enabled:
                            running.control_url = await serving.start(
                                partial(
                                    serve_control,
                                    running.controls,
                                    port=config.control.port,
                                    token_file=paths.token_file,
                                    control_file=paths.control_file,
                                )
                            )
                        task_status.started(running)
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

    async def _start_services(
        self,
        serving: trio.Nursery,
        node: Node,
        runtime: ExpertRuntime,
        checkpointer: Checkpointer,
        volunteer: Volunteer,
        device: torch.device,
        joining: bool,
    ) -> Running:
        """Start the announcer, the volunteer's controls, the checkpointer, the averager
        and the joiner (as configured) in ``serving``."""
        config = self.config
        averager = ReplicaAverager(
            runtime, SwarmReplicas(node, config.timeouts.dht_lookup_s), config.replicas
        )
        announcer = Announcer(
            node.dht, node.identity, node.peer_id, node.addrs, config.dht, config.timeouts
        )
        announcer.set_uids(runtime.uids)
        if node.reachability is not None:  # moved to or from a relay: re-announce
            node.reachability.watch_addrs(announcer.set_addrs)
        volunteer.attach(announcer)
        await serving.start(announcer.serve)
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
                ShardDownloader.for_node(node.rpc, self.paths.downloads_dir, config.timeouts),
                config.experiments,
                capacity_for(config, device),
            )
            await serving.start(joiner.serve)
        manifest = joiner.manifest if joiner is not None else None
        kind = manifest.expert_type if manifest is not None else config.experts.type
        logger.info(
            "volunteerd %s serving %d %s experts on %s as %s",
            __version__,
            len(runtime.uids),
            kind,
            device,
            node.peer_id,
        )
        for addr in node.multiaddrs:
            logger.info("reachable at %s", addr)
        return Running(node, runtime, announcer, checkpointer, averager, joiner, volunteer)


async def bootstrap_only(
    config: Config,
    paths: Paths,
    *,
    task_status: TaskStatus[Node] = trio.TASK_STATUS_IGNORED,
) -> None:
    """``volunteerd bootstrap``: a DHT node with no experts, for others to join through."""
    with DataDirLock(paths.lock_file):
        identity = load_or_create_identity(paths.identity_file)
        # Bootstrap nodes also relay circuits for peers that cannot be dialled.
        async with open_node(identity, config, relay=True) as node:
            logger.info("bootstrap node %s", node.peer_id)
            for addr in node.multiaddrs:
                logger.info("join with --bootstrap %s", addr)
            task_status.started(node)
            await trio.sleep_forever()
