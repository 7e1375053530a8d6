"""What the control API sees of a running daemon: snapshots built from its services,
and the changes it may ask for (pause, resume, snooze, limits, stop, joining and
leaving projects).

A daemon may host nothing (no project: ``runtime`` is None); then it shows no experts
and device "none". Joining or leaving a project records it in ``projects.toml``
(``swarm.projects``) and, when that changes what the daemon runs, restarts it (a
moment after the reply left: ``Daemon.request_restart``), unless the configuration it
would restart with does not load (``check_restart``: a change refused with 409, and the
daemon goes on as it is).

``ControlView`` implements ``control.api.Controls``. The events it serves are posted
by the services themselves (``server.events``); its ``serve`` task looks up every
``_REPLICAS_EVERY_S`` how many other peers announce each hosted expert (only while a
client asked for the experts in the last ``_REPLICAS_WANTED_S`` and network use is
allowed: a daemon nobody looked at, or a paused one, ran those lookups all day), and keeps the
rates of the last ``HISTORY_WINDOW_S`` (every ``HISTORY_EVERY_S``) for the dashboard's
live charts, so that a page opened now shows the last minutes at once.
"""

from __future__ import annotations

import logging
import math
import re
import time
from collections import deque
from collections.abc import Callable, Sequence
from dataclasses import asdict
from functools import partial
from pathlib import Path
from typing import TYPE_CHECKING, Any

import trio

from volunteerd import __version__, localtime
from volunteerd.control.events import EventLog
from volunteerd.control.models import (
    ExpertView,
    History,
    HistorySample,
    LimitsChange,
    LimitsView,
    PeerView,
    ProjectJoin,
    ProjectJoined,
    ProjectLeft,
    ProjectView,
    Rates,
    Reachability,
    ScheduleChange,
    ScheduleStatus,
    ScheduleView,
    Staleness,
    Stats,
    StatsBucket,
    Status,
    Totals,
)
from volunteerd.errors import ConfigError, ControlError, ResourceUnavailable
from volunteerd.net import Node
from volunteerd.schedule import Scheduler
from volunteerd.server.activity import Signals, decide_activity
from volunteerd.server.contribution import Accountant
from volunteerd.server.pausing import Volunteer
from volunteerd.shown import short_id
from volunteerd.stats import Totals as StoreTotals
from volunteerd.stats import Traffic, Work
from volunteerd.swarm.invitation import parse_invitation
from volunteerd.swarm.projects import (
    Project,
    SetAside,
    join_project,
    leave_project,
    read_projects,
    replaced_owner,
    replacing,
)

if TYPE_CHECKING:
    from trio_typing import TaskStatus

    # Only for types: a daemon that hosts nothing never imports torch.
    from volunteerd.runtime import ExpertRuntime
    from volunteerd.runtime.checkpointer import Checkpointer
    from volunteerd.swarm.joiner import Joiner

__all__ = ["HISTORY_EVERY_S", "HISTORY_WINDOW_S", "ControlView"]

logger = logging.getLogger(__name__)

_REPLICAS_EVERY_S = 30.0
# Replicas are counted only while an API client asked for the experts this recently
# (the dashboard's table polls them), and only while network use is allowed.
_REPLICAS_WANTED_S = 300.0
# The dashboard's live charts: ten minutes, a point as often as the page polls /status.
HISTORY_WINDOW_S = 600.0
HISTORY_EVERY_S = 2.0
_DAY_S = 86400.0
_STOP_AFTER_S = 0.2  # lets the reply to a shutdown request leave first


def _tcp_port(addrs: list[str]) -> int | None:
    """The TCP port of the first address that has one (``/ip4/.../tcp/PORT/...``)."""
    for addr in addrs:
        if found := re.search(r"/tcp/(\d+)", addr):
            return int(found.group(1))
    return None


def _totals(t: StoreTotals) -> Totals:
    return Totals(
        **asdict(t.work),
        running_s=t.running_s,
        paused_s=t.paused_s,
        rejected=dict(t.rejected),
        bytes_sent=t.traffic.bytes_up,
        bytes_received=t.traffic.bytes_down,
    )


