"""A local swarm on this machine: one bootstrap node and several daemons, each its own
``volunteerd`` process, hosting the experiment's experts between them.

Where each process runs is its ``Placement``: by default on 127.0.0.1; ``volunteerd
demo --wan`` places each in its own host of the WAN emulator (a command prefix that
enters the host's network namespace, and the host's address to listen on).

``LocalSwarm`` is a context manager. Leaving it — normally, on an error or on Ctrl-C —
stops every process it started: SIGTERM first (they withdraw their experts and exit),
SIGKILL for any still running after a few seconds. On Linux the children are also told
to die with their parent, should the parent itself be killed.

Every process runs ``VOLUNTEERD``: this interpreter with ``-P``, and ``child_env`` puts
the folder this process imported ``volunteerd`` from first on ``PYTHONPATH``, so a child
runs the same code as its parent wherever it is started (``python -m`` alone takes a
``volunteerd`` folder in the working folder first: a demo started from another checkout,
or a benchmark comparing an earlier commit's worktree, ran the wrong code).

``start_trainer`` runs one more trainer of an experiment as a ``volunteerd train``
process (``volunteerd demo --trainers N``, the trainers benchmark and tests): its output
goes to a log file, its summary to a JSON file when it ends.
"""

from __future__ import annotations

import ctypes
import json
import logging
import os
import re
import signal
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from types import TracebackType
from typing import Any

import tomli_w

from volunteerd.errors import Interrupted, VolunteerdError
from volunteerd.train.experiment import Experiment

__all__ = [
    "LOOPBACK",
    "VOLUNTEERD",
    "LocalSwarm",
    "Placement",
    "SwarmNode",
    "TrainerProcess",
    "child_env",
    "importing_this_package",
    "start_child",
    "start_trainer",
    "stop_trainers",
    "wait_trainers",
    "write_experiment",
]

logger = logging.getLogger(__name__)

# How a swarm process runs volunteerd (see the module's docstring).
VOLUNTEERD = (sys.executable, "-P", "-m", "volunteerd")
# The folder holding the package this process runs.
_IMPORTED_FROM = str(Path(__file__).resolve().parents[2])


@dataclass(frozen=True, slots=True)
class Placement:
    """Where one process runs: ``prefix`` goes before its command line (``ip netns exec
    NS`` runs it inside an emulated host) and it listens on ``listen_host``."""

    prefix: tuple[str, ...] = ()
    listen_host: str = "127.0.0.1"


LOOPBACK = Placement()


@dataclass
class SwarmNode:
    name: str
    process: subprocess.Popen[bytes]
    ready_file: Path
    log_file: Path
    peer_id: str = ""
    multiaddrs: tuple[str, ...] = ()
    experts: str = ""
    args: tuple[str, ...] = ()
    control_url: str = ""  # its control API and dashboard (daemons only)
    placement: Placement = LOOPBACK

    @property
    def data_dir(self) -> Path:
        return self.ready_file.parent / "data"


def _rows(rows: int, nodes: int, index: int) -> range:
    """Node ``index``'s share of ``rows`` rows split as evenly as possible."""
    per, extra = divmod(rows, nodes)
    start = index * per + min(index, extra)
    return range(start, start + per + (1 if index < extra else 0))


def _die_with_parent() -> None:  # pragma: no cover - runs in the child before exec
    try:
        libc = ctypes.CDLL("libc.so.6", use_errno=True)
        libc.prctl(1, signal.SIGTERM)  # PR_SET_PDEATHSIG
    except OSError:
        pass


def importing_this_package(env: dict[str, str]) -> dict[str, str]:
    """``env`` with the folder this process imported ``volunteerd`` from first on
    ``PYTHONPATH``: a child run as ``VOLUNTEERD`` imports the same code."""
    rest = [env["PYTHONPATH"]] if env.get("PYTHONPATH") else []
    return {**env, "PYTHONPATH": os.pathsep.join([_IMPORTED_FROM, *rest])}


