"""``net.clones.CloneWatch``: a record under this node's id that this process did not
sign, issued after it started, is another daemon's (a copied identity.key); told once,
then at most hourly; a previous run's records, and other peers', are not."""

from __future__ import annotations

import logging

import pytest

from volunteerd.identity import Identity
from volunteerd.net.clones import WARN_EVERY_S, CloneWatch
from volunteerd.net.peers import peer_id_for
from volunteerd.net.records import ExpertRecord, sign_record

ME, OTHER = Identity.generate(), Identity.generate()
STARTED_AT = 1_000_000.0
MARGIN_S = 30.0


def record(identity: Identity, issued_at: float, port: int) -> ExpertRecord:
    return sign_record(
        identity,
        str(peer_id_for(identity)),
        key="ffn.",
        addrs=[f"/ip4/10.0.0.1/tcp/{port}"],
        children=[0],
        ttl_s=30.0,
        now=issued_at,
    )


class Clock:
    def __init__(self) -> None:
        self.now = 0.0

    def __call__(self) -> float:
        return self.now


def test_a_copys_records_are_told_once_an_hour_and_its_own_never(
    caplog: pytest.LogCaptureFixture,
) -> None:
    clock, told = Clock(), []
    watch = CloneWatch(str(peer_id_for(ME)), started_at=STARTED_AT, margin_s=MARGIN_S, clock=clock)
    watch.on_clone = told.append
    mine = record(ME, STARTED_AT + 100, 4001)
    watch.signed([mine])
    previous_run = record(ME, STARTED_AT - 5, 4000)  # restarted at another port
    within_margin = record(ME, STARTED_AT + MARGIN_S - 1, 4000)  # its clock a bit ahead
    someone_else = record(OTHER, STARTED_AT + 100, 4002)
    with caplog.at_level(logging.WARNING):
        watch.check([mine, previous_run, within_margin, someone_else])
        assert told == []
        assert watch.clash() is None

        copy = record(ME, STARTED_AT + 200, 4009)
        watch.check([copy])
        assert len(told) == 1
        assert "/ip4/10.0.0.1/tcp/4009" in told[0]
        assert "identity.key" in caplog.text
        assert watch.clash() == told[0]
        clock.now += WARN_EVERY_S / 2
        watch.check([record(ME, STARTED_AT + 300, 4009)])
        assert len(told) == 1  # at most hourly
        clock.now += WARN_EVERY_S
        watch.check([record(ME, STARTED_AT + 400, 4009)])
        assert len(told) == 2
        clock.now += WARN_EVERY_S + 1
        assert watch.clash() is None  # not seen for an hour


def test_issue_times_are_read_with_the_offset_this_node_follows() -> None:
    # The swarm's clock is 600 s ahead of this computer's, which this run follows: a
    # previous run's record signed just before this one started reads 600 s later.
    told: list[str] = []
    watch = CloneWatch(
        str(peer_id_for(ME)), started_at=STARTED_AT, margin_s=MARGIN_S, offset=lambda: 600.0
    )
    watch.on_clone = told.append
    watch.check([record(ME, STARTED_AT - 5 + 600, 4000)])
    assert told == []
    watch.check([record(ME, STARTED_AT + 120 + 600, 4000)])
    assert len(told) == 1
