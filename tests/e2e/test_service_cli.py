"""``volunteerd service install|status|uninstall`` as a subprocess, in a throw-away home
with no user systemd (as in CI containers): the daemon is started detached, and
uninstall leaves the home as it found it (but for the data folder)."""

from __future__ import annotations

import contextlib
import json
import os
import signal
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import pytest

from volunteerd.control.client import ControlClient
from volunteerd.paths import lock_holder

SMALL_DAEMON = """\
[network]
listen_host = "127.0.0.1"
port = 0
[experts]
uids = "ffn.0.0"
hidden_dim = 16
[runtime]
device = "cpu"
[control]
port = 0
[timeouts]
shutdown_grace_s = 1
"""
UNIT = ".config/systemd/user/volunteerd.service"
TRAY = ".config/autostart/volunteerd-tray.desktop"
ICON = ".local/share/icons/hicolor/scalable/apps/volunteerd.svg"
DATA = ".local/share/volunteerd"  # the daemon's own: kept by uninstall
CACHE = ".cache/volunteerd"

pytestmark = [
    # each test runs `volunteerd service`; some start the daemon
    pytest.mark.slow,
    pytest.mark.skipif(not sys.platform.startswith("linux"), reason="Linux files"),
]


@pytest.fixture
def home(tmp_path: Path) -> Iterator[Path]:
    """A home with the small daemon's settings in its config file; any daemon left
    running by a failed test is killed."""
    home = tmp_path / "home"
    (home / ".config" / "volunteerd").mkdir(parents=True)
    (home / ".config" / "volunteerd" / "config.toml").write_text(SMALL_DAEMON)
    yield home
    with contextlib.suppress(OSError, ValueError, KeyError, TypeError):
        pid = json.loads((home / DATA / "control.json").read_text())["pid"]
        os.kill(pid, signal.SIGKILL)
    holder = lock_holder(home / DATA / "volunteerd.lock")  # one with its control API off
    if holder is not None and holder.pid is not None:
        with contextlib.suppress(OSError):
            os.kill(holder.pid, signal.SIGKILL)


def service(home: Path, *args: str) -> subprocess.CompletedProcess[str]:
    env = {
        k: v
        for k, v in os.environ.items()
        if not k.startswith(("VOLUNTEERD_", "XDG_")) and k != "DBUS_SESSION_BUS_ADDRESS"
    }
    env.update(HOME=str(home), PYTHONUNBUFFERED="1")
    return subprocess.run(
        [sys.executable, "-m", "volunteerd", "service", *args],
        env=env,
        capture_output=True,
        text=True,
        timeout=90,
        check=False,
    )


def files_in(home: Path) -> set[str]:
    """Every file and link under ``home``, but the daemon's data and cache."""
    return {
        str(p.relative_to(home))
        for p in home.rglob("*")
        if not p.is_dir() and not str(p.relative_to(home)).startswith((DATA, CACHE))
    }


def alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    with contextlib.suppress(OSError):  # a zombie nobody reaps is gone too
        return Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0] != "Z"
    return True


def test_install_starts_the_daemon_and_uninstall_leaves_the_home_as_it_was(home: Path) -> None:
    before = files_in(home)

    installed = service(home, "install")
    assert installed.returncode == 0, installed.stdout + installed.stderr
    assert "no user systemd here: started volunteerd in the background" in installed.stdout
    assert "dashboard at http://127.0.0.1:" in installed.stdout
    assert files_in(home) - before == {UNIT, TRAY, ICON}
    unit = (home / UNIT).read_text()
    assert f"\nExecStart={sys.executable} -m volunteerd serve\n" in unit
    assert "Environment=" not in unit  # nothing was chosen explicitly
    assert f"\nExec={sys.executable} -m volunteerd tray\n" in (home / TRAY).read_text()
    client = ControlClient.for_data_dir(home / DATA)
    assert client.health().ok
    pid = client.endpoint.pid
    assert pid is not None

    shown = service(home, "status")
    assert shown.returncode == 0, shown.stdout + shown.stderr
    assert "autostart   installed\n" in shown.stdout
    assert f"running, pid {pid}" in shown.stdout
    report = json.loads(service(home, "status", "--json").stdout)
    assert (report["installed"], report["current"], report["running"]) == (True, True, True)
    assert report["dashboard"] == f"{client.endpoint.url}/"

    again = service(home, "install")
    assert again.returncode == 0, again.stdout + again.stderr
    assert "volunteerd's autostart is already installed" in again.stdout
    assert again.stdout.count("unchanged ") == 3
    assert f"volunteerd is running (pid {pid})" in again.stdout  # the same daemon

    removed = service(home, "uninstall")
    assert removed.returncode == 0, removed.stdout + removed.stderr
    assert f"stopped the daemon (pid {pid})" in removed.stdout
    assert not (home / DATA / "control.json").exists()
    assert not alive(pid)
    assert files_in(home) == before
    # nor the folders the autostart files were put in (issue 15)
    assert not (home / UNIT).parent.exists()
    assert not (home / TRAY).parent.exists()
    assert "are not touched by this command" in removed.stdout
    gone = service(home, "status")
    assert gone.returncode == 5
    assert "not installed" in gone.stdout
    assert "daemon      not running" in gone.stdout


