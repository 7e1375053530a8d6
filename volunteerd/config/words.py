"""Changed settings said as a person would, for the events the dashboard, the tray and
`volunteerd` show: "upload limit set to 7 Mbit/s", not ``upload_mbit = 7``."""

from __future__ import annotations

from collections.abc import Callable, Mapping

__all__ = ["changes_in_words"]


def _number(value: float) -> str:
    return f"{value:,.3f}".rstrip("0").rstrip(".")


def _amount(what: str, unit: str, none: str) -> Callable[[object], str]:
    def say(value: object) -> str:
        if not isinstance(value, int | float) or isinstance(value, bool):
            return f"{what} set to {value}"
        return none if value == 0 else f"{what} set to {_number(value)}{unit}"

    return say


def _choice(what: str, words: Mapping[object, str]) -> Callable[[object], str]:
    return lambda value: words.get(value, f"{what} set to {value}")


def _hours(what: str) -> Callable[[object], str]:
    def say(value: object) -> str:
        if isinstance(value, list | tuple) and value:
            return f"{what} hours {' and '.join(str(v) for v in value)}"
        return f"{what} at any time"

    return say


def _duty_cycle(value: object) -> str:
    if isinstance(value, int | float):
        return f"duty cycle set to {_number(value * 100)} %"
    return f"duty cycle set to {value}"


_WORDS: dict[str, Callable[[object], str]] = {
    # [limits]
    "upload_mbit": _amount("upload limit", " Mbit/s", "upload unlimited"),
    "download_mbit": _amount("download limit", " Mbit/s", "download unlimited"),
    "monthly_quota_gb": _amount("monthly data quota", " GB", "no monthly data quota"),
    "daily_quota_gb": _amount("daily data quota", " GB", "no daily data quota"),
    "disk_budget_gb": _amount("disk budget", " GB", "no disk budget"),
    "duty_cycle": _duty_cycle,
    "max_batch_size": _amount("largest batch", " samples", "no batch size limit"),
    "cpu_threads": _amount("CPU threads", "", "CPU threads as the system gives"),
    # [schedule]
    "run": _choice(
        "run", {"when_idle": "compute only when the computer is idle", "always": "compute always"}
    ),
    "idle_minutes": _amount("idle time", " min", "idle at once"),
    "on_battery": _choice(
        "on battery", {True: "compute on battery too", False: "pause on battery"}
    ),
    "compute_hours": _hours("compute"),
    "network_hours": _hours("network"),
    "gpu": _choice(
        "GPU",
        {"when_idle": "GPU only when the computer is idle", "always": "GPU whenever computing"},
    ),
}


def changes_in_words(before: Mapping[str, object], after: Mapping[str, object]) -> str:
    """The settings that differ between ``before`` and ``after``, in words, joined with
    commas ("" when none differ). A key without words is said as ``key = value``."""
    said = []
    for key, value in after.items():
        if before.get(key) == value:
            continue
        words = _WORDS.get(key)
        said.append(words(value) if words is not None else f"{key} = {value}")
    return ", ".join(said)
