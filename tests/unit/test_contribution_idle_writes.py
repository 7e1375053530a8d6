"""An idle daemon's statistics cost the disk little: with nothing but time ticking and
the DHT's trickle of traffic, the counts are written every couple of minutes, not every
``flush_s`` (an idle daemon wrote ~11 MB/h to the WAL, four pages every 5 s); expert
calls and transfers are still written every ``flush_s``, and a stop writes everything.
In virtual time, the writes in line (``inline_threads``)."""

from __future__ import annotations

from pathlib import Path

import pytest
import trio

from volunteerd.config import LimitsConfig, StatsConfig
from volunteerd.net.throttle import Throttle
from volunteerd.server.contribution import Accountant
from volunteerd.stats import StatsStore


class _Runtime:
    """What the accountant asks of an ``ExpertRuntime``: its experts, their counters."""

    def __init__(self) -> None:
        self.uids = ["ffn.0.0"]

    def statistics(self) -> list[object]:
        return []


def _writes(store: StatsStore) -> int:
    """Transactions the store wrote (each flush that had counts moves this by two)."""
    return store._flushes // 2


async def _run(
    tmp_path: Path, *, serving: bool, busy: bool, seconds: float
) -> tuple[StatsStore, int]:
    store = StatsStore.open(tmp_path / "stats.sqlite3")
    accountant = Accountant(
        store,
        _Runtime(),  # type: ignore[arg-type]
        Throttle(LimitsConfig()),
        StatsConfig(flush_s=5),
        serving=lambda: serving,
    )
    async with trio.open_nursery() as nursery:
        await nursery.start(accountant.serve)
        start = trio.current_time()
        while trio.current_time() - start < seconds:
            if busy:  # an expert call answered every few seconds
                store.record("ffn.0.0", forward=1, samples=4)
            await trio.sleep(3)
        writes = _writes(store)
        nursery.cancel_scope.cancel()
    return store, writes


@pytest.mark.parametrize("serving", [True, False], ids=["serving", "paused"])
async def test_an_idle_daemon_writes_its_time_every_few_minutes_not_every_flush(
    tmp_path: Path, autojump_clock: trio.abc.Clock, inline_threads: None, serving: bool
) -> None:
    store, writes = await _run(tmp_path, serving=serving, busy=False, seconds=1200)
    # 20 minutes: every 5 s was 240 writes; every 2 min is 10
    assert writes <= 12
    # nothing is lost to a stop: the file holds all of it once closed
    store.close()
    again = StatsStore.open(tmp_path / "stats.sqlite3")
    try:
        totals = again.totals()
        counted = totals.running_s if serving else totals.paused_s
        assert counted == pytest.approx(1200, abs=5)
    finally:
        again.close()


async def test_expert_calls_are_still_written_every_flush(
    tmp_path: Path, autojump_clock: trio.abc.Clock, inline_threads: None
) -> None:
    store, writes = await _run(tmp_path, serving=True, busy=True, seconds=300)
    store.close()
    assert writes >= 50  # every 5 s (60 in 300 s)
