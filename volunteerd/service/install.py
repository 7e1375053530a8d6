"""``volunteerd service install|uninstall|status|render``.

``install`` writes this platform's autostart files (atomically, and only those whose
bytes change), tells the service manager, then (unless ``start=False``) starts the
daemon and waits until its control API answers. Where no service manager runs the
daemon (Linux without a user systemd: containers, some SSH sessions) it starts
``volunteerd serve`` detached itself, and the tray's autostart entry starts it at
login. ``uninstall`` stops the daemon and removes exactly the files install writes.
``status`` says what is installed, whether it is current and whether a daemon answers
(or runs without its control API: the data folder's lock says so).

Exit codes (packaging/README.md): install 0 (installed, and answering unless
``--no-start``; with ``control.enabled = false``, holding its data folder's lock), 2
(``--set``: the service would not keep it), 3 (the configuration is invalid: nothing
written), 5 (installed, but the daemon did not answer or the service manager refused).
uninstall 0 (nothing of volunteerd's autostart is left), 5 (the daemon would not stop;
the files are removed all the same). status 0 (installed, current, and a daemon
answers or, with the control API off, runs), 5 (anything else; the output says which).
"""

from __future__ import annotations

import json
import os
import shlex
import subprocess
import sys
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from pathlib import Path

from volunteerd.atomic import write_atomic
from volunteerd.config import Config, load_config
from volunteerd.control.client import ControlClient
from volunteerd.detached import config_variables, start_detached
from volunteerd.errors import (
    ConfigError,
    ControlError,
    ExitCode,
    ResourceUnavailable,
    UsageError,
)
from volunteerd.paths import ENV_CACHE_DIR, ENV_CONFIG, ENV_DATA_DIR, Paths
from volunteerd.service.files import (
    DEFAULT_STOP_TIMEOUT_S,
    PLACEHOLDER_USER,
    PLATFORMS,
    SYSTEMD_UNIT,
    Launch,
    Platform,
    Rendered,
    render,
    stop_timeout_s,
)
from volunteerd.service.managers import Manager, Systemd, manager_for
from volunteerd.service.process import (
    probe,
    stop_daemon,
    stop_tray,
    tray_pid,
    wait_until_answering,
    wait_until_running,
)

__all__ = ["Chosen", "current_platform", "install", "render_reference", "status", "uninstall"]

START_TIMEOUT_S = 60.0  # for a started daemon's control API to answer

# `volunteerd service render` without --exec: where a packaged interpreter would live.
PLACEHOLDER_ARGV: dict[Platform, tuple[str, ...]] = {
    "linux": ("/opt/volunteerd/bin/python", "-m", "volunteerd"),
    "macos": ("/opt/volunteerd/bin/python", "-m", "volunteerd"),
    "windows": ("C:\\Program Files\\volunteerd\\pythonw.exe", "-m", "volunteerd"),
}

Out = Callable[[str], None]


@dataclass(frozen=True, slots=True)
class Chosen:
    """What the user chose at install time: ``--config``/``--data-dir`` given (those and
    the variables VOLUNTEERD_CONFIG, _DATA_DIR, _CACHE_DIR are kept in the files)."""

    config_flag: bool = False
    data_dir_flag: bool = False


def current_platform() -> Platform:
    if sys.platform.startswith("linux"):
        return "linux"
    if sys.platform == "darwin":
        return "macos"
    if sys.platform == "win32":
        return "windows"
    raise UsageError(f"no autostart for {sys.platform}: run `volunteerd serve` yourself")


