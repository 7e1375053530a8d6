"""Joining a project as a volunteer does it: a researcher publishes an experiment and
shares the invitation it prints; a fresh daemon (a throw-away home) hosts nothing, is
small and says it is not in a project; ``volunteerd join <invitation>`` restarts it
(the same process) into the project, whose experts it downloads or seeds and serves
to the researcher's trainer; ``volunteerd leave`` makes it small again."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import TypeVar

import pytest

from tests.e2e.conftest import cli_env, publish
from volunteerd.control.client import ControlClient
from volunteerd.control.models import Status
from volunteerd.errors import ExitCode, VolunteerdError
from volunteerd.stats.store import IDLE_READERS
from volunteerd.swarm.invitation import parse_invitation
from volunteerd.testing.ports import fixed_port

# A bootstrap node, a daemon that restarts twice and a trainer, as processes.
pytestmark = pytest.mark.slow

T = TypeVar("T")

NAME = "e2e-join"
MANIFEST = f"""\
name = "{NAME}"
description = "A tiny test model"
owner_name = "The e2e lab"
hidden_dim = 32
uid_prefix = "ffn"
grid = [2, 2]
replication = 1
lifetime_days = 1
"""
TRAINER = """\
name = "{name}"
[swarm]
manifest = "{name}"
trusted_owners = ["{owner}"]
[data]
max_bytes = 100000
[model]
num_heads = 2
seq_len = 16
[training]
batch_size = 4
eval_batches = 1
eval_every = 1000
"""
# What an idle daemon may take: the bound (it uses ~100 MB; hosting, ~400 MB).
IDLE_RSS_BYTES = 250 << 20


def fresh_home(home: Path, control_port: int) -> dict[str, str]:
    """A new user's environment: everything under ``home`` (no VOLUNTEERD_* or XDG_*
    locations: the platform defaults apply), the control API on ``control_port``."""
    env = {k: v for k, v in cli_env(home).items() if not k.startswith(("VOLUNTEERD_", "XDG_"))}
    env.update(HOME=str(home), VOLUNTEERD_CONTROL__PORT=str(control_port))
    return env


def volunteerd(env: dict[str, str], *args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-m", "volunteerd", *args],
        env=env, capture_output=True, text=True, timeout=120, check=False, stdin=subprocess.DEVNULL,
    )  # fmt: skip


def rss_bytes(pid: int) -> int:
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1]) * 1024
    raise AssertionError("no VmRSS")


def open_files(pid: int) -> list[str]:
    """What the process's descriptors point at."""
    fds = Path(f"/proc/{pid}/fd")
    targets = []
    for fd in fds.iterdir():
        try:
            targets.append(os.readlink(fd))
        except OSError:  # closed meanwhile
            continue
    return targets


def torch_loaded(pid: int) -> bool:
    return "libtorch" in Path(f"/proc/{pid}/maps").read_text()


def eventually(ask: Callable[[], T], ok: Callable[[T], bool], within_s: float, log: Path) -> T:
    """``ask()`` until its answer is ``ok`` (a daemon restarting does not answer for a
    moment: asked again)."""
    deadline = time.monotonic() + within_s
    last: object = None
    while time.monotonic() < deadline:
        try:
            last = ask()
        except VolunteerdError as exc:
            last = exc
        else:
            if ok(last):  # type: ignore[arg-type]
                return last  # type: ignore[return-value]
        time.sleep(0.2)
    raise AssertionError(f"not so within {within_s}s: {last!r}\n{log.read_text()[-4000:]}")


@pytest.fixture
def volunteer(tmp_path: Path) -> Iterator[tuple[subprocess.Popen[str], dict[str, str], Path]]:
    """``volunteerd serve`` as a fresh install starts it (on loopback, any free port for
    libp2p; one fixed control port, which every restart must get back: the old process
    released it)."""
    home = tmp_path / "volunteer"
    home.mkdir()
    env = fresh_home(home, fixed_port())
    log = home / "log.txt"
    with log.open("w") as output:
        process = subprocess.Popen(
            [sys.executable, "-m", "volunteerd", "serve", "--listen-host", "127.0.0.1",
             "--port", "0", "--set", 'runtime.device="cpu"',
             "--set", "experiments.max_experts=4"],
            env=env, stdout=output, stderr=subprocess.STDOUT, text=True,
        )  # fmt: skip
    yield process, env, log
    if process.poll() is None:
        process.kill()
        process.wait(10)


