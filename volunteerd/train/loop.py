"""The training loop: steps, validation, live progress and a summary.

``build_model`` makes the experiment's model with remote mixtures (given a
``SwarmClient``) or local ones (the baseline); ``Trainer.run`` trains it and returns a
``TrainSummary``. Validation uses the same fixed held-out batches every time, so the
curve compares like with like.

A step that no expert of some layer answered (``NoExpertsAvailable``: every replica of
a layer gone at once) is skipped and does not count toward the steps asked for: the
trainer waits before the next try, 1 s, then twice as long each time up to 30 s, and
says so once per outage, not once per step. Skipping as fast as steps failed used to
burn through a run's steps in seconds (20 a second, a line each, a third of a core).
When no step was applied for ``training.wait_for_experts_s`` (10 minutes by default)
it gives up: the summary says why in ``error``. A validation the swarm cannot answer is
skipped; at the end, the last one measured stands in (``final_val_step`` says when).
"""

from __future__ import annotations

import copy
import hashlib
import logging
import threading
import time
from collections import Counter, deque
from collections.abc import Callable
from concurrent.futures import FIRST_COMPLETED, Future, ThreadPoolExecutor, wait
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

import torch
from torch import nn

from volunteerd.config import ExpertsConfig
from volunteerd.errors import ModelDiverging, NoExpertsAvailable
from volunteerd.experts import build_module, make_optimizer
from volunteerd.moe import (
    LocalMixtureOfExperts,
    OutputChecks,
    RemoteMixtureOfExperts,
    grid_uids,
)
from volunteerd.moe.client import TrainerClient
from volunteerd.train.averaging import TrainerAverager, data_shard_of
from volunteerd.train.data import Corpus
from volunteerd.train.experiment import Experiment
from volunteerd.train.model import MoETransformerLM
from volunteerd.train.progress import Progress, Rate
from volunteerd.train.state import TrainerStateFolder

__all__ = ["TrainSummary", "Trainer", "build_model", "expert_config", "too_stale"]

logger = logging.getLogger(__name__)

# The wait before trying again after a step no expert of some layer answered: doubled
# after each such step in a row, from the first to the most.
BACKOFF_FIRST_S = 1.0
BACKOFF_MAX_S = 30.0
# the progress line's "experts N/M": those that answered within this many steps
ANSWERING_WINDOW_STEPS = 10


def _backoff_s(failures: int) -> float:
    """The wait after ``failures`` tries in a row that no expert answered."""
    return min(BACKOFF_MAX_S, BACKOFF_FIRST_S * 2 ** (failures - 1))


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


def build_model(experiment: Experiment, client: TrainerClient | None) -> MoETransformerLM:
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
    # answers dropped by the output checks, by reason
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
    # batches computed at once, and the staleness bound (docs/decisions/0012)
    in_flight: int = 1
    max_staleness: int = 0
    # steps whose gradient came back older than max_staleness updates: not applied
    stale_dropped: int = 0
    # updates between a step's forward and its update, over the steps applied
    mean_staleness: float = 0.0
    max_staleness_seen: int = 0
    # several trainers of one experiment (docs/training.md): the most seen active at
    # once (itself included), averaging rounds completed with >= 1 peer, peers summed
    # over them, the last round (seconds after the start of training) and its peers
    trainers: int = 1
    averaging_rounds: int = 0
    averaged_with: int = 0
    last_round_s: float | None = None
    last_round_peers: list[str] = field(default_factory=list)
    # peers left out of a round (or of joining), by reason; tensors clipped
    averaging_rejected: dict[str, int] = field(default_factory=dict)
    averaging_clipped: int = 0
    averaging_bytes_sent: int = 0
    averaging_bytes_received: int = 0
    averaging_bytes_per_step: float = 0.0
    # this trainer's tokens/s plus the other trainers' last reported rates
    swarm_tokens_per_s: float = 0.0
    # "seed", "state" (its own saved state: state_file, at started_from_step), or the
    # peer whose state this trainer downloaded; and its update count
    started_from: str = "seed"
    started_from_version: int = 0
    started_from_step: int = 0
    state_file: str = ""
    # seconds spent looking for a peer's state, downloading and checking it (0 alone)
    join_s: float = 0.0
    data_shard: int = 0
    peer_id: str = ""
    # this process's CPU time (all threads)
    cpu_seconds: float = 0.0
    # [seconds after the start of training, [peer ids]] of each round, the last 100
    rounds_log: list[tuple[float, list[str]]] = field(default_factory=list)
    # when training started (after joining and the first evaluation), Unix time
    started_at: float = 0.0
    # the step final_val_loss was measured after: ``steps`` unless the last validation
    # found no experts (or the run was stopped in between), then the last one measured
    final_val_step: int = 0
    # why training ended before its steps, other than a stop: e.g. no step applied for
    # training.wait_for_experts_s ("" when it did not)
    error: str = ""
    # the run ended because the model diverged (``error`` says how)
    diverged: bool = False

    def as_dict(self) -> dict[str, Any]:
        return asdict(self)


