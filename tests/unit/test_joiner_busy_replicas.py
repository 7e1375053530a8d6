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
from volunteerd.errors import RemoteError, RequestTimeout, ShardError, ShardTooSlow
from volunteerd.experts import ExpertBackend
from volunteerd.net import PeerAddress
from volunteerd.swarm.joiner import Joiner

CONFIG = ExpertsConfig(hidden_dim=8)
SEED = PeerAddress("seed", ["/ip4/127.0.0.1/tcp/1"])


def queued() -> ShardError:
    """What ``download_shard`` raises when the replica kept it waiting past its queue."""
    slow = ShardTooSlow("0 bytes in 35.0 s, slower than 32768 bytes a second", fetched=0)
    slow.__cause__ = RequestTimeout("no reply within 35.0 s")
    return slow


def fell_behind() -> ShardError:
    """What ``download_shard`` raises when the replica sent bytes, then too slowly."""
    return ShardTooSlow("141 MiB in 602.0 s, slower than 32768 bytes a second", fetched=141 << 20)


class Replica:
    """Gives an expert's trained state, after refusing it ``refusals[uid]`` times with
    the error it is given (a list: one per try)."""

    def __init__(self, refusals: dict[str, list[Exception]]) -> None:
        self.refusals = refusals
        self.asked: list[tuple[float, str]] = []
        self.peers: list[str] = []  # the peer of each try
        self.discarded: list[str] = []

    async def download(self, peer: PeerAddress, backend: ExpertBackend) -> object:
        self.asked.append((trio.current_time(), backend.uid))
        self.peers.append(peer.peer_id)
        await trio.sleep(1.0)
        refusals = self.refusals.get(backend.uid, [])
        if refusals:
            raise refusals.pop(0)
        trained = ExpertBackend(backend.uid, CONFIG, torch.device("cpu"), 64)
        trained.backward([torch.randn(2, 8)], [torch.randn(2, 8)])
        trained.step()
        return trained.state()

    async def discard(self, uid: str) -> None:
        self.discarded.append(uid)


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


@pytest.mark.parametrize(
    "cut", [fell_behind, trio.TooSlowError], ids=["fell_behind", "past_the_bound"]
)
async def test_a_download_cut_for_being_slow_is_resumed_later_not_seeded(
    autojump_clock: trio.abc.Clock, inline_threads: None, cut: type[Exception]
) -> None:
    """A big expert over a slow uplink: the download fell behind the least rate after
    bytes came, or passed its whole bound. The joiner seeded it (a fork) and deleted
    the partial file (141 of 384 MiB at 2 Mbit/s; an outside audit); it is now tried
    again like a busy replica's, and its partial file is kept for that try."""
    replica = Replica({"ffn.0.1": [cut()]})
    joiner = joiner_with(replica)
    await joiner._add(["ffn.0.1"], {"ffn.0.1": [SEED]}, CONFIG)
    assert joiner.sources == {"ffn.0.1": "replica seed"}
    assert replica.discarded == []
    assert replica.peers == ["seed", "seed"]


async def test_waiting_says_how_far_a_download_under_way_is(
    autojump_clock: trio.abc.Clock, inline_threads: None
) -> None:
    """A big expert takes an hour at 256 kbit/s: "joining" and a rate said nothing of
    how far it was or how long it would take."""
    from volunteerd.swarm.download import DownloadProgress

    replica = Replica({})
    joiner = joiner_with(replica)
    going = DownloadProgress("ffn.0.1", 141 << 20, 384 << 20, 2e6 / 8)
    joiner._progress = lambda uid: going if uid == "ffn.0.1" else None
    said: list[str | None] = []
    async with trio.open_nursery() as nursery:
        nursery.start_soon(joiner._add, ["ffn.0.1"], {"ffn.0.1": [SEED]}, CONFIG)
        await trio.sleep(0.5)  # within the replica's 1 s
        said.append(joiner.waiting)
    assert said == ["downloading ffn.0.1: 141 of 384 MiB at 2.0 Mbit/s, ~16 min left"]
    assert joiner.waiting is None


async def test_a_cut_download_resumes_from_its_own_replica_first(
    autojump_clock: trio.abc.Clock, inline_threads: None
) -> None:
    """Its partial file is that replica's bytes: another replica's download would start
    it over. Whatever the random order of the replicas, the cut one comes first."""
    other = PeerAddress("other", ["/ip4/127.0.0.1/tcp/2"])
    for seed in range(6):
        replica = Replica({"ffn.0.1": [fell_behind(), RemoteError("busy", "try later")]})
        joiner = joiner_with(replica)
        joiner._rng = random.Random(seed)
        await joiner._add(["ffn.0.1"], {"ffn.0.1": [SEED, other]}, CONFIG)
        cut, busy, again = replica.peers
        assert again == cut != busy, seed
        assert joiner.sources == {"ffn.0.1": f"replica {cut}"}


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
