"""A joiner whose expert's replicas are only busy (``busy``, ``paused``,
``rate_limited``) does not seed it: the expert exists, and is downloaded in turn, for
``_BUSY_ROUNDS`` rounds. An outside audit had 8-16 joiners start at
one seed: 59 of 72 experts forked from the initial weights at the seed's 5th download."""

from __future__ import annotations

import itertools
import random
import types
from typing import Any

import pytest
import torch
import trio

from volunteerd.config import ExperimentsConfig, ExpertsConfig
from volunteerd.errors import RemoteError, RequestTimeout, ShardError
from volunteerd.experts import ExpertBackend
from volunteerd.net import PeerAddress
from volunteerd.swarm.joiner import Joiner

CONFIG = ExpertsConfig(hidden_dim=8)
SEED = PeerAddress("seed", ["/ip4/127.0.0.1/tcp/1"])


def queued() -> ShardError:
    """What ``download_shard`` raises when the replica kept it waiting past its queue."""
    slow = ShardError("0 bytes in 35.0 s, slower than 32768 bytes a second", resumable=True)
    slow.__cause__ = RequestTimeout("no reply within 35.0 s")
    return slow


class Replica:
    """Gives an expert's trained state, after refusing it ``refusals[uid]`` times with
    the error it is given (a list: one per try)."""

    def __init__(self, refusals: dict[str, list[Exception]]) -> None:
        self.refusals = refusals
        self.asked: list[tuple[float, str]] = []

    async def download(self, peer: PeerAddress, backend: ExpertBackend) -> object:
        self.asked.append((trio.current_time(), backend.uid))
        await trio.sleep(1.0)
        refusals = self.refusals.get(backend.uid, [])
        if refusals:
            raise refusals.pop(0)
        trained = ExpertBackend(backend.uid, CONFIG, torch.device("cpu"), 64)
        trained.backward([torch.randn(2, 8)], [torch.randn(2, 8)])
        trained.step()
        return trained.state()

    async def discard(self, uid: str) -> None:
        pass


def joiner_with(replica: Replica) -> Joiner:
    async def run(fn: Any) -> Any:
        return fn()

    added: list[str] = []

    async def add_expert(backend: ExpertBackend) -> None:
        added.append(backend.uid)

    runtime = types.SimpleNamespace(
        make_backend=lambda uid, experts: ExpertBackend(uid, experts, torch.device("cpu"), 64),
        add_expert=add_expert,
        executor=types.SimpleNamespace(run=run),
    )
    joiner = Joiner(
        None,  # type: ignore[arg-type]  # not looked up: the replicas are given
        runtime,  # type: ignore[arg-type]
        lambda: None,
        None,
        replica,
        ExperimentsConfig(),
        lambda experts: 4,
        clock=trio.current_time,
        rng=random.Random(5),
    )

    async def no_replicas(uids: list[str]) -> dict[str, list[PeerAddress]]:
        return {uid: [] for uid in uids}

    joiner.live_replicas = no_replicas  # type: ignore[method-assign]
    return joiner


@pytest.mark.parametrize(
    "refusal",
    [
        RemoteError("busy", "server busy: 4 params and shard replies going out"),
        RemoteError("paused", "daily transfer quota used"),
        RemoteError("rate_limited", "over the request rate"),
        ShardError("failed 5 times in a row: busy", resumable=True),  # its cause below
    ],
    ids=["busy", "paused", "rate_limited", "busy_retries"],
)
async def test_an_expert_whose_replica_is_busy_is_downloaded_later_not_seeded(
    autojump_clock: trio.abc.Clock, inline_threads: None, refusal: Exception
) -> None:
    if isinstance(refusal, ShardError) and refusal.__cause__ is None:
        refusal.__cause__ = RemoteError("busy", "try later")
    replica = Replica({"ffn.0.1": [refusal, refusal]})
    joiner = joiner_with(replica)
    uids = ["ffn.0.0", "ffn.0.1", "ffn.0.2"]
    said: list[str | None] = []

    async def watch() -> None:
        while True:
            said.append(joiner.waiting)
            await trio.sleep(1.0)

    async with trio.open_nursery() as nursery:
        nursery.start_soon(watch)
        await joiner._add(uids, {uid: [SEED] for uid in uids}, CONFIG)
        nursery.cancel_scope.cancel()
    assert joiner.sources == {uid: "replica seed" for uid in uids}  # none seeded
    assert set(joiner.hosted) == set(uids)
    tries = [at for at, uid in replica.asked if uid == "ffn.0.1"]
    assert len(tries) == 3
    # the others went first; the busy one came back after a backoff (10 s, then 20 s, +-50 %)
    assert [uid for _, uid in replica.asked[:3]] == uids
    gaps = [b - a for a, b in itertools.pairwise(tries)]
    assert 5 <= gaps[0] - 2 <= 15, gaps  # ffn.0.1's own try and ffn.0.2's, then the wait
    assert 10 <= gaps[1] - 1 <= 30, gaps
    expected = "waiting for a busy replica of ffn.0.1, retrying in "
    assert any(w and w.startswith(expected) for w in said), said
    assert joiner.waiting is None  # done waiting


