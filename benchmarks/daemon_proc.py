"""One ``volunteerd serve`` (or ``bootstrap``) process for benchmarks: its own temporary
data folder, 127.0.0.1, any free ports, ``experts`` ffn experts of ``hidden``; stopped
with SIGTERM.
Also reads its CPU time from /proc (Linux)."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import tempfile
import time
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from volunteerd.demo.local_swarm import VOLUNTEERD, importing_this_package


@dataclass
class DaemonProc:
    process: subprocess.Popen[bytes]
    data_dir: Path
    info: dict[str, Any]  # the ready file: peer_id, multiaddrs, pid, control_url
    startup_s: float


@contextmanager
def daemon_process(experts: int, hidden: int) -> Iterator[DaemonProc]:
    with volunteerd_process(
        "serve", "--experts", f"ffn.0.[0:{experts}]",
        "--set", f"experts.hidden_dim={hidden}", "--set", 'runtime.device="cpu"',
    ) as daemon:  # fmt: skip
        yield daemon


@contextmanager
def volunteerd_process(*args: str) -> Iterator[DaemonProc]:
    """``volunteerd ARGS`` (serve, bootstrap) on 127.0.0.1, any free port, until ready."""
    with tempfile.TemporaryDirectory() as tmp:
        ready = Path(tmp) / "ready.json"
        # The code this process imported, wherever it is started from (a worktree of an
        # earlier commit, for a comparison): see ``VOLUNTEERD``.
        env = importing_this_package(
            {
                **os.environ,
                "VOLUNTEERD_DATA_DIR": tmp,
                "VOLUNTEERD_CONFIG": f"{tmp}/none.toml",
                "VOLUNTEERD_CONTROL__PORT": "0",
            }
        )
        cmd = [
            *VOLUNTEERD, *args,
            "--listen-host", "127.0.0.1", "--port", "0", "--ready-file", str(ready),
            "--set", 'logging.level="WARNING"',
        ]  # fmt: skip
        started = time.monotonic()
        proc = subprocess.Popen(cmd, env=env, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE)
        try:
            while not ready.exists():
                if proc.poll() is not None:
                    raise SystemExit(proc.stderr.read().decode() if proc.stderr else "failed")
                time.sleep(0.05)
            startup_s = time.monotonic() - started
            yield DaemonProc(proc, Path(tmp), json.loads(ready.read_text()), startup_s)
        finally:
            proc.send_signal(signal.SIGTERM)
            proc.wait(30)


def cpu_seconds(pid: int) -> float:
    """User + system CPU time of ``pid`` so far."""
    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")
