"""A daemon stopped with a trainer connected binds its port again at once (issue 12,
item 6): its old connections linger in TIME-WAIT for a minute, and the port check
refused every restart until they were gone -- a restart loop to a service manager.
A daemon restarting in place (a join) keeps its data folder from a second one started
meanwhile."""

from __future__ import annotations

import json
import socket
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch
import trio

from tests.e2e.conftest import cli_env, run_cli
from volunteerd.errors import ExitCode
from volunteerd.experts import to_wire
from volunteerd.identity import Identity
from volunteerd.net import Verb
from volunteerd.net.peers import parse_peer_multiaddr, peer_id_for
from volunteerd.paths import DataDirLock, LockHolder, lock_holder
from volunteerd.swarm.invitation import Invitation
from volunteerd.testing import local_config, open_peer
from volunteerd.testing.ports import fixed_port
from volunteerd.wire import ForwardRequest

# Each test starts volunteerd as a process (most, a daemon or a swarm of them).
pytestmark = pytest.mark.slow

SMALL = ["--set", "experts.hidden_dim=32", "--set", 'runtime.device="cpu"']
# The states a closed socket lingers in on the side that closed first: FIN-WAIT-1/2,
# CLOSING, TIME-WAIT. Any of them kept a plain bind from succeeding.
LINGERING = {"04", "05", "06", "0B"}


def lingering_on(port: int) -> int | None:
    """Closed sockets still holding local port ``port`` (None: no /proc/net/tcp here)."""
    table = Path("/proc/net/tcp")
    if not table.exists():
        return None
    lines = table.read_text().splitlines()[1:]
    return sum(
        1
        for line in lines
        if int(line.split()[1].split(":")[1], 16) == port and line.split()[3] in LINGERING
    )


def test_restart_with_a_trainer_connected_binds_the_same_port_at_once(spawn) -> None:  # type: ignore[no-untyped-def]
    port = fixed_port()
    first = spawn("server", "serve", "--experts", "ffn.0.0", *SMALL, port=port)
    address = parse_peer_multiaddr(first.wait_ready()["multiaddrs"][0])
    meta, data = to_wire(torch.randn(2, 32))
    request = ForwardRequest(uid="ffn.0.0", tensors=[meta])
    restarted = {}

    async def trainer() -> None:
        # A peer that connected and says nothing (a stalled handshake) is certain to be
        # closed by the daemon first, so that a closed socket lingers on its port.
        stalled = socket.create_connection(("127.0.0.1", port))
        async with open_peer(local_config()) as client:
            await client.rpc.call(address, Verb.FORWARD, request, [data])
            assert await trio.to_thread.run_sync(first.stop) == ExitCode.INTERRUPTED
            lingering = lingering_on(port)
            assert lingering is None or lingering > 0, "the scenario needs a lingering socket"
            second = spawn("server", "serve", "--experts", "ffn.0.0", *SMALL, port=port)
            restarted["info"] = await trio.to_thread.run_sync(second.wait_ready)
            restarted["proc"] = second
            with trio.fail_after(30):
                while True:  # the trainer notices the restart and reconnects
                    try:
                        reply, _ = await client.rpc.call(address, Verb.FORWARD, request, [data])
                        break
                    except Exception:
                        await trio.sleep(0.2)
            assert reply.status == "ok"
        stalled.close()

    trio.run(trainer)
    assert f"/tcp/{port}/" in restarted["info"]["multiaddrs"][0]
    assert restarted["proc"].stop() == ExitCode.INTERRUPTED


def test_a_live_daemon_on_the_port_is_still_refused(spawn, tmp_path: Path) -> None:  # type: ignore[no-untyped-def]
    port = fixed_port()
    first = spawn("first", "serve", "--experts", "ffn.0.0", *SMALL, port=port)
    first.wait_ready()
    other = run_cli(
        tmp_path / "other", "serve", "--listen-host", "127.0.0.1", "--port", str(port), *SMALL
    )
    assert other.returncode == ExitCode.UNAVAILABLE
    assert f"cannot listen on 127.0.0.1:{port}" in other.stderr
    assert first.stop() == ExitCode.INTERRUPTED


