"""The projects file (``<data dir>/projects.toml``): joining records a project (in place
of one of the same name), leaving removes it, a damaged file is an error naming the
file, shares split the room for experts; and a daemon module that hosts nothing
imports no torch."""

from __future__ import annotations

import subprocess
import sys
import threading
from pathlib import Path

import pytest

from volunteerd.config import ExperimentsConfig, load_config
from volunteerd.control.models import MAX_PROJECT_SHARE
from volunteerd.errors import ConfigError
from volunteerd.identity import Identity
from volunteerd.net.peers import peer_id_for
from volunteerd.swarm.invitation import Invitation
from volunteerd.swarm.manifest import load_manifest_file
from volunteerd.swarm.projects import (
    MAX_SHARE,
    Project,
    check_share,
    join_project,
    leave_project,
    load_projects,
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

    # Joining again under the same name replaces the entry (here: a new owner and share).
    new_owner = str(peer_id_for(Identity.generate()))
    assert join_project(path, project("tiny-lm", share=2, owner=new_owner))
    assert [(p.name, p.owner, p.share) for p in load_projects(path)] == [
        ("other", OWNER, 3.0),
        ("tiny-lm", new_owner, 2.0),
    ]

    assert leave_project(path, "other")
    assert not leave_project(path, "other")
    assert [p.name for p in load_projects(path)] == ["tiny-lm"]
    assert leave_project(path, "tiny-lm")
    assert load_projects(path) == []


@pytest.mark.parametrize(
    ("text", "says"),
    [
        ("[[project]\n", "not valid TOML"),
        ('[[project]]\nname = "x"\n', "project.0.owner"),
        (f'[[project]]\nname = "x"\nowner = "{OWNER}"\npeers = []\n', "names no peer"),
        (f'[[project]]\nname = "x"\nowner = "nobody"\npeers = ["{PEER}"]\n', "Ed25519"),
        (
            f'[[project]]\nname = "x"\nowner = "{OWNER}"\npeers = ["{PEER}"]\nshare = 0\n',
            "share",
        ),
        (f'[[project]]\nname = "x"\nowner = "{OWNER}"\npeers = ["{PEER}"]\nfoo = 1\n', "foo"),
        (f'[[project]]\nname = "x"\nowner = "{OWNER}"\npeers = ["{PEER}"]\n' * 2, "twice"),
        ('something = "else"\n', "something"),
    ],
    ids=["toml", "no-owner", "no-peer", "bad-owner", "bad-share", "unknown-key", "twice", "table"],
)
def test_a_bad_file_is_an_error_naming_it(tmp_path: Path, text: str, says: str) -> None:
    path = tmp_path / "projects.toml"
    path.write_text(text)
    with pytest.raises(ConfigError) as error:
        load_projects(path)
    assert str(path) in str(error.value)
    assert says in str(error.value)
    # and nothing is written over it: the volunteer's file stays for them to fix
    with pytest.raises(ConfigError):
        join_project(path, project("y"))
    assert path.read_text() == text


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
