"""The autostart files of every platform: what packaging/ keeps is what volunteerd
renders, each parses as its service manager reads it, and each keeps the exit-code
contract of errors.ExitCode."""

from __future__ import annotations

import plistlib
import shlex
import shutil
import subprocess
import sys
import xml.etree.ElementTree as ET
from pathlib import Path

import pytest

from volunteerd.cli import main
from volunteerd.config import TimeoutsConfig
from volunteerd.errors import ExitCode
from volunteerd.service.files import (
    PLATFORMS,
    Launch,
    Platform,
    render,
    stop_timeout_s,
)
from volunteerd.service.install import PLACEHOLDER_ARGV

ROOT = Path(__file__).resolve().parents[2]
TASK = "{http://schemas.microsoft.com/windows/2004/02/mit/task}"
REGENERATE = (
    "run: for p in linux macos windows; do "
    "volunteerd service render --platform $p --out packaging/$p; done"
)
AWKWARD = Path("/srv/awkward/100% sure/$HOME \"quoted\" 'single' back\\slash;x")


def files(platform: Platform, launch: Launch) -> dict[str, bytes]:
    return {f.name: f.content for f in render(platform, launch)}


def unit_lines(launch: Launch) -> dict[str, list[str]]:
    text = files("linux", launch)["volunteerd.service"].decode()
    keys: dict[str, list[str]] = {}
    for line in text.splitlines():
        if "=" in line and not line.startswith("#"):
            key, value = line.split("=", 1)
            keys.setdefault(key, []).append(value)
    return keys


@pytest.mark.parametrize("platform", PLATFORMS)
def test_packaging_files_are_what_volunteerd_renders(platform: Platform, tmp_path: Path) -> None:
    assert main(["service", "render", "--platform", platform, "--out", str(tmp_path)]) == 0
    rendered = {p.name: p.read_bytes() for p in tmp_path.iterdir()}
    kept = {p.name: p.read_bytes() for p in (ROOT / "packaging" / platform).iterdir()}
    assert kept == rendered, REGENERATE


# -- systemd ---------------------------------------------------------------------------------


def test_systemd_unit_keeps_the_exit_code_contract() -> None:
    keys = unit_lines(Launch(argv=("/opt/v/bin/python", "-m", "volunteerd")))
    assert keys["ExecStart"] == ["/opt/v/bin/python -m volunteerd serve"]
    assert keys["Restart"] == ["on-failure"]
    assert "RestartForceExitStatus" not in keys  # no exit status asks for a restart
    assert keys["RestartPreventExitStatus"] == [str(int(ExitCode.CONFIG))]
    assert keys["SuccessExitStatus"] == [str(int(ExitCode.INTERRUPTED))]
    assert keys["KillSignal"] == ["SIGTERM"]
    assert keys["WantedBy"] == ["default.target"]
    assert "Environment" not in keys  # nothing chosen explicitly: the daemon's defaults


def test_stop_timeout_is_over_the_daemons_shutdown_grace() -> None:
    grace = TimeoutsConfig().shutdown_grace_s
    keys = unit_lines(Launch(argv=("/x",)))
    assert int(keys["TimeoutStopSec"][0]) > 2 * grace  # withdraw + drain, then save
    assert stop_timeout_s(TimeoutsConfig(shutdown_grace_s=60)) > 120


def test_systemd_unit_quotes_paths_so_systemd_reads_them_back() -> None:
    launch = Launch(argv=(str(AWKWARD / "python"), "-m", "volunteerd"), config_file=AWKWARD)
    keys = unit_lines(launch)
    # systemd: "..." with C escapes (as shlex reads them), %% for %, $$ for $ in commands
    (exec_start,) = keys["ExecStart"]
    # (through /usr/bin/env: systemd takes none of these characters in a program's name)
    assert shlex.split(exec_start.replace("%%", "%").replace("$$", "$")) == [
        "/usr/bin/env",
        str(AWKWARD / "python"),
        "-m",
        "volunteerd",
        "serve",
    ]
    (environment,) = keys["Environment"]
    assert shlex.split(environment.replace("%%", "%")) == [f"VOLUNTEERD_CONFIG={AWKWARD}"]


def systemd_verify(unit: Path) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        ["systemd-analyze", "verify", str(unit)],
        capture_output=True,
        text=True,
        timeout=60,
        check=False,
    )