def child_env(home: Path) -> dict[str, str]:
    """The environment of a swarm process whose files all live under ``home``, which
    imports the ``volunteerd`` this process imported (run it as ``VOLUNTEERD``)."""
    env = importing_this_package(
        {k: v for k, v in os.environ.items() if not k.startswith("VOLUNTEERD_")}
    )
    env.update(
        VOLUNTEERD_DATA_DIR=str(home / "data"),
        VOLUNTEERD_CONFIG=str(home / "config.toml"),
        VOLUNTEERD_CACHE_DIR=str(home / "cache"),
        PYTHONUNBUFFERED="1",
        OMP_NUM_THREADS="1",
    )
    return env


def start_child(command: list[str], env: dict[str, str], out: Any) -> subprocess.Popen[bytes]:
    """Start one process of the swarm, its stdout and stderr both to ``out``."""
    return subprocess.Popen(
        command,
        env=env,
        stdout=out,
        stderr=subprocess.STDOUT,
        stdin=subprocess.DEVNULL,
        # Ctrl-C reaches the demo, which stops its children itself, in order.
        start_new_session=True,
        preexec_fn=_die_with_parent if sys.platform.startswith("linux") else None,
    )


class LocalSwarm:
    """``node_experts[i]`` is the expert pattern daemon ``i`` hosts; every daemon gets
    ``settings`` (``section.key=value`` overrides) too. ``placements`` says where the
    bootstrap node (first) and each daemon (then, in order) run; loopback if not given."""

    def __init__(
        self,
        node_experts: list[str],
        settings: list[str],
        *,
        workdir: Path | None = None,
        start_timeout_s: float = 120.0,
        stop: threading.Event | None = None,
        placements: Sequence[Placement] = (),
    ) -> None:
        self.node_experts = node_experts
        self.placements = list(placements)
        self.stop_requested = stop or threading.Event()
        self.settings = settings
        self.start_timeout_s = start_timeout_s
        self._tmp: tempfile.TemporaryDirectory[str] | None = None
        self._workdir = workdir
        self.bootstrap: SwarmNode | None = None
        self.daemons: list[SwarmNode] = []

    @property
    def bootstrap_addrs(self) -> list[str]:
        return list(self.bootstrap.multiaddrs) if self.bootstrap else []

    def names(self) -> dict[str, str]:
        """peer id -> node name, for reports."""
        return {d.peer_id: d.name for d in self.daemons}

    def __enter__(self) -> LocalSwarm:
        try:
            self.start()
        except BaseException:
            self.stop()
            raise
        return self

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        self.stop()

    @classmethod
    def for_experiment(
        cls,
        experiment: Experiment,
        nodes: int = 3,
        stop: threading.Event | None = None,
        *,
        replication: int = 1,
        settings: Sequence[str] = (),
        placements: Sequence[Placement] = (),
    ) -> LocalSwarm:
        """Daemons hosting whole rows of every layer's grid, with the experiment's
        expert width and optimizer. With ``replication`` r > 1 every row of every layer
        is hosted by r different daemons (neighbours in a ring, so that no two daemons
        host exactly the same set)."""
        m = experiment.model
        if replication == 1:
            if not 1 <= nodes <= m.grid[0]:
                raise VolunteerdError(
                    f"--nodes must be between 1 and {m.grid[0]} (the grid's first dimension: "
                    "each node hosts whole rows of every layer)"
                )
            patterns = [
                ",".join(
                    m.expert_pattern(b, _rows(m.grid[0], nodes, i)) for b in range(m.num_blocks)
                )
                for i in range(nodes)
            ]
        else:
            units = [(b, r) for b in range(m.num_blocks) for r in range(m.grid[0])]
            if not replication <= nodes <= len(units) * replication:
                raise VolunteerdError(
                    f"{nodes} nodes cannot host {len(units)} rows {replication} times each"
                )
            hosted: list[list[str]] = [[] for _ in range(nodes)]
            for i, (b, r) in enumerate(units):
                for j in range(replication):
                    hosted[(i + j) % nodes].append(m.expert_pattern(b, range(r, r + 1)))
            patterns = [",".join(h) for h in hosted]
        opt = experiment.experts
        defaults = [
            f"experts.hidden_dim={m.hidden_dim}",
            f'experts.optimizer.name="{opt.name}"',
            f"experts.optimizer.lr={opt.lr}",
            "runtime.torch_threads=1",
        ]
        return cls(patterns, [*defaults, *settings], stop=stop, placements=placements)

    def _placement(self, index: int) -> Placement:
        """Process ``index``'s placement: 0 is the bootstrap node, i the i-th daemon."""
        return self.placements[index] if index < len(self.placements) else LOOPBACK

    def start(self) -> None:
        if self._workdir is None:
            self._tmp = tempfile.TemporaryDirectory(prefix="volunteerd-demo-")
            self._workdir = Path(self._tmp.name)
        self.bootstrap = self._spawn("bootstrap", ["bootstrap"], self._placement(0))
        self._wait(self.bootstrap)
        defaults = [
            'runtime.device="cpu"',
            "dht.announce_period_s=3",
            "dht.record_ttl_s=8",
            "control.port=0",  # several daemons on one machine: any free port each
        ]
        for i, pattern in enumerate(self.node_experts):
            args = ["serve", "--experts", pattern, "--bootstrap", self.bootstrap_addrs[0]]
            for setting in [*defaults, *self.settings]:
                args += ["--set", setting]
            node = self._spawn(f"node{i + 1}", args, self._placement(i + 1))
            node.experts = pattern
            self.daemons.append(node)
        for node in self.daemons:
            self._wait(node)

    def _spawn(
        self, name: str, args: list[str], placement: Placement, *, append_log: bool = False
    ) -> SwarmNode:
        if self._workdir is None:
            raise VolunteerdError("the swarm is not started")
        home = self._workdir / name
        home.mkdir(parents=True, exist_ok=True)
        ready = home / "ready.json"
        log = home / "log.txt"
        command = [
            *placement.prefix, *VOLUNTEERD, *args,
            "--listen-host", placement.listen_host, "--port", "0", "--ready-file", str(ready),
            "--set", 'logging.level="WARNING"',
        ]  # fmt: skip
        with log.open("ab" if append_log else "wb") as out:
            process = start_child(command, child_env(home), out)
        logger.debug("started %s (pid %d)", name, process.pid)
        return SwarmNode(name, process, ready, log, args=tuple(args), placement=placement)

    def _wait(self, node: SwarmNode) -> None:
        deadline = time.monotonic() + self.start_timeout_s
        while not node.ready_file.exists():
            if node.process.poll() is not None:
                raise VolunteerdError(
                    f"{node.name} exited with {node.process.returncode}:\n"
                    + node.log_file.read_text(errors="replace")[-2000:]
                )
            if time.monotonic() > deadline:
                raise VolunteerdError(f"{node.name} did not start in {self.start_timeout_s}s")
            if self.stop_requested.is_set():
                raise Interrupted("stopped while the swarm was starting")
            time.sleep(0.05)
        info = json.loads(node.ready_file.read_text())
        node.peer_id = info["peer_id"]
        node.multiaddrs = tuple(info["multiaddrs"])
        node.control_url = info.get("control_url") or ""

    def stop(self, grace_s: float = 8.0) -> None:
        """Stop every process: daemons first (they withdraw), then the bootstrap node."""
        for group in (self.daemons, [self.bootstrap] if self.bootstrap else []):
            for node in group:
                if node.process.poll() is None:
                    node.process.send_signal(signal.SIGTERM)
            deadline = time.monotonic() + grace_s
            for node in group:
                try:
                    node.process.wait(max(0.1, deadline - time.monotonic()))
                except subprocess.TimeoutExpired:
                    logger.warning("%s did not stop in %.0fs; killing it", node.name, grace_s)
                    node.process.kill()
                    node.process.wait(5)
        if self._tmp is not None:
            self._tmp.cleanup()
            self._tmp = None

    def kill(self, index: int) -> SwarmNode:
        """SIGKILL daemon ``index`` (for demonstrations of fault tolerance)."""
        node = self.daemons[index]
        node.process.kill()
        node.process.wait(10)
        return node

    def restart(self, index: int, *, wait: bool = True) -> SwarmNode:
        """Start daemon ``index`` again on its own data folder (same identity, its own
        checkpoints), after it was killed or stopped."""
        old = self.daemons[index]
        if old.process.poll() is None:
            raise VolunteerdError(f"{old.name} is still running")
        old.ready_file.unlink(missing_ok=True)
        with old.log_file.open("ab") as log:
            log.write(b"\n--- restarted ---\n")
        node = self._spawn(old.name, list(old.args), old.placement, append_log=True)
        node.experts = old.experts
        self.daemons[index] = node
        if wait:
            self._wait(node)
        return node


