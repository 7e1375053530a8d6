"""A paused daemon, or one hosting nothing, announces nothing, and its rounds leave the
DHT alone once its withdrawals went out: a paused daemon still ran a read-back and an
empty store every ``announce_period_s``, four DHT rounds a minute (an outside audit)."""

from __future__ import annotations

from collections.abc import Sequence

import trio

from volunteerd.config import Config
from volunteerd.identity import Identity
from volunteerd.net import peer_id_for
from volunteerd.net.announce import Announcer
from volunteerd.net.dht import StoreOutcome
from volunteerd.net.records import ExpertRecord
from volunteerd.net.swarm_clock import SwarmClock

CONFIG = Config()


class _DHT:
    """What the announcer asks of an ``ExpertDHT``, each call written down."""

    def __init__(self) -> None:
        self.clock = SwarmClock()
        self.calls: list[str] = []
        self.stored: list[ExpertRecord] = []

    async def put(self, records: Sequence[ExpertRecord]) -> StoreOutcome:
        self.calls.append("put")
        self.stored += records
        return StoreOutcome({r.key: 3 for r in records})

    async def look_for_copies(self, key: str) -> None:
        self.calls.append("look_for_copies")

    async def read_back(self, record: ExpertRecord) -> bool:
        self.calls.append("read_back")
        return True

    def routing_table_size(self) -> int:
        return 3


def _announcer(dht: _DHT) -> Announcer:
    identity = Identity.generate()
    return Announcer(
        dht,  # type: ignore[arg-type]
        identity,
        str(peer_id_for(identity)),
        ["/ip4/127.0.0.1/tcp/4001"],
        CONFIG.dht,
        CONFIG.timeouts,
    )


async def test_a_paused_announcer_withdraws_once_then_leaves_the_dht_alone(
    autojump_clock: trio.abc.Clock,
) -> None:
    dht = _DHT()
    announcer = _announcer(dht)
    announcer.set_uids(["ffn.0.0", "ffn.0.1"])
    async with trio.open_nursery() as nursery:
        await nursery.start(announcer.serve)
        assert dht.calls.count("put") == 1
        announcer.set_paused(True)
        await announcer.announce_now()  # what Volunteer does on a pause
        assert not any(r.active for r in dht.stored[-3:])  # the withdrawal went out
        before = len(dht.calls)
        await trio.sleep(CONFIG.dht.announce_period_s * 40)  # ten minutes paused
        assert dht.calls[before:] == []
        assert not announcer.unheard
        # Serving again announces at once, and the rounds go on.
        puts = dht.calls.count("put")
        announcer.set_paused(False)  # wakes a round too: one or two stores
        await announcer.announce_now()
        assert dht.calls.count("put") > puts
        assert dht.stored[-1].active
        nursery.cancel_scope.cancel()


async def test_an_announcer_hosting_nothing_touches_no_dht(
    autojump_clock: trio.abc.Clock,
) -> None:
    dht = _DHT()
    announcer = _announcer(dht)
    async with trio.open_nursery() as nursery:
        await nursery.start(announcer.serve)
        await trio.sleep(CONFIG.dht.announce_period_s * 40)
        nursery.cancel_scope.cancel()
    assert dht.calls == []