@pytest.mark.skipif(not shutil.which("systemd-analyze"), reason="systemd-analyze not installed")
def test_systemd_analyze_accepts_the_unit(tmp_path: Path) -> None:
    unit = tmp_path / "volunteerd.service"
    # the real interpreter: verify checks that ExecStart's program exists
    unit.write_bytes(files("linux", Launch(argv=(sys.executable, "-m", "volunteerd")))[unit.name])
    done = systemd_verify(unit)
    complaints = [line for line in (done.stdout + done.stderr).splitlines() if "volunteerd" in line]
    assert done.returncode == 0, done.stderr
    assert complaints == []  # unknown keys are only warned about


@pytest.mark.skipif(not shutil.which("systemd-analyze"), reason="systemd-analyze not installed")
@pytest.mark.parametrize("name", ["dollar$x", "quote's", 'dq"x', "back\\slash", "100% sure"])
def test_systemd_takes_a_program_whose_path_has_characters_it_does_not_allow(
    tmp_path: Path, name: str
) -> None:
    """systemd refuses a quote or a backslash in the program's name, and reads ``$$``
    there as two dollars ("is not executable"): an environment under such a folder got
    a unit that never started (an outside probe)."""
    program = tmp_path / name / "bin" / "python"
    program.parent.mkdir(parents=True)
    program.symlink_to(sys.executable)
    unit = tmp_path / "volunteerd.service"
    unit.write_bytes(files("linux", Launch(argv=(str(program), "-m", "volunteerd")))[unit.name])
    done = systemd_verify(unit)
    assert done.returncode == 0, done.stderr
    (exec_start,) = unit_lines(Launch(argv=(str(program), "-m", "volunteerd")))["ExecStart"]
    words = shlex.split(exec_start.replace("%%", "%").replace("$$", "$"))
    assert words[words.index(str(program)) :] == [str(program), "-m", "volunteerd", "serve"]


# -- XDG autostart ---------------------------------------------------------------------------


def desktop_exec(entry: str) -> list[str]:
    """The Exec key's arguments, read as the Desktop Entry Specification says."""
    (value,) = [line[5:] for line in entry.splitlines() if line.startswith("Exec=")]
    value = value.replace("\\\\", "\\").replace("%%", "%")  # the string value's escapes
    args, word, quoted, i, started = [], "", False, 0, False
    while i < len(value):
        c = value[i]
        if quoted and c == "\\":
            word, i = word + value[i + 1], i + 2
            continue
        if c == '"':
            quoted, started = not quoted, True
        elif c == " " and not quoted:
            if started:
                args.append(word)
            word, started = "", False
        else:
            word, started = word + c, True
        i += 1
    if started:
        args.append(word)
    return args


def test_tray_entry_runs_the_tray_with_the_chosen_locations() -> None:
    launch = Launch(argv=(str(AWKWARD / "python"), "-m", "volunteerd"), data_dir=AWKWARD)
    entry = files("linux", launch)["volunteerd-tray.desktop"].decode()
    assert desktop_exec(entry) == [
        "env",
        f"VOLUNTEERD_DATA_DIR={AWKWARD}",
        str(AWKWARD / "python"),
        "-m",
        "volunteerd",
        "tray",
        "--no-start",
    ]
    assert "Icon=volunteerd\n" in entry
    assert "X-GNOME-Autostart-enabled=true\n" in entry


def test_the_tray_starts_the_daemon_only_where_no_service_manager_does() -> None:
    with_systemd = files("linux", Launch(argv=("/x",)))["volunteerd-tray.desktop"].decode()
    without = files("linux", Launch(argv=("/x",), tray_starts_daemon=True))
    assert desktop_exec(with_systemd) == ["/x", "tray", "--no-start"]
    assert desktop_exec(without["volunteerd-tray.desktop"].decode()) == ["/x", "tray"]


@pytest.mark.skipif(
    not shutil.which("desktop-file-validate"),
    reason="desktop-file-validate not installed (apt-get install desktop-file-utils)",
)
@pytest.mark.parametrize("tricky", [False, True])
def test_desktop_file_validate_accepts_the_entry(tmp_path: Path, tricky: bool) -> None:
    launch = (
        Launch(argv=(str(AWKWARD / "python"), "-m", "volunteerd"), config_file=AWKWARD)
        if tricky
        else Launch(argv=(sys.executable, "-m", "volunteerd"))
    )
    entry = tmp_path / "volunteerd-tray.desktop"
    entry.write_bytes(files("linux", launch)[entry.name])
    done = subprocess.run(
        ["desktop-file-validate", str(entry)], capture_output=True, text=True, timeout=30
    )
    assert done.returncode == 0, done.stdout + done.stderr
    assert done.stdout + done.stderr == ""  # no warnings or hints either


