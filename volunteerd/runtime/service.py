"""ExpertRuntime: the hosted experts behind the forward, backward and info verbs.

A request is checked against the expert's schema before any tensor is built, queued
on the expert's bounded queue (full: ``Busy`` at once), batched with others, computed
on the device worker, and answered with wire tensors. This module speaks wire types
only; the daemon binds it to the network.
"""

from __future__ import annotations

import logging
from collections.abc import Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING

import torch
import trio

from volunteerd.config import ExpertsConfig, RuntimeConfig, WireLimits
from volunteerd.errors import UnknownExpert
from volunteerd.experts import ExpertBackend, from_wire, to_wire
from volunteerd.runtime.batching import BatchQueue, QueueStats
from volunteerd.runtime.executor import DeviceExecutor
from volunteerd.wire import ExpertInfo, TensorReply, WireTensor, check_against_schema

if TYPE_CHECKING:
    # trio's TaskStatus as libp2p's trio-typing stubs spell it
    from trio_typing import TaskStatus

__all__ = ["ExpertRuntime", "ExpertStats"]

logger = logging.getLogger(__name__)


@dataclass(frozen=True, slots=True)
class ExpertStats:
    uid: str
    forward: QueueStats
    backward: QueueStats
    updates: int


@dataclass(slots=True)
class _Hosted:
    backend: ExpertBackend
    forward: BatchQueue
    backward: BatchQueue


class ExpertRuntime:
    """Hosts ``uids`` on ``device``. Start ``serve`` in a nursery before sending work."""

    def __init__(
        self,
        uids: Sequence[str],
        experts: ExpertsConfig,
        runtime: RuntimeConfig,
        limits: WireLimits,
        device: torch.device,
    ) -> None:
        self.device = device
        self.executor = DeviceExecutor(device)
        self._limits = limits
        self._max_samples = min(limits.max_request_samples, runtime.max_batch_size)
        self._experts: dict[str, _Hosted] = {}
        self._closed = False
        self._finished = trio.Event()
        for uid in uids:
            backend = ExpertBackend(uid, experts, device, self._max_samples)
            n_in = len(backend.info.inputs)

            def backward(
                joined: list[torch.Tensor], b: ExpertBackend = backend, n: int = n_in
            ) -> list[torch.Tensor]:
                return b.backward(joined[:n], joined[n:])

            self._experts[uid] = _Hosted(
                backend,
                BatchQueue(f"{uid}/forward", backend.forward, self.executor, runtime),
                BatchQueue(f"{uid}/backward", backward, self.executor, runtime),
            )

    @property
    def uids(self) -> list[str]:
        return list(self._experts)

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
                for hosted in self._experts.values():
                    await nursery.start(hosted.forward.serve)
                    await nursery.start(hosted.backward.serve)
                logger.info("serving %d experts on %s", len(self._experts), self.device)
                task_status.started()
        finally:
            self._finished.set()

    def close(self) -> None:
        """Refuse new requests; queued ones still finish, then ``serve`` returns."""
        for hosted in self._experts.values():
            hosted.forward.close()
            hosted.backward.close()
        self._closed = True

    async def drained(self) -> None:
        """Wait until every queue is closed and empty (``serve`` has returned)."""
        await self._finished.wait()

    def info(self, uid: str) -> ExpertInfo:
        return self._hosted(uid).backend.info

    async def forward(
        self, uid: str, tensors: Sequence[WireTensor]
    ) -> tuple[TensorReply, list[bytes]]:
        hosted = self._hosted(uid)
        info = hosted.backend.info
        check_against_schema([t.meta for t in tensors], info.inputs, max_samples=self._max_samples)
        outputs = await hosted.forward.submit([from_wire(t) for t in tensors])
        return _reply(outputs)

    async def backward(
        self, uid: str, tensors: Sequence[WireTensor]
    ) -> tuple[TensorReply, list[bytes]]:
        """``tensors`` = the inputs, then the gradients of the outputs."""
        hosted = self._hosted(uid)
        info = hosted.backend.info
        check_against_schema(
            [t.meta for t in tensors],
            [*info.inputs, *info.outputs],
            max_samples=self._max_samples,
        )
        grads = await hosted.backward.submit([from_wire(t) for t in tensors])
        return _reply(grads)

    def statistics(self) -> list[ExpertStats]:
        return [
            ExpertStats(
                uid,
                h.forward.statistics(),
                h.backward.statistics(),
                h.backend.updates,
            )
            for uid, h in self._experts.items()
        ]


def _reply(tensors: Sequence[torch.Tensor]) -> tuple[TensorReply, list[bytes]]:
    encoded = [to_wire(t) for t in tensors]
    return TensorReply(tensors=[m for m, _ in encoded]), [b for _, b in encoded]
