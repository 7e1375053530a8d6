"""``volunteerd demo``: the whole system on one machine, in a few minutes.

Starts a local swarm (a bootstrap node and ``nodes`` daemons, separate processes on
127.0.0.1, each hosting whole rows of every layer's expert grid), then trains the
embedded default experiment — a small character-level transformer whose feed-forward
layers are mixtures of the swarm's experts — on the source of Python's standard
library, with a held-out split. ``--local`` trains the same model with the same
experts as ordinary local modules instead: the non-distributed baseline. ``--wan
PROFILE`` runs every process in its own host of the WAN emulator (``demo/wan.py``).
"""

from __future__ import annotations

import json
import logging
import os
import sys
import tempfile
import threading
import time
from pathlib import Path
from typing import Any, TextIO

import torch

from volunteerd.atomic import write_atomic
from volunteerd.config import Config
from volunteerd.control.client import ControlClient
from volunteerd.demo.local_swarm import (
    LocalSwarm,
    SwarmNode,
    TrainerProcess,
    start_trainer,
    stop_trainers,
    wait_trainers,
    write_experiment,
)
from volunteerd.errors import ConfigError, ControlError, VolunteerdError
from volunteerd.moe import SwarmClient
from volunteerd.train import (
    Experiment,
    Progress,
    Trainer,
    TrainSummary,
    build_model,
    load_corpus,
    start_averaging,
)
from volunteerd.train.state import TrainerStateFolder
from volunteerd.uids import expand_pattern

__all__ = ["run_demo", "run_training", "trainer_config"]

logger = logging.getLogger(__name__)


def trainer_config(bootstrap: list[str], *, listen_host: str = "0.0.0.0") -> Config:
    """The trainer's own node: any free port, server-mode DHT. ``volunteerd train``
    listens on every interface (peers of a real swarm dial it for DHT traffic); the
    demo's swarm is all on this machine, so it passes 127.0.0.1."""
    return Config.model_validate(
        {
            "network": {"listen_host": listen_host, "port": 0, "bootstrap_peers": bootstrap},
            "timeouts": {"request_s": 30},
        }
    )


def run_training(
    experiment: Experiment,
    *,
    client: SwarmClient | None,
    steps: int,
    out: TextIO,
    stop: threading.Event | None = None,
    state: TrainerStateFolder | None = None,
) -> TrainSummary:
    """Train ``experiment`` on the swarm of ``client`` (local experts when None);
    ``state``: the locked folder of the trainer's own state (None: keep none)."""
    corpus = load_corpus(experiment.data)
    torch.manual_seed(experiment.training.seed)
    model = build_model(experiment, client)
    print(
        f"data: {len(corpus.train) / 1e6:.1f} MB of {corpus.source} for training, "
        f"{len(corpus.val) / 1e6:.2f} MB held out ({corpus.files} files); "
        f"a model that ignores context scores {corpus.unigram_loss():.3f}",
        file=out,
    )
    m = experiment.model
    print(
        f"model: {m.num_blocks} blocks of attention + a mixture of "
        f"{'x'.join(map(str, m.grid))} ffn experts (k_best {m.k_best}), hidden {m.hidden_dim}, "
        f"{sum(p.numel() for p in model.trainer_parameters()) / 1e6:.2f}M trainer parameters",
        file=out,
    )
    averager = None
    if client is not None and experiment.averaging.enabled:
        averager = start_averaging(client, experiment)
        print(
            f"averaging with the experiment's other trainers every "
            f"{experiment.averaging.every_s:g} s (rendezvous {averager.rendezvous})",
            file=out,
        )
    trainer = Trainer(
        experiment,
        model,
        corpus,
        Progress(steps, stream=out),
        stop=stop,
        averager=averager,
        peer_id=client.node.node.peer_id if client is not None else "",
        state=state,
    )
    return trainer.run(steps)


def _dashboard_hint(node: SwarmNode, out: TextIO) -> None:
    """Where to watch one daemon at work (its dashboard, signed in)."""
    if not node.control_url:
        return
    try:
        url = ControlClient.for_data_dir(node.data_dir).dashboard_url
    except ControlError:
        return
    print(f"  watch {node.name} at work in a browser: {url}", file=out)


