"""The per-peer tables of the ``peers`` view stay bounded without freezing: a peer that
comes after the table is full gets its own row, the one idle longest makes room, and the
rows (its own and ``other``) still add up to every call counted. Both tables stopped
taking new peers once full, for the rest of the run: after 1,000 peers a new trainer's
calls showed only under ``other``, with no event, and the first 1,000 stayed listed."""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

import pytest

import volunteerd.net.rpc as rpc
import volunteerd.server.contribution as contribution
from volunteerd.config import Config, LimitsConfig
from volunteerd.control.events import EventLog
from volunteerd.errors import Paused
from volunteerd.net import Throttle
from volunteerd.net.rpc import RpcStats
from volunteerd.server.contribution import Accountant
from volunteerd.stats import StatsStore

CAP = 3


@contextmanager
def accountant(events: EventLog | None = None) -> Iterator[Accountant]:
    store = StatsStore.open(Path(":memory:"), keep_hourly_days=7)
    try:
        yield Accountant(
            store,
            None,
            Throttle(LimitsConfig()),
            Config().stats,
            serving=lambda: True,
            events=events,
        )
    finally:
        store.close()


def call(counts: Accountant, peer: str, n: int = 1) -> None:
    for _ in range(n):
        counts.served("forward", "ffn.0.0", peer, [], [])


async def test_a_new_peer_is_counted_as_itself_after_more_peers_than_the_table_holds(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.setattr(contribution, "_MAX_PEERS", CAP)
    events = EventLog()
    with accountant(events) as counts:
        for i in range(CAP + 4):
            call(counts, f"peer-{i}", 2)
        counts.refused("ffn.0.0", "peer-0", Paused("paused"))
        call(counts, "newcomer", 5)
        assert counts.peers["newcomer"].requests == 5
        assert "newcomer sent its first request" in [e.message for e in events.after(0)]
        assert len([p for p in counts.peers if p != "other"]) == CAP
        assert "peer-1" not in counts.peers  # the ones idle longest made room
        assert sum(c.requests for c in counts.peers.values()) == counts.requests == 2 * 7 + 5
        assert sum(c.refused for c in counts.peers.values()) == 1


async def test_a_full_table_forgets_a_peer_not_connected_before_a_connected_one(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.setattr(contribution, "_MAX_PEERS", CAP)
    with accountant() as counts:
        counts.connected = lambda: ["peer-0", "peer-1", "peer-2"]
        for i in range(CAP):
            call(counts, f"peer-{i}")
        call(counts, "peer-3")  # all connected: the one counted longest ago goes
        assert list(counts.peers) == ["peer-1", "peer-2", "other", "peer-3"]
        call(counts, "peer-4")  # peer-3 is the only one not connected
        assert list(counts.peers) == ["peer-1", "peer-2", "other", "peer-4"]
        assert counts.peers["other"].requests == 2


def test_a_peer_refused_now_has_its_own_row_after_the_table_filled(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.setattr(rpc, "_MAX_REFUSED_KEYS", CAP)
    stats = RpcStats()
    for i in range(CAP + 4):
        for _ in range(2):
            stats.count_refused(f"peer-{i}", "streams")
    stats.count_refused("peer-5", "bytes")
    stats.count_refused("newcomer", "streams")
    assert stats.refused[("newcomer", "streams")] == 1
    assert ("peer-5", "bytes") in stats.refused  # refused just before: kept
    assert len([k for k in stats.refused if k[0] != "other"]) <= CAP
    assert sum(stats.refused.values()) == 2 * 7 + 2
    streams = [n for (_, reason), n in stats.refused.items() if reason == "streams"]
    assert sum(streams) == 2 * 7 + 1
    assert stats.refused[("other", "streams")] > 0


async def test_a_flood_of_new_peers_does_not_push_other_events_out_of_the_log() -> None:
    # A new identity's first request is an event: fresh identities one after another
    # pushed every error and state change out of the 500 kept (the peers table no
    # longer stops posting after its first 1,000 peers). No kind keeps more than 100.
    events = EventLog()
    events.post("error", "statistics not saved: disk full")
    events.post("state", "paused")
    with accountant(events) as counts:
        for i in range(2_000):
            call(counts, f"peer-{i}")
    kept = events.after(0)
    assert [e.message for e in kept if e.kind != "peers"] == [
        "statistics not saved: disk full",
        "paused",
    ]
    newest = [e.message for e in kept if e.kind == "peers"]
    assert len(newest) == 100
    assert newest[-1].endswith("eer-1999 sent its first request")  # the id shortened
    assert [e.id for e in kept] == sorted(e.id for e in kept)