@pytest.mark.timeout(300)
def test_a_fresh_daemon_joins_a_published_project_serves_it_and_leaves(
    spawn,  # type: ignore[no-untyped-def]
    volunteer: tuple[subprocess.Popen[str], dict[str, str], Path],
    tmp_path: Path,
) -> None:
    process, env, log = volunteer
    data_dir = tmp_path / "volunteer" / ".local" / "share" / "volunteerd"

    def status() -> Status:
        return ControlClient.for_data_dir(data_dir).status()

    # The researcher: a bootstrap node, and the experiment published through it.
    boot = spawn("boot", "bootstrap").wait_ready()["multiaddrs"][0]
    owner_home = tmp_path / "owner"
    (tmp_path / "experiment.toml").write_text(MANIFEST)
    line = publish(owner_home, tmp_path / "experiment.toml", boot)
    invitation = parse_invitation(line)
    assert invitation.name == NAME

    # The volunteer's daemon, freshly installed: hosts nothing, small, no torch.
    idle = eventually(status, lambda s: True, 60, log)
    assert (idle.projects, idle.experts, idle.device) == ([], [], "none")
    assert idle.activity.state == "not_in_project"
    assert "not in a project" in idle.activity.message
    assert "volunteerd join" in idle.activity.hint
    assert not torch_loaded(process.pid)
    idle_rss = rss_bytes(process.pid)
    print(f"idle RSS {idle_rss / 2**20:.0f} MiB")
    assert idle_rss < IDLE_RSS_BYTES

    # Joining asks first; without a terminal it says which flag to add. A bad
    # invitation is a bad argument (exit 2), and the daemon keeps running.
    asked = volunteerd(env, "join", line)
    assert asked.returncode == ExitCode.USAGE
    assert "--yes" in asked.stderr
    bad = volunteerd(env, "join", line.replace("owner=", "owner=x"), "--yes")
    assert bad.returncode == ExitCode.USAGE
    assert "not a valid invitation" in bad.stderr
    assert status().started_at == idle.started_at

    joined = volunteerd(env, "join", line, "--yes")
    assert joined.returncode == ExitCode.OK, joined.stderr
    assert NAME in joined.stdout
    assert invitation.owner in joined.stdout
    assert invitation.peers[0] in joined.stdout
    assert "restarts" in joined.stdout

    # The same process restarts into the project and hosts its experts.
    hosting = eventually(
        status,
        lambda s: bool(s.projects) and s.projects[0].state == "joined" and bool(s.experts),
        120,
        log,
    )
    assert process.poll() is None
    endpoint = ControlClient.for_data_dir(data_dir).endpoint
    assert endpoint.pid == process.pid
    assert endpoint.url == f"http://127.0.0.1:{env['VOLUNTEERD_CONTROL__PORT']}"
    # Nothing of the process before the restart was inherited: one lock, and the
    # statistics' writer with at most its idle query connections.
    files = open_files(process.pid)
    assert files.count(str(data_dir / "volunteerd.lock")) == 1, files
    assert 1 <= files.count(str(data_dir / "stats.sqlite3")) <= 1 + IDLE_READERS, files
    (project,) = hosting.projects
    assert (project.name, project.owner) == (NAME, invitation.owner)
    assert project.description == "A tiny test model"
    assert project.owner_name == "The e2e lab"
    assert project.experts == len(hosting.experts) > 0
    assert hosting.started_at > idle.started_at
    listed = volunteerd(env, "projects")
    assert listed.returncode == ExitCode.OK
    assert NAME in listed.stdout
    assert "A tiny test model" in listed.stdout

    # The researcher's trainer uses them.
    trainer_config = tmp_path / "trainer.toml"
    trainer_config.write_text(TRAINER.format(name=NAME, owner=invitation.owner))
    summary_file = tmp_path / "summary.json"
    trained = subprocess.run(
        [sys.executable, "-m", "volunteerd", "train", "--config", str(trainer_config),
         "--bootstrap", boot, "--listen-host", "127.0.0.1", "--steps", "3",
         "--summary-json", str(summary_file)],
        env=cli_env(tmp_path / "trainer"), capture_output=True, text=True, timeout=240,
        check=False,
    )  # fmt: skip
    assert trained.returncode == ExitCode.OK, trained.stderr[-3000:]
    summary = json.loads(summary_file.read_text())
    assert summary["expert_calls"] > 0
    served = eventually(status, lambda s: s.today.forward > 0, 30, log)
    assert served.today.backward > 0
    assert served.activity.state == "contributing"

    # Leaving: back to hosting nothing, in the same process, small again.
    left = volunteerd(env, "leave", NAME)
    assert left.returncode == ExitCode.OK, left.stderr
    again = eventually(
        status, lambda s: s.started_at > hosting.started_at and s.device == "none", 60, log
    )
    assert (again.projects, again.experts) == ([], [])
    assert process.poll() is None
    assert not torch_loaded(process.pid)
    left_rss = rss_bytes(process.pid)
    print(f"RSS after leaving {left_rss / 2**20:.0f} MiB")
    assert left_rss < IDLE_RSS_BYTES
    assert volunteerd(env, "leave", NAME).returncode == ExitCode.USAGE  # not in it any more

    process.send_signal(signal.SIGTERM)
    assert process.wait(30) == ExitCode.INTERRUPTED
    assert not os.path.exists(data_dir / "control.json")
