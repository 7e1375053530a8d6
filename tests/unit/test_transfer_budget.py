"""The bulk replies' budget on its own: shares of the day's allowance, per party and
for all together, from the throttle's quotas and the ledger's day (an injected clock)."""

from __future__ import annotations

import datetime as dt
import time
from pathlib import Path
from zoneinfo import ZoneInfo

import pytest

from volunteerd.config import LimitsConfig
from volunteerd.errors import Busy, RateLimited
from volunteerd.net import Throttle
from volunteerd.net.throttle import TransferLedger
from volunteerd.server import transfers
from volunteerd.server.transfers import TransferBudget

NOON = 1_700_000_000.0 - 1_700_000_000.0 % 86400 + 12 * 3600
MB = 1_000_000


def budget(now: list[float], **limits: float) -> TransferBudget:
    ledger = TransferLedger(None, clock=lambda: now[0])
    return TransferBudget(Throttle(LimitsConfig(**limits), ledger))  # type: ignore[arg-type]


def test_without_a_quota_nothing_is_counted_or_refused() -> None:
    b = budget([NOON])
    for _ in range(100):
        b.check("10.0.0.1")
        b.take("10.0.0.1", 100 * MB, 100 * MB)


def test_a_party_gets_its_share_or_one_whole_transfer() -> None:
    b = budget([NOON], daily_quota_gb=1.0)  # a party's share: 5 %, 50 MB
    for _ in range(500):
        b.take("10.0.0.1", 100_000, 100_000)  # 8 whole transfers: 0.8 MB
    with pytest.raises(RateLimited):
        b.take("10.0.0.1", 100_000, 100_000)
    with pytest.raises(RateLimited):
        b.check("10.0.0.1")  # refused before its reply is built
    # a shard of 200 MB, in 4 MB chunks, to a joiner: whole, though over a quarter
    for _ in range(50):
        b.take("10.0.0.2", 4 * MB, 200 * MB)
    with pytest.raises(RateLimited):
        b.take("10.0.0.2", 4 * MB, 200 * MB)


def test_a_joiner_gets_the_experts_it_joins_with() -> None:
    # Experts of 2.1 MB (an outside audit): at a 0.1 GB daily quota a share of 5 % was
    # 5 MB, two experts, and every joiner choosing 6 was refused the rest.
    b = budget([NOON], daily_quota_gb=0.2)  # a party's share: 8 experts, 16.8 MB
    for _ in range(8):
        b.take("10.0.0.1", 2_100_000, 2_100_000)
    with pytest.raises(RateLimited):
        b.take("10.0.0.1", 2_100_000, 2_100_000)
    b = budget([NOON], daily_quota_gb=0.1)  # a quarter of the 50 MB bulk half: 12.5 MB
    for _ in range(5):
        b.take("10.0.0.1", 2_100_000, 2_100_000)
    with pytest.raises(RateLimited):
        b.take("10.0.0.1", 2_100_000, 2_100_000)


def test_a_party_gets_at_most_a_quarter_of_the_bulk_half() -> None:
    b = budget([NOON], daily_quota_gb=1.0)  # bulk half 500 MB, a quarter 125 MB
    for _ in range(6):
        b.take("10.0.0.1", 20 * MB, 20 * MB)  # 8 whole transfers would be 160 MB
    with pytest.raises(RateLimited):
        b.take("10.0.0.1", 20 * MB, 20 * MB)


def test_all_parties_together_get_half_the_days_allowance() -> None:
    b = budget([NOON], daily_quota_gb=1.0)
    for party in range(10):
        for _ in range(5):
            b.take(f"10.0.1.{party}", 10 * MB, 10 * MB)
    with pytest.raises(Busy):
        b.check("10.0.2.1")
    with pytest.raises(Busy):
        b.take("10.0.2.1", 1, 1)


def test_a_monthly_quota_allows_a_thirtieth_a_day_and_a_new_day_starts_afresh() -> None:
    now = [NOON]
    b = budget(now, monthly_quota_gb=30.0)  # 1 GB a day: 500 MB of bulk
    for party in range(10):
        b.take(f"10.0.1.{party}", 50 * MB, 50 * MB)
    with pytest.raises(Busy):
        b.take("10.0.2.1", 1, 1)
    now[0] += 86400.0
    b.take("10.0.2.1", 50 * MB, 50 * MB)
    b.take("10.0.1.0", 50 * MB, 50 * MB)


def test_the_party_table_is_bounded(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(transfers, "MAX_PARTIES", 8)
    b = budget([NOON], daily_quota_gb=1000.0)
    for party in range(100):
        b.take(f"party-{party}", 1, 1)
    assert len(b._parties) == 8


def test_a_day_ended_early_by_flying_west_starts_the_bulk_share_afresh(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """Berlin -> New York at Tuesday 03:00: the ledger's day ends at New York's
    midnight, 3 h later, and the next one has the same date (Tuesday). The bulk share
    was keyed on the date and stayed spent until Wednesday, 24 h more, while its
    refusals said "retry in 3 h" (a re-check)."""
    if not all(
        Path(f"/usr/share/zoneinfo/{z}").exists() for z in ("Europe/Berlin", "America/New_York")
    ):
        pytest.skip("no time zone data")
    berlin = dt.datetime(2026, 12, 8, 2, 0, tzinfo=ZoneInfo("Europe/Berlin")).timestamp()
    ny_midnight = dt.datetime(2026, 12, 8, 0, 0, tzinfo=ZoneInfo("America/New_York")).timestamp()
    try:
        monkeypatch.setenv("TZ", "Europe/Berlin")
        time.tzset()
        now = [berlin]
        b = budget(now, daily_quota_gb=1.0)
        for party in range(10):
            b.take(f"10.0.1.{party}", 50 * MB, 50 * MB)
        with pytest.raises(Busy):
            b.take("10.0.2.1", 1, 1)
        monkeypatch.setenv("TZ", "America/New_York")
        time.tzset()
        now[0] = berlin + 3600.0
        with pytest.raises(Busy) as refused:
            b.take("10.0.2.1", 1, 1)
        assert refused.value.retry_after_s == pytest.approx(ny_midnight - now[0], abs=1.0)
        now[0] = ny_midnight + 1.0
        b.take("10.0.2.1", 50 * MB, 50 * MB)
    finally:
        monkeypatch.undo()
        time.tzset()
