"""The batcher: groups waiting requests, respects the batch budget and shapes, runs
several lanes' batches in one hand-off, answers ``busy`` at once when a lane is full,
and fails queued work cleanly on shutdown."""

from __future__ import annotations

import threading
import traceback

import pytest
import torch
import trio

from volunteerd.config import RuntimeConfig
from volunteerd.errors import Busy, ShuttingDown
from volunteerd.runtime import DeviceBatcher, DeviceExecutor, Lane
from volunteerd.runtime.batching import FRUITLESS_WAITS, Together


def doubling(batches: list[int]):  # type: ignore[no-untyped-def]
    """A compute function that concatenates its batch, doubles it and splits it back."""

    def compute(items: list[torch.Tensor]) -> list[torch.Tensor]:
        joined = torch.cat(items)
        batches.append(int(joined.shape[0]))
        return list((joined * 2).split([len(x) for x in items]))

    return compute


def batcher(config: RuntimeConfig) -> DeviceBatcher:
    return DeviceBatcher(DeviceExecutor(torch.device("cpu")), config)


async def submit(queue: Lane, x: torch.Tensor) -> torch.Tensor:  # type: ignore[type-arg]
    return await queue.submit(x, samples=x.shape[0], shape_key=tuple(x.shape[1:]))


async def test_requests_waiting_together_form_one_batch(autojump_clock: trio.abc.Clock) -> None:
    batches: list[int] = []
    config = RuntimeConfig(max_batch_size=100, max_batch_wait_s=0.05)
    device = batcher(config)
    queue = device.lane("e", doubling(batches))
    results: dict[int, torch.Tensor] = {}

    async def one(i: int) -> None:
        results[i] = await submit(queue, torch.full((i + 1, 3), float(i)))

    async with trio.open_nursery() as nursery:
        await nursery.start(device.serve)
        async with trio.open_nursery() as clients:
            for i in range(5):
                clients.start_soon(one, i)
        device.close()
    assert batches == [15]  # 1+2+3+4+5 samples in one batch
    for i in range(5):
        assert torch.equal(results[i], torch.full((i + 1, 3), 2.0 * i))
    assert queue.statistics().mean_batch_samples == 15


async def test_batch_budget_and_shapes_split_batches(autojump_clock: trio.abc.Clock) -> None:
    batches: list[int] = []
    config = RuntimeConfig(max_batch_size=8, max_batch_wait_s=0.05)
    device = batcher(config)
    queue = device.lane("e", doubling(batches))
    shapes = [(4, 3), (4, 3), (4, 3), (2, 5)]
    outputs: list[tuple[int, ...]] = []

    async def one(shape: tuple[int, int]) -> None:
        out = await submit(queue, torch.ones(shape))
        outputs.append(tuple(out.shape))

    async with trio.open_nursery() as nursery:
        await nursery.start(device.serve)
        async with trio.open_nursery() as clients:
            for shape in shapes:
                clients.start_soon(one, shape)
        device.close()
    assert sorted(batches) == [2, 4, 8]
    assert sorted(outputs) == sorted(shapes)


async def test_full_queue_answers_busy_at_once() -> None:
    release = threading.Event()

    def blocking(items: list[torch.Tensor]) -> list[torch.Tensor]:
        release.wait(10)
        return items

    config = RuntimeConfig(queue_size=2, max_batch_size=1, max_batch_wait_s=0)
    device = batcher(config)
    queue = device.lane("e", blocking)
    async with trio.open_nursery() as nursery:
        await nursery.start(device.serve)
        nursery.start_soon(submit, queue, torch.ones(1, 1))  # computing
        await trio.testing.wait_all_tasks_blocked(cushion=0.05)
        for _ in range(2):  # waiting
            nursery.start_soon(submit, queue, torch.ones(1, 1))
        await trio.testing.wait_all_tasks_blocked(cushion=0.05)
        with trio.fail_after(0.5), pytest.raises(Busy):
            await submit(queue, torch.ones(1, 1))
        assert queue.statistics().refused_busy == 1
        release.set()
        device.close()


async def test_close_refuses_new_work_and_finishes_queued() -> None:
    batches: list[int] = []
    device = batcher(RuntimeConfig())
    queue = device.lane("e", doubling(batches))
    async with trio.open_nursery() as nursery:
        await nursery.start(device.serve)
        out = await submit(queue, torch.ones(2, 2))
        device.close()
        with pytest.raises(ShuttingDown):
            await submit(queue, torch.ones(2, 2))
    assert torch.equal(out, torch.full((2, 2), 2.0))


async def test_a_failing_batch_fails_only_its_requests() -> None:
    calls = 0

    def flaky(items: list[torch.Tensor]) -> list[torch.Tensor]:
        nonlocal calls
        calls += 1
        if calls == 1:
            raise RuntimeError("device fell over")
        return items

    device = batcher(RuntimeConfig())
    queue = device.lane("e", flaky)
    async with trio.open_nursery() as nursery:
        await nursery.start(device.serve)
        with pytest.raises(RuntimeError, match="fell over"):
            await submit(queue, torch.ones(1, 1))
        out = await submit(queue, torch.ones(1, 1))
        assert torch.equal(out, torch.ones(1, 1))
        device.close()


