"""A seed whose transfer quota's share for bulk replies is used up says until when
(``retry_after_s``: to the end of the quota's day), and joiners fill their room from the
replicas that can give now instead of asking it again and again.

An outside re-check: 8 joiners at a seed of 32 experts of 2.1 MB with a 0.1 GB daily
quota held 2-5 of their 6 experts for ~30 min, then seeded the rest from initial
weights, while other joiners held experts they could have given: the choice (fewest
replicas first) kept taking the experts only the spent seed held."""

from __future__ import annotations

import random
import time
import types
from pathlib import Path
from typing import Any

import pytest
import torch
import trio

from volunteerd.config import Config, ExperimentsConfig, ExpertsConfig, LimitsConfig
from volunteerd.errors import Busy, RateLimited, RemoteError, ShardError
from volunteerd.experts import ExpertBackend
from volunteerd.net import PeerAddress, Throttle, Verb
from volunteerd.net.rpc import Reply, Request, RpcClient, RpcServer
from volunteerd.net.shard import download_shard
from volunteerd.net.throttle import TransferLedger
from volunteerd.server.transfers import TransferBudget
from volunteerd.swarm import joiner as joiner_module
from volunteerd.swarm.joiner import Joiner
from volunteerd.testing.memnet import MemoryNetwork
from volunteerd.wire import BatchReply, ErrorReply, ShardRequest
from volunteerd.wire.frames import encode_frame

NOON = 1_700_000_000.0 - 1_700_000_000.0 % 86400 + 12 * 3600
MB = 1_000_000
HOUR = 3600.0


def to_local_midnight(now: float) -> float:
    t = time.localtime(now)
    return time.mktime((t.tm_year, t.tm_mon, t.tm_mday + 1, 0, 0, 0, 0, 0, -1)) - now


# ------------------------------------------------------------------ the refusal says when


def test_a_spent_bulk_budget_refuses_until_the_ledgers_midnight() -> None:
    now = [NOON]
    ledger = TransferLedger(None, clock=lambda: now[0])
    budget = TransferBudget(Throttle(LimitsConfig(daily_quota_gb=0.1), ledger))
    for _ in range(5):  # a party's share: a quarter of the bulk half, 12.5 MB
        budget.take("10.0.0.0", 2_500_000, 2_500_000)
    with pytest.raises(RateLimited) as limited:
        budget.check("10.0.0.0")
    for party in range(1, 4):  # the bulk half, 50 MB
        for _ in range(5):
            budget.take(f"10.0.0.{party}", 2_500_000, 2_500_000)
    with pytest.raises(Busy) as busy:
        budget.check("10.0.0.9")
    left = to_local_midnight(NOON)
    assert 0 < left <= 25 * HOUR
    assert busy.value.retry_after_s == pytest.approx(left)
    assert limited.value.retry_after_s == pytest.approx(left)
    now[0] += 5 * HOUR  # later the same day: less left
    with pytest.raises(Busy) as later:
        budget.take("10.0.0.9", 1, 1)
    assert later.value.retry_after_s == pytest.approx(left - 5 * HOUR)


def test_a_full_queue_says_no_time() -> None:
    assert Busy("4 params and shard replies going out").retry_after_s is None


def test_an_error_reply_without_a_time_is_the_same_bytes_as_before() -> None:
    # Older peers' ErrorReply forbids extra fields: every other refusal must not change.
    assert encode_frame(ErrorReply(code="busy", message="try later")) == (
        b'VD\x01\x006\x00\x00\x00\x00\x00\x00\x00\x00\x00\x00\x00{"status":"error",'
        b'"code":"busy","message":"try later"}'
    )
    assert encode_frame(BatchReply(items=[ErrorReply(code="busy", message="full")])) == (
        b'VD\x01\x00K\x00\x00\x00\x00\x00\x00\x00\x00\x00\x00\x00{"status":"ok","items":'
        b'[{"status":"error","code":"busy","message":"full"}]}'
    )


def test_an_error_reply_with_a_time_round_trips_within_its_bounds() -> None:
    reply = ErrorReply(code="busy", message="quota", retry_after_s=25_920.5)
    assert ErrorReply.model_validate_json(reply.model_dump_json()) == reply
    for bad in ("-1", "1e9", "NaN", "Infinity", '"soon"'):
        with pytest.raises(ValueError):
            ErrorReply.model_validate_json(
                f'{{"status":"error","code":"busy","retry_after_s":{bad}}}'
            )


