"""The training loop: steps, validation, live progress and a summary.

``build_model`` makes the experiment's model with remote mixtures (given a
``SwarmClient``) or local ones (the baseline); ``Trainer.run`` trains it and returns a
``TrainSummary``. Validation uses the same fixed held-out batches every time, so the
curve compares like with like.
"""

from __future__ import annotations

import logging
import threading
import time
from collections import Counter
from dataclasses import asdict, dataclass, field
from typing import Any

import torch
from torch import nn

from volunteerd.config import ExpertsConfig
from volunteerd.errors import NoExpertsAvailable
from volunteerd.experts import build_module, make_optimizer
from volunteerd.moe import (
    LocalMixtureOfExperts,
    OutputChecks,
    RemoteMixtureOfExperts,
    SwarmClient,
    grid_uids,
)
from volunteerd.train.data import Corpus
from volunteerd.train.experiment import Experiment
from volunteerd.train.model import MoETransformerLM
from volunteerd.train.progress import Progress

__all__ = ["TrainSummary", "Trainer", "build_model", "expert_config"]

logger = logging.getLogger(__name__)


def expert_config(experiment: Experiment) -> ExpertsConfig:
    """The expert settings daemons need to host this experiment's experts."""
    return ExpertsConfig(
        uids=",".join(
            experiment.model.expert_pattern(b) for b in range(experiment.model.num_blocks)
        ),
        type="ffn",
        hidden_dim=experiment.model.hidden_dim,
        optimizer=experiment.experts,
    )


def build_model(experiment: Experiment, client: SwarmClient | None) -> MoETransformerLM:
    """The experiment's model: remote mixtures through ``client``, or local ones if None.

    Local experts start from exactly the weights a daemon would create for them."""
    m = experiment.model

    def make_moe(block: int) -> nn.Module:
        name = m.layer_name(block)
        if client is not None:
            return RemoteMixtureOfExperts(
                m.hidden_dim,
                m.grid,
                name,
                m.k_best,
                m.k_min,
                m.forward_timeout_s,
                m.backward_timeout_s,
                m.grace_after_k_min_s,
                client=client,
                compression=m.compression,
                checks=OutputChecks(max_abs=m.max_output_abs, spot_check=m.spot_check),
            )
        config = expert_config(experiment)
        # (build_module leaves the global random state alone, so the trainer's own
        # parameters start the same as in the swarm run)
        experts = {uid: build_module(config, uid) for uid in grid_uids(name, m.grid)}
        return LocalMixtureOfExperts(m.hidden_dim, m.grid, name, m.k_best, experts)

    return MoETransformerLM(m, make_moe)


@dataclass
class TrainSummary:
    mode: str
    steps: int
    tokens: int
    seconds: float
    initial_val_loss: float
    final_val_loss: float
    unigram_loss: float
    expert_calls: int
    failed_calls: int
    val_curve: list[tuple[int, float]] = field(default_factory=list)
    interrupted: bool = False
    # steps that could not be taken: no expert of some layer answered
    skipped_steps: int = 0
    # expert calls resent to another replica of the same expert within the step
    failovers: int = 0
    # answers dropped by the trainer's output checks, by reason
    rejected: dict[str, int] = field(default_factory=dict)
    # expert calls that got no answer, by error code (busy, timeout, rejected, ...)
    failures: dict[str, int] = field(default_factory=dict)
    # peers banned, by reason (unreachable, timeout, non_finite, disagreed, ...)
    bans: dict[str, int] = field(default_factory=dict)
    # rounds whose answers most peers sent non-finite or above max_abs, by check: the
    # model diverging (nobody was banned for them; see docs/security.md)
    diverging: dict[str, int] = field(default_factory=dict)
    # uid -> [calls answered, calls failed, tokens served]
    experts: dict[str, list[int]] = field(default_factory=dict)

    def as_dict(self) -> dict[str, Any]:
        return asdict(self)


