"""The directory keeps DHT lookups off the training step's path: concurrent steps share
one lookup, and a stale cache entry is answered while a refresh runs beside it."""

from __future__ import annotations

import logging
from collections.abc import Sequence

import pytest
import trio

from volunteerd.identity import Identity
from volunteerd.moe import ExpertDirectory
from volunteerd.net import ExpertRecord, peer_id_for
from volunteerd.net.records import sign_record


class SlowDHT:
    """Answers a lookup once ``release`` is set; counts lookups."""

    def __init__(self, server: Identity) -> None:
        self.server = server
        self.release = trio.Event()
        self.failing = False
        self.lookups = 0

    async def get(self, keys: Sequence[str]) -> dict[str, list[ExpertRecord]]:
        self.lookups += 1
        if self.failing:
            raise OSError("no storing node answered")
        await self.release.wait()
        return {k: [record(self.server, k)] for k in keys}


def record(identity: Identity, key: str) -> ExpertRecord:
    return sign_record(
        identity, str(peer_id_for(identity)), key=key, addrs=["/ip4/127.0.0.1/tcp/1"],
        children=[0, 1], ttl_s=60,
    )  # fmt: skip


async def test_concurrent_steps_share_one_lookup_of_a_prefix() -> None:
    dht = SlowDHT(Identity.generate())
    directory = ExpertDirectory(dht)
    answers: list[set[int]] = []

    async def step() -> None:
        found = await directory.children(["ffn."])
        answers.append(set(found["ffn."]))

    async with trio.open_nursery() as nursery:
        for _ in range(4):
            nursery.start_soon(step)
        await trio.testing.wait_all_tasks_blocked()
        dht.release.set()
    assert answers == [{0, 1}] * 4
    assert dht.lookups == directory.lookups == 1


async def test_a_stale_entry_answers_at_once_while_it_is_refreshed(
    autojump_clock: trio.testing.MockClock,
) -> None:
    dht = SlowDHT(Identity.generate())
    dht.release.set()
    directory = ExpertDirectory(dht, refresh_s=1000.0, clock=trio.current_time)
    async with trio.open_nursery() as nursery:
        await nursery.start(directory.serve)
        await directory.children(["ffn."])
        assert dht.lookups == 1
        dht.failing = True
        await trio.sleep(3001)  # past 3 x refresh_s, every periodic refresh failed: stale
        dht.failing, dht.release = False, trio.Event()  # and now the DHT is slow
        refreshes = dht.lookups
        assert refreshes == 4
        with trio.fail_after(1):  # virtual time: the step does not wait for the DHT
            found = await directory.children(["ffn."])
        assert set(found["ffn."]) == {0, 1}
        await trio.testing.wait_all_tasks_blocked()
        assert dht.lookups == refreshes + 1, "a refresh runs beside the step"
        nursery.cancel_scope.cancel()


async def test_a_refresh_timing_out_now_and_then_is_not_a_warning_a_streak_is(
    autojump_clock: trio.testing.MockClock, caplog: pytest.LogCaptureFixture
) -> None:
    # on a 400 ms-round-trip, 2 % loss link a trainer logged "refreshing 10 DHT keys
    # timed out" as a WARNING nine times in 267 s while it trained normally
    dht = SlowDHT(Identity.generate())
    dht.release.set()
    directory = ExpertDirectory(dht, refresh_s=10.0, clock=trio.current_time)
    caplog.set_level(logging.INFO, logger="volunteerd.moe.directory")
    async with trio.open_nursery() as nursery:
        await nursery.start(directory.serve)
        await directory.children(["ffn."])
        dht.release = trio.Event()  # every refresh from now on times out
        await trio.sleep(26)  # a refresh every 10 s, each given 10 s: one timed out, at 20 s
        warnings = [r for r in caplog.records if r.levelno >= logging.WARNING]
        assert warnings == []
        assert sum("timed out" in r.getMessage() for r in caplog.records) >= 1
        await trio.sleep(60)  # at 40, 60 and 80 s: a streak of them
        warnings = [r.getMessage() for r in caplog.records if r.levelno >= logging.WARNING]
        assert len(warnings) == 1, warnings
        assert "timed out 3 times in a row" in warnings[0]
        dht.release.set()  # the DHT answers again
        await trio.sleep(15)
        assert any("works again" in r.getMessage() for r in caplog.records)
        nursery.cancel_scope.cancel()
