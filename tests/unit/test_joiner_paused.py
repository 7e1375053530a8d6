"""A joined daemon's rounds (its replica lookups, the manifest's checks and its
republishing) wait while network use is not allowed: paused by the volunteer, outside
the network hours, a quota used up. A paused daemon looked every expert of its
experiment up at each round (an outside audit). Virtual time, a DHT in memory."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import trio

from tests.unit.test_joiner_follows_manifest import MemoryDHT, Runtime, joiner_of, publish
from volunteerd.config import LimitsConfig
from volunteerd.net.throttle import Throttle
from volunteerd.server.pausing import Volunteer
from volunteerd.swarm.expiries import ManifestExpiries


class CountingDHT(MemoryDHT):
    def __init__(self) -> None:
        super().__init__()
        self.reads = 0
        self.stores = 0

    async def get(self, uids: list[str]) -> dict[str, list[Any]]:
        self.reads += 1
        return await super().get(uids)

    async def get_manifests(self, name: str, owner: str | None = None) -> list[Any]:
        self.reads += 1
        return await super().get_manifests(name, owner)

    async def put_manifest(self, record: Any) -> int:
        self.stores += 1
        return await super().put_manifest(record)


@pytest.mark.usefixtures("inline_threads")
async def test_a_paused_daemon_s_joiner_looks_nothing_up_until_resumed(
    autojump_clock: trio.abc.Clock, tmp_path: Path
) -> None:
    dht, runtime = CountingDHT(), Runtime()
    publish(dht, 16, (2,))
    volunteer = Volunteer(
        None, Throttle(LimitsConfig()), LimitsConfig(), state_file=None, limits_file=None, grace_s=1
    )
    joiner = joiner_of(
        dht, runtime, ManifestExpiries(tmp_path / "manifests.json"), republish_every_s=100.0
    )
    joiner._network = volunteer.wait_for_network  # as hosting wires it
    async with trio.open_nursery() as nursery:
        await nursery.start(volunteer.serve)
        await nursery.start(joiner.serve)
        await trio.sleep(30)
        assert dht.reads > 0  # rounds every 10 s while serving
        await volunteer.pause()
        reads, stores = dht.reads, dht.stores
        await trio.sleep(3600)  # an hour paused: rounds every 10 s, a republish every 100 s
        assert (dht.reads, dht.stores) == (reads, stores)
        assert joiner.state == "joined"
        await volunteer.resume()
        await trio.sleep(15)
        assert dht.reads > reads
        nursery.cancel_scope.cancel()
