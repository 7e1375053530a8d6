"""The projects file (``<data dir>/projects.toml``): joining records a project (in place
of one of the same name), leaving removes it, a damaged file is an error naming the
file, an entry today's checks refuse (another release's) is set aside alone, shares
split the room for experts; and a daemon module that hosts nothing imports no torch."""

from __future__ import annotations

import json
import subprocess
import sys
import threading
from collections.abc import Sequence
from functools import partial
from pathlib import Path
from typing import Any

import pytest
import trio

from volunteerd.config import Config, ExperimentsConfig, load_config
from volunteerd.control.events import EventLog
from volunteerd.control.models import MAX_PROJECT_SHARE, ProjectJoin
from volunteerd.daemon import Daemon
from volunteerd.errors import ConfigError, ControlError, ExitCode
from volunteerd.identity import Identity
from volunteerd.net.peers import peer_id_for
from volunteerd.paths import Paths
from volunteerd.server.control_view import ControlView
from volunteerd.swarm.invitation import Invitation
from volunteerd.swarm.manifest import load_manifest_file
from volunteerd.swarm.projects import (
    MAX_SHARE,
    Project,
    SetAside,
    check_share,
    join_project,
    leave_project,
    load_projects,
    read_projects,
    share_of,
)
from volunteerd.train.experiment import load_experiment

OWNER = str(peer_id_for(Identity.generate()))
PEER = f"/ip4/127.0.0.1/tcp/4001/p2p/{peer_id_for(Identity.generate())}"


def project(name: str, share: float = 1.0, owner: str = OWNER) -> Project:
    return Project.invited(Invitation(name, owner, (PEER,)), share=share, joined_at=1.0)


def test_join_leave_round_trip(tmp_path: Path) -> None:
    path = tmp_path / "projects.toml"
    assert load_projects(path) == []
    assert join_project(path, project("tiny-lm"))
    assert join_project(path, project("other", share=3))
    assert load_projects(path) == [project("tiny-lm"), project("other", share=3)]
    assert not join_project(path, project("tiny-lm")), "the same entry again changes nothing"

    # Joining again under the same name replaces the entry (here: a new owner, asked
    # for, and share).
    new_owner = str(peer_id_for(Identity.generate()))
    assert join_project(path, project("tiny-lm", share=2, owner=new_owner), replace=True)
    assert [(p.name, p.owner, p.share) for p in load_projects(path)] == [
        ("other", OWNER, 3.0),
        ("tiny-lm", new_owner, 2.0),
    ]

    assert leave_project(path, "other")
    assert not leave_project(path, "other")
    assert [p.name for p in load_projects(path)] == ["tiny-lm"]
    assert leave_project(path, "tiny-lm")
    assert load_projects(path) == []


def test_another_owners_project_of_the_same_name_is_replaced_only_when_asked(
    tmp_path: Path,
) -> None:
    """Another owner's invitation of a name joined already used to replace that project
    silently: the prompt and the reply said "join", and this computer stopped helping
    the first owner. Under the same owner it is the same project (new peers, a share)."""
    from volunteerd.swarm.projects import replaced_owner

    path = tmp_path / "projects.toml"
    assert join_project(path, project("life-a"))
    other = str(peer_id_for(Identity.generate()))
    assert replaced_owner(load_projects(path), project("life-a", owner=other)) == OWNER
    assert replaced_owner(load_projects(path), project("life-a", share=2)) is None
    assert replaced_owner(load_projects(path), project("life-b", owner=other)) is None
    with pytest.raises(ConfigError) as refused:
        join_project(path, project("life-a", owner=other))
    told = f"this replaces the project 'life-a' of owner {OWNER[:8]}…{OWNER[-6:]}"
    assert told in str(refused.value)
    assert load_projects(path) == [project("life-a")]  # nothing changed
    assert join_project(path, project("life-a", share=2))  # the same owner's: no question
    assert join_project(path, project("life-a", owner=other), replace=True)
    assert [(p.name, p.owner) for p in load_projects(path)] == [("life-a", other)]


