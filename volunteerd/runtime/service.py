"""ExpertRuntime: the hosted experts behind the forward, backward and info verbs.

A request is checked against the expert's schema before any tensor is built, queued
on the expert's bounded queue (full: ``Busy`` at once), batched with others, computed
on the device worker, and answered with wire tensors. This module speaks wire types
only; the daemon binds it to the network.

Per expert there are four lanes (``runtime.batching``): forwards, forwards kept for
their backward, stateless backwards, and backwards through kept forwards; concurrent
requests of a lane merge into one batch (kept forwards into one graph, see
``experts.backend`` for the two kinds of backward). One batcher per device runs the
waiting batches of every expert in one hand-off to the worker thread, preceded by the
optimizer steps that the previous job's backwards made due: one pass over all those
experts (``experts.multistep``), after their replies went out.

Every request passes the ``RequestGuard`` (a banned peer is refused at once; values are
bounded) and every optimizer step is checked (``experts.stepcheck.StepCheck``): one that
breaks the weights is refused or undone and the guard blames and bans its senders (see
``runtime.guard``). A step that the check's bounds vouched for but that left a weight
non-finite all the same (which the bounds rule out: the check of the check) cannot be
undone: the expert refuses requests (``Busy``) until it is restored from its newest
checkpoint, or to its seeded weights when it has none.

Per expert the runtime counts the staleness of its gradients (``ExpertStats.staleness``):
for each backward through a kept forward, the optimizer updates the expert took between
that forward and the backward (other trainers' backwards, and this trainer's other
batches in flight), read on the worker as each runs. Stateless backwards are counted
apart (their forward's weights are unknown here). See decision 0012.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Awaitable, Callable, Iterable, Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass
from functools import partial
from pathlib import Path
from typing import TYPE_CHECKING, TypeVar

import torch
import trio

from volunteerd.config import ExpertsConfig, GuardConfig, RuntimeConfig, WireLimits
from volunteerd.errors import (
    ActivationsExpired,
    BadShape,
    Busy,
    CheckpointError,
    ShuttingDown,
    UnknownExpert,
)
from volunteerd.experts import TORCH_DTYPES, ExpertBackend, Retained, from_wire, to_wire
from volunteerd.experts.multistep import step_many
from volunteerd.experts.registry import output_shapes
from volunteerd.experts.stepcheck import StepCheck, StepOutcome
from volunteerd.malloc import reuse_freed_memory
from volunteerd.runtime.batching import BeforeJob, DeviceBatcher, Lane, QueueStats, Together
from volunteerd.runtime.executor import DeviceExecutor
from volunteerd.runtime.guard import RequestGuard, Sender
from volunteerd.runtime.retained import (
    RetainedStats,
    RetainedStore,
    StalenessMeter,
    StalenessStats,
)
from volunteerd.runtime.stacking import Kind, Stacking, cat_rows, split_rows, stacks_on
from volunteerd.wire import (
    Compression,
    ExpertInfo,
    TensorReply,
    WireTensor,
    check_against_schema,
)

if TYPE_CHECKING:
    # trio's TaskStatus as libp2p's trio-typing stubs spell it
    from trio_typing import TaskStatus

__all__ = ["ExpertRuntime", "ExpertStats"]

logger = logging.getLogger(__name__)

_EXPIRE_RETAINED_EVERY_S = 1.0

Tensors = list[torch.Tensor]
T = TypeVar("T")


@dataclass(frozen=True, slots=True)
class ExpertStats:
    uid: str
    forward: QueueStats
    backward: QueueStats
    updates: int
    compute_s: float  # worker time of its batches and optimizer steps
    last_used: float | None  # time.time() of its last request
    staleness: StalenessStats  # updates between a kept forward and its backward


class _Hosted:
    """One expert's backend and queues."""

    def __init__(
        self,
        backend: ExpertBackend,
        batcher: DeviceBatcher,
        stacking: Stacking | None = None,
        gradients_in: Callable[[_Hosted, float], None] | None = None,
    ) -> None:
        self.backend = backend
        self.step_pending = False
        self.compute_s = 0.0  # added on the worker thread, read on the trio thread
        self.last_used: float | None = None
        # Whose gradients the next optimizer step applies: noted on the worker thread
        # as each batch runs (a backward finishing just before a step is in that step).
        self.senders: list[Sender] = []
        # Set on the worker when a step left the weights non-finite and could not be
        # undone: no batch of this expert runs until it is restored.
        self.broken = False
        self.staleness = StalenessMeter()  # recorded on the worker
        n_in = len(backend.info.inputs)

        def forward(items: list[Tensors]) -> list[Tensors]:
            self.refuse_if_broken()
            with self.timed():
                return split_rows(backend.forward(cat_rows(items)), [t[0].shape[0] for t in items])

        def backward(items: list[tuple[Tensors, Sender]]) -> list[Tensors]:
            self.refuse_if_broken()
            with self.timed():
                self.heard(sender for _, sender in items)
                joined = cat_rows([tensors for tensors, _ in items])
                grads = backend.backward(joined[:n_in], joined[n_in:])
                self.staleness.record_stateless(len(items))
                return split_rows(grads, [t[0].shape[0] for t, _ in items])

        def forward_retained(items: list[Tensors]) -> list[tuple[Tensors, Retained, int]]:
            self.refuse_if_broken()
            with self.timed():
                # read here, on the worker: no step can run between it and the forward
                version = backend.updates
                return [(*kept, version) for kept in backend.forward_retained_many(items)]

        def backward_retained(
            items: list[tuple[Retained, Tensors, Sender, int]],
        ) -> list[Tensors]:
            self.refuse_if_broken()
            with self.timed():
                self.heard(item[2] for item in items)
                grads = backend.backward_retained([(kept, g) for kept, g, _, _ in items])
                # the next step (updates + 1) applies them: staleness = updates since
                # each forward
                for _, _, _, version in items:
                    self.staleness.record(backend.updates - version)
                return grads

        uid = backend.uid

        def together(kind: Kind) -> Together | None:
            return stacking.together(self, kind) if stacking is not None else None

        self.forward = batcher.lane(f"{uid}/forward", forward, together=together("forward"))

        # Gradients a backward added are the expert's next step's whether or not its
        # caller still waits for the answer (one cut off by its deadline, or whose
        # stream closed): ``gradients_in`` makes that step due as each batch ran.
        # Before, the handler did after its answer: a caller gone left its gradients
        # in .grad, applied unannounced by whichever backward came next.
        def loudest(senders: Iterable[Sender]) -> None:
            if gradients_in is not None:
                gradients_in(self, max((s.grad_norm for s in senders), default=0.0))

        self.backward = batcher.lane(
            f"{uid}/backward",
            backward,
            together=together("backward"),
            on_ran=lambda items: loudest(sender for _, sender in items),
        )
        self.forward_retained = batcher.lane(
            f"{uid}/forward-retained", forward_retained, together=together("forward-retained")
        )
        self.backward_retained = batcher.lane(
            f"{uid}/backward-retained",
            backward_retained,
            together=together("backward-retained"),
            on_ran=lambda items: loudest(item[2] for item in items),
        )

    @contextmanager
    def timed(self) -> Iterator[None]:
        """Count the worker time of the block as this expert's compute."""
        start = time.perf_counter()
        try:
            yield
        finally:
            self.compute_s += time.perf_counter() - start

    def heard(self, senders: Iterable[Sender]) -> None:
        """Note whose gradients the next step applies (on the worker). A backward whose
        gradients are all zero makes no step due (``_step_soon``), so it is not noted:
        nothing would clear the list on an expert nobody else trains (a peer grew it by
        a thousand entries a second), and a silent sender has no part in a step to
        blame (its zero would only lower the median the loud are measured against)."""
        self.senders.extend(s for s in senders if s.grad_norm > 0.0)

    def refuse_if_broken(self) -> None:
        if self.broken:
            raise Busy(f"{self.backend.uid} is being restored from its checkpoint")

    @property
    def queues(self) -> tuple[Lane, ...]:  # type: ignore[type-arg]
        return (self.forward, self.backward, self.forward_retained, self.backward_retained)

    async def stopped(self) -> None:
        """Wait until every lane is closed and its requests answered."""
        for queue in self.queues:
            await queue.finished()