class Trainer:
    def __init__(
        self,
        experiment: Experiment,
        model: MoETransformerLM,
        corpus: Corpus,
        progress: Progress | None = None,
        stop: threading.Event | None = None,
    ) -> None:
        """``stop``, when set (e.g. on Ctrl-C), ends training after the current step."""
        self.experiment = experiment
        self.stop = stop or threading.Event()
        self.model = model
        self.corpus = corpus
        self.progress = progress
        t = experiment.training
        self.optimizer = torch.optim.Adam(model.trainer_parameters(), lr=t.lr)
        local_experts = [
            p
            for block in model.blocks
            if isinstance(block.moe, LocalMixtureOfExperts)
            for p in block.moe.experts.parameters()
        ]
        # The baseline's experts learn with the optimizer the daemons would use.
        self.expert_optimizer = (
            make_optimizer(local_experts, experiment.experts) if local_experts else None
        )
        self.generator = torch.Generator().manual_seed(t.seed)
        val_generator = torch.Generator().manual_seed(t.seed + 1)
        m = experiment.model
        self.val_batches = [
            corpus.batch("val", t.batch_size, m.seq_len, val_generator)
            for _ in range(t.eval_batches)
        ]
        self.mode = "local" if self.expert_optimizer is not None else "swarm"

    def remote_layers(self) -> list[RemoteMixtureOfExperts]:
        return [b.moe for b in self.model.blocks if isinstance(b.moe, RemoteMixtureOfExperts)]

    @torch.no_grad()
    def evaluate(self, attempts: int = 5) -> float:
        """Mean validation loss. Evaluating needs every layer answered; while a swarm
        has no expert answering for some layer (every replica down at once), it waits a
        little and tries again."""
        for attempt in range(attempts):
            try:
                losses = [float(self.model.loss(x, y)) for x, y in self.val_batches]
                return sum(losses) / len(losses)
            except NoExpertsAvailable:
                if attempt == attempts - 1:
                    raise
                self._say("evaluation: no experts answered; retrying in 2 s")
                time.sleep(2.0)
        raise AssertionError("unreachable")  # pragma: no cover

    def step(self) -> float:
        t, m = self.experiment.training, self.experiment.model
        x, y = self.corpus.batch("train", t.batch_size, m.seq_len, self.generator)
        loss = self.model.loss(x, y)
        self.optimizer.zero_grad(set_to_none=True)
        if self.expert_optimizer is not None:
            self.expert_optimizer.zero_grad(set_to_none=True)
        loss.backward()
        self.optimizer.step()
        if self.expert_optimizer is not None:
            self.expert_optimizer.step()
        return float(loss.detach())

    def run(self, steps: int) -> TrainSummary:
        t, m = self.experiment.training, self.experiment.model
        tokens_per_step = t.batch_size * m.seq_len
        initial = self.evaluate()
        curve = [(0, initial)]
        self._say(f"step 0: validation loss {initial:.3f}")
        started = time.monotonic()
        smoothed: float | None = None
        done = skipped = 0
        try:
            for step in range(1, steps + 1):
                if self.stop.is_set():
                    break
                step_started = time.monotonic()
                done = step
                try:
                    loss = self.step()
                except NoExpertsAvailable as exc:
                    # A whole layer without answers: skip the batch rather than stop.
                    skipped += 1
                    self._say(f"step {step}: skipped ({exc})")
                    continue
                smoothed = loss if smoothed is None else 0.9 * smoothed + 0.1 * loss
                if self.progress is not None:
                    rate = tokens_per_step / max(time.monotonic() - step_started, 1e-9)
                    self.progress.update(step, self._fields(smoothed, rate))
                if (step % t.eval_every == 0 or step == steps) and not self.stop.is_set():
                    val = self.evaluate()
                    curve.append((step, val))
                    self._say(f"step {step}: validation loss {val:.3f} (train {smoothed:.3f})")
        finally:
            if self.progress is not None:
                self.progress.close()
        seconds = time.monotonic() - started
        interrupted = self.stop.is_set()
        if interrupted:
            self._say(f"stopped after {done} steps")
            final = curve[-1][1]
        else:
            final = curve[-1][1] if curve[-1][0] == done and done else self.evaluate()
        return TrainSummary(
            mode=self.mode,
            steps=done,
            tokens=done * tokens_per_step,
            seconds=seconds,
            initial_val_loss=initial,
            final_val_loss=final,
            unigram_loss=self.corpus.unigram_loss(),
            expert_calls=sum(layer.stats.calls for layer in self.remote_layers()),
            failed_calls=sum(layer.stats.failed for layer in self.remote_layers()),
            val_curve=curve,
            experts=self._by_uid(),
            interrupted=interrupted,
            skipped_steps=skipped,
            failovers=sum(layer.stats.failovers for layer in self.remote_layers()),
            rejected=dict(
                sum((Counter(layer.stats.rejected) for layer in self.remote_layers()), Counter())
            ),
            failures=dict(
                sum((Counter(layer.stats.failures) for layer in self.remote_layers()), Counter())
            ),
            bans=self._bans(),
            diverging=dict(
                sum((Counter(layer.stats.diverging) for layer in self.remote_layers()), Counter())
            ),
        )

    def _bans(self) -> dict[str, int]:
        layers = self.remote_layers()
        return dict(layers[0].client.directory.ban_reasons) if layers else {}

    def _fields(self, loss: float, tokens_per_s: float) -> dict[str, str]:
        fields = {"loss": f"{loss:.3f}", "tok/s": f"{tokens_per_s:,.0f}"}
        layers = self.remote_layers()
        if layers:
            grid = 1
            for g in self.experiment.model.grid:
                grid *= g
            answering = sum(1 for layer in layers for v in layer.stats.by_uid.values() if v[0] > 0)
            fields["experts"] = f"{answering}/{grid * len(layers)}"
            fields["failed"] = str(sum(layer.stats.failed for layer in layers))
        return fields

    def _by_uid(self) -> dict[str, list[int]]:
        out: dict[str, list[int]] = {}
        for layer in self.remote_layers():
            for uid, counts in layer.stats.by_uid.items():
                out[uid] = list(counts)
        return out

    def _say(self, text: str) -> None:
        if self.progress is not None:
            self.progress.message(text)
        else:
            logger.info("%s", text)
