"""``volunteerd demo --wan PROFILE``: the demo over emulated internet links.

Every process gets its own host of the WAN emulator (``volunteerd.testing.wan``): the
bootstrap node, each daemon, and the trainer. The trainer runs as ``volunteerd train``
inside its host — its node must dial and be dialled across the emulated links like the
others — on the demo's experiment written to a TOML file, and hands its summary back
as JSON. Network namespaces need root.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any, TextIO

from volunteerd.demo.local_swarm import (
    VOLUNTEERD,
    LocalSwarm,
    Placement,
    child_env,
    start_child,
    write_experiment,
)
from volunteerd.errors import ConfigError, ExitCode, VolunteerdError
from volunteerd.train import Experiment, TrainSummary

__all__ = ["WanPlacements", "open_placements", "train_in_host"]


class WanPlacements:
    """The emulated network's hosts as placements: ``bootstrap``, ``trainer`` and one per
    daemon, each with its namespace's name (for the commands the demo prints), then
    ``more_trainers``: one per further trainer (``demo --trainers N``)."""

    def __init__(self, wan: Any, daemons: int) -> None:
        hosts = list(wan.hosts)
        self.wan = wan
        self.namespaces = [str(h.namespace) for h in hosts]
        self.links = [
            f"{h.link.delay_ms:.0f} ms to the core, {h.link.down_mbit:g} down/"
            f"{h.link.up_mbit:g} up Mbit/s, {h.link.loss:.1%} loss"
            + ("" if h.link.nat == "none" else f", {h.link.nat} NAT")
            for h in hosts
        ]
        placements = [Placement(tuple(h.argv([])), str(h.address)) for h in hosts]
        self.bootstrap, self.trainer = placements[0], placements[1]
        self.daemons = placements[2 : 2 + daemons]
        self.more_trainers = placements[2 + daemons :]

    @property
    def swarm(self) -> list[Placement]:
        """Bootstrap first, then the daemons: ``LocalSwarm``'s order."""
        return [self.bootstrap, *self.daemons]

    def traffic(self) -> list[tuple[int, int]]:
        """Bytes each host sent and received so far (IP packets, headers included), in
        host order: bootstrap, trainer, daemons, further trainers."""
        return [(h.sent_bytes, h.received_bytes) for h in self.wan.stats()]


@contextmanager
def open_placements(
    profile: str, daemons: int, seed: int = 0, trainers: int = 1
) -> Iterator[WanPlacements]:
    """An emulated network of ``daemons + 1 + trainers`` hosts on ``profile`` (a
    profile's name or a TOML file): host 0 for the bootstrap node, host 1 for the
    trainer, then the daemons, then one host per further trainer.
    Every namespace and device is gone when the block is left, however it is left.

    Raises ConfigError (a message, not a traceback) without root or without what the
    emulator needs (network namespaces, TUN), and for an unknown or invalid profile."""
    from volunteerd.testing.wan import Profile, ProfileError, open_wan, wan_available

    if not (available := wan_available()):
        raise ConfigError(f"--wan cannot emulate a network here: {available.reason}")
    try:
        links = Profile.load(profile)
    except ProfileError as exc:
        raise ConfigError(f"--wan: {exc}") from None
    with open_wan(links, hosts=daemons + 1 + max(trainers, 1), seed=seed) as wan:
        yield WanPlacements(wan, daemons)


def dashboard_hint(swarm: LocalSwarm, placements: WanPlacements, out: TextIO) -> None:
    """The daemons' control APIs listen on 127.0.0.1 inside their own hosts, where no
    browser of this machine reaches them: say how to ask one instead."""
    node = swarm.daemons[0]
    namespace = placements.namespaces[2]
    print(
        f"  the daemons' dashboards listen inside their hosts; ask {node.name} with:\n"
        f"    sudo ip netns exec {namespace} {sys.executable} -m volunteerd status "
        f"--data-dir {node.data_dir}",
        file=out,
    )


def train_in_host(
    experiment: Experiment,
    placement: Placement,
    bootstrap: str,
    *,
    steps: int,
    workdir: Path,
    out: TextIO,
    stop: threading.Event,
) -> tuple[TrainSummary, int]:
    """Train with ``volunteerd train`` run at ``placement``; its output goes to ``out``.

    Setting ``stop`` sends the trainer SIGINT once: it stops after the current step and
    still reports. Returns the summary and the trainer's network namespace (its inode:
    the proof that it ran in a host of its own). Raises VolunteerdError if it fails."""
    home = workdir / "trainer"
    home.mkdir(parents=True, exist_ok=True)
    config = home / "experiment.toml"
    write_experiment(experiment, config)
    summary_path = home / "summary.json"
    command = [
        *placement.prefix, *VOLUNTEERD, "train",
        "--config", str(config), "--bootstrap", bootstrap, "--steps", str(steps),
        "--listen-host", placement.listen_host, "--summary-json", str(summary_path),
    ]  # fmt: skip
    process = start_child(command, child_env(home), subprocess.PIPE)
    copier = threading.Thread(target=_copy, args=(process, out), daemon=True)
    copier.start()
    namespace = 0
    interrupted = False
    try:
        while process.poll() is None:
            if not namespace:
                namespace = _netns(process.pid, before=placement.prefix)
            if stop.is_set() and not interrupted:
                interrupted = True
                process.send_signal(signal.SIGINT)
            time.sleep(0.05)
    finally:
        if process.poll() is None:
            process.kill()
            process.wait(10)
        copier.join(5)
    if process.returncode not in (ExitCode.OK, ExitCode.INTERRUPTED):
        raise VolunteerdError(f"the trainer exited with {process.returncode}")
    data = json.loads(summary_path.read_text())
    data["val_curve"] = [tuple(point) for point in data["val_curve"]]
    return TrainSummary(**data), namespace


def _copy(process: subprocess.Popen[bytes], out: TextIO) -> None:
    """The trainer's live progress, passed on as it comes (``\\r`` updates included)."""
    if process.stdout is None:
        return
    while chunk := os.read(process.stdout.fileno(), 4096):
        out.write(chunk.decode(errors="replace"))
        out.flush()


def _netns(pid: int, *, before: tuple[str, ...]) -> int:
    """The network namespace ``pid`` runs in once it has entered it (``ip netns exec``
    enters it before exec'ing the trainer); 0 while not yet known."""
    try:
        comm = Path(f"/proc/{pid}/comm").read_text().strip()
        if before and comm == Path(before[0]).name:
            return 0  # still the `ip` command, about to enter
        return os.stat(f"/proc/{pid}/ns/net").st_ino
    except OSError:
        return 0