def write_experiment(experiment: Experiment, path: Path) -> Path:
    """``experiment`` as the TOML file ``volunteerd train --config`` reads (keys left
    unset, None, are left out: TOML has no null)."""
    path.write_text(tomli_w.dumps(experiment.model_dump(mode="json", exclude_none=True)))
    return path


_STEP_LINE = re.compile(rb"step +(\d+)/\d+ ")


@dataclass
class TrainerProcess:
    """One ``volunteerd train`` process. ``started_at`` is when it was started
    (``time.time()``); its summary is in ``summary_file`` once it has ended (not if it
    was killed)."""

    name: str
    process: subprocess.Popen[bytes]
    log_file: Path
    summary_file: Path
    started_at: float

    def summary(self) -> dict[str, Any]:
        """Its summary JSON; raises VolunteerdError (with the log's end) if it has none."""
        try:
            return dict(json.loads(self.summary_file.read_text()))
        except (OSError, ValueError):
            tail = self.log_file.read_text(errors="replace")[-3000:]
            raise VolunteerdError(
                f"{self.name} exited with {self.process.returncode} and no summary:\n{tail}"
            ) from None

    def steps_done(self) -> int:
        """The last step its progress bar reported (0 before the first)."""
        try:
            found = _STEP_LINE.findall(self.log_file.read_bytes())
        except OSError:
            return 0
        return int(found[-1]) if found else 0


