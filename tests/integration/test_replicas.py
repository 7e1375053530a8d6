"""Replica averaging: daemons hosting the same expert pull their weights together over
libp2p, and one bad replica can move the others only by a small, bounded amount."""

from __future__ import annotations

import copy
import math
from collections import Counter
from pathlib import Path

import pytest
import torch
import trio

from volunteerd.config import ExpertsConfig, RuntimeConfig, WireLimits
from volunteerd.config.models import ReplicasConfig
from volunteerd.errors import PeerUnreachable, ReplyTooLarge
from volunteerd.experts import ExpertBackend, to_wire
from volunteerd.runtime import ExpertRuntime, averaging
from volunteerd.runtime.averaging import ReplicaAverager, centered_clip
from volunteerd.testing import local_config, open_daemon, open_peer
from volunteerd.wire import WireTensor
from volunteerd.wire.messages import ParamsReply

# Real libp2p nodes on loopback, in wall-clock time: a swarm, or a node and its clients.
pytestmark = pytest.mark.slow

UID = "ffn.0.0"
HIDDEN = 32
CLIP_RATIO = 0.1
# No round starts by itself: the test runs them.
NO_TIMER = {"average_every_s": 3600.0, "clip_ratio": CLIP_RATIO}

Params = dict[str, torch.Tensor]


def tau(x: torch.Tensor) -> float:
    return CLIP_RATIO * max(float(x.norm()), 0.01 * math.sqrt(x.numel()))


def distance(a: Params, b: Params) -> float:
    return math.sqrt(sum(float((a[k] - b[k]).norm()) ** 2 for k in a))


async def params_of(daemon_runtime: ExpertRuntime) -> Params:
    return await daemon_runtime.with_expert(UID, lambda b: b.parameter_copies())


async def set_params(daemon_runtime: ExpertRuntime, params: Params) -> None:
    await daemon_runtime.with_expert(UID, lambda b: b.set_parameters(params))


