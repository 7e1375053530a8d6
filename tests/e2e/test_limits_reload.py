"""``volunteerd serve`` reloads its limits on SIGHUP, without a restart."""

from __future__ import annotations

import signal
import time
from collections.abc import Callable
from pathlib import Path

from tests.e2e.conftest import Proc

SMALL = ["--set", "experts.hidden_dim=32", "--set", 'runtime.device="cpu"']


def wait_for_log(proc: Proc, text: str, timeout_s: float = 30) -> None:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if text in proc.log.read_text():
            return
        time.sleep(0.1)
    raise AssertionError(f"{text!r} not logged in {timeout_s}s:\n{proc.log.read_text()}")


def test_sighup_applies_the_limits_file_and_keeps_serving(
    tmp_path: Path, spawn: Callable[..., Proc]
) -> None:
    server = spawn("server", "serve", "--experts", "ffn.0.0", *SMALL)
    server.wait_ready()
    limits = tmp_path / "server" / "limits.toml"  # next to VOLUNTEERD_CONFIG

    limits.write_text("[limits]\nupload_mbit = 3.0\nduty_cycle = 0.5\n")
    server.process.send_signal(signal.SIGHUP)
    wait_for_log(server, "'upload_mbit': 3.0")
    wait_for_log(server, "'duty_cycle': 0.5")

    limits.write_text("[limits]\nduty_cycle = 7\n")  # invalid: logged, nothing changes
    server.process.send_signal(signal.SIGHUP)
    wait_for_log(server, "configuration not reloaded")

    assert server.process.poll() is None
    assert server.stop() == 130