def start_trainer(
    name: str,
    config: Path,
    bootstrap: str,
    *,
    steps: int,
    workdir: Path,
    placement: Placement = LOOPBACK,
) -> TrainerProcess:
    """Start ``volunteerd train --config config`` joining through ``bootstrap``, its files
    under ``workdir/name``. It is told to die with this process, and ignores Ctrl-C
    meant for this one (``stop_trainers`` stops it)."""
    home = workdir / name
    home.mkdir(parents=True, exist_ok=True)
    log = home / "log.txt"
    summary = home / "summary.json"
    summary.unlink(missing_ok=True)
    command = [
        *placement.prefix, *VOLUNTEERD, "train",
        "--config", str(config), "--bootstrap", bootstrap, "--steps", str(steps),
        "--listen-host", placement.listen_host, "--summary-json", str(summary),
    ]  # fmt: skip
    with log.open("wb") as out:
        process = start_child(command, child_env(home), out)
    return TrainerProcess(name, process, log, summary, time.time())


def wait_trainers(
    trainers: Sequence[TrainerProcess],
    stop: threading.Event | None = None,
    timeout_s: float | None = None,
) -> None:
    """Wait until every trainer has ended. Once ``stop`` is set each still running is
    sent SIGINT (it stops after its current step and still writes its summary).
    Raises VolunteerdError after ``timeout_s``."""
    deadline = None if timeout_s is None else time.monotonic() + timeout_s
    interrupted = False
    while any(t.process.poll() is None for t in trainers):
        if stop is not None and stop.is_set() and not interrupted:
            interrupted = True
            for t in trainers:
                if t.process.poll() is None:
                    t.process.send_signal(signal.SIGINT)
        if deadline is not None and time.monotonic() > deadline:
            raise VolunteerdError(f"the trainers did not end in {timeout_s:.0f}s")
        time.sleep(0.1)


def stop_trainers(trainers: Sequence[TrainerProcess], grace_s: float = 30.0) -> None:
    """Stop every trainer still running: SIGINT (it stops after the current step),
    SIGKILL after ``grace_s``."""
    running = [t for t in trainers if t.process.poll() is None]
    for t in running:
        t.process.send_signal(signal.SIGINT)
    deadline = time.monotonic() + grace_s
    for t in running:
        try:
            t.process.wait(max(0.1, deadline - time.monotonic()))
        except subprocess.TimeoutExpired:
            logger.warning("%s did not stop in %.0fs; killing it", t.name, grace_s)
            t.process.kill()
            t.process.wait(10)