# a micro-batch's gradient per trained parameter (None: unused) and its loss
_Gradients = tuple[list[torch.Tensor | None], float]


@dataclass(slots=True)
class _Step:
    """One step in flight: its micro-batches' gradients (as they come back) and the
    number of updates made before its forward started."""

    number: int
    version: int
    tokens: int
    weights: list[float]
    results: list[_Gradients | None]
    failed: BaseException | None = None
    # the output checks refused its answers, blaming no peer, or the model's own values
    # were not finite: the run ends
    diverged: ModelDiverging | None = None
    # the training batches' generator before this step drew its batch (a saved state
    # resumes from there while the step is unapplied)
    generator_state: torch.Tensor | None = None

    @property
    def complete(self) -> bool:
        return (
            self.failed is not None
            or self.diverged is not None
            or all(r is not None for r in self.results)
        )


class Trainer:
    """Trains a model, ``training.in_flight`` batches at a time (docs/decisions/0012).

    Each micro-batch runs, in a thread of its own, through a *replica* of the model
    loaded with the trainer's weights when it started (remote layers' replicas share
    the swarm client); its gradient comes back to this thread, which alone touches the
    model's weights and the optimizers. So a batch waiting for its experts holds no
    other up, no autograd graph sees a weight change under it, and no two threads
    share a ``.grad``.

    ``max_staleness >= 1``: ``in_flight`` whole batches at once, each its own update,
    applied as they come back unless more than ``max_staleness`` updates came in
    between (then it is dropped and counted). ``max_staleness = 0``: one batch at a
    time, cut into ``in_flight`` micro-batches computed from the same weights and
    applied together: the update of that whole batch.
    """

    # the clock of the backoff and of giving up (tests put a fake one here)
    clock: Callable[[], float] = staticmethod(time.monotonic)

    def __init__(
        self,
        experiment: Experiment,
        model: MoETransformerLM,
        corpus: Corpus,
        progress: Progress | None = None,
        stop: threading.Event | None = None,
        *,
        averager: TrainerAverager | None = None,
        peer_id: str = "",
        state_dir: Path | None = None,
        state: TrainerStateFolder | None = None,
    ) -> None:
        """``stop``, when set (e.g. on Ctrl-C), ends training once the steps in flight
        are done. ``averager`` averages the trainer-side weights with the experiment's
        other trainers (and starts from one's state, downloaded to ``state_dir``, a
        temporary folder when None); ``peer_id``: this trainer's on the swarm (default:
        the averager's), from which its data shard is derived. ``state``: the folder
        (locked) this trainer saves its own state in, and resumes from here if it holds
        one (volunteerd.train.state)."""
        self.experiment = experiment
        self.averager = averager
        self.peer_id = peer_id or (averager.peer_id if averager is not None else "")
        self._state_dir = state_dir
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
        self.mode = "local" if self.expert_optimizer is not None else "swarm"
        # Trainers of one experiment draw different batches (each its own shard);
        # shard 0 draws what a lone trainer always drew.
        if t.data_shard is not None:
            self.data_shard = t.data_shard
        elif self.mode == "swarm" and self.peer_id:
            self.data_shard = data_shard_of(self.peer_id)
        else:
            self.data_shard = 0
        if averager is not None:
            averager.data_shard = self.data_shard
        self.generator = torch.Generator().manual_seed(_batch_seed(t.seed, self.data_shard))
        val_generator = torch.Generator().manual_seed(t.seed + 1)
        m = experiment.model
        self.val_batches = [
            corpus.batch("val", t.batch_size, m.seq_len, val_generator)
            for _ in range(t.eval_batches)
        ]
        self.in_flight = t.in_flight
        self.max_staleness = t.max_staleness
        # what the update applies to, by name; replicas are loaded from these
        self._trained = {n: p for n, p in model.named_parameters() if p.requires_grad}
        # what is averaged with other trainers: the trainer-side parameters, in the
        # optimizer's order (the same tensors as in _trained)
        own = {id(p) for p in model.trainer_parameters()}
        self._own = {n: p for n, p in model.named_parameters() if id(p) in own}
        self.tokens_trained = 0  # tokens of the updates applied
        self._replicas = [_replica(model) for _ in range(self.in_flight)]
        self.version = 0  # updates made
        self.stale_dropped = 0
        # applied updates' staleness: how many, their sum and the largest (a list of them
        # grew by one int a step for as long as a trainer ran)
        self._stale_count = self._stale_sum = self._stale_max = 0
        # (step, uid -> answers so far) over the last ANSWERING_WINDOW_STEPS steps
        self._answer_marks: deque[tuple[int, dict[str, int]]] = deque()
        # during run: replicas not in use, and each micro-batch's (step, index, replica)
        self._free: list[MoETransformerLM] = []
        self._futures: dict[Future[_Gradients], tuple[_Step, int, MoETransformerLM]] = {}
        self.state = state
        self.resumed = state.load(self) if state is not None else None

    def remote_layers(self) -> list[RemoteMixtureOfExperts]:
        """The model's remote layers and their replicas' (each counts its own calls)."""
        return [
            b.moe
            for model in (self.model, *self._replicas)
            for b in model.blocks
            if isinstance(b.moe, RemoteMixtureOfExperts)
        ]

    @torch.no_grad()
    def evaluate(self, attempts: int = 5) -> float:
        """Mean validation loss. Evaluating needs every layer answered; while a swarm
        has no expert answering for some layer (every replica down at once), it waits a
        little and tries again. Raises NoExpertsAvailable after ``attempts`` tries (at
        once when ``stop`` is set)."""
        for attempt in range(attempts):
            try:
                losses = [float(self.model.loss(x, y)) for x, y in self.val_batches]
                return sum(losses) / len(losses)
            except NoExpertsAvailable:
                if attempt == attempts - 1 or self.stop.is_set():
                    raise
                self._say("evaluation: no experts answered; retrying in 2 s")
                self._pause(2.0)
        raise AssertionError("unreachable")  # pragma: no cover

    def _first_validation(self) -> float:
        """The validation loss before training. While no expert of some layer answers
        (a trainer started before its swarm is up, or in an outage) it waits as a step
        does, 1 s ... 30 s between tries, up to ``training.wait_for_experts_s``: it gave
        up after 5 tries 2 s apart, so a trainer started while the daemons were still
        joining exited 1. Raises NoExpertsAvailable then (at once when ``stop`` is set)."""
        wait_s = self.experiment.training.wait_for_experts_s
        began = self.clock()
        tries = 0
        while True:
            try:
                return self.evaluate(attempts=1)
            except NoExpertsAvailable as exc:
                tries += 1
                waited = self.clock() - began
                if self.stop.is_set() or waited >= wait_s:
                    raise
                if tries == 1:
                    self._say(
                        f"no experts answered the first validation ({exc}): waiting for experts"
                    )
                self._pause(min(_backoff_s(tries), wait_s - waited))

    def _pause(self, seconds: float) -> None:
        """Wait ``seconds``, or less if ``stop`` is set meanwhile (Ctrl-C ends a wait)."""
        self.stop.wait(seconds)

    def run(self, steps: int) -> TrainSummary:
        t, m = self.experiment.training, self.experiment.model
        tokens_per_step = t.batch_size * m.seq_len
        averager = self.averager
        join_s = 0.0
        first = 0 if self.resumed is None else self.resumed.step
        if self.resumed is not None:
            r = self.resumed
            loss_known = "" if r.train_loss is None else f", train loss {r.train_loss:.3f}"
            self._say(f"resumed from {r.path} (step {r.step}, update {r.version}{loss_known})")
            if first >= steps:
                self._say(f"nothing to train: step {steps} was reached (steps count from 0)")
        if averager is not None and self.resumed is None:
            # before the first validation: a late joiner's starts at its peers' level
            joining = time.monotonic()
            peer, version = averager.join(self._own, self.optimizer, self._state_dir)
            join_s = time.monotonic() - joining
            if peer != "seed":
                self.version = version
                self._say(f"started from {peer}'s state (update {version})")
        if averager is not None:
            averager.publish(self._own, self.optimizer, self.version, 0, 0.0, force=True)
        initial = self._first_validation()
        curve = [(first, initial)]
        self._say(f"step {first}: validation loss {initial:.3f}")
        started = time.monotonic()
        started_at = time.time()
        rate = Rate()
        smoothed: float | None = None
        # done: steps taken (applied, or dropped as too stale), which count toward
        # ``steps`` (from ``first``, the step a saved state resumes at); skipped: steps
        # no expert of some layer answered, which do not
        done = issued = first
        skipped = 0
        # the outage under way: skipped steps in a row, when the last step was taken,
        # and when the next may start
        in_a_row = 0
        last_taken = resume_at = self.clock()
        error = ""
        diverged = False
        self._free = list(self._replicas)
        self._futures = {}
        flying: list[_Step] = []
        steps_at_once = 1 if self.max_staleness == 0 else self.in_flight
        with ThreadPoolExecutor(self.in_flight, thread_name_prefix="batch") as pool:
            try:
                while True:
                    while (
                        not self.stop.is_set()
                        and not error
                        and done + len(flying) < steps
                        and len(flying) < steps_at_once
                    ):
                        wait_s = resume_at - self.clock()
                        if wait_s > 0:
                            if flying:
                                break  # those in flight first: one may end the outage
                            self._pause(wait_s)
                            continue
                        issued += 1
                        flying.append(self._start(issued, pool))
                    if not flying:
                        break
                    for step in self._wait(flying):
                        now = self.clock()
                        if step.diverged is not None:
                            if not diverged:
                                error, diverged = self._diverged(step.number, step.diverged), True
                            continue
                        if step.failed is not None:
                            # A whole layer without answers: skip the batch, wait, try again.
                            skipped += 1
                            in_a_row += 1
                            if in_a_row == 1:
                                self._say(
                                    f"step {step.number}: skipped ({step.failed}); waiting "
                                    f"for experts ({skipped} step{'s' if skipped != 1 else ''} "
                                    "skipped so far)"
                                )
                            backoff_s = _backoff_s(in_a_row)
                            # the last try when the time to give up comes, not 30 s after it
                            resume_at = min(now + backoff_s, last_taken + t.wait_for_experts_s)
                            if now - last_taken >= t.wait_for_experts_s and not error:
                                error = (
                                    f"no step taken for {now - last_taken:.0f} s "
                                    f"(training.wait_for_experts_s = {t.wait_for_experts_s:g}): "
                                    f"{step.failed}"
                                )
                                self._say(f"giving up: {error}")
                            continue
                        if in_a_row:
                            self._say(
                                f"step {step.number}: experts answer again after "
                                f"{now - last_taken:.0f} s ({in_a_row} step"
                                f"{'s' if in_a_row != 1 else ''} skipped)"
                            )
                            in_a_row = 0
                        done += 1
                        last_taken = now
                        loss = self._apply(step)
                        if loss is not None:
                            rate.add(step.tokens)
                            smoothed = loss if smoothed is None else 0.9 * smoothed + 0.1 * loss
                            self.tokens_trained += step.tokens
                            if averager is not None:
                                # between two updates, on this thread: steps started
                                # later load the averaged weights
                                averager.apply_pending(self._own)
                                averager.publish(
                                    self._own,
                                    self.optimizer,
                                    self.version,
                                    self.tokens_trained,
                                    rate.per_s(),
                                )
                            if self.state is not None:
                                self.state.count_update()
                        if self.progress is not None and smoothed is not None:
                            self.progress.update(done, self._fields(smoothed, rate.per_s(), done))
                        if (
                            (done % t.eval_every == 0 or done == steps)
                            and not self.stop.is_set()
                            and not diverged
                        ):
                            exc = self._validate(done, curve, smoothed)
                            if exc is not None:
                                error, diverged = self._diverged(done, exc), True
                    if self.state is not None and self.state.due and not diverged:
                        self._save_state(done, flying, smoothed)
            finally:
                if self.progress is not None:
                    self.progress.close()
        if self.state is not None and diverged:
            self._say(
                "the diverged weights are not saved: "
                + (
                    f"the state saved after step {self.state.saved_step} stays"
                    if self.state.files()
                    else "no state was saved before"
                )
            )
        elif self.state is not None and done != self.state.saved_step:  # ended, or stopped
            self._save_state(done, flying, smoothed)
        seconds = time.monotonic() - started
        interrupted = self.stop.is_set()
        if interrupted:
            self._say(f"stopped after {done} steps")
        elif curve[-1][0] != done and not error:
            self._validate(done, curve, smoothed)
        final_step, final = curve[-1]
        if final_step != done:
            self._say(f"final validation loss {final:.3f} is from step {final_step}")
        layers = self.remote_layers()
        summary = TrainSummary(
            mode=self.mode,
            steps=done - first,
            tokens=(done - first) * tokens_per_step,
            seconds=seconds,
            initial_val_loss=initial,
            final_val_loss=final,
            unigram_loss=self.corpus.unigram_loss(),
            expert_calls=sum(layer.stats.calls for layer in layers),
            failed_calls=sum(layer.stats.failed for layer in layers),
            val_curve=curve,
            experts=self._by_uid(),
            interrupted=interrupted,
            skipped_steps=skipped,
            failovers=sum(layer.stats.failovers for layer in layers),
            rejected=dict(sum((Counter(layer.stats.rejected) for layer in layers), Counter())),
            failures=dict(sum((Counter(layer.stats.failures) for layer in layers), Counter())),
            bans=self._bans(),
            diverging=dict(sum((Counter(layer.stats.diverging) for layer in layers), Counter())),
            in_flight=self.in_flight,
            max_staleness=self.max_staleness,
            stale_dropped=self.stale_dropped,
            mean_staleness=self._stale_sum / self._stale_count if self._stale_count else 0.0,
            max_staleness_seen=self._stale_max,
            swarm_tokens_per_s=(done - first) * tokens_per_step / max(seconds, 1e-9),
            data_shard=self.data_shard,
            peer_id=self.peer_id,
            started_at=started_at,
            final_val_step=final_step,
            error=error,
            diverged=diverged,
        )
        if averager is not None:
            _add_averaging(summary, averager, started)
            summary.join_s = join_s
        if self.resumed is not None:
            summary.started_from, summary.started_from_version = "state", self.resumed.version
            summary.started_from_step, summary.state_file = first, str(self.resumed.path)
        summary.cpu_seconds = time.process_time()
        return summary

    def _diverged(self, step: int, exc: ModelDiverging) -> str:
        """Say that the model diverged at ``step`` and return the summary's ``error``."""
        error = f"the model diverged at step {step}: {exc}"
        self._say(f"stopping: {error}")
        return error

    def _validate(
        self, step: int, curve: list[tuple[int, float]], smoothed: float | None
    ) -> ModelDiverging | None:
        """Add the validation loss after ``step`` to ``curve``, unless no expert of some
        layer answers (the curve then goes without this point, and training goes on).
        Returns the ``ModelDiverging`` the validation raised, if it did."""
        try:
            val = self.evaluate()
        except NoExpertsAvailable as exc:
            self._say(f"step {step}: no validation loss, no experts answered ({exc})")
            return None
        except ModelDiverging as exc:
            return exc
        curve.append((step, val))
        train = "-" if smoothed is None else f"{smoothed:.3f}"
        self._say(f"step {step}: validation loss {val:.3f} (train {train})")
        return None

    def _start(self, number: int, pool: ThreadPoolExecutor) -> _Step:
        """Draw step ``number``'s batch and start its micro-batches (one, or with
        ``max_staleness = 0`` up to ``in_flight``), each on a free replica loaded with
        the weights of now."""
        t, m = self.experiment.training, self.experiment.model
        before = self.generator.get_state() if self.state is not None else None
        x, y = self.corpus.batch("train", t.batch_size, m.seq_len, self.generator)
        parts = 1 if self.max_staleness else self.in_flight
        pieces = [
            (xs, ys)
            for xs, ys in zip(x.tensor_split(parts), y.tensor_split(parts), strict=True)
            if len(xs)
        ]
        step = _Step(
            number,
            self.version,
            t.batch_size * m.seq_len,
            [len(xs) / t.batch_size for xs, _ in pieces],
            [None] * len(pieces),
            generator_state=before,
        )
        for index, (xs, ys) in enumerate(pieces):
            replica = self._free.pop()
            _load(replica, self._trained)
            self._futures[pool.submit(_gradients, replica, xs, ys)] = (step, index, replica)
        return step

    def _wait(self, flying: list[_Step]) -> list[_Step]:
        """Wait until a micro-batch comes back; returns the steps now complete (every
        micro-batch back, or one failed and the others back), taken out of ``flying``."""
        finished, _ = wait(list(self._futures), return_when=FIRST_COMPLETED)
        for future in finished:
            step, index, replica = self._futures.pop(future)
            self._free.append(replica)
            try:
                step.results[index] = future.result()
            except NoExpertsAvailable as exc:
                step.failed = step.failed or exc
            except ModelDiverging as exc:
                step.diverged = step.diverged or exc
        running = {id(step) for step, _, _ in self._futures.values()}
        complete = [s for s in flying if id(s) not in running and s.complete]
        for step in complete:
            flying.remove(step)
        return complete

    def _apply(self, step: _Step) -> float | None:
        """Apply ``step``'s gradient (the micro-batches' weighted sum) unless it is
        staler than ``max_staleness`` updates; returns its loss, or None if dropped."""
        staleness = self.version - step.version
        if too_stale(self.version, step.version, self.max_staleness):
            self.stale_dropped += 1
            return None
        self._stale_count += 1
        self._stale_sum += staleness
        self._stale_max = max(self._stale_max, staleness)
        results = [r for r in step.results if r is not None]
        for i, p in enumerate(self._trained.values()):
            grads = [(w, g[i]) for w, (g, _) in zip(step.weights, results, strict=True)]
            present = [w * g for w, g in grads if g is not None]
            p.grad = torch.stack(present).sum(dim=0) if present else None
        self.optimizer.step()
        if self.expert_optimizer is not None:
            self.expert_optimizer.step()
        self.version += 1
        return sum(w * loss for w, (_, loss) in zip(step.weights, results, strict=True))

    def _save_state(self, done: int, flying: list[_Step], loss: float | None) -> None:
        """Save the trainer's state after ``done`` steps, the data position before the
        oldest step still in flight (its batch is drawn again on resuming); nothing
        without a state folder."""
        if self.state is None:
            return
        drawn = [s.generator_state for s in sorted(flying, key=lambda s: s.number)]
        position = next((g for g in drawn if g is not None), None)
        if position is None:
            position = self.generator.get_state()
        self.state.save(self, done, position, loss)

    def _bans(self) -> dict[str, int]:
        layers = self.remote_layers()
        return dict(layers[0].client.directory.ban_reasons) if layers else {}

    def _fields(self, loss: float, tokens_per_s: float, step: int) -> dict[str, str]:
        fields = {"loss": f"{loss:.3f}", "tok/s": f"{tokens_per_s:,.0f}"}
        layers = self.remote_layers()
        if layers:
            m = self.experiment.model
            grid = 1
            for g in m.grid:
                grid *= g
            fields["experts"] = f"{self._answering(step)}/{grid * m.num_blocks}"
            fields["failed"] = str(sum(layer.stats.failed for layer in layers))
        if self.averager is not None:
            s = self.averager.statistics()
            fields["trainers"] = str(s.trainers_now)
            if s.last_round_at is None:
                fields["avg"] = "no round yet" if s.trainers_now > 1 else "no other trainer"
            else:
                ago = time.monotonic() - s.last_round_at
                n = len(s.last_round_peers)
                fields["avg"] = f"{ago:.0f}s ago, {n} peer{'s' if n != 1 else ''}"
            fields["swarm tok/s"] = f"{s.swarm_tokens_per_s:,.0f}"
        return fields

    def _answering(self, step: int) -> int:
        """How many experts answered a call within the last ANSWERING_WINDOW_STEPS steps
        (to ``step``). It counted every expert that ever answered, so a server gone
        mid-run (banned, its experts unreachable) still read "experts 32/32"."""
        now = {uid: counts[0] for uid, counts in self._by_uid().items()}
        marks = self._answer_marks
        while len(marks) > 1 and marks[1][0] <= step - ANSWERING_WINDOW_STEPS:
            marks.popleft()
        before = marks[0][1] if marks else {}
        marks.append((step, now))
        return sum(1 for uid, answered in now.items() if answered > before.get(uid, 0))

    def _by_uid(self) -> dict[str, list[int]]:
        """uid -> [answered, failed, tokens], summed over the replicas' layers."""
        out: dict[str, list[int]] = {}
        for layer in self.remote_layers():
            for uid, counts in layer.stats.by_uid.items():
                total = out.setdefault(uid, [0, 0, 0])
                for i, n in enumerate(counts):
                    total[i] += n
        return out

    def _say(self, text: str) -> None:
        if self.progress is not None:
            self.progress.message(text)
        else:
            logger.info("%s", text)