def test_icon_is_an_svg() -> None:
    svg = ET.fromstring(files("linux", Launch(argv=("/x",)))["volunteerd.svg"])
    assert svg.tag == "{http://www.w3.org/2000/svg}svg"


# -- launchd ---------------------------------------------------------------------------------


def test_launch_agents_restart_the_daemon_after_a_crash_only(tmp_path: Path) -> None:
    logs = tmp_path / "Logs" / "volunteerd"
    launch = Launch(argv=("/opt/v/bin/python", "-m", "volunteerd"), log_dir=logs)
    agents = files("macos", launch)
    daemon = plistlib.loads(agents["org.volunteerd.daemon.plist"])
    assert daemon["Label"] == "org.volunteerd.daemon"
    assert daemon["ProgramArguments"] == ["/opt/v/bin/python", "-m", "volunteerd", "serve"]
    assert daemon["RunAtLoad"] is True
    assert daemon["KeepAlive"] == {"SuccessfulExit": False}
    assert daemon["StandardOutPath"] == daemon["StandardErrorPath"] == str(logs / "daemon.log")
    assert daemon["ExitTimeOut"] == launch.stop_timeout_s
    assert daemon["ProcessType"] == "Standard"
    # the one file it appends its output to, which it keeps bounded (detached.OwnLogFile)
    assert daemon["EnvironmentVariables"] == {"VOLUNTEERD_LOG_FILE": str(logs / "daemon.log")}
    tray = plistlib.loads(agents["org.volunteerd.tray.plist"])
    assert tray["Label"] == "org.volunteerd.tray"
    assert tray["ProgramArguments"][-2:] == ["tray", "--no-start"]  # launchd runs the daemon
    assert tray["ProcessType"] == "Interactive"
    assert tray["LimitLoadToSessionType"] == "Aqua"
    assert tray["StandardErrorPath"] == str(logs / "tray.log")
    assert "EnvironmentVariables" not in tray


def test_launch_agents_carry_the_chosen_locations() -> None:
    launch = Launch(argv=("/x",), config_file=AWKWARD, data_dir=Path("/d"), cache_dir=Path("/c"))
    for content in files("macos", launch).values():
        env = plistlib.loads(content)["EnvironmentVariables"]
        env.pop("VOLUNTEERD_LOG_FILE", None)  # the daemon's
        assert env == {
            "VOLUNTEERD_CONFIG": str(AWKWARD),
            "VOLUNTEERD_DATA_DIR": "/d",
            "VOLUNTEERD_CACHE_DIR": "/c",
        }


# -- Task Scheduler --------------------------------------------------------------------------


def test_tasks_run_at_the_users_logon_with_least_privilege() -> None:
    argv = ("C:\\Program Files\\volunteerd\\pythonw.exe", "-m", "volunteerd")
    launch = Launch(argv=argv, user="HOME-PC\\ada", data_dir=Path("C:/Users/ada/vol data"))
    tasks = files("windows", launch)
    for name, verb in (("volunteerd-daemon.xml", "serve"), ("volunteerd-tray.xml", "tray")):
        content = tasks[name]
        assert content.startswith(b"\xff\xfe")  # UTF-16 with its byte-order mark
        text = content.decode("utf-16")
        assert text.startswith('<?xml version="1.0" encoding="UTF-16"?>\r\n')
        task = ET.fromstring(content)
        assert task.tag == f"{TASK}Task"
        trigger = task.find(f"{TASK}Triggers/{TASK}LogonTrigger")
        assert trigger is not None
        assert trigger.findtext(f"{TASK}UserId") == "HOME-PC\\ada"
        principal = task.find(f"{TASK}Principals/{TASK}Principal")
        assert principal is not None
        assert principal.findtext(f"{TASK}UserId") == "HOME-PC\\ada"
        assert principal.findtext(f"{TASK}LogonType") == "InteractiveToken"
        assert principal.findtext(f"{TASK}RunLevel") == "LeastPrivilege"
        settings = task.find(f"{TASK}Settings")
        assert settings is not None
        assert settings.findtext(f"{TASK}ExecutionTimeLimit") == "PT0S"  # no time limit
        assert settings.findtext(f"{TASK}RestartOnFailure/{TASK}Interval") == "PT1M"
        assert settings.findtext(f"{TASK}RestartOnFailure/{TASK}Count") == "3"
        assert settings.findtext(f"{TASK}DisallowStartIfOnBatteries") == "false"
        action = task.find(f"{TASK}Actions/{TASK}Exec")
        assert action is not None
        assert action.findtext(f"{TASK}Command") == argv[0]
        arguments = action.findtext(f"{TASK}Arguments")
        expected = ["-m", "volunteerd", verb]
        if verb == "tray":
            expected.append("--no-start")
        expected += ["--data-dir", "C:/Users/ada/vol data"]
        assert arguments == subprocess.list2cmdline(expected)


