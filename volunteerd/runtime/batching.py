"""Lanes of requests and the device's batcher, which runs many experts' batches per
hand-off to the worker thread.

A **lane** holds one expert's requests of one kind (forward, backward, ...). It is
bounded: when ``queue_size`` requests are already waiting in it, a new one is refused
at once with ``Busy`` instead of waiting without end.

The **batcher** (one per device) takes the waiting requests of *every* lane into one
**job**: it waits at most ``max_batch_wait_s`` after the oldest waiting request for
more to come (less when the oldest one's batch is already full; not at all while that
lane's waiting has not paid, below), groups the requests
by lane and ``shape_key`` into batches of at most ``max_batch_size`` samples (or the
executor's lower cap, a volunteer's limit; requests that do not fit wait, in order,
for the next job), and runs the whole job in one call on the device executor's worker
thread: first the work due before any batch (the runtime's optimizer steps, see
``before_job``), then each batch's compute function, each handing every request its
own result. A batch whose compute fails fails only its own requests.

Requests that arrive while a job runs have waited already: the next job takes them
at once. Under load, concurrent requests for the same expert (several trainers, or
one trainer's several batches in flight) therefore merge into larger batches, and a
server answering a message that names eight experts pays one thread hand-off, not
eight. With ``merge=False`` every request of a lane is its own batch (still in the
same job as the others).

Waiting pays only where requests for the same expert come close together. A lane
whose last ``FRUITLESS_WAITS`` waits each brought no second request stops waiting (one
trainer calling an expert once per pass gains nothing from it and would lose
``max_batch_wait_s`` per pass) until one of its batches holds several requests again,
which happens by itself under load: requests that arrive while a job runs merge
without any wait. (One fruitless wait is not enough: two clients of an expert that
meet in every other wait would otherwise stop meeting at all.)

Lanes made ``together`` with the same key (one kind of request to experts of one
architecture and size, where the runtime stacks experts: see ``experts.stacked``) may
run as one call: when a job holds batches of several such lanes, ``Together.run`` gets
them all and answers each batch. A batch it answers with an exception fails alone; if
the call itself raises, each batch runs on its own compute function instead.
"""

from __future__ import annotations

import copy
import logging
from collections import deque
from collections.abc import Callable, Hashable
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, Generic, TypeVar

import trio

from volunteerd.config import RuntimeConfig
from volunteerd.errors import Busy, ShuttingDown, VolunteerdError
from volunteerd.runtime.executor import DeviceExecutor

if TYPE_CHECKING:
    # trio's TaskStatus as libp2p's trio-typing stubs spell it
    from trio_typing import TaskStatus

__all__ = ["FRUITLESS_WAITS", "BeforeJob", "DeviceBatcher", "Lane", "QueueStats", "Together"]

logger = logging.getLogger(__name__)

# Waits in a row that brought a lane no second request before it stops waiting.
FRUITLESS_WAITS = 8

T = TypeVar("T")
R = TypeVar("R")
X = TypeVar("X")

# What ``DeviceBatcher.before_job`` hands the batcher: work to run on the worker thread
# before the job's batches, and what to do with its result back on the trio thread.
BeforeJob = tuple[Callable[[], Any], Callable[[Any], None]]


@dataclass(frozen=True, slots=True)
class Together:
    """Lanes whose batches may run as one call. ``run`` gets, per batch, the lane's
    ``member`` and the batch's items, and returns per batch its results in order or the
    exception that fails that batch; it must change nothing before it can answer every
    batch (if it raises, each batch runs on its own compute function)."""

    key: Hashable
    member: Any
    run: Callable[[list[tuple[Any, list[Any]]]], list[list[Any] | Exception]]


@dataclass(slots=True)
class _Task(Generic[T, R]):
    lane: Lane[T, R]
    item: T
    samples: int
    shape_key: Hashable
    arrived: float
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


