"""The composition root: builds every service from the config and runs them in order;
no request passes through here (the serving side is ``server``).

What runs depends on what there is to host: the projects joined (``projects.toml``,
``swarm.projects``), the config's ``experiments.join``, or ``experts.uids``.

* Nothing (a fresh install): identity, pause controls, contribution counting, the
  libp2p node (a DHT peer like any other) and the control API; nothing that imports
  torch, so the daemon stays small and says it is not in a project.
* Something: the same plus ``hosting`` (torch: the runtime with the newest good
  checkpoints, the expert verbs in the request pipeline, announcer, checkpointer,
  averager, one joiner per project). While in a project, ``experts.uids`` is ignored.

Stop, gently and in reverse: withdraw from the DHT, stop taking requests, finish queued
ones (``shutdown_grace_s``), save, close.

Joining or leaving a project (``ControlView``) records it in ``projects.toml`` and asks
for a restart: ``serve`` stops as for a stop and returns with ``restart_requested``
set; ``volunteerd serve`` then executes itself again, same pid, into the new projects,
keeping the data folder's lock across (``DataDirLock.hand_over``): it holds the lock
then, and passes ``lock_held``.
"""

from __future__ import annotations

import logging
import socket
from collections.abc import Callable
from contextlib import AbstractAsyncContextManager, AbstractContextManager, nullcontext
from dataclasses import dataclass
from functools import partial
from typing import TYPE_CHECKING

import trio

from volunteerd import __version__, localtime
from volunteerd.checkpoint_folders import OTHERS_KEPT, trim_others
from volunteerd.config import Config
from volunteerd.control.events import EventLog
from volunteerd.control.server import bind_control, serve_control
from volunteerd.detached import OwnLogFile
from volunteerd.identity import Identity, load_or_create_identity
from volunteerd.net import Node, open_node
from volunteerd.net.shard import sweep_downloads
from volunteerd.net.throttle import Throttle, TransferLedger
from volunteerd.paths import DataDirLock, Paths
from volunteerd.schedule import Scheduler
from volunteerd.server.contribution import Accountant, opened_stats
from volunteerd.server.control_view import ControlView
from volunteerd.server.events import open_events
from volunteerd.server.pausing import Volunteer, refusal_before_reading
from volunteerd.swarm.projects import Project, load_projects, read_projects

if TYPE_CHECKING:
    # trio's TaskStatus as libp2p's trio-typing stubs spell it
    from trio_typing import TaskStatus

    # Only for types: the hosting side (and torch) is imported when there is work.
    from volunteerd.hosting import Hosting
    from volunteerd.net import Announcer
    from volunteerd.runtime import ExpertRuntime
    from volunteerd.runtime.averaging import ReplicaAverager
    from volunteerd.swarm.joiner import Joiner

__all__ = ["Daemon", "Running", "bootstrap_only", "running_projects"]

logger = logging.getLogger(__name__)


@dataclass(slots=True)
class Running:
    """What a started daemon exposes to its owner (the CLI, tests)."""

    node: Node
    volunteer: Volunteer  # pause, resume, snooze, limits
    hosting: Hosting | None  # None: hosting nothing (no project, no experts.uids)
    projects: list[Project]
    scheduler: Scheduler | None = None  # when to compute (Daemon sets it)
    controls: ControlView | None = None  # what the control API sees (Daemon sets it)
    control_url: str | None = None  # http://127.0.0.1:PORT while the control API serves

    def _hosting(self) -> Hosting:
        if self.hosting is None:
            raise RuntimeError("this daemon hosts nothing (no project, no experts.uids)")
        return self.hosting

    @property
    def runtime(self) -> ExpertRuntime:
        """The experts' runtime. Raises RuntimeError when hosting nothing."""
        return self._hosting().runtime

    @property
    def announcer(self) -> Announcer:
        """Raises RuntimeError when hosting nothing."""
        announcer = self._hosting().announcer
        if announcer is None:  # pragma: no cover - set before the daemon reports started
            raise RuntimeError("the announcer has not started")
        return announcer

    @property
    def averager(self) -> ReplicaAverager:
        """The replica averager. Raises RuntimeError when hosting nothing."""
        averager = self._hosting().averager
        if averager is None:  # pragma: no cover - set before the daemon reports started
            raise RuntimeError("the averager has not started")
        return averager

    @property
    def joiners(self) -> list[Joiner]:
        """One per project, in the order of ``projects`` (none when hosting nothing)."""
        return self.hosting.joiners if self.hosting is not None else []


def running_projects(config: Config, paths: Paths) -> list[Project]:
    """The projects a daemon started now runs: the config's ``experiments.join`` first,
    then those in ``projects.toml`` (one of the config's name is left out: the config
    decides). Raises ConfigError for an unreadable or invalid projects file."""
    projects = load_projects(paths.projects_file)
    configured = Project.from_experiments(config.experiments)
    if configured is None:
        return projects
    if any(p.name == configured.name for p in projects):
        logger.warning(
            "project %r is both in %s and the config's experiments.join; the config's is used",
            configured.name,
            paths.projects_file,
        )
    return [configured, *(p for p in projects if p.name != configured.name)]


