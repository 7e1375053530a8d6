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

**Parties share the device.** Every request names its *party* (the runtime gives the
address of the peer's connection, or the peer's id where it has none, so all the
identities of one machine are one party). While several parties are active (a request
waiting or served in the last ``RECENT_S``) the batcher counts each party's worker
time (its batches', and what the runtime ``charge``s it for: the optimizer steps its
gradients made due), decaying with a half-life of ``USAGE_HALF_LIFE_S``; a party alone
with the device is charged nothing, so a trainer that had it to itself does not look
heavy to a newcomer. A party that used more than ``HEAVY_RATIO`` times the lightest
one's (and more than ``HEAVY_SLACK_S``) is *heavy*: its requests wait while a lighter
party's run, and a job of heavy parties' requests alone holds as many as take about
``HEAVY_JOB_S`` of the worker with the optimizer steps due before them (starting at one
request, at most one batch budget: ``_adapt``), so a lighter party waits about that
long for the device however much a heavy one asks for. Other requests are taken in
turns: every party's first waiting request before any party's second, the least-used
party's first within a round, so a queue of one party's holds another's request for
at most one batch even before that party counts as heavy. A party found heavy stays
*held* until its use comes down to ``CALM_RATIO`` times the lightest one's and it asks
for no more than a held party may add to a job (or no other party is active; held,
its use is only what the cap lets it have): while it is merely held
(under the bar, so its requests are not deferred) it adds at most that many samples
to any job, so it never gets a whole job of its waiting requests by dipping under the
bar now and then. The rule is work-conserving (a heavy party is served whenever no
lighter one waits) and does nothing to parties of similar use, whose requests still
merge. A full lane refuses the newcomer unless another party holds at
least two more of its waiting places; then the party with the most gives up its
newest one (``Busy``). A job holds at most ``JOB_BATCHES`` times the batch budget in
samples, so a party that has the device to itself keeps a newcomer waiting at most
that long. With ``fair=False`` (``runtime.fair_share``) parties are not told apart
(the bound on a job stays).