def _expert_table(summary: TrainSummary, swarm: LocalSwarm, out: TextIO) -> None:
    print("\nwho served what:", file=out)
    for node in swarm.daemons:
        mine = [uid for uid in summary.experts if _hosted_by(uid, node.experts)]
        calls = sum(summary.experts[u][0] for u in mine)
        failed = sum(summary.experts[u][1] for u in mine)
        tokens = sum(summary.experts[u][2] for u in mine)
        print(
            f"  {node.name} ({node.peer_id[-8:]}): {len(mine):>2} experts used, "
            f"{calls:>6,} calls answered, {tokens:>10,} tokens, {failed} failed",
            file=out,
        )
    busiest = sorted(summary.experts.items(), key=lambda kv: -kv[1][2])[:5]
    print(
        "  busiest experts: " + ", ".join(f"{uid} ({v[2]:,} tokens)" for uid, v in busiest),
        file=out,
    )


def _hosted_by(uid: str, pattern: str) -> bool:
    return uid in set(expand_pattern(pattern))


def run_demo(
    *,
    steps: int | None = None,
    nodes: int = 3,
    local: bool = False,
    wan: str | None = None,
    seed: int = 0,
    trainers: int = 1,
    summary_json: Path | None = None,
    out: TextIO = sys.stderr,
    stop: threading.Event | None = None,
) -> TrainSummary:
    """Run the demo and return its summary (also written to ``summary_json``).

    Setting ``stop`` (the CLI does on Ctrl-C) ends training after the current step; the
    summary then covers the steps done, and every process started is stopped. ``wan``
    (a profile's name or file) runs the swarm and the trainer over emulated links.
    ``trainers`` > 1 trains with that many trainers of the same experiment at once: this
    process's and ``trainers - 1`` ``volunteerd train`` processes, averaging their
    weights; the summary JSON lists the others' summaries under ``other_trainers``."""
    if trainers < 1:
        raise ConfigError("--trainers must be at least 1")
    if trainers > 1 and local:
        raise ConfigError("--local trains without a network: it cannot go with --trainers")
    base = Experiment()
    experiment = base.model_copy(
        update={
            "training": base.training.model_copy(
                update={"seed": seed, **({"steps": steps} if steps else {})}
            )
        }
    )
    steps = experiment.training.steps
    torch.set_num_threads(1)
    started = time.monotonic()
    if local:
        print(f"volunteerd demo --local: {steps} steps, experts as local modules", file=out)
        summary = run_training(experiment, client=None, steps=steps, out=out, stop=stop)
        extra: dict[str, Any] = {"nodes": 0}
    elif wan is not None:
        summary, extra = _run_over_wan(experiment, wan, nodes, seed, steps, out, stop, trainers)
    else:
        print(f"volunteerd demo: starting a local swarm of {nodes} daemons ...", file=out)
        with LocalSwarm.for_experiment(experiment, nodes, stop=stop) as swarm:
            for node in swarm.daemons:
                print(f"  {node.name} {node.peer_id[-8:]} hosts {node.experts}", file=out)
            _dashboard_hint(swarm.daemons[0], out)
            print(
                f"swarm ready in {time.monotonic() - started:.1f}s; training {steps} steps"
                + (f" with {trainers} trainers" if trainers > 1 else ""),
                file=out,
            )
            with tempfile.TemporaryDirectory(prefix="volunteerd-demo-trainers-") as workdir:
                others = _start_other_trainers(
                    experiment, swarm.bootstrap_addrs[0], trainers - 1, steps, Path(workdir), out
                )
                try:
                    began = time.monotonic()
                    with SwarmClient(
                        trainer_config(swarm.bootstrap_addrs, listen_host="127.0.0.1")
                    ) as client:
                        summary = run_training(
                            experiment, client=client, steps=steps, out=out, stop=stop
                        )
                    wait_trainers(others, stop)
                    wall_s = time.monotonic() - began
                    other_summaries = [_summary_or_none(t) for t in others]
                finally:
                    stop_trainers(others)
            _expert_table(summary, swarm, out)
            extra = {"nodes": nodes}
            if trainers > 1:
                _trainers_table(summary, other_summaries, wall_s, out)
                extra.update(trainers=trainers, other_trainers=other_summaries)
    measured = (
        f" at step {summary.final_val_step}" if summary.final_val_step != summary.steps else ""
    )
    verb = "stopped" if summary.interrupted else "done"
    print(
        f"\n{verb}: {summary.steps} steps ({summary.skipped_steps} failed), {summary.tokens:,} "
        f"tokens in {summary.seconds:.0f}s ({summary.tokens / max(summary.seconds, 1e-9):,.0f} "
        f"tokens/s); validation loss {summary.initial_val_loss:.3f} -> "
        f"{summary.final_val_loss:.3f}{measured} (context-free: {summary.unigram_loss:.3f}); "
        f"{summary.expert_calls:,} expert calls, {summary.failed_calls} failed",
        file=out,
    )
    if summary_json is not None:
        data = {**summary.as_dict(), **extra, "experiment": experiment.name}
        write_atomic(summary_json, json.dumps(data, indent=2))
    return summary


