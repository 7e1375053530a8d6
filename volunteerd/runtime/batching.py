"""Per-expert request queues and the batcher that turns waiting requests into batches.

Each queue is bounded: when it is full a request is refused at once with ``Busy``
instead of waiting without end. The batcher takes the first waiting request, then
keeps collecting for at most ``max_batch_wait_s`` or until ``max_batch_size`` samples
are in, concatenates requests whose non-batch shapes agree, runs the batch on the
device executor, and hands each request its slice of the result.
"""

from __future__ import annotations

import logging
from collections import deque
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

import torch
import trio

from volunteerd.config import RuntimeConfig
from volunteerd.errors import Busy, ShuttingDown
from volunteerd.runtime.executor import DeviceExecutor

if TYPE_CHECKING:
    # trio's TaskStatus as libp2p's trio-typing stubs spell it
    from trio_typing import TaskStatus

__all__ = ["BatchFn", "BatchQueue", "QueueStats"]

logger = logging.getLogger(__name__)

# Computes one batch: concatenated tensors in, concatenated tensors out.
BatchFn = Callable[[list[torch.Tensor]], list[torch.Tensor]]


@dataclass(slots=True)
class _Task:
    tensors: Sequence[torch.Tensor]
    samples: int
    done: trio.Event = field(default_factory=trio.Event)
    result: list[torch.Tensor] | None = None
    error: BaseException | None = None

    @property
    def shape_key(self) -> tuple[tuple[int, ...], ...]:
        return tuple(tuple(t.shape[1:]) for t in self.tensors)


@dataclass(frozen=True, slots=True)
class QueueStats:
    requests: int
    samples: int
    batches: int
    refused_busy: int
    waiting: int

    @property
    def mean_batch_samples(self) -> float:
        return self.samples / self.batches if self.batches else 0.0


class BatchQueue:
    """Requests for one expert and one verb. Start ``serve`` in a nursery, then ``submit``."""

    def __init__(
        self, name: str, compute: BatchFn, executor: DeviceExecutor, config: RuntimeConfig
    ) -> None:
        self.name = name
        self._compute = compute
        self._executor = executor
        self._config = config
        self._send, self._recv = trio.open_memory_channel[_Task](config.queue_size)
        self._carry: deque[_Task] = deque()
        self._closed = False
        self._requests = 0
        self._samples = 0
        self._batches = 0
        self._refused = 0

    async def submit(self, tensors: Sequence[torch.Tensor]) -> list[torch.Tensor]:
        """Queue one request (first dimension = samples) and wait for its outputs.

        Raises Busy at once when the queue is full, ShuttingDown after ``close``.
        """
        if self._closed:
            raise ShuttingDown(f"{self.name} is stopping")
        task = _Task(tensors, int(tensors[0].shape[0]))
        try:
            self._send.send_nowait(task)
        except trio.WouldBlock:
            self._refused += 1
            raise Busy(f"{self.name}: {self._config.queue_size} requests already waiting") from None
        except (trio.ClosedResourceError, trio.BrokenResourceError):
            raise ShuttingDown(f"{self.name} is stopping") from None
        await task.done.wait()
        if task.error is not None:
            raise task.error
        if task.result is None:  # pragma: no cover - done is set only with one of the two
            raise ShuttingDown(f"{self.name} is stopping")
        return task.result

    def close(self) -> None:
        """Refuse new requests; ``serve`` finishes what is queued and returns."""
        self._closed = True
        self._send.close()

    def statistics(self) -> QueueStats:
        return QueueStats(
            requests=self._requests,
            samples=self._samples,
            batches=self._batches,
            refused_busy=self._refused,
            waiting=self._recv.statistics().current_buffer_used + len(self._carry),
        )

    async def serve(self, *, task_status: TaskStatus[None] = trio.TASK_STATUS_IGNORED) -> None:
        task_status.started()
        try:
            while True:
                batch = await self._next_batch()
                if not batch:
                    return
                await self._run(batch)
        finally:
            for task in [*self._carry, *_drain(self._recv)]:
                task.error = ShuttingDown(f"{self.name} stopped")
                task.done.set()

    async def _next_batch(self) -> list[_Task]:
        if self._carry:
            first = self._carry.popleft()
        else:
            try:
                first = await self._recv.receive()
            except trio.EndOfChannel:
                return []
        batch = [first]
        samples = first.samples
        key = first.shape_key
        # Requests of another shape wait for the next batch, in their order.
        for _ in range(len(self._carry)):
            task = self._carry.popleft()
            if task.shape_key == key and samples + task.samples <= self._config.max_batch_size:
                batch.append(task)
                samples += task.samples
            else:
                self._carry.append(task)
        with trio.move_on_after(self._config.max_batch_wait_s):
            while samples < self._config.max_batch_size:
                try:
                    task = await self._recv.receive()
                except trio.EndOfChannel:
                    break
                if task.shape_key == key and samples + task.samples <= self._config.max_batch_size:
                    batch.append(task)
                    samples += task.samples
                else:
                    self._carry.append(task)
                    if task.shape_key == key:
                        break  # the batch is full
        return batch

    async def _run(self, batch: list[_Task]) -> None:
        sizes = [t.samples for t in batch]
        columns = list(zip(*(t.tensors for t in batch), strict=True))

        def compute() -> list[list[torch.Tensor]]:
            joined = [c[0] if len(c) == 1 else torch.cat(c) for c in columns]
            outputs = self._compute(joined)
            if len(batch) == 1:
                return [outputs]
            pieces = [o.split(sizes) for o in outputs]
            return [[p[i] for p in pieces] for i in range(len(batch))]

        try:
            results = await self._executor.run(compute)
        except Exception as exc:
            logger.exception("%s: batch of %d samples failed", self.name, sum(sizes))
            for task in batch:
                task.error = exc
                task.done.set()
            return
        self._requests += len(batch)
        self._samples += sum(sizes)
        self._batches += 1
        for task, result in zip(batch, results, strict=True):
            task.result = result
            task.done.set()


def _drain(recv: trio.MemoryReceiveChannel[_Task]) -> list[_Task]:
    out = []
    while True:
        try:
            out.append(recv.receive_nowait())
        except (trio.WouldBlock, trio.EndOfChannel, trio.ClosedResourceError):
            return out
