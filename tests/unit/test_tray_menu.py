"""The tray's menu model, its icons, and the app's logic that needs no display."""

from __future__ import annotations

import itertools
import json
import os
import socket
import subprocess
import sys
import threading
import time
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import pytest
from PIL import Image

from tests.unit.test_service_process import name_in_tray_pid
from volunteerd.control.client import ControlClient
from volunteerd.control.models import LimitsView, Status
from volunteerd.errors import ControlError, DaemonNotRunning
from volunteerd.paths import DataDirLock, Paths
from volunteerd.service.process import tray_pid
from volunteerd.tray import menu
from volunteerd.tray.app import TrayApp, pystray_items, run_tray
from volunteerd.tray.icons import icon_image
from volunteerd.tray.menu import ICON_STATES, Action, Item, Seen, find, view


def status(
    state: str = "running",
    *,
    serving: bool = True,
    samples: int = 0,
    upload_mbit: float = 0.0,
    download_mbit: float = 0.0,
    snoozed_until: float | None = None,
    activity: str = "contributing",
    message: str = "contributing",
    hint: str = "",
    projects: list[dict[str, Any]] | None = None,
    limits: dict[str, Any] | None = None,
) -> Status:
    return Status.model_validate(
        {
            "activity": {"state": activity, "message": message, "hint": hint},
            "projects": projects or [],
            "version": "0.1.0",
            "peer_id": "12D3KooWtest",
            "state": state,
            "serving": serving,
            "reason": "" if state == "running" else state,
            "snoozed_until": snoozed_until,
            "device": "cpu",
            "experts": ["ffn.0.0"],
            "reachability": {"mode": "local"},
            "limits": {
                "upload_mbit": upload_mbit,
                "download_mbit": download_mbit,
                "monthly_quota_gb": 0,
                "duty_cycle": 1.0,
                "max_batch_size": 0,
                **(limits or {}),
            },
            "started_at": 0.0,
            "uptime_s": 1.0,
            "connected_peers": 0,
            "rates": {},
            "today": {"samples": samples},
        }
    )


def connected(*, schedule_run: str | None = None, **kwargs: Any) -> Seen:
    return Seen("connected", status=status(**kwargs), schedule_run=schedule_run)


def project(name: str = "tiny-lm", **fields: Any) -> dict[str, Any]:
    return {"name": name, "owner": "12D3KooWAbCdEfGhIjKlMnOpQrStUv", "share": 1.0,
            "state": "joined", "experts": 2, **fields}  # fmt: skip


def enabled_actions(seen: Seen) -> set[str]:
    names: set[str] = set()

    def walk(items: tuple[Item, ...]) -> None:
        for item in items:
            if item.enabled and item.action is not None:
                names.add(item.action.name)
            walk(item.submenu)

    walk(view(seen).items)
    return names


def radio(items: tuple[Item, ...], section: str) -> dict[str, bool]:
    """The radio items after the label ``section`` of the bandwidth submenu."""
    submenu = find(items, "Bandwidth").submenu
    start = next(i for i, item in enumerate(submenu) if item.text == section) + 1
    out: dict[str, bool] = {}
    for item in submenu[start:]:
        if item.separator:
            break
        assert item.radio
        out[item.text] = bool(item.checked)
    return out


# -- status lines and icon states ----------------------------------------------------------


def test_contributing_line_counts_todays_samples_with_thousands_separators() -> None:
    shown = view(connected(samples=1234))
    assert shown.state == "contributing"
    assert shown.status_line == "Contributing · 1,234 samples today"
    assert shown.title == "volunteerd — Contributing · 1,234 samples today"
    assert shown.items[0] == Item("Contributing · 1,234 samples today", enabled=False)
    assert view(connected(samples=1)).status_line == "Contributing · 1 sample today"


def test_running_but_not_yet_serving_says_so() -> None:
    shown = view(connected(serving=False))
    assert shown.state == "contributing"
    assert shown.status_line == "Starting to contribute…"


def test_paused_snoozed_and_quota_show_the_paused_icon() -> None:
    now = time.mktime((2025, 3, 4, 12, 0, 0, 0, 0, -1))
    until = time.mktime((2025, 3, 4, 14, 5, 0, 0, 0, -1))
    tomorrow = time.mktime((2025, 3, 5, 9, 30, 0, 0, 0, -1))
    assert view(connected(state="paused")).status_line == "Paused"
    snoozed = view(connected(state="snoozed", snoozed_until=until), now=now)
    assert snoozed.status_line == "Snoozed until 14:05"
    later = view(connected(state="snoozed", snoozed_until=tomorrow), now=now)
    assert later.status_line == "Snoozed until Wed 09:30"
    monthly = {"monthly_quota_gb": 5, "month_bytes": 5_000_000_000}
    shown = view(connected(state="quota", limits=monthly))
    assert shown.status_line == "Paused · monthly quota used up"
    for state in ("paused", "snoozed", "quota"):
        assert view(connected(state=state, snoozed_until=until)).state == "paused"