def _add_averaging(summary: TrainSummary, averager: TrainerAverager, started: float) -> None:
    """The averager's statistics in ``summary`` (times after ``started``)."""
    s = averager.statistics()
    summary.trainers = s.trainers
    summary.averaging_rounds = s.rounds
    summary.averaged_with = s.averaged_with
    summary.last_round_s = None if s.last_round_at is None else s.last_round_at - started
    summary.last_round_peers = list(s.last_round_peers)
    summary.averaging_rejected = dict(s.rejected)
    summary.averaging_clipped = s.clipped
    summary.averaging_bytes_sent = s.bytes_sent
    summary.averaging_bytes_received = s.bytes_received
    summary.averaging_bytes_per_step = (s.bytes_sent + s.bytes_received) / max(summary.steps, 1)
    # this trainer's average rate over the run, the others' as they last reported it
    summary.swarm_tokens_per_s += s.peers_tokens_per_s
    summary.started_from = s.started_from
    summary.started_from_version = s.started_from_version
    summary.rounds_log = [(when - started, list(peers)) for when, peers in s.rounds_log]


def too_stale(version: int, started_at: int, max_staleness: int) -> bool:
    """Whether a gradient computed from update ``started_at`` may no longer be applied
    at update ``version`` (docs/decisions/0012): more than ``max_staleness`` came between."""
    return version - started_at > max_staleness