async def test_a_refusals_time_reaches_the_caller_as_the_remote_errors(
    autojump_clock: trio.abc.Clock,
) -> None:
    config = Config()
    refusals = [Busy("quota's share used", retry_after_s=7 * HOUR), Busy("queue full")]

    async def refuse(request: Request) -> Reply:
        raise refusals.pop(0)

    network = MemoryNetwork()
    async with network.open_host() as server_host, network.open_host() as client_host:
        server = RpcServer(
            server_host, {Verb.SHARD: refuse}, config.wire, config.timeouts, config.peer_limits
        )
        server.install()
        client = RpcClient(client_host, config.wire, config.timeouts)
        try:
            request = ShardRequest(uid="ffn.0.0", offset=0, length=1024)
            with pytest.raises(RemoteError) as spent:
                await client.call_raw(server_host.address, Verb.SHARD, request)
            assert (spent.value.code, spent.value.retry_after_s) == ("busy", 7 * HOUR)
            with pytest.raises(RemoteError) as full:
                await client.call_raw(server_host.address, Verb.SHARD, request)
            assert (full.value.code, full.value.retry_after_s) == ("busy", None)
        finally:
            await client.aclose()


class RefusingRpc:
    """Answers every shard request with ``error``."""

    def __init__(self, error: RemoteError) -> None:
        self.error = error
        self.calls = 0

    async def call_raw(self, *args: Any, **kwargs: Any) -> Any:
        self.calls += 1
        raise self.error


async def test_a_download_refused_for_longer_than_its_retries_gives_up_at_once(
    autojump_clock: trio.abc.Clock, tmp_path: Path
) -> None:
    peer = PeerAddress("seed", ["/ip4/127.0.0.1/tcp/1"])
    spent = RemoteError("busy", "try again tomorrow", retry_after_s=7 * HOUR)
    rpc = RefusingRpc(spent)
    with pytest.raises(ShardError) as caught:
        await download_shard(rpc, peer, "ffn.0.0", tmp_path / "a", retries=4, backoff_s=0.5)  # type: ignore[arg-type]
    assert rpc.calls == 1
    assert caught.value.__cause__ is spent  # the joiner still reads its code
    # a short time, within the backoff's: retried as before
    rpc = RefusingRpc(RemoteError("busy", "a moment", retry_after_s=1.0))
    with pytest.raises(ShardError):
        await download_shard(rpc, peer, "ffn.0.0", tmp_path / "b", retries=4, backoff_s=0.5)  # type: ignore[arg-type]
    assert rpc.calls == 5


# ------------------------------------------------------ the joiner fills its room elsewhere

CONFIG = ExpertsConfig(hidden_dim=8)
SEED = PeerAddress("seed", ["/ip4/127.0.0.1/tcp/1"])
OTHER = PeerAddress("joiner", ["/ip4/127.0.0.1/tcp/2"])
UIDS = [f"ffn.0.{i}" for i in range(8)]
HELD = UIDS[:3]  # what the other joiner holds (the seed holds them all)


class Swarm:
    """Gives any expert; the seed refuses until ``spent_until`` (a spent quota)."""

    def __init__(self, spent_until: float) -> None:
        self.spent_until = spent_until
        self.asked: list[tuple[str, str]] = []

    async def download(self, peer: PeerAddress, backend: ExpertBackend) -> object:
        self.asked.append((peer.peer_id, backend.uid))
        await trio.sleep(1.0)
        now = trio.current_time()
        if peer.peer_id == "seed" and now < self.spent_until:
            cause = RemoteError("busy", "try again tomorrow")
            cause.retry_after_s = self.spent_until - now  # what the seed's reply said
            raise ShardError(f"shard from seed: {cause}", resumable=True) from cause
        if peer.peer_id == "broken":
            raise ShardError("the bytes received do not match their sha256", resumable=False)
        trained = ExpertBackend(backend.uid, CONFIG, torch.device("cpu"), 64)
        trained.backward([torch.randn(2, 8)], [torch.randn(2, 8)])
        trained.step()
        return trained.state()

    async def discard(self, uid: str) -> None:
        pass


