"""The batcher: groups waiting requests, respects the batch budget and shapes, answers
``busy`` at once when the queue is full, and fails queued work cleanly on shutdown."""

from __future__ import annotations

import threading

import pytest
import torch
import trio

from volunteerd.config import RuntimeConfig
from volunteerd.errors import Busy, ShuttingDown
from volunteerd.runtime import BatchQueue, DeviceExecutor


def doubling(batches: list[int]):  # type: ignore[no-untyped-def]
    """A compute function that concatenates its batch, doubles it and splits it back."""

    def compute(items: list[torch.Tensor]) -> list[torch.Tensor]:
        joined = torch.cat(items)
        batches.append(int(joined.shape[0]))
        return list((joined * 2).split([len(x) for x in items]))

    return compute


async def submit(queue: BatchQueue, x: torch.Tensor) -> torch.Tensor:  # type: ignore[type-arg]
    return await queue.submit(x, samples=x.shape[0], shape_key=tuple(x.shape[1:]))


async def test_requests_waiting_together_form_one_batch(autojump_clock: trio.abc.Clock) -> None:
    batches: list[int] = []
    config = RuntimeConfig(max_batch_size=100, max_batch_wait_s=0.05)
    queue = BatchQueue("e", doubling(batches), DeviceExecutor(torch.device("cpu")), config)
    results: dict[int, torch.Tensor] = {}

    async def one(i: int) -> None:
        results[i] = await submit(queue, torch.full((i + 1, 3), float(i)))

    async with trio.open_nursery() as nursery:
        await nursery.start(queue.serve)
        async with trio.open_nursery() as clients:
            for i in range(5):
                clients.start_soon(one, i)
        queue.close()
    assert batches == [15]  # 1+2+3+4+5 samples in one batch
    for i in range(5):
        assert torch.equal(results[i], torch.full((i + 1, 3), 2.0 * i))
    assert queue.statistics().mean_batch_samples == 15


async def test_batch_budget_and_shapes_split_batches(autojump_clock: trio.abc.Clock) -> None:
    batches: list[int] = []
    config = RuntimeConfig(max_batch_size=8, max_batch_wait_s=0.05)
    queue = BatchQueue("e", doubling(batches), DeviceExecutor(torch.device("cpu")), config)
    shapes = [(4, 3), (4, 3), (4, 3), (2, 5)]
    outputs: list[tuple[int, ...]] = []

    async def one(shape: tuple[int, int]) -> None:
        out = await submit(queue, torch.ones(shape))
        outputs.append(tuple(out.shape))

    async with trio.open_nursery() as nursery:
        await nursery.start(queue.serve)
        async with trio.open_nursery() as clients:
            for shape in shapes:
                clients.start_soon(one, shape)
        queue.close()
    assert sorted(batches) == [2, 4, 8]
    assert sorted(outputs) == sorted(shapes)


async def test_full_queue_answers_busy_at_once() -> None:
    release = threading.Event()

    def blocking(items: list[torch.Tensor]) -> list[torch.Tensor]:
        release.wait(10)
        return items

    config = RuntimeConfig(queue_size=2, max_batch_size=1, max_batch_wait_s=0)
    queue = BatchQueue("e", blocking, DeviceExecutor(torch.device("cpu")), config)
    async with trio.open_nursery() as nursery:
        await nursery.start(queue.serve)
        for _ in range(3):  # one computing, two waiting
            nursery.start_soon(submit, queue, torch.ones(1, 1))
        await trio.testing.wait_all_tasks_blocked(cushion=0.05)
        with trio.fail_after(0.5), pytest.raises(Busy):
            await submit(queue, torch.ones(1, 1))
        assert queue.statistics().refused_busy == 1
        release.set()
        queue.close()


async def test_close_refuses_new_work_and_finishes_queued() -> None:
    batches: list[int] = []
    queue = BatchQueue("e", doubling(batches), DeviceExecutor(torch.device("cpu")), RuntimeConfig())
    async with trio.open_nursery() as nursery:
        await nursery.start(queue.serve)
        out = await submit(queue, torch.ones(2, 2))
        queue.close()
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

    queue = BatchQueue("e", flaky, DeviceExecutor(torch.device("cpu")), RuntimeConfig())
    async with trio.open_nursery() as nursery:
        await nursery.start(queue.serve)
        with pytest.raises(RuntimeError, match="fell over"):
            await submit(queue, torch.ones(1, 1))
        out = await submit(queue, torch.ones(1, 1))
        assert torch.equal(out, torch.ones(1, 1))
        queue.close()


async def test_unmerged_queue_runs_each_request_alone(autojump_clock: trio.abc.Clock) -> None:
    batches: list[int] = []
    config = RuntimeConfig(max_batch_size=100, max_batch_wait_s=0.05)
    queue = BatchQueue(
        "e", doubling(batches), DeviceExecutor(torch.device("cpu")), config, merge=False
    )
    async with trio.open_nursery() as nursery:
        await nursery.start(queue.serve)
        async with trio.open_nursery() as clients:
            for _ in range(3):
                clients.start_soon(submit, queue, torch.ones(2, 3))
        queue.close()
    assert batches == [2, 2, 2]