def test_not_connected_lines_and_states() -> None:
    starting = view(Seen("starting"))
    assert (starting.state, starting.status_line) == (
        "disconnected",
        "Not connected — starting volunteerd…",
    )
    locked = view(Seen("locked"))  # its pid not written yet
    assert (locked.state, locked.status_line) == (
        "disconnected",
        "Not connected — volunteerd is starting or restarting…",
    )
    busy = view(Seen("busy"))
    assert (busy.state, busy.status_line) == (
        "disconnected",
        "Not connected — volunteerd runs but does not answer (busy?)",
    )
    assert "Start volunteerd" not in [i.text for i in busy.items]  # one runs already
    absent = view(Seen("absent"))
    assert (absent.state, absent.status_line) == (
        "disconnected",
        "Not connected — volunteerd is not running",
    )
    failed = view(Seen("failed", error="volunteerd exited (5): the port is taken"))
    assert (failed.state, failed.status_line) == (
        "error",
        "Error: volunteerd exited (5): the port is taken",
    )
    refused = view(Seen("error", error="missing or wrong API token " + "x" * 100))
    assert refused.state == "error"
    assert len(refused.status_line) <= len("Error: ") + 64
    assert refused.status_line.endswith("…")


def test_contributing_to_a_project_says_whose_it_is() -> None:
    tiny = project(description="a tiny language model", owner_name="Ana")
    shown = view(connected(samples=12, projects=[tiny]))
    assert shown.status_line == "Helping: a tiny language model by Ana · 12 samples today"
    assert shown.title == "volunteerd — " + shown.status_line
    assert shown.state == "contributing"
    # a manifest without a description or owner name: the project's name and the key
    bare = view(connected(projects=[project(), project("other")])).status_line
    assert bare == "Helping: tiny-lm by 12D3KooW…QrStUv and 1 more · 0 samples today"
    configured = view(connected(projects=[project(owner="")])).status_line  # experiments.join
    assert configured == "Helping: tiny-lm · 0 samples today"
    joining = view(connected(projects=[project(state="joining")])).status_line
    assert joining == "Contributing · 0 samples today", "only joined projects are helped"
    # a stranger's longest description and owner name: one line of a menu still
    wordy = project(description="w" * 280, owner_name="o" * 64)
    long = view(connected(projects=[wordy]))
    assert long.status_line == f"Helping: {'w' * 63}… by {'o' * 31}… · 0 samples today"
    # the tooltip: at most 127 characters (pystray's Windows backend raises on more)
    assert long.title == ("volunteerd — " + long.status_line)[:126] + "…"


def test_a_used_up_daily_quota_is_named_the_daily_one() -> None:
    # It was "monthly quota used up" whichever quota it was.
    daily = {"monthly_quota_gb": 5, "month_bytes": 10**9, "daily_quota_gb": 0.5,
             "day_bytes": 500_000_000}  # fmt: skip
    assert view(connected(state="quota", limits=daily)).status_line == (
        "Paused · daily quota used up"
    )
    # both used up: the month's, as the daemon decides (its pause lasts longer)
    both = {**daily, "month_bytes": 6 * 10**9}
    shown = view(connected(state="quota", limits=both))
    assert shown.status_line == "Paused · monthly quota used up"
    # neither known (counts from a daemon that does not send them): not one named wrongly
    assert view(connected(state="quota")).status_line == "Paused · transfer quota used up"


def test_a_join_held_back_says_it_waits_why_and_what_to_do() -> None:
    # "Paused", with nothing of the join, while the activity said "downloading".
    message = "joining tinylm: waiting, the daily transfer quota is used up"
    hint = "its experts download after midnight; raise the daily quota with `volunteerd ..."
    for state in ("paused", "snoozed", "quota", "scheduled"):
        shown = view(connected(state=state, activity="joining", message=message, hint=hint))
        assert shown.state == "paused"
        assert shown.status_line == "Joining tinylm: waiting, the daily transfer quota is used up"
        assert shown.items[1] == Item(menu._shorten(hint), enabled=False)
        assert shown.title.startswith(f"volunteerd — {shown.status_line} — its experts")
        assert find(shown.items, "Resume" if state in ("paused", "snoozed") else "Pause")


