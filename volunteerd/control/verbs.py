"""The CLI's control verbs (``status``, ``pause``, ``resume``, ``snooze``, ``limit``,
``dashboard``): calls through the typed client, and what they print for people."""

from __future__ import annotations

import re
import time

from volunteerd.control.models import LimitsView, Status

__all__ = [
    "describe_change",
    "format_bytes",
    "format_duration",
    "format_limits",
    "format_status",
    "parse_duration",
]

_UNITS = {"s": 1, "m": 60, "h": 3600, "d": 86400}


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


def format_limits(limits: LimitsView) -> str:
    quota = (
        "none"
        if limits.monthly_quota_gb == 0
        else f"{limits.monthly_quota_gb:g} GB ({format_bytes(limits.month_bytes)} used)"
    )
    return "\n".join(
        [
            f"upload        {_mbit(limits.upload_mbit)}",
            f"download      {_mbit(limits.download_mbit)}",
            f"monthly quota {quota}",
            f"duty cycle    {limits.duty_cycle:g}",
            f"batch cap     {limits.max_batch_size or 'none'}",
        ]
    )


def format_status(status: Status) -> str:
    if status.state == "running":
        state = "contributing" if status.serving else "resuming"
    elif status.state == "snoozed" and status.snoozed_until is not None:
        until = time.strftime("%H:%M", time.localtime(status.snoozed_until))
        state = f"snoozed until {until}"
    else:
        state = f"{status.state}: {status.reason}" if status.reason else status.state
    today = status.today
    rates = status.rates
    reach = status.reachability
    lines = [
        f"state         {state}",
        f"peer id       {status.peer_id}",
        f"experiment    {status.experiment or '(local experts)'}",
        f"device        {status.device}",
        f"experts       {len(status.experts)}: {', '.join(status.experts[:6])}"
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
        f"{format_duration(today.compute_s)} of compute, "
        f"{format_bytes(today.bytes_out)} sent, {format_bytes(today.bytes_in)} received",
        f"limits        up {_mbit(status.limits.upload_mbit)}, "
        f"down {_mbit(status.limits.download_mbit)}",
    ]
    return "\n".join(lines)


def describe_change(status: Status) -> str:
    """One line after pause/resume/snooze."""
    if status.state == "running":
        return "volunteerd is contributing again"
    if status.state == "snoozed" and status.snoozed_until is not None:
        until = time.strftime("%Y-%m-%d %H:%M", time.localtime(status.snoozed_until))
        return f"volunteerd is snoozed until {until}"
    if status.state == "paused":
        return "volunteerd is paused (until `volunteerd resume`)"
    return f"volunteerd is paused: {status.reason}"  # the quota