def install(
    paths: Paths,
    chosen: Chosen,
    *,
    start: bool = True,
    tray: bool = True,
    overrides: list[str] | None = None,
    out: Out = print,
) -> ExitCode:
    """``volunteerd service install``; see the module docstring."""
    if overrides:
        raise UsageError(
            f"--set is not kept by the autostarted daemon: put the value in {paths.config_file}"
        )
    platform = current_platform()
    # What the autostarted daemon will read: the file, not this shell's variables.
    config = load_config(
        paths.config_file, required=chosen.config_flag, env={}, run_time_dir=paths.data_dir
    )
    ignored = config_variables(os.environ)
    if ignored:
        out(
            f"note: {', '.join(ignored)} apply to this shell only; the autostarted daemon "
            f"reads {paths.config_file}"
        )
    manager = manager_for(platform)
    launch = _launch(platform, paths, chosen, config, manager)
    made = paths.make_data_dir()  # 0700, before the daemon or `volunteerd id` fills it
    if made:
        out(made)
    where = manager.locations(paths)
    written: dict[str, str] = {}
    daemon_changed = False
    for file in render(platform, launch):
        target = where[file.name]
        if file.role == "tray" and not tray:
            if target.exists():
                target.unlink()
                out(f"removed   {target} (--no-tray)")
            continue
        state = _write(target, file.content)
        written[file.name] = state
        daemon_changed |= file.role == "daemon" and state != "unchanged"
        out(f"{state:9} {target}")
    if platform == "macos":
        launch.log_dir.mkdir(parents=True, exist_ok=True)  # launchd does not create it
    states = set(written.values())
    if states == {"unchanged"}:
        out("volunteerd's autostart is already installed")
    else:
        out("volunteerd's autostart is " + ("updated" if "updated" in states else "installed"))
    registered = manager.register(
        {name: where[name] for name in written if name.endswith((".service", ".plist", ".xml"))},
        changed=states != {"unchanged"},
    )
    if not registered.ok:
        out(f"{manager.name} refused the files: {registered.output}")
        return ExitCode.UNAVAILABLE
    if not start:
        out("not started (--no-start): volunteerd starts at your next login")
        return ExitCode.OK
    return _start(
        platform, manager, launch, paths, config, changed=daemon_changed, tray=tray, out=out
    )


def uninstall(paths: Paths, chosen: Chosen, *, out: Out = print) -> ExitCode:
    """``volunteerd service uninstall``; see the module docstring."""
    platform = current_platform()
    manager = manager_for(platform)
    config, _ = _config_or_defaults(paths, chosen)
    installed = {name: path for name, path in manager.locations(paths).items() if path.exists()}
    unregistered = manager.unregister(installed)
    if not unregistered.ok:
        out(f"{manager.name}: {unregistered.output}")
    wait_s = stop_timeout_s(config.timeouts) if config else DEFAULT_STOP_TIMEOUT_S
    stopped = True
    try:
        out(stop_daemon(paths, wait_s))
    except ResourceUnavailable as exc:
        out(str(exc))
        stopped = False
    tray = stop_tray(paths)
    if tray is not None:
        out(tray)
    for path in installed.values():
        path.unlink(missing_ok=True)
        out(f"removed   {path}")
    links = []
    if isinstance(manager, Systemd):
        link = manager.enablement_link(paths)
        links.append(link)
        if link.is_symlink():  # enabled once, and systemd is gone now
            link.unlink()
            out(f"removed   {link}")
    manager.after_removal()
    _remove_empty_folders([*installed.values(), *links], manager.shared_folders(), out)
    if not installed:
        out("volunteerd's autostart was not installed")
    out(
        f"your data in {paths.data_dir} and your settings in {paths.config_file} "
        "are not touched by this command"
    )
    return ExitCode.OK if stopped else ExitCode.UNAVAILABLE


def _remove_empty_folders(removed: list[Path], shared: tuple[Path, ...], out: Out) -> None:
    """Remove the folders of the ``removed`` files that are empty now, and their
    parents that became empty, up to (not including) a ``shared`` folder; folders
    outside those are left as they are (e.g. ~/Library/LaunchAgents)."""
    for path in removed:
        folder = path.parent
        while any(folder.is_relative_to(s) and folder != s for s in shared):
            try:
                folder.rmdir()  # only when empty
            except OSError:
                break
            out(f"removed   {folder}/ (empty)")
            folder = folder.parent