def _batch_seed(seed: int, shard: int) -> int:
    """The training batches' seed of ``shard``: ``seed`` itself for shard 0."""
    if shard == 0:
        return seed
    digest = hashlib.sha256(f"{seed}:{shard}".encode()).digest()
    return int.from_bytes(digest[:8], "big") >> 1


def _replica(model: MoETransformerLM) -> MoETransformerLM:
    """A copy of ``model`` for one batch thread: its own trainer-side weights (and local
    experts), remote layers that share the swarm client (``RemoteMixtureOfExperts.replica``)."""
    memo: dict[int, Any] = {
        id(block.moe): block.moe.replica()
        for block in model.blocks
        if isinstance(block.moe, RemoteMixtureOfExperts)
    }
    replica = copy.deepcopy(model, memo)
    for p in replica.parameters():
        p.grad = None
    return replica


@torch.no_grad()
def _load(replica: MoETransformerLM, weights: dict[str, nn.Parameter]) -> None:
    for name, p in replica.named_parameters():
        source = weights.get(name)
        if source is not None:
            p.copy_(source)


def _gradients(replica: MoETransformerLM, x: torch.Tensor, y: torch.Tensor) -> _Gradients:
    """The loss of ``x -> y`` through ``replica`` and its gradient for each trained
    parameter (in ``named_parameters`` order; None where unused). Runs in a batch thread."""
    loss = replica.loss(x, y)
    trained = [p for p in replica.parameters() if p.requires_grad]
    grads = torch.autograd.grad(loss, trained, allow_unused=True)
    return list(grads), float(loss.detach())
