"""HandshakeSlots: the handshake queue's turns go round the addresses."""

from __future__ import annotations

import trio
import trio.testing

from volunteerd.net.connections import HandshakeSlots


async def test_a_freed_slot_goes_to_the_next_address_not_to_the_longest_queue() -> None:
    slots = HandshakeSlots(1)
    await slots.acquire("held")
    order: list[str] = []

    async def wait_for_slot(key: str, name: str) -> None:
        await slots.acquire(key)
        order.append(name)

    async with trio.open_nursery() as nursery:
        for i in range(5):  # one address queues five first
            nursery.start_soon(wait_for_slot, "flood", f"flood{i}")
            await trio.testing.wait_all_tasks_blocked()
        nursery.start_soon(wait_for_slot, "honest", "honest")
        await trio.testing.wait_all_tasks_blocked()
        assert slots.waiting() == 6
        assert slots.used == 1
        for _ in range(6):
            slots.release()  # each turn's holder is done at once
            await trio.testing.wait_all_tasks_blocked()
    assert order == ["flood0", "honest", "flood1", "flood2", "flood3", "flood4"]
    assert slots.used == 1  # the last holder's slot, until it gives it back
    slots.release()
    assert slots.used == 0
    assert slots.waiting() == 0


async def test_a_cancelled_waiter_leaves_the_queue() -> None:
    slots = HandshakeSlots(1)
    await slots.acquire("a")
    got: list[str] = []

    async def wait_for_slot(key: str) -> None:
        await slots.acquire(key)
        got.append(key)

    async with trio.open_nursery() as nursery:
        nursery.start_soon(wait_for_slot, "b")
        await trio.testing.wait_all_tasks_blocked()
        cancelled = trio.CancelScope()

        async def impatient() -> None:
            with cancelled:
                await slots.acquire("c")
                got.append("c")

        nursery.start_soon(impatient)
        await trio.testing.wait_all_tasks_blocked()
        cancelled.cancel()  # leaves the queue before its turn
        await trio.testing.wait_all_tasks_blocked()
        assert slots.waiting() == 1
        slots.release()
    assert got == ["b"]
    assert slots.used == 1
    assert slots.waiting() == 0


async def test_a_holders_patience_shrinks_as_the_queue_grows() -> None:
    # Held by stalled peers, the slots must turn over faster than a long queue grows.
    slots = HandshakeSlots(2, patience=1.0)
    assert slots.allowance() == 1.0
    await slots.acquire("a")
    await slots.acquire("b")
    began = trio.current_time()
    reading = trio.CancelScope()
    slots.reading(reading, began - 0.25)  # it had waited 0.25 s before this read
    assert reading.deadline == began + 0.75
    async with trio.open_nursery() as nursery:
        for key in ("c", "d"):
            nursery.start_soon(slots.acquire, key)
        await trio.testing.wait_all_tasks_blocked()
        assert slots.waiting() == 2
        assert slots.allowance() == 0.5  # 1 s x 2 slots / (2 + 2 waiting)
        assert reading.deadline == began + 0.25  # tightened, counting what it waited
        slots.done_reading(reading)
        slots.release()
        slots.release()
    assert slots.allowance() == 1.0  # nobody waits any more