class Lane(Generic[T, R]):
    """One expert's requests of one kind. ``compute`` maps a batch of items to their
    results, in order; it runs on the device's worker thread."""

    def __init__(
        self,
        batcher: DeviceBatcher,
        name: str,
        compute: Callable[[list[T]], list[R]],
        *,
        merge: bool = True,
        together: Together | None = None,
    ) -> None:
        self.name = name
        self.compute = compute
        self.merge = merge
        self.together = together
        self._batcher = batcher
        self._closed = False
        self._waiting = 0  # submitted, not yet taken into a job
        self._unfinished = 0  # submitted, not yet answered
        self._finished = trio.Event()
        # Waits in a row that brought no second request (reset by any batch of several).
        self.fruitless_waits = 0
        self._requests = 0
        self._samples = 0
        self._batches = 0
        self._refused = 0

    async def submit(self, item: T, *, samples: int, shape_key: Hashable = None) -> R:
        """Queue one request and wait for its result.

        Raises Busy at once when the lane is full, ShuttingDown after ``close``, and
        whatever the compute function raised for the batch."""
        if self._closed or self._batcher.closing:
            raise ShuttingDown(f"{self.name} is stopping")
        if self._waiting >= self._batcher.config.queue_size:
            self._refused += 1
            raise Busy(f"{self.name}: {self._batcher.config.queue_size} requests already waiting")
        task: _Task[T, R] = _Task(self, item, samples, shape_key, trio.current_time())
        self._waiting += 1
        self._unfinished += 1
        self._batcher._put(task)
        await task.done.wait()
        if task.error is not None:
            raise task.error
        return task.result  # type: ignore[return-value]

    def close(self) -> None:
        """Refuse new requests; the queued ones are still answered (``finished``)."""
        self._closed = True
        if self._unfinished == 0:
            self._finished.set()

    async def finished(self) -> None:
        """Wait until the lane is closed and every request it took is answered."""
        await self._finished.wait()

    def statistics(self) -> QueueStats:
        return QueueStats(
            requests=self._requests,
            samples=self._samples,
            batches=self._batches,
            refused_busy=self._refused,
            waiting=self._waiting,
        )

    def _answered(self, tasks: list[_Task[T, R]], ran: bool) -> None:
        if ran:
            self._requests += len(tasks)
            self._samples += sum(t.samples for t in tasks)
            self._batches += 1
        self._unfinished -= len(tasks)
        for task in tasks:
            task.done.set()
        if self._closed and self._unfinished == 0:
            self._finished.set()


@dataclass(slots=True)
class _Batch:
    lane: Lane[Any, Any]
    tasks: list[_Task[Any, Any]]
    results: list[Any] | None = None
    error: BaseException | None = None


class DeviceBatcher:
    """The lanes of one device and the loop that runs them. Make lanes with ``lane``,
    start ``serve`` in a nursery, then submit to the lanes."""

    def __init__(self, executor: DeviceExecutor, config: RuntimeConfig) -> None:
        self.executor = executor
        self.config = config
        # Called on the trio thread as each job is formed: work that must run on the
        # worker before the job's batches (and after those of the previous job), or
        # None. The runtime's optimizer steps come this way.
        self.before_job: Callable[[], BeforeJob | None] | None = None
        self.closing = False
        self._queue: deque[_Task[Any, Any]] = deque()
        self._wakeup = trio.Event()
        self._jobs = 0

    def lane(
        self,
        name: str,
        compute: Callable[[list[T]], list[R]],
        *,
        merge: bool = True,
        together: Together | None = None,
    ) -> Lane[T, R]:
        return Lane(self, name, compute, merge=merge, together=together)

    def wake(self) -> None:
        """Form a job now even if no request waits (``before_job`` has work)."""
        self._wakeup.set()

    def close(self) -> None:
        """Refuse new requests; ``serve`` answers what is queued and returns."""
        self.closing = True
        self._wakeup.set()

    @property
    def jobs(self) -> int:
        """Jobs run so far (each one hand-off to the worker)."""
        return self._jobs

    def _put(self, task: _Task[Any, Any]) -> None:
        self._queue.append(task)
        self._wakeup.set()

    async def serve(self, *, task_status: TaskStatus[None] = trio.TASK_STATUS_IGNORED) -> None:
        task_status.started()
        try:
            while True:
                if not self._queue:
                    before = self.before_job() if self.before_job is not None else None
                    if before is not None:
                        await self._run([], before)
                        continue
                    if self.closing:
                        return
                    self._wakeup = trio.Event()
                    await self._wakeup.wait()
                    continue
                waited = self._queue[0].lane if await self._wait_for_more() else None
                batches = self._take()
                for batch in batches:
                    if len(batch.tasks) > 1:
                        batch.lane.fruitless_waits = 0
                    elif batch.lane is waited:
                        batch.lane.fruitless_waits += 1
                before = self.before_job() if self.before_job is not None else None
                await self._run(batches, before)
        finally:
            stopped = ShuttingDown("the device's batcher stopped")
            while self._queue:
                task = self._queue.popleft()
                task.lane._waiting -= 1
                task.error = stopped
                task.lane._answered([task], ran=False)

    def _limit(self) -> int:
        return self.executor.batch_limit(self.config.max_batch_size)

    async def _wait_for_more(self) -> bool:
        """Until ``max_batch_wait_s`` after the oldest waiting request, or until its
        batch is full; not at all when waiting does not pay for its lane. True when
        it waited."""
        first = self._queue[0]
        if not first.lane.merge or first.lane.fruitless_waits >= FRUITLESS_WAITS:
            return False
        deadline = first.arrived + self.config.max_batch_wait_s
        waited = False
        while trio.current_time() < deadline and not self.closing:
            samples = sum(
                t.samples
                for t in self._queue
                if t.lane is first.lane and t.shape_key == first.shape_key
            )
            if samples >= self._limit():
                break
            waited = True
            self._wakeup = trio.Event()
            with trio.move_on_at(deadline):
                await self._wakeup.wait()
        return waited

    def _take(self) -> list[_Batch]:
        """The waiting requests as batches, in order of their first request; those
        that do not fit their batch's budget stay queued, in order."""
        limit = self._limit()
        batches: list[_Batch] = []
        open_batches: dict[tuple[int, Hashable], tuple[_Batch, int]] = {}
        full: set[tuple[int, Hashable]] = set()
        left: deque[_Task[Any, Any]] = deque()
        for task in self._queue:
            lane = task.lane
            key = (id(lane), task.shape_key)
            if not lane.merge:
                batches.append(_Batch(lane, [task]))
                continue
            if key in full:
                left.append(task)
                continue
            entry = open_batches.get(key)
            if entry is None:
                batch = _Batch(lane, [task])
                batches.append(batch)
                open_batches[key] = (batch, task.samples)
                continue
            batch, samples = entry
            if samples + task.samples > limit:
                full.add(key)  # later requests of this batch wait, in order
                left.append(task)
                continue
            batch.tasks.append(task)
            open_batches[key] = (batch, samples + task.samples)
        self._queue = left
        for batch in batches:
            batch.lane._waiting -= len(batch.tasks)
        return batches

    async def _run(self, batches: list[_Batch], before: BeforeJob | None) -> None:
        def job() -> Any:
            # The work before the batches must not raise (the runtime's steps report
            # their failures in their result); if it does, the batches still run.
            ahead = None
            if before is not None:
                try:
                    ahead = before[0]()
                except Exception as exc:
                    logger.exception("the work before a job failed")
                    ahead = exc
            groups: dict[Hashable, list[_Batch]] = {}
            for batch in batches:
                if batch.lane.together is not None:
                    groups.setdefault(batch.lane.together.key, []).append(batch)
            for batch in batches:
                together = batch.lane.together
                group = groups.pop(together.key, []) if together is not None else []
                if len(group) > 1 and together is not None:
                    _compute_together(together, group)
                elif batch.results is None and batch.error is None:
                    _compute(batch)
            return ahead

        try:
            ahead = await self.executor.run(job)
        except BaseException as exc:
            # The job itself failed (the work before the batches, or cancellation):
            # its requests get the error, nothing else is lost.
            for batch in batches:
                if batch.results is None and batch.error is None:
                    batch.error = exc if isinstance(exc, Exception) else ShuttingDown("stopped")
            self._answer(batches)
            raise
        self._jobs += 1
        self._answer(batches)
        if before is not None:
            before[1](ahead)

    @staticmethod
    def _answer(batches: list[_Batch]) -> None:
        for batch in batches:
            if batch.results is not None and len(batch.results) != len(batch.tasks):
                batch.error = RuntimeError(
                    f"{batch.lane.name}: {len(batch.results)} results for {len(batch.tasks)}"
                )
            if batch.error is None and batch.results is not None:
                for task, result in zip(batch.tasks, batch.results, strict=True):
                    task.result = result
                batch.lane._answered(batch.tasks, ran=True)
            else:
                for task in batch.tasks:
                    task.error = _own_copy(batch.error)
                batch.lane._answered(batch.tasks, ran=False)


