"""What the daemon is doing for the volunteer, said honestly: one state, one line to
show, and what to do about it (``Status.activity``; the CLI's ``status``, the
dashboard's header and the tray's tooltip show it).

``decide_activity`` is pure: ``ControlView`` reads the signals off the services and
passes them in. The first rule that holds decides::

    not_in_project  no expert hosted and no project recorded
    joining         no expert hosted yet, a project recorded (its experts on the way;
                    waiting, and why, while bulk transfers are held: paused, a quota,
                    the network hours, or a replica busy serving others; how far a
                    download under way is, and the time left; or the join failed: the
                    message says why)
    paused          not serving by choice or rule: paused, snoozed, a quota, the schedule
    no_peers        no peer connected
    unreachable     peers cannot dial this node and no relay carries its connections
    no_peers        no expert call answered in the last ``WAITING_AFTER_S`` and the
                    last announcements reached no other peer ("cut off": connections
                    that died with the network, or no bootstrap peers; with an upload
                    limit set, that limit may be why, and it is named first)
    waiting         serving, but no expert call answered in the last ``WAITING_AFTER_S``
                    (with an upload limit set: trainers may pass slow experts over)
    contributing    otherwise
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Protocol

from volunteerd.control.models import Activity, ActivityState
from volunteerd.shown import clock_time, one_line

__all__ = ["WAITING_AFTER_S", "ProjectSignal", "Signals", "decide_activity"]

# A trainer calls every expert it routes to many times a minute; two quiet minutes mean
# no training runs that uses this node (or none reaches it).
WAITING_AFTER_S = 120.0

# A failed join's error in the message: any exception's text, which can quote a peer or
# an owner (an error reply, a manifest's fault). One line, its start if long.
_ERROR_CHARS = 400

_JOIN_HINT = "join one with `volunteerd join <invitation>` or the dashboard's Join a project"


class ProjectSignal(Protocol):
    """What the decision reads of a recorded project (``control.models.ProjectView``)."""

    @property
    def name(self) -> str: ...
    @property
    def state(self) -> str: ...  # "joining", "joined" or "failed"
    @property
    def error(self) -> str | None: ...
    @property
    def expired_at(self) -> float | None: ...  # its manifest's, when that is why it failed
    @property
    def too_big(self) -> bool: ...  # its experts do not fit this computer's memory budget
    @property
    def waiting(self) -> str | None: ...  # "waiting for a busy replica of ffn.3.1, ..."


@dataclass(frozen=True, slots=True)
class Signals:
    """The daemon at one moment, as far as its activity depends on it."""

    experts: int  # hosted now
    projects: Sequence[ProjectSignal]  # recorded in projects.toml
    mode: str  # the volunteer's: running, paused, snoozed, quota, scheduled...
    serving: bool  # requests accepted now (a pause or resume may be under way)
    reason: str  # why not serving, for people ("" while running)
    snoozed_until: float | None  # time.time() of a snooze's end
    connected_peers: int
    reachability: str  # direct, relayed, unreachable, unknown or local
    port: int | None  # the TCP port peers would dial, when known
    last_answered_at: float | None  # time.time() of the last expert call answered
    now: float
    unheard: bool = False  # the experts' last announcements reached no other peer
    # Bulk transfers may run (``Volunteer.network_allowed``): a project's experts
    # download only then, so a join waits while the daemon is held back.
    network: bool = True
    quota: str | None = None  # the quota used up: "monthly" or "daily" (mode "quota")
    upload_mbit: float = 0.0  # the volunteer's upload limit (0: none)


def decide_activity(s: Signals) -> Activity:
    """The first rule of the module docstring's table that holds."""
    if s.experts == 0:
        if not s.projects:
            return _activity("not_in_project", "not in a project", _JOIN_HINT)
        return _joining(s)
    if s.mode != "running":
        return _paused(s)
    if s.connected_peers == 0:
        return _activity(
            "no_peers",
            "no peers",
            "check the internet connection; if it works, the peers to join through may "
            "be down (the project's invitation, or network.bootstrap_peers)",
        )
    if s.reachability == "unreachable":
        port = f"TCP port {s.port}" if s.port else "the TCP port it listens on (network.port)"
        return _activity(
            "unreachable",
            "unreachable: peers cannot connect to this computer",
            f"forward {port} on your router to this computer, or let a relay carry "
            'its connections: reachability.mode = "relay"',
        )
    if not s.serving:
        return _activity("waiting", "resuming", "the experts are being put back to work")
    idle = s.last_answered_at is None or s.now - s.last_answered_at > WAITING_AFTER_S
    limited = f"{s.upload_mbit:g} Mbit/s" if s.upload_mbit > 0 else ""
    if idle and s.unheard and limited:
        # Peers connected and an upload limit: its messages may be what is slow (they
        # wait their turn among the replies going out), not the network. "Cut off"
        # blamed the internet connection of a volunteer with 7 peers connected.
        return _activity(
            "no_peers",
            "its announcements reach no other peer",
            "trainers find experts through other peers, and none keeps its records now: "
            f"its upload limit ({limited}) may be too low for what it hosts (raise it "
            "with `volunteerd limit --up MBIT` or in the dashboard's limits); if not, "
            "check the internet connection (it joins through its bootstrap peers again "
            "by itself)",
        )
    if idle and s.unheard:
        return _activity(
            "no_peers",
            "cut off: its announcements reach no other peer",
            "trainers find experts through other peers, and none keeps its records: check "
            "the internet connection (it joins through its bootstrap peers again by "
            "itself); without bootstrap peers, only trainers that dial it directly find it",
        )
    if idle:
        slow = (
            f" (with its upload limit of {limited}, trainers may pass its experts over "
            "as slow for a while)"
            if limited
            else ""
        )
        return _activity(
            "waiting",
            "waiting for work",
            f"ready with {_experts(s.experts)} and {s.connected_peers} peers; no trainer "
            f"has called them in the last {WAITING_AFTER_S / 60:g} minutes{slow}",
        )
    return _activity("contributing", "contributing")


