"""``volunteerd serve`` reloads its limits on SIGHUP, without a restart, and says so in
its events."""

from __future__ import annotations

import signal
import time
from collections.abc import Callable
from pathlib import Path

import pytest

from tests.e2e.conftest import Proc
from volunteerd.control.client import ControlClient

# Each test starts volunteerd as a process (most, a daemon or a swarm of them).
pytestmark = pytest.mark.slow

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
    limits = tmp_path / "server" / "data" / "limits.toml"  # in VOLUNTEERD_DATA_DIR
    api = ControlClient.for_data_dir(tmp_path / "server" / "data")
    since = api.events(0).next

    limits.write_text("[limits]\nupload_mbit = 3.0\nduty_cycle = 0.5\n")
    server.process.send_signal(signal.SIGHUP)
    wait_for_log(server, "'upload_mbit': 3.0")
    wait_for_log(server, "'duty_cycle': 0.5")
    # posted as the limits are applied, in the same turn as the log line above
    got = api.events(since)
    assert [(e.kind, e.message) for e in got.events] == [
        (
            "limits",
            "upload limit set to 3 Mbit/s, duty cycle set to 50 % (reloaded from the config file)",
        )
    ]

    limits.write_text("[limits]\nduty_cycle = 7\n")  # invalid: logged, nothing changes
    server.process.send_signal(signal.SIGHUP)
    wait_for_log(server, "configuration not reloaded")
    (error,) = api.events(got.next).events
    assert error.kind == "error"
    assert "duty_cycle" in error.message

    # issue 12: TOML's inf was taken, and every later status reply failed on it
    limits.write_text("[limits]\nupload_mbit = inf\nmonthly_quota_gb = 1e300\n")
    server.process.send_signal(signal.SIGHUP)
    wait_for_log(server, "limits.upload_mbit = inf: Input should be a finite number")
    assert "limits.monthly_quota_gb = 1e+300" in server.log.read_text()

    # tomllib's errors other than TOMLDecodeError stopped the daemon
    limits.write_text("[limits]\nupload_mbit = 1" + "0" * 5000 + "\n")
    server.process.send_signal(signal.SIGHUP)
    wait_for_log(server, "limits.toml: not valid TOML: Exceeds the limit (4300 digits)")
    limits.write_text("[limits]\nupload_mbit = " + "[" * 3000 + "]" * 3000 + "\n")
    server.process.send_signal(signal.SIGHUP)
    wait_for_log(server, "limits.toml: not valid TOML: nested too deeply")

    assert server.process.poll() is None
    kept = api.limits()  # the API answers, with the limits of the last good reload
    assert (kept.upload_mbit, kept.duty_cycle, kept.monthly_quota_gb) == (3.0, 0.5, 0.0)
    assert api.status().limits.upload_mbit == 3.0
    assert server.stop() == 130
