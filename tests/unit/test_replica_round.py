"""How long a replica averaging round takes (``runtime.averaging.ReplicaAverager``): a
replica that never answers is dropped after the fetch bound, the hosted experts are
gathered at once (a few at a time), and a round ends by its deadline.

In virtual time (``autojump_clock``), with the replies' checks and the weights' updates
run inline rather than in worker threads: virtual time jumps whenever every task waits,
a thread's work included, so with threads the clock could run past a deadline while a
check runs. Inline, every time below is exact."""

from __future__ import annotations

import itertools
import logging
from collections import Counter
from collections.abc import Sequence

import pytest
import torch
import trio

from volunteerd.config import ExpertsConfig, LimitsConfig, RuntimeConfig, WireLimits
from volunteerd.config.models import ReplicasConfig
from volunteerd.errors import PeerUnreachable, ReplyTooSlow, RequestTimeout
from volunteerd.experts import to_wire
from volunteerd.net import Throttle
from volunteerd.net.throttle import TransferLedger
from volunteerd.runtime import ExpertRuntime, averaging
from volunteerd.runtime.averaging import ReplicaAverager
from volunteerd.server.transfers import TransferBudget
from volunteerd.wire import WireTensor
from volunteerd.wire.messages import ParamsReply

REQUEST_S = 60.0  # the RPC client's bound on one call (timeouts.request_s)
SHIFT = 1e-4  # the honest replica's weights: its own plus this

Params = dict[str, torch.Tensor]
Reply = tuple[ParamsReply, list[WireTensor]]


pytestmark = pytest.mark.usefixtures("inline_threads")


def runtime_of(n: int) -> ExpertRuntime:
    uids = [f"ffn.0.{i}" for i in range(n)]
    experts = ExpertsConfig(hidden_dim=16)
    return ExpertRuntime(
        uids, experts, RuntimeConfig(device="cpu"), WireLimits(), torch.device("cpu")
    )


def reply_for(params: Params, uid: str) -> Reply:
    encoded = [to_wire(t) for t in params.values()]
    header = ParamsReply(uid=uid, updates=0, names=list(params), tensors=[m for m, _ in encoded])
    return header, [WireTensor(m.dtype, m.shape, memoryview(bytearray(d))) for m, d in encoded]


class Swarm:
    """Every uid is hosted by "honest" (the expert's own weights + SHIFT, after
    ``honest_s``) and by ``silent`` fresh identities a round that never answer: the RPC
    client's RequestTimeout after ``REQUEST_S``."""

    def __init__(self, runtime: ExpertRuntime, silent: int = 1, honest_s: float = 0.0) -> None:
        self.runtime = runtime
        self.silent = silent
        self.honest_s = honest_s
        self.fresh = itertools.count()
        self.listed: dict[str, list[str]] = {}  # uid -> the silent peers last listed
        self.gone: set[str] = set()  # peers that are unreachable at once
        self.fetched: list[str] = []  # uids, in the order their first fetch began
        self.calls: Counter[str] = Counter()
        self.in_flight: Counter[str] = Counter()  # uid -> fetches under way
        self.most_uids_at_once = 0
        self.silent_cut = 0  # silent fetches cancelled before REQUEST_S

    async def replicas(self, uid: str) -> list[str]:
        self.listed[uid] = [f"silent-{next(self.fresh)}" for _ in range(self.silent)]
        return ["honest", *self.listed[uid], *sorted(self.gone)]

    async def replicas_of(self, uids: Sequence[str]) -> dict[str, list[str]]:
        return {uid: await self.replicas(uid) for uid in uids}

    async def fetch(
        self,
        peer_id: str,
        uid: str,
        *,
        max_bytes: int,
        timeout_s: float | None = None,
        unless_version: str | None = None,
    ) -> Reply:
        self.calls[peer_id] += 1
        if uid not in self.fetched:
            self.fetched.append(uid)
        if peer_id in self.gone:
            raise PeerUnreachable(f"{peer_id}: gone")
        self.in_flight[uid] += 1
        self.most_uids_at_once = max(self.most_uids_at_once, len(+self.in_flight))
        try:
            if peer_id.startswith("silent"):
                # the stream opened, never answered: cut as the RPC client cuts it
                waited_s = REQUEST_S if timeout_s is None else min(REQUEST_S, timeout_s)
                try:
                    await trio.sleep(waited_s)
                except trio.Cancelled:
                    self.silent_cut += 1
                    raise
                raise RequestTimeout(f"{peer_id}: no reply within {waited_s}s")
            await trio.sleep(self.honest_s)
            own = self.runtime.backend(uid).parameter_copies()
            return reply_for({k: v + SHIFT for k, v in own.items()}, uid)
        finally:
            self.in_flight[uid] -= 1