async def test_each_request_of_a_failed_batch_gets_a_traceback_of_its_own(
    autojump_clock: trio.abc.Clock,
) -> None:
    """One exception object raised again by every request's task gathered all their
    frames: the 64th request of a failed batch logged 64 tracebacks (~2 MB of log)."""
    batches: list[int] = []

    def broken(items: list[torch.Tensor]) -> list[torch.Tensor]:
        batches.append(len(items))
        raise RuntimeError("a bug in the expert")

    device = batcher(RuntimeConfig(max_batch_size=1000, max_batch_wait_s=0.05))
    queue = device.lane("e", broken)
    caught: list[tuple[str, int]] = []  # each request's error and its frames, as caught

    async def one() -> None:
        try:
            await submit(queue, torch.ones(1, 1))
        except RuntimeError as exc:
            caught.append((str(exc), len(traceback.extract_tb(exc.__traceback__))))

    async with trio.open_nursery() as nursery:
        await nursery.start(device.serve)
        async with trio.open_nursery() as clients:
            for _ in range(32):
                clients.start_soon(one)
        device.close()
    assert batches == [32]  # one batch failed, for all of them
    assert len(caught) == 32
    assert {message for message, _ in caught} == {"a bug in the expert"}
    depths = {frames for _, frames in caught}
    assert len(depths) == 1, depths  # the same frames each, however many came before


async def test_unmerged_queue_runs_each_request_alone(autojump_clock: trio.abc.Clock) -> None:
    batches: list[int] = []
    config = RuntimeConfig(max_batch_size=100, max_batch_wait_s=0.05)
    device = batcher(config)
    queue = device.lane("e", doubling(batches), merge=False)
    async with trio.open_nursery() as nursery:
        await nursery.start(device.serve)
        async with trio.open_nursery() as clients:
            for _ in range(3):
                clients.start_soon(submit, queue, torch.ones(2, 3))
        device.close()
    assert batches == [2, 2, 2]


async def test_one_job_runs_the_batches_of_every_lane(autojump_clock: trio.abc.Clock) -> None:
    """Requests for several experts waiting together cost one hand-off to the worker,
    and a lane whose compute fails fails only its own requests."""
    config = RuntimeConfig(max_batch_size=100, max_batch_wait_s=0.05)
    device = batcher(config)
    a_batches: list[int] = []
    b_batches: list[int] = []
    threads: set[int] = set()

    def broken(items: list[torch.Tensor]) -> list[torch.Tensor]:
        raise RuntimeError("expert c fell over")

    def noting(batches: list[int]):  # type: ignore[no-untyped-def]
        compute = doubling(batches)

        def run(items: list[torch.Tensor]) -> list[torch.Tensor]:
            threads.add(threading.get_ident())
            return compute(items)

        return run

    a = device.lane("a", noting(a_batches))
    b = device.lane("b", noting(b_batches))
    c = device.lane("c", broken)
    failures: list[BaseException] = []

    async def failing() -> None:
        try:
            await submit(c, torch.ones(1, 3))
        except RuntimeError as exc:
            failures.append(exc)

    async with trio.open_nursery() as nursery:
        await nursery.start(device.serve)
        async with trio.open_nursery() as clients:
            for lane in (a, b, a, b):
                clients.start_soon(submit, lane, torch.ones(2, 3))
            clients.start_soon(failing)
        device.close()
    assert (a_batches, b_batches) == ([4], [4])
    assert device.jobs == 1
    assert len(threads) == 1
    assert [str(e) for e in failures] == ["expert c fell over"]
    assert a.statistics().batches == 1
    assert c.statistics().batches == 0


async def test_work_before_a_job_runs_ahead_of_its_batches_or_alone() -> None:
    """The runtime's optimizer steps ride the next job, ahead of its batches; with no
    request waiting, ``wake`` runs them in a job of their own."""
    device = batcher(RuntimeConfig(max_batch_wait_s=0))
    order: list[str] = []
    results: list[object] = []
    due = [False]

    def compute(items: list[torch.Tensor]) -> list[torch.Tensor]:
        order.append("batch")
        return items

    def before() -> tuple[object, object] | None:
        if not due[0]:
            return None
        due[0] = False
        return (lambda: order.append("step") or "stepped"), results.append

    device.before_job = before  # type: ignore[assignment]
    lane = device.lane("e", compute)
    async with trio.open_nursery() as nursery:
        await nursery.start(device.serve)
        due[0] = True
        await submit(lane, torch.ones(1, 1))
        assert order == ["step", "batch"]
        due[0] = True
        device.wake()
        await trio.testing.wait_all_tasks_blocked(cushion=0.05)
        assert order == ["step", "batch", "step"]
        assert results == ["stepped", "stepped"]
        device.close()
    assert device.jobs == 2


