"""The service verbs' view of the daemon from outside, and where their files go."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from volunteerd.config import load_config
from volunteerd.detached import OwnLogFile, config_variables, start_detached
from volunteerd.paths import DataDirLock, LockHolder, Paths, lock_holder
from volunteerd.service import process
from volunteerd.service.install import Chosen, status
from volunteerd.service.managers import Systemd
from volunteerd.service.process import (
    Answer,
    probe,
    stop_daemon,
    stop_tray,
    tray_pid,
    wait_until_answering,
)


def paths_in(tmp_path: Path) -> Paths:
    return Paths(config_file=tmp_path / "config.toml", data_dir=tmp_path, cache_dir=tmp_path)


def name_in_tray_pid(paths: Paths, pid: int) -> None:
    """Name ``pid`` in tray.pid as a tray does, and let the file's lock go (as if the tray
    holding it were another process, or had been killed)."""
    held = paths.hold_tray_pid(pid)
    assert held is not None
    os.close(held)


def test_nothing_recorded_means_nothing_to_stop(tmp_path: Path) -> None:
    assert probe(tmp_path) is None
    assert stop_daemon(paths_in(tmp_path), timeout_s=1) == "no daemon was running"


@pytest.mark.skipif(sys.platform == "win32", reason="signals")
def test_a_stale_address_file_never_gets_another_program_signalled(tmp_path: Path) -> None:
    # control.json left by a daemon that was killed; its pid now belongs to another program
    other = subprocess.Popen(["sleep", "30"])
    try:
        (tmp_path / "control.json").write_text(
            json.dumps({"url": "http://127.0.0.1:9", "pid": other.pid})
        )
        (tmp_path / "api-token").write_text("t")
        assert stop_daemon(paths_in(tmp_path), timeout_s=1) == "no daemon was running"
        assert other.poll() is None
        assert not (tmp_path / "control.json").exists()
    finally:
        other.kill()
        other.wait(10)


@pytest.mark.skipif(sys.platform == "win32", reason="signals")
def test_a_stale_pid_reused_by_a_program_named_like_volunteerd_is_not_signalled(
    tmp_path: Path,
) -> None:
    """A daemon that was killed left control.json; its pid now runs ``tail -f
    .../volunteerd/daemon.log``, "volunteerd" in its command line. That process got
    SIGTERM from ``service uninstall``, which then waited for it and said "did not
    stop". Nothing holds the data folder's lock: no daemon runs, nothing is signalled."""
    other = subprocess.Popen(
        [sys.executable, "-c", SLEEP, "tail", "-f", str(tmp_path / "volunteerd" / "daemon.log")]
    )
    try:
        paths = paths_in(tmp_path)
        paths.control_file.write_text(json.dumps({"url": "http://127.0.0.1:9", "pid": other.pid}))
        (tmp_path / "api-token").write_text("t")
        paths.lock_file.write_text(f"{other.pid}\n")  # not held: the lock died with its daemon
        assert probe(tmp_path) is None
        said: list[str] = []
        status(paths, Chosen(), out=said.append)
        assert said[-1] == "daemon      not running"
        assert stop_daemon(paths, timeout_s=1) == "no daemon was running"
        assert other.poll() is None
        assert not paths.control_file.exists()
    finally:
        other.kill()
        other.wait(10)


def test_the_lock_holder_is_found_without_taking_or_creating_anything(tmp_path: Path) -> None:
    lock = tmp_path / "data" / "volunteerd.lock"
    assert lock_holder(lock) is None
    assert not lock.parent.exists()  # nothing created
    lock.parent.mkdir()
    lock.write_text("1234\n")  # left by a daemon that ended: not held
    assert lock_holder(lock) is None
    with DataDirLock(lock):
        assert lock_holder(lock) == LockHolder(os.getpid())
    assert lock_holder(lock) is None  # the probe did not keep it


