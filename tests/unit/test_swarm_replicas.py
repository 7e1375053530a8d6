"""``server.replicas.SwarmReplicas``: who else hosts an expert, as the replica averager
sees it, when a DHT lookup does not answer in time."""

from __future__ import annotations

from types import SimpleNamespace
from typing import Any, cast

import pytest
import trio

from volunteerd.errors import Paused
from volunteerd.net.records import ExpertRecord
from volunteerd.server.replicas import LOOKUP_KEYS, SwarmReplicas

UID = "ffn.0.0"


class SlowDHT:
    """Answers lookups at once until ``hang`` is set; then never (a stale connection
    after a freeze, a silent peer)."""

    def __init__(self, records: list[ExpertRecord]) -> None:
        self.records, self.hang = records, False
        self.lookups: list[list[str]] = []  # the keys of each lookup

    async def get(self, keys: list[str]) -> dict[str, list[ExpertRecord]]:
        self.lookups.append(list(keys))
        if self.hang:
            await trio.sleep_forever()
        return {key: [r for r in self.records if r.key == key] for key in keys}


def record(peer_id: str, key: str = UID) -> ExpertRecord:
    return ExpertRecord.model_construct(
        key=key, peer_id=peer_id, addrs=("/ip4/127.0.0.1/tcp/1",), issued_at=0.0
    )


async def test_a_lookup_that_times_out_gives_the_last_answer_not_none(
    autojump_clock: trio.abc.Clock,
) -> None:
    """A timed-out lookup read as "no replicas": after a freeze the averager then
    served its stale expert at once instead of catching up with its replicas."""
    dht = SlowDHT([record("me"), record("other")])
    node = SimpleNamespace(dht=dht, peer_id="me")
    replicas = SwarmReplicas(cast(Any, node), lookup_s=5.0)
    assert await replicas.replicas(UID) == ["other"]
    dht.hang = True
    started = trio.current_time()
    assert await replicas.replicas(UID) == ["other"]
    assert trio.current_time() - started == 5.0
    assert await replicas.replicas("ffn.9.9") == []  # never looked up: none known


async def test_outside_the_network_hours_no_replica_is_looked_up() -> None:
    """Paused, not "no replica": the catch-up served held experts on that."""
    dht = SlowDHT([record("other")])
    allowed = [True]
    replicas = SwarmReplicas(
        cast(Any, SimpleNamespace(dht=dht, peer_id="me")), lookup_s=5.0, allowed=lambda: allowed[0]
    )
    assert await replicas.replicas(UID) == ["other"]
    allowed[0] = False
    looked_up = len(dht.lookups)
    with pytest.raises(Paused):
        await replicas.replicas(UID)
    assert len(dht.lookups) == looked_up
    with pytest.raises(Paused):  # a catch-up's next round fetches without a lookup
        await replicas.fetch("other", UID, max_bytes=1 << 20)


async def test_many_uids_are_looked_up_in_a_few_batched_lookups(
    autojump_clock: trio.abc.Clock,
) -> None:
    """The averager looked each hosted uid up on its own, 512 lookups a round for a
    daemon of 512 experts. ``replicas_of`` asks for ``LOOKUP_KEYS`` uids a lookup, all
    at once, each bounded by the lookup time; a lookup that times out gives its uids'
    last answers."""
    uids = [f"ffn.{i}.{j}" for i in range(3) for j in range(200)]  # 600
    dht = SlowDHT([record("me", "ffn.0.5"), record("other", "ffn.0.5"), record("b", "ffn.2.9")])
    replicas = SwarmReplicas(cast(Any, SimpleNamespace(dht=dht, peer_id="me")), lookup_s=5.0)
    found = await replicas.replicas_of(uids)
    assert sorted(len(keys) for keys in dht.lookups) == [88, LOOKUP_KEYS, LOOKUP_KEYS]  # at once
    assert sorted(key for keys in dht.lookups for key in keys) == sorted(uids)
    assert {uid: peers for uid, peers in found.items() if peers} == {
        "ffn.0.5": ["other"],
        "ffn.2.9": ["b"],
    }
    assert found.keys() == set(uids)
    dht.hang = True
    started = trio.current_time()
    again = await replicas.replicas_of(uids)
    assert trio.current_time() - started == 5.0  # the lookups ran at once
    assert again == found