def expert_bytes(runtime: ExpertRuntime) -> int:
    uid = runtime.uids[0]
    return sum(p.numel() * 4 for p in runtime.backend(uid).module.parameters())


async def timed_round(averager: ReplicaAverager) -> tuple[float, int]:
    """How long a round took (to the ms: virtual time is exact) and the replicas used."""
    start = trio.current_time()
    used = await averager.run_round()
    return round(trio.current_time() - start, 3), used


async def test_a_silent_replica_per_expert_holds_a_round_for_one_fetch_bound(
    autojump_clock: trio.abc.Clock,
) -> None:
    """Four hosted experts, each listed with a fresh identity a round that accepts and
    never answers (a never-asked peer always gets a place): a round used to ask the
    experts in turn and wait out the RPC's 60 s for each, 240 s. Now the silent peers
    are dropped after the fetch bound (5 s + the expert's bytes at 256 kbit/s), all four
    at once, and the honest replica is averaged with in every round."""
    runtime = runtime_of(4)
    before = {uid: runtime.backend(uid).parameter_copies() for uid in runtime.uids}
    swarm = Swarm(runtime)
    averager = ReplicaAverager(runtime, swarm, ReplicasConfig(), clock=trio.current_time)
    rounds = [await timed_round(averager) for _ in range(3)]
    assert all(took < 6 for took, _ in rounds), rounds  # were 240 s each
    bound = averaging.fetch_bound_s(expert_bytes(runtime))  # of a 8.5 KB expert
    assert rounds == [(round(bound, 3), 4)] * 3
    stats = averager.statistics()
    assert stats.rejected == {"timeout": 12}
    assert stats.averaged == 12
    assert swarm.calls["honest"] == 12
    for uid, own in before.items():  # three rounds, each the mean of own and own + SHIFT
        after = runtime.backend(uid).parameter_copies()
        for k in own:
            torch.testing.assert_close(after[k], own[k] + 3 * SHIFT / 2)
    # each silent identity backs off as a failure; the honest replica is known
    assert all(averager._failed[p][1] == 1 for ps in swarm.listed.values() for p in ps)
    assert "honest" in averager._good


async def test_experts_are_gathered_a_few_at_a_time(autojump_clock: trio.abc.Clock) -> None:
    """Ten experts whose replica takes 1 s to answer: four at a time, three batches,
    3 s (one after another: 10 s)."""
    runtime = runtime_of(10)
    swarm = Swarm(runtime, silent=0, honest_s=1.0)
    averager = ReplicaAverager(runtime, swarm, ReplicasConfig(), clock=trio.current_time)
    assert await timed_round(averager) == (3.0, 10)
    assert swarm.most_uids_at_once == averaging.CONCURRENT_EXPERTS == 4