async def test_the_control_api_says_what_a_join_replaces_and_needs_replace_for_it(
    tmp_path: Path,
) -> None:
    daemon = a_daemon(tmp_path)
    join_project(daemon.paths.projects_file, project("life-a"))
    view = a_view(daemon, [project("life-a")])
    other = str(peer_id_for(Identity.generate()))
    invited = Invitation("life-a", other, (PEER,)).url()

    dry = await view.join_project(ProjectJoin(invitation=invited, dry_run=True))
    assert dry.replaces_owner == OWNER
    assert not dry.restarting
    with pytest.raises(ControlError) as refused:
        await view.join_project(ProjectJoin(invitation=invited))
    assert refused.value.status == 409
    message = str(refused.value)
    assert f"replaces the project 'life-a' of owner {OWNER[:8]}…{OWNER[-6:]}" in message
    assert '"replace": true' in message
    assert load_projects(daemon.paths.projects_file) == [project("life-a")]
    assert not daemon.restart_requested

    joined = await view.join_project(ProjectJoin(invitation=invited, replace=True))
    assert joined.restarting
    assert joined.replaces_owner == OWNER
    assert [p.owner for p in load_projects(daemon.paths.projects_file)] == [other]
    said = [e.message for e in view.events.after(-1)]
    assert any("in place of owner" in m for m in said), said

    # the same owner's invitation again (another share) replaces nothing
    same = Invitation("life-a", other, (PEER,)).url()
    dry = await view.join_project(ProjectJoin(invitation=same, share=2, dry_run=True))
    assert dry.replaces_owner is None


def test_volunteerd_join_asks_before_replacing_another_owners_project(
    tmp_path: Path,
    monkeypatch: pytest.MonkeyPatch,
    capsys: pytest.CaptureFixture[str],
) -> None:
    """The prompt was "Join the project 'life-a'?" whoever owned the one joined."""
    from volunteerd.cli import main

    monkeypatch.setenv("VOLUNTEERD_CONFIG", str(tmp_path / "config.toml"))
    monkeypatch.setenv("VOLUNTEERD_DATA_DIR", str(tmp_path / "data"))
    monkeypatch.setenv("VOLUNTEERD_CACHE_DIR", str(tmp_path / "cache"))
    projects_file = tmp_path / "data" / "projects.toml"
    join_project(projects_file, project("life-a"))
    other = str(peer_id_for(Identity.generate()))
    invited = Invitation("life-a", other, (PEER,)).url()
    told = f"This replaces the project 'life-a' of owner {OWNER[:8]}…{OWNER[-6:]}"

    asked: list[str] = []
    monkeypatch.setattr("sys.stdin.isatty", lambda: True)
    monkeypatch.setattr("builtins.input", lambda question: asked.append(question) or "n")
    assert main(["join", invited]) == 0
    out = capsys.readouterr().out
    assert told in out
    assert asked == ["Join and replace it? [y/N] "]
    assert "not joined" in out
    assert load_projects(projects_file) == [project("life-a")]

    assert main(["join", invited, "--yes"]) == 0  # --yes says yes to it, as to the join
    assert told in capsys.readouterr().out
    assert [p.owner for p in load_projects(projects_file)] == [other]


@pytest.mark.parametrize(
    ("text", "says"),
    [
        ("[[project]\n", "not valid TOML"),
        ('project = ["x"]\n', "expected [[project]] tables"),
        ("project = 3\n", "expected [[project]] tables"),
    ],
    ids=["toml", "not-tables", "not-a-list"],
)
def test_a_file_that_is_no_list_of_projects_is_an_error_naming_it(
    tmp_path: Path, text: str, says: str
) -> None:
    path = tmp_path / "projects.toml"
    path.write_text(text)
    with pytest.raises(ConfigError) as error:
        load_projects(path)
    assert str(path) in str(error.value)
    assert says in str(error.value)
    # and nothing is written over it: the volunteer's file stays for them to fix
    with pytest.raises(ConfigError):
        join_project(path, project("y"))
    with pytest.raises(ConfigError):
        leave_project(path, "x")
    assert path.read_text() == text


GOOD = f'[[project]]\nname = "good"\nowner = "{OWNER}"\npeers = ["{PEER}"]\nshare = 2.0\n'
OTHER_ID = str(peer_id_for(Identity.generate()))