def test_install_refuses_an_invalid_configuration(home: Path) -> None:
    (home / ".config" / "volunteerd" / "config.toml").write_text("[network]\nport = -1\n")
    before = files_in(home)
    refused = service(home, "install")
    assert refused.returncode == 3
    assert "network.port" in refused.stderr
    assert files_in(home) == before


def test_install_no_start_keeps_locations_chosen_explicitly(home: Path, tmp_path: Path) -> None:
    config = home / ".config" / "volunteerd" / "config.toml"
    data = tmp_path / "elsewhere"
    done = service(
        home, "install", "--no-start", "--no-tray", "--config", str(config), "--data-dir", str(data)
    )
    assert done.returncode == 0, done.stdout + done.stderr
    assert "not started (--no-start)" in done.stdout
    assert not (home / TRAY).exists()
    unit = (home / UNIT).read_text()
    assert f"\nEnvironment=VOLUNTEERD_CONFIG={config}\n" in unit
    assert f"\nEnvironment=VOLUNTEERD_DATA_DIR={data}\n" in unit
    assert not (data / "control.json").exists()
    # status and uninstall need the same locations as install
    assert service(home, "status", "--config", str(config), "--data-dir", str(data)).returncode == 5
    removed = service(home, "uninstall", "--data-dir", str(data))
    assert removed.returncode == 0, removed.stdout + removed.stderr
    assert "no daemon was running" in removed.stdout
    assert files_in(home) == {".config/volunteerd/config.toml"}


def test_install_refuses_set_because_the_service_would_not_keep_it(home: Path) -> None:
    refused = service(home, "install", "--set", "network.port=4001")
    assert refused.returncode == 2
    assert "put the value in" in refused.stderr
    assert not (home / UNIT).exists()


@pytest.mark.parametrize(
    ("folder", "words"),
    [
        ("data\nevil", "has a control character"),
        ("data\tevil", "has a control character"),
        # Latin-1 bytes on a UTF-8 system: "Jos\xe9" as the file system names it
        (os.fsdecode(b"Jos\xe9 M\xfcller"), "is not named in UTF-8 on disk"),
    ],
    ids=["newline", "tab", "latin-1"],
)
def test_install_refuses_a_data_folder_no_autostart_file_can_name(
    home: Path, tmp_path: Path, folder: str, words: str
) -> None:
    data = tmp_path / folder
    done = service(home, "install", "--no-start", "--data-dir", str(data))
    assert done.returncode == 2, done.stdout + done.stderr
    assert f"the data folder {str(data)!r} {words}" in done.stderr
    assert "Traceback" not in done.stderr
    assert not (home / UNIT).exists()
    assert not (home / TRAY).exists()
    assert not data.exists()
    # a folder with letters outside ASCII, a percent sign and a dollar sign is fine
    fine = tmp_path / "Jos\u00e9 M\u00fcller 100% $USER"
    done = service(home, "install", "--no-start", "--no-tray", "--data-dir", str(fine))
    assert done.returncode == 0, done.stdout + done.stderr
    assert f"VOLUNTEERD_DATA_DIR={fine}".replace("%", "%%") in (home / UNIT).read_text()


def test_a_daemon_with_its_control_api_off_is_seen_kept_single_and_stopped(home: Path) -> None:
    """With ``control.enabled = false`` there is no control.json: ``status`` said "not
    running" while the daemon ran, a second ``install`` started another (which died:
    the data folder in use) and said all was well, and ``uninstall`` left it running
    under an environment uninstall.sh then deletes. The data folder's lock says it
    runs, and names its pid."""
    config = home / ".config" / "volunteerd" / "config.toml"
    config.write_text(SMALL_DAEMON.replace("[control]\nport = 0\n", "[control]\nenabled = false\n"))
    installed = service(home, "install", "--no-tray")
    assert installed.returncode == 0, installed.stdout + installed.stderr
    holder = lock_holder(home / DATA / "volunteerd.lock")
    assert holder is not None
    assert holder.pid is not None
    pid = holder.pid
    assert f"volunteerd is running (pid {pid}); the control API is off" in installed.stdout
    assert not (home / DATA / "control.json").exists()

    again = service(home, "install", "--no-tray")
    assert again.returncode == 0, again.stdout + again.stderr
    assert "started volunteerd in the background" not in again.stdout  # no second daemon
    assert f"volunteerd is running (pid {pid}); the control API is off" in again.stdout

    shown = service(home, "status")
    assert shown.returncode == 0, shown.stdout + shown.stderr
    assert f"daemon      running (control API off), pid {pid}\n" in shown.stdout
    report = json.loads(service(home, "status", "--json").stdout)
    assert (report["running"], report["pid"], report["dashboard"]) == (True, pid, None)

    removed = service(home, "uninstall")
    assert removed.returncode == 0, removed.stdout + removed.stderr
    assert f"stopped the daemon (pid {pid}) with SIGTERM" in removed.stdout
    assert not alive(pid)
    assert "another volunteerd is using" not in (home / DATA / "daemon.log").read_text()
    assert "daemon      not running" in service(home, "status").stdout
