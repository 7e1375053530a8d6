"""A daemon under a low open-file limit: idle strangers neither keep an honest peer out
for good nor make it run out of files and stop.

Under ``ulimit -n 256`` (macOS's default) 300 strangers from loopback, each after one
DHT find, held their connections: the daemon's open files reached the limit and stayed
there (``network.max_connections`` was 1,000 and idle trimming began past half of 900
inbound slots), newcomers were refused, and the checkpointer's next listing of its
folder raised EMFILE and stopped the daemon (exit 5). Here the limit is 96, soft and hard
(so the daemon cannot raise it): 32 connections at most, 24 inbound slots, trimmed to
12 once idle for ``timeouts.connection_idle_s``.
"""

from __future__ import annotations

import signal
import subprocess
import sys
from pathlib import Path

import pytest
import trio

from tests.e2e.conftest import Proc, cli_env
from volunteerd.errors import ExitCode
from volunteerd.net import Verb
from volunteerd.net.peers import PeerAddress, parse_peer_multiaddr
from volunteerd.net.records import FindRequest
from volunteerd.testing import local_config
from volunteerd.testing.clients import open_bare_client

resource = pytest.importorskip("resource")

pytestmark = [
    pytest.mark.slow,
    pytest.mark.skipif(sys.platform == "win32", reason="no RLIMIT_NOFILE"),
]

LIMIT = 96
STRANGERS = 100  # more than the files left after the daemon's own ~20
CONFIG = local_config(timeouts={"connect_s": 5, "request_s": 10})


def start_limited(home: Path) -> Proc:
    """``volunteerd serve`` hosting two experts, its open files limited to ``LIMIT``,
    saving checkpoints every second; a folder of an expert it does not host is there
    to be trimmed at every round."""
    (home / "data" / "checkpoints" / "ffn.9.9").mkdir(parents=True)
    ready, log = home / "ready.json", home / "log.txt"
    with log.open("w") as output:
        process = subprocess.Popen(
            [
                sys.executable, "-m", "volunteerd", "serve",
                "--experts", "ffn.0.[0:2]",
                "--set", "experts.hidden_dim=16",
                "--set", 'runtime.device="cpu"',
                "--set", "checkpoints.every_s=1",
                "--set", "timeouts.connection_idle_s=1",
                "--listen-host", "127.0.0.1", "--port", "0",
                "--ready-file", str(ready),
            ],
            env=cli_env(home),
            stdout=output,
            stderr=subprocess.STDOUT,
            text=True,
            preexec_fn=lambda: resource.setrlimit(resource.RLIMIT_NOFILE, (LIMIT, LIMIT)),
        )  # fmt: skip
    return Proc(process, ready, log)


async def find(server: PeerAddress) -> None:
    async with open_bare_client(CONFIG) as client:
        await client.call(server, Verb.DHT_FIND, FindRequest(keys=["ffn."]))


async def test_idle_strangers_under_a_low_file_limit_neither_shut_out_nor_stop_the_daemon(
    tmp_path: Path,
) -> None:
    daemon = start_limited(tmp_path)
    try:
        ready = daemon.wait_ready()
        server = parse_peer_multiaddr(ready["multiaddrs"][0])
        held, refused, release = 0, 0, trio.Event()

        async def idle_stranger() -> None:
            nonlocal held, refused
            try:
                async with open_bare_client(CONFIG) as client:
                    await client.connect(server)
                    held += 1
                    await release.wait()
            except Exception:  # refused: the daemon's slots are full
                refused += 1

        async with trio.open_nursery() as nursery:
            for _ in range(STRANGERS):
                nursery.start_soon(idle_stranger)
            with trio.fail_after(120):  # each connected, or refused
                while held + refused < STRANGERS:  # noqa: ASYNC110 - counting tasks
                    await trio.sleep(0.1)
            assert held >= 24, held  # every inbound slot was taken
            # An honest peer gets in once the idle ones are trimmed (every 5 s).
            with trio.fail_after(60):
                while True:
                    try:
                        await find(server)
                        break
                    except Exception:  # refused while the slots are full
                        assert daemon.process.poll() is None, daemon.log.read_text()[-3000:]
                        await trio.sleep(0.5)
            await trio.sleep(2.5)  # more checkpoint rounds, strangers still there
            assert daemon.process.poll() is None, daemon.log.read_text()[-3000:]
            release.set()
        assert daemon.stop(signal.SIGTERM) == ExitCode.INTERRUPTED
    finally:
        if daemon.process.poll() is None:
            daemon.process.kill()
            daemon.process.wait(10)
    log = daemon.log.read_text()
    assert f"open files: at most {LIMIT}, hard limit {LIMIT}" in log
    assert "at most 32 connections, not network.max_connections (1000)" in log
    assert "Too many open files" not in log