@pytest.mark.parametrize(
    ("entry", "says"),
    [
        (f'name = "x"\npeers = ["{PEER}"]\n', "names no owner"),
        (f'name = "x"\nowner = "{OWNER}"\npeers = []\n', "names no peer"),
        (f'name = "x"\nowner = "{OWNER}"\n', "no list of peers"),
        (f'name = "x"\nowner = "nobody"\npeers = ["{PEER}"]\n', "Ed25519"),
        (f'name = "x"\nowner = "{OWNER}"\npeers = ["{PEER}"]\nshare = 0\n', "share 0"),
        (f'name = "x"\nowner = "{OWNER}"\npeers = ["{PEER}"]\nshare = "1"\n', "share '1'"),
        (f'name = "X Y"\nowner = "{OWNER}"\npeers = ["{PEER}"]\n', "is not a name"),
        (f'owner = "{OWNER}"\npeers = ["{PEER}"]\n', "names no experiment"),
        (
            f'name = "x"\nowner = "{OWNER}"\npeers = ["/unix/a{PEER[-57:]}"]\n',
            "none of its peers",
        ),
        (
            f'name = "x"\nowner = "{OWNER}"\n'
            f'peers = ["/dnsaddr/boot.example.org/p2p/{OTHER_ID}"]\n',
            "none of its peers",
        ),
        (f'name = "good"\nowner = "{OWNER}"\npeers = ["{PEER}"]\n', "listed twice"),
    ],
    ids=[
        "no-owner",
        "no-peer",
        "no-peers-key",
        "bad-owner",
        "bad-share",
        "share-text",
        "bad-name",
        "no-name",
        "unix-peer",
        "dnsaddr-peer",
        "twice",
    ],
)
def test_an_entry_todays_checks_refuse_is_set_aside_and_the_others_still_load(
    tmp_path: Path, entry: str, says: str
) -> None:
    """One such entry (an older release's, or one edited by hand) made the whole file an
    error: the daemon did not start, and `leave` could not remove it."""
    path = tmp_path / "projects.toml"
    text = GOOD + "\n[[project]]\n" + entry
    path.write_text(text)
    recorded = read_projects(path)
    assert [(p.name, p.peers, p.share) for p in recorded.projects] == [("good", (PEER,), 2.0)]
    [aside] = recorded.set_aside
    assert says in aside.problem
    if aside.name == "good":  # following the advice must not cost the hosted entry
        assert "first entry of that name is hosted" in aside.advice()
    assert any(f"{path}: project 2" in w and "is not hosted" in w for w in recorded.warnings)
    # joining another project leaves it as it was; leaving it (by its name) removes it
    assert join_project(path, project("third"))
    assert read_projects(path).set_aside == [aside]
    name = aside.name
    assert leave_project(path, name)
    if name == "good":  # both entries of the name go
        assert [p.name for p in load_projects(path)] == ["third"]
    else:
        assert [p.name for p in load_projects(path)] == ["good", "third"]
    assert read_projects(path).set_aside == []


@pytest.mark.parametrize(
    "refused",
    [
        f"/dnsaddr/boot.example.org/p2p/{OTHER_ID}",
        f"/ip4/127.0.0.1/tcp/4001/ws/p2p/{OTHER_ID}",
        f"/dns4/boot.example.org/tcp/443/tls/ws/p2p/{OTHER_ID}",
        f"/ip4/127.0.0.1/udp/4001/quic-v1/p2p/{OTHER_ID}",
    ],
    ids=["dnsaddr", "ws", "tls-ws", "quic"],
)
def test_a_peer_todays_rules_refuse_is_left_out_and_the_project_joins_through_the_others(
    tmp_path: Path, refused: str
) -> None:
    """What an older release put in an invitation and recorded at `join`: the new daemon
    stopped with "project 1: not a valid invitation" (exit 3)."""
    path = tmp_path / "projects.toml"
    text = (
        f'[[project]]\nname = "vmix"\nowner = "{OWNER}"\npeers = ["{PEER}", "{refused}"]\n'
        "share = 1.0\njoined_at = 1767225600.0\ntrainers = 3\n"
    )
    path.write_text(text)
    recorded = read_projects(path)
    assert recorded.projects == [Project("vmix", OWNER, (PEER,), share=1.0, joined_at=1767225600.0)]
    assert recorded.set_aside == []
    assert len(recorded.warnings) == 2  # the peer left out, the key not known
    assert any(refused[:20] in w and "left out" in w for w in recorded.warnings)
    assert any("'trainers'" in w and "ignored" in w for w in recorded.warnings)
    # the daemon starts (and a join or leave may restart it) on such a file
    daemon = a_daemon(tmp_path)
    daemon.paths.data_dir.mkdir()
    daemon.paths.projects_file.write_text(text)
    daemon.check_restart()
    # an entry not changed is written back as it was read: peers, unknown keys and all
    assert join_project(path, project("other"))
    assert "trainers = 3" in path.read_text()
    assert refused in path.read_text()
    # joining it again from a valid invitation writes it anew
    assert join_project(path, Project("vmix", OWNER, (PEER,), joined_at=2.0))
    assert refused not in path.read_text()
    assert read_projects(path).warnings == []