def _start_other_trainers(
    experiment: Experiment, bootstrap: str, count: int, steps: int, workdir: Path, out: TextIO
) -> list[TrainerProcess]:
    """``count`` more trainers of ``experiment``, as ``volunteerd train`` processes on
    127.0.0.1; each one's output goes to its log under ``workdir``."""
    if count < 1:
        return []
    config = write_experiment(experiment, workdir / "experiment.toml")
    started = []
    try:
        for i in range(count):
            trainer = start_trainer(
                f"trainer{i + 2}", config, bootstrap, steps=steps, workdir=workdir
            )
            started.append(trainer)
            print(f"  trainer{i + 2}: volunteerd train (pid {trainer.process.pid})", file=out)
    except BaseException:
        stop_trainers(started)
        raise
    print(
        f"  trainer1 trains in this process; the others write to {workdir}/trainer*/log.txt",
        file=out,
    )
    return started


def _summary_or_none(trainer: TrainerProcess) -> dict[str, Any] | None:
    try:
        return trainer.summary()
    except VolunteerdError as exc:
        logger.warning("%s", exc)
        return None


def _trainers_table(
    summary: TrainSummary,
    others: list[dict[str, Any] | None],
    wall_s: float,
    out: TextIO,
) -> None:
    """One line per trainer (steps, tokens, final validation loss, averaging rounds and
    where it started from) and the tokens/s of all of them together."""
    print("\ntrainers:", file=out)
    rows: list[dict[str, Any] | None] = [summary.as_dict(), *others]
    total = 0
    for i, row in enumerate(rows):
        name = f"trainer{i + 1}"
        if row is None:
            print(f"  {name}: ended without a summary (see its log)", file=out)
            continue
        total += int(row["tokens"])
        peer = str(row.get("peer_id", ""))[-8:]
        started_from = str(row.get("started_from", "seed"))
        if started_from not in ("seed", "state"):
            started_from = f"peer {started_from[-8:]}"
        elif started_from == "state":
            started_from = "its saved state"
        print(
            f"  {name}{f' ({peer})' if peer else ''}: {row['steps']} steps, "
            f"{row['tokens']:,} tokens, validation loss {row['final_val_loss']:.3f}, "
            f"{row.get('averaging_rounds', 0)} averaging rounds, started from {started_from}",
            file=out,
        )
    print(
        f"  all trainers together: {total:,} tokens in {wall_s:.0f}s "
        f"({total / max(wall_s, 1e-9):,.0f} tokens/s)",
        file=out,
    )