def test_running_for_nobody_says_so_with_what_to_do_and_the_waiting_icon() -> None:
    hint = "join one with `volunteerd join <invitation>` or the dashboard's Join a project"
    idle = view(connected(activity="not_in_project", message="not in a project", hint=hint))
    assert idle.state == "waiting"
    assert idle.status_line == "Not in a project"
    assert idle.title == f"volunteerd — Not in a project — {hint}"
    assert idle.items[1] == Item(menu._shorten(hint), enabled=False)
    for activity in ("joining", "waiting", "no_peers", "unreachable"):
        shown = view(connected(activity=activity, message=activity.replace("_", " ")))
        assert shown.state == "waiting"
        assert shown.status_line == activity.replace("_", " ").capitalize()
    # paused by the volunteer: the paused icon, whatever the activity says
    paused = view(connected(state="paused", activity="paused", message="paused"))
    assert paused.state == "paused"
    outside = "paused: outside the hours set to compute"
    scheduled = view(connected(state="scheduled", activity="paused", message=outside))
    assert scheduled.state == "paused"
    assert scheduled.status_line == "Paused: outside the hours set to compute"


def test_a_failed_joins_long_error_is_one_short_line_and_the_tooltip_fits_windows() -> None:
    """The ordinary "not found" failure made a first line of 183 characters and a
    tooltip of 302; a manifest's key, one of 10 KB with line breaks."""
    found = (
        "could not join tiny-lm: experiment 'tiny-lm' was not found in the DHT from a trusted "
        "owner (experiments.trusted_owners) within 60s: is it published, and are the "
        "bootstrap peers right?"
    )
    hint = "check the internet connection; it tries again by itself. " * 3
    shown = view(connected(activity="joining", message=found, hint=hint))
    assert shown.status_line == "Could not join tiny-lm: experiment 'tiny-lm' was not found in t…"
    assert len(shown.status_line) == menu._MAX_LINE
    assert shown.items[0].text == shown.status_line
    assert len(shown.title) == menu.MAX_TITLE
    assert shown.title.startswith(f"volunteerd — {shown.status_line} — check the internet")
    broken = "could not join x: '\x1b[2J\n\n12:00:00 INFO  forged\u2028\u202eright'"
    shown = view(connected(activity="joining", message=broken + "A" * 10_000, hint="h\ni"))
    assert shown.status_line == (
        "Could not join x: '\\x1b[2J 12:00:00 INFO forged \\u202eright'AAA…"
    )
    assert shown.title == f"volunteerd — {shown.status_line} — h i"  # one line
    # paused by the schedule: the activity's message too
    scheduled = view(connected(state="scheduled", activity="paused", message="paused: " + "z" * 99))
    assert scheduled.status_line == "Paused: " + "z" * 55 + "…"


def test_a_failed_action_shows_as_a_second_line() -> None:
    items = view(Seen("connected", status=status(), notice="Could not pause: refused")).items
    assert items[1] == Item("Could not pause: refused", enabled=False)


# -- items per state ---------------------------------------------------------------------------


def test_running_offers_pause_snooze_bandwidth_dashboard_and_both_quits() -> None:
    assert enabled_actions(connected()) == {
        "pause",
        "snooze",
        "upload",
        "download",
        "dashboard",
        "join",
        "quit",
        "quit_and_stop",
    }
    items = view(connected()).items
    assert find(items, "Snooze for 1 hour").action == Action("snooze", 3600.0)
    with pytest.raises(KeyError):
        find(items, "Resume")
    with pytest.raises(KeyError):
        find(items, "Start volunteerd")


def test_paused_and_snoozed_offer_resume_instead_of_pause() -> None:
    for state in ("paused", "snoozed"):
        actions = enabled_actions(connected(state=state, snoozed_until=time.time() + 60))
        assert "resume" in actions
        assert "pause" not in actions
    quota = enabled_actions(connected(state="quota"))
    assert "pause" in quota
    assert "resume" not in quota


def test_not_connected_disables_everything_but_quit_and_offers_start() -> None:
    assert enabled_actions(Seen("absent")) == {"start", "quit"}
    assert enabled_actions(Seen("failed", error="exited (1)")) == {"start", "quit"}
    assert enabled_actions(Seen("starting")) == {"quit"}
    assert enabled_actions(Seen("locked", pid=42)) == {"quit"}
    assert enabled_actions(Seen("error", error="HTTP 401")) == {"quit"}
    assert find(view(Seen("starting")).items, "Pause").enabled is False
    for link in ("absent", "starting", "error"):
        upload = radio(view(Seen(link, error="e")).items, "Upload")  # type: ignore[arg-type]
        assert not any(upload.values()), "nothing is checked while the limits are unknown"