async def test_a_replica_busy_for_long_leaves_its_expert_to_the_next_round(
    autojump_clock: trio.abc.Clock, inline_threads: None
) -> None:
    """The retries are bounded: the join completes with what came, and the expert
    still busy is neither hosted nor seeded (the next rebalance chooses again)."""
    replica = Replica({"ffn.0.1": [RemoteError("paused", "quota")] * 100})
    joiner = joiner_with(replica)
    uids = ["ffn.0.0", "ffn.0.1"]
    start = trio.current_time()
    await joiner._add(uids, {uid: [SEED] for uid in uids}, CONFIG)
    assert trio.current_time() - start <= 300 + 60
    assert set(joiner.hosted) == {"ffn.0.0"}
    assert "ffn.0.1" not in joiner.sources
    assert 4 <= sum(uid == "ffn.0.1" for _, uid in replica.asked) <= 10


@pytest.mark.parametrize(
    "failure",
    [ShardError("the bytes received do not match their sha256", resumable=False), queued()],
    ids=["bad_bytes", "silent_past_the_queue"],
)
async def test_an_expert_without_replicas_or_with_broken_ones_is_still_seeded(
    autojump_clock: trio.abc.Clock, inline_threads: None, failure: Exception
) -> None:
    """No live replica (three lookups) or replicas that failed for real (bad bytes; or
    nothing at all within the queue's bound and the grace, when an honest replica would
    have answered ``busy``): seeded, as before."""
    replica = Replica({"ffn.0.1": [failure]})
    joiner = joiner_with(replica)
    await joiner._add(["ffn.0.0", "ffn.0.1"], {"ffn.0.1": [SEED]}, CONFIG)
    assert joiner.sources == {"ffn.0.0": "seed", "ffn.0.1": "seed"}
    assert [uid for _, uid in replica.asked] == ["ffn.0.1"]


async def test_an_expert_whose_replicas_stay_busy_round_after_round_is_seeded_at_last(
    autojump_clock: trio.abc.Clock, inline_threads: None
) -> None:
    """A stranger that announces every expert and answers ``busy`` to each kept a
    newcomer from hosting anything, for good (a re-check, on a simulated hour): after
    ``_BUSY_ROUNDS`` rounds of busy replicas the expert is seeded."""
    from volunteerd.swarm import joiner as joiner_module

    replica = Replica({"ffn.0.0": [RemoteError("busy", "try later")] * 1000})
    joiner = joiner_with(replica)
    joiner._node = types.SimpleNamespace(peer_id="me")  # type: ignore[assignment]
    joiner.manifest = types.SimpleNamespace(  # type: ignore[assignment]
        uids=lambda: ["ffn.0.0"], replication=2, experts_config=lambda: CONFIG, owner="o", name="n"
    )
    joiner.capacity = 1

    async def on_the_stranger(asked: list[str]) -> dict[str, list[PeerAddress]]:
        return {uid: [SEED] for uid in asked}

    joiner.live_replicas = on_the_stranger  # type: ignore[method-assign]
    for _ in range(joiner_module._BUSY_ROUNDS):
        await joiner.rebalance()
        assert not joiner.hosted
        await trio.sleep(joiner_module._BUSY_WAIT_S + 1)  # out of the choices meanwhile
    await joiner.rebalance()
    assert joiner.sources == {"ffn.0.0": "seed"}
    assert set(joiner.hosted) == {"ffn.0.0"}


async def test_the_room_of_an_expert_busy_all_round_goes_to_another_for_a_while(
    autojump_clock: trio.abc.Clock, inline_threads: None
) -> None:
    """A seed whose quota's share for bulk transfers is used refuses until midnight:
    the expert it alone holds is left out of the next choices for a while, and the
    joiner hosts another one that can be downloaded now (from another joiner)."""
    from volunteerd.swarm.assignment import tie_break

    uids = [f"ffn.0.{i}" for i in range(4)]
    first, stubborn, *others = sorted(uids, key=lambda uid: tie_break("me", uid))
    replica = Replica({stubborn: [RemoteError("busy", "quota's share used")] * 1000})
    joiner = joiner_with(replica)
    joiner._node = types.SimpleNamespace(peer_id="me")  # type: ignore[assignment]
    joiner.manifest = types.SimpleNamespace(  # type: ignore[assignment]
        uids=lambda: uids, replication=2, experts_config=lambda: CONFIG, owner="o", name="n"
    )
    joiner.capacity = 2

    async def all_on_the_seed(asked: list[str]) -> dict[str, list[PeerAddress]]:
        return {uid: [SEED] for uid in asked}

    joiner.live_replicas = all_on_the_seed  # type: ignore[method-assign]
    await joiner.rebalance()
    assert set(joiner.hosted) == {first}  # the stubborn one neither hosted nor seeded
    assert stubborn not in joiner.sources
    await joiner.rebalance()
    assert set(joiner.hosted) == {first, others[0]}
    assert joiner.sources[others[0]] == "replica seed"
