"""Per-expert request queues and the batcher that turns waiting requests into batches.

Each queue is bounded: when it is full a request is refused at once with ``Busy``
instead of waiting without end. The batcher takes the first waiting request, then
keeps collecting for at most ``max_batch_wait_s`` or until ``max_batch_size`` samples
(or the executor's lower cap, a volunteer's limit) are in, taking only requests with
the same ``shape_key`` (others wait, in order, for a later batch), runs the batch's
compute function on the device executor, and hands each request its own result. With
``merge=False`` every request is its own batch.
"""

from __future__ import annotations

import logging
from collections import deque
from collections.abc import Callable, Hashable
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Generic, TypeVar

import trio

from volunteerd.config import RuntimeConfig
from volunteerd.errors import Busy, ShuttingDown
from volunteerd.runtime.executor import DeviceExecutor

if TYPE_CHECKING:
    # trio's TaskStatus as libp2p's trio-typing stubs spell it
    from trio_typing import TaskStatus

__all__ = ["BatchQueue", "QueueStats"]

logger = logging.getLogger(__name__)

T = TypeVar("T")
R = TypeVar("R")


@dataclass(slots=True)
class _Task(Generic[T, R]):
    item: T
    samples: int
    shape_key: Hashable
    done: trio.Event = field(default_factory=trio.Event)
    result: R | None = None
    error: BaseException | None = None


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


class BatchQueue(Generic[T, R]):
    """Requests for one expert and one kind of work. Start ``serve`` in a nursery, then
    ``submit``. ``compute`` maps a batch of items to their results, in order; it runs on
    the device's worker thread."""

    def __init__(
        self,
        name: str,
        compute: Callable[[list[T]], list[R]],
        executor: DeviceExecutor,
        config: RuntimeConfig,
        *,
        merge: bool = True,
    ) -> None:
        self.name = name
        self._compute = compute
        self._executor = executor
        self._config = config
        self._merge = merge
        self._send, self._recv = trio.open_memory_channel[_Task[T, R]](config.queue_size)
        self._carry: deque[_Task[T, R]] = deque()
        self._closed = False
        self._requests = 0
        self._samples = 0
        self._batches = 0
        self._refused = 0

    async def submit(self, item: T, *, samples: int, shape_key: Hashable = None) -> R:
        """Queue one request and wait for its result.

        Raises Busy at once when the queue is full, ShuttingDown after ``close``, and
        whatever the compute function raised for the batch.
        """
        if self._closed:
            raise ShuttingDown(f"{self.name} is stopping")
        task: _Task[T, R] = _Task(item, samples, shape_key)
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
        return task.result  # type: ignore[return-value]

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

    def _fits(self, batch: list[_Task[T, R]], samples: int, task: _Task[T, R]) -> bool:
        return (
            self._merge
            and task.shape_key == batch[0].shape_key
            and samples + task.samples <= self._executor.batch_limit(self._config.max_batch_size)
        )

    async def _next_batch(self) -> list[_Task[T, R]]:
        if self._carry:
            first = self._carry.popleft()
        else:
            try:
                first = await self._recv.receive()
            except trio.EndOfChannel:
                return []
        batch = [first]
        samples = first.samples
        if not self._merge:
            return batch
        # Requests of another shape wait for a later batch, in their order.
        for _ in range(len(self._carry)):
            task = self._carry.popleft()
            if self._fits(batch, samples, task):
                batch.append(task)
                samples += task.samples
            else:
                self._carry.append(task)
        with trio.move_on_after(self._config.max_batch_wait_s):
            while samples < self._executor.batch_limit(self._config.max_batch_size):
                try:
                    task = await self._recv.receive()
                except trio.EndOfChannel:
                    break
                if self._fits(batch, samples, task):
                    batch.append(task)
                    samples += task.samples
                else:
                    self._carry.append(task)
                    if task.shape_key == first.shape_key:
                        break  # the batch is full
        return batch

    async def _run(self, batch: list[_Task[T, R]]) -> None:
        items = [t.item for t in batch]
        samples = sum(t.samples for t in batch)
        try:
            results = await self._executor.run(lambda: self._compute(items))
        except Exception as exc:
            logger.exception("%s: batch of %d samples failed", self.name, samples)
            for task in batch:
                task.error = exc
                task.done.set()
            return
        self._requests += len(batch)
        self._samples += samples
        self._batches += 1
        for task, result in zip(batch, results, strict=True):
            task.result = result
            task.done.set()


def _drain(recv: trio.MemoryReceiveChannel[_Task[T, R]]) -> list[_Task[T, R]]:
    out = []
    while True:
        try:
            out.append(recv.receive_nowait())
        except (trio.WouldBlock, trio.EndOfChannel, trio.ClosedResourceError):
            return out