def test_the_default_item_opens_the_dashboard_or_starts_the_daemon() -> None:
    def defaults(seen: Seen) -> list[str]:
        return [item.text for item in view(seen).items if item.default]

    assert defaults(connected()) == ["Open dashboard"]
    assert defaults(connected(state="paused")) == ["Open dashboard"]
    assert defaults(Seen("absent")) == ["Start volunteerd"]
    assert defaults(Seen("starting")) == []
    assert defaults(Seen("locked", pid=42)) == []  # restarting: a second one is refused


def test_menu_has_no_leading_trailing_or_double_separators() -> None:
    for seen in (connected(), Seen("absent"), Seen("connected", status=status(), notice="n")):
        items = view(seen).items
        assert not items[0].separator
        assert not items[-1].separator
        assert not any(a.separator and b.separator for a, b in itertools.pairwise(items))


def test_compute_only_when_idle_is_checked_from_the_schedule_and_flips_it() -> None:
    always = find(view(connected(schedule_run="always")).items, "Compute only when idle")
    assert (always.checked, always.action) == (False, Action("idle_only", 1.0))
    idle = find(view(connected(schedule_run="when_idle")).items, "Compute only when idle")
    assert (idle.checked, idle.action) == (True, Action("idle_only", 0.0))
    with pytest.raises(KeyError):  # a daemon without a schedule: no item to lie with
        find(view(connected()).items, "Compute only when idle")
    client = FakeClient()
    menu.perform(client, always.action)  # type: ignore[arg-type]
    menu.perform(client, idle.action)  # type: ignore[arg-type]
    assert client.calls == [
        ("set_schedule", {"run": "when_idle"}),
        ("set_schedule", {"run": "always"}),
    ]
    assert menu.describe(Action("idle_only", 1.0)) == "compute only when idle"


# -- bandwidth presets -------------------------------------------------------------------------


def test_bandwidth_presets_are_radio_checked_from_the_limits() -> None:
    items = view(connected(upload_mbit=5, download_mbit=0)).items
    assert radio(items, "Upload") == {
        "Unlimited": False,
        "1 Mbit/s": False,
        "5 Mbit/s": True,
        "10 Mbit/s": False,
        "50 Mbit/s": False,
    }
    assert radio(items, "Download") == {
        "Unlimited": True,
        "5 Mbit/s": False,
        "10 Mbit/s": False,
        "50 Mbit/s": False,
        "100 Mbit/s": False,
    }
    submenu = find(items, "Bandwidth").submenu
    assert [i.action for i in submenu if i.action and i.action.name == "upload"] == [
        Action("upload", mbit) for mbit in menu.UPLOAD_PRESETS_MBIT
    ]


def test_a_limit_that_is_no_preset_shows_checked_and_disabled() -> None:
    items = view(connected(upload_mbit=3.5)).items
    upload = radio(items, "Upload")
    assert upload["3.5 Mbit/s (set elsewhere)"] is True
    assert sum(upload.values()) == 1
    assert find(items, "3.5 Mbit/s (set elsewhere)").enabled is False


# -- actions -----------------------------------------------------------------------------------


class FakeClient:
    def __init__(self) -> None:
        self.calls: list[tuple[str, Any]] = []

    def pause(self) -> Status:
        self.calls.append(("pause", None))
        return status("paused")

    def resume(self) -> Status:
        self.calls.append(("resume", None))
        return status()

    def snooze(self, seconds: float) -> Status:
        self.calls.append(("snooze", seconds))
        return status("snoozed")

    def set_limits(self, **changes: float | int) -> LimitsView:
        self.calls.append(("set_limits", changes))
        return status().limits

    def set_schedule(self, **changes: Any) -> Any:
        self.calls.append(("set_schedule", changes))

    def schedule(self) -> Any:
        return SimpleNamespace(run="always")

    def shutdown(self) -> None:
        self.calls.append(("shutdown", None))

    def status(self) -> Status:
        return status()


def test_each_daemon_action_makes_its_client_call() -> None:
    client = FakeClient()
    for action in (
        Action("pause"),
        Action("resume"),
        Action("snooze", 3600.0),
        Action("upload", 10.0),
        Action("download", 0.0),
        Action("quit_and_stop"),
    ):
        menu.perform(client, action)
    assert client.calls == [
        ("pause", None),
        ("resume", None),
        ("snooze", 3600.0),
        ("set_limits", {"upload_mbit": 10.0}),
        ("set_limits", {"download_mbit": 0.0}),
        ("shutdown", None),
    ]


