"""One simulated run: a swarm of volunteers, a trainer, and what it amounted to.

``simulate`` builds a ``World`` of ``Scenario.volunteers`` volunteers under a
``SimClock``, lets them join for ``churn.warmup_s``, trains the experiment's model with
a ``SimTrainer`` and reports the training (``TrainRun``) and the swarm's costs
(``SwarmReport``). ``centralized`` trains the same model with every expert local (the
production ``Trainer``) and charges each step what one machine would compute, for the
"relative to centralized training" comparison. Everything is deterministic given the
seed: trio's scheduler, Python's and torch's random sources are seeded.
"""

from __future__ import annotations

import math
import random
import statistics
import time
from dataclasses import dataclass, field
from typing import Any

import torch
import trio

from volunteerd.net import children_by_key
from volunteerd.sim.calibration import Calibration
from volunteerd.sim.clock import SimClock, seed_scheduler
from volunteerd.sim.trainer import SimTrainer, TrainRun
from volunteerd.sim.world import (
    FIND_NODE_REPLY_BYTES,
    FIND_NODE_REQUEST_BYTES,
    STORE_REPLY_BYTES,
    STORE_REQUEST_BYTES,
    Churn,
    World,
)
from volunteerd.train.data import Corpus
from volunteerd.train.experiment import Experiment
from volunteerd.train.loop import Trainer, build_model

__all__ = ["Scenario", "SimResult", "SwarmReport", "centralized", "simulate"]


@dataclass(frozen=True, slots=True)
class Scenario:
    volunteers: int
    churn: Churn = field(default_factory=Churn)
    capacity: int = 2  # experts per volunteer
    links: str = "home"  # "home": sim.links.home_links; "lan": one machine's loopback
    shared_cores: int = 0  # > 0: every host computes on one machine's cores
    steps: int = 300
    eval_every: int = 25
    target_loss: float | None = None
    target_window: int = 1  # evaluations averaged when comparing with target_loss
    seed: int = 0
    placement: tuple[tuple[str, ...], ...] | None = None  # fixed uids per volunteer
    background_cpu: float = 0.0  # share of a core each daemon spends on upkeep


@dataclass
class SwarmReport:
    """The swarm's side, per volunteer and minute of its presence where it says so."""

    volunteers: int
    lookup_hops: float
    lookup_s: float  # mean time of the trainer's DHT lookups
    lookup_messages: float
    # bytes per volunteer per minute, mean over volunteers, up and down, by purpose
    up_bytes_per_min: dict[str, float]
    down_bytes_per_min: dict[str, float]
    messages_per_min: dict[str, float]  # up + down, per volunteer
    serve_up_mbps_p99: float  # the busiest 1 % of volunteers' upload for serving
    serve_up_mbps_max: float
    expert_calls_answered: float  # share of forward calls answered in time
    tokens_answered: float  # share of tokens with at least one expert answer
    staleness_mean: float
    staleness_max: int
    uids_served: int
    uids: int
    refused_records: int
    moves: int
    downloads: int
    requests: int = 0  # the trainer's requests to volunteers
    served_s: float = 0.0  # device seconds they cost the volunteers
    trainer_busy_s: float = 0.0  # device seconds the trainer's own device worked

    @property
    def up_mbps(self) -> float:
        return sum(self.up_bytes_per_min.values()) * 8 / 60 / 1e6

    @property
    def down_mbps(self) -> float:
        return sum(self.down_bytes_per_min.values()) * 8 / 60 / 1e6


@dataclass
class SimResult:
    scenario: Scenario
    run: TrainRun
    swarm: SwarmReport
    wall_s: float


def _seed(seed: int) -> None:
    seed_scheduler(seed)
    random.seed(seed)
    torch.manual_seed(seed)


def simulate(
    experiment: Experiment, calibration: Calibration, corpus: Corpus, scenario: Scenario
) -> SimResult:
    """Run ``scenario`` (see the module docstring)."""
    began = time.perf_counter()
    _seed(scenario.seed)
    clock = SimClock()
    holder: dict[str, Any] = {}

    async def main() -> None:
        world = World(
            experiment,
            calibration,
            volunteers=scenario.volunteers,
            capacity=scenario.capacity,
            churn=scenario.churn,
            links=scenario.links,
            shared_cores=scenario.shared_cores,
            seed=scenario.seed,
            placement=scenario.placement,
            background_cpu=scenario.background_cpu,
        )
        async with trio.open_nursery() as nursery:
            await nursery.start(world.serve)
            await trio.sleep(scenario.churn.warmup_s)
            torch.manual_seed(experiment.training.seed)
            trainer = SimTrainer(world, clock, experiment, corpus)
            run = await trainer.run(
                scenario.steps,
                eval_every=scenario.eval_every,
                target_loss=scenario.target_loss,
                target_window=scenario.target_window,
            )
            holder["report"] = report(world, run, trainer)
            holder["run"] = run
            nursery.cancel_scope.cancel()

    trio.run(main, clock=clock)
    return SimResult(scenario, holder["run"], holder["report"], time.perf_counter() - began)


