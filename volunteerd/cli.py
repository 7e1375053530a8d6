"""The command line: the only argument parser. Maps signals and errors to exit codes.

Exit codes (``errors.ExitCode``): 0 ok, 1 unexpected error, 2 bad usage (also a value
the control API refused), 3 invalid configuration, 5 a needed resource is unavailable
(also: no daemon running, for the control verbs), 130 stopped by a signal,
141 the reader of the output went (``| head -1``), as for a program killed by SIGPIPE.
"""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import json
import logging
import os
import select
import signal
import statistics
import sys
import threading
import time
from collections.abc import Awaitable, Callable, Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Any

import trio

from volunteerd import __version__, localtime
from volunteerd.atomic import write_atomic
from volunteerd.config import Config, Flag, dump_toml, load_config
from volunteerd.config.loading import check_limits_overlay
from volunteerd.detached import lower_priority
from volunteerd.errors import ConfigError, ExitCode, UsageError, VolunteerdError, exit_code
from volunteerd.logs import configure_logging
from volunteerd.malloc import one_arena
from volunteerd.paths import ENV_LOCK_FD, DataDirLock, Paths, lock_holder

if TYPE_CHECKING:
    from volunteerd.control.client import ControlClient
    from volunteerd.control.models import LimitsView

__all__ = ["main"]

logger = logging.getLogger("volunteerd.cli")


