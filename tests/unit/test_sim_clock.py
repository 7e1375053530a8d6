"""The simulator's clock: events in order, virtual time, workers that stop it."""

from __future__ import annotations

import threading
import time

import trio

from volunteerd.sim.clock import SimClock, seed_scheduler


def test_events_happen_in_time_order_and_time_is_virtual() -> None:
    clock = SimClock()
    seen: list[tuple[float, str]] = []

    async def wake(at: float, name: str) -> None:
        await trio.sleep_until(at)
        seen.append((trio.current_time(), name))

    async def main() -> None:
        async with trio.open_nursery() as nursery:
            for at, name in [(500.0, "c"), (3.5, "a"), (86_400.0, "d"), (40.0, "b")]:
                nursery.start_soon(wake, at, name)

    trio.run(main, clock=clock)
    assert seen == [(3.5, "a"), (40.0, "b"), (500.0, "c"), (86_400.0, "d")]
    assert clock.current_time() == 86_400.0
    assert clock.jumps == 4


def test_time_stands_still_while_a_worker_computes() -> None:
    clock = SimClock()
    log: list[str] = []
    inside: list[float] = []

    def work() -> int:
        inside.append(clock.current_time())
        time.sleep(0.2)  # real work: no timer may fire meanwhile
        log.append("worker done")
        inside.append(clock.current_time())
        return 7

    async def timer() -> None:
        await trio.sleep(1.0)
        log.append(f"timer at {trio.current_time()}")

    async def main() -> None:
        async with trio.open_nursery() as nursery:
            nursery.start_soon(timer)
            await trio.sleep(0.5)
            assert await clock.in_thread(work) == 7

    trio.run(main, clock=clock)
    assert inside == [0.5, 0.5]
    assert log == ["worker done", "timer at 1.0"]


def test_a_worker_waits_in_virtual_time_on_the_loop() -> None:
    clock = SimClock()
    times: list[float] = []
    threads: set[int] = set()

    async def network_round(seconds: float) -> float:
        await trio.sleep(seconds)
        return trio.current_time()

    def work() -> None:
        threads.add(threading.get_ident())
        times.append(clock.on_loop(network_round, 2.0))
        times.append(clock.on_loop(network_round, 0.25))

    async def main() -> None:
        await trio.sleep(10.0)
        await clock.in_thread(work)
        assert clock.computing == 0

    trio.run(main, clock=clock)
    assert times == [12.0, 12.25]
    assert threading.get_ident() not in threads


def test_same_seed_same_order_of_simultaneous_events() -> None:
    def order(seed: int) -> list[int]:
        seed_scheduler(seed)
        out: list[int] = []

        async def one(i: int) -> None:
            await trio.sleep(1.0)  # all wake at the same instant
            out.append(i)

        async def main() -> None:
            async with trio.open_nursery() as nursery:
                for i in range(30):
                    nursery.start_soon(one, i)

        trio.run(main, clock=SimClock())
        return out

    assert order(1) == order(1)
    assert order(1) != order(2) or order(3) != order(1)
