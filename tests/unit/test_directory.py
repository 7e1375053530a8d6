"""The trainer's expert directory: cache, bans, and not believing a sudden empty answer."""

from __future__ import annotations

from collections.abc import Sequence

from volunteerd.identity import Identity
from volunteerd.moe import ExpertDirectory
from volunteerd.net import ExpertRecord, peer_id_for
from volunteerd.net.records import sign_record


class FakeDHT:
    def __init__(self) -> None:
        self.answers: dict[str, list[ExpertRecord]] = {}
        self.calls = 0

    async def get(self, keys: Sequence[str]) -> dict[str, list[ExpertRecord]]:
        self.calls += 1
        return {k: list(self.answers.get(k, [])) for k in keys}


class Clock:
    def __init__(self) -> None:
        self.now = 1000.0

    def __call__(self) -> float:
        return self.now


def record(identity: Identity, key: str, children: list[int]) -> ExpertRecord:
    return sign_record(
        identity, str(peer_id_for(identity)), key=key, addrs=["/ip4/127.0.0.1/tcp/1"],
        children=children, ttl_s=60,
    )  # fmt: skip


async def test_an_empty_refresh_right_after_servers_answered_is_not_believed() -> None:
    server = Identity.generate()
    dht, clock = FakeDHT(), Clock()
    directory = ExpertDirectory(dht, refresh_s=5.0, clock=clock)  # type: ignore[arg-type]
    dht.answers["ffn."] = [record(server, "ffn.", [0, 1])]
    assert set((await directory.children(["ffn."]))["ffn."]) == {0, 1}

    dht.answers["ffn."] = []  # a lookup that found nobody
    await directory._fetch(["ffn."])
    assert set((await directory.children(["ffn."]))["ffn."]) == {0, 1}
    assert directory.empty_answers == 1

    clock.now += 16.0  # the last real answer is stale now: nobody it is
    assert (await directory.children(["ffn."]))["ffn."] == {}

    directory.ban(str(peer_id_for(server)), "timeout: test")
    dht.answers["ffn."] = [record(server, "ffn.", [0])]
    clock.now += 16.0
    assert (await directory.children(["ffn."]))["ffn."] == {}  # banned
    assert directory.ban_reasons["timeout"] == 1