def _run_over_wan(
    experiment: Experiment,
    profile: str,
    nodes: int,
    seed: int,
    steps: int,
    out: TextIO,
    stop: threading.Event | None,
    trainers: int = 1,
) -> tuple[TrainSummary, dict[str, Any]]:
    """The demo with the bootstrap node, each daemon and each trainer in hosts of their
    own, linked as ``profile`` says. The summary's extra ``hosts`` records where each
    process ran: its network namespace (inode) and the addresses it announced."""
    from volunteerd.demo.wan import dashboard_hint, open_placements, train_in_host

    stop = stop or threading.Event()
    started = time.monotonic()
    print(f"volunteerd demo --wan {profile}: {nodes} daemons, each in its own host", file=out)
    with (
        open_placements(profile, nodes, seed, trainers) as hosts,
        LocalSwarm.for_experiment(experiment, nodes, stop=stop, placements=hosts.swarm) as swarm,
    ):
        print(f"  bootstrap at {hosts.bootstrap.listen_host}: {hosts.links[0]}", file=out)
        print(f"  trainer   at {hosts.trainer.listen_host}: {hosts.links[1]}", file=out)
        for node, link in zip(swarm.daemons, hosts.links[2:], strict=False):
            print(
                f"  {node.name} {node.peer_id[-8:]} at {node.placement.listen_host}: {link}; "
                f"hosts {node.experts}",
                file=out,
            )
        for i, (placement, link) in enumerate(
            zip(hosts.more_trainers, hosts.links[2 + nodes :], strict=False)
        ):
            print(f"  trainer{i + 2} at {placement.listen_host}: {link}", file=out)
        dashboard_hint(swarm, hosts, out)
        print(
            f"swarm ready in {time.monotonic() - started:.1f}s; training {steps} steps from "
            f"{hosts.trainer.listen_host}"
            + (f" and {trainers - 1} more trainers" if trainers > 1 else ""),
            file=out,
        )
        with tempfile.TemporaryDirectory(prefix="volunteerd-demo-trainer-") as tmp:
            config = write_experiment(experiment, Path(tmp) / "experiment.toml")
            others: list[TrainerProcess] = []
            try:
                for i, placement in enumerate(hosts.more_trainers):
                    others.append(
                        start_trainer(
                            f"trainer{i + 2}",
                            config,
                            swarm.bootstrap_addrs[0],
                            steps=steps,
                            workdir=Path(tmp),
                            placement=placement,
                        )
                    )
                if others:
                    print(f"  trainer2...: their output goes to {tmp}/trainer*/log.txt", file=out)
                began = time.monotonic()
                summary, trainer_netns = train_in_host(
                    experiment,
                    hosts.trainer,
                    swarm.bootstrap_addrs[0],
                    steps=steps,
                    workdir=Path(tmp),
                    out=out,
                    stop=stop,
                )
                wait_trainers(others, stop)
                wall_s = time.monotonic() - began
                other_summaries = [_summary_or_none(t) for t in others]
            finally:
                stop_trainers(others)
        _expert_table(summary, swarm, out)
        if trainers > 1:
            _trainers_table(summary, other_summaries, wall_s, out)
        traffic = hosts.traffic()
        where = {
            node.name: {
                "netns": _netns_of(node.process.pid),
                "listen_host": node.placement.listen_host,
                "multiaddrs": list(node.multiaddrs),
            }
            for node in [*([swarm.bootstrap] if swarm.bootstrap else []), *swarm.daemons]
        }
        where["trainer"] = {
            "netns": trainer_netns,
            "listen_host": hosts.trainer.listen_host,
            "multiaddrs": [],
        }
        for i, placement in enumerate(hosts.more_trainers):
            where[f"trainer{i + 2}"] = {
                "netns": 0,
                "listen_host": placement.listen_host,
                "multiaddrs": [],
            }
        names = [
            "bootstrap",
            "trainer",
            *(node.name for node in swarm.daemons),
            *(f"trainer{i + 2}" for i in range(len(hosts.more_trainers))),
        ]
        for name, (sent, received) in zip(names, traffic, strict=False):
            where[name].update(sent_bytes=sent, received_bytes=received)
        _traffic_table(summary, where, names, out)
    extra: dict[str, Any] = {"nodes": nodes, "wan": profile, "hosts": where}
    if trainers > 1:
        extra.update(trainers=trainers, other_trainers=other_summaries)
    return summary, extra


def _netns_of(pid: int) -> int:
    try:
        return os.stat(f"/proc/{pid}/ns/net").st_ino
    except OSError:
        return 0


def _traffic_table(
    summary: TrainSummary, where: dict[str, dict[str, Any]], names: list[str], out: TextIO
) -> None:
    """What crossed each emulated link, whole and per token trained (the trainer's
    evaluations and the DHT's upkeep included)."""
    tokens = max(summary.tokens, 1)
    print("\ntraffic on the emulated links (IP bytes, all of the run):", file=out)
    for name in names:
        sent, received = where[name]["sent_bytes"], where[name]["received_bytes"]
        print(
            f"  {name:>9}: sent {sent / 1e6:8.1f} MB ({sent / tokens:7,.0f} B/token), "
            f"received {received / 1e6:8.1f} MB ({received / tokens:7,.0f} B/token)",
            file=out,
        )