Lanes made ``together`` with the same key (one kind of request to experts of one
architecture and size, where the runtime stacks experts: see ``experts.stacked``) may
run as one call: when a job holds batches of several such lanes, ``Together.run`` gets
them all and answers each batch. A batch it answers with an exception fails alone; if
the call itself raises, each batch runs on its own compute function instead.
"""

from __future__ import annotations

import contextlib
import copy
import logging
import time
from collections import deque
from collections.abc import Callable, Hashable, Mapping
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, Generic, TypeVar

import trio

from volunteerd.config import RuntimeConfig
from volunteerd.errors import Busy, ShuttingDown, VolunteerdError
from volunteerd.runtime.executor import DeviceExecutor

if TYPE_CHECKING:
    # trio's TaskStatus as libp2p's trio-typing stubs spell it
    from trio_typing import TaskStatus

__all__ = [
    "FRUITLESS_WAITS",
    "BeforeJob",
    "DeviceBatcher",
    "FairStats",
    "Lane",
    "QueueStats",
    "Together",
]

logger = logging.getLogger(__name__)

# Waits in a row that brought a lane no second request before it stops waiting.
FRUITLESS_WAITS = 8

# Sharing the device among parties (see the module's docstring).
USAGE_HALF_LIFE_S = 2.0  # a party's worker time halves every this many seconds
RECENT_S = 5.0  # a party that submitted within this long is active
HEAVY_RATIO = 4.0  # heavy: more than this many times the lightest active party's time
CALM_RATIO = 2.0  # a heavy party stays held to small jobs until it uses less than this
HEAVY_SLACK_S = 0.05  # ... and more than this (decayed seconds of worker time)
JOB_BATCHES = 8  # a job holds at most this many batch budgets of samples
HEAVY_JOB_S = 0.05  # what a job of heavy parties' alone should take at most

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
    party: Hashable = None
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


@dataclass(frozen=True, slots=True)
class FairStats:
    """How the device was shared: requests held back while a lighter party's ran
    (``deferred``, counted once per job that held them), waiting requests that gave
    their place in a full lane to another party's (``evicted``), and the parties
    active now with their decayed worker time in seconds (``usage``)."""

    deferred: int
    evicted: int
    usage: dict[str, float]


class Lane(Generic[T, R]):
    """One expert's requests of one kind. ``compute`` maps a batch of items to their
    results, in order; it runs on the device's worker thread. ``on_ran`` is told (on the
    trio thread) the items of each batch that ran, whether or not their callers still
    wait: work with an effect (gradients added) follows it up there."""

    def __init__(
        self,
        batcher: DeviceBatcher,
        name: str,
        compute: Callable[[list[T]], list[R]],
        *,
        merge: bool = True,
        together: Together | None = None,
        on_ran: Callable[[list[T]], None] | None = None,
    ) -> None:
        self.name = name
        self.compute = compute
        self.merge = merge
        self.together = together
        self.on_ran = on_ran
        self._batcher = batcher
        self._closed = False
        self._waiting = 0  # submitted, not yet taken into a job
        self._party_waiting: dict[Hashable, int] = {}  # the same, per party
        self._unfinished = 0  # submitted, not yet answered
        self._finished = trio.Event()
        # Waits in a row that brought no second request (reset by any batch of several).
        self.fruitless_waits = 0
        self._requests = 0
        self._samples = 0
        self._batches = 0
        self._refused = 0

    async def submit(
        self, item: T, *, samples: int, shape_key: Hashable = None, party: Hashable = None
    ) -> R:
        """Queue one request of ``party`` and wait for its result.

        Raises Busy at once when the lane is full (or later, when a party with fewer
        waiting requests took this one's place), ShuttingDown after ``close``, and
        whatever the compute function raised for the batch."""
        if self._closed or self._batcher.closing:
            raise ShuttingDown(f"{self.name} is stopping")
        if self._waiting >= self._batcher.config.queue_size and not self._make_room(party):
            self._refused += 1
            raise Busy(f"{self.name}: {self._batcher.config.queue_size} requests already waiting")
        task: _Task[T, R] = _Task(self, item, samples, shape_key, trio.current_time(), party)
        self._waiting += 1
        self._party_waiting[party] = self._party_waiting.get(party, 0) + 1
        self._unfinished += 1
        self._batcher._put(task)
        await task.done.wait()
        if task.error is not None:
            raise task.error
        return task.result  # type: ignore[return-value]

    def _make_room(self, party: Hashable) -> bool:
        """In a full lane, the newest waiting request of the party that has the most
        waiting here gives its place to ``party``, if ``party`` has at least two fewer
        (with one fewer, the swap would only turn the two round)."""
        if not self._batcher.fair:
            return False
        mine = self._party_waiting.get(party, 0)
        victim, most = max(self._party_waiting.items(), key=lambda kv: kv[1])
        if most <= mine + 1:
            return False
        task = self._batcher._evict(self, victim)
        if task is None:
            return False
        self._took([task])
        self._refused += 1
        task.error = Busy(
            f"{self.name}: {self._batcher.config.queue_size} requests already waiting; "
            "this one gave its place to another party's"
        )
        self._answered([task], ran=False)
        return True

    def _took(self, tasks: list[_Task[T, R]]) -> None:
        """``tasks`` left the waiting line (taken into a job, or evicted)."""
        self._waiting -= len(tasks)
        for task in tasks:
            left = self._party_waiting[task.party] - 1
            if left:
                self._party_waiting[task.party] = left
            else:
                del self._party_waiting[task.party]

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
            if self.on_ran is not None:
                self.on_ran([t.item for t in tasks])
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
    seconds: float = 0.0  # worker time, set on the worker

    @property
    def samples(self) -> int:
        return sum(t.samples for t in self.tasks)


class DeviceBatcher:
    """The lanes of one device and the loop that runs them. Make lanes with ``lane``,
    start ``serve`` in a nursery, then submit to the lanes."""

    def __init__(
        self, executor: DeviceExecutor, config: RuntimeConfig, *, fair: bool | None = None
    ) -> None:
        self.executor = executor
        self.config = config
        self.fair = config.fair_share if fair is None else fair
        # Per party: worker time (seconds, decayed), and when it last submitted.
        self._usage: dict[Hashable, float] = {}
        self._seen: dict[Hashable, float] = {}
        self._decayed_at: float | None = None
        self._deferred = 0
        self._evicted = 0
        # Samples a job of heavy parties' alone may hold, adapted to what such jobs
        # take (their optimizer steps included): see ``_adapt``. It starts at one
        # request and grows: a first heavy job of a whole batch budget of one-row
        # backwards made a second of steps due, which a light party then waited for.
        self._heavy_budget = 1
        self._heavy_job = False  # the job being formed holds heavy parties' only
        # Parties found heavy that have not come down to CALM_RATIO since: their
        # requests in any job hold at most ``_heavy_budget`` samples.
        self._held: set[Hashable] = set()
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
        on_ran: Callable[[list[T]], None] | None = None,
    ) -> Lane[T, R]:
        return Lane(self, name, compute, merge=merge, together=together, on_ran=on_ran)

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

    def statistics(self) -> FairStats:
        with contextlib.suppress(RuntimeError):  # outside trio: as last decayed
            self._decay(trio.current_time())
        return FairStats(
            deferred=self._deferred,
            evicted=self._evicted,
            usage={str(p): round(u, 4) for p, u in self._usage.items()},
        )

    def _put(self, task: _Task[Any, Any]) -> None:
        self._queue.append(task)
        self._seen[task.party] = task.arrived
        self._wakeup.set()

    def _evict(self, lane: Lane[Any, Any], party: Hashable) -> _Task[Any, Any] | None:
        """Take the newest waiting request of ``party`` in ``lane`` out of the queue."""
        for index in range(len(self._queue) - 1, -1, -1):
            task = self._queue[index]
            if task.lane is lane and task.party == party:
                del self._queue[index]
                self._evicted += 1
                return task
        return None

    # -- sharing among parties ------------------------------------------------------------

    def _decay(self, now: float) -> None:
        if self._decayed_at is None or now <= self._decayed_at:
            self._decayed_at = now if self._decayed_at is None else self._decayed_at
            return
        factor = 0.5 ** ((now - self._decayed_at) / USAGE_HALF_LIFE_S)
        self._decayed_at = now
        for party in self._usage:
            self._usage[party] *= factor
        waiting = {task.party for task in self._queue}
        for party, seen in list(self._seen.items()):
            if now - seen > RECENT_S and party not in waiting:
                del self._seen[party]
                # what it used is forgotten with it: after RECENT_S of silence little
                # is left of it anyway (a sixth at the default half-life)
                self._usage.pop(party, None)

    def _charge(self, batches: list[_Batch]) -> None:
        """Add each batch's worker time to its parties, in proportion to samples, while
        the device is contended; a party just served is active."""
        now = trio.current_time()
        self._decay(now)
        for batch in batches:
            for task in batch.tasks:
                self._seen[task.party] = now
        if not self._contended():
            return
        for batch in batches:
            total = batch.samples
            for task in batch.tasks:
                if batch.seconds and total:
                    share = batch.seconds * task.samples / total
                    self._usage[task.party] = self._usage.get(task.party, 0.0) + share

    def _contended(self) -> bool:
        """Several parties are active: only then does worker time count against a
        party. A party that had the device to itself (a trainer before anyone else
        came) would otherwise look heavy beside a newcomer, a flooder included, and
        wait while the flooder's queue ran, for as long as its use took to decay."""
        return len(self._seen) >= 2

    def _adapt(self, samples: int, seconds: float) -> None:
        """After a job of heavy parties' alone that held ``samples`` and took
        ``seconds`` of the worker (with the steps due before it): the next such job
        holds as many as would take ``HEAVY_JOB_S`` at this one's pace when it took
        longer (at least one request), twice as many (up to the batch budget) when it
        took less than half that. A lighter party that asks meanwhile thus waits about
        ``HEAVY_JOB_S``, or one request where a single one takes longer, whether a
        heavy party sends large batches or many small requests whose optimizer steps
        cost far more than they do."""
        if seconds > HEAVY_JOB_S:
            self._heavy_budget = max(1, int(samples * HEAVY_JOB_S / seconds))
        elif seconds < HEAVY_JOB_S / 2:
            self._heavy_budget = min(self._limit(), 2 * self._heavy_budget)

    def charge(self, costs: Mapping[Any, float]) -> None:
        """Charge parties for worker time spent on their behalf outside their batches
        (the runtime: the optimizer steps their gradients made due, which run before
        a later job's batches). Call on the trio thread."""
        if not costs:
            return
        now = trio.current_time()
        self._decay(now)
        for party in costs:
            self._seen[party] = now
        if not self._contended():
            return
        for party, seconds in costs.items():
            self._usage[party] = self._usage.get(party, 0.0) + seconds

    def _hold_heavy(self) -> set[Hashable]:
        """The waiting parties that used far more of the device than the lightest active
        one. Also updates who is held (``_held``): once per job formed, not a query."""
        if not self.fair:
            return set()
        self._decay(trio.current_time())
        waiting = {task.party for task in self._queue}
        active = waiting | set(self._seen)
        if len(active) < 2:
            self._held = set()  # nobody left to share with
            return set()
        usage = {party: self._usage.get(party, 0.0) for party in active}
        lightest = min(usage.values())
        bar = HEAVY_RATIO * lightest + HEAVY_SLACK_S
        heavy = {party for party in waiting if usage[party] > bar}
        calm = CALM_RATIO * lightest + HEAVY_SLACK_S
        # Held, a party's use is what the cap lets it have: it is released when that
        # use is calm *and* it no longer asks for more than the cap (else it dipped
        # under only because it was held, and its next job would take its whole queue).
        asking: dict[Hashable, int] = {}
        for task in self._queue:
            asking[task.party] = asking.get(task.party, 0) + task.samples
        self._held = {
            p
            for p in self._held
            if p in active and (usage[p] > calm or asking.get(p, 0) > self._heavy_budget)
        } | heavy
        return heavy

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
                await self._run(batches, before, heavy_job=self._heavy_job)
        finally:
            stopped = ShuttingDown("the device's batcher stopped")
            while self._queue:
                task = self._queue.popleft()
                task.lane._took([task])
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
        """The waiting requests as batches, in order of their first request (sharing
        the device: taken in turns, each party's first before any party's second);
        those that do not fit their batch's budget or the job's stay queued, in order.
        While a lighter party has requests waiting, a heavy party's wait; otherwise
        they get a job of ``_heavy_budget`` samples, the least-used party's first."""
        limit = self._limit()
        job_limit = limit * JOB_BATCHES
        heavy = self._hold_heavy()
        self._heavy_job = False
        held: dict[Hashable, int] = {}
        if heavy and all(task.party in heavy for task in self._queue):
            # only heavy parties wait: as many as take ~HEAVY_JOB_S, least-used first
            candidates = sorted(self._queue, key=lambda t: self._usage.get(t.party, 0.0))
            job_limit = min(limit, self._heavy_budget)
            self._heavy_job = True
        else:
            candidates = [t for t in self._queue if t.party not in heavy]
            self._deferred += len(self._queue) - len(candidates)
            if self.fair:
                candidates = _in_turns(candidates, self._usage)
            # a party that dipped under the bar does not get a whole job at once
            held = {party: self._heavy_budget for party in self._held}
        chosen = self._batches(candidates, limit, job_limit, held)
        taken = {id(task) for batch in chosen for task in batch.tasks}
        self._queue = deque(task for task in self._queue if id(task) not in taken)
        for batch in chosen:
            batch.lane._took(batch.tasks)
        return chosen

    @staticmethod
    def _batches(
        tasks: list[_Task[Any, Any]],
        limit: int,
        job_limit: int,
        held: Mapping[Hashable, int] | None = None,
    ) -> list[_Batch]:
        """``tasks`` grouped into batches of at most ``limit`` samples and
        ``job_limit`` in all (the first request always fits), in order; a party in
        ``held`` adds at most that many samples (its first request always fits)."""
        batches: list[_Batch] = []
        open_batches: dict[tuple[int, Hashable], tuple[_Batch, int]] = {}
        full: set[tuple[int, Hashable]] = set()
        job = 0
        own: dict[Hashable, int] = {}  # samples taken per party
        capped: set[Hashable] = set()  # held parties that took what they may
        for task in tasks:
            if batches and job + task.samples > job_limit:
                break  # the job is full: the rest wait, in order
            if held and task.party in held:
                taken = own.get(task.party, 0)
                if task.party in capped or (taken and taken + task.samples > held[task.party]):
                    capped.add(task.party)
                    continue  # its later requests wait, in order
            lane = task.lane
            key = (id(lane), task.shape_key)
            if not lane.merge:
                batches.append(_Batch(lane, [task]))
            elif key in full:
                continue
            elif (entry := open_batches.get(key)) is None:
                batch = _Batch(lane, [task])
                batches.append(batch)
                open_batches[key] = (batch, task.samples)
            else:
                batch, samples = entry
                if samples + task.samples > limit:
                    full.add(key)  # later requests of this batch wait, in order
                    continue
                batch.tasks.append(task)
                open_batches[key] = (batch, samples + task.samples)
            job += task.samples
            own[task.party] = own.get(task.party, 0) + task.samples
        return batches

    async def _run(
        self, batches: list[_Batch], before: BeforeJob | None, *, heavy_job: bool = False
    ) -> None:
        took = [0.0]

        def job() -> Any:
            start = time.perf_counter()
            try:
                return work()
            finally:
                took[0] = time.perf_counter() - start

        def work() -> Any:
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
        if heavy_job:
            self._adapt(sum(batch.samples for batch in batches), took[0])
        self._charge(batches)
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


def _in_turns(
    tasks: list[_Task[Any, Any]], usage: Mapping[Hashable, float]
) -> list[_Task[Any, Any]]:
    """``tasks`` in rounds: every party's first waiting request before any party's
    second, and so on; within a round the least-used party's first (by arrival where
    they used alike). A party with a queue of requests thus holds each lane's next
    batch for at most one of them against one that asks now and then, even before it
    counts as heavy; parties with one request each still merge, the least-used first."""
    taken: dict[Hashable, int] = {}
    turns: list[tuple[int, float, int]] = []
    for index, task in enumerate(tasks):
        turn = taken.get(task.party, 0)
        taken[task.party] = turn + 1
        turns.append((turn, usage.get(task.party, 0.0), index))
    return [tasks[index] for _, _, index in sorted(turns)]


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
    start = time.perf_counter()
    try:
        batch.results = batch.lane.compute([t.item for t in batch.tasks])
    except Exception as exc:  # one batch's failure is its requests' only
        batch_failed(batch.lane.name, exc)
        batch.error = exc
    finally:
        batch.seconds += time.perf_counter() - start


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
    start = time.perf_counter()
    answers: list[list[Any] | Exception] | None
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
        answers = None
    # the call's time shared out by samples (a batch run alone again adds its own)
    seconds = time.perf_counter() - start
    total = sum(batch.samples for batch in group) or 1
    for batch in group:
        batch.seconds += seconds * batch.samples / total
    if answers is None:
        for batch in group:
            _compute(batch)
        return
    for batch, answer in zip(group, answers, strict=True):
        if isinstance(answer, Exception):
            batch.error = answer
        else:
            batch.results = answer