@pytest.mark.skipif(sys.platform == "win32", reason="signals")
def test_a_daemon_without_its_control_api_is_found_by_its_lock_and_stopped(
    tmp_path: Path,
) -> None:
    """With ``control.enabled = false`` there is no control.json: ``service status``
    said "not running" and ``uninstall`` "no daemon was running" while it ran on. The
    data folder's lock it holds says it runs, and names the pid to stop."""
    paths = paths_in(tmp_path)
    daemon = subprocess.Popen(
        [sys.executable, "-c", LOCKED_DAEMON, str(paths.lock_file)], stdout=subprocess.PIPE
    )
    try:
        assert daemon.stdout is not None
        assert daemon.stdout.readline() == b"locked\n"
        assert probe(tmp_path) == Answer("", daemon.pid, unreachable=True)
        paths.config_file.write_text("[control]\nenabled = false\n")
        said: list[str] = []
        status(paths, Chosen(), out=said.append)
        assert said[-1] == f"daemon      running (control API off), pid {daemon.pid}"
        assert (
            stop_daemon(paths, timeout_s=5) == f"stopped the daemon (pid {daemon.pid}) with SIGTERM"
        )
        assert daemon.wait(10) == 143
        assert probe(tmp_path) is None
    finally:
        daemon.kill()
        daemon.wait(10)
        if daemon.stdout is not None:
            daemon.stdout.close()


