"""A daemon stopped with a trainer connected binds its port again at once (issue 12,
item 6): its old connections linger in TIME-WAIT for a minute, and the port check
refused every restart until they were gone -- a restart loop to a service manager."""

from __future__ import annotations

import socket
from pathlib import Path

import pytest
import torch
import trio

from tests.e2e.conftest import run_cli
from volunteerd.errors import ExitCode
from volunteerd.experts import to_wire
from volunteerd.net import Verb
from volunteerd.net.peers import parse_peer_multiaddr
from volunteerd.testing import local_config, open_peer
from volunteerd.wire import ForwardRequest

# Each test starts volunteerd as a process (most, a daemon or a swarm of them).
pytestmark = pytest.mark.slow

SMALL = ["--set", "experts.hidden_dim=32", "--set", 'runtime.device="cpu"']
# The states a closed socket lingers in on the side that closed first: FIN-WAIT-1/2,
# CLOSING, TIME-WAIT. Any of them kept a plain bind from succeeding.
LINGERING = {"04", "05", "06", "0B"}


def free_port() -> int:
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        return int(probe.getsockname()[1])


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
    port = free_port()
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
    port = free_port()
    first = spawn("first", "serve", "--experts", "ffn.0.0", *SMALL, port=port)
    first.wait_ready()
    other = run_cli(
        tmp_path / "other", "serve", "--listen-host", "127.0.0.1", "--port", str(port), *SMALL
    )
    assert other.returncode == ExitCode.UNAVAILABLE
    assert f"cannot listen on 127.0.0.1:{port}" in other.stderr
    assert first.stop() == ExitCode.INTERRUPTED
