"""A trainer in the simulated swarm: the production model, layers and directory.

The model is ``train.loop.build_model``'s: RemoteMixtureOfExperts layers (gating, beam
search over what the directory knows, k_best / k_min / grace with timeouts stretched to
measured round trips, failover to replicas, backtracking, output checks, bans) through
a ``SimClient``, whose directory is a production ``ExpertDirectory`` (cache, refresh,
verification by ``info``, bans) over the simulated DHT and whose RPC client is
``sim.world.SimRpc``. Batches, the optimizer and the staleness rule are the trainer's
(``train.loop``): ``in_flight`` batches at once, a gradient older than
``max_staleness`` updates dropped.

The torch work runs in worker threads (``SimClock.in_thread``), so virtual time stands
still while it computes; the trainer's own compute is charged from calibration
(``trainer_step_s`` per step on the trainer's device), each network round takes the
virtual time the swarm gives it.

Validation loss is measured outside virtual time on the model as it is (trainer-side
weights and every expert's current weights, all experts reachable), on the trainer's
held-out batches: the quality of what the swarm trained, not of what answered.
"""

from __future__ import annotations

import statistics
from collections import Counter
from collections.abc import Awaitable, Callable
from dataclasses import dataclass, field
from typing import Any, TypeVar

import torch
import trio

from volunteerd.errors import ModelDiverging, NoExpertsAvailable
from volunteerd.moe.client import TrainerClient
from volunteerd.moe.directory import ExpertDirectory, info_verifier
from volunteerd.moe.layer import LocalMixtureOfExperts, RemoteMixtureOfExperts
from volunteerd.net import RpcClient
from volunteerd.sim.clock import SimClock
from volunteerd.sim.world import SimRpc, World
from volunteerd.train.data import Corpus
from volunteerd.train.experiment import Experiment
from volunteerd.train.loop import (
    _batch_seed,
    _gradients,
    _load,
    _replica,
    build_model,
    too_stale,
)
from volunteerd.train.model import MoETransformerLM

__all__ = ["SimClient", "SimTrainer", "TrainRun"]

T = TypeVar("T")


class SimClient(TrainerClient):
    """The swarm as a simulated trainer's layers see it."""

    def __init__(self, clock: SimClock, rpc: SimRpc, directory: ExpertDirectory) -> None:
        self._clock = clock
        self._rpc = rpc
        self._directory = directory

    @property
    def rpc(self) -> RpcClient:
        return self._rpc  # type: ignore[return-value]  # duck-typed: call() is all they use

    @property
    def directory(self) -> ExpertDirectory:
        return self._directory

    def run(self, fn: Callable[..., Awaitable[T]], *args: Any) -> T:
        return self._clock.on_loop(fn, *args)


@dataclass
class TrainRun:
    """What a simulated training run did. Times are virtual seconds."""

    steps: int = 0
    seconds: float = 0.0
    step_s: list[float] = field(default_factory=list)
    curve: list[tuple[int, float, float]] = field(default_factory=list)  # step, time, loss
    skipped: int = 0
    stale_dropped: int = 0
    forward_ok: int = 0
    forward_failed: int = 0
    backward_ok: int = 0
    backward_failed: int = 0
    late: int = 0
    failovers: int = 0
    unanswered_tokens: int = 0
    tokens: int = 0
    rejected: Counter[str] = field(default_factory=Counter)
    bans: Counter[str] = field(default_factory=Counter)

    @property
    def final_loss(self) -> float:
        return self.curve[-1][2]

    @property
    def step_s_median(self) -> float:
        return statistics.median(self.step_s) if self.step_s else float("nan")

    def reached(self, target: float, window: int = 1) -> tuple[int, float] | None:
        """(steps, seconds) at the first evaluation where the mean of the last
        ``window`` evaluations is at or below ``target`` (a window smooths the noise of
        one evaluation)."""
        for i, (step, seconds, _) in enumerate(self.curve):
            last = [loss for _, _, loss in self.curve[max(0, i - window + 1) : i + 1]]
            if len(last) == window and sum(last) / window <= target:
                return step, seconds
        return None

    def smoothed_final(self, window: int) -> float:
        """The mean of the last ``window`` evaluations."""
        last = [loss for _, _, loss in self.curve[-window:]]
        return sum(last) / len(last)