def _own_copy(error: BaseException | None) -> BaseException | None:
    """The batch's error for one of its requests. One exception object raised again by
    each request's task gathers every task's frames into its traceback: a batch of 64
    failed requests logged 64 tracebacks, each longer than the last (~2 MB of log per
    batch). A copy shares the worker's frames and adds only its own task's."""
    if error is None:
        return None
    try:
        mine = copy.copy(error)
    except Exception:  # an exception class that cannot be rebuilt from its args
        return error
    mine.__traceback__ = error.__traceback__
    mine.__cause__ = error.__cause__
    mine.__context__ = error.__context__
    mine.__suppress_context__ = error.__suppress_context__
    return mine


def _compute(batch: _Batch) -> None:
    try:
        batch.results = batch.lane.compute([t.item for t in batch.tasks])
    except Exception as exc:  # one batch's failure is its requests' only
        batch_failed(batch.lane.name, exc)
        batch.error = exc


def batch_failed(lane: str, exc: Exception) -> None:
    """Log a batch's failure. A typed error is its requests' own (a bad shape, an
    expert being restored) and their replies say so; anything else is a bug, worth its
    traceback."""
    typed = isinstance(exc, VolunteerdError)
    logger.log(
        logging.DEBUG if typed else logging.ERROR,
        "%s: batch failed: %s",
        lane,
        exc,
        exc_info=not typed,
    )


def _compute_together(together: Together, group: list[_Batch]) -> None:
    """The batches of ``group`` in one call, each alone if that call fails."""
    try:
        # every lane of the group has a Together of the same key
        members = [b.lane.together.member for b in group]  # type: ignore[union-attr]
        answers = together.run(
            [(member, [t.item for t in b.tasks]) for member, b in zip(members, group, strict=True)]
        )
        if len(answers) != len(group):
            raise RuntimeError(f"{len(answers)} answers for {len(group)} batches")
    except Exception:
        logger.exception("%d batches together failed; running them one by one", len(group))
        for batch in group:
            _compute(batch)
        return
    for batch, answer in zip(group, answers, strict=True):
        if isinstance(answer, Exception):
            batch.error = answer
        else:
            batch.results = answer