class ExpertRuntime:
    """Hosts ``uids`` on ``device``. Start ``serve`` in a nursery before sending work."""

    def __init__(
        self,
        uids: Sequence[str],
        experts: ExpertsConfig,
        runtime: RuntimeConfig,
        limits: WireLimits,
        device: torch.device,
        guard: GuardConfig | None = None,
    ) -> None:
        self.device = device
        reuse_freed_memory()  # gradients come and go every step: keep their pages
        self.executor = DeviceExecutor(device)
        self.batcher = DeviceBatcher(self.executor, runtime)
        self.batcher.before_job = self._due_steps
        guard = guard or GuardConfig()
        self.guard = RequestGuard(guard)
        # One shadow for every expert: steps run one at a time on the device's worker.
        self.step_check = (
            StepCheck(guard.max_step_ratio, full_every=guard.full_check_every)
            if guard.check_steps
            else None
        )
        # Loads an expert's newest good checkpoint (the checkpointer sets it): how an
        # expert broken by a step that could not be undone gets its weights back.
        self.restore_checkpoint: Callable[[ExpertBackend], Awaitable[Path | None]] | None = None
        # Told (added uids, dropped uids) when ``add_expert``/``remove_expert`` change
        # what is hosted (the daemon posts it as an event).
        self.on_experts_changed: Callable[[list[str], list[str]], object] | None = None
        # Told what failed when an expert had to be restored (posted as an error event).
        self.on_error: Callable[[str], object] | None = None
        self.retained = RetainedStore(runtime.retain_activations_mb << 20, runtime.retain_s)
        self._max_samples = min(limits.max_request_samples, runtime.max_batch_size)
        self._max_sequence = limits.max_sequence_length
        self._runtime_config = runtime
        # Experts of one type and size computed as one per job (on GPUs by default)
        min_stack = stacks_on(runtime, device)
        self.stacking = Stacking(min_stack) if min_stack else None
        self._experts = {
            uid: _Hosted(
                ExpertBackend(uid, experts, device, self._max_samples),
                self.batcher,
                self.stacking,
                self._step_soon,
            )
            for uid in uids
        }
        self._finished = trio.Event()
        self._nursery: trio.Nursery | None = None
        self._closing = False
        self._close_requested = trio.Event()
        # Experts whose gradients wait for their optimizer step, in order: the next job
        # the batcher forms steps them all first.
        self._due: list[_Hosted] = []
        self._steps_in_flight = 0
        self._no_steps = trio.Event()
        self._no_steps.set()

    @property
    def uids(self) -> list[str]:
        return list(self._experts)

    def hosts(self, uid: str) -> bool:
        return uid in self._experts

    def backend(self, uid: str) -> ExpertBackend:
        return self._hosted(uid).backend

    def _hosted(self, uid: str) -> _Hosted:
        hosted = self._experts.get(uid)
        if hosted is None:
            raise UnknownExpert(f"this server does not host {uid!r}")
        return hosted

    async def serve(self, *, task_status: TaskStatus[None] = trio.TASK_STATUS_IGNORED) -> None:
        """Run every expert's batchers until cancelled or ``close``d."""
        try:
            async with trio.open_nursery() as nursery:
                self._nursery = nursery
                await nursery.start(self.batcher.serve)
                logger.info("serving %d experts on %s", len(self._experts), self.device)
                expiry = trio.CancelScope()
                nursery.start_soon(self._expire_retained, expiry)
                task_status.started()
                # Experts may be added later (add_expert): stay until closed.
                await self._close_requested.wait()
                expiry.cancel()  # the batcher still finishes what is queued
        finally:
            self._nursery = None
            self.retained.clear()
            self._finished.set()

    async def _expire_retained(self, scope: trio.CancelScope) -> None:
        """Forwards kept past ``retain_s`` give their memory back even when no request
        comes to drop them."""
        with scope:
            while True:
                await trio.sleep(_EXPIRE_RETAINED_EVERY_S)
                self.retained.expire()

    def close(self) -> None:
        """Refuse new requests; queued ones still finish, then ``serve`` returns."""
        self._closing = True
        self._close_requested.set()
        for hosted in self._experts.values():
            for queue in hosted.queues:
                queue.close()
        self.batcher.close()

    def make_backend(self, uid: str, experts: ExpertsConfig) -> ExpertBackend:
        """A backend for ``uid`` with seeded initial weights, on this runtime's device.
        Builds the module on the calling thread (call it from a worker for big ones)."""
        return ExpertBackend(uid, experts, self.device, self._max_samples)

    async def add_expert(self, backend: ExpertBackend) -> None:
        """Start hosting ``backend`` (while ``serve`` runs): its queues start in the
        runtime's nursery and requests for its uid are taken from now on. Raises
        ValueError if the uid is hosted already, ShuttingDown once ``close`` was called."""
        if self._nursery is None or self._closing:
            raise ShuttingDown("the expert runtime is not running")
        if backend.uid in self._experts:
            raise ValueError(f"{backend.uid} is hosted already")
        hosted = _Hosted(backend, self.batcher, self.stacking, self._step_soon)
        self._experts[backend.uid] = hosted
        if self.on_experts_changed is not None:
            self.on_experts_changed([backend.uid], [])

    async def remove_expert(self, uid: str) -> ExpertBackend:
        """Stop hosting ``uid``: new requests for it get UnknownExpert at once, queued
        ones finish (their batches and the optimizer step they queued) before this
        returns. Returns the backend (its weights are intact, e.g. for a final save).
        Raises UnknownExpert."""
        hosted = self._hosted(uid)
        del self._experts[uid]
        if self.on_experts_changed is not None:
            self.on_experts_changed([], [uid])
        for queue in hosted.queues:
            queue.close()
        await hosted.stopped()
        await self.settled()  # the optimizer step queued behind its last backward
        return hosted.backend

    async def drained(self) -> None:
        """Wait until every queue is closed and empty (``serve`` has returned)."""
        await self._finished.wait()

    @property
    def max_samples(self) -> int:
        """The most samples one expert call may carry (the wire's and the batch cap)."""
        return self._max_samples

    def info(self, uid: str) -> ExpertInfo:
        return self._hosted(uid).backend.info

    async def forward(
        self,
        uid: str,
        tensors: Sequence[WireTensor],
        *,
        retain: bool = False,
        peer_id: str = "",
        source: str | None = None,
        compression: Compression = "none",
    ) -> tuple[TensorReply, list[bytes]]:
        """Outputs for ``tensors``; with ``retain`` the graph is kept (if memory allows)
        and the reply carries its handle. With ``compression`` floating-point tensors
        travel narrowed or quantized, both ways (``experts.tensor_codec``). ``source``
        is the party the device is shared by (the peer's address; None: the peer)."""
        hosted = self._hosted(uid)
        self.guard.check_peer(uid, peer_id)
        hosted.refuse_if_broken()
        hosted.last_used = time.time()
        info = hosted.backend.info
        metas = [t.meta for t in tensors]
        samples = check_against_schema(
            metas,
            info.inputs,
            max_samples=self._max_samples,
            max_sequence=self._max_sequence,
            compression=compression,
        )
        inputs = _decode(tensors, [s.dtype for s in info.inputs])
        self.guard.check_inputs(uid, peer_id, inputs)
        shape = tuple(m.shape[1:] for m in metas)
        reserved = None
        if retain and self.retained.enabled:
            input_bytes = sum(t.numel() * t.element_size() for t in inputs)
            reserved = self.retained.reserve(uid, samples, input_bytes)
        if reserved is not None:
            try:
                outputs, kept, version = await hosted.forward_retained.submit(
                    inputs, samples=samples, shape_key=shape, party=source or peer_id
                )
            except BaseException:
                self.retained.release(reserved)
                raise
            handle = self.retained.put(
                uid,
                peer_id,
                kept,
                reserved,
                samples,
                version,
                input_bytes=input_bytes,
                party=source or peer_id,
            )
            return _reply(outputs, compression, handle)
        outputs = await hosted.forward.submit(
            inputs, samples=samples, shape_key=shape, party=source or peer_id
        )
        return _reply(outputs, compression)

    async def backward(
        self,
        uid: str,
        tensors: Sequence[WireTensor],
        *,
        handle: str | None = None,
        peer_id: str = "",
        source: str | None = None,
        compression: Compression = "none",
    ) -> tuple[TensorReply, list[bytes]]:
        """Input gradients. ``tensors`` are the output gradients with a ``handle``, else
        the inputs followed by the output gradients. Raises ActivationsExpired for a
        handle this server no longer knows. ``source`` is what the guard's statistics
        count the gradients under (the peer's address; None: the peer)."""
        hosted = self._hosted(uid)
        self.guard.check_peer(uid, peer_id)
        hosted.refuse_if_broken()
        hosted.last_used = time.time()
        info = hosted.backend.info
        metas = [t.meta for t in tensors]
        if handle is not None:
            samples = check_against_schema(
                metas,
                info.outputs,
                max_samples=self._max_samples,
                max_sequence=self._max_sequence,
                compression=compression,
            )
            # Checked against the kept forward before it is taken: a backward refused for
            # its gradients (bad_shape, rejected) leaves it for a corrected retry.
            retained = self.retained.peek(handle, uid, peer_id)
            if retained is None:
                raise ActivationsExpired(f"{uid}: the forward for this backward is gone")
            made = tuple(retained.output.shape)
            if made != tuple(metas[0].shape):
                raise BadShape(
                    f"{uid}: output gradients of shape {tuple(metas[0].shape)} for a kept "
                    f"forward whose output is {made}"
                )
            grads, loudest, clipped = self.guard.clip_gradients(
                uid, peer_id, _decode(tensors, [s.dtype for s in info.outputs]), source=source
            )
            # No await since peek: this backward alone takes it (a second one with the
            # same handle finds it gone).
            kept = self.retained.take(handle, uid, peer_id)
            if kept is None:
                raise ActivationsExpired(f"{uid}: the forward for this backward is gone")
            try:
                result = await hosted.backward_retained.submit(
                    (
                        kept.retained,
                        grads,
                        Sender(peer_id, loudest, source or peer_id),
                        kept.version,
                    ),
                    samples=samples,
                    party=source or peer_id,
                )
            except Busy:
                # refused before it ran (a full lane, its place given to another party,
                # the expert being restored): the trainer may retry with the handle
                self.retained.give_back(kept)
                raise
            # its step was made due as the batch ran (``_Hosted``, gradients_in)
            return _reply(self.guard.unclipped(result, clipped), compression)
        schemas = [*info.inputs, *info.outputs]
        samples = check_against_schema(
            metas,
            schemas,
            max_samples=self._max_samples,
            max_sequence=self._max_sequence,
            compression=compression,
        )
        n_in = len(info.inputs)
        expected = output_shapes(info.expert_type, [m.shape for m in metas[:n_in]])
        got = [m.shape for m in metas[n_in:]]
        if got != expected:
            # the schemas leave a sequence open: inputs of one length with gradients of
            # another passed them, and failed in autograd (an internal error, logged)
            raise BadShape(
                f"output gradients of shapes {got} do not match the outputs {expected} "
                "of these inputs"
            )
        shape = tuple(m.shape[1:] for m in metas)
        decoded = _decode(tensors, [s.dtype for s in schemas])
        self.guard.check_inputs(uid, peer_id, decoded[:n_in])
        decoded[n_in:], loudest, clipped = self.guard.clip_gradients(
            uid, peer_id, decoded[n_in:], source=source
        )
        grads = await hosted.backward.submit(
            (decoded, Sender(peer_id, loudest, source or peer_id)),
            samples=samples,
            shape_key=shape,
            party=source or peer_id,
        )
        return _reply(self.guard.unclipped(grads, clipped), compression)

    def _step_soon(self, hosted: _Hosted, loudest: float) -> None:
        """Make the expert's optimizer step due behind the backward batch just computed
        (its replies go out first): the batcher's next job runs it before its batches.
        Backwards that finish before that job is formed share the step.

        A backward whose gradients are all zero (``loudest``: its largest row norm),
        or that has no rows at all, brings nothing to learn: it makes no step due. Adam
        would still move the weights by its momentum and count an update, so a peer
        sending empty backwards could otherwise add steps, and advance the expert's
        schedule, at its request rate."""
        if loudest <= 0.0 or hosted.step_pending or self._nursery is None:
            return
        hosted.step_pending = True
        self._due.append(hosted)
        self._steps_in_flight += 1
        if self._steps_in_flight == 1:
            self._no_steps = trio.Event()
        self.batcher.wake()

    def _due_steps(self) -> BeforeJob | None:
        """The optimizer steps due now, for the job being formed (the batcher asks on
        the trio thread): every expert that received gradients since its last step,
        stepped in one pass on the worker, with their outcomes handled afterwards; the
        parties whose gradients made each step due are charged its time."""
        if not self._due:
            return None
        due, self._due = self._due, []
        # Until the guard knows what an expert's gradients look like, every step gets
        # the full check (a few steps after a start); after that the cheap prediction,
        # whoever sent the gradients: the bounds do not depend on trust, and a check per
        # new identity would let fresh identities buy full checks for the price of a
        # request.
        audits = [not self.guard.warmed_up(h.backend.uid) for h in due]
        for hosted in due:
            hosted.step_pending = False  # from here on, new gradients wait for the next step
        check = self.step_check

        costs: dict[str, float] = {}  # worker time of the steps, per party that made them due

        def run() -> list[tuple[StepOutcome, list[Sender]] | BaseException]:
            senders = []
            for hosted in due:
                senders.append(hosted.senders)
                hosted.senders = []
            start = time.perf_counter()
            try:
                outcomes = step_many([h.backend for h in due], check, audits)
            except Exception as exc:  # a bug, not an attack: reported, the runtime goes on
                logger.exception("optimizer steps of %d experts failed", len(due))
                return [exc] * len(due)
            finally:
                share = (time.perf_counter() - start) / len(due)
                for hosted, heard in zip(due, senders, strict=True):
                    hosted.compute_s += share
                    for sender in heard:  # an expert's step is its senders' to pay
                        party = sender.party or sender.peer_id
                        costs[party] = costs.get(party, 0.0) + share / len(heard)
            for hosted, outcome in zip(due, outcomes, strict=True):
                if outcome.broken is not None:
                    hosted.broken = True
            return list(zip(outcomes, senders, strict=True))

        def after(results: list[tuple[StepOutcome, list[Sender]] | BaseException]) -> None:
            self.batcher.charge(costs)
            self._steps_in_flight -= len(due)
            for hosted, result in zip(due, results, strict=True):
                if isinstance(result, BaseException):
                    continue
                outcome, senders = result
                if outcome.broken is not None and self._nursery is not None:
                    self._steps_in_flight += 1  # settled() waits for the restore too
                    self._nursery.start_soon(self._restore_then_settle, hosted, outcome.broken)
                elif outcome.undone is not None:
                    self.guard.step_undone(hosted.backend.uid, outcome.undone, senders)
            if self._steps_in_flight == 0:
                self._no_steps.set()

        return run, after

    async def _restore_then_settle(self, hosted: _Hosted, reason: str) -> None:
        try:
            await self._restore(hosted, reason)
        finally:
            self._steps_in_flight -= 1
            if self._steps_in_flight == 0:
                self._no_steps.set()

    async def _restore(self, hosted: _Hosted, reason: str) -> None:
        """Give a broken expert good weights again: its newest checkpoint, else its
        seeded initial weights (and an empty optimizer state first, either way: the
        checkpoint may be of another optimizer). What was learnt since that checkpoint
        is lost."""
        backend = hosted.backend
        uid = backend.uid
        self.guard.step_broken(uid, reason)
        logger.error(
            "a step of %s left its weights non-finite (%s) although its bounds vouched "
            "for it, and could not be undone: restoring %s from its newest checkpoint; "
            "the updates since are lost",
            uid,
            reason,
            uid,
        )
        seeded = await trio.to_thread.run_sync(
            partial(ExpertBackend, uid, backend.config, torch.device("cpu"), self._max_samples)
        )
        await self.executor.run(partial(backend.load_state, seeded.state()))
        path = None
        if self.restore_checkpoint is not None:
            try:
                path = await self.restore_checkpoint(backend)
            except (CheckpointError, OSError) as exc:
                logger.error("could not restore %s from a checkpoint: %s", uid, exc)
        if path is None:
            logger.error("%s has no checkpoint: back to its seeded initial weights", uid)
        hosted.broken = False
        if self.on_error is not None:
            to = "its newest checkpoint" if path is not None else "its seeded initial weights"
            self.on_error(f"a step broke the weights of {uid}: back to {to}")

    async def settled(self) -> None:
        """Wait until every queued optimizer step has run."""
        await self._no_steps.wait()

    async def with_expert(self, uid: str, fn: Callable[[ExpertBackend], T]) -> T:
        """Run ``fn(backend)`` on the device's worker, in its turn: no batch or optimizer
        step runs meanwhile. For reading or writing the weights (checkpoints, replica
        averaging). Raises UnknownExpert."""
        backend = self._hosted(uid).backend
        return await self.executor.run(lambda: fn(backend))

    def statistics(self) -> list[ExpertStats]:
        return [
            ExpertStats(
                uid,
                _sum(h.forward.statistics(), h.forward_retained.statistics()),
                _sum(h.backward.statistics(), h.backward_retained.statistics()),
                h.backend.updates,
                h.compute_s,
                h.last_used,
                h.staleness.statistics(),
            )
            for uid, h in self._experts.items()
        ]

    def staleness_statistics(self) -> StalenessStats:
        """Staleness summed over the experts hosted now."""
        return sum((h.staleness.statistics() for h in self._experts.values()), StalenessStats())

    def retained_statistics(self) -> RetainedStats:
        return self.retained.statistics()


def _sum(a: QueueStats, b: QueueStats) -> QueueStats:
    return QueueStats(
        requests=a.requests + b.requests,
        samples=a.samples + b.samples,
        batches=a.batches + b.batches,
        refused_busy=a.refused_busy + b.refused_busy,
        waiting=a.waiting + b.waiting,
    )


def _decode(tensors: Sequence[WireTensor], dtypes: Sequence[str]) -> list[torch.Tensor]:
    """Wire tensors as torch tensors of the schema's dtypes (widening narrowed ones,
    dequantizing q8 ones; MalformedFrame for a q8 buffer no encoder makes)."""
    out = []
    for tensor, dtype in zip(tensors, dtypes, strict=True):
        decoded = from_wire(tensor)
        out.append(decoded if tensor.dtype == dtype else decoded.to(TORCH_DTYPES[dtype]))
    return out


def _reply(
    tensors: Sequence[torch.Tensor], compression: Compression = "none", handle: str | None = None
) -> tuple[TensorReply, list[bytes]]:
    encoded = [to_wire(t, compression) for t in tensors]
    return TensorReply(tensors=[m for m, _ in encoded], handle=handle), [b for _, b in encoded]