# -- the render verb -------------------------------------------------------------------------


def test_render_takes_the_command_that_runs_volunteerd(tmp_path: Path) -> None:
    argv = ["service", "render", "--platform", "linux", "--out", str(tmp_path)]
    assert main([*argv, "--exec", "/usr/bin/volunteerd"]) == 0
    unit = (tmp_path / "volunteerd.service").read_text()
    assert "\nExecStart=/usr/bin/volunteerd serve\n" in unit
    entry = (tmp_path / "volunteerd-tray.desktop").read_text()
    assert "\nExec=/usr/bin/volunteerd tray --no-start\n" in entry


def test_render_writes_a_placeholder_interpreter_by_default(tmp_path: Path) -> None:
    assert main(["service", "render", "--platform", "macos", "--out", str(tmp_path)]) == 0
    agent = plistlib.loads((tmp_path / "org.volunteerd.daemon.plist").read_bytes())
    assert agent["ProgramArguments"] == [*PLACEHOLDER_ARGV["macos"], "serve"]


@pytest.mark.parametrize("platform", PLATFORMS)
def test_launches_whose_paths_no_autostart_file_can_hold_are_told(platform: Platform) -> None:
    python = ("/usr/bin/python3", "-m", "volunteerd")
    for fine in (
        "/home/Jos\u00e9 M\u00fcller/data",
        "/home/\u0130lkay I\u015f\u0131k",
        str(AWKWARD),
    ):
        assert Launch(argv=python, data_dir=Path(fine)).unwritable(platform) is None
    split = Launch(argv=("/opt/v\nenv/bin/python", "-m", "volunteerd"))
    assert "the program '/opt/v\\nenv/bin/python' has a control character" in str(
        split.unwritable(platform)
    )
    tab = Launch(argv=python, config_file=Path("/etc/v\tcfg.toml"))
    assert "the configuration file '/etc/v\\tcfg.toml' has a control" in str(
        tab.unwritable(platform)
    )
    # Latin-1 bytes read on a UTF-8 system: they cannot be written in a UTF-8 file
    latin1 = Launch(argv=python, cache_dir=Path("/home/" + "Jos\udce9"))
    assert "the cache folder '/home/Jos\\udce9' is not named in UTF-8" in str(
        latin1.unwritable(platform)
    )
    # the log folder is launchd's alone
    logs = Launch(argv=python, log_dir=Path("/Users/a\nb/Library/Logs/volunteerd"))
    assert (logs.unwritable(platform) is None) == (platform != "macos")


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="a Linux locale")
def test_a_latin1_systems_folder_with_accents_is_refused_not_misnamed(tmp_path: Path) -> None:
    """On a system whose file names are Latin-1, "Jos\u00e9" is the bytes 4a 6f 73 e9 on
    disk: written into the UTF-8 unit it would be c3 a9, a folder that does not exist."""
    if (
        "de_DE.iso88591"
        not in subprocess.run(
            ["locale", "-a"], capture_output=True, text=True, check=False
        ).stdout.split()
    ):
        pytest.skip("no de_DE.ISO-8859-1 locale (localedef -f ISO-8859-1 -i de_DE ...)")
    code = (
        "import sys; from pathlib import Path; from volunteerd.service.files import Launch\n"
        "d = Path(sys.argv[1])\n"
        "print(sys.getfilesystemencoding(), Launch(argv=('/p',), data_dir=d).unwritable('linux'))"
    )
    env = {"PATH": "/usr/bin:/bin", "LC_ALL": "de_DE.ISO-8859-1", "PYTHONPATH": str(ROOT)}
    done = subprocess.run(
        [sys.executable, "-c", code, bytes(tmp_path) + "/Jos\u00e9".encode("latin-1")],
        env=env,
        capture_output=True,
        check=False,
    )
    assert done.returncode == 0, done.stderr
    assert done.stdout.startswith(b"iso8859-1 the data folder"), done.stdout
    assert b"is not named in UTF-8 on disk" in done.stdout