def test_systemd_files_follow_the_xdg_variables(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("HOME", str(tmp_path / "home"))
    paths = paths_in(tmp_path)
    custom = Systemd({"XDG_CONFIG_HOME": str(tmp_path / "cfg"), "XDG_DATA_HOME": "relative"})
    where = custom.locations(paths)
    assert where["volunteerd.service"] == tmp_path / "cfg/systemd/user/volunteerd.service"
    assert where["volunteerd-tray.desktop"] == tmp_path / "cfg/autostart/volunteerd-tray.desktop"
    # a relative XDG path is invalid (the spec says to ignore it)
    assert where["volunteerd.svg"] == (
        tmp_path / "home/.local/share/icons/hicolor/scalable/apps/volunteerd.svg"
    )
    assert custom.enablement_link(paths) == (
        tmp_path / "cfg/systemd/user/default.target.wants/volunteerd.service"
    )


def test_only_section_variables_are_config_settings() -> None:
    environ = {
        "VOLUNTEERD_CONTROL__PORT": "0",
        "VOLUNTEERD_DATA_DIR": "/d",
        "VOLUNTEERD_CONFIG": "/c",
        "HOME": "/h",
    }
    assert config_variables(environ) == ["VOLUNTEERD_CONTROL__PORT"]
    # the names the configuration itself reads (detached.py cannot import config)
    assert load_config(None, env=environ).control.port == 0


@pytest.mark.skipif(sys.platform == "win32", reason="sessions")
def test_a_detached_command_has_its_own_session_and_no_config_variables(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    for name in [k for k in os.environ if k.startswith("VOLUNTEERD_")]:
        # e.g. VOLUNTEERD_TEST_WORKERS=0, which the README offers for scripts/test
        monkeypatch.delenv(name)
    monkeypatch.setenv("VOLUNTEERD_CONTROL__PORT", "0")
    monkeypatch.setenv("VOLUNTEERD_DATA_DIR", "/from/the/shell")
    log = tmp_path / "logs" / "daemon.log"
    log.parent.mkdir()
    log.write_text("earlier\n")
    show = "import os; print(os.getsid(0), sorted(k for k in os.environ if 'VOLUNTEERD' in k))"
    child = start_detached(
        [sys.executable, "-c", show], log, {"VOLUNTEERD_CONFIG": "/chosen/config.toml"}
    )
    assert child.wait(30) == 0
    earlier, shown = log.read_text().splitlines()
    assert earlier == "earlier"  # appended, not overwritten
    session, names = shown.split(" ", 1)
    assert int(session) == child.pid  # its own session: a Ctrl-C here does not reach it
    # the file it appends to, which a daemon keeps bounded (OwnLogFile)
    assert names == "['VOLUNTEERD_CONFIG', 'VOLUNTEERD_DATA_DIR', 'VOLUNTEERD_LOG_FILE']"


@pytest.mark.parametrize("home_exists", [True, False])
def test_a_detached_program_starts_in_the_home_folder_not_the_starters(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, home_exists: bool
) -> None:
    """As the systemd unit's WorkingDirectory=%h: it kept the folder `service install`
    ran in, even once that was deleted (an outside probe). Without a home: the root."""
    monkeypatch.setenv("HOME", str(tmp_path / "home"))
    if home_exists:
        (tmp_path / "home").mkdir()
    (tmp_path / "checkout").mkdir()
    monkeypatch.chdir(tmp_path / "checkout")
    log = tmp_path / "daemon.log"
    child = start_detached([sys.executable, "-c", "import os; print(os.getcwd())"], log, {})
    assert child.wait(30) == 0
    assert log.read_text().strip() == str(tmp_path / "home" if home_exists else Path("/"))


@pytest.mark.skipif(sys.platform == "win32", reason="appended files (POSIX)")
def test_a_detached_daemons_log_file_is_kept_bounded_one_older_file_beside_it(
    tmp_path: Path,
) -> None:
    """Nothing rotated a detached daemon's log: a stranger repeating a handful of bad
    requests grew it ~7 MB a day. Past its bound the file is copied to ``<name>.1`` and
    emptied; the process's output goes on into it."""
    log = tmp_path / "daemon.log"
    log.write_text("earlier\n")
    script = (
        "from volunteerd.detached import OwnLogFile\n"
        "log = OwnLogFile.named()\n"
        "log.max_bytes = 1000\n"
        "print('x' * 2000, flush=True)\n"
        "print('bounded', log.bound(), log.bound(), flush=True)\n"
    )
    # this checkout's volunteerd, from the home folder the child starts in
    checkout = {"PYTHONPATH": str(Path(__file__).resolve().parents[2])}
    child = start_detached([sys.executable, "-c", script], log, checkout)
    assert child.wait(30) == 0
    assert (tmp_path / "daemon.log.1").read_text() == "earlier\n" + "x" * 2000 + "\n"
    assert log.read_text() == "bounded True False\n"  # appended at its new start


def test_output_not_appended_to_the_named_file_is_left_alone(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("VOLUNTEERD_LOG_FILE", str(tmp_path / "daemon.log"))
    (tmp_path / "daemon.log").write_text("not where this process writes\n")
    assert OwnLogFile.named() is None


def test_tray_pid_is_written_read_and_removed_only_by_its_owner(tmp_path: Path) -> None:
    paths = paths_in(tmp_path)
    assert paths.read_tray_pid() is None
    name_in_tray_pid(paths, 1234)
    assert paths.read_tray_pid() == 1234
    paths.remove_tray_pid(999)  # a newer tray took the file over: it is not ours
    assert paths.read_tray_pid() == 1234
    paths.remove_tray_pid(1234)
    assert not paths.tray_pid_file.exists()
    paths.tray_pid_file.write_text("garbage")
    assert paths.read_tray_pid() is None
    assert tray_pid(paths) is None


@pytest.mark.skipif(sys.platform == "win32", reason="signals")
def test_uninstall_stops_the_tray_named_in_its_pid_file_and_nothing_else(
    tmp_path: Path,
) -> None:
    paths = paths_in(tmp_path)
    assert stop_tray(paths) is None  # no tray.pid: nothing to do
    # A process whose command line is volunteerd's tray (argv as `volunteerd tray` has).
    tray = subprocess.Popen(
        [sys.executable, "-c", "import time; time.sleep(60)", "volunteerd", "tray"]
    )
    other = subprocess.Popen(["sleep", "30"])
    try:
        name_in_tray_pid(paths, other.pid)  # stale: reused by another program
        assert stop_tray(paths) is None
        assert other.poll() is None
        assert not paths.tray_pid_file.exists()

        name_in_tray_pid(paths, tray.pid)
        assert tray_pid(paths) == tray.pid
        said = stop_tray(paths)
        assert said == f"stopped the tray (pid {tray.pid})"
        assert tray.wait(10) == -signal.SIGTERM
        assert not paths.tray_pid_file.exists()
    finally:
        for proc in (tray, other):
            proc.kill()
            proc.wait(10)


@pytest.mark.skipif(sys.platform == "win32", reason="signals")
def test_a_daemon_too_busy_to_answer_is_running_and_is_stopped_by_signal(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    # A volunteerd process whose control port accepts connections but never answers
    # (a daemon at nice 10 on a loaded computer): running, not gone.
    monkeypatch.setattr(process, "REQUEST_TIMEOUT_S", 0.3)
    monkeypatch.setenv("HOME", str(tmp_path / "home"))
    busy = subprocess.Popen(
        [sys.executable, "-c", BUSY_DAEMON, "volunteerd", "serve", str(tmp_path / "control.json")],
        stdout=subprocess.PIPE,
    )
    try:
        assert busy.stdout is not None
        port = int(busy.stdout.readline())
        paths = paths_in(tmp_path)
        paths.control_file.write_text(
            json.dumps({"url": f"http://127.0.0.1:{port}", "pid": busy.pid})
        )
        (tmp_path / "api-token").write_text("t")

        answer = probe(tmp_path)
        assert answer is not None
        assert answer.pid == busy.pid
        assert "did not answer" in answer.busy
        assert not answer.refused
        started = time.monotonic()
        assert wait_until_answering(tmp_path, timeout_s=0.5) == answer  # waited, then busy
        assert time.monotonic() - started >= 0.5

        said: list[str] = []
        status(paths, Chosen(), out=said.append)
        assert said[-1] == (
            f"daemon      running (pid {busy.pid}) but its API did not answer in time (busy?)"
        )
        shown: list[str] = []
        status(paths, Chosen(), as_json=True, out=shown.append)
        report = json.loads(shown[0])
        assert report["running"] is True
        assert report["pid"] == busy.pid
        assert report["state"].startswith("busy")

        # No shutdown request to wait out: SIGTERM at once.
        assert (
            stop_daemon(paths, timeout_s=5) == f"stopped the daemon (pid {busy.pid}) with SIGTERM"
        )
        assert busy.wait(10) == 143
    finally:
        busy.kill()
        busy.wait(10)
        if busy.stdout is not None:
            busy.stdout.close()


BUSY_DAEMON = """
import os, signal, socket, sys, time
from pathlib import Path
from volunteerd.paths import DataDirLock
def stop(*_):  # as the daemon does: its control.json goes with it
    os.remove(sys.argv[3])
    os._exit(143)
signal.signal(signal.SIGTERM, stop)
DataDirLock(Path(sys.argv[3]).with_name("volunteerd.lock")).__enter__()  # as the daemon
server = socket.create_server(("127.0.0.1", 0))
print(server.getsockname()[1], flush=True)
time.sleep(60)
"""

SLEEP = "import time; time.sleep(30)"

LOCKED_DAEMON = """
import os, signal, sys, time
from pathlib import Path
from volunteerd.paths import DataDirLock
signal.signal(signal.SIGTERM, lambda *_: os._exit(143))
with DataDirLock(Path(sys.argv[1])):  # as the daemon does, first thing
    print("locked", flush=True)
    time.sleep(60)
"""


@pytest.mark.skipif(not Path("/proc/self/stat").exists(), reason="reads /proc")
def test_a_stale_tray_pid_of_a_program_named_in_another_encoding_is_no_tray(
    tmp_path: Path,
) -> None:
    """A pid in a stale tray.pid reused by a program whose name the kernel cut at 15
    bytes inside a letter, or one with a Latin-1 byte in its arguments, raised
    UnicodeDecodeError from /proc: `volunteerd tray`, `service uninstall` exited 1,
    every login."""
    import shutil

    cut = tmp_path / ("a" * 14 + "é")  # its comm: 14 a's and the first byte of "é"
    shutil.copy(shutil.which("sleep") or "/bin/sleep", cut)
    latin1 = [sys.executable, "-c", "import time; time.sleep(60)", b"Jos\xe9"]
    programs = [subprocess.Popen([cut, "60"]), subprocess.Popen(latin1)]
    try:
        paths = paths_in(tmp_path)
        for program in programs:
            name_in_tray_pid(paths, program.pid)
            assert tray_pid(paths) is None
            assert not paths.tray_pid_file.exists()  # the stale file is cleared
            assert stop_tray(paths) is None
            assert program.poll() is None  # and the program never signalled
    finally:
        for program in programs:
            program.kill()
            program.wait(10)