def test_a_file_with_entries_set_aside_lets_volunteerd_list_leave_and_join(
    tmp_path: Path,
    monkeypatch: pytest.MonkeyPatch,
    capsys: pytest.CaptureFixture[str],
) -> None:
    """`volunteerd projects`, `leave` and `join` (no daemon running) each stopped with
    the file's error (exit 3): only editing projects.toml by hand got out of it."""
    from volunteerd.cli import main

    monkeypatch.setenv("VOLUNTEERD_CONFIG", str(tmp_path / "config.toml"))
    monkeypatch.setenv("VOLUNTEERD_DATA_DIR", str(tmp_path / "data"))
    monkeypatch.setenv("VOLUNTEERD_CACHE_DIR", str(tmp_path / "cache"))
    projects_file = tmp_path / "data" / "projects.toml"
    projects_file.parent.mkdir()
    dnsaddr = f"/dnsaddr/boot.example.org/p2p/{OTHER_ID}"
    projects_file.write_text(
        f'[[project]]\nname = "vmix"\nowner = "{OWNER}"\npeers = ["{PEER}", "{dnsaddr}"]\n'
        f'[[project]]\nname = "dead"\nowner = "{OWNER}"\npeers = ["{dnsaddr}"]\n'
    )
    assert main(["projects"]) == 0
    out = capsys.readouterr().out
    assert "vmix  share 1  volunteerd is not running" in out
    assert "dead  not hosted: none of its peers is one this release joins through" in out
    assert "`volunteerd leave dead`" in out
    assert main(["projects", "--json"]) == 0
    listed = json.loads(capsys.readouterr().out)
    assert [(p["name"], p["state"]) for p in listed] == [
        ("vmix", "joining"),
        ("dead", "not_hosted"),
    ]
    assert "`volunteerd leave dead`" in listed[1]["advice"]

    assert main(["join", Invitation("new", OWNER, (PEER,)).url(), "--yes"]) == 0
    assert main(["leave", "dead"]) == 0
    assert "left 'dead'" in capsys.readouterr().out
    assert [p.name for p in load_projects(projects_file)] == ["vmix", "new"]
    assert read_projects(projects_file).set_aside == []
    # an invitation at `join` is still checked strictly: a bad argument, exit 2
    bad = Invitation("new", OWNER, (PEER,)).url().replace("%2Fip4%2F127.0.0.1", "%2Fdnsaddr%2Fx")
    assert main(["join", bad, "--yes"]) == ExitCode.USAGE
    assert "not a valid invitation" in capsys.readouterr().err


def test_shares_split_the_room_at_least_one_each() -> None:
    small, big = project("a", share=1), project("b", share=3)
    both = [small, big]
    assert (share_of(8, small, both), share_of(8, big, both)) == (2, 6)
    assert share_of(2, small, both) == 1  # never nothing
    assert share_of(5, small, [small]) == 5
    for bad in (0.0, -1.0, float("nan"), float("inf"), MAX_SHARE + 1):
        with pytest.raises(ConfigError):
            check_share(bad)
    assert MAX_SHARE == MAX_PROJECT_SHARE  # the control API checks with its own copy