def joiner_in(swarm: Swarm, capacity: int) -> Joiner:
    async def run(fn: Any) -> Any:
        return fn()

    async def add_expert(backend: ExpertBackend) -> None:
        pass

    runtime = types.SimpleNamespace(
        make_backend=lambda uid, experts: ExpertBackend(uid, experts, torch.device("cpu"), 64),
        add_expert=add_expert,
        executor=types.SimpleNamespace(run=run),
    )
    joiner = Joiner(
        types.SimpleNamespace(peer_id="me"),  # type: ignore[arg-type]
        runtime,  # type: ignore[arg-type]
        lambda: None,
        None,
        swarm,
        ExperimentsConfig(),
        lambda experts: capacity,
        clock=trio.current_time,
        rng=random.Random(5),
    )
    joiner.manifest = types.SimpleNamespace(  # type: ignore[assignment]
        uids=lambda: UIDS, replication=2, experts_config=lambda: CONFIG, owner="o", name="n"
    )
    joiner.capacity = capacity

    async def listed(asked: list[str]) -> dict[str, list[PeerAddress]]:
        return {uid: [SEED, OTHER] if uid in HELD else [SEED] for uid in asked}

    joiner.live_replicas = listed  # type: ignore[method-assign]
    return joiner


async def test_a_spent_seed_is_asked_once_and_the_room_filled_from_the_others(
    autojump_clock: trio.abc.Clock, inline_threads: None
) -> None:
    swarm = Swarm(spent_until=trio.current_time() + 7 * HOUR)
    joiner = joiner_in(swarm, capacity=4)
    start = trio.current_time()
    await joiner.rebalance()
    assert trio.current_time() - start < 60  # no busy wait
    assert set(joiner.hosted) == set(HELD)
    assert set(joiner.sources.values()) == {"replica joiner"}  # none seeded
    assert sum(peer == "seed" for peer, _ in swarm.asked) == 1
    assert not joiner._busy_rounds  # nothing counted towards seeding
    assert not joiner._busy_until
    said = joiner.waiting
    assert said is not None
    assert said.startswith("1 expert waits for replicas whose daily transfer quota is used up")
    assert said.endswith("(in 6 h 59 min)"), said
    # a later round asks the seed nothing while it is spent
    await joiner.rebalance()
    assert sum(peer == "seed" for peer, _ in swarm.asked) == 1
    # once its day is over, its experts are candidates again
    await trio.sleep(7 * HOUR)
    await joiner.rebalance()
    assert len(joiner.hosted) == 4
    assert sorted(joiner.sources.values()).count("replica seed") == 1
    assert joiner.waiting is None


async def test_a_full_room_waits_for_nothing(
    autojump_clock: trio.abc.Clock, inline_threads: None
) -> None:
    swarm = Swarm(spent_until=trio.current_time() + 7 * HOUR)
    joiner = joiner_in(swarm, capacity=3)
    await joiner.rebalance()
    assert set(joiner.hosted) == set(HELD)
    assert sum(peer == "seed" for peer, _ in swarm.asked) == 1
    assert joiner.waiting is None


async def test_a_peer_that_stays_spent_past_its_times_is_only_busy_then(
    autojump_clock: trio.abc.Clock, inline_threads: None
) -> None:
    """A stranger that lists every expert and claims a spent quota day after day would
    hold a newcomer's room for good: after ``_SPENT_CLAIMS`` claims, its refusals count
    as busy rounds, which end in seeding."""
    swarm = Swarm(spent_until=float("inf"))
    joiner = joiner_in(swarm, capacity=1)

    async def only_the_stranger(asked: list[str]) -> dict[str, list[PeerAddress]]:
        return {uid: [SEED] for uid in asked}

    joiner.live_replicas = only_the_stranger  # type: ignore[method-assign]
    for _ in range(joiner_module._SPENT_CLAIMS):
        await joiner.rebalance()
        assert not joiner.hosted
        await trio.sleep(joiner_module._SPENT_MOST_S + 1)
    for _ in range(joiner_module._BUSY_ROUNDS + 1):
        await joiner.rebalance()
        await trio.sleep(joiner_module._BUSY_WAIT_S + 1)
    assert list(joiner.sources.values()) == ["seed"]


