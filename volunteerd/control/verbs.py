"""The CLI's control verbs (``status``, ``pause``, ``resume``, ``snooze``, ``limit``,
``dashboard``, ``join``, ``leave``, ``projects``): calls through the typed client, and
what they print for people."""

from __future__ import annotations

import re
from collections.abc import Sequence

from volunteerd import localtime
from volunteerd.control.models import (
    LimitsView,
    ProjectJoined,
    ProjectView,
    ScheduleStatus,
    ScheduleView,
    Status,
)
from volunteerd.shown import escaped

__all__ = [
    "describe_change",
    "describe_invitation",
    "describe_joined",
    "format_bytes",
    "format_duration",
    "format_limits",
    "format_projects",
    "format_schedule",
    "format_status",
    "parse_duration",
]

_UNITS = {"s": 1, "m": 60, "h": 3600, "d": 86400}
# What a terminal acts on rather than shows: escape sequences, line breaks, bidi overrides.


def _shown(text: str) -> str:
    """``text`` with every control or invisible character written as its escape: lines
    printed from the daemon's status can carry text that came from peers (an error, an
    address), and an ESC, a newline or U+202E would act on the terminal (a forged line,
    colours, reversed text) instead of being read."""
    return escaped(text)


def _lines(lines: Sequence[str]) -> str:
    return "\n".join(_shown(line) for line in lines)


def parse_duration(text: str) -> float:
    """``90``, ``90s``, ``30m``, ``2h``, ``1d`` or ``1h30m`` to seconds; ValueError else."""
    text = text.strip().lower()
    if re.fullmatch(r"\d+(\.\d+)?", text):
        seconds = float(text)
    else:
        parts = re.findall(r"(\d+(?:\.\d+)?)([smhd])", text)
        if not parts or "".join(n + u for n, u in parts) != text:
            raise ValueError(f"not a duration: {text!r} (e.g. 90s, 30m, 2h, 1h30m)")
        seconds = sum(float(n) * _UNITS[u] for n, u in parts)
    if seconds <= 0:
        raise ValueError("a duration must be positive")
    return seconds


def format_bytes(n: float) -> str:
    for unit in ("B", "KB", "MB", "GB", "TB"):
        if abs(n) < 1000 or unit == "TB":
            return f"{n:.0f} {unit}" if unit == "B" else f"{n:.1f} {unit}"
        n /= 1000
    raise AssertionError  # pragma: no cover


def format_duration(seconds: float) -> str:
    seconds = int(seconds)
    days, rest = divmod(seconds, 86400)
    hours, rest = divmod(rest, 3600)
    minutes, secs = divmod(rest, 60)
    if days:
        return f"{days}d {hours}h"
    if hours:
        return f"{hours}h {minutes}m"
    if minutes:
        return f"{minutes}m {secs}s"
    return f"{secs}s"


def _mbit(value: float) -> str:
    return "unlimited" if value == 0 else f"{value:g} Mbit/s"


def _quota(gb: float, used: int) -> str:
    return "none" if gb == 0 else f"{gb:g} GB ({format_bytes(used)} used)"


def _quotas_said(limits: LimitsView) -> str:
    """The quotas that are set, for the status's limits line ("" when none is): a
    volunteer whose traffic stopped at midnight's quota saw only the rates there."""
    said = []
    if limits.daily_quota_gb:
        said.append(f"daily quota {_quota(limits.daily_quota_gb, limits.day_bytes)}")
    if limits.monthly_quota_gb:
        said.append(f"monthly quota {_quota(limits.monthly_quota_gb, limits.month_bytes)}")
    return "".join(f"; {quota}" for quota in said)


def format_limits(limits: LimitsView) -> str:
    return "\n".join(
        [
            f"upload        {_mbit(limits.upload_mbit)}",
            f"download      {_mbit(limits.download_mbit)}",
            f"monthly quota {_quota(limits.monthly_quota_gb, limits.month_bytes)}",
            f"daily quota   {_quota(limits.daily_quota_gb, limits.day_bytes)}",
            f"disk budget   {f'{limits.disk_budget_gb:g} GB' if limits.disk_budget_gb else 'none'}",
            f"CPU threads   {limits.cpu_threads or 'default'}",
            f"duty cycle    {limits.duty_cycle:g}",
            f"batch cap     {limits.max_batch_size or 'none'}",
        ]
    )


def format_schedule(schedule: ScheduleView, now: ScheduleStatus | None = None) -> str:
    """What ``volunteerd schedule`` prints: the rules, then what they mean now."""
    run = (
        f"when idle for {schedule.idle_minutes:g} min" if schedule.run == "when_idle" else "always"
    )
    gpu = (
        f"when idle for {schedule.idle_minutes:g} min" if schedule.gpu == "when_idle" else "always"
    )
    lines = [
        f"run           {run}",
        f"on battery    {'yes' if schedule.on_battery else 'no (pauses)'}",
        f"compute hours {', '.join(schedule.compute_hours) or 'any time'}",
        f"network hours {', '.join(schedule.network_hours) or 'any time'}",
        f"GPU           {gpu}",
        *_zone_line(now),
    ]
    if now is not None:
        state = "computing" if now.computing and now.network else f"waiting: {now.reason}"
        idle = "unknown" if now.idle_s is None else format_duration(now.idle_s)
        battery = {None: "unknown", True: "yes", False: "no"}[now.on_battery]
        lines += [
            f"now           {state}",
            f"idle for      {idle} (read with {schedule.idle_source})",
            f"on battery    {battery}",
        ]
    return "\n".join(lines)