def test_a_serve_started_while_a_join_restarts_the_daemon_is_refused(spawn, tmp_path: Path) -> None:  # type: ignore[no-untyped-def]
    # A join restarts the daemon in place (execv). It let go of the data folder's lock
    # before the exec and took it again 2-5 s later: a `volunteerd serve` started in that
    # gap (`volunteerd status` said "not running; start it", the tray offered "Start
    # volunteerd") took the folder, and the restarted daemon exited "another volunteerd
    # is using ...". The lock is kept across the exec now.
    home, name = tmp_path / "volunteer", "e2e-restart"
    daemon = spawn("volunteer", "serve", "--set", 'runtime.device="cpu"',
                   "--set", "experiments.max_experts=2")  # fmt: skip
    first = daemon.wait_ready()
    lock_file = home / "data" / "volunteerd.lock"
    assert lock_holder(lock_file) == LockHolder(daemon.process.pid)
    owner = str(peer_id_for(Identity.generate()))  # nobody answers for it: the project is joining
    line = Invitation(name, owner, (f"/ip4/127.0.0.1/tcp/9/p2p/{owner}",)).url()
    daemon.ready_file.unlink()  # written again by the restarted daemon

    joined = run_cli(home, "join", line, "--yes")
    assert joined.returncode == ExitCode.OK, joined.stderr
    assert "restarts" in joined.stdout
    control_file = home / "data" / "control.json"
    deadline = time.monotonic() + 60
    while control_file.exists():  # the old daemon's API stops: the restart has begun
        assert time.monotonic() < deadline, "the daemon did not restart"
        time.sleep(0.01)
    # A second daemon started now, and `volunteerd status` asked meanwhile.
    second_log = tmp_path / "second.txt"
    with second_log.open("w") as output:
        second = subprocess.Popen(
            [sys.executable, "-m", "volunteerd", "serve", "--listen-host", "127.0.0.1",
             "--port", "0"],
            env=cli_env(home), stdout=output, stderr=subprocess.STDOUT, text=True,
        )  # fmt: skip
    status = subprocess.Popen(
        [sys.executable, "-m", "volunteerd", "status"],
        env=cli_env(home), stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
    )  # fmt: skip
    # Whoever asks for the lock meanwhile (as a start would, every 10 ms) finds it held.
    holders: set[LockHolder | None] = set()
    taken: DataDirLock | None = None
    deadline = time.monotonic() + 180
    try:
        while not daemon.ready_file.exists() and daemon.process.poll() is None:
            assert time.monotonic() < deadline, daemon.log.read_text()
            holders.add(holder := lock_holder(lock_file))
            if holder is None and taken is None:
                taken = DataDirLock(lock_file).__enter__()  # pragma: no cover - the defect
            time.sleep(0.01)
    finally:
        if taken is not None:  # pragma: no cover - the defect
            taken.__exit__()
    assert daemon.process.poll() is None, f"the restarted daemon exited:\n{daemon.log.read_text()}"
    assert holders == {LockHolder(daemon.process.pid)}, holders

    assert second.wait(120) == ExitCode.UNAVAILABLE
    assert "another volunteerd is using" in second_log.read_text()
    _, said = status.communicate(timeout=60)
    if status.returncode != ExitCode.OK:  # asked before the restarted daemon answered
        assert status.returncode == ExitCode.UNAVAILABLE
        assert "volunteerd is starting or restarting" in said, said
        assert "not running" not in said
    again = json.loads(daemon.ready_file.read_text())
    assert again["peer_id"] == first["peer_id"]  # the same folder and identity
    assert again["pid"] == first["pid"] == daemon.process.pid  # and the same process
    assert lock_holder(lock_file) == LockHolder(daemon.process.pid)
    projects = run_cli(home, "projects")
    assert name in projects.stdout
    assert daemon.stop() == ExitCode.INTERRUPTED