async def test_an_expert_whose_other_replica_fails_waits_for_the_spent_one_unseeded(
    autojump_clock: trio.abc.Clock, inline_threads: None
) -> None:
    """A spent replica has the trained weights: its expert is not seeded because the
    other replica sent bad bytes, nor tried again and again within the round."""
    swarm = Swarm(spent_until=trio.current_time() + 7 * HOUR)
    joiner = joiner_in(swarm, capacity=2)
    broken = PeerAddress("broken", ["/ip4/127.0.0.1/tcp/3"])

    async def listed(asked: list[str]) -> dict[str, list[PeerAddress]]:
        return {uid: [SEED, broken] if uid == "ffn.0.0" else [SEED, OTHER] for uid in asked}

    joiner.live_replicas = listed  # type: ignore[method-assign]
    joiner.manifest = types.SimpleNamespace(  # type: ignore[assignment]
        uids=lambda: ["ffn.0.0", "ffn.0.1"],
        replication=2,
        experts_config=lambda: CONFIG,
        owner="o",
        name="n",
    )
    for _ in range(3):
        await joiner.rebalance()
    assert joiner.sources == {"ffn.0.1": "replica joiner"}
    assert sum(peer == "broken" for peer, _ in swarm.asked) <= 3  # once a round at most
    assert sum(peer == "seed" for peer, _ in swarm.asked) == 1


async def test_fresh_identities_claiming_a_spent_quota_hold_an_expert_a_day_at_most(
    autojump_clock: trio.abc.Clock, inline_threads: None
) -> None:
    """The bound is the expert's, not the peer's: a stranger announcing every expert
    under a fresh identity every 47 h, each claiming a spent quota for the wire's two
    days, kept a newcomer's room empty for 10 simulated days (a re-check). An expert
    waits on spent replicas a day at most; then their refusals are busy rounds."""
    swarm = Swarm(spent_until=float("inf"))
    joiner = joiner_in(swarm, capacity=1)
    start = trio.current_time()

    async def a_fresh_stranger(asked: list[str]) -> dict[str, list[PeerAddress]]:
        era = int((trio.current_time() - start) // (47 * HOUR))
        return {uid: [PeerAddress(f"seed{era}", SEED.addrs)] for uid in asked}

    async def refuse_for_two_days(peer: PeerAddress, backend: ExpertBackend) -> object:
        swarm.asked.append((peer.peer_id, backend.uid))
        await trio.sleep(1.0)
        cause = RemoteError("busy", "try again tomorrow")
        cause.retry_after_s = 2 * 86400.0  # the most the wire carries
        raise ShardError(f"shard from {peer.peer_id}: {cause}", resumable=True) from cause

    joiner.live_replicas = a_fresh_stranger  # type: ignore[method-assign]
    swarm.download = refuse_for_two_days  # type: ignore[method-assign]
    while not joiner.hosted and trio.current_time() - start < 4 * 86400:
        await joiner.rebalance()
        await trio.sleep(60.0)
    waited = trio.current_time() - start
    assert list(joiner.sources.values()) == ["seed"]
    busy_wait = joiner_module._BUSY_WAIT_S
    bound = joiner_module._SPENT_MOST_S + (joiner_module._BUSY_ROUNDS + 1) * 2 * busy_wait
    assert waited < bound, waited / HOUR


async def test_the_spent_peers_remembered_are_bounded(
    autojump_clock: trio.abc.Clock, inline_threads: None
) -> None:
    """A fresh identity costs a stranger an announcement: what the joiner keeps of
    each (its spent time, its claims) is bounded, the oldest forgotten first."""
    swarm = Swarm(spent_until=float("inf"))
    joiner = joiner_in(swarm, capacity=1)
    most = joiner_module._SPENT_PEERS
    for n in range(most + 10):
        joiner._spend(PeerAddress(f"stranger{n}", SEED.addrs), 86400.0)
    assert len(joiner._spent) == len(joiner._spent_claims) == most
    assert "stranger0" not in joiner._spent
    assert f"stranger{most + 9}" in joiner._spent