def status(paths: Paths, chosen: Chosen, *, as_json: bool = False, out: Out = print) -> ExitCode:
    """``volunteerd service status``: 0 when installed, current and answering, else 5."""
    platform = current_platform()
    manager = manager_for(platform)
    config, problem = _config_or_defaults(paths, chosen)
    launch = _launch(platform, paths, chosen, config or Config(), manager)
    where = manager.locations(paths)
    files = [_file_state(file, where[file.name]) for file in render(platform, launch)]
    installed = any(f["role"] == "daemon" and f["installed"] for f in files)
    current = installed and all(f["current"] for f in files if f["installed"])
    answer = probe(paths.data_dir)
    api_off = config is not None and not config.control.enabled
    state = (
        None
        if answer is None or answer.refused
        else "busy (does not answer in time)"
        if answer.busy
        else ("running (control API off)" if api_off else "running (no control API: starting?)")
        if answer.unreachable
        else _daemon_state(paths)
    )
    report = {
        "platform": platform,
        "installed": installed,
        "current": current,
        "files": files,
        "manager": manager.describe(),
        "running": answer is not None,
        "state": state,
        "pid": answer.pid if answer is not None else None,
        "dashboard": f"{answer.url}/" if answer is not None and answer.url else None,
        "config_error": problem,
    }
    ok = installed and current and answer is not None
    if as_json:
        out(json.dumps(report, indent=2))
        return ExitCode.OK if ok else ExitCode.UNAVAILABLE
    if not installed:
        out("autostart   not installed (`volunteerd service install` installs it)")
    elif not current:
        out("autostart   installed, out of date (`volunteerd service install` updates it)")
    else:
        out("autostart   installed")
    for f in files:
        shown = "current" if f["current"] else "differs" if f["installed"] else "absent"
        out(f"  {f['role']:6}    {f['path']} ({shown})")
    out(f"manager     {report['manager']}")
    if answer is None:
        out("daemon      not running")
    elif answer.refused:
        out(f"daemon      something answers at {answer.url} but refuses: {answer.refused}")
    elif answer.busy:
        out(f"daemon      running (pid {answer.pid}) but its API did not answer in time (busy?)")
    elif answer.unreachable:
        out(f"daemon      {state}, pid {answer.pid or 'unknown'}")
    else:
        out(f"daemon      {state}, pid {answer.pid}, dashboard at {answer.url}/")
        out("            (`volunteerd dashboard` opens it, signed in)")
    if problem:
        out(f"config      {problem}")
    return ExitCode.OK if ok else ExitCode.UNAVAILABLE


def render_reference(
    platform: str, out_dir: Path, exec_command: str | None = None, *, out: Out = print
) -> ExitCode:
    """``volunteerd service render``: this platform's files for ``exec_command`` (how to
    run volunteerd: ``/usr/bin/volunteerd`` or ``/opt/volunteerd/bin/python -m
    volunteerd``; a placeholder by default), as packaging/ keeps them."""
    if platform not in PLATFORMS:
        raise UsageError(f"--platform must be one of {', '.join(PLATFORMS)}")
    chosen: Platform = platform  # type: ignore[assignment]
    if exec_command is None:
        argv = PLACEHOLDER_ARGV[chosen]
    elif chosen == "windows":
        argv = tuple(word.strip('"') for word in shlex.split(exec_command, posix=False))
    else:
        argv = tuple(shlex.split(exec_command))
    if not argv:
        raise UsageError("--exec is empty")
    for file in render(chosen, Launch(argv=argv)):
        write_atomic(out_dir / file.name, file.content)
        out(str(out_dir / file.name))
    return ExitCode.OK


# -- helpers -------------------------------------------------------------------------------


