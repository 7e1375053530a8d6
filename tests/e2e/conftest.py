"""Run ``volunteerd`` as a real subprocess, as a user or a service manager would."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import pytest

# A test here starts real daemons: each imports torch and opens a libp2p host, and a
# daemon may be given up to `Proc.wait_ready`'s 180 s to do so. The suite's 120 s per
# test (pyproject.toml) is for tests in one process; beside busy processes a test that
# starts a daemon twice (a restart) ran past it while nothing was hung. Without a
# timeout mark of its own, such a test gets this one.
E2E_TIMEOUT_S = 400


def pytest_collection_modifyitems(items: list[pytest.Item]) -> None:
    here = Path(__file__).parent
    for item in items:
        if item.path.is_relative_to(here) and item.get_closest_marker("timeout") is None:
            item.add_marker(pytest.mark.timeout(E2E_TIMEOUT_S))


@dataclass
class Proc:
    process: subprocess.Popen[str]
    ready_file: Path
    log: Path

    def wait_ready(self, timeout_s: float = 180) -> dict:  # type: ignore[type-arg]
        # generous: on 2 loaded cores, four processes importing torch at once took 41 s
        # before one of them even listened (CI)
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            if self.ready_file.exists():
                return json.loads(self.ready_file.read_text())
            if self.process.poll() is not None:
                raise AssertionError(f"exited {self.process.returncode}:\n{self.log.read_text()}")
            time.sleep(0.05)
        raise AssertionError(f"not ready in {timeout_s}s:\n{self.log.read_text()}")

    def stop(self, sig: int = signal.SIGTERM, timeout_s: float = 90) -> int:
        # generous too: a daemon lowers itself to nice 10, and its graceful stop (1 s
        # on an idle machine) took over 15 s beside busy processes at nice 0
        if self.process.poll() is None:
            self.process.send_signal(sig)
        return self.process.wait(timeout_s)


def cli_env(home: Path) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if not k.startswith("VOLUNTEERD_")}
    env.update(
        VOLUNTEERD_CONFIG=str(home / "config.toml"),
        VOLUNTEERD_DATA_DIR=str(home / "data"),
        VOLUNTEERD_CACHE_DIR=str(home / "cache"),
        # any free port for the control API: several daemons run side by side
        VOLUNTEERD_CONTROL__PORT="0",
        PYTHONUNBUFFERED="1",
    )
    return env


def run_cli(home: Path, *args: str, timeout_s: float = 60) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-m", "volunteerd", *args],
        env=cli_env(home),
        capture_output=True,
        text=True,
        timeout=timeout_s,
        check=False,
    )


def publish(home: Path, manifest: Path, bootstrap: str) -> str:
    """``volunteerd publish MANIFEST`` as ``home``'s owner, through ``bootstrap`` (on
    127.0.0.1): the invitation line it prints."""
    published = run_cli(
        home, "publish", str(manifest), "--bootstrap", bootstrap,
        "--set", 'network.listen_host="127.0.0.1"',
    )  # fmt: skip
    assert published.returncode == 0, published.stderr
    (line,) = [x for x in published.stdout.splitlines() if x.startswith("volunteerd://join/")]
    return line


@pytest.fixture
def spawn(tmp_path: Path) -> Iterator:  # type: ignore[type-arg]
    procs: list[Proc] = []

    def start(name: str, *args: str, port: int = 0) -> Proc:
        home = tmp_path / name
        home.mkdir(exist_ok=True)
        ready = home / "ready.json"
        ready.unlink(missing_ok=True)  # a restart under the same name
        log = home / "log.txt"
        with log.open("w") as output:  # the child has its own copy of the descriptor
            process = subprocess.Popen(
                [
                    sys.executable,
                    "-m",
                    "volunteerd",
                    *args,
                    "--listen-host",
                    "127.0.0.1",
                    "--port",
                    str(port),
                    "--ready-file",
                    str(ready),
                ],
                env=cli_env(home),
                stdout=output,
                stderr=subprocess.STDOUT,
                text=True,
            )
        proc = Proc(process, ready, log)
        procs.append(proc)
        return proc

    yield start
    for proc in procs:
        if proc.process.poll() is None:
            proc.process.kill()
            proc.process.wait(10)
