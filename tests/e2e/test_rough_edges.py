"""Rough edges a new volunteer hit (issue 15), as subprocesses: the README's swarm of
three terminals on one machine, limits that belong to their daemon, mistakes named
before anything starts, and a daemon started detached that runs at low priority."""

from __future__ import annotations

import os
import re
import shlex
import signal
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from tests.e2e.conftest import cli_env, run_cli
from volunteerd.control.client import ControlClient
from volunteerd.detached import IO_CLASS_BEST_EFFORT, IO_LEVEL, io_priority, start_detached
from volunteerd.errors import ControlError, ExitCode
from volunteerd.testing.ports import fixed_port

pytestmark = pytest.mark.slow

ROOT = Path(__file__).parents[2]
START_TIMEOUT_S = 120.0


def readme_swarm() -> list[list[str]]:
    """The README's "small swarm by hand": its three commands, as written."""
    text = (ROOT / "README.md").read_text()
    block = text.split("A small swarm by hand (three terminals):", 1)[1].split("```")[1]
    joined = block.replace("\\\n", " ")
    return [
        shlex.split(line)
        for line in joined.splitlines()
        if line.strip().startswith(".venv/bin/volunteerd")
    ]


def wait_answering(data_dir: Path, proc: subprocess.Popen[Any], log: Path) -> ControlClient:
    deadline = time.monotonic() + START_TIMEOUT_S
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise AssertionError(f"exited {proc.returncode}:\n{log.read_text()}")
        try:
            client = ControlClient.for_data_dir(data_dir)
            client.health()
            return client
        except ControlError:
            time.sleep(0.2)
    raise AssertionError(f"{data_dir}: no answer in {START_TIMEOUT_S}s:\n{log.read_text()}")


@pytest.fixture
def processes() -> Iterator[list[subprocess.Popen[str]]]:
    started: list[subprocess.Popen[str]] = []
    yield started
    for proc in started:
        if proc.poll() is None:
            proc.kill()
            proc.wait(10)


def test_the_readmes_three_terminal_swarm_runs_on_one_machine(
    tmp_path: Path, processes: list[subprocess.Popen[str]]
) -> None:
    boot_cmd, serve_a, serve_b = readme_swarm()
    boot_port = str(fixed_port())
    env = cli_env(tmp_path)  # one config file for all three, as a user's default would be
    for name in ("VOLUNTEERD_DATA_DIR", "VOLUNTEERD_CACHE_DIR"):
        del env[name]  # the README's --data-dir flags choose
    # the README relies on the default control port: both daemons ask for the same one
    env["VOLUNTEERD_CONTROL__PORT"] = str(fixed_port())
    env["VOLUNTEERD_EXPERTS__HIDDEN_DIM"] = "32"  # small experts; the commands as written
    env["VOLUNTEERD_RUNTIME__DEVICE"] = "cpu"

    def run(name: str, command: list[str], peer: str = "") -> tuple[Path, Path]:
        args = [
            a.replace("38400", boot_port)
            .replace("/tmp/vd-", str(tmp_path / "vd-"))
            .replace("/ip4/127.0.0.1/tcp/" + boot_port + "/p2p/12D3KooW...", peer)
            for a in command[1:]
        ]
        log = tmp_path / f"{name}.log"
        with log.open("w") as out:
            processes.append(
                subprocess.Popen(
                    [sys.executable, "-m", "volunteerd", *args],
                    env=env,
                    stdout=out,
                    stderr=subprocess.STDOUT,
                    text=True,
                )
            )
        return tmp_path / f"vd-{name}", log

    _, boot_log = run("boot", boot_cmd)
    deadline = time.monotonic() + START_TIMEOUT_S
    while not (found := re.search(r"join with --bootstrap (\S+)", boot_log.read_text())):
        assert time.monotonic() < deadline, boot_log.read_text()
        assert processes[0].poll() is None, boot_log.read_text()
        time.sleep(0.2)
    peer = found.group(1)
    a_dir, a_log = run("a", serve_a, peer)
    a = wait_answering(a_dir, processes[1], a_log)
    b_dir, b_log = run("b", serve_b, peer)
    b = wait_answering(b_dir, processes[2], b_log)

    assert a.endpoint.url != b.endpoint.url
    assert "another volunteerd's control API uses port" in b_log.read_text()
    assert a.status().experts[0].startswith("ffn.0.")
    assert b.status().experts[0].startswith("ffn.2.")

    # limits belong to the data folder's daemon: one's change does not reach the other
    changed = run_cli(tmp_path, "limit", "--up", "7", "--data-dir", str(b_dir))
    assert changed.returncode == 0, changed.stderr
    assert (b_dir / "limits.toml").exists()
    assert not (tmp_path / "limits.toml").exists()  # not in the shared config folder
    processes[1].send_signal(signal.SIGHUP)  # a reloads its files: none of b's
    deadline = time.monotonic() + START_TIMEOUT_S
    while "SIGHUP: reloading the limits" not in a_log.read_text():
        assert time.monotonic() < deadline, a_log.read_text()
        time.sleep(0.2)
    assert b.limits().upload_mbit == 7
    assert a.limits().upload_mbit == 0

    for proc in reversed(processes):
        proc.send_signal(signal.SIGTERM)
        assert proc.wait(60) == ExitCode.INTERRUPTED