def _launch(
    platform: Platform, paths: Paths, chosen: Chosen, config: Config, manager: Manager
) -> Launch:
    """The Launch of this install: this interpreter (or frozen executable), the
    locations chosen explicitly, the account, the log folder."""
    if not sys.executable:
        raise UsageError("cannot tell which Python runs volunteerd (sys.executable is empty)")
    executable = os.path.abspath(sys.executable)
    if platform == "windows" and not getattr(sys, "frozen", False):
        windowless = Path(executable).with_name("pythonw.exe")  # no console window
        executable = str(windowless) if windowless.exists() else executable
    argv = (executable,) if getattr(sys, "frozen", False) else (executable, "-m", "volunteerd")
    environ = os.environ

    def explicit(flag: bool, variable: str, value: Path) -> Path | None:
        return value.absolute() if flag or environ.get(variable) else None

    launch = Launch(
        argv=argv,
        stop_timeout_s=stop_timeout_s(config.timeouts),
        config_file=explicit(chosen.config_flag, ENV_CONFIG, paths.config_file),
        data_dir=explicit(chosen.data_dir_flag, ENV_DATA_DIR, paths.data_dir),
        cache_dir=explicit(False, ENV_CACHE_DIR, paths.cache_dir),
        tray_starts_daemon=platform == "linux" and not manager.usable(),
        user=_windows_account(environ) if platform == "windows" else PLACEHOLDER_USER,
        log_dir=Path.home() / "Library" / "Logs" / "volunteerd",
        low_priority=config.runtime.priority == "low",
    )
    problem = launch.unwritable(platform)
    if problem:
        raise UsageError(problem)
    return launch


def _windows_account(environ: Mapping[str, str]) -> str:
    import getpass

    domain = environ.get("USERDOMAIN", "")
    name = getpass.getuser()
    return f"{domain}\\{name}" if domain else name


def _write(target: Path, content: bytes) -> str:
    """Write ``content`` unless it is there already: "installed", "updated" or
    "unchanged"."""
    try:
        old: bytes | None = target.read_bytes()
    except FileNotFoundError:
        old = None
    if old == content:
        return "unchanged"
    write_atomic(target, content)
    return "installed" if old is None else "updated"


def _start(
    platform: Platform,
    manager: Manager,
    launch: Launch,
    paths: Paths,
    config: Config,
    *,
    changed: bool,
    tray: bool,
    out: Out,
) -> ExitCode:
    """Start the daemon through the service manager (or detached, where there is none)
    and wait until its control API answers."""
    running = probe(paths.data_dir)
    alive: Callable[[], bool] | None = None
    child: subprocess.Popen[bytes] | None = None
    log_hint = f"its log: {launch.log_dir / 'daemon.log'}"
    if isinstance(manager, Systemd) and manager.usable():
        systemd = manager
        if running is not None and systemd.state() not in ("active", "activating"):
            # Started by hand or by the tray: systemd runs it from now on.
            out(stop_daemon(paths, launch.stop_timeout_s) + "; systemd runs it from now on")
            running = None
        started = systemd.start(changed=changed, tray=tray)
        if not started.ok:
            out(f"systemd could not start volunteerd: {started.output}")
            return ExitCode.UNAVAILABLE
        out(f"started {SYSTEMD_UNIT}")
        log_hint = "its log: `journalctl --user -u volunteerd`"

        def alive() -> bool:
            return systemd.state() not in ("failed", "inactive")

    elif platform == "linux":
        log_hint = f"its log: {paths.daemon_log_file}"
        if running is None:
            child = start_detached(
                launch.command("serve"), paths.daemon_log_file, launch.environment()
            )
            out(
                f"no user systemd here: started volunteerd in the background (pid {child.pid}, "
                f"output in {paths.daemon_log_file})"
            )
            alive = _running(child)
        out(
            "the tray's autostart entry starts volunteerd at your next login"
            if tray
            else "note: without a user systemd, only the tray's autostart entry (not "
            "installed: --no-tray) starts volunteerd at login"
        )
    else:
        started = manager.start(changed=changed, tray=tray)
        if not started.ok:
            out(f"{manager.name} could not start volunteerd: {started.output}")
            return ExitCode.UNAVAILABLE
        if platform == "windows":
            log_hint = "the task's history in Task Scheduler"
    if changed and child is None:
        running = None  # restarted with the new file: wait for the new daemon
    if not config.control.enabled:
        # No API to wait for: the data folder's lock says it runs, held a moment on.
        answer = (
            running
            if running is not None
            else wait_until_running(paths.data_dir, START_TIMEOUT_S, alive)
        )
    elif running is not None and not running.busy and not running.unreachable:
        answer = running
    else:
        answer = wait_until_answering(paths.data_dir, START_TIMEOUT_S, alive)
    if answer is None:
        code = child.poll() if child is not None else None
        if code is None:
            what = "answer" if config.control.enabled else "start"
            out(f"volunteerd did not {what} within {START_TIMEOUT_S:.0f} s; {log_hint}")
        else:
            out(f"volunteerd exited with status {code}; {log_hint}:")
            out(_tail(paths.daemon_log_file))
        return ExitCode.CONFIG if code == ExitCode.CONFIG else ExitCode.UNAVAILABLE
    if answer.refused:
        out(f"something answers at {answer.url} but refuses this client: {answer.refused}")
        return ExitCode.UNAVAILABLE
    if answer.busy:
        out(
            f"volunteerd is running (pid {answer.pid}) but did not answer within "
            f"{START_TIMEOUT_S:.0f} s (busy?); `volunteerd service status` asks again"
        )
        return ExitCode.UNAVAILABLE
    if answer.unreachable and not config.control.enabled:
        out(
            f"volunteerd is running (pid {answer.pid or 'unknown'}); the control API is off "
            "(control.enabled = false): no dashboard"
        )
        return ExitCode.OK
    if answer.unreachable:
        out(
            f"volunteerd is running (pid {answer.pid or 'unknown'}) but its control API did "
            f"not come up within {START_TIMEOUT_S:.0f} s; {log_hint}"
        )
        return ExitCode.UNAVAILABLE
    out(f"volunteerd is running (pid {answer.pid}): dashboard at {answer.url}/")
    out("`volunteerd dashboard` opens it, signed in")
    if tray and platform == "linux":
        out(_start_tray(launch, paths))
    return ExitCode.OK