def test_the_configs_project_trusts_its_owners_and_a_joined_one_its_own() -> None:
    configured = ExperimentsConfig(join="cfg", trusted_owners=[OWNER], max_experts=3)
    mine = Project.from_experiments(configured)
    assert mine is not None
    assert (mine.name, mine.owner, mine.from_config) == ("cfg", OWNER, True)
    assert mine.experiments(configured) is configured
    assert Project.from_experiments(ExperimentsConfig()) is None

    joined = project("tiny-lm").experiments(configured)
    assert (joined.join, joined.trusted_owners, joined.max_experts) == ("tiny-lm", [OWNER], 3)


def test_a_daemon_that_hosts_nothing_imports_no_torch() -> None:
    """The modules an idle ``volunteerd serve`` loads (the hosting side, which imports
    torch, is imported only when there is something to host)."""
    code = (
        "import sys\n"
        "import volunteerd.cli, volunteerd.daemon, volunteerd.swarm.projects\n"
        "from volunteerd.cli import build_parser\n"
        "build_parser()\n"
        "print(sorted(m for m in sys.modules if m == 'torch' or m.startswith('torch.')))\n"
    )
    result = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, timeout=120, check=True
    )
    assert result.stdout.strip() == "[]"


def test_joins_from_many_threads_at_once_are_all_recorded(tmp_path: Path) -> None:
    """Eight joins at once (the control API runs each in a thread): each is recorded,
    the file stays valid and no temporary file is left. All eight used to share one
    temporary file: joins answered "done" went missing and the file came out garbled."""
    path = tmp_path / "projects.toml"
    start = threading.Barrier(8)
    failures: list[BaseException] = []

    def join(i: int) -> None:
        start.wait()
        try:
            assert join_project(path, project(f"project-{i}"))
        except BaseException as exc:  # reported below, on the test's thread
            failures.append(exc)

    threads = [threading.Thread(target=join, args=(i,)) for i in range(8)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    assert failures == []
    assert sorted(p.name for p in load_projects(path)) == [f"project-{i}" for i in range(8)]
    assert sorted(f.name for f in tmp_path.iterdir()) == [".projects.toml.lock", "projects.toml"]


def test_bytes_that_are_not_utf8_are_an_error_naming_the_file(tmp_path: Path) -> None:
    """Every TOML file a volunteer or researcher hands over: a one-line error, not a
    traceback (a SIGHUP with such a limits.toml used to end the daemon)."""
    garbled = b"\xff[limits]\nupload_mbit = 3\n"
    config, limits = tmp_path / "config.toml", tmp_path / "limits.toml"
    config.write_bytes(garbled)
    limits.write_bytes(garbled)
    projects = tmp_path / "projects.toml"
    projects.write_bytes(garbled)
    manifest, experiment = tmp_path / "manifest.toml", tmp_path / "experiment.toml"
    manifest.write_bytes(garbled)
    experiment.write_bytes(garbled)
    loaders = [
        (config, lambda: load_config(config)),
        (limits, lambda: load_config(None, run_time_dir=tmp_path)),
        (projects, lambda: load_projects(projects)),
        (manifest, lambda: load_manifest_file(manifest, owner=OWNER)),
        (experiment, lambda: load_experiment(experiment)),
    ]
    for path, load in loaders:
        with pytest.raises(ConfigError, match="not valid TOML") as error:
            load()
        assert str(path) in str(error.value)


# -- restarting for a join or leave ------------------------------------------------------


def a_daemon(tmp_path: Path, reload: Any = None) -> Daemon:
    paths = Paths(tmp_path / "config.toml", tmp_path / "data", tmp_path / "cache")
    return Daemon(Config(), paths, reload=reload)


def a_view(daemon: Daemon, projects: Sequence[Project] = ()) -> ControlView:
    """The projects part of the control view, over ``daemon``'s stop and restart."""
    return ControlView(
        node=None,  # type: ignore[arg-type]  # not reached by joins and leaves
        runtime=None,
        volunteer=None,  # type: ignore[arg-type]
        checkpointer=None,
        accountant=None,  # type: ignore[arg-type]
        projects=projects,
        joiners=[],
        projects_file=daemon.paths.projects_file,
        request_stop=daemon.request_stop,
        request_restart=daemon.request_restart,
        check_restart=daemon.check_restart,
        events=EventLog(),
    )


def test_a_stop_asked_for_after_a_restart_is_a_stop_and_before_one_too(tmp_path: Path) -> None:
    daemon = a_daemon(tmp_path)
    daemon.request_restart()
    daemon.request_stop()
    assert not daemon.restart_requested
    daemon = a_daemon(tmp_path)
    daemon.request_stop()
    daemon.request_restart()
    assert not daemon.restart_requested
    daemon = a_daemon(tmp_path)
    daemon.request_restart()
    assert daemon.restart_requested


@pytest.mark.parametrize("restart_began", [False, True])
async def test_a_shutdown_just_after_a_join_stops_the_daemon_for_good(
    tmp_path: Path, restart_began: bool
) -> None:
    # The tray's "Quit and stop" a moment after a join: the daemon restarted instead.
    daemon = a_daemon(tmp_path)
    view = a_view(daemon)
    invited = Invitation("tiny", OWNER, (PEER,)).url()
    async with trio.open_nursery() as nursery:
        view._nursery = nursery  # as its serve() sets it: stops wait for the reply to leave
        joined = await view.join_project(ProjectJoin(invitation=invited))
        assert joined.restarting
        if restart_began:
            await trio.sleep(0.5)
            assert daemon.restart_requested
        view.shutdown()
        await trio.sleep(0.5)
    assert not daemon.restart_requested


async def test_no_join_or_leave_restarts_into_a_configuration_that_does_not_load(
    tmp_path: Path,
) -> None:
    (tmp_path / "config.toml").write_text('[limits]\nupload_mbit = "ten"\n')
    daemon = a_daemon(tmp_path, reload=lambda: load_config(tmp_path / "config.toml"))
    view = a_view(daemon, [project("running")])
    invited = Invitation("tiny", OWNER, (PEER,)).url()
    with pytest.raises(ControlError) as refused:
        await view.join_project(ProjectJoin(invitation=invited))
    assert refused.value.status == 409
    assert "cannot join 'tiny' now" in str(refused.value)
    assert "limits.upload_mbit = 'ten'" in str(refused.value)
    assert not daemon.paths.projects_file.exists()  # nothing recorded
    with pytest.raises(ControlError, match="cannot leave 'running' now") as refused:
        await view.leave_project("running")
    assert refused.value.status == 409
    # a dry run restarts nothing: still answered
    dry = await view.join_project(ProjectJoin(invitation=invited, dry_run=True))
    assert not dry.restarting
    assert not daemon.restart_requested

    # a damaged limits.toml (or schedule.toml, projects.toml) is refused the same way
    (tmp_path / "config.toml").write_text("")
    daemon.paths.data_dir.mkdir()
    daemon.paths.limits_file.write_text("[limits]\nupload_mbit = -1\n")
    reload = partial(load_config, tmp_path / "config.toml", run_time_dir=daemon.paths.data_dir)
    daemon = a_daemon(tmp_path, reload=reload)
    view = a_view(daemon, [project("running")])
    with pytest.raises(ControlError, match=r"limits\.toml"):
        await view.leave_project("running")
    daemon.paths.limits_file.unlink()
    daemon.paths.projects_file.write_text("[[project]\n")
    with pytest.raises(ControlError, match=r"projects\.toml"):
        await view.leave_project("running")
    daemon.paths.projects_file.unlink()

    # once it loads again, the change is made and the daemon restarts for it
    joined = await view.join_project(ProjectJoin(invitation=invited))
    assert joined.restarting
    assert daemon.restart_requested
    assert [p.name for p in load_projects(daemon.paths.projects_file)] == ["tiny"]


def test_the_advice_for_an_entry_set_aside_is_a_command_a_shell_takes_whole() -> None:
    # A name edited by hand was shown bare: `volunteerd leave a b;rm` ran two commands.
    advice = SetAside("a b;rm", "", "it is not a name").advice()
    assert "`volunteerd leave 'a b;rm'`" in advice
