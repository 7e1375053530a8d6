"""``volunteerd status|pause|resume|snooze|limit|dashboard`` against a real daemon
process, and what they say when no daemon runs."""

from __future__ import annotations

import contextlib
import json
import signal
import socket
import sqlite3
import time
from pathlib import Path

import pytest
import torch

from tests.e2e.conftest import run_cli
from volunteerd.control.client import ControlClient
from volunteerd.experts import to_wire
from volunteerd.identity import Identity
from volunteerd.net import Verb, parse_peer_multiaddr
from volunteerd.net.background import BackgroundNode
from volunteerd.testing import local_config
from volunteerd.wire import ForwardRequest

# Each test starts volunteerd as a process (most, a daemon or a swarm of them).
pytestmark = pytest.mark.slow


def test_control_verbs_drive_a_running_daemon(spawn, tmp_path: Path) -> None:  # type: ignore[no-untyped-def]
    home = tmp_path / "vol"
    daemon = spawn("vol", "serve", "--experts", "ffn.[0:2].[0:1]", "--set", "control.port=0")
    ready = daemon.wait_ready()
    assert ready["control_url"].startswith("http://127.0.0.1:")

    shown = run_cli(home, "status")
    assert shown.returncode == 0, shown.stderr
    # honest: serving, but alone (issue 15), and what to do about it
    assert "state         no peers\nwhat to do    check the internet connection" in shown.stdout
    assert ready["peer_id"] in shown.stdout
    as_json = json.loads(run_cli(home, "status", "--json").stdout)
    assert as_json["experts"] == ["ffn.0.0", "ffn.1.0"]

    paused = run_cli(home, "pause")
    assert paused.returncode == 0, paused.stderr
    assert "paused" in paused.stdout
    assert json.loads(run_cli(home, "status", "--json").stdout)["state"] == "paused"
    shown = run_cli(home, "status").stdout
    assert "state         paused by you\n" in shown  # not "paused: paused"
    assert "volunteerd resume" in shown
    snoozed = run_cli(home, "snooze", "30m")
    assert "snoozed until" in snoozed.stdout
    resumed = run_cli(home, "resume")
    assert "contributing again" in resumed.stdout

    limited = run_cli(home, "limit", "--up", "8", "--down", "20")
    assert limited.returncode == 0, limited.stderr
    assert "upload        8 Mbit/s" in limited.stdout
    assert "download      20 Mbit/s" in limited.stdout
    refused = run_cli(home, "limit", "--up", "-1")
    assert refused.returncode == 2
    assert "upload_mbit" in refused.stderr
    # issue 12: `limit --up inf` made every later status a 500 until a restart
    for value in ("inf", "nan", "1e999", "Infinity"):
        refused = run_cli(home, "limit", "--up", value, "--down", "3")
        assert refused.returncode == 2, (value, refused.stderr)
        assert f"--up {value}: upload_mbit: Input should be a finite number" in refused.stderr
    refused = run_cli(home, "limit", "--quota", "1e300")
    assert refused.returncode == 2
    assert "monthly_quota_gb" in refused.stderr
    unchanged = run_cli(home, "limit")  # nothing of the refused changes was applied
    assert unchanged.returncode == 0, unchanged.stderr
    assert "upload        8 Mbit/s" in unchanged.stdout
    assert "download      20 Mbit/s" in unchanged.stdout
    assert "monthly quota none" in unchanged.stdout
    assert run_cli(home, "status").returncode == 0
    bad_duration = run_cli(home, "snooze", "soon")
    assert bad_duration.returncode == 2
    assert "not a duration" in bad_duration.stderr

    url = run_cli(home, "dashboard", "--print").stdout.strip()
    token = (home / "data" / "api-token").read_text().strip()
    assert url == f"{ready['control_url']}/#token={token}"
    assert daemon.process.poll() is None  # refused input left it running
    assert daemon.stop() == 130


def test_limit_refuses_a_bad_value_before_asking_the_daemon(tmp_path: Path) -> None:
    """A bad value is bad usage (exit 2) whether a daemon runs or not."""
    for flag, value in (("--up", "inf"), ("--down", "nan"), ("--quota", "1e999"), ("--up", "x")):
        result = run_cli(tmp_path, "limit", flag, value)
        assert result.returncode == 2, (flag, value, result.stderr)
        assert f"{flag} {value}:" in result.stderr
        assert "not running" not in result.stderr


def test_control_verbs_without_a_daemon_exit_5(tmp_path: Path) -> None:
    result = run_cli(tmp_path, "status")
    assert result.returncode == 5
    assert "not running" in result.stderr


def test_a_taken_control_port_is_a_clear_error(tmp_path: Path) -> None:
    with socket.socket() as held:
        held.bind(("127.0.0.1", 0))
        held.listen()
        port = held.getsockname()[1]
        result = run_cli(
            tmp_path, "serve", "--listen-host", "127.0.0.1", "--port", "0",
            "--experts", "ffn.0.0", "--set", "experts.hidden_dim=16",
            "--set", f"control.port={port}",
        )  # fmt: skip
    assert result.returncode == 5
    assert f"cannot listen on 127.0.0.1:{port}" in result.stderr


def _forwards_written(stats_file: Path) -> int:
    """The forward calls the daemon's flushes have written to its stats file so far."""
    if not stats_file.exists():
        return 0
    with contextlib.closing(sqlite3.connect(f"file:{stats_file}?mode=ro", uri=True)) as db:
        return int(db.execute("SELECT COALESCE(SUM(forward), 0) FROM work").fetchone()[0])


def test_stats_survive_kill_9(spawn) -> None:  # type: ignore[no-untyped-def]
    """Counted calls survive SIGKILL once a flush has passed (stats.flush_s)."""
    settings = ["--experts", "ffn.0.0", "--set", "experts.hidden_dim=16",
                "--set", "stats.flush_s=0.5"]  # fmt: skip
    server = spawn("vol", "serve", *settings)
    home = server.ready_file.parent
    address = parse_peer_multiaddr(server.wait_ready()["multiaddrs"][0])
    with BackgroundNode(Identity.generate(), local_config()) as client:
        for rows in range(1, 11):
            meta, data = to_wire(torch.randn(rows, 16))
            client.run(
                client.node.rpc.call,
                address,
                Verb.FORWARD,
                ForwardRequest(uid="ffn.0.0", tensors=[meta]),
                [data],
            )
    # Killed once a flush has written all ten, not a fixed 1.5 s after they were
    # counted: flushes come on the daemon's 1 s tick, and a loaded machine delays the
    # tick and the write past that.
    deadline = time.monotonic() + 30
    while _forwards_written(home / "data" / "stats.sqlite3") < 10:
        assert time.monotonic() < deadline
        time.sleep(0.1)
    server.stop(signal.SIGKILL)

    server.ready_file.unlink()
    again = spawn("vol", "serve", *settings)
    again.wait_ready()
    kept = ControlClient.for_data_dir(home / "data").stats().all_time
    assert kept.forward == 10
    assert kept.samples == 55
    assert again.stop() == 130