def report(world: World, run: TrainRun, trainer: SimTrainer) -> SwarmReport:
    """The swarm's costs over the run (see SwarmReport)."""
    now = trio.current_time()
    config = world.config
    minutes = []
    for v in world.volunteers:
        present = v.online_s + (now - v.last_up if v.online else 0.0)
        minutes.append(max(present, 1e-9) / 60)
    total_minutes = sum(minutes)
    n = len(world.volunteers)
    up: dict[str, float] = {}
    down: dict[str, float] = {}
    messages: dict[str, float] = {}
    for what in ("serve", "download"):
        up[what] = sum(v.host.traffic.bytes_up[what] for v in world.volunteers) / total_minutes
        down[what] = sum(v.host.traffic.bytes_down[what] for v in world.volunteers) / total_minutes
        messages[what] = (
            sum(
                v.host.traffic.messages_up[what] + v.host.traffic.messages_down[what]
                for v in world.volunteers
            )
            / total_minutes
        )
    # Announcing: every announce_period_s, each record is put: a lookup (find-node
    # requests, each answered with k peers) and `replication` STORE requests. Every
    # request is answered by some volunteer: spread evenly, each answers as many as the
    # mean volunteer sends, plus its share of the trainer's lookups.
    hosted = statistics.fmean(len(v.hosted) for v in world.volunteers) if n else 0.0
    records = statistics.fmean(len(children_by_key(v.hosted)) for v in world.volunteers) if n else 0
    puts = records * 60 / config.dht.announce_period_s
    finds = puts * world.dht.cost.messages_mean
    stores = puts * config.dht.replication
    up["announce"] = finds * FIND_NODE_REQUEST_BYTES + stores * STORE_REQUEST_BYTES
    down["announce"] = finds * FIND_NODE_REPLY_BYTES + stores * STORE_REPLY_BYTES
    messages["announce"] = 2 * (finds + stores)
    trainer_finds = world.dht_answered_messages / total_minutes
    up["dht"] = (finds + trainer_finds) * FIND_NODE_REPLY_BYTES + stores * STORE_REPLY_BYTES
    down["dht"] = (finds + trainer_finds) * FIND_NODE_REQUEST_BYTES + stores * STORE_REQUEST_BYTES
    messages["dht"] = 2 * (finds + stores + trainer_finds)
    # Replica averaging: every average_every_s each hosted expert fetches the
    # parameters of up to max_peers other replicas, and is fetched as often.
    replicas = config.replicas
    if replicas.enabled:
        listed = [len(world.dht.listed(u)) for u in world.uids]
        peers = statistics.fmean(min(replicas.max_peers, max(c - 1, 0)) for c in listed)
        rounds = 60 / replicas.average_every_s
        up["averaging"] = down["averaging"] = hosted * peers * rounds * world.expert_param_bytes()
        messages["averaging"] = 2 * hosted * peers * rounds
    serve_rates = sorted(
        v.host.traffic.bytes_up["serve"] * 8 / 1e6 / max(m * 60, 1e-9)
        for v, m in zip(world.volunteers, minutes, strict=True)
        if m * 60 > 10
    ) or [0.0]
    forward = run.forward_ok + run.forward_failed
    layers = world.experiment.model.num_blocks
    stale = world.staleness_stats()
    served = {u for v in world.volunteers if v.online for u in v.serving}
    lookups = world.dht.lookup_s
    return SwarmReport(
        volunteers=n,
        lookup_hops=world.dht.cost.hops_mean,
        lookup_s=statistics.fmean(lookups) if lookups else 0.0,
        lookup_messages=world.dht.cost.messages_mean,
        up_bytes_per_min=up,
        down_bytes_per_min=down,
        messages_per_min=messages,
        serve_up_mbps_p99=serve_rates[min(len(serve_rates) - 1, int(0.99 * len(serve_rates)))],
        serve_up_mbps_max=serve_rates[-1],
        expert_calls_answered=run.forward_ok / forward if forward else math.nan,
        tokens_answered=1 - run.unanswered_tokens / max(run.tokens * layers, 1),
        staleness_mean=stale.mean or 0.0,
        staleness_max=stale.max,
        uids_served=len(served),
        uids=len(world.uids),
        refused_records=world.refused_records,
        moves=world.moves,
        downloads=world.downloads,
        requests=world.requests,
        served_s=world.served_s,
        trainer_busy_s=world.trainer_host.cpu.busy_s,
    )


def centralized_step_s(experiment: Experiment, calibration: Calibration) -> float:
    """One step of the same model on one machine: the trainer's compute and every
    expert call's, one after another (no network, nothing lost, nothing stale)."""
    m, t = experiment.model, experiment.training
    experts = math.prod(m.grid)
    rows = t.batch_size * m.seq_len * m.k_best
    fa, fb = calibration.forward_s
    ba, bb = calibration.backward_s
    per_layer = (fa + ba) * min(experts, rows) + (fb + bb) * rows
    return calibration.trainer_step_s + m.num_blocks * per_layer


def centralized(
    experiment: Experiment, calibration: Calibration, corpus: Corpus, *, steps: int, eval_every: int
) -> TrainRun:
    """The production ``Trainer`` with local experts, timed as ``centralized_step_s``."""
    _seed(experiment.training.seed)
    training = experiment.training.model_copy(update={"eval_every": eval_every, "data_shard": 0})
    experiment = experiment.model_copy(update={"training": training})
    torch.manual_seed(experiment.training.seed)
    model = build_model(experiment, None)
    summary = Trainer(experiment, model, corpus).run(steps)
    step_s = centralized_step_s(experiment, calibration)
    run = TrainRun(steps=steps, seconds=steps * step_s, step_s=[step_s] * steps)
    run.curve = [(step, step * step_s, loss) for step, loss in summary.val_curve]
    run.tokens = steps * training.batch_size * experiment.model.seq_len
    return run