@pytest.mark.parametrize("attack", ["scaled", "noise"])
async def test_honest_replicas_converge_and_a_bad_one_pulls_a_bounded_amount(
    tmp_path: Path, attack: str
) -> None:
    async with open_peer(local_config()) as boot:

        def config(hidden: int = HIDDEN):  # type: ignore[no-untyped-def]
            return local_config(
                bootstrap=boot.multiaddrs,
                uids=UID,
                experts={"hidden_dim": hidden},
                replicas=NO_TIMER,
            )

        async with (
            open_daemon(config(), tmp_path / "a") as a,
            open_daemon(config(), tmp_path / "b") as b,
            open_daemon(config(), tmp_path / "bad") as bad,
            open_daemon(config(hidden=HIDDEN // 2), tmp_path / "misfit") as misfit,
        ):
            # Different honest weights (1% apart), and one replica far away.
            torch.manual_seed(0)
            a0 = await params_of(a.runtime)
            b0 = {k: v + 0.01 * v.norm() / math.sqrt(v.numel()) * torch.randn_like(v)
                  for k, v in a0.items()}  # fmt: skip
            if attack == "scaled":
                evil = {k: v * 1e3 for k, v in a0.items()}
            else:
                evil = {k: torch.randn_like(v) * 10 for k, v in a0.items()}
            await set_params(b.runtime, b0)
            await set_params(bad.runtime, evil)

            with trio.fail_after(15):
                for averager in (a.averager, b.averager):
                    while len(await averager.source.replicas(UID)) < 3:  # noqa: ASYNC110
                        await trio.sleep(0.2)  # announcements still spreading

            # A round on both at the same moment: each sees the other's weights before.
            from_a, from_b = await a.averager.gather(UID), await b.averager.gather(UID)
            assert len(from_a) == len(from_b) == 2  # b (or a) and bad; misfit refused
            assert await a.averager.combine(UID, from_a) == 2
            assert await b.averager.combine(UID, from_b) == 2
            a1, b1 = await params_of(a.runtime), await params_of(b.runtime)

            # The bad replica's pull on a, per tensor: at most tau/3 beyond what the
            # honest replica alone contributes (b0 - a0 is within tau: not clipped).
            for k in a0:
                honest_only = a0[k] + (b0[k] - a0[k]) / 3
                pull = float((a1[k] - honest_only).norm())
                assert pull <= tau(a0[k]) / 3 * (1 + 1e-4), (k, pull, tau(a0[k]))
            size = math.sqrt(sum(float(v.norm()) ** 2 for v in a0.values()))
            moved = distance(a1, a0) / size
            assert moved <= CLIP_RATIO * 2 / 3 + 1e-3
            # A plain mean would have moved a by ~333x (scaled) of its own size.
            # The honest replicas got closer to each other despite the attacker: a third
            # of their distance is left, as if it were not there.
            assert distance(a1, b1) < 0.4 * distance(a0, b0)

            stats = a.averager.statistics()
            assert stats.rounds == 1
            assert stats.averaged == 2
            assert stats.rejected == {"shape": 1}
            assert stats.rejected_by_peer == {misfit.node.peer_id: 1}
            far = sum(float((evil[k] - a0[k]).norm()) > tau(a0[k]) for k in a0)
            assert far >= len(a0) - 1  # (x1e3 leaves a zero bias at zero)
            assert stats.clipped_by_peer[bad.node.peer_id] == far
            assert b.node.peer_id not in stats.clipped_by_peer
            assert stats.last_shift[UID] == pytest.approx(moved, rel=1e-3)
            # a's weights changed without an optimizer step: the checkpointer sees it.
            assert a.runtime.backend(UID).revision == 1


async def test_replicas_that_agree_write_nothing_and_their_checkpoints_are_not_rewritten(
    tmp_path: Path,
) -> None:
    """Every averaging round wrote the weights, a move of zero too, and every write was a
    new revision that the checkpointer saved: two idle daemons rewrote every checkpoint
    every minute for as long as they ran (7.2 GB an hour with 4 default experts). A round
    between replicas that agree writes nothing, and nothing new is saved; one that moves
    them still writes."""
    async with open_peer(local_config()) as boot:
        config = local_config(
            bootstrap=boot.multiaddrs, uids=UID, experts={"hidden_dim": HIDDEN}, replicas=NO_TIMER
        )
        async with (
            open_daemon(config, tmp_path / "a") as a,
            open_daemon(config, tmp_path / "b") as b,
        ):
            await set_params(b.runtime, await params_of(a.runtime))
            with trio.fail_after(15):
                for averager in (a.averager, b.averager):
                    while len(await averager.source.replicas(UID)) < 1:  # noqa: ASYNC110
                        await trio.sleep(0.2)  # announcements still spreading
            checkpointers = [a._hosting().checkpointer, b._hosting().checkpointer]
            for checkpointer in checkpointers:
                await checkpointer.save_changed()
            revisions = [d.runtime.backend(UID).revision for d in (a, b)]
            for _ in range(3):
                for daemon in (a, b):
                    replies = await daemon.averager.gather(UID)
                    assert await daemon.averager.combine(UID, replies) == 1
            assert [d.runtime.backend(UID).revision for d in (a, b)] == revisions
            assert [await c.save_changed() for c in checkpointers] == [0, 0]
            assert a.averager.statistics().last_shift[UID] == 0.0

            # b trains (here: its weights move by 1 %): the next round on a writes
            torch.manual_seed(1)
            moved = {
                k: v + 0.01 * v.norm() / math.sqrt(v.numel()) * torch.randn_like(v)
                for k, v in (await params_of(b.runtime)).items()
            }
            await set_params(b.runtime, moved)
            assert await a.averager.combine(UID, await a.averager.gather(UID)) == 1
            assert a.runtime.backend(UID).revision == revisions[0] + 1
            assert await checkpointers[0].save_changed() == 1


# The pure parts, with the swarm faked.


def backend_runtime(uids: list[str] | None = None) -> ExpertRuntime:
    experts = ExpertsConfig(hidden_dim=HIDDEN)
    return ExpertRuntime(
        uids or [UID], experts, RuntimeConfig(device="cpu"), WireLimits(), torch.device("cpu")
    )


def reply_for(params: Params, uid: str = UID) -> tuple[ParamsReply, list[WireTensor]]:
    encoded = [to_wire(t) for t in params.values()]
    header = ParamsReply(
        uid=uid, updates=0, names=list(params), tensors=[meta for meta, _ in encoded]
    )
    tensors = [WireTensor(m.dtype, m.shape, memoryview(bytearray(d))) for m, d in encoded]
    return header, tensors


class FakeSwarm:
    def __init__(self, replies: dict[str, tuple[ParamsReply, list[WireTensor]] | None]) -> None:
        self.replies = replies
        self.calls: Counter[str] = Counter()  # peer id -> fetches
        self.caps: list[int] = []  # each fetch's max_bytes

    async def replicas(self, uid: str) -> list[str]:
        return list(self.replies)

    async def fetch(
        self,
        peer_id: str,
        uid: str,
        *,
        max_bytes: int,
        timeout_s: float | None = None,
        unless_version: str | None = None,
    ) -> tuple[ParamsReply, list[WireTensor]]:
        """As the RPC client does: a reply over ``max_bytes`` is ReplyTooLarge."""
        self.calls[peer_id] += 1
        self.caps.append(max_bytes)
        reply = self.replies[peer_id]
        if reply is None:
            raise PeerUnreachable(f"{peer_id}: gone")
        declared = sum(t.data.nbytes for t in reply[1])
        if declared > max_bytes:
            raise ReplyTooLarge(f"body of {declared} bytes exceeds the cap of {max_bytes}")
        return reply


async def test_replies_that_do_not_fit_are_dropped_and_counted() -> None:
    runtime = backend_runtime()
    own = runtime.backend(UID).parameter_copies()
    good = {k: v + 1e-4 for k, v in own.items()}
    nan = {k: v.clone() for k, v in own.items()}
    nan["up.weight"][0, 0] = float("nan")
    renamed = {f"x{k}": v for k, v in own.items()}
    swarm = FakeSwarm(
        {
            "good": reply_for(good),
            "nan": reply_for(nan),
            "renamed": reply_for(renamed),
            "other-uid": reply_for(own, uid="ffn.9.9"),
            "gone": None,
        }
    )
    averager = ReplicaAverager(runtime, swarm, ReplicasConfig(clip_ratio=CLIP_RATIO))
    assert await averager.average(UID) == 1
    stats = averager.statistics()
    assert stats.rejected == {"non_finite": 1, "names": 1, "uid": 1, "unreachable": 1}
    assert stats.rejected_by_peer == {"nan": 1, "renamed": 1, "other-uid": 1, "gone": 1}
    after = runtime.backend(UID).parameter_copies()
    for k in own:  # the mean of own and good
        torch.testing.assert_close(after[k], own[k] + 0.5e-4)


async def test_a_reply_larger_than_the_experts_parameters_is_refused_and_backs_off() -> None:
    """Each fetch may bring at most the expert's own parameter bytes; a replica that
    sends more is counted as "too_large" and not asked again until its backoff is over
    (tests/integration/test_oversized_replies.py: refused over libp2p, unread)."""
    runtime = backend_runtime()
    own = runtime.backend(UID).parameter_copies()
    size = sum(v.numel() * 4 for v in own.values())
    padded = {k: v.clone() for k, v in own.items()}
    padded["up.weight"] = torch.zeros(size)  # one tensor as large as all of them
    swarm, clock = FakeSwarm({"huge": reply_for(padded)}), Clock()
    averager = ReplicaAverager(runtime, swarm, ReplicasConfig(average_every_s=10.0), clock=clock)
    assert await averager.average(UID) == 0
    assert swarm.caps == [size]
    stats = averager.statistics()
    assert stats.rejected == {"too_large": 1}
    assert stats.rejected_by_peer == {"huge": 1}
    clock.now = 5.0
    assert await averager.average(UID) == 0
    assert swarm.calls["huge"] == 1  # backing off
    after = runtime.backend(UID).parameter_copies()
    assert all(torch.equal(after[k], own[k]) for k in own)


async def test_averaging_keeps_kept_forwards_valid() -> None:
    """New weights are written copy-on-write: a forward kept for its backward still
    back-propagates through the weights it was computed with."""
    runtime = backend_runtime()
    backend: ExpertBackend = runtime.backend(UID)
    x, g = torch.randn(4, HIDDEN), torch.randn(4, HIDDEN)
    reference = copy.deepcopy(backend.module)
    _, kept = backend.forward_retained([x])
    far = {k: v * 3 for k, v in backend.parameter_copies().items()}
    averager = ReplicaAverager(runtime, FakeSwarm({"p": reply_for(far)}), ReplicasConfig())
    assert await averager.average(UID) == 1
    ((grad_x,),) = backend.backward_retained([(kept, [g])])
    x_ref = x.clone().requires_grad_()
    reference(x_ref).backward(g)
    torch.testing.assert_close(grad_x, x_ref.grad)


class Clock:
    def __init__(self) -> None:
        self.now = 0.0

    def __call__(self) -> float:
        return self.now


async def test_fake_replicas_cannot_crowd_out_an_honest_one() -> None:
    """A uid listed by 40 identities that do not answer, ahead of the one honest
    replica: each round asks at most max_peers of them, a fake is asked again only
    after its backoff (30 s, then 60 s, 120 s...), and once the honest replica has
    answered it is averaged with in every round, however many fakes are listed."""
    runtime = backend_runtime()
    own = runtime.backend(UID).parameter_copies()
    replies: dict[str, tuple[ParamsReply, list[WireTensor]] | None] = {
        f"fake-{i}": None for i in range(40)
    }
    replies["honest"] = reply_for({k: v + 1e-4 for k, v in own.items()})
    swarm, clock = FakeSwarm(replies), Clock()
    config = ReplicasConfig(average_every_s=30.0, max_peers=8)
    averager = ReplicaAverager(runtime, swarm, config, clock=clock)
    used = []
    for _ in range(30):  # 15 minutes of rounds every 30 s
        used.append(await averager.average(UID))
        clock.now += 30.0
    first = used.index(1)
    assert first <= 5  # 40 fakes at 8 calls a round: found by the sixth round
    assert used[first:] == [1] * (30 - first)
    assert all(swarm.calls[f"fake-{i}"] <= 5 for i in range(40))  # at 0, 30, 90, 210, 450 s
    assert sum(swarm.calls.values()) <= 8 * 30
    stats = averager.statistics()
    assert stats.rejected == {"unreachable": sum(swarm.calls.values()) - swarm.calls["honest"]}


async def test_a_failing_replica_backs_off_and_comes_back_when_it_answers() -> None:
    runtime = backend_runtime()
    own = runtime.backend(UID).parameter_copies()
    swarm, clock = FakeSwarm({"flaky": None}), Clock()
    averager = ReplicaAverager(runtime, swarm, ReplicasConfig(average_every_s=10.0), clock=clock)
    asked_at = []
    for second in range(0, 200, 5):
        clock.now = float(second)
        calls = swarm.calls["flaky"]
        await averager.average(UID)
        if swarm.calls["flaky"] > calls:
            asked_at.append(second)
    assert asked_at == [0, 10, 30, 70, 150]  # 10 s, doubled after each failure
    swarm.replies["flaky"] = reply_for(own)
    clock.now = 310.0  # after its 160 s backoff
    assert await averager.average(UID) == 1
    clock.now += 1.0  # answered: asked again at once
    assert await averager.average(UID) == 1


async def test_what_the_averager_remembers_of_peers_is_bounded(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.setattr(averaging, "_MAX_REMEMBERED", 16)
    runtime = backend_runtime()
    own = runtime.backend(UID).parameter_copies()
    swarm, clock = FakeSwarm({}), Clock()
    averager = ReplicaAverager(runtime, swarm, ReplicasConfig(max_peers=4), clock=clock)
    for round_ in range(50):  # four fresh identities a round, half junk
        swarm.replies = {
            f"good-{round_}-0": reply_for(own),
            f"good-{round_}-1": reply_for(own),
            f"junk-{round_}-0": reply_for({f"x{k}": v for k, v in own.items()}),
            f"gone-{round_}": None,
        }
        await averager.average(UID)
    assert swarm.calls.total() == 200
    assert len(averager._good) == 16
    assert len(averager._failed) == 16
    assert len(averager.statistics().rejected_by_peer) == 16
    assert averager.statistics().rejected == {"names": 50, "unreachable": 50}


def test_centered_clip_bounds_any_single_replica() -> None:
    torch.manual_seed(1)
    own = {"w": torch.randn(64, 64) * 0.05}
    for scale in (1.0, 1e3, 1e9):
        evil = {"w": torch.randn(64, 64) * scale}
        new, clipped = centered_clip(own, [evil], CLIP_RATIO)
        assert clipped == [1]
        assert float((new["w"] - own["w"]).norm()) <= tau(own["w"]) / 2 * (1 + 1e-5)
    close = {"w": own["w"] * 1.01}
    new, clipped = centered_clip(own, [close], CLIP_RATIO)
    assert clipped == [0]
    torch.testing.assert_close(new["w"], own["w"] * 1.005)