def _history(
    work: list[tuple[int, int, Work]], traffic: dict[tuple[int, int], Traffic]
) -> list[StatsBucket]:
    """The store's hours (or days) of expert calls and of traffic as one list, oldest
    first: an hour of traffic and no expert call (a shard sent) is one too."""
    by_bucket = {(bucket, size): w for bucket, size, w in work}
    out = []
    for key in sorted(by_bucket.keys() | traffic.keys()):
        t = traffic.get(key, Traffic())
        out.append(
            StatsBucket(
                start=key[0],
                size_s=key[1],
                **asdict(by_bucket.get(key, Work())),
                bytes_sent=t.bytes_up,
                bytes_received=t.bytes_down,
            )
        )
    return out


class ControlView:
    """What the control API reads of the daemon's services, and the changes it asks
    for (through ``Volunteer``, which posts them as events)."""

    def __init__(
        self,
        *,
        node: Node,
        runtime: ExpertRuntime | None,
        volunteer: Volunteer,
        checkpointer: Checkpointer | None,
        accountant: Accountant,
        projects: Sequence[Project],
        joiners: Sequence[Joiner],
        projects_file: Path,
        request_stop: Callable[[], None],
        request_restart: Callable[[], None],
        events: EventLog,
        check_restart: Callable[[], None] = lambda: None,
        scheduler: Scheduler | None = None,
        unheard: Callable[[], bool] = lambda: False,
        set_aside: Sequence[SetAside] = (),
    ) -> None:
        self._node = node
        self._unheard = unheard  # whether the last announcements reached no other peer
        self._runtime = runtime
        self._volunteer = volunteer
        self._checkpointer = checkpointer
        self._accountant = accountant
        self._projects = list(projects)  # what this daemon runs (file + config)
        # entries of the projects file it read at its start and does not host, until left
        self._set_aside = list(set_aside)
        self._joiners = list(joiners)
        self._projects_file = projects_file
        self._request_stop = request_stop
        self._request_restart = request_restart
        self._check_restart = check_restart  # raises ConfigError: a restart would not start
        self._stopping = False  # shutdown() was asked for
        self._restarting = False  # a join or leave's restart began
        self.events = events
        self._scheduler = scheduler
        # started_at is for display; uptime counts on the monotonic clock (wall time
        # less a wall-clock start read -17,960 s after the clock was set back 5 h)
        self.started_at = time.time()
        self._started = time.monotonic()
        self._replicas: dict[str, int] = {}
        self._replicas_asked = -math.inf  # trio time a client last asked for the experts
        self._replicas_wanted = trio.Event()  # set when one asks
        self._history: deque[HistorySample] = deque(maxlen=int(HISTORY_WINDOW_S / HISTORY_EVERY_S))
        self._nursery: trio.Nursery | None = None

    # -- snapshots -------------------------------------------------------------------

    async def status(self) -> Status:
        # first, in a thread: the rest is a snapshot of the loop's state after it
        today = _totals(await self._accountant.counted_since(localtime.day_start(time.time())))
        state = self._volunteer.state
        now = time.time()
        reach = self._node.reachability
        if reach is None:
            reachability = Reachability(mode="unknown", addrs=self._node.multiaddrs)
        else:
            report = reach.report()
            reachability = Reachability(
                mode=report.mode,
                addrs=list(report.announce_addrs),
                relay=report.relay,
                advice=report.advice,
                observed=list(report.observed_ips),
                upgraded=report.upgrades.upgraded,
                hole_punch_failed=report.upgrades.failed,
                hole_punch_refused=report.upgrades.refused,
                last_upgrade_at=report.upgrades.last_upgrade_at,
            )
        rates = self._accountant.rates()
        # a dict first: the activity is decided from the rest of the status
        fields: dict[str, Any] = dict(
            version=__version__,
            peer_id=self._node.peer_id,
            state=state.mode,
            serving=state.serving,
            reason=state.reason,
            snoozed_until=state.until,
            experiment=next((j.manifest.name for j in self._joiners if j.manifest), None),
            projects=self.projects(),
            device=str(self._runtime.device) if self._runtime is not None else "none",
            experts=self._runtime.uids if self._runtime is not None else [],
            reachability=reachability,
            limits=self.limits(),
            started_at=self.started_at,
            uptime_s=time.monotonic() - self._started,
            connected_peers=len(self._node.connected_peers()),
            rates=Rates(
                samples_per_s=rates.samples_per_s,
                requests_per_s=rates.requests_per_s,
                upload_bytes_per_s=rates.upload_bytes_per_s,
                download_bytes_per_s=rates.download_bytes_per_s,
            ),
            today=today,
            schedule=self._schedule_status(),
            staleness=self._staleness(),
            identity_clash=self._node.dht.clones.clash(),
        )
        signals = Signals(
            experts=len(fields["experts"]),
            # the entries set aside are listed, not joined: they make no "joining" state
            projects=[p for p in fields["projects"] if p.state != "not_hosted"],
            mode=state.mode,
            serving=state.serving,
            reason=state.reason,
            snoozed_until=state.until,
            connected_peers=fields["connected_peers"],
            reachability=reachability.mode,
            port=_tcp_port(reachability.addrs or self._node.multiaddrs),
            last_answered_at=self._accountant.last_answered_at,
            now=now,
            unheard=self._unheard(),
            network=self._volunteer.network_allowed,
            quota=state.quota,
            upload_mbit=self._volunteer.limits.upload_mbit,
        )
        return Status(**fields, activity=decide_activity(signals))

    def experts(self) -> list[ExpertView]:
        """The hosted experts, for a client: their replicas are counted from now on for
        ``_REPLICAS_WANTED_S`` (at once when they were not being counted)."""
        self._replicas_asked = trio.current_time()
        self._replicas_wanted.set()
        return self._expert_views()

    def _expert_views(self) -> list[ExpertView]:
        now = time.time()
        saved_at = self._checkpointer.saved_at if self._checkpointer is not None else {}
        views = []
        for stats in self._runtime.statistics() if self._runtime is not None else []:
            saved = saved_at.get(stats.uid)
            views.append(
                ExpertView(
                    uid=stats.uid,
                    forward=stats.forward.requests,
                    backward=stats.backward.requests,
                    samples=stats.forward.samples + stats.backward.samples,
                    compute_s=stats.compute_s,
                    last_used=stats.last_used,
                    updates=stats.updates,
                    waiting=stats.forward.waiting + stats.backward.waiting,
                    replicas=self._replicas.get(stats.uid),
                    checkpoint_age_s=None if saved is None else max(0.0, now - saved),
                    staleness_mean=stats.staleness.mean,
                    staleness_max=stats.staleness.max if stats.staleness.count else None,
                )
            )
        return views

    def _staleness(self) -> Staleness:
        if self._runtime is None:
            return Staleness()
        s = self._runtime.staleness_statistics()
        return Staleness(
            backwards=s.count,
            mean=s.mean,
            max=s.max,
            histogram=s.by_bucket,
            stateless=s.stateless,
        )

    def peers(self) -> list[PeerView]:
        refused: dict[str, int] = {}
        for (peer, _reason), count in self._node.server.stats.refused.items():
            refused[peer] = refused.get(peer, 0) + count
        counted = self._accountant.peers
        connected = set(self._node.connected_peers())
        bans = self._runtime.guard.banned() if self._runtime is not None else {}
        ids = sorted(connected | set(counted) | set(refused) | set(bans))
        return [
            PeerView(
                peer_id=peer,
                requests=counted[peer].requests if peer in counted else 0,
                refused=refused.get(peer, 0) + (counted[peer].refused if peer in counted else 0),
                connected=peer in connected,
                banned=peer in bans,
                banned_s=round(bans.get(peer, 0.0), 1),
            )
            for peer in ids
        ]

    async def stats(self, since: float) -> Stats:
        store = self._accountant.store

        def read() -> Stats:
            now = time.time()
            history = _history(store.history(since), store.traffic_history(since))
            return Stats(
                today=_totals(store.current(localtime.day_start(now))),
                week=_totals(store.current(now - 7 * _DAY_S)),
                all_time=_totals(store.current(0.0)),
                history=history,
            )

        return await trio.to_thread.run_sync(read)

    def history(self) -> History:
        return History(
            every_s=HISTORY_EVERY_S, window_s=HISTORY_WINDOW_S, samples=list(self._history)
        )

    def _schedule_status(self) -> ScheduleStatus:
        if self._scheduler is None:
            return ScheduleStatus(zone=localtime.zone_name(), utc_offset_s=localtime.utc_offset_s())
        scheduled = self._scheduler.state()
        seen = scheduled.observation
        return ScheduleStatus(
            computing=scheduled.decision.compute,
            network=scheduled.decision.network,
            reason=scheduled.decision.reason,
            idle_s=seen.idle_s if seen is not None else None,
            on_battery=seen.on_battery if seen is not None else None,
            zone=localtime.zone_name(),
            utc_offset_s=localtime.utc_offset_s(),
        )

    def schedule(self) -> ScheduleView:
        if self._scheduler is None:
            raise ResourceUnavailable("this daemon runs no schedule")
        scheduled = self._scheduler.state()
        return ScheduleView(**scheduled.rules.model_dump(), idle_source=scheduled.idle_source)

    async def set_schedule(self, change: ScheduleChange) -> ScheduleView:
        if self._scheduler is None:
            raise ResourceUnavailable("this daemon runs no schedule")
        if changes := change.changes():
            # validated whole by the scheduler before anything is applied
            await self._scheduler.set_rules(**changes)
        return self.schedule()

    def limits(self) -> LimitsView:
        limits = self._volunteer.limits
        throttle = self._node.throttle.statistics()
        return LimitsView(
            **limits.model_dump(), month_bytes=throttle.month_bytes, day_bytes=throttle.day_bytes
        )

    async def metrics(self) -> str:
        """Prometheus text format (version 0.0.4)."""
        status = await self.status()
        lines: list[str] = []

        def metric(name: str, kind: str, help_: str, samples: list[tuple[str, float]]) -> None:
            lines.append(f"# HELP volunteerd_{name} {help_}")
            lines.append(f"# TYPE volunteerd_{name} {kind}")
            lines.extend(f"volunteerd_{name}{labels} {value:g}" for labels, value in samples)

        def label(**values: str) -> str:
            inner = ",".join(
                '{}="{}"'.format(
                    k, v.replace("\\", "\\\\").replace('"', '\\"').replace("\n", "\\n")
                )
                for k, v in values.items()
            )
            return "{" + inner + "}"

        metric("serving", "gauge", "1 while serving experts", [("", float(status.serving))])
        metric(
            "uptime_seconds", "gauge", "seconds since the daemon started", [("", status.uptime_s)]
        )
        metric(
            "connected_peers",
            "gauge",
            "open libp2p connections",
            [("", float(status.connected_peers))],
        )
        metric("experts_hosted", "gauge", "experts served", [("", float(len(status.experts)))])
        experts = self._expert_views()  # a scraper does not keep replicas counted
        metric(
            "expert_requests_total",
            "counter",
            "expert calls answered since start",
            [
                (label(uid=e.uid, kind=kind), float(count))
                for e in experts
                for kind, count in (("forward", e.forward), ("backward", e.backward))
            ],
        )
        metric(
            "expert_samples_total",
            "counter",
            "samples computed since start",
            [(label(uid=e.uid), float(e.samples)) for e in experts],
        )
        metric(
            "expert_compute_seconds_total",
            "counter",
            "worker seconds since start",
            [(label(uid=e.uid), e.compute_s) for e in experts],
        )
        metric(
            "refused_total",
            "counter",
            "expert calls refused since start, by reason",
            [(label(reason=r), float(n)) for r, n in sorted(self._accountant.refusals.items())],
        )
        throttle = self._node.throttle.statistics()
        metric(
            "transfer_bytes_total",
            "counter",
            "bytes on volunteerd streams since start",
            [
                (label(direction="up"), float(throttle.bytes_up)),
                (label(direction="down"), float(throttle.bytes_down)),
            ],
        )
        connections = self._node.connections.statistics()
        metric(
            "inbound_slots",
            "gauge",
            "inbound connection slots: taken now, and in all",
            [
                (label(state="used"), float(connections.inbound_slots_used)),
                (label(state="total"), float(connections.inbound_slots)),
            ],
        )
        metric(
            "idle_connections_closed_total",
            "counter",
            "idle inbound connections closed to free slots",
            [("", float(connections.trimmed))],
        )
        metric(
            "inflight_request_bytes",
            "gauge",
            "declared bytes of requests being read or answered now, all peers",
            [("", float(self._node.server.inflight_bytes))],
        )
        runtime = self._runtime
        retained = runtime.retained_statistics().nbytes if runtime is not None else 0
        metric(
            "retained_bytes",
            "gauge",
            "memory of forward passes kept for their backward (and reserved for ones running)",
            [("", float(retained))],
        )
        dht = self._node.dht.statistics()
        stores = (("records", dht.records), ("manifests", dht.manifests))
        metric(
            "dht_store_bytes",
            "gauge",
            "estimated memory of what this node stores for others, and its budget",
            [
                sample
                for name, store in stores
                for sample in (
                    (label(store=name, kind="used"), float(store.bytes)),
                    (label(store=name, kind="budget"), float(store.budget_bytes)),
                )
            ],
        )
        metric(
            "dht_store_records",
            "gauge",
            "records this node stores for others",
            [(label(store=name), float(store.records)) for name, store in stores],
        )
        metric(
            "dht_store_refused_total",
            "counter",
            "records refused by this node's store, by reason",
            [
                (label(store=name, reason=reason), float(count))
                for name, store in stores
                for reason, count in sorted(store.refused.items())
            ],
        )
        guarded: dict[str, int] = {}
        for (_, reason), count in runtime.guard.counts.items() if runtime is not None else ():
            guarded[reason] = guarded.get(reason, 0) + count
        metric(
            "guard_total",
            "counter",
            "trainer requests clipped, refused, undone or refused while banned, by reason",
            [(label(reason=r), float(n)) for r, n in sorted(guarded.items())],
        )
        metric(
            "guard_banned_peers",
            "gauge",
            "trainers this daemon refuses now",
            [("", float(len(runtime.guard.banned()) if runtime is not None else 0))],
        )
        metric(
            "limit_mbit",
            "gauge",
            "bandwidth limits (0 = none)",
            [
                (label(direction="up"), status.limits.upload_mbit),
                (label(direction="down"), status.limits.download_mbit),
            ],
        )
        metric(
            "samples_today_total",
            "counter",
            "samples computed today (local time)",
            [("", float(status.today.samples))],
        )
        return "\n".join(lines) + "\n"

    # -- changes ---------------------------------------------------------------------

    async def pause(self) -> None:
        await self._volunteer.pause()

    async def resume(self) -> None:
        await self._volunteer.resume()

    async def snooze(self, seconds: float) -> None:
        await self._volunteer.snooze(seconds)

    async def set_limits(self, change: LimitsChange) -> LimitsView:
        changes: dict[str, Any] = change.changes()
        if changes:
            # validated whole by the volunteer before anything is applied
            await self._volunteer.set_limits(**changes)
        return self.limits()

    def shutdown(self) -> None:
        """Stop the daemon gracefully, a moment after the reply to this request left;
        for good, also when a join or leave asked for a restart just before (the tray's
        "Quit" a moment after a join restarted the daemon instead)."""
        self.events.post("state", "stopping (asked through the control API)")
        self._stopping = True
        if self._restarting:  # stopping already, to start again: for good instead
            self._request_stop()
        else:
            self._after_reply(self._request_stop)

    def _restart(self) -> None:
        """The restart a join or leave asked for, unless a stop was asked since."""
        if self._stopping:
            return
        self._restarting = True
        self._request_restart()

    def _after_reply(self, stop: Callable[[], None]) -> None:
        if self._nursery is None:
            stop()
            return

        async def stop_soon() -> None:
            await trio.sleep(_STOP_AFTER_S)
            stop()

        self._nursery.start_soon(stop_soon)

    # -- projects --------------------------------------------------------------------

    def projects(self) -> list[ProjectView]:
        joiners = {j.name: j for j in self._joiners}
        hosted = [_project_view(p, joiners.get(p.name)) for p in self._projects]
        return hosted + [
            ProjectView.not_hosted(e.name, e.owner, e.problem, e.advice()) for e in self._set_aside
        ]

    async def join_project(self, body: ProjectJoin) -> ProjectJoined:
        """Record the project ``body.invitation`` names (in place of one of the same
        name) and restart into it, unless a dry run or already running it as recorded.
        A project of that name of another owner is replaced only with ``body.replace``
        (the reply's ``replaces_owner`` names that owner; a dry run says so too).
        Raises ConfigError: a bad invitation (what is wrong), the config's project's
        name, a bad projects file or too many projects; ControlError (409) for another
        owner's project without ``replace``, and when the restart would not start
        (``_restart_would_start``), before anything is recorded."""
        project = Project.invited(
            parse_invitation(body.invitation), share=body.share, joined_at=time.time()
        )
        if any(p.from_config and p.name == project.name for p in self._projects):
            raise ConfigError(
                f"project {project.name!r} is joined through the config file "
                "(experiments.join) already"
            )
        replaces = await self._replaced_owner(project)
        if replaces is not None and not body.replace and not body.dry_run:
            raise ControlError(
                f"joining {project.name!r} of owner {short_id(project.owner)}: "
                f"{replacing(project.name, replaces)}. Nothing was changed: to join it "
                'all the same, send "replace": true',
                status=409,
            )
        # joined already as asked: record it again (in case the file was edited since),
        # but nothing to restart for
        running = next((p for p in self._projects if p.same_entry(project)), None)
        if not body.dry_run and running is None:
            await self._restart_would_start(f"join {project.name!r}")
        if not body.dry_run:
            await trio.to_thread.run_sync(
                partial(join_project, self._projects_file, project, replace=body.replace)
            )
        if body.dry_run or running is not None:
            joiners = {j.name: j for j in self._joiners}
            view = _project_view(running or project, joiners.get(project.name) if running else None)
            return ProjectJoined(project=view, restarting=False, replaces_owner=replaces)
        instead = f" in place of owner {short_id(replaces)}'s" if replaces else ""
        logger.info(
            "joined project %r of %s%s; restarting to host it",
            project.name,
            short_id(project.owner),
            instead,
        )
        self.events.post(
            "projects", f"joined project {project.name}{instead}: restarting to host it"
        )
        self._after_reply(self._restart)
        return ProjectJoined(
            project=_project_view(project, None), restarting=True, replaces_owner=replaces
        )

    async def _replaced_owner(self, project: Project) -> str | None:
        """The owner of the recorded project of ``project.name`` when another owner's
        (``swarm.projects.replaced_owner``). None too when the projects file does not
        load: the join is refused for that, with its own words, a moment later."""
        try:
            recorded = await trio.to_thread.run_sync(read_projects, self._projects_file)
        except (ConfigError, OSError):
            return None
        return replaced_owner(recorded.entries(), project)

    async def leave_project(self, name: str) -> ProjectLeft | None:
        """Forget project ``name`` and restart without it; None when there is no such
        project. Raises ConfigError for the config's project (edit the file); ControlError
        (409) when the restart would not start, before anything is changed."""
        if any(p.from_config and p.name == name for p in self._projects):
            raise ConfigError(
                f"project {name!r} comes from the config file (experiments.join): "
                "remove it there, then restart volunteerd"
            )
        running = any(p.name == name for p in self._projects)
        if running:
            await self._restart_would_start(f"leave {name!r}")
        removed = await trio.to_thread.run_sync(leave_project, self._projects_file, name)
        if removed:  # every entry of the name left the file
            self._set_aside = [e for e in self._set_aside if e.name != name]
        if not removed and not running:
            return None
        if running:
            logger.info("left project %r; restarting without it", name)
            self.events.post("projects", f"left project {name}: restarting without it")
            self._after_reply(self._restart)
        return ProjectLeft(left=name, restarting=running)

    async def _restart_would_start(self, change: str) -> None:
        """Raises ControlError (409) when the daemon, restarted now, would not start: the
        config file, limits.toml, schedule.toml or projects.toml was edited badly since
        it started (read only at a start). It would have answered "restarting" and
        been gone, its exit status in a log."""
        try:
            await trio.to_thread.run_sync(self._check_restart)
        except (ConfigError, OSError) as exc:
            raise ControlError(
                f"cannot {change} now: volunteerd would restart for it into a configuration "
                f"that does not load, and stop. Fix it first; this daemon goes on as it is.\n"
                f"{exc}",
                status=409,
            ) from None

    # -- replicas --------------------------------------------------------------------

    async def serve(self, *, task_status: TaskStatus[None] = trio.TASK_STATUS_IGNORED) -> None:
        """Count the replicas of the hosted experts and sample the rates until
        cancelled (and run the delayed stop of ``shutdown``)."""
        async with trio.open_nursery() as nursery:
            self._nursery = nursery
            task_status.started()
            nursery.start_soon(self._sample_history)
            await self._count_replicas()

    async def _sample_history(self) -> None:
        while True:
            rates = self._accountant.rates()
            self._history.append(
                HistorySample(
                    t=time.time(),
                    samples_per_s=rates.samples_per_s,
                    requests_per_s=rates.requests_per_s,
                    upload_bytes_per_s=rates.upload_bytes_per_s,
                    download_bytes_per_s=rates.download_bytes_per_s,
                )
            )
            await trio.sleep(HISTORY_EVERY_S)

    def _replicas_due(self) -> bool:
        """Whether to count the replicas now: some expert hosted, a client asked for
        them lately, and network use allowed (not paused, within the network hours, no
        quota used up)."""
        return (
            self._runtime is not None
            and bool(self._runtime.uids)
            and trio.current_time() - self._replicas_asked < _REPLICAS_WANTED_S
            and self._volunteer.network_allowed
        )

    async def _count_replicas(self) -> None:
        while True:
            if not self._replicas_due():
                # a client asking wakes it; network use allowed again is seen within
                # a round
                self._replicas_wanted = trio.Event()
                with trio.move_on_after(_REPLICAS_EVERY_S):
                    await self._replicas_wanted.wait()
                continue
            uids = self._runtime.uids if self._runtime is not None else []
            if uids:
                try:
                    found = await self._node.dht.get(uids)
                except Exception as exc:  # the next round tries again
                    logger.debug("replica lookup failed: %s", exc)
                else:
                    me = self._node.peer_id
                    self._replicas = {
                        uid: len({r.peer_id for r in records if r.peer_id != me})
                        for uid, records in found.items()
                    }
            await trio.sleep(_REPLICAS_EVERY_S)


def _project_view(project: Project, joiner: Joiner | None) -> ProjectView:
    """``project`` as the API shows it: its manifest's words once found, and the state
    of its joiner (none yet: joining)."""
    manifest = joiner.manifest if joiner is not None else None
    return ProjectView(
        name=project.name,
        owner=manifest.owner if manifest is not None else project.owner,
        owner_name=manifest.owner_name if manifest is not None else "",
        description=manifest.description if manifest is not None else "",
        homepage=manifest.homepage if manifest is not None else "",
        share=project.share,
        state=joiner.state if joiner is not None else "joining",
        experts=len(joiner.hosted) if joiner is not None else 0,
        error=joiner.error if joiner is not None else None,
        expired_at=joiner.expired_at if joiner is not None else None,
        too_big=joiner.too_big if joiner is not None else False,
        waiting=joiner.waiting if joiner is not None else None,
    )
