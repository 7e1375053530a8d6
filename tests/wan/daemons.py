"""volunteerd processes on the emulated hosts, for the WAN tests: start one and wait
until it is ready; read its reachability through its control API (what the
dashboard's panel shows)."""

from __future__ import annotations

import json
import subprocess
import sys
import time
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import pytest

from volunteerd.demo.local_swarm import VOLUNTEERD, child_env
from volunteerd.testing.wan import WanHost

START_S = 90.0  # a process starting on a busy machine, inside a namespace

_STATUS = r"""
import sys
from pathlib import Path
from volunteerd.control.client import ControlClient
print(ControlClient.for_data_dir(Path(sys.argv[1])).status().reachability.model_dump_json())
"""


@contextmanager
def volunteerd_on(
    host: WanHost, home: Path, args: list[str], *, listen_host: str | None = None, port: int = 0
) -> Iterator[tuple[subprocess.Popen[bytes], dict[str, Any]]]:
    """``volunteerd ARGS`` on ``host`` with its files under ``home`` (kept across
    starts: a restart keeps its identity); yields the process and its ready file."""
    home.mkdir(parents=True, exist_ok=True)
    ready = home / "ready.json"
    ready.unlink(missing_ok=True)
    command = [
        *VOLUNTEERD, *args,
        "--listen-host", listen_host or host.address, "--port", str(port),
        "--ready-file", str(ready),
        "--set", 'logging.level="INFO"', "--set", "control.port=0",
    ]  # fmt: skip
    with (home / "log.txt").open("ab") as log:
        process = host.popen(command, env=child_env(home), stdout=log, stderr=subprocess.STDOUT)
    try:
        deadline = time.monotonic() + START_S
        while not ready.exists():
            if process.poll() is not None or time.monotonic() > deadline:
                log_text = (home / "log.txt").read_text(errors="replace")[-3000:]
                pytest.fail(f"volunteerd {args[0]} did not start:\n{log_text}")
            time.sleep(0.1)
        yield process, json.loads(ready.read_text())
    finally:
        process.terminate()
        try:
            process.wait(timeout=15)
        except subprocess.TimeoutExpired:
            process.kill()
            process.wait(timeout=15)


def reachability(host: WanHost, home: Path) -> dict[str, Any]:
    """The reachability the daemon whose files are under ``home`` reports now."""
    status = host.run(
        [sys.executable, "-c", _STATUS, str(home / "data")],
        env=child_env(home), capture_output=True, text=True, timeout=60, check=True,
    )  # fmt: skip
    report: dict[str, Any] = json.loads(status.stdout)
    return report