def _start_tray(launch: Launch, paths: Paths) -> str:
    """Show the tray now, as its autostart entry will at the next login (Linux: no
    service manager runs the tray; launchd and Task Scheduler start it themselves)."""
    if not (os.environ.get("DISPLAY") or os.environ.get("WAYLAND_DISPLAY")):
        return "no desktop session here: the tray icon shows at your next login"
    running = tray_pid(paths)
    if running is not None:
        return f"the tray icon is showing already (pid {running})"
    child = start_detached(launch.command("tray"), paths.daemon_log_file, launch.environment())
    return f"started the tray icon (pid {child.pid})"


def _running(child: subprocess.Popen[bytes]) -> Callable[[], bool]:
    return lambda: child.poll() is None


def _tail(path: Path, lines: int = 20) -> str:
    try:
        text = path.read_text(errors="replace")
    except OSError:
        return ""
    return "\n".join("  " + line for line in text.splitlines()[-lines:])


def _config_or_defaults(paths: Paths, chosen: Chosen) -> tuple[Config | None, str | None]:
    """The configuration the autostarted daemon reads, or None and the problem (status
    and uninstall must work with a broken file)."""
    try:
        config = load_config(
            paths.config_file, required=chosen.config_flag, env={}, run_time_dir=paths.data_dir
        )
        return config, None
    except ConfigError as exc:
        return None, str(exc)


def _file_state(file: Rendered, path: Path) -> dict[str, object]:
    try:
        content: bytes | None = path.read_bytes()
    except OSError:
        content = None
    return {
        "name": file.name,
        "role": file.role,
        "path": str(path),
        "installed": content is not None,
        "current": content == file.content,
    }


def _daemon_state(paths: Paths) -> str | None:
    try:
        shown = ControlClient.for_data_dir(paths.data_dir, timeout_s=5.0).status()
    except ControlError:
        return None
    if shown.serving or shown.reason in ("", shown.state):
        return shown.state
    return f"{shown.state} ({shown.reason})"