def _common(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--config", metavar="FILE", help="config file (default: per-user)")
    parser.add_argument("--data-dir", metavar="DIR", help="where the key and checkpoints live")
    parser.add_argument(
        "--set",
        dest="overrides",
        action="append",
        default=[],
        metavar="KEY=VALUE",
        help="override one config value, e.g. --set network.port=4001 (repeatable)",
    )


def _network_flags(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--listen-host", metavar="IP", help="address to listen on")
    parser.add_argument("--port", type=int, metavar="N", help="TCP port (0 = any free one)")
    parser.add_argument(
        "--bootstrap",
        action="append",
        default=[],
        metavar="MULTIADDR",
        help="peer to join through, /ip4/.../tcp/.../p2p/<id> (repeatable)",
    )
    parser.add_argument(
        "--ready-file",
        metavar="FILE",
        help="write {peer_id, multiaddrs, pid, control_url} as JSON here once serving",
    )


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="volunteerd",
        description="Train huge neural networks together on home PCs.",
    )
    parser.add_argument("--version", action="version", version=f"volunteerd {__version__}")
    sub = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")

    serve = sub.add_parser("serve", help="run the daemon: host experts and serve them")
    _common(serve)
    _network_flags(serve)
    serve.add_argument(
        "--experts", metavar="PATTERN", help='experts to host, e.g. "ffn.[0:4].[0:4]"'
    )

    boot = sub.add_parser("bootstrap", help="run a DHT-only node for others to join through")
    _common(boot)
    _network_flags(boot)

    config = sub.add_parser("config", help="show, check or locate the configuration")
    config_sub = config.add_subparsers(dest="config_command", required=True, metavar="ACTION")
    for name, text in (
        ("show", "print the effective configuration as TOML"),
        ("validate", "check the configuration; exit 3 if it is invalid"),
        ("path", "print the config file's location"),
        ("default", "print every key with its default and a comment (a starting file)"),
    ):
        _common(config_sub.add_parser(name, help=text))
    config_sub.choices["default"].add_argument(
        "--out",
        metavar="FILE",
        help="write it to FILE as UTF-8 (a new file) instead: on Windows, `>` writes the "
        "console's code page, which volunteerd refuses",
    )

    demo = sub.add_parser(
        "demo",
        help="train a small language model on a local swarm on this machine (nothing to set up)",
    )
    demo.add_argument("--steps", type=int, metavar="N", help="training steps (default 300)")
    demo.add_argument("--nodes", type=int, default=3, metavar="N", help="daemons to start (1-4)")
    demo.add_argument(
        "--local", action="store_true", help="train with local experts instead (the baseline)"
    )
    demo.add_argument(
        "--wan",
        metavar="PROFILE",
        help="run every process in its own emulated host, linked as PROFILE says (a "
        "profile's name, e.g. home, or a TOML file; needs root): see docs/wan.md",
    )
    demo.add_argument("--seed", type=int, default=0)
    demo.add_argument(
        "--trainers",
        type=int,
        default=1,
        metavar="N",
        help="trainers of the same model at once, averaging their weights (default 1)",
    )
    demo.add_argument("--summary-json", metavar="FILE", help="write the summary here as JSON")

    train = sub.add_parser("train", help="train an experiment's model on a swarm")
    train.add_argument("--config", required=True, metavar="FILE", help="experiment TOML file")
    train.add_argument(
        "--bootstrap",
        action="append",
        default=[],
        metavar="MULTIADDR",
        help="peer to join through (repeatable; default: the experiment's swarm.bootstrap_peers)",
    )
    train.add_argument(
        "--invitation",
        metavar="URL",
        help="the invitation `volunteerd publish` printed: train with its experiment, "
        "trusting its owner, joining through its peers",
    )
    train.add_argument("--steps", type=int, metavar="N", help="override training.steps")
    train.add_argument(
        "--listen-host", default="0.0.0.0", metavar="IP", help="address the trainer listens on"
    )
    train.add_argument("--summary-json", metavar="FILE", help="write the summary here as JSON")
    train.add_argument(
        "--state-dir",
        metavar="DIR",
        help="keep the trainer's own state here and resume from it (default: "
        "training.state_dir, else <data dir>/trainers/<experiment name>)",
    )

    publish = sub.add_parser(
        "publish", help="sign an experiment manifest with your key and store it in the DHT"
    )
    _common(publish)
    publish.add_argument("manifest", metavar="FILE", help="experiment manifest (TOML)")
    publish.add_argument(
        "--bootstrap",
        action="append",
        default=[],
        metavar="MULTIADDR",
        help="peer to store it through (repeatable; default: network.bootstrap_peers)",
    )
    publish.add_argument(
        "--key", metavar="FILE", help="the owner's key file (default: this node's key)"
    )

    ident = sub.add_parser("id", help="print this node's peer id (creating its key if needed)")
    _common(ident)

    paths = sub.add_parser("paths", help="print where volunteerd keeps its files")
    _common(paths)

    hardware = sub.add_parser(
        "hardware", help="print the devices and memory found, and how many experts fit"
    )
    _common(hardware)
    hardware.add_argument(
        "--benchmark", action="store_true", help="measure the expert speed again (~2 s)"
    )
    hardware.add_argument("--json", action="store_true", help="print JSON")

    # Clients of the running daemon's control API.
    status = sub.add_parser("status", help="what the running daemon is doing")
    _common(status)
    status.add_argument("--json", action="store_true", help="print the API's JSON")
    for name, text in (("pause", "stop contributing until resumed"), ("resume", "contribute")):
        _common(sub.add_parser(name, help=text))
    snooze = sub.add_parser("snooze", help="pause for a while (default 1h), then resume")
    _common(snooze)
    snooze.add_argument("duration", nargs="?", default="1h", help="e.g. 30m, 2h, 1h30m")
    limit = sub.add_parser(
        "limit", help="show or change the limits: bandwidth, quotas, disk, threads (0 = none)"
    )
    _common(limit)
    # read as text: checked (finite, in range) by _limit_changes before the daemon is asked
    limit.add_argument("--up", metavar="MBIT", help="upload limit in Mbit/s (0 = none)")
    limit.add_argument("--down", metavar="MBIT", help="download limit in Mbit/s (0 = none)")
    limit.add_argument("--quota", metavar="GB", help="monthly transfer quota (0 = none)")
    limit.add_argument("--daily-gb", metavar="GB", help="daily transfer quota (0 = none)")
    limit.add_argument(
        "--disk-gb", metavar="GB", help="disk for checkpoints and downloads (0 = none)"
    )
    limit.add_argument(
        "--threads", metavar="N", help="CPU threads to compute with (0 = torch's default)"
    )
    schedule = sub.add_parser(
        "schedule", help="show or change when to compute (idle, battery, hours)"
    )
    _common(schedule)
    schedule.add_argument(
        "--run", choices=["always", "when_idle"], help="always, or only while nobody uses it"
    )
    schedule.add_argument(
        "--idle-minutes", metavar="MIN", help="minutes without input before it counts as idle"
    )
    schedule.add_argument(
        "--on-battery", choices=["yes", "no"], help="compute on battery (no: pause)"
    )
    schedule.add_argument(
        "--compute-hours",
        metavar="HH:MM-HH:MM[,...]",
        help='windows to compute in, e.g. 22:00-07:00 ("any": any time)',
    )
    schedule.add_argument(
        "--network-hours",
        metavar="HH:MM-HH:MM[,...]",
        help='windows to use the network in ("any": any time)',
    )
    schedule.add_argument(
        "--gpu", choices=["always", "when_idle"], help="with experts on a GPU: when to compute"
    )
    dashboard = sub.add_parser("dashboard", help="open the dashboard in the browser")
    _common(dashboard)
    dashboard.add_argument(
        "--print", action="store_true", help="print its address (with the token) instead"
    )
    tray = sub.add_parser("tray", help="show the tray icon (starts the daemon if needed)")
    _common(tray)
    tray.add_argument(
        "--no-start", action="store_true", help="do not start the daemon if it is not running"
    )
    tray.add_argument(
        "--backend",
        choices=("appindicator", "gtk", "xorg", "darwin", "win32"),
        help="pystray backend (default: the best one available)",
    )
    _projects_parsers(sub)
    _service_parser(sub)
    return parser


def _projects_parsers(sub: Any) -> None:
    join = sub.add_parser(
        "join", help="join a project: host a share of its experiment (the daemon restarts)"
    )
    _common(join)
    join.add_argument(
        "invitation", metavar="INVITATION", help="volunteerd://join/... from the project's owner"
    )
    # read as text: checked (finite, in range) before anything is recorded
    join.add_argument(
        "--share",
        default="1",
        metavar="X",
        help="its share of this computer's room for experts, against other projects' (default 1)",
    )
    join.add_argument("--yes", "-y", action="store_true", help="join without asking")
    leave = sub.add_parser("leave", help="leave a project (the daemon restarts without it)")
    _common(leave)
    leave.add_argument(
        "name", metavar="NAME", help="the project's name (see `volunteerd projects`)"
    )
    projects = sub.add_parser("projects", help="the projects joined, and how each is doing")
    _common(projects)
    projects.add_argument("--json", action="store_true", help="print the API's JSON")


def _service_parser(sub: Any) -> None:
    service = sub.add_parser("service", help="start volunteerd (and its tray) at every login")
    verbs = service.add_subparsers(dest="service_command", required=True, metavar="ACTION")
    install = verbs.add_parser(
        "install", help="install the autostart files for this user and start volunteerd"
    )
    _common(install)
    install.add_argument(
        "--no-start", action="store_true", help="only install: start at the next login"
    )
    install.add_argument("--no-tray", action="store_true", help="no tray icon at login")
    _common(verbs.add_parser("uninstall", help="stop volunteerd and remove its autostart files"))
    status = verbs.add_parser(
        "status", help="what is installed and whether it runs (exit 0: both, else 5)"
    )
    _common(status)
    status.add_argument("--json", action="store_true", help="print JSON")
    render = verbs.add_parser("render", help="write a platform's autostart files (packaging)")
    render.add_argument("--platform", required=True, choices=("linux", "macos", "windows"))
    render.add_argument("--out", required=True, metavar="DIR", help="folder to write them in")
    render.add_argument(
        "--exec",
        dest="exec_command",
        metavar="COMMAND",
        help='how to run volunteerd, e.g. "/usr/bin/volunteerd" (default: a placeholder '
        '"/opt/volunteerd/bin/python -m volunteerd")',
    )


def _service(args: argparse.Namespace) -> ExitCode:
    """``volunteerd service install|uninstall|status|render`` (volunteerd/service/)."""
    from volunteerd.service import install as service

    if args.service_command == "render":
        return service.render_reference(args.platform, Path(args.out), args.exec_command)
    paths = _paths(args)
    chosen = service.Chosen(args.config is not None, args.data_dir is not None)
    if args.service_command == "install":
        _private_files()
        return service.install(
            paths, chosen, start=not args.no_start, tray=not args.no_tray, overrides=args.overrides
        )
    if args.service_command == "uninstall":
        return service.uninstall(paths, chosen)
    return service.status(paths, chosen, as_json=args.json)


_CONTROL_VERBS = {
    "status",
    "pause",
    "resume",
    "snooze",
    "limit",
    "schedule",
    "dashboard",
    "tray",
}
_PROJECT_VERBS = {"join", "leave", "projects"}


def _control(args: argparse.Namespace, paths: Paths) -> ExitCode:
    """The verbs that talk to a running daemon through its control API."""
    if args.command == "tray":
        from volunteerd.service.process import tray_pid
        from volunteerd.tray.app import run_tray

        configure_logging("INFO")
        return ExitCode(
            run_tray(paths, start_daemon=not args.no_start, backend=args.backend, showing=tray_pid)
        )
    from volunteerd.control import verbs as commands
    from volunteerd.control.models import MAX_SNOOZE_S

    # a bad value is a usage error whether a daemon runs or not, and never reaches it
    changes = _limit_changes(args) if args.command == "limit" else {}
    rules = _schedule_changes(args) if args.command == "schedule" else {}
    if args.command == "snooze":
        try:
            seconds = commands.parse_duration(args.duration)
        except ValueError as exc:
            raise UsageError(str(exc)) from None
        if seconds > MAX_SNOOZE_S:  # the API's bound, said in days
            raise UsageError(f"snooze {args.duration}: at most {MAX_SNOOZE_S / 86400:g} days")
    client = _control_client(paths)
    if args.command == "status":
        status = client.status()
        print(status.model_dump_json(indent=2) if args.json else commands.format_status(status))
    elif args.command == "pause":
        print(commands.describe_change(client.pause()))
    elif args.command == "resume":
        print(commands.describe_change(client.resume()))
    elif args.command == "snooze":
        print(commands.describe_change(client.snooze(seconds)))
    elif args.command == "limit":
        limits = client.set_limits(**changes) if changes else client.limits()
        print(commands.format_limits(limits))
        if {"daily_quota_gb", "monthly_quota_gb"} & changes.keys():
            for warning in _quota_warnings(limits, _upkeep_gb_a_day(client)):
                print(f"warning: {warning}", file=sys.stderr)
    elif args.command == "schedule":
        schedule = client.set_schedule(**rules) if rules else client.schedule()
        print(commands.format_schedule(schedule, client.status().schedule))
    elif args.command == "dashboard":
        url = client.dashboard_url
        if args.print:
            print(url)
        else:
            import webbrowser

            if not webbrowser.open(url):
                print(f"open this address in a browser: {url}")
    return ExitCode.OK


def _control_client(paths: Paths) -> ControlClient:
    """The control API's client. Raises DaemonNotRunning: while a daemon holds the data
    folder's lock but no address of its API is recorded, one that says it is starting
    or restarting (a join or leave restarts it in place: its API is back in a few
    seconds), not to start one: that one would be refused."""
    from volunteerd.control.client import ControlClient
    from volunteerd.errors import DaemonNotRunning

    try:
        return ControlClient.for_data_dir(paths.data_dir)
    except DaemonNotRunning:
        holder = lock_holder(paths.lock_file)
        if holder is None:
            raise
    pid = f"pid {holder.pid}" if holder.pid is not None else "pid not known yet"
    raise DaemonNotRunning(
        f"volunteerd is starting or restarting ({pid}): its control API is not up yet; "
        "try again in a moment (if it stays so, it runs with control.enabled = false)"
    )


def _projects(args: argparse.Namespace) -> ExitCode:
    """``join``, ``leave`` and ``projects``: through the running daemon's control API
    (it records the change in ``projects.toml`` and restarts into it), else in the file
    itself, under the data folder's lock (the daemon reads it when it starts)."""
    from volunteerd.control import verbs as commands
    from volunteerd.control.client import ControlClient
    from volunteerd.control.models import ProjectView
    from volunteerd.errors import ControlError, DaemonNotRunning
    from volunteerd.swarm.invitation import parse_invitation
    from volunteerd.swarm.projects import (
        Project,
        join_project,
        leave_project,
        read_projects,
        replaced_owner,
        replacing,
    )

    config, paths = _load(args)
    configured = Project.from_experiments(config.experiments)
    if args.command == "projects":
        try:
            status = ControlClient.for_data_dir(paths.data_dir).status()
        except DaemonNotRunning:
            from volunteerd.daemon import running_projects

            views = [
                ProjectView(name=p.name, owner=p.owner, share=p.share, state="joining")
                for p in running_projects(config, paths)
            ]
            with contextlib.suppress(ConfigError, OSError):  # the error says it at `serve`
                views += [  # recorded, but not hosted by this release
                    ProjectView.not_hosted(e.name, e.owner, e.problem, e.advice())
                    for e in read_projects(paths.projects_file).set_aside
                ]
            running = False
        else:  # the daemon's word: what it read at its start, less what was left since
            views, running = status.projects, True
        if args.json:
            print(json.dumps([v.model_dump(mode="json") for v in views], indent=2))
            return ExitCode.OK
        print(commands.format_projects(views, running=running))
        return ExitCode.OK
    if args.command == "leave":
        name = args.name
        if configured is not None and configured.name == name:
            raise ConfigError(
                f"project {name!r} comes from the config file (experiments.join in "
                f"{paths.config_file}): remove it there, then restart volunteerd"
            )
        try:
            left = ControlClient.for_data_dir(paths.data_dir).leave_project(name)
        except DaemonNotRunning:
            if not _offline(paths, lambda: leave_project(paths.projects_file, name)):
                raise UsageError(
                    f"not in a project named {name!r} (see `volunteerd projects`)"
                ) from None
            print(f"left {name!r}")
            return ExitCode.OK
        except ControlError as exc:
            if exc.status == 404:
                raise UsageError(f"{exc} (see `volunteerd projects`)") from None
            raise
        print(f"left {name!r}" + ": volunteerd restarts without it" * left.restarting)
        return ExitCode.OK
    share = _share(args.share)
    try:
        invitation = parse_invitation(args.invitation)
    except ConfigError as exc:  # an argument typed wrong: exit 2, as any bad argument
        raise UsageError(str(exc)) from None
    if configured is not None and configured.name == invitation.name:
        raise ConfigError(
            f"project {invitation.name!r} is joined through the config file "
            f"(experiments.join in {paths.config_file}) already"
        )
    project = Project.invited(invitation, share=share, joined_at=time.time())
    # another owner's project of that name is replaced only when the person said yes to it
    replaces = replaced_owner(read_projects(paths.projects_file).entries(), project)
    told = replacing(invitation.name, replaces) if replaces else ""
    print(
        commands.describe_invitation(
            invitation.name, invitation.owner, invitation.peers, share, replaces=told
        )
    )
    if not args.yes:
        if not sys.stdin.isatty():
            raise UsageError("not asking for a confirmation without a terminal: add --yes")
        question = "Join and replace it? [y/N] " if replaces else "Join? [y/N] "
        if input(question).strip().lower() not in {"y", "yes"}:
            print("not joined")
            return ExitCode.OK
    replace = replaces is not None
    try:
        joined = ControlClient.for_data_dir(paths.data_dir).join_project(
            invitation.url(), share=share, replace=replace
        )
    except DaemonNotRunning:
        changed = _offline(
            paths, lambda: join_project(paths.projects_file, project, replace=replace)
        )
        print(
            f"joined {invitation.name!r}" + " (already recorded)" * (not changed) + ": "
            "volunteerd is not running; it joins when started (`volunteerd serve`)"
        )
        return ExitCode.OK
    except ControlError as exc:
        if exc.status == 400:  # the daemon judged the invitation (or its file) wrong
            raise ConfigError(str(exc)) from None
        raise
    print(commands.describe_joined(joined))
    return ExitCode.OK


def _share(raw: str) -> float:
    """``--share``'s value; UsageError unless a finite number in (0, 100]."""
    from volunteerd.swarm.projects import check_share

    try:
        share = float(raw)
        check_share(share)
    except (ValueError, ConfigError) as exc:
        raise UsageError(f"--share {raw}: {exc}") from None
    return share


def _offline(paths: Paths, change: Callable[[], Any]) -> Any:
    """``change()`` to the projects file while no daemon runs, holding the data
    folder's lock so that none starts meanwhile."""
    from volunteerd.errors import ResourceUnavailable

    try:
        with DataDirLock(paths.lock_file):  # the only ResourceUnavailable here
            return change()
    except ResourceUnavailable:
        raise ResourceUnavailable(
            f"a volunteerd uses {paths.data_dir} but its control API does not answer (still "
            "starting, or control.enabled = false): try again in a moment, or stop it first"
        ) from None


def _exec_again(lock: DataDirLock) -> None:
    """Replace this process with ``volunteerd serve`` as it was started (same pid, so a
    service manager or the tray keeps following it), once the daemon stopped to
    restart (it joined or left a project). Everything the old daemon held is closed by
    then (its sockets, the control port; descriptors are not inherited by an exec:
    Python opens them close-on-exec) but the data folder's lock: handed over to the new
    program (its descriptor's number in ``VOLUNTEERD_LOCK_FD``), so that no other
    volunteerd takes the folder while it starts (``DataDirLock``)."""
    fd = lock.hand_over()
    os.environ[ENV_LOCK_FD] = "" if fd is None else str(fd)
    logger.info("restarting: %s", " ".join(sys.orig_argv))
    logging.shutdown()  # flush the log handlers
    sys.stdout.flush()
    sys.stderr.flush()
    os.execv(sys.executable, sys.orig_argv)


def _limit_changes(args: argparse.Namespace) -> dict[str, float]:
    """The limits ``volunteerd limit`` was asked to change, checked as the control API
    checks them (a finite number within the documented range). Raises UsageError
    naming the flag, the value and the rule."""
    from pydantic import ValidationError

    from volunteerd.control.models import LimitsChange

    changes: dict[str, float] = {}
    for flag, field, raw in (
        ("--up", "upload_mbit", args.up),
        ("--down", "download_mbit", args.down),
        ("--quota", "monthly_quota_gb", args.quota),
        ("--daily-gb", "daily_quota_gb", args.daily_gb),
        ("--disk-gb", "disk_budget_gb", args.disk_gb),
        ("--threads", "cpu_threads", args.threads),
    ):
        if raw is None:
            continue
        try:
            checked = LimitsChange.model_validate({field: raw}, strict=False)  # text typed
        except ValidationError as exc:
            raise UsageError(f"{flag} {raw}: {field}: {exc.errors()[0]['msg']}") from None
        changes[field] = getattr(checked, field)
    return changes


# What a joined daemon's own upkeep (the DHT, identify, pings: other peers' traffic
# reaching it) moves when the stats have too few idle hours to tell: a 6-node test
# swarm measured 16.1 MB/h serving nothing, 0.39 GB a day (docs/volunteer.md).
UPKEEP_FLOOR_GB_A_DAY = 0.5
UPKEEP_FLOOR_GB_A_MONTH = 15.0
_UPKEEP_MIN_HOURS = 3  # idle hours of the last week to go by


def _upkeep_gb_a_day(client: ControlClient) -> float | None:
    """What the daemon's upkeep moves a day by its own count: the median of the last
    week's whole hours in which it served no expert call and moved anything, times 24
    (a median: an hour of replica averaging or of a download is not upkeep, nor is an
    hour the daemon ran minutes of); None with fewer than ``_UPKEEP_MIN_HOURS`` of them
    (or no stats)."""
    now = time.time()
    try:
        stats = client.stats(since=now - 7 * 86400)
    except VolunteerdError:
        return None
    idle = [
        bucket.bytes_sent + bucket.bytes_received
        for bucket in stats.history
        if bucket.size_s == 3600
        and bucket.start + bucket.size_s <= now
        and bucket.forward + bucket.backward == 0
        and bucket.bytes_sent + bucket.bytes_received > 0
    ]
    if len(idle) < _UPKEEP_MIN_HOURS:
        return None
    return statistics.median(idle) * 24 / 1e9


def _quota_warnings(limits: LimitsView, upkeep_gb_a_day: float | None) -> list[str]:
    """Lines for a daily or monthly quota set below what upkeep alone moves (by the
    daemon's count, ``_upkeep_gb_a_day``, or else the documented floor): it would be
    used up without serving, and upkeep goes on after it. A warning: the quota is set."""
    if upkeep_gb_a_day is None:
        day, month = UPKEEP_FLOOR_GB_A_DAY, UPKEEP_FLOOR_GB_A_MONTH
        measured = f"a joined daemon's upkeep moves about {day:g} GB a day"
    else:
        day, month = upkeep_gb_a_day, upkeep_gb_a_day * 30
        measured = f"this daemon's upkeep moved {day:.2g} GB a day while it served nothing"
    out = []
    for quota, needed, name in (
        (limits.daily_quota_gb, day, "daily"),
        (limits.monthly_quota_gb, month, "monthly"),
    ):
        if 0 < quota < needed:
            out.append(
                f"the {name} quota of {quota:g} GB is below what upkeep alone uses "
                f"({measured}): it may be used up without serving a call, and upkeep "
                "goes on after it (docs/volunteer.md)"
            )
    return out


def _schedule_changes(args: argparse.Namespace) -> dict[str, Any]:
    """The rules ``volunteerd schedule`` was asked to change, checked as the control API
    checks them. Raises UsageError naming the flag, the value and the rule."""
    from pydantic import ValidationError

    from volunteerd.control.models import ScheduleChange

    def windows(flag: str, raw: str) -> list[str]:
        if raw.strip() == "any":
            return []
        found = [w.strip() for w in raw.split(",") if w.strip()]
        if not found:  # an empty shell variable, say: clearing the hours takes "any"
            raise UsageError(f"{flag} {raw!r}: no time window: give `any` to clear the hours")
        return found

    changes: dict[str, Any] = {}
    for flag, field, raw, value in (
        ("--run", "run", args.run, args.run),
        ("--idle-minutes", "idle_minutes", args.idle_minutes, args.idle_minutes),
        ("--on-battery", "on_battery", args.on_battery, args.on_battery == "yes"),
        ("--compute-hours", "compute_hours", args.compute_hours, None),
        ("--network-hours", "network_hours", args.network_hours, None),
        ("--gpu", "gpu", args.gpu, args.gpu),
    ):
        if raw is None:
            continue
        if field.endswith("_hours"):
            value = windows(flag, raw)
        try:
            checked = ScheduleChange.model_validate({field: value}, strict=False)  # text typed
        except ValidationError as exc:
            # pydantic starts the message of a rule of ours with this: noise to a user
            rule = exc.errors()[0]["msg"].removeprefix("Value error, ")
            raise UsageError(f"{flag} {raw}: {field}: {rule}") from None
        changes[field] = getattr(checked, field)
    return changes


def _flags(args: argparse.Namespace) -> list[Flag]:
    """The flags that set one key each, named as typed (errors blame them, not --set)."""
    out = []
    if getattr(args, "listen_host", None):
        out.append(
            Flag("network.listen_host", args.listen_host, f"--listen-host {args.listen_host}")
        )
    if getattr(args, "port", None) is not None:
        out.append(Flag("network.port", args.port, f"--port {args.port}"))
    if getattr(args, "bootstrap", None):
        typed = " ".join(f"--bootstrap {peer}" for peer in args.bootstrap)
        out.append(Flag("network.bootstrap_peers", list(args.bootstrap), typed))
    if getattr(args, "experts", None):
        out.append(Flag("experts.uids", args.experts, f"--experts {args.experts}"))
    return out


def _load(args: argparse.Namespace) -> tuple[Config, Paths]:
    paths = _paths(args)
    # A file named on the command line must exist; the default location (or one from
    # VOLUNTEERD_CONFIG) may be absent, which means defaults.
    config = load_config(
        paths.config_file,
        required=args.config is not None,
        overrides=args.overrides,
        flags=_flags(args),
        run_time_dir=paths.data_dir,
    )
    return config, paths


def _paths(args: argparse.Namespace) -> Paths:
    return Paths.resolve(config_file=args.config, data_dir=args.data_dir)


def _standard_streams() -> None:
    """Standard input, output and error usable whatever this program was started with.

    A descriptor 0-2 left closed (``serve <&- >&- 2>&-``) was taken by the next file
    opened: the data folder's lock became standard input, a socket standard error.
    Each closed one is opened on the null device first. Text a stream's encoding
    cannot hold (an em dash on a Latin-1 terminal, a file name that is not UTF-8) is
    written as a backslash escape: it raised UnicodeEncodeError, a traceback for
    ``volunteerd status`` on a German ISO-8859-1 console."""
    for fd in (0, 1, 2):
        try:
            os.fstat(fd)
        except OSError:
            null = os.open(os.devnull, os.O_RDWR)  # the lowest free number: fd itself
            if null != fd:  # only were a thread opening files meanwhile
                os.dup2(null, fd)
                os.close(null)
    for name, fd, mode in (("stdin", 0, "r"), ("stdout", 1, "w"), ("stderr", 2, "w")):
        if getattr(sys, name) is None:  # closed when Python started: None, output lost
            setattr(sys, name, open(fd, mode, closefd=False))  # noqa: SIM115
    for stream in (sys.stdout, sys.stderr):
        with contextlib.suppress(AttributeError, ValueError):  # not a text file (a test's)
            stream.reconfigure(errors="backslashreplace")  # type: ignore[union-attr]


def _stdout_gone() -> bool:
    """Whether standard output is a pipe whose reader has gone (``| head -1``): a
    BrokenPipeError from there is no error of ours, one from a socket is."""
    try:
        fd = sys.stdout.fileno()
        poll = select.poll()
    except (AttributeError, OSError, ValueError):  # no poll on Windows
        return sys.platform == "win32"
    poll.register(fd, 0)  # POLLERR is reported without asking: a pipe with no reader
    return any(events & select.POLLERR for _, events in poll.poll(0))


def main(argv: Sequence[str] | None = None) -> int:
    _standard_streams()  # before anything opens a file
    # Before any thread exists: every thread's allocations from glibc's main arena, where
    # the experts' freed gradients are reused instead of faulted in anew (volunteerd.malloc).
    one_arena()
    parser = build_parser()
    args = parser.parse_args(argv)
    try:
        code = int(_dispatch(args))
        sys.stdout.flush()  # here, where a reader gone is handled: not at exit
        return code
    except BaseException as exc:
        # Errors raised inside a nursery arrive wrapped in exception groups.
        inner = _single(exc)
        if isinstance(inner, BrokenPipeError) and _stdout_gone():
            # The reader of our output is done with it: stop quietly, as a program
            # killed by SIGPIPE would. What is still buffered goes to the null device
            # (Python's advice): flushed at exit, it raised the same error again.
            null = os.open(os.devnull, os.O_WRONLY)
            os.dup2(null, sys.stdout.fileno())
            os.close(null)
            return 128 + signal.SIGPIPE if hasattr(signal, "SIGPIPE") else 1
        if isinstance(inner, VolunteerdError | OSError):
            print(f"volunteerd: {inner}", file=sys.stderr)
            return int(exit_code(inner))
        if isinstance(inner, KeyboardInterrupt):
            return int(ExitCode.INTERRUPTED)
        raise


def _default_config(out: str | None) -> ExitCode:
    """``volunteerd config default``: printed, or written to ``out`` as UTF-8 (never
    over a file: it would be somebody's configuration)."""
    from volunteerd.config.schema import commented_default_toml

    text = commented_default_toml()
    if out is None:
        sys.stdout.write(text)
        return ExitCode.OK
    if not out:
        raise UsageError("--out: give the name of a new file, e.g. --out config.toml")
    try:
        with open(out, "x", encoding="utf-8", newline="") as f:
            f.write(text)
    except (FileExistsError, IsADirectoryError, FileNotFoundError, NotADirectoryError):
        raise UsageError(f"--out {out}: {_why_not_new(Path(out))}") from None
    except PermissionError:
        raise UsageError(
            f"--out {out}: no permission to write there; choose a folder of yours"
        ) from None
    print(f"wrote {out}", file=sys.stderr)
    return ExitCode.OK


def _why_not_new(path: Path) -> str:
    """Why a new file ``path`` could not be made, in words (not "[Errno 2]")."""
    if path.is_dir():
        return "is a folder; give the name of a new file in it"
    if path.exists() or path.is_symlink():
        return "the file exists; give a new name or remove it first"
    folder = path.parent
    if folder.is_dir():
        return f"cannot make a file in {folder}; choose another folder"
    if folder.exists():
        return f"{folder} is not a folder"
    return f"the folder {folder} does not exist; make it first"


def _single(exc: BaseException) -> BaseException:
    while isinstance(exc, BaseExceptionGroup) and len(exc.exceptions) == 1:
        exc = exc.exceptions[0]
    return exc


def _dispatch(args: argparse.Namespace) -> ExitCode:
    if args.command in {"demo", "train"}:
        return _train(args)
    if args.command == "config" and args.config_command == "path":
        print(_paths(args).config_file)
        return ExitCode.OK
    if args.command == "config" and args.config_command == "default":
        return _default_config(args.out)  # needs no configuration, nor a valid one
    if args.command == "paths":
        for name, value in _paths(args).as_dict().items():
            print(f"{name:16} {value}")
        return ExitCode.OK
    if args.command == "service":
        return _service(args)
    if args.command in _CONTROL_VERBS:
        return _control(args, _paths(args))
    if args.command in _PROJECT_VERBS:
        return _projects(args)
    if args.command in {"serve", "bootstrap"} and args.ready_file:
        _check_ready_file(Path(args.ready_file))  # before the start, not after it
    notes: list[str] = []
    if args.command in {"serve", "bootstrap"}:
        _private_files()
        made = _paths(args).make_data_dir()
        notes += [made] if made else []
    # the data folder's lock a restart in place kept for this program (not for its children)
    handed_over = os.environ.pop(ENV_LOCK_FD, None) if args.command == "serve" else None
    if args.command == "serve":
        # limits.toml moved to the data folder: a daemon takes an old one along first
        notes += _adopt_old_limits(_paths(args))
    config, paths = _load(args)
    if args.command == "serve" and config.runtime.priority == "low":
        # first thing, before any thread (Linux keeps priorities per thread) or import
        notes.append("running at low priority: " + (", ".join(lower_priority()) or "unchanged"))
    if args.command in {"serve", "bootstrap"}:
        # connections are open files: room for network.max_connections (net/open_files.py)
        from volunteerd.net.open_files import raise_open_file_limit

        notes += filter(None, [raise_open_file_limit(config.network.max_connections)])
    if args.command == "config":
        if args.config_command == "validate":
            where = paths.config_file if paths.config_file.exists() else "defaults"
            print(f"configuration is valid ({where})")
        else:
            sys.stdout.write(dump_toml(config))
        return ExitCode.OK
    if args.command == "hardware":
        return _hardware(args, config, paths)
    if args.command == "id":
        from volunteerd.identity import load_or_create_identity
        from volunteerd.net import peer_id_for

        print(peer_id_for(load_or_create_identity(paths.identity_file)))
        return ExitCode.OK

    # Import the daemon (and with it py-libp2p, which resets its loggers on import)
    # before configuring logging.
    from volunteerd.daemon import Daemon, bootstrap_only

    configure_logging(config.logging.level)
    for note in notes:
        logger.info("%s", note)
    if args.command == "publish":
        return _publish(args, config, paths)
    if args.command == "serve":
        # held by this process until it ends, or kept across a restart in place (exec):
        # a daemon restarted so finds it here, handed over (``_exec_again``)
        with DataDirLock(paths.lock_file, handed_over=handed_over) as lock:
            # a join or leave restarts (exec) into the configuration loaded as now: it
            # must load
            daemon = Daemon(config, paths, reload=lambda: _load(args)[0], lock_held=True)

            async def start_serve(nursery: trio.Nursery) -> Any:
                return await nursery.start(_serve_reloading_limits, daemon, args)

            code = trio.run(_run_service, start_serve, daemon.request_stop, args.ready_file)
            if daemon.restart_requested and code == ExitCode.OK:
                _exec_again(lock)
        return code
    if args.command == "bootstrap":

        async def start_boot(nursery: trio.Nursery) -> Any:
            return await nursery.start(bootstrap_only, config, paths)

        return trio.run(_run_service, start_boot, None, args.ready_file)
    raise AssertionError(args.command)  # pragma: no cover - argparse rejects others


def _private_files() -> None:
    """What this process creates is its user's only (umask 077, or a stricter one kept):
    the daemon's database, checkpoints and logs, the folders of the autostart files.
    Under a umask of 000 they were made writable by every local user."""
    os.umask(os.umask(0o077) | 0o077)


def _adopt_old_limits(paths: Paths) -> list[str]:
    """Move ``limits.toml`` from the config folder into the data folder (once); what
    happened, for the log once it is set up."""
    try:
        moved = paths.adopt_old_limits_file(check_limits_overlay)
    except OSError as exc:
        return [f"{paths.old_limits_file} not moved to {paths.limits_file} ({exc}): not read"]
    except ConfigError as exc:  # another program's file beside the config file
        return [
            f"{paths.old_limits_file} left where it is, not read: not limits volunteerd "
            f"wrote ({exc})"
        ]
    if not moved:
        return []
    return [f"moved {paths.old_limits_file} to {paths.limits_file}: limits are per data folder"]


async def _serve_reloading_limits(
    daemon: Any, args: argparse.Namespace, *, task_status: Any = trio.TASK_STATUS_IGNORED
) -> None:
    """``daemon.serve``; meanwhile SIGHUP reloads the configuration (file, limits.toml,
    schedule.toml, environment, flags) and applies its ``[limits]`` and ``[schedule]``
    at once (``limits`` and ``schedule`` events). Other sections need a restart. A bad
    configuration is logged (an ``error`` event) and the current limits stay."""
    if not hasattr(signal, "SIGHUP"):  # pragma: no cover - Windows
        await daemon.serve(task_status=task_status)
        return
    with trio.open_signal_receiver(signal.SIGHUP) as hangups:
        async with trio.open_nursery() as nursery:

            async def serve(task_status: Any = trio.TASK_STATUS_IGNORED) -> None:
                await daemon.serve(task_status=task_status)
                nursery.cancel_scope.cancel()  # the daemon stopped: stop listening too

            running = await nursery.start(serve)
            task_status.started(running)
            async for _ in hangups:
                logger.info("SIGHUP: reloading the limits and the schedule")
                await running.volunteer.reload_limits(lambda: _load(args)[0].limits)
                if running.scheduler is not None:
                    await running.scheduler.reload(lambda: _load(args)[0].schedule)


def _publish(args: argparse.Namespace, config: Config, paths: Paths) -> ExitCode:
    """``volunteerd publish FILE``: sign with the owner's key, store in the DHT, and say
    which key daemons must trust."""
    from volunteerd.identity import load_or_create_identity
    from volunteerd.swarm.publish import publish_manifest

    key = Path(args.key) if args.key else paths.identity_file
    if args.key and not key.exists():
        raise ConfigError(f"key file not found: {key}")
    owner = load_or_create_identity(key)
    published = trio.run(publish_manifest, config, owner, Path(args.manifest))
    manifest = published.manifest
    print(
        f"published experiment {manifest.name!r} ({len(manifest.uids())} experts, "
        f"replication {manifest.replication}) on {published.acks} peers"
    )
    print(f"owner: {manifest.owner}")
    by = f" by {manifest.owner_name}" if manifest.owner_name else ""
    print(f"volunteers see: Helping: {manifest.description or manifest.name}{by}")
    # The invitation alone on its line, so it can be copied whole (or grepped).
    print("invitation (share it; volunteers run `volunteerd join <invitation>`):")
    print(published.invitation.url())
    peers = published.invitation.peers
    print(
        f"volunteers join through {'this peer' if len(peers) == 1 else 'these peers'}, "
        f"which must stay up and reachable for anyone to join:"
    )
    for peer in peers:
        print(f"  {peer}")
    for reason in published.left_out:
        print(f"  (left out of the invitation: {reason})")
    print(
        f"a daemon can also serve it directly: volunteerd serve --set experiments.join="
        f"{manifest.name} --set 'experiments.trusted_owners=[\"{manifest.owner}\"]'"
    )
    return ExitCode.OK


def _hardware(args: argparse.Namespace, config: Config, paths: Paths) -> ExitCode:
    """``volunteerd hardware``: what was found, the budget, and the measured speed."""
    import torch

    from volunteerd.runtime import choose_device
    from volunteerd.runtime.hardware import capacity, detect, measure_speed

    found = detect()
    device = choose_device(config.runtime.device)
    if config.runtime.torch_threads:
        torch.set_num_threads(config.runtime.torch_threads)
    room = capacity(found, device, config.experts, config.runtime, config.hardware)
    speed = measure_speed(
        device, config.experts, paths.cache_dir / "speed.json", refresh=args.benchmark
    )
    if args.json:
        print(
            json.dumps(
                {
                    "hardware": found.as_dict(),
                    "device": str(device),
                    "capacity": dataclasses.asdict(room),
                    "speed": dataclasses.asdict(speed),
                },
                indent=2,
            )
        )
        return ExitCode.OK
    gib = 1 << 30
    print(f"device    {device} (runtime.device = {config.runtime.device!r})")
    print(f"cpu       {found.cpu_model}: {found.cpu_cores} cores ({found.usable_cores} usable)")
    print(
        f"memory    {found.memory_bytes / gib:.1f} GiB, "
        f"{found.available_bytes / gib:.1f} GiB available"
    )
    for gpu in found.gpus:
        print(
            f"gpu       cuda:{gpu.index} {gpu.name}, {gpu.memory_bytes / gib:.1f} GiB, "
            f"compute {gpu.capability}, bfloat16 {'yes' if gpu.bf16 else 'no'}"
        )
    if not found.gpus:
        print("gpu       none (CUDA not available)")
    print(f"mps       {'available' if found.mps else 'no'}")
    print(f"budget    {room.budget_bytes / gib:.1f} GiB ({room.budget_source})")
    e = config.experts
    print(
        f"experts   {e.type} hidden {e.hidden_dim}: {room.per_expert_bytes / (1 << 20):,.0f} MiB "
        f"each with {e.optimizer.name} state, {room.experts} fit"
    )
    when = localtime.strftime("%Y-%m-%d %H:%M", speed.measured_at)
    print(
        f"speed     {speed.samples_per_s:,.0f} samples/s per expert, forward + backward + "
        f"step (batch {speed.batch}; {'cached, measured' if speed.cached else 'measured'} {when})"
    )
    return ExitCode.OK


def _stop_on_signals() -> threading.Event:
    """The first Ctrl-C (or SIGTERM) asks training to stop after the current step — a
    flag the loop checks, not an exception that could land anywhere (in CPython, a
    KeyboardInterrupt raised inside exec'd code, as lazy imports do, makes the process
    die by SIGINT at exit even when handled). A second Ctrl-C aborts at once."""
    stop = threading.Event()

    def handle(signum: int, frame: object) -> None:
        if stop.is_set():
            raise KeyboardInterrupt
        stop.set()
        print("\nstopping after the current step (Ctrl-C again to abort)", file=sys.stderr)

    signal.signal(signal.SIGINT, handle)
    signal.signal(signal.SIGTERM, handle)
    return stop


def _train(args: argparse.Namespace) -> ExitCode:
    """``demo`` and ``train``: a trainer in this process (its node in a thread)."""
    from volunteerd.demo import run_demo, run_training
    from volunteerd.moe import SwarmClient
    from volunteerd.train import Experiment, load_experiment
    from volunteerd.train.published import resolve_manifest

    # bad flags are usage errors, before anything starts (0 steps is not "the default")
    if args.steps is not None and args.steps < 1:
        raise UsageError(f"--steps {args.steps}: at least 1")
    if args.command == "demo":
        rows = Experiment().model.grid[0]  # each daemon hosts whole rows of the demo's grid
        if not 1 <= args.nodes <= rows:
            raise UsageError(f"--nodes {args.nodes}: between 1 and {rows}")
        if args.trainers < 1:
            raise UsageError(f"--trainers {args.trainers}: at least 1")
        if args.local and (args.wan or args.trainers > 1):
            other = "--wan" if args.wan else "--trainers"
            raise UsageError(f"--local trains without a network: it cannot go with {other}")
    summary_json = Path(args.summary_json) if args.summary_json else None
    if summary_json is not None:
        _check_ready_file(summary_json, "--summary-json")  # before training, not after it
    stop = _stop_on_signals()
    configure_logging("WARNING")
    # the trainer's node holds a connection to every server it calls, each an open file:
    # room for as many as a daemon's (under macOS's 256 it ran out in a large swarm)
    from volunteerd.net.open_files import raise_open_file_limit

    raise_open_file_limit(Config().network.max_connections)
    if args.command == "demo":
        summary = run_demo(
            steps=args.steps,
            nodes=args.nodes,
            local=args.local,
            wan=args.wan,
            seed=args.seed,
            trainers=args.trainers,
            summary_json=summary_json,
            stop=stop,
        )
        return _training_ended(summary)
    experiment = load_experiment(Path(args.config))
    if args.invitation:
        from volunteerd.swarm.invitation import parse_invitation
        from volunteerd.train.published import apply_invitation

        experiment = apply_invitation(experiment, parse_invitation(args.invitation))
    bootstrap = args.bootstrap or experiment.swarm.bootstrap_peers
    if not bootstrap:
        raise ConfigError("no swarm to train on: give --bootstrap or swarm.bootstrap_peers")
    steps = experiment.training.steps if args.steps is None else args.steps
    node_config = _trainer_node_config(args, bootstrap)
    with contextlib.ExitStack() as stack:
        # locked before joining the swarm: a second trainer on the folder stops here
        state_dir = _trainer_state_dir(args, experiment)
        state = None
        if state_dir is not None:
            from volunteerd.train.state import TrainerStateFolder

            folder = TrainerStateFolder(state_dir, experiment.training.save_every_steps)
            state = stack.enter_context(folder)
            print(f"trainer state: {state_dir}", file=sys.stderr)
        client = stack.enter_context(SwarmClient(node_config))
        experiment = resolve_manifest(experiment, client)
        summary = run_training(
            experiment, client=client, steps=steps, out=sys.stderr, stop=stop, state=state
        )
    print(
        f"done: validation loss {summary.initial_val_loss:.3f} -> {summary.final_val_loss:.3f}; "
        f"{summary.expert_calls:,} expert calls, {summary.failed_calls} failed",
        file=sys.stderr,
    )
    if summary_json is not None:
        write_atomic(summary_json, json.dumps(summary.as_dict(), indent=2))
    return _training_ended(summary)


def _training_ended(summary: Any) -> ExitCode:
    """The exit status of a training run that returned its summary: 1 when the model
    diverged, 5 (unavailable) when it gave up on the swarm (``summary.error`` says
    which), 130 when stopped, else 0."""
    if summary.error:
        print(f"volunteerd: {summary.error}", file=sys.stderr)
        return ExitCode.ERROR if summary.diverged else ExitCode.UNAVAILABLE
    return ExitCode.INTERRUPTED if summary.interrupted else ExitCode.OK


def _trainer_node_config(args: argparse.Namespace, bootstrap: list[str]) -> Config:
    """The trainer's node config, checked as the daemon's: a bad address is a
    ConfigError naming the flag or key it came from (it was an 8-frame traceback)."""
    from pydantic import ValidationError

    from volunteerd.demo import trainer_config

    try:
        return trainer_config(bootstrap, listen_host=args.listen_host)
    except ValidationError as exc:
        problems = []
        for error in exc.errors():
            key = error["loc"][-1] if error["loc"] else ""
            if key == "listen_host":
                source = "--listen-host"
            elif key == "bootstrap_peers" and args.bootstrap:
                source = "--bootstrap"
            elif key == "bootstrap_peers":
                source = f"swarm.bootstrap_peers in {args.config}"
            else:
                source = ".".join(str(part) for part in error["loc"])
            # pydantic starts the message of a rule of ours with this: noise to a user
            problems.append(f"{source}: {error['msg'].removeprefix('Value error, ')}")
        raise ConfigError("; ".join(problems)) from None


def _trainer_state_dir(args: argparse.Namespace, experiment: Any) -> Path | None:
    """Where ``train`` keeps its own state: ``--state-dir``, else ``training.state_dir``
    (relative to the experiment file's folder), else ``<data dir>/trainers/<name>``;
    None with ``training.save_every_steps = 0``."""
    from volunteerd.train.state import default_state_dir

    if experiment.training.save_every_steps == 0:
        return None
    if args.state_dir:
        return Path(args.state_dir).expanduser().absolute()
    if experiment.training.state_dir:
        path = Path(experiment.training.state_dir).expanduser()
        return path if path.is_absolute() else Path(args.config).absolute().parent / path
    return default_state_dir(Paths.resolve().trainers_dir, experiment.name)


async def _run_service(
    start: Callable[[trio.Nursery], Awaitable[Any]],
    request_stop: Callable[[], None] | None,
    ready_file: str | None,
) -> ExitCode:
    """Run a service until it ends or a signal arrives. The first SIGINT/SIGTERM asks it
    to stop gracefully; a second one (or the first, for a service without a graceful
    stop) cancels it."""
    signalled = 0
    with trio.open_signal_receiver(signal.SIGINT, signal.SIGTERM) as signals:
        async with trio.open_nursery() as outer:
            service_scope = trio.CancelScope()

            async def watch_signals() -> None:
                nonlocal signalled
                async for signum in signals:
                    signalled += 1
                    logger.info("received %s, stopping", signal.Signals(signum).name)
                    if request_stop is not None and signalled == 1:
                        request_stop()
                    else:
                        service_scope.cancel()

            outer.start_soon(watch_signals)
            with service_scope:
                async with trio.open_nursery() as inner:
                    running = await start(inner)
                    if ready_file:
                        _write_ready_file(Path(ready_file), running)
            outer.cancel_scope.cancel()
    return ExitCode.INTERRUPTED if signalled else ExitCode.OK


def _check_ready_file(path: Path, flag: str = "--ready-file") -> None:
    """Raises UsageError when the file of ``flag`` cannot be written at the end: a
    folder, or in a folder that does not exist or cannot be written to. Found only after
    the whole start, ``--ready-file`` stopped the daemon again (exit 5), a ``.tmp`` file
    left behind; found after a whole training run, ``--summary-json`` lost its summary."""
    folder = path.parent
    if path.is_dir():
        raise UsageError(f"{flag} {path}: is a folder; name a file in it")
    if not folder.is_dir():
        raise UsageError(f"{flag} {path}: there is no folder {folder}")
    if not os.access(folder, os.W_OK | os.X_OK):
        raise UsageError(f"{flag} {path}: cannot write to the folder {folder}")


def _write_ready_file(path: Path, running: Any) -> None:
    node = getattr(running, "node", running)
    data = {
        "peer_id": node.peer_id,
        "multiaddrs": node.multiaddrs,
        "pid": os.getpid(),
        "control_url": getattr(running, "control_url", None),
    }
    tmp = path.with_name(path.name + ".tmp")
    try:
        tmp.write_text(json.dumps(data))
        tmp.replace(path)
    except OSError:
        with contextlib.suppress(OSError):  # nothing left behind by a failed write
            tmp.unlink(missing_ok=True)
        raise
