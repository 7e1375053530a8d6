"""What a daemon that hosts experts adds to one that hosts nothing: the expert runtime
on its device, the request pipeline's expert verbs, checkpoints, the announcer, the
replica averager, and one joiner per project.

Only ``daemon`` imports this module, and only when there is something to host (a
project joined, ``experiments.join``, or ``experts.uids``): it is where torch comes
in, so a daemon in no project stays small (docs/architecture.md, Lifetimes).

Projects share the runtime and the announcer: each joiner hosts its own experiment's
experts within its share of the room (``swarm.projects.share_of``), and what is
announced is every joiner's experts together. The config's project
(``experiments.join``) is joined before the daemon reports itself started, and a
failure ends it (exit 3 or 5, as before); a project from ``projects.toml`` is joined
in the background, and a failure is shown in its state and tried again.

After a freeze, and when experts are loaded from checkpoints ``FROZEN_S`` old or more
(at start, or when a joiner takes one from its own checkpoint), the averager holds back
the experts with replicas until it has averaged them (``runtime.averaging``, ``stale``):
their calls are refused (``RequestGate.held``) and their records withdrawn (or never
announced) meanwhile.
"""

from __future__ import annotations

import logging
import time
from collections.abc import AsyncIterator, Sequence
from contextlib import asynccontextmanager
from dataclasses import dataclass, field

import torch
import trio

from volunteerd.config import Config, ExpertsConfig
from volunteerd.net import Announcer, Handler, Node, ShardServer, Throttle, Verb
from volunteerd.paths import Paths
from volunteerd.runtime import ExpertRuntime, choose_device
from volunteerd.runtime.averaging import ReplicaAverager
from volunteerd.runtime.checkpointer import Checkpointer
from volunteerd.server.contribution import Accountant
from volunteerd.server.pausing import RequestGate, Volunteer, hold_back
from volunteerd.server.pipeline import expert_handlers, shard_snapshot
from volunteerd.server.replicas import SwarmReplicas, WindowedDownloader
from volunteerd.server.transfers import TransferBudget
from volunteerd.swarm.download import ShardDownloader
from volunteerd.swarm.expiries import ManifestExpiries
from volunteerd.swarm.joiner import Joiner, capacity_for
from volunteerd.swarm.projects import Project, share_of
from volunteerd.swarm.verified import ReplicaChecks, hosts_uid

__all__ = ["Hosting", "prepare_hosting"]

logger = logging.getLogger(__name__)

# A project that could not be joined (not found, peers down) is tried again after this.
REJOIN_AFTER_S = 60.0


