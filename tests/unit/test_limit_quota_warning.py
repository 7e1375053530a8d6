"""``volunteerd limit`` warns (and still sets it) when a daily or monthly quota is below
what the daemon's own upkeep moves: the DHT, identify and pings reaching a joined daemon
count, ~0.39 GB a day in a 6-node test swarm serving nothing, and go on after a quota is
used up (a re-check), so a smaller quota is used up without serving a call."""

from __future__ import annotations

import time
from pathlib import Path
from typing import Any

import pytest

from volunteerd import cli
from volunteerd.control.models import LimitsView, Stats, StatsBucket, Totals
from volunteerd.errors import ControlError


def _hour(start: int, *, sent: int, received: int = 0, calls: int = 0) -> StatsBucket:
    """One hour of the daemon's statistics: ``calls`` forwards served (0: upkeep alone)."""
    return StatsBucket(
        start=start,
        size_s=3600,
        forward=calls,
        backward=0,
        samples=calls,
        compute_s=1.0 if calls else 0.0,
        bytes_in=1 if calls else 0,
        bytes_out=1 if calls else 0,
        bytes_sent=sent,
        bytes_received=received,
    )


class FakeClient:
    """The control API's answers (the daemon's side has tests of its own)."""

    def __init__(self, idle_hour_bytes: list[int], busy_hour_bytes: int = 0) -> None:
        self.limits_set: dict[str, Any] = {}
        hour = int(time.time() // 3600 * 3600)
        buckets = [
            _hour(hour - 3600 * (i + 1), sent=n // 2, received=n - n // 2)
            for i, n in enumerate(idle_hour_bytes)
        ]
        if busy_hour_bytes:  # an hour that served calls: not upkeep alone
            buckets.append(_hour(hour - 3600 * 50, sent=busy_hour_bytes, calls=9))
        buckets.append(_hour(hour, sent=1))  # the hour under way: not a whole hour yet
        self.answer = Stats(
            today=Totals(),
            week=Totals(),
            all_time=Totals(),
            history=sorted(buckets, key=lambda b: b.start),
        )

    def set_limits(self, **changes: Any) -> LimitsView:
        self.limits_set.update(changes)
        return self.limits()

    def limits(self) -> LimitsView:
        return LimitsView(
            upload_mbit=0,
            download_mbit=0,
            duty_cycle=1,
            max_batch_size=64,
            monthly_quota_gb=self.limits_set.get("monthly_quota_gb", 0.0),
            daily_quota_gb=self.limits_set.get("daily_quota_gb", 0.0),
        )

    def stats(self, since: float | None = None) -> Stats:
        return self.answer


def run_limit(monkeypatch: pytest.MonkeyPatch, tmp_path: Path, client: Any, *flags: str) -> None:
    monkeypatch.setattr(cli, "_control_client", lambda paths: client)
    assert cli.main(["limit", "--data-dir", str(tmp_path), *flags]) == 0


def test_a_daily_quota_below_the_measured_upkeep_is_set_with_a_warning(
    monkeypatch: pytest.MonkeyPatch, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    client = FakeClient([16_100_000] * 6, busy_hour_bytes=900_000_000)  # 0.39 GB a day
    run_limit(monkeypatch, tmp_path, client, "--daily-gb", "0.2")
    assert client.limits_set == {"daily_quota_gb": 0.2}  # set all the same
    err = capsys.readouterr().err
    assert "warning: the daily quota of 0.2 GB is below what upkeep alone uses" in err
    assert "moved 0.39 GB a day while it served nothing" in err
    run_limit(monkeypatch, tmp_path, client, "--daily-gb", "0.5", "--quota", "10")
    err = capsys.readouterr().err
    assert "daily" not in err  # 0.5 GB covers 0.39
    assert "the monthly quota of 10 GB is below" in err  # 30 days of 0.39 GB: 11.6 GB


def test_without_enough_idle_hours_the_documented_floor_is_the_mark(
    monkeypatch: pytest.MonkeyPatch, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    client = FakeClient([10] * 2)
    run_limit(monkeypatch, tmp_path, client, "--daily-gb", "0.4", "--quota", "14")
    err = capsys.readouterr().err
    assert "daily quota of 0.4 GB" in err
    assert "monthly quota of 14 GB" in err
    assert "about 0.5 GB a day" in err
    run_limit(monkeypatch, tmp_path, client, "--daily-gb", "0.6", "--quota", "0")
    assert capsys.readouterr().err == ""  # above the floor; no monthly quota

    def refused(since: float | None = None) -> Stats:
        raise ControlError("no stats here", status=404)

    client.stats = refused  # type: ignore[method-assign]
    run_limit(monkeypatch, tmp_path, client, "--daily-gb", "0.1")
    assert "daily quota of 0.1 GB" in capsys.readouterr().err


def test_showing_or_changing_other_limits_warns_of_nothing(
    monkeypatch: pytest.MonkeyPatch, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    client = FakeClient([16_100_000] * 6)
    client.limits_set["daily_quota_gb"] = 0.1
    run_limit(monkeypatch, tmp_path, client)
    run_limit(monkeypatch, tmp_path, client, "--up", "5")
    assert capsys.readouterr().err == ""


def test_an_hour_of_averaging_or_one_barely_run_does_not_set_the_mark(
    monkeypatch: pytest.MonkeyPatch, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """Hours without expert calls count as idle: an hour of replica averaging (1 GB)
    read as 24 GB a day of upkeep in a mean, and hours the daemon ran minutes of as
    nothing (a re-check). The median of the hours that moved anything is the mark."""
    client = FakeClient([16_100_000] * 5 + [1_000_000_000, 0, 0, 0, 0, 0, 0])
    run_limit(monkeypatch, tmp_path, client, "--daily-gb", "2")
    assert "warning" not in capsys.readouterr().err  # 0.39 GB a day, not 2.4
    run_limit(monkeypatch, tmp_path, client, "--daily-gb", "0.2")
    assert "moved 0.39 GB a day while it served nothing" in capsys.readouterr().err
