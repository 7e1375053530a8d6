"""A volunteer behind a symmetric NAT whose only relay restarts: what it announces
meanwhile. Before, it announced its private address at once (192.168.x, which nobody
can dial), and trainers that dialled it banned it as unreachable, for longer on each
restart (outside probe mini1: its experts were unused 52 s after the relay was back).
It keeps announcing its circuit, which works again once the relay takes it back."""

from __future__ import annotations

import dataclasses
import time
from contextlib import ExitStack
from pathlib import Path
from typing import Any

import pytest

from tests.wan.daemons import reachability, volunteerd_on
from volunteerd.testing.wan import LinkSpec, WanHost, open_wan, wan_available

pytestmark = [pytest.mark.slow, pytest.mark.timeout(300)]

_available = wan_available()
if not _available:
    pytest.skip(f"needs the WAN emulator: {_available.reason}", allow_module_level=True)

_LINK = LinkSpec(delay_ms=5.0, down_mbit=100.0, up_mbit=100.0)
_RELAY_PORT = 4001  # the same address after the restart, as a real relay's


def _wait_for_mode(host: WanHost, home: Path, mode: str, within_s: float) -> dict[str, Any]:
    deadline = time.monotonic() + within_s
    while (report := reachability(host, home))["mode"] != mode:
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
            volunteerd_on(relay, tmp_path / "relay", ["bootstrap"], port=_RELAY_PORT)
        )
        bootstrap = next(a for a in first[1]["multiaddrs"] if relay.public_address in a)
        serve = [
            "serve", "--experts", "ffn.0.0", "--bootstrap", bootstrap,
            "--set", "experts.hidden_dim=16", "--set", 'runtime.device="cpu"',
        ]  # fmt: skip
        stack.enter_context(volunteerd_on(daemon_host, home, serve))
        circuit = _wait_for_mode(daemon_host, home, "relayed", 60)["addrs"]
        assert circuit
        assert all("/p2p-circuit" in a for a in circuit)

        first[0].kill()  # the relay crashes
        first[0].wait(timeout=15)
        down = _wait_for_mode(daemon_host, home, "unreachable", 60)
        assert down["addrs"] == circuit  # not its private address behind the NAT

        with volunteerd_on(relay, tmp_path / "relay", ["bootstrap"], port=_RELAY_PORT):
            back = _wait_for_mode(daemon_host, home, "relayed", 120)
            assert back["addrs"] == circuit