def test_the_trays_own_actions_are_no_daemon_calls() -> None:
    for name in ("dashboard", "join", "start", "quit"):
        with pytest.raises(ValueError, match="not a call to the daemon"):
            menu.perform(FakeClient(), Action(name))  # type: ignore[arg-type]
    assert menu.describe(Action("upload", 5.0)) == "set the upload limit to 5 mbit/s"
    assert menu.describe(Action("download", 0.0)) == "set the download limit to unlimited"


# -- icons -------------------------------------------------------------------------------------


def test_every_state_has_its_own_64px_icon() -> None:
    images = {state: icon_image(state) for state in ICON_STATES}
    for image in images.values():
        assert image.size == (64, 64)
        assert image.mode == "RGBA"
        assert image.getpixel((0, 0)) == (0, 0, 0, 0), "the corners are transparent"
    pixels = {state: image.tobytes() for state, image in images.items()}
    assert len(set(pixels.values())) == len(ICON_STATES)


def test_icons_differ_in_shape_at_16px_and_in_colour() -> None:
    small = {state: icon_image(state, 16) for state in ICON_STATES}

    def ink(x: int, y: int, image: Image.Image) -> int:  # 0 transparent, 1 white, 2 colour
        r, g, b, a = image.getpixel((x, y))  # type: ignore[misc]
        return 0 if a < 128 else 1 if min(r, g, b) > 200 else 2

    shapes = {
        state: tuple(ink(x, y, image) for x in range(16) for y in range(16))
        for state, image in small.items()
    }
    assert len(set(shapes.values())) == len(ICON_STATES), "readable without colour"
    assert ink(5, 5, small["disconnected"]) == 0, "the disconnected icon is hollow"
    r, g, b, _ = icon_image("contributing").getpixel((10, 32))  # type: ignore[misc]
    assert min(g - r, g - b) > 50, "green"
    r, g, b, _ = icon_image("error").getpixel((32, 56))  # type: ignore[misc]
    assert min(r - g, r - b) > 100, "red"
    r, g, b, _ = icon_image("waiting").getpixel((32, 10))  # type: ignore[misc]
    assert r > g > b, "amber"
    assert r - b > 100, "amber"


# -- the app, without a display ----------------------------------------------------------------


def paths_in(tmp_path: Path) -> Paths:
    return Paths(
        config_file=tmp_path / "config.toml",
        data_dir=tmp_path / "data",
        cache_dir=tmp_path / "cache",
    )


def test_app_sees_no_daemon_when_none_recorded_its_address(tmp_path: Path) -> None:
    app = TrayApp(paths_in(tmp_path), start_daemon=False)
    with pytest.raises(DaemonNotRunning):
        app._client()
    assert app._poll() == Seen("absent")


def test_app_sees_a_busy_daemon_and_does_not_start_another(tmp_path: Path) -> None:
    paths = paths_in(tmp_path)
    paths.data_dir.mkdir()
    (paths.data_dir / "api-token").write_text("a-token")
    never = [sys.executable, "-c", "raise SystemExit('a second daemon was started')"]
    with socket.create_server(("127.0.0.1", 0)) as silent:  # accepts, never answers
        url = f"http://127.0.0.1:{silent.getsockname()[1]}"
        (paths.data_dir / "control.json").write_text(json.dumps({"url": url, "pid": os.getpid()}))
        app = TrayApp(paths, serve_command=never)
        app._client = lambda: ControlClient.for_data_dir(paths.data_dir, timeout_s=0.3)  # type: ignore[method-assign]
        app._start_if_absent()
        assert app._child is None
        assert app._poll() == Seen("busy")