def _joining(s: Signals) -> Activity:
    projects = s.projects
    on_the_way = [p.name for p in projects if p.state != "failed"]
    if on_the_way and not s.network:
        # Not "downloading": nothing is, until the hold ends (a daily quota: midnight).
        why, remedy = _held_join(s)
        return _activity("joining", f"joining {', '.join(on_the_way)}: waiting, {why}", remedy)
    busy = next((p for p in projects if p.state != "failed" and p.waiting), None)
    if busy is not None:
        waiting = busy.waiting or ""
        if waiting.startswith("downloading"):
            remedy = (
                "it downloads its experts' trained weights from their replicas; it "
                "contributes once they are ready"
            )
        elif "quota" in waiting:
            remedy = (
                "its experts' replicas have used their transfer quota for the day; it "
                "downloads them then (their trained weights, not a fresh start), and hosts "
                "experts other volunteers can give meanwhile"
            )
        else:
            remedy = (
                "its experts' replicas are serving others first; it downloads them in turn "
                "(its trained weights, not a fresh start)"
            )
        return _activity("joining", f"joining {busy.name}: {busy.waiting}", remedy)
    if on_the_way:
        return _activity(
            "joining",
            f"joining {', '.join(on_the_way)}",
            "finding its peers and downloading the experts to host; it contributes "
            "once they are ready",
        )
    failed = projects[0]
    why = f": {_one_line(failed.error)}" if failed.error else ""
    # an expired manifest, or experts too big for this computer, are no network's fault
    if failed.expired_at is not None:
        fix = "it looks for a newer one by itself"
    elif failed.too_big:
        fix = "it tries again by itself, in case memory was freed"
    else:
        fix = "check the internet connection; it tries again by itself"
    return _activity(
        "joining",
        f"could not join {failed.name}{why}",
        f"{fix}. `volunteerd leave {failed.name}` forgets the project",
    )


def _paused(s: Signals) -> Activity:
    if s.mode == "paused":
        return _activity(
            "paused",
            "paused by you",
            "resume with `volunteerd resume`, the dashboard or the tray",
        )
    if s.mode == "snoozed" and s.snoozed_until is not None:
        until = clock_time(s.snoozed_until, s.now)
        return _activity(
            "paused",
            f"snoozed until {until}",
            "it resumes by itself then; `volunteerd resume` resumes now",
        )
    if s.mode == "quota":
        return _activity(
            "paused",
            f"paused: {s.reason or 'the transfer quota is used up'}",
            f"it resumes {_quota_remedy(s.quota)}",
        )
    if s.mode == "scheduled":
        return _activity(
            "paused",
            f"paused: {s.reason or 'outside the hours set to compute'}",
            "it resumes by itself; change when it computes in the dashboard's schedule "
            "(the [schedule] settings)",
        )
    return _activity("paused", f"paused: {s.reason or s.mode}", "")


def _held_join(s: Signals) -> tuple[str, str]:
    """What holds a join's downloads back (``s.network`` is false), and what to do."""
    if s.mode == "paused":
        return "paused by you", (
            "its experts download once it resumes: `volunteerd resume`, the dashboard or the tray"
        )
    if s.mode == "snoozed" and s.snoozed_until is not None:
        until = clock_time(s.snoozed_until, s.now)
        return f"snoozed until {until}", (
            "its experts download when the snooze ends; `volunteerd resume` resumes now"
        )
    if s.mode == "quota":
        used_up = f"the {s.quota} transfer quota" if s.quota else "a transfer quota"
        return f"{used_up} is used up", f"its experts download {_quota_remedy(s.quota)}"
    if s.mode == "scheduled":
        return s.reason or "outside the network hours", (
            "its experts download within the network hours; change them in the "
            "dashboard's schedule (the [schedule] settings)"
        )
    return s.reason or s.mode, ""


def _quota_remedy(quota: str | None) -> str:
    """When a used-up ``quota`` renews, and the flag that raises it (a daily quota's is
    not the monthly one's: raising the monthly one left the daemon paused)."""
    if quota == "daily":
        return (
            "after midnight; raise the daily quota with `volunteerd limit --daily-gb GB` "
            "or in the dashboard's limits"
        )
    if quota == "monthly":
        return (
            "when the month turns over; raise the monthly quota with "
            "`volunteerd limit --quota GB` or in the dashboard's limits"
        )
    return (
        "when the quota renews; raise it with `volunteerd limit --quota GB` (monthly) or "
        "`--daily-gb GB` (daily), or in the dashboard's limits"
    )


def _one_line(text: str) -> str:
    """``text`` on one line (runs of white space, line breaks included, as one space),
    any other control or invisible character as its escape, cut to ``_ERROR_CHARS``."""
    text = one_line(text)
    if len(text) > _ERROR_CHARS:
        text = f"{text[: _ERROR_CHARS - 3]}..."
    return text


def _experts(n: int) -> str:
    return f"{n} expert" + ("s" if n != 1 else "")


def _activity(state: ActivityState, message: str, hint: str = "") -> Activity:
    return Activity(state=state, message=message, hint=hint)