async def test_large_experts_are_gathered_fewer_at_a_time(
    autojump_clock: trio.abc.Clock, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Replies are held in memory until averaged: no more experts at once than
    ``max_peers`` replies of each fit ``GATHER_BUDGET_BYTES``, one at least."""
    runtime = runtime_of(4)
    size = expert_bytes(runtime)
    swarm = Swarm(runtime, silent=0, honest_s=1.0)
    averager = ReplicaAverager(runtime, swarm, ReplicasConfig(max_peers=2), clock=trio.current_time)
    monkeypatch.setattr(averaging, "GATHER_BUDGET_BYTES", 2 * 2 * size)  # two experts' worth
    assert await timed_round(averager) == (2.0, 4)
    assert swarm.most_uids_at_once == 2
    monkeypatch.setattr(averaging, "GATHER_BUDGET_BYTES", 1)
    swarm.most_uids_at_once = 0
    assert await timed_round(averager) == (4.0, 4)
    assert swarm.most_uids_at_once == 1


async def test_a_round_ends_by_its_deadline_and_experts_left_out_go_first_next(
    autojump_clock: trio.abc.Clock,
) -> None:
    """Twelve experts, each with a silent replica; rounds every 10 s, so a round ends
    10 s after it began (longer than one fetch bound). The first four experts take a
    fetch bound, the next four are cut at 10 s: their honest replies, checked by then,
    are averaged, and their silent peers, cut by the round rather than by their own
    bound, are not counted. The last four are not begun: next round they go first, then
    the others in the order they were last gathered."""
    runtime = runtime_of(12)
    uids = list(runtime.uids)
    swarm = Swarm(runtime)
    averager = ReplicaAverager(
        runtime, swarm, ReplicasConfig(average_every_s=10.0), clock=trio.current_time
    )
    bound = averaging.fetch_bound_s(expert_bytes(runtime))
    assert 2 * bound > 10.0 > bound
    assert await timed_round(averager) == (10.0, 8)
    assert set(swarm.fetched[:4]) == set(uids[:4])  # in line (trio starts tasks in any order)
    assert set(swarm.fetched[4:]) == set(uids[4:8])
    stats = averager.statistics()
    assert stats.rejected == {"timeout": 4}
    assert swarm.silent_cut == 4  # by the round; the first four ended at their bound
    cut = [p for uid in uids[4:8] for p in swarm.listed[uid]]
    assert not any(p in averager._failed for p in cut)
    assert stats.rounds == 8

    swarm.fetched.clear()
    assert await timed_round(averager) == (10.0, 8)
    assert set(swarm.fetched[:4]) == set(uids[8:])
    assert set(swarm.fetched[4:]) == set(uids[:4])
    assert averager.statistics().rejected == {"timeout": 8}


class SlowLookups(Swarm):
    """A DHT lookup that takes ``LOOKUP_TAKES_S`` (a real one takes up to
    ``timeouts.dht_lookup_s``)."""

    async def replicas(self, uid: str) -> list[str]:
        await trio.sleep(LOOKUP_TAKES_S)
        return await super().replicas(uid)


LOOKUP_TAKES_S = 1.0


async def test_a_silent_replica_is_dropped_when_rounds_come_faster_than_a_fetch_bound(
    autojump_clock: trio.abc.Clock,
) -> None:
    """Rounds every second, an expert whose fetch bound is longer: a round lasts one
    fetch bound, and its fetches began after the lookup, so the silent replica was cut
    by the round's deadline, never by its own bound: never counted nor backed off, it
    held every round for its whole length. The round now leaves room for the lookup."""
    runtime = runtime_of(1)
    swarm = SlowLookups(runtime)
    averager = ReplicaAverager(
        runtime,
        swarm,
        ReplicasConfig(average_every_s=1.0),
        clock=trio.current_time,
        lookup_s=2 * LOOKUP_TAKES_S,
    )
    bound = averaging.fetch_bound_s(expert_bytes(runtime))
    assert bound > 1.0
    assert await timed_round(averager) == (round(LOOKUP_TAKES_S + bound, 3), 1)
    stats = averager.statistics()
    assert stats.rejected == {"timeout": 1}
    assert all(averager._failed[p][1] == 1 for p in swarm.listed[runtime.uids[0]])
    assert averager.round_s(expert_bytes(runtime)) == 2 * LOOKUP_TAKES_S + bound


async def test_a_peer_that_fails_for_several_experts_of_a_round_backs_off_once(
    autojump_clock: trio.abc.Clock,
) -> None:
    """The experts of a round are gathered at once, so a peer hosting three of them
    fails three times in the same instant: one failure, as when they were asked in
    turn (the peer was not asked for the second once the first had failed)."""
    runtime = runtime_of(3)
    swarm = Swarm(runtime, silent=0)
    swarm.gone.add("gone")
    averager = ReplicaAverager(
        runtime, swarm, ReplicasConfig(average_every_s=10.0), clock=trio.current_time
    )
    assert await averager.run_round() == 3
    assert averager._failed["gone"] == (trio.current_time() + 10.0, 1)
    await trio.sleep(10.0)
    assert await averager.run_round() == 3
    assert averager._failed["gone"] == (trio.current_time() + 20.0, 2)
    assert swarm.calls["gone"] == 6


class FewReplicated(Swarm):
    """Only ``replicated`` uids have a replica ("honest"); every lookup, of one uid or
    of many, takes ``LOOKUP_TAKES_S``."""

    def __init__(self, runtime: ExpertRuntime, replicated: set[str]) -> None:
        super().__init__(runtime, silent=0, honest_s=1.0)
        self.replicated = replicated
        self.lookups: list[list[str]] = []  # the uids of each lookup

    async def replicas(self, uid: str) -> list[str]:
        return (await self.replicas_of([uid]))[uid]

    async def replicas_of(self, uids: Sequence[str]) -> dict[str, list[str]]:
        self.lookups.append(list(uids))
        await trio.sleep(LOOKUP_TAKES_S)
        return {uid: ["honest"] if uid in self.replicated else [] for uid in uids}


async def test_experts_without_replicas_take_none_of_a_rounds_time(
    autojump_clock: trio.abc.Clock,
) -> None:
    """A lookup per hosted expert, four at a time, replicated or not: two daemons of 512
    experts each ran every round out of time (the first after 17 experts; outside
    audit). Here 64 experts, lookups of 1 s and rounds every 10 s: the two with a
    replica, last in line, were never reached. Now one round looks all 64 up at once
    and spends its time on those two only."""
    runtime = runtime_of(64)
    replicated = set(runtime.uids[-2:])
    swarm = FewReplicated(runtime, replicated)
    averager = ReplicaAverager(
        runtime,
        swarm,
        ReplicasConfig(average_every_s=10.0),
        clock=trio.current_time,
        lookup_s=2 * LOOKUP_TAKES_S,
    )
    assert await timed_round(averager) == (LOOKUP_TAKES_S + swarm.honest_s, 2)
    assert swarm.lookups == [list(runtime.uids)]
    assert set(swarm.fetched) == replicated
    assert averager._replicated == replicated
    assert averager.statistics().rounds == 2


async def test_averaging_fetches_stay_within_the_quotas_bulk_share(
    autojump_clock: trio.abc.Clock, caplog: pytest.LogCaptureFixture
) -> None:
    """Under a daily quota the averager's own fetches go against the bulk half, at most
    half of it: fetches that do not fit are skipped, then whole rounds (no lookups),
    logged once. Before, nothing bounded them: a seed's averaging received 164 MB in
    ~70 s under a 0.2 GB quota and stopped serving until midnight (an outside audit)."""
    runtime = runtime_of(4)
    fetch_bytes = expert_bytes(runtime) + averaging.FETCH_FRAME_BYTES
    now = 1_700_000_000.0 - 1_700_000_000.0 % 86400 + 12 * 3600
    ledger = TransferLedger(None, clock=lambda: now)
    # averaging's share (a quarter of the allowance): two and a half fetches
    allowance = 10 * fetch_bytes
    throttle = Throttle(LimitsConfig(daily_quota_gb=allowance / 1e9), ledger)
    budget = TransferBudget(throttle)
    swarm = Swarm(runtime, silent=0, honest_s=1.0)
    averager = ReplicaAverager(
        runtime, swarm, ReplicasConfig(), clock=trio.current_time, budget=budget
    )
    with caplog.at_level(logging.WARNING, logger="volunteerd.server.transfers"):
        assert await averager.run_round() == 2  # two experts; two skipped
        assert averager.statistics().skipped_for_quota == 2
        assert budget._total == budget._fetched == 2 * fetch_bytes
        lookups = len(swarm.listed)
        swarm.listed.clear()
        assert await averager.run_round() == 0  # no fetch fits: not even a lookup
        assert not swarm.listed
        assert averager.statistics().skipped_for_quota == 3
    assert lookups == 4
    assert swarm.calls["honest"] == 2
    assert budget._total <= allowance // 4
    skipped = [r for r in caplog.records if "averaging skipped" in r.getMessage()]
    assert len(skipped) == 1
    # what peers download keeps the rest of the bulk half
    budget.take("10.0.0.1", fetch_bytes, fetch_bytes)


async def test_a_fetch_that_brought_no_reply_gives_its_bytes_back_to_the_budget(
    autojump_clock: trio.abc.Clock,
) -> None:
    """Beside each honest replica one that never answers: its fetches, cut at their
    bound, count nothing against the quota's bulk half. Before, they counted whole: half
    of averaging's share went to fetches that brought nothing (a re-check)."""
    runtime = runtime_of(4)
    fetch_bytes = expert_bytes(runtime) + averaging.FETCH_FRAME_BYTES
    now = 1_700_000_000.0 - 1_700_000_000.0 % 86400 + 12 * 3600
    ledger = TransferLedger(None, clock=lambda: now)
    throttle = Throttle(LimitsConfig(daily_quota_gb=1000 * fetch_bytes / 1e9), ledger)
    budget = TransferBudget(throttle)
    swarm = Swarm(runtime, silent=1)
    averager = ReplicaAverager(
        runtime, swarm, ReplicasConfig(), clock=trio.current_time, budget=budget
    )
    await averager.run_round()
    assert swarm.calls["honest"] == 4
    assert sum(n for peer, n in swarm.calls.items() if peer.startswith("silent")) == 4
    assert budget._total == budget._fetched == 4 * fetch_bytes


class SlowAndGone:
    """Every uid is hosted by "slow", whose reply arrives too slowly (cut at the fetch
    bound as the RPC client cuts it, ``ReplyTooSlow`` with ``ARRIVED`` bytes in), and by
    "gone" (no stream opens)."""

    ARRIVED = 3000

    async def replicas(self, uid: str) -> list[str]:
        return ["slow", "gone"]

    async def replicas_of(self, uids: Sequence[str]) -> dict[str, list[str]]:
        return {uid: await self.replicas(uid) for uid in uids}

    async def fetch(
        self,
        peer_id: str,
        uid: str,
        *,
        max_bytes: int,
        timeout_s: float | None = None,
        unless_version: str | None = None,
    ) -> Reply:
        if peer_id == "gone":
            raise PeerUnreachable(f"{peer_id}: no stream")
        assert timeout_s == averaging.fetch_bound_s(max_bytes)
        await trio.sleep(timeout_s)
        raise ReplyTooSlow(
            f"params: reply of {max_bytes} bytes not whole",
            received=self.ARRIVED,
            declared=max_bytes + 300,
        )


async def test_a_replica_too_slow_to_send_its_parameters_is_told_from_one_gone(
    autojump_clock: trio.abc.Clock, caplog: pytest.LogCaptureFixture
) -> None:
    """A reply cut at its bound while it was arriving is "too_slow", not "unreachable"
    (before, both were: the audit's replicas were sending at full rate); a WARNING says
    so once per expert, not every round; and what arrived of it stays counted against
    the quota's bulk share, only the rest given back."""
    runtime = runtime_of(2)
    now = 1_700_000_000.0 - 1_700_000_000.0 % 86400 + 12 * 3600
    ledger = TransferLedger(None, clock=lambda: now)
    throttle = Throttle(LimitsConfig(daily_quota_gb=1.0), ledger)
    budget = TransferBudget(throttle)
    averager = ReplicaAverager(
        runtime, SlowAndGone(), ReplicasConfig(), clock=trio.current_time, budget=budget
    )
    with caplog.at_level(logging.INFO, logger="volunteerd.runtime.averaging"):
        for _ in range(3):
            assert await averager.run_round() == 0
            await trio.sleep(averaging._MAX_BACKOFF_S)  # both peers asked again
    stats = averager.statistics()
    assert stats.rejected == {"too_slow": 6, "unreachable": 6}
    warnings = [r.getMessage() for r in caplog.records if r.levelno == logging.WARNING]
    assert len(warnings) == 2
    size_mb = f"{expert_bytes(runtime) / 1e6:.1f} MB"
    for uid, message in zip(sorted(runtime.uids), sorted(warnings), strict=True):
        assert uid in message
        assert size_mb in message
        assert "kbit/s" in message
    assert budget._total == budget._fetched == 6 * SlowAndGone.ARRIVED