def test_a_peer_without_its_id_is_refused_before_an_identity_exists(tmp_path: Path) -> None:
    started = time.monotonic()
    refused = run_cli(tmp_path, "serve", "--bootstrap", "/ip4/1.2.3.4/tcp/1")
    assert refused.returncode == ExitCode.CONFIG
    assert "/p2p/<peer id>" in refused.stderr
    assert "flag --bootstrap /ip4/1.2.3.4/tcp/1" in refused.stderr
    assert not (tmp_path / "data" / "identity.key").exists()
    print(f"refused after {time.monotonic() - started:.1f} s")


def test_a_bad_experts_pattern_blames_the_flag_typed(tmp_path: Path) -> None:
    refused = run_cli(tmp_path, "serve", "--experts", "ffn.[0:x]")
    assert refused.returncode == ExitCode.CONFIG
    assert "(flag --experts ffn.[0:x])" in refused.stderr
    assert "--set" not in refused.stderr


def test_snooze_checks_its_duration_before_looking_for_a_daemon(tmp_path: Path) -> None:
    refused = run_cli(tmp_path, "snooze", "banana")
    assert refused.returncode == ExitCode.USAGE
    assert "not a duration: 'banana'" in refused.stderr
    assert "not running" not in refused.stderr


def stat_nice(pid: int, task: int | None = None) -> int:
    where = f"/proc/{pid}/task/{task}/stat" if task else f"/proc/{pid}/stat"
    return int(Path(where).read_text().rsplit(")", 1)[1].split()[16])


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="reads /proc")
def test_a_daemon_started_detached_runs_at_low_priority(tmp_path: Path) -> None:
    if os.getpriority(os.PRIO_PROCESS, 0) > 10:
        pytest.skip("this test runs above nice 10 already")
    env = cli_env(tmp_path)
    command = [sys.executable, "-m", "volunteerd", "serve", "--listen-host", "127.0.0.1"]
    command += ["--port", "0", "--experts", "ffn.0.0", "--set", "experts.hidden_dim=16"]
    child = start_detached(command, tmp_path / "daemon.log", env)
    try:
        client = wait_answering(tmp_path / "data", child, tmp_path / "daemon.log")
        assert client.endpoint.pid == child.pid
        assert stat_nice(child.pid) == 10
        # every thread: lowered before the first one started
        threads = [int(t) for t in os.listdir(f"/proc/{child.pid}/task")]
        assert len(threads) > 1
        assert {stat_nice(child.pid, t) for t in threads} == {10}
        if io_priority(0) is not None:
            assert io_priority(child.pid) == (IO_CLASS_BEST_EFFORT, IO_LEVEL)
        assert "running at low priority: nice 10" in (tmp_path / "daemon.log").read_text()
    finally:
        child.send_signal(signal.SIGTERM)
        child.wait(60)
