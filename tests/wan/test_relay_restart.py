"""A volunteer behind a symmetric NAT whose only relay restarts: what it announces
meanwhile. Before, it announced its private address at once (192.168.x, which nobody
can dial), and trainers that dialled it banned it as unreachable, for longer on each
restart (outside probe mini1: its experts were unused 52 s after the relay was back).
It keeps announcing its circuit, which works again once the relay takes it back."""

from __future__ import annotations

import dataclasses
import json
import subprocess
import sys
import time
from collections.abc import Iterator
from contextlib import ExitStack, contextmanager
from pathlib import Path
from typing import Any

import pytest

from volunteerd.demo.local_swarm import VOLUNTEERD, child_env
from volunteerd.testing.wan import LinkSpec, WanHost, open_wan, wan_available

pytestmark = [pytest.mark.slow, pytest.mark.timeout(300)]

_available = wan_available()
if not _available:
    pytest.skip(f"needs the WAN emulator: {_available.reason}", allow_module_level=True)

_START_S = 90.0
_LINK = LinkSpec(delay_ms=5.0, down_mbit=100.0, up_mbit=100.0)
_RELAY_PORT = 4001  # the same address after the restart, as a real relay's

_STATUS = r"""
import json, sys
from pathlib import Path
from volunteerd.control.client import ControlClient
print(ControlClient.for_data_dir(Path(sys.argv[1])).status().reachability.model_dump_json())
"""


@contextmanager
def _volunteerd(
    host: WanHost, home: Path, args: list[str], port: int = 0
) -> Iterator[tuple[subprocess.Popen[bytes], dict[str, Any]]]:
    """``volunteerd ARGS`` on ``host`` with its files under ``home`` (kept across
    starts: a restart keeps its identity); yields the process and its ready file."""
    home.mkdir(parents=True, exist_ok=True)
    ready = home / "ready.json"
    ready.unlink(missing_ok=True)
    command = [
        *VOLUNTEERD, *args,
        "--listen-host", host.address, "--port", str(port), "--ready-file", str(ready),
        "--set", 'logging.level="INFO"', "--set", "control.port=0",
    ]  # fmt: skip
    with (home / "log.txt").open("ab") as log:
        process = host.popen(command, env=child_env(home), stdout=log, stderr=subprocess.STDOUT)
    try:
        deadline = time.monotonic() + _START_S
        while not ready.exists():
            if process.poll() is not None or time.monotonic() > deadline:
                log_text = (home / "log.txt").read_text(errors="replace")[-3000:]
                pytest.fail(f"volunteerd {args[0]} did not start:\n{log_text}")
            time.sleep(0.1)
        yield process, json.loads(ready.read_text())
    finally:
        process.kill()
        process.wait(timeout=15)


def _reachability(host: WanHost, home: Path) -> dict[str, Any]:
    status = host.run(
        [sys.executable, "-c", _STATUS, str(home / "data")],
        env=child_env(home), capture_output=True, text=True, timeout=60, check=True,
    )  # fmt: skip
    report: dict[str, Any] = json.loads(status.stdout)
    return report


def _wait_for_mode(host: WanHost, home: Path, mode: str, within_s: float) -> dict[str, Any]:
    deadline = time.monotonic() + within_s
    while (report := _reachability(host, home))["mode"] != mode:
        if time.monotonic() > deadline:
            pytest.fail(f"still {report['mode']} after {within_s:.0f} s, not {mode}: {report}")
        time.sleep(1.0)
    return report


def test_a_natted_volunteer_keeps_announcing_its_circuit_while_its_relay_restarts(
    tmp_path: Path,
) -> None:
    links = [_LINK, dataclasses.replace(_LINK, nat="symmetric")]
    with open_wan(links, seed=5) as wan, ExitStack() as stack:
        relay, daemon_host = wan.hosts
        home = tmp_path / "daemon"
        first = stack.enter_context(
            _volunteerd(relay, tmp_path / "relay", ["bootstrap"], _RELAY_PORT)
        )
        bootstrap = next(a for a in first[1]["multiaddrs"] if relay.public_address in a)
        serve = [
            "serve", "--experts", "ffn.0.0", "--bootstrap", bootstrap,
            "--set", "experts.hidden_dim=16", "--set", 'runtime.device="cpu"',
        ]  # fmt: skip
        stack.enter_context(_volunteerd(daemon_host, home, serve))
        circuit = _wait_for_mode(daemon_host, home, "relayed", 60)["addrs"]
        assert circuit
        assert all("/p2p-circuit" in a for a in circuit)

        first[0].kill()  # the relay crashes
        first[0].wait(timeout=15)
        down = _wait_for_mode(daemon_host, home, "unreachable", 60)
        assert down["addrs"] == circuit  # not its private address behind the NAT

        with _volunteerd(relay, tmp_path / "relay", ["bootstrap"], _RELAY_PORT):
            back = _wait_for_mode(daemon_host, home, "relayed", 120)
            assert back["addrs"] == circuit