@pytest.mark.skipif(sys.platform == "win32", reason="command lines read from /proc or ps")
def test_a_second_tray_of_one_data_folder_says_so_and_does_not_start(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    # Two icons, and tray.pid named only the newer: `service uninstall` stopped that one.
    shown: list[int | None] = []

    def run(app: TrayApp) -> int:
        shown.append(app.paths.read_tray_pid())
        return 0

    monkeypatch.setattr(TrayApp, "run", run)
    paths = paths_in(tmp_path)
    paths.data_dir.mkdir()
    # a process whose command line is volunteerd's tray (argv as `volunteerd tray` has)
    tray = subprocess.Popen(
        [sys.executable, "-c", "import time; time.sleep(60)", "volunteerd", "tray"]
    )
    other = subprocess.Popen(["sleep", "30"])
    try:
        name_in_tray_pid(paths, tray.pid)
        assert run_tray(paths, start_daemon=False, showing=tray_pid) == 0
        assert shown == []
        assert capsys.readouterr().out == (
            f"the tray icon of {paths.data_dir} is showing already (pid {tray.pid})\n"
        )
        assert paths.read_tray_pid() == tray.pid
        assert tray.poll() is None

        name_in_tray_pid(paths, other.pid)  # stale: its pid reused by another program
        assert run_tray(paths, start_daemon=False, showing=tray_pid) == 0
        assert shown == [os.getpid()]  # this one runs, named in tray.pid
        assert other.poll() is None
        assert not paths.tray_pid_file.exists()  # removed when it quit
    finally:
        for proc in (tray, other):
            proc.kill()
            proc.wait(10)


@pytest.mark.skipif(sys.platform == "win32", reason="flock")
def test_two_trays_started_at_the_same_moment_show_one_icon(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    # Both read tray.pid before either wrote it: both passed the check, both showed an
    # icon. The first to take the file's lock runs; the other says so and exits 0.
    ran: list[int] = []
    monkeypatch.setattr(TrayApp, "run", lambda app: ran.append(1) or 0)
    paths = paths_in(tmp_path)
    holder = subprocess.Popen(
        [
            sys.executable,
            "-c",
            "import sys, time\n"
            "from pathlib import Path\n"
            "from volunteerd.paths import Paths\n"
            "paths = Paths(config_file=Path(sys.argv[1]), data_dir=Path(sys.argv[2]),"
            " cache_dir=Path(sys.argv[3]))\n"
            "held = paths.hold_tray_pid(4242)\n"
            "print(held is not None, flush=True)\n"
            "time.sleep(60)\n",
            str(paths.config_file),
            str(paths.data_dir),
            str(paths.cache_dir),
        ],
        stdout=subprocess.PIPE,
        text=True,
    )
    try:
        assert holder.stdout is not None
        assert holder.stdout.readline() == "True\n"  # the first tray holds the lock
        never_seen = lambda paths: None  # noqa: E731 - the check ran before it wrote
        assert run_tray(paths, start_daemon=False, showing=never_seen) == 0
        assert ran == []
        assert capsys.readouterr().out == (
            f"the tray icon of {paths.data_dir} is showing already (pid 4242)\n"
        )
        assert paths.read_tray_pid() == 4242  # the first tray's file, left as it was
    finally:
        holder.kill()
        holder.communicate(timeout=10)
    # the first tray gone (its lock with it): the next one runs, named in the file
    assert run_tray(paths, start_daemon=False, showing=lambda paths: None) == 0
    assert ran == [1]
    assert not paths.tray_pid_file.exists()  # removed when it quit


def test_app_sees_a_daemon_restarting_in_place_and_does_not_start_another(
    tmp_path: Path,
) -> None:
    # A join or leave: no control.json until the daemon is back, its lock held meanwhile.
    # The tray said "not running" and made "Start volunteerd" its click, whose daemon
    # took the folder from the restarting one.
    paths = paths_in(tmp_path)
    never = [sys.executable, "-c", "raise SystemExit('a second daemon was started')"]
    app = TrayApp(paths, serve_command=never)
    with DataDirLock(paths.lock_file):
        seen = app._poll()
        assert seen == Seen("locked", pid=os.getpid())
        shown = view(seen)
        assert shown.status_line == (
            f"Not connected — volunteerd is starting or restarting (pid {os.getpid()})…"
        )
        assert shown.state == "disconnected"
        assert [i.text for i in shown.items if i.default] == []
        assert "Start volunteerd" not in [i.text for i in shown.items]
        app._start_if_absent()  # at the tray's start, or a click queued before
        assert app._child is None
    assert app._poll() == Seen("absent")  # gone for good: it may be started again


def test_app_reports_a_daemon_it_started_that_exited(tmp_path: Path) -> None:
    failing = "import sys; print('volunteerd: the data folder is in use'); sys.exit(5)"
    app = TrayApp(paths_in(tmp_path), serve_command=[sys.executable, "-c", failing])
    app._start_if_absent()
    assert app._poll().link in ("starting", "failed")
    deadline = time.monotonic() + 20
    while (seen := app._poll()).link == "starting":
        assert time.monotonic() < deadline, "the child did not exit"
        time.sleep(0.05)
    assert seen == Seen(
        "failed", error="volunteerd exited (5): volunteerd: the data folder is in use"
    )
    assert "in use" in app.paths.daemon_log_file.read_text()
    assert [i.text for i in view(seen).items if i.default] == ["Start volunteerd"]


def test_a_daemon_that_cannot_be_started_is_reported_and_the_tray_keeps_polling(
    tmp_path: Path,
) -> None:
    app = TrayApp(paths_in(tmp_path), serve_command=[str(tmp_path / "no-such-volunteerd")])
    poller = threading.Thread(target=app._poll_loop, daemon=True)
    poller.start()
    try:
        deadline = time.monotonic() + 20
        while "Could not start volunteerd" not in app.seen.notice:
            assert poller.is_alive(), "the poll thread died"
            assert time.monotonic() < deadline, app.seen
            time.sleep(0.02)
        assert app.seen.link == "absent"
        assert "no-such-volunteerd" in app.seen.notice
    finally:
        app._stopping.set()
        app._wake.set()
        poller.join(10)
    assert not poller.is_alive()


def test_the_daemon_the_tray_starts_gets_its_locations_and_not_the_shells_settings(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """As a daemon started by a service manager: the tray's file locations, none of the
    VOLUNTEERD_<SECTION>__<KEY> variables of the shell that started the tray."""
    for name in [k for k in os.environ if k.startswith("VOLUNTEERD_")]:
        monkeypatch.delenv(name)  # the test runner's own (scripts/test reads one)
    monkeypatch.setenv("VOLUNTEERD_CONTROL__PORT", "0")
    monkeypatch.setenv("VOLUNTEERD_DATA_DIR", str(tmp_path / "the-shells"))
    show = "import os; print(sorted((k, v) for k, v in os.environ.items() if 'VOLUNTEERD' in k))"
    app = TrayApp(paths_in(tmp_path), serve_command=[sys.executable, "-c", show])
    app._start_if_absent()
    assert app._child is not None
    assert app._child.wait(30) == 0
    paths = app.paths
    assert paths.daemon_log_file.read_text().strip() == str(
        [
            ("VOLUNTEERD_CACHE_DIR", str(paths.cache_dir)),
            ("VOLUNTEERD_CONFIG", str(paths.config_file)),
            ("VOLUNTEERD_DATA_DIR", str(paths.data_dir)),
            # the file it appends to, which it keeps bounded (detached.OwnLogFile)
            ("VOLUNTEERD_LOG_FILE", str(paths.daemon_log_file)),
        ]
    )


def test_the_daemon_the_tray_starts_gets_absolute_locations(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A tray started with a relative --data-dir: the daemon, which starts in the home
    folder, is told where that is from the tray's current folder."""
    monkeypatch.setenv("HOME", str(tmp_path / "home"))
    monkeypatch.chdir(tmp_path)
    relative = Paths(config_file=Path("c.toml"), data_dir=Path("d"), cache_dir=Path("k"))
    show = "import os; print(os.environ['VOLUNTEERD_DATA_DIR'], os.environ['VOLUNTEERD_CONFIG'])"
    app = TrayApp(relative, serve_command=[sys.executable, "-c", show])
    app._start_if_absent()
    assert app._child is not None
    assert app._child.wait(30) == 0
    shown = (tmp_path / "d" / "daemon.log").read_text().split()
    assert shown == [str(tmp_path / "d"), str(tmp_path / "c.toml")]


def test_app_maps_the_model_to_pystray_items_and_clicks_only_queue(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    if "pystray" not in sys.modules:  # importing it picks a backend, which may want X
        monkeypatch.setenv("PYSTRAY_BACKEND", "dummy")
    import pystray

    app = TrayApp(paths_in(tmp_path), start_daemon=False)
    seen = connected(upload_mbit=10)
    rendered = pystray.Menu(*pystray_items(pystray, view(seen).items, app.submit))
    texts = [item.text for item in rendered]
    assert texts[0] == "Contributing · 0 samples today"
    pause = next(item for item in rendered if item.text == "Pause")
    bandwidth = next(item for item in rendered if item.text == "Bandwidth")
    ten = [item for item in bandwidth.submenu if item.text == "10 Mbit/s"]
    assert [(i.checked, i.radio) for i in ten] == [(True, True), (False, True)]
    assert rendered.items[0].enabled is False

    pause(None)
    ten[1](None)  # download: 10 Mbit/s
    assert app._jobs.get_nowait() == Action("pause")
    assert app._jobs.get_nowait() == Action("download", 10.0)

    absent = pystray.Menu(*pystray_items(pystray, view(Seen("absent")).items, app.submit))
    next(item for item in absent if item.text == "Pause")(None)  # disabled: ignored
    absent(None)  # a click on the icon: the default item, "Start volunteerd"
    assert app._jobs.get_nowait() == Action("start")
    assert app._jobs.empty()


class Win32LikeIcon:
    """pystray's Windows backend, as far as ``TrayApp._show`` reaches it: the title is
    copied into NOTIFYICONDATAW.szTip, a WCHAR[128], after pystray stored it."""

    def __init__(self, *, refuse_titles: bool = False) -> None:
        self.visible = True
        self.icon: Any = None
        self._title = ""
        self.refuse_titles = refuse_titles
        self.menus: list[str] = []  # the first item of each menu built
        self.app: TrayApp | None = None

    @property
    def title(self) -> str:
        return self._title

    @title.setter
    def title(self, value: str) -> None:
        if value != self._title:
            self._title = value
            if self.refuse_titles or len(value) >= 128:
                raise ValueError(f"string too long ({len(value)}, maximum length 128)")

    def update_menu(self) -> None:
        assert self.app is not None
        self.menus.append(self.app.view.items[0].text)


def test_a_tooltip_too_long_for_windows_is_cut_and_the_menu_still_follows(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A title over 127 characters raised in pystray's Windows backend, before the menu
    was rebuilt, and the new view counted as shown: the menu kept offering Resume beside
    a daemon that ran, poll after poll."""
    monkeypatch.setattr("volunteerd.tray.app.icon_image", lambda state: None)
    no_peers = "check the internet connection; if it works, the peers to join through may be "
    running = connected(activity="no_peers", message="no peers", hint=no_peers * 2)
    for refuse_titles in (False, True):  # whatever else a backend refuses, the menu follows
        app = TrayApp(paths_in(tmp_path), start_daemon=False)
        app.icon = icon = Win32LikeIcon(refuse_titles=refuse_titles)
        icon.app = app
        app._show(connected(state="paused", activity="paused", message="paused by you"))
        for _ in range(3):
            app._show(running)
        assert icon.menus == ["Paused", "No peers"]
        assert find(app.view.items, "Pause").action == Action("pause")
        if not refuse_titles:
            assert len(icon.title) == menu.MAX_TITLE
            assert icon.title.startswith("volunteerd — No peers — check the internet")


def test_join_a_project_opens_the_dashboard_at_its_join_field(tmp_path: Path) -> None:
    opened: list[str] = []
    app = TrayApp(paths_in(tmp_path), start_daemon=False, open_url=opened.append)

    class Client(FakeClient):
        dashboard_url = "http://127.0.0.1:38480/#token=abc"

    app._client = Client  # type: ignore[method-assign,assignment]
    app._do(Action("join"))
    assert opened == ["http://127.0.0.1:38480/#token=abc&join"]


def test_app_turns_a_refused_action_into_a_notice(tmp_path: Path) -> None:
    app = TrayApp(paths_in(tmp_path), start_daemon=False)

    class Refusing(FakeClient):
        def set_limits(self, **changes: float | int) -> LimitsView:
            raise ControlError("upload_mbit: must be at least 0", status=422)

    app._client = Refusing  # type: ignore[method-assign,assignment]
    app.submit(Action("upload", 5.0))
    app._jobs.put(None)  # ends the worker loop
    app._work_loop()
    assert app._poll().notice == (
        "Could not set the upload limit to 5 mbit/s: upload_mbit: must be at least 0"
    )


def test_volunteerd_tray_checks_for_a_tray_already_showing(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    import volunteerd.tray.app
    from volunteerd.cli import main

    calls: list[dict[str, object]] = []
    monkeypatch.setattr(volunteerd.tray.app, "run_tray", lambda paths, **kw: calls.append(kw) or 0)
    monkeypatch.setenv("VOLUNTEERD_DATA_DIR", str(tmp_path / "data"))
    assert main(["tray", "--no-start"]) == 0
    assert calls[0]["showing"] is tray_pid


def test_a_desktop_without_a_tray_is_said_once_in_our_words(
    caplog: pytest.LogCaptureFixture,
) -> None:
    # pystray logged "Failed to dock icon" with a traceback at every try, and the tray
    # ran on with no icon and no word of why (an outside re-check)
    from volunteerd.tray.app import _docking_once

    class NoTray:  # pystray's plain X icon where no tray owns the selection
        _systray_manager = None

        def _assert_docked(self) -> None:
            raise AssertionError

    icon = _docking_once(NoTray)()
    for _ in range(3):  # pystray tries at every new image
        with pytest.raises(AssertionError):  # as pystray expects: it tries again later
            icon._assert_docked()
    said = [r.getMessage() for r in caplog.records if r.name == "volunteerd.tray.app"]
    assert said == [
        "no system tray (notification area) on this desktop: the icon shows once one "
        "starts; `volunteerd dashboard` has every control"
    ]