def _zone_line(now: ScheduleStatus | None) -> list[str]:
    """The time zone the daemon's hours and days go by (an older daemon's: none)."""
    if now is None or now.zone is None:
        return []
    offset = "" if now.utc_offset_s is None else f" ({localtime.offset_words(now.utc_offset_s)})"
    return [f"time zone     {escaped(now.zone)}{offset}"]


def format_status(status: Status) -> str:
    activity = status.activity
    today = status.today
    rates = status.rates
    reach = status.reachability
    lines = [
        f"state         {activity.message}",
        *([f"what to do    {activity.hint}"] if activity.hint else []),
        *([f"warning       {status.identity_clash}"] if status.identity_clash else []),
        f"peer id       {status.peer_id}",
        f"projects      {_projects_line(status)}",
        f"device        {status.device}",
        f"experts       {len(status.experts)}"
        + (f": {', '.join(status.experts[:6])}" if status.experts else "")
        + (" …" if len(status.experts) > 6 else ""),
        f"peers         {status.connected_peers} connected",
        f"reachability  {reach.mode}" + (f" — {reach.advice}" if reach.advice else ""),
        *(
            [
                f"hole punching {reach.upgraded} relayed connections made direct, "
                f"{reach.hole_punch_failed} attempts failed"
            ]
            if reach.upgraded or reach.hole_punch_failed
            else []
        ),
        f"uptime        {format_duration(status.uptime_s)}",
        f"now           {rates.samples_per_s:.1f} samples/s, "
        f"up {format_bytes(rates.upload_bytes_per_s)}/s, "
        f"down {format_bytes(rates.download_bytes_per_s)}/s",
        f"today         {today.samples:,} samples in {today.requests:,} requests, "
        f"{format_duration(today.compute_s)} of compute (wall clock)",
        # all traffic (what the quotas count), then the expert calls' tensors in it
        f"data today    {format_bytes(today.bytes_sent)} sent, "
        f"{format_bytes(today.bytes_received)} received; of which expert calls "
        f"{format_bytes(today.bytes_out)} sent, {format_bytes(today.bytes_in)} received",
        f"limits        up {_mbit(status.limits.upload_mbit)}, "
        f"down {_mbit(status.limits.download_mbit)}" + _quotas_said(status.limits),
        *_zone_line(status.schedule),
    ]
    return _lines(lines)


def describe_change(status: Status) -> str:
    """One line after pause/resume/snooze."""
    if status.state == "running":
        return "volunteerd is contributing again"
    if status.state == "snoozed" and status.snoozed_until is not None:
        until = localtime.strftime("%Y-%m-%d %H:%M", status.snoozed_until)
        return f"volunteerd is snoozed until {until}"
    if status.state == "paused":
        return "volunteerd is paused (until `volunteerd resume`)"
    if status.state == "scheduled":
        return f"volunteerd is not computing now: {status.reason}"
    return f"volunteerd is paused: {status.reason}"  # the quota


def _projects_line(status: Status) -> str:
    if status.projects:
        return ", ".join(f"{p.name} ({_project_state(p)})" for p in status.projects)
    if status.experts:
        return "none (hosting experts.uids)"
    return "none"


def _project_state(project: ProjectView) -> str:
    if project.state == "joined":
        return f"{project.experts} expert" + "s" * (project.experts != 1)
    if project.state == "failed":
        return "could not join, trying again"
    if project.state == "not_hosted":
        return "not hosted"
    return "joining"


def describe_invitation(
    name: str, owner: str, peers: Sequence[str], share: float, *, replaces: str = ""
) -> str:
    """What ``volunteerd join`` asks a person to confirm; ``replaces``: the text saying
    which project of another owner it replaces (``swarm.projects.replacing``)."""
    return "\n".join(
        [
            f"Join the project {name!r}?",
            f"  owner        {owner}",
            "               (only an experiment signed with this key is accepted)",
            *(f"  {'through' if i == 0 else '':12} {peer}" for i, peer in enumerate(peers)),
            f"  share        {share:g} (of this computer's room for experts, against "
            "other projects')",
            "This computer will download some of its experts and compute with them for "
            "whoever trains the experiment.",
            *([f"{replaces[:1].upper()}{replaces[1:]}."] if replaces else []),
        ]
    )


def describe_joined(joined: ProjectJoined) -> str:
    """One line after ``volunteerd join`` (the daemon running)."""
    name = joined.project.name
    if joined.restarting:
        return (
            f"joined {name!r}: volunteerd restarts to host its experts "
            "(`volunteerd status` shows how it goes)"
        )
    return f"already in {name!r}: nothing changed"


def format_projects(projects: Sequence[ProjectView], *, running: bool) -> str:
    """The table of ``volunteerd projects`` (``running``: states from the daemon)."""
    if not projects:
        return "not in a project: join one with `volunteerd join <invitation>`"
    lines = []
    for p in projects:
        if p.state == "not_hosted":  # from the file, running or not
            lines.append(f"{p.name}  not hosted: {p.error}")
            lines.append(f"  owner {p.owner or '(none)'}")
            lines.append(f"  {p.advice}")
            continue
        state = _project_state(p) if running else "volunteerd is not running"
        by = f" by {p.owner_name}" if p.owner_name else ""
        lines.append(f"{p.name}  share {p.share:g}  {state}")
        if p.description:
            lines.append(f"  {p.description}{by}")
        lines.append(f"  owner {p.owner or '(experiments.trusted_owners)'}")
        if p.homepage:
            lines.append(f"  {p.homepage}")
        if p.error:
            lines.append(f"  last error: {p.error}")
    return _lines(lines)
