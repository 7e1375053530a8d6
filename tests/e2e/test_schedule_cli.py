"""``volunteerd schedule`` and the new ``volunteerd limit`` flags against a real daemon
process: the rules change at once, are kept across a restart, reload on SIGHUP, and a
bad value is bad usage before any daemon is asked."""

from __future__ import annotations

import json
import signal
import time
from pathlib import Path

import pytest

from tests.e2e.conftest import run_cli

# Each test starts volunteerd as a process.
pytestmark = pytest.mark.slow


def status_of(home: Path) -> dict:  # type: ignore[type-arg]
    shown = run_cli(home, "status", "--json")
    assert shown.returncode == 0, shown.stderr
    return json.loads(shown.stdout)  # type: ignore[no-any-return]


def wait_for_state(home: Path, state: str, timeout_s: float = 60) -> dict:  # type: ignore[type-arg]
    deadline = time.monotonic() + timeout_s
    while True:
        status = status_of(home)
        if status["state"] == state or time.monotonic() > deadline:
            return status
        time.sleep(0.2)


def test_schedule_and_limits_drive_a_running_daemon(spawn, tmp_path: Path) -> None:  # type: ignore[no-untyped-def]
    home = tmp_path / "vol"
    daemon = spawn("vol", "serve", "--experts", "ffn.0.[0:2]", "--set", "control.port=0")
    daemon.wait_ready()

    shown = run_cli(home, "schedule")
    assert shown.returncode == 0, shown.stderr
    assert "run           always" in shown.stdout
    assert "compute hours any time" in shown.stdout
    assert "now           computing" in shown.stdout

    # compute only in a window that is never now: serving stops, with the reason
    hour = time.localtime().tm_hour
    window = f"{(hour + 2) % 24:02d}:00-{(hour + 3) % 24:02d}:00"
    changed = run_cli(home, "schedule", "--compute-hours", window, "--on-battery", "yes")
    assert changed.returncode == 0, changed.stderr
    assert f"compute hours {window}" in changed.stdout
    assert "on battery    yes" in changed.stdout
    status = wait_for_state(home, "scheduled")
    assert status["state"] == "scheduled"
    assert not status["serving"]
    assert status["schedule"]["reason"] == f"outside compute hours {window}"
    assert status["reason"].startswith(f"outside compute hours {window}: waiting until")
    resumed = run_cli(home, "resume")  # the person's resume does not override it
    assert "not computing now: outside compute hours" in resumed.stdout
    assert (home / "data" / "schedule.toml").exists()

    # SIGHUP reads the files again: the config file's schedule, then schedule.toml
    (home / "data" / "schedule.toml").unlink()
    daemon.process.send_signal(signal.SIGHUP)
    assert wait_for_state(home, "running")["serving"]

    back = run_cli(home, "schedule", "--run", "when_idle", "--idle-minutes", "5")
    assert back.returncode == 0, back.stderr
    assert "run           when idle for 5 min" in back.stdout

    limited = run_cli(home, "limit", "--daily-gb", "2", "--disk-gb", "10", "--threads", "1")
    assert limited.returncode == 0, limited.stderr
    assert "daily quota   2 GB" in limited.stdout
    assert "disk budget   10 GB" in limited.stdout
    assert "CPU threads   1" in limited.stdout
    assert daemon.stop() == 130

    # a restarted daemon keeps the schedule it was given
    again = spawn("vol", "serve", "--experts", "ffn.0.[0:2]", "--set", "control.port=0")
    again.wait_ready()
    kept = run_cli(home, "schedule")
    assert "run           when idle for 5 min" in kept.stdout
    assert "CPU threads   1" in run_cli(home, "limit").stdout
    assert again.stop() == 130


def test_schedule_refuses_a_bad_value_before_asking_the_daemon(tmp_path: Path) -> None:
    for args, named in (
        (("schedule", "--compute-hours", "7-8"), "--compute-hours 7-8: compute_hours"),
        (("schedule", "--network-hours", "25:00-01:00"), "--network-hours 25:00-01:00"),
        (("schedule", "--idle-minutes", "nan"), "--idle-minutes nan: idle_minutes"),
        (("schedule", "--idle-minutes", "0"), "--idle-minutes 0: idle_minutes"),
        (("limit", "--threads", "-1"), "--threads -1: cpu_threads"),
        (("limit", "--daily-gb", "inf"), "--daily-gb inf: daily_quota_gb"),
        (("limit", "--disk-gb", "x"), "--disk-gb x: disk_budget_gb"),
    ):
        result = run_cli(tmp_path, *args)
        assert result.returncode == 2, (args, result.stderr)
        assert named in result.stderr, (args, result.stderr)
        assert "not running" not in result.stderr