async def test_a_closed_lane_answers_what_it_took_and_refuses_the_rest() -> None:
    release = threading.Event()

    def blocking(items: list[torch.Tensor]) -> list[torch.Tensor]:
        release.wait(10)
        return items

    device = batcher(RuntimeConfig(max_batch_wait_s=0))
    lane = device.lane("e", blocking)
    other = device.lane("f", blocking)
    answered: list[torch.Tensor] = []

    async def one() -> None:
        answered.append(await submit(lane, torch.ones(1, 1)))

    async with trio.open_nursery() as nursery:
        await nursery.start(device.serve)
        nursery.start_soon(one)
        await trio.testing.wait_all_tasks_blocked(cushion=0.05)
        lane.close()
        with pytest.raises(ShuttingDown):
            await submit(lane, torch.ones(1, 1))
        release.set()
        with trio.fail_after(5):
            await lane.finished()
        await trio.testing.wait_all_tasks_blocked()
        assert len(answered) == 1
        assert torch.equal(await submit(other, torch.ones(1, 1)), torch.ones(1, 1))
        device.close()


async def test_a_lane_stops_waiting_when_waiting_brings_nothing(
    autojump_clock: trio.abc.Clock,
) -> None:
    """One request per pass (one trainer, one expert): the first FRUITLESS_WAITS wait
    out ``max_batch_wait_s`` for company, later ones start at once; requests that come
    together again bring the wait back."""
    config = RuntimeConfig(max_batch_size=100, max_batch_wait_s=0.05)
    device = batcher(config)
    batches: list[int] = []
    lane = device.lane("e", doubling(batches))

    async def timed() -> float:
        start = trio.current_time()
        await submit(lane, torch.ones(1, 1))
        return trio.current_time() - start

    async with trio.open_nursery() as nursery:
        await nursery.start(device.serve)
        for _ in range(FRUITLESS_WAITS):
            assert await timed() == pytest.approx(0.05)
        assert await timed() == 0
        async with trio.open_nursery() as clients:
            for _ in range(3):
                clients.start_soon(submit, lane, torch.ones(1, 1))
        assert batches[-1] == 3
        assert await timed() == pytest.approx(0.05)  # waiting again
        device.close()


async def test_lanes_together_run_as_one_call_and_fail_apart(
    autojump_clock: trio.abc.Clock,
) -> None:
    """Batches of lanes with one ``Together`` key in a job go to one call, which answers
    each; an exception it answers fails that batch only; a lane with another key (or
    none) runs alone; and when the call itself raises, each batch runs on its own."""
    config = RuntimeConfig(max_batch_size=100, max_batch_wait_s=0.05)
    device = batcher(config)
    calls: list[list[tuple[str, int]]] = []
    alone: list[int] = []
    fail_next_call = False

    def together_run(
        batches: list[tuple[object, list[torch.Tensor]]],
    ) -> list[list[torch.Tensor] | Exception]:
        if fail_next_call:
            raise RuntimeError("the stacked kernel fell over")
        calls.append([(str(member), sum(len(x) for x in items)) for member, items in batches])
        return [
            RuntimeError(f"{member} is broken")
            if member == "b"
            else [x * 3 for x in items]  # distinguishable from the lanes' own doubling
            for member, items in batches
        ]

    lanes = {
        name: device.lane(name, doubling(alone), together=Together("ffn", name, together_run))
        for name in "abc"
    }
    other = device.lane("d", doubling(alone), together=Together("other", "d", together_run))

    async def one(lane: Lane, results: dict[str, object]) -> None:  # type: ignore[type-arg]
        try:
            results[lane.name] = await submit(lane, torch.ones(2, 3))
        except RuntimeError as exc:
            results[lane.name] = exc

    async def job() -> dict[str, object]:
        results: dict[str, object] = {}
        async with trio.open_nursery() as clients:
            for lane in [*lanes.values(), other]:
                clients.start_soon(one, lane, results)
        return results

    async with trio.open_nursery() as nursery:
        await nursery.start(device.serve)
        first = await job()
        fail_next_call = True
        second = await job()
        device.close()
    assert [sorted(call) for call in calls] == [[("a", 2), ("b", 2), ("c", 2)]]  # d: alone
    assert torch.equal(first["a"], torch.full((2, 3), 3.0))  # type: ignore[arg-type]
    assert str(first["b"]) == "b is broken"
    assert torch.equal(first["d"], torch.full((2, 3), 2.0))  # type: ignore[arg-type]
    for name in "abcd":  # the failed call: every batch on its own compute instead
        assert torch.equal(second[name], torch.full((2, 3), 2.0))  # type: ignore[arg-type]
    assert lanes["b"].statistics().batches == 1  # the failed batch is not counted
    assert alone == [2, 2, 2, 2, 2]