def _node_config(config: Config, projects: list[Project]) -> Config:
    """``config`` with the projects' peers as bootstrap peers too, and their owners'
    manifests trusted (stored first by this node)."""
    peers = [*config.network.bootstrap_peers, *(a for p in projects for a in p.peers)]
    owners = [*config.experiments.trusted_owners, *(p.owner for p in projects if p.owner)]
    return config.model_copy(
        update={
            "network": config.network.model_copy(
                update={"bootstrap_peers": list(dict.fromkeys(peers))}
            ),
            "experiments": config.experiments.model_copy(
                update={"trusted_owners": list(dict.fromkeys(owners))}
            ),
        }
    )


class Daemon:
    """``volunteerd serve``. Start with ``await nursery.start(daemon.serve)``; stop with
    ``request_stop()`` (graceful) or by cancelling (the same, without waiting for a
    second signal). After ``serve`` returns, ``restart_requested`` says whether it
    stopped to be started again (the projects changed).

    ``serve`` holds the data folder's lock (``DataDirLock``) while it runs, unless
    ``lock_held``: its caller holds it (the CLI, which keeps it across a restart)."""

    def __init__(
        self,
        config: Config,
        paths: Paths,
        identity: Identity | None = None,
        *,
        reload: Callable[[], Config] | None = None,
        lock_held: bool = False,
    ) -> None:
        self.config = config
        self.paths = paths
        self._identity = identity
        self._lock_held = lock_held
        # the configuration as a restart loads it (the CLI's: file, limits.toml,
        # schedule.toml, environment and flags); None: ``config`` as it is
        self._reload = reload
        self._stop = trio.Event()
        self.restart_requested = False
        self._control_socket: socket.socket | None = None  # bound while serving

    def request_stop(self) -> None:
        """Stop gracefully, for good: also when a restart was asked for just before (a
        ``POST /shutdown`` a moment after a join), which this one takes the place of."""
        self.restart_requested = False
        self._stop.set()

    def request_restart(self) -> None:
        """Stop gracefully, to be started again (with the projects file as it is then);
        nothing more when a stop was asked for already (a stop stays a stop)."""
        if self._stop.is_set() and not self.restart_requested:
            return
        self.restart_requested = True
        self._stop.set()

    def check_restart(self) -> None:
        """Raises ConfigError (or OSError) when the daemon, started again now, would not
        start: the configuration (``reload``) or the projects file does not load. A join
        or leave asks this before it is answered with a restart."""
        config = self._reload() if self._reload is not None else self.config
        running_projects(config, self.paths)

    async def serve(self, *, task_status: TaskStatus[Running] = trio.TASK_STATUS_IGNORED) -> None:
        self._stop = trio.Event()
        self.restart_requested = False
        locked = nullcontext() if self._lock_held else DataDirLock(self.paths.lock_file)
        with locked, self._bound_control() as self._control_socket:
            await self._serve(task_status)

    def _bound_control(self) -> AbstractContextManager[socket.socket | None]:
        """The control API's socket, bound before anything joins a swarm (a port another
        program holds ends the start here; None: the API is disabled)."""
        if not self.config.control.enabled:
            return nullcontext()
        return bind_control(self.config.control.port)

    async def _serve(self, task_status: TaskStatus[Running]) -> None:
        config, paths = self.config, self.paths
        projects = running_projects(config, paths)
        # what was left out of projects.toml: said once a start (not at every read)
        recorded = read_projects(paths.projects_file)
        for warning in recorded.warnings:
            logger.warning("%s", warning)
        identity = self._identity or load_or_create_identity(paths.identity_file)
        uids = [] if projects else config.experts.uid_list()
        if projects and config.experts.uids:
            logger.info("in a project: experts.uids (%s) is not hosted", config.experts.uids)
        # what downloads cut short long ago left (also after leaving the last project)
        await trio.to_thread.run_sync(sweep_downloads, paths.downloads_dir)
        hosting: Hosting | None = None
        if not (projects or uids):  # what experts hosted before left (a project left)
            try:
                await trio.to_thread.run_sync(trim_others, paths.checkpoints_dir, (), OTHERS_KEPT)
            except OSError as exc:  # tidying only: a start must not end for it
                logger.warning("could not trim the checkpoints of experts left: %s", exc)
        if projects or uids:
            from volunteerd.hosting import prepare_hosting  # imports torch

            hosting = await prepare_hosting(config, paths, uids)
        runtime = hosting.runtime if hosting is not None else None
        events = EventLog()
        for entry in recorded.set_aside:
            events.post(
                "error", f"project {entry.name} is not hosted: {entry.problem}; {entry.advice()}"
            )
        if hosting is not None:
            hosting.checkpointer.on_warning = lambda message: events.post("error", message)
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
        scheduler = Scheduler(
            config.schedule,
            volunteer,
            on_gpu=hosting is not None and hosting.device.type != "cpu",
            schedule_file=paths.schedule_file,
            events=events,
        )
        async with opened_stats(paths.stats_file, config.stats.keep_hourly_days) as store:
            accountant = Accountant(
                store,
                runtime,
                throttle,
                config.stats,
                serving=lambda: volunteer.state.serving,
                events=events,
            )
            handlers = hosting.handlers(volunteer.gate, accountant, throttle) if hosting else None
            computing: AbstractAsyncContextManager[None] = (
                hosting.computing() if hosting is not None else nullcontext()
            )
            async with (
                open_node(identity, _node_config(config, projects), handlers, throttle) as node,
                computing,
                trio.open_nursery() as serving,
            ):
                if handlers is not None:  # paused: refused before a byte more is read
                    node.server.refuse_unread = refusal_before_reading(volunteer.gate, accountant)
                    node.server.refused_early = accountant.refused_early
                if hosting is not None:  # a call over the batch cap: its body left unread
                    node.server.max_request_samples = hosting.runtime.max_samples
                    node.server.hosts = hosting.runtime.hosts
                accountant.connected = node.connected_peers  # a full peers table spares them
                node.dht.clones.on_clone = lambda message: events.post("error", message)
                if node.reachability is not None:  # relaying is the volunteer's bandwidth too
                    gate = volunteer.gate
                    node.reachability.relaying.hold_while(
                        lambda: gate.reason if gate.closed else None
                    )
                await serving.start(accountant.serve)
                own_log = OwnLogFile.named()
                if own_log is not None:  # started detached, or by launchd: bounded here
                    serving.start_soon(_keep_bounded, own_log)
                await serving.start(scheduler.serve)  # decides before the volunteer serves
                configured: list[Joiner] = []  # experiments.join: joined below
                if hosting is not None:
                    configured = await hosting.start(serving, node, volunteer, projects)
                else:
                    await serving.start(volunteer.serve)
                running = Running(node, volunteer, hosting, projects, scheduler)
                open_events(events, node, runtime, volunteer.described)
                running.controls = ControlView(
                    node=node,
                    runtime=runtime,
                    volunteer=volunteer,
                    checkpointer=hosting.checkpointer
                    if hosting is not None and config.checkpoints.enabled
                    else None,
                    accountant=accountant,
                    projects=projects,
                    joiners=running.joiners,
                    projects_file=paths.projects_file,
                    request_stop=self.request_stop,
                    request_restart=self.request_restart,
                    check_restart=self.check_restart,
                    events=events,
                    scheduler=scheduler,
                    unheard=partial(_unheard, hosting),
                    set_aside=recorded.set_aside,
                )
                await serving.start(running.controls.serve)
                if self._control_socket is not None:
                    running.control_url = await serving.start(
                        partial(
                            serve_control,
                            running.controls,
                            sock=self._control_socket,
                            token_file=paths.token_file,
                            control_file=paths.control_file,
                        )
                    )
                for joiner in configured:  # the control API answers meanwhile
                    await serving.start(joiner.serve)
                self._log_started(running)
                task_status.started(running)
                await self._stop.wait()
                serving.cancel_scope.cancel()  # withdraws the announcements
            accountant.count_traffic()  # the node's last words, after the accountant stopped
        logger.info("stopped" + " to restart" * self.restart_requested)

    def _log_started(self, running: Running) -> None:
        node, hosting = running.node, running.hosting
        if hosting is None:
            logger.info(
                "volunteerd %s as %s hosts nothing: not in a project (join one with "
                "`volunteerd join INVITATION`)",
                __version__,
                node.peer_id,
            )
        else:
            manifests = [j.manifest for j in hosting.joiners if j.manifest is not None]
            kind = manifests[0].expert_type if manifests else self.config.experts.type
            logger.info(
                "volunteerd %s serving %d %s experts on %s as %s%s",
                __version__,
                len(hosting.runtime.uids),
                kind,
                hosting.device,
                node.peer_id,
                "".join(f"; joining {p.name!r}" for p in running.projects if not p.from_config),
            )
        for addr in node.multiaddrs:
            logger.info("reachable at %s", addr)
        now = localtime.local()
        logger.info(
            "local time: %s (%s, %s), which the schedule's hours and the daily quota's day go by",
            localtime.zone_name(),
            now.tm_zone,
            localtime.offset_words(now.tm_gmtoff),
        )
        if warning := localtime.zone_warning():
            logger.warning("%s", warning)


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


def _unheard(hosting: Hosting | None) -> bool:
    """Whether the experts' last announcements reached no other peer."""
    announcer = hosting.announcer if hosting is not None else None
    return announcer is not None and announcer.unheard


# How often the daemon's own log file is measured (``OwnLogFile``).
_LOG_CHECK_S = 60.0


async def _keep_bounded(log: OwnLogFile) -> None:
    while True:
        await trio.to_thread.run_sync(log.bound)
        await trio.sleep(_LOG_CHECK_S)
