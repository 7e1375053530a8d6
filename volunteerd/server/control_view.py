"""What the control API sees of a running daemon: snapshots built from its services,
and the changes it may ask for (pause, resume, snooze, limits, stop).

``ControlView`` implements ``control.api.Controls``. The events it serves are posted
by the services themselves (``server.events``); its ``serve`` task looks up every
``_REPLICAS_EVERY_S`` how many other peers announce each hosted expert.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable
from dataclasses import asdict
from typing import TYPE_CHECKING, Any

import trio

from volunteerd import __version__
from volunteerd.control.events import EventLog
from volunteerd.control.models import (
    ExpertView,
    LimitsChange,
    LimitsView,
    PeerView,
    Rates,
    Reachability,
    Stats,
    StatsBucket,
    Status,
    Totals,
)
from volunteerd.net import Node
from volunteerd.runtime import ExpertRuntime
from volunteerd.runtime.checkpointer import Checkpointer
from volunteerd.server.contribution import Accountant
from volunteerd.server.pausing import Volunteer
from volunteerd.stats import Totals as StoreTotals

if TYPE_CHECKING:
    from trio_typing import TaskStatus

__all__ = ["ControlView"]

logger = logging.getLogger(__name__)

_REPLICAS_EVERY_S = 30.0
_DAY_S = 86400.0
_STOP_AFTER_S = 0.2  # lets the reply to a shutdown request leave first


def _local_midnight(now: float) -> float:
    t = time.localtime(now)
    return time.mktime((t.tm_year, t.tm_mon, t.tm_mday, 0, 0, 0, 0, 0, -1))


def _totals(t: StoreTotals) -> Totals:
    return Totals(
        **asdict(t.work), running_s=t.running_s, paused_s=t.paused_s, rejected=dict(t.rejected)
    )


class ControlView:
    """What the control API reads of the daemon's services, and the changes it asks
    for (through ``Volunteer``, which posts them as events)."""

    def __init__(
        self,
        *,
        node: Node,
        runtime: ExpertRuntime,
        volunteer: Volunteer,
        checkpointer: Checkpointer | None,
        accountant: Accountant,
        experiment: Callable[[], str | None],
        request_stop: Callable[[], None],
        events: EventLog,
    ) -> None:
        self._node = node
        self._runtime = runtime
        self._volunteer = volunteer
        self._checkpointer = checkpointer
        self._accountant = accountant
        self._experiment = experiment
        self._request_stop = request_stop
        self.events = events
        self.started_at = time.time()
        self._replicas: dict[str, int] = {}
        self._nursery: trio.Nursery | None = None

    # -- snapshots -------------------------------------------------------------------

    def status(self) -> Status:
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
                last_upgrade_at=report.upgrades.last_upgrade_at,
            )
        rates = self._accountant.rates()
        store = self._accountant.store
        return Status(
            version=__version__,
            peer_id=self._node.peer_id,
            state=state.mode,
            serving=state.serving,
            reason=state.reason,
            snoozed_until=state.until,
            experiment=self._experiment(),
            device=str(self._runtime.device),
            experts=self._runtime.uids,
            reachability=reachability,
            limits=self.limits(),
            started_at=self.started_at,
            uptime_s=now - self.started_at,
            connected_peers=len(self._node.connected_peers()),
            rates=Rates(
                samples_per_s=rates.samples_per_s,
                requests_per_s=rates.requests_per_s,
                upload_bytes_per_s=rates.upload_bytes_per_s,
                download_bytes_per_s=rates.download_bytes_per_s,
            ),
            today=_totals(store.current(_local_midnight(now))),
        )

    def experts(self) -> list[ExpertView]:
        now = time.time()
        saved_at = self._checkpointer.saved_at if self._checkpointer is not None else {}
        views = []
        for stats in self._runtime.statistics():
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
                )
            )
        return views

    def peers(self) -> list[PeerView]:
        refused: dict[str, int] = {}
        for (peer, _reason), count in self._node.server.stats.refused.items():
            refused[peer] = refused.get(peer, 0) + count
        counted = self._accountant.peers
        connected = set(self._node.connected_peers())
        ids = sorted(connected | set(counted) | set(refused))
        return [
            PeerView(
                peer_id=peer,
                requests=counted[peer].requests if peer in counted else 0,
                refused=refused.get(peer, 0) + (counted[peer].refused if peer in counted else 0),
                connected=peer in connected,
            )
            for peer in ids
        ]

    async def stats(self, since: float) -> Stats:
        store = self._accountant.store

        def read() -> Stats:
            now = time.time()
            history = store.history(since)
            return Stats(
                today=_totals(store.current(_local_midnight(now))),
                week=_totals(store.current(now - 7 * _DAY_S)),
                all_time=_totals(store.current(0.0)),
                history=[
                    StatsBucket(start=bucket, size_s=size, **asdict(w))
                    for bucket, size, w in history
                ],
            )

        return await trio.to_thread.run_sync(read)

    def limits(self) -> LimitsView:
        limits = self._volunteer.limits
        return LimitsView(
            **limits.model_dump(), month_bytes=self._node.throttle.statistics().month_bytes
        )

    def metrics(self) -> str:
        """Prometheus text format (version 0.0.4)."""
        status = self.status()
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
        experts = self.experts()
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
        retained = self._runtime.retained_statistics()
        metric(
            "retained_bytes",
            "gauge",
            "memory of forward passes kept for their backward (and reserved for ones running)",
            [("", float(retained.nbytes))],
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
        for (_, reason), count in self._runtime.guard.counts.items():
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
            [("", float(len(self._runtime.guard.banned())))],
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
        """Stop the daemon gracefully, a moment after the reply to this request left."""
        self.events.post("state", "stopping (asked through the control API)")
        if self._nursery is None:
            self._request_stop()
            return

        async def stop_soon() -> None:
            await trio.sleep(_STOP_AFTER_S)
            self._request_stop()

        self._nursery.start_soon(stop_soon)

    # -- replicas --------------------------------------------------------------------

    async def serve(self, *, task_status: TaskStatus[None] = trio.TASK_STATUS_IGNORED) -> None:
        """Count the replicas of the hosted experts until cancelled (and run the
        delayed stop of ``shutdown``)."""
        async with trio.open_nursery() as nursery:
            self._nursery = nursery
            task_status.started()
            await self._count_replicas()

    async def _count_replicas(self) -> None:
        while True:
            uids = self._runtime.uids
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