class SimTrainer:
    def __init__(self, world: World, clock: SimClock, experiment: Experiment, corpus: Corpus):
        self.world = world
        self.clock = clock
        self.experiment = experiment
        self.corpus = corpus
        config = world.config
        self.rpc = SimRpc(world, world.trainer_host)
        verify_s = config.timeouts.connect_s + config.timeouts.dht_rpc_s
        self.directory = ExpertDirectory(
            world.dht,
            verify=info_verifier(self.rpc, verify_s),  # type: ignore[arg-type]
            verify_wait_s=verify_s,
            clock=clock.current_time,
        )
        self.client = SimClient(clock, self.rpc, self.directory)
        self.model = build_model(experiment, self.client)
        self._eval_model = build_model(experiment, None)
        t, m = experiment.training, experiment.model
        self.optimizer = torch.optim.Adam(self.model.trainer_parameters(), lr=t.lr)
        self.generator = torch.Generator().manual_seed(_batch_seed(t.seed, 0))
        val_generator = torch.Generator().manual_seed(t.seed + 1)
        self.val_batches = [
            corpus.batch("val", t.batch_size, m.seq_len, val_generator)
            for _ in range(t.eval_batches)
        ]
        self._trained = {n: p for n, p in self.model.named_parameters() if p.requires_grad}
        self.version = 0

    def layers(self, models: list[MoETransformerLM]) -> list[RemoteMixtureOfExperts]:
        return [
            b.moe
            for model in models
            for b in model.blocks
            if isinstance(b.moe, RemoteMixtureOfExperts)
        ]

    @torch.no_grad()
    def evaluate(self) -> float:
        """Validation loss of the model as trained so far (see the module docstring)."""
        local = self._eval_model
        local.load_state_dict(self.model.state_dict(), strict=False)
        for block in local.blocks:
            moe = block.moe
            if not isinstance(moe, LocalMixtureOfExperts):
                raise TypeError(f"the evaluation model has a {type(moe).__name__} layer")
            for uid in moe.all_uids():
                backend = self.world.backends.get(uid)
                if backend is not None:
                    moe.expert(uid).load_state_dict(backend.module.state_dict())
        losses = [float(local.loss(x, y)) for x, y in self.val_batches]
        return sum(losses) / len(losses)

    async def run(
        self,
        steps: int,
        *,
        eval_every: int,
        target_loss: float | None = None,
        target_window: int = 1,
    ) -> TrainRun:
        """Train ``steps`` steps (fewer once ``target_loss`` is reached at an evaluation)."""
        t, m = self.experiment.training, self.experiment.model
        in_flight = t.in_flight if t.max_staleness else 1
        out = TrainRun()
        started = trio.current_time()
        out.curve.append((0, 0.0, self.evaluate()))
        replicas = [_replica(self.model) for _ in range(in_flight)]
        cal = self.world.calibration
        issued = 0
        done = trio.Event()
        async with trio.open_nursery() as nursery:
            await nursery.start(self.directory.serve)

            async def worker(replica: MoETransformerLM) -> None:
                nonlocal issued
                while issued < steps and not done.is_set():
                    issued += 1
                    x, y = self.corpus.batch("train", t.batch_size, m.seq_len, self.generator)
                    version = self.version
                    _load(replica, self._trained)
                    began = trio.current_time()
                    await self.world.trainer_host.cpu.run(cal.trainer_step_s)
                    try:
                        grads, _loss = await self.clock.in_thread(_gradients, replica, x, y)
                    except (NoExpertsAvailable, ModelDiverging):
                        out.skipped += 1  # a whole layer without answers: skip the batch
                        continue
                    if too_stale(self.version, version, t.max_staleness):
                        out.stale_dropped += 1
                        continue
                    for p, g in zip(self._trained.values(), grads, strict=True):
                        p.grad = g
                    self.optimizer.step()
                    self.version += 1
                    out.steps += 1
                    out.tokens += t.batch_size * m.seq_len
                    out.step_s.append(trio.current_time() - began)
                    if out.steps % eval_every == 0 or out.steps == steps:
                        loss = self.evaluate()
                        out.curve.append((out.steps, trio.current_time() - started, loss))
                        if target_loss is not None and out.reached(target_loss, target_window):
                            done.set()

            async with trio.open_nursery() as workers:
                for replica in replicas:
                    workers.start_soon(worker, replica)
            nursery.cancel_scope.cancel()
        out.seconds = trio.current_time() - started
        for layer in self.layers([self.model, *replicas]):
            s = layer.stats
            out.forward_ok += s.forward_ok
            out.forward_failed += s.forward_failed
            out.backward_ok += s.backward_ok
            out.backward_failed += s.backward_failed
            out.late += s.late
            out.failovers += s.failovers
            out.unanswered_tokens += s.unanswered_tokens
            out.rejected.update(s.rejected)
        out.bans.update(self.directory.ban_reasons)
        return out