@dataclass(slots=True)
class Hosting:
    """The hosting side of a running daemon (``prepare_hosting``, then ``computing``
    around the serving, then ``start``)."""

    config: Config
    paths: Paths
    runtime: ExpertRuntime
    checkpointer: Checkpointer
    device: torch.device
    shards: ShardServer
    announcer: Announcer | None = None  # set by start
    averager: ReplicaAverager | None = None  # set by start
    joiners: list[Joiner] = field(default_factory=list)  # one per project, in order
    hosted: set[str] = field(default_factory=set)  # what to announce, but held-back experts
    # The bulk transfers' share of the transfer quotas, one for the daemon: what peers
    # download from it and what its averager fetches (set by handlers)
    budget: TransferBudget | None = None

    def handlers(
        self, gate: RequestGate, accountant: Accountant, throttle: Throttle
    ) -> dict[Verb, Handler]:
        """The expert verbs through the request pipeline (pause gate, accounting, the
        bulk replies' share of ``throttle``'s quotas), those of experts held back after a
        freeze refused (``RequestGate.held``). The budget is the averager's too."""
        self.budget = TransferBudget(throttle)
        handlers = expert_handlers(
            self.runtime,
            gate=gate,
            accountant=accountant,
            shards=self.shards,
            budget=self.budget,
        )
        return hold_back(handlers, gate, accountant)

    @asynccontextmanager
    async def computing(self) -> AsyncIterator[None]:
        """The runtime's batchers while the block runs; on the way out, stop taking
        requests, finish the queued ones (``shutdown_grace_s``) and save the experts
        whose weights changed (inside the node, so a replica can still be asked), then
        record that their newest checkpoints held them until now
        (``Checkpointer.mark_stopped``: a restart in place holds nothing back)."""
        config = self.config
        async with trio.open_nursery() as compute:
            await compute.start(self.runtime.serve)
            try:
                yield
            finally:
                self.runtime.close()
                with (
                    trio.CancelScope(shield=True),
                    trio.move_on_after(config.timeouts.shutdown_grace_s),
                ):
                    await self.runtime.drained()
                if config.checkpoints.enabled:
                    with trio.CancelScope(shield=True):
                        await self.checkpointer.save_changed()
                        await trio.to_thread.run_sync(self.checkpointer.mark_stopped)
                compute.cancel_scope.cancel()

    async def start(
        self,
        serving: trio.Nursery,
        node: Node,
        volunteer: Volunteer,
        projects: Sequence[Project],
    ) -> list[Joiner]:
        """Start the announcer, the shard server, the checkpointer and the averager (as
        configured) in ``serving``, and a joiner for each of ``projects`` but the
        config's (``experiments.join``): its joiner is returned, not started, for the
        caller to start (``await serving.start(joiner.serve)`` returns once it hosts its
        first experts, and raises if it cannot join) once the control API answers: a
        long join showed "not running" in `volunteerd status`."""
        config = self.config
        # Bulk transfers (averaging, downloads) only within the schedule's network hours.
        replicas = SwarmReplicas(
            node, config.timeouts.dht_lookup_s, allowed=lambda: volunteer.network_allowed
        )
        announcer = Announcer(
            node.dht, node.identity, node.peer_id, node.addrs, config.dht, config.timeouts
        )
        self.announcer = announcer

        def hold(stale: frozenset[str]) -> None:
            """Refuse and withdraw ``stale`` experts (serve the others again)."""
            volunteer.gate.held = stale
            announcer.set_uids(self.hosted - stale)

        averager = self.averager = ReplicaAverager(
            self.runtime,
            replicas,
            config.replicas,
            on_stale=hold,
            lookup_s=config.timeouts.dht_lookup_s,
            budget=self.budget,
        )

        def set_uids(uids: set[str]) -> None:
            self.hosted = uids
            if config.replicas.enabled:  # loaded from old checkpoints: held, not announced
                averager.hold_restored(self.checkpointer.take_restored(uids))
            announcer.set_uids(uids - volunteer.gate.held)

        self.checkpointer.budget_bytes = lambda: round(volunteer.limits.disk_budget_gb * 1e9)
        set_uids(set(self.runtime.uids))  # experts.uids (none while in a project)
        if node.reachability is not None:  # moved to or from a relay: re-announce
            node.reachability.watch_addrs(announcer.set_addrs)
        volunteer.attach(announcer)
        await serving.start(announcer.serve)
        await serving.start(self.shards.serve)
        await serving.start(volunteer.serve)
        if config.checkpoints.enabled:
            await serving.start(self.checkpointer.serve)
        if config.replicas.enabled:
            await serving.start(self.averager.serve)

        def announce() -> None:
            set_uids(set().union(*(j.hosted for j in self.joiners)))

        room = capacity_for(config, self.device)
        shards = ShardDownloader.for_node(node.rpc, self.paths.downloads_dir, config.timeouts)
        downloader = WindowedDownloader(shards, volunteer.wait_for_network)
        # Which listed replicas answer as such (shared: the projects' uids differ).
        timeouts = config.timeouts
        checks = ReplicaChecks(
            hosts_uid(node.rpc), time.monotonic, check_s=timeouts.connect_s + timeouts.dht_rpc_s
        )
        expiries = ManifestExpiries(self.paths.manifests_file)  # kept across restarts
        for index, project in enumerate(projects):

            def capacity(experts: ExpertsConfig, project: Project = project) -> int:
                return share_of(room(experts), project, projects)

            def taken(index: int = index) -> set[str]:
                """The experts the other projects' experiments name."""
                others = (j.manifest for i, j in enumerate(self.joiners) if i != index)
                return set().union(*(m.uids() for m in others if m is not None))

            self.joiners.append(
                Joiner(
                    node,
                    self.runtime,
                    announce,
                    self.checkpointer if config.checkpoints.enabled else None,
                    downloader,
                    project.experiments(config.experiments),
                    capacity,
                    taken=taken,
                    checks=checks,
                    expiries=expiries,
                    announce_gap_s=config.dht.announce_period_s,
                    progress=shards.progress,
                    network=volunteer.wait_for_network,
                )
            )
        configured: list[Joiner] = []
        for project, joiner in zip(projects, self.joiners, strict=True):
            if project.from_config:
                configured.append(joiner)
            else:
                serving.start_soon(joiner.keep_joining, REJOIN_AFTER_S)
        return configured


async def prepare_hosting(config: Config, paths: Paths, uids: Sequence[str]) -> Hosting:
    """The runtime on its device with ``uids`` (more come from the joiners), restored
    from the newest good checkpoints."""
    device = choose_device(config.runtime.device)
    if config.runtime.torch_threads:
        torch.set_num_threads(config.runtime.torch_threads)
    runtime = ExpertRuntime(
        list(uids), config.experts, config.runtime, config.wire, device, guard=config.guard
    )
    checkpointer = Checkpointer(
        runtime, paths.checkpoints_dir, config.checkpoints, also_counted=[paths.downloads_dir]
    )
    if config.checkpoints.enabled:
        await checkpointer.restore()
    return Hosting(
        config, paths, runtime, checkpointer, device, ShardServer(shard_snapshot(runtime))
    )
