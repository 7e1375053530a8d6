"""A replica whose transfer quota is used up says until when (``retry_after_s``), and
the replica averager leaves it alone until then, saying so once; a node paused for a
used-up quota says until when too, to its ``params`` and ``shard`` callers only.

The averager in virtual time with its checks run inline (``inline_threads``), as in
``test_replica_round``; the pause over the in-memory network."""

from __future__ import annotations

import logging
import time
from collections import Counter
from collections.abc import Callable, Sequence

import pytest
import torch
import trio

from volunteerd.config import Config, ExpertsConfig, LimitsConfig, RuntimeConfig, WireLimits
from volunteerd.config.models import ReplicasConfig
from volunteerd.errors import RETRY_AFTER_MOST_S, RemoteError
from volunteerd.experts import to_wire
from volunteerd.net import Throttle, Verb
from volunteerd.net.rpc import Reply, Request, RpcClient, RpcServer
from volunteerd.net.throttle import TransferLedger
from volunteerd.runtime import ExpertRuntime
from volunteerd.runtime.averaging import ReplicaAverager
from volunteerd.server.pausing import Volunteer, refusal_before_reading
from volunteerd.shown import clock_time
from volunteerd.testing.memnet import MemoryNetwork
from volunteerd.wire import ForwardRequest, TensorMeta, WireTensor
from volunteerd.wire.messages import ParamsReply, ParamsRequest, ShardRequest

HOUR = 3600.0
ROUND_S = 600.0  # average_every_s
NOON = 1_700_000_000.0 - 1_700_000_000.0 % 86400 + 12 * 3600  # some day's noon, UTC


def to_local_midnight(now: float) -> float:
    t = time.localtime(now)
    return time.mktime((t.tm_year, t.tm_mon, t.tm_mday + 1, 0, 0, 0, 0, 0, -1)) - now


def small_runtime(*uids: str) -> ExpertRuntime:
    """A runtime of small experts (default: ffn.0.0) on the CPU."""
    return ExpertRuntime(
        list(uids) or ["ffn.0.0"],
        ExpertsConfig(hidden_dim=16),
        RuntimeConfig(device="cpu"),
        WireLimits(),
        torch.device("cpu"),
    )


class Swarm:
    """Every uid has two replicas: "honest" answers (its weights + 1e-4), "spent"
    refuses as a node whose bulk share of its quota is used up does (``code``, with
    ``retry_after_s``)."""

    def __init__(self, runtime: ExpertRuntime, code: str, retry_after_s: float) -> None:
        self.runtime = runtime
        self.code = code
        self.retry_after_s = retry_after_s
        self.calls: Counter[str] = Counter()

    async def replicas(self, uid: str) -> list[str]:
        return ["honest", "spent"]

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
    ) -> tuple[ParamsReply, list[WireTensor]]:
        self.calls[peer_id] += 1
        await trio.lowlevel.checkpoint()
        if peer_id == "spent":
            raise RemoteError(self.code, "quota's share used", self.retry_after_s)
        own = self.runtime.backend(uid).parameter_copies()
        encoded = [to_wire(t + 1e-4) for t in own.values()]
        header = ParamsReply(uid=uid, updates=0, names=list(own), tensors=[m for m, _ in encoded])
        tensors = [WireTensor(m.dtype, m.shape, memoryview(bytearray(d))) for m, d in encoded]
        return header, tensors


@pytest.mark.usefixtures("inline_threads")
@pytest.mark.parametrize("code", ["busy", "rate_limited", "paused"])
async def test_a_replica_whose_quota_is_used_up_is_left_alone_until_then_and_said_once(
    autojump_clock: trio.abc.Clock, caplog: pytest.LogCaptureFixture, code: str
) -> None:
    """Two experts, each with a replica that gives and one that refuses for five hours:
    one line says until when, the refusing replica is not asked again until then (nor
    counted as rejected), and it is asked again after. Before, it was "dropped
    (unreachable): busy: ..." for each expert, and asked again every backoff."""
    runtime = small_runtime("ffn.0.0", "ffn.0.1")
    swarm = Swarm(runtime, code, retry_after_s=5 * HOUR)
    now = [1000.0]
    averager = ReplicaAverager(
        runtime,
        swarm,
        ReplicasConfig(average_every_s=ROUND_S),
        clock=lambda: now[0],
        wall_clock=lambda: NOON,
    )
    async with trio.open_nursery() as nursery:
        await nursery.start(runtime.serve)
        with caplog.at_level(logging.INFO, logger="volunteerd.runtime.averaging"):
            assert await averager.run_round() == 2  # the honest replica, for each expert
            assert swarm.calls == {"honest": 2, "spent": 2}
            for _ in range(4):  # rounds within the five hours
                now[0] += ROUND_S
                assert await averager.run_round() == 2
            assert swarm.calls == {"honest": 10, "spent": 2}
            now[0] += 5 * HOUR - 4 * ROUND_S
            await averager.run_round()
            assert swarm.calls["spent"] == 4  # its time is up: asked again
        nursery.cancel_scope.cancel()
    said = [r.getMessage() for r in caplog.records if "spent" in r.getMessage()]
    until = clock_time(NOON + 5 * HOUR, NOON)
    assert said == [
        f"replica spent: quota used up until {until} (in 5 h 0 min); not asked until then",
        f"replica spent: quota used up until {until} (in 5 h 0 min); not asked until then",
    ]  # once for each time it refused: at the first round and when asked again
    assert "unreachable" not in caplog.text
    assert averager.statistics().rejected == {}


@pytest.mark.usefixtures("inline_threads")
async def test_a_strangers_claim_of_a_long_quota_is_held_to_a_day(
    autojump_clock: trio.abc.Clock,
) -> None:
    runtime = small_runtime()
    swarm = Swarm(runtime, "busy", retry_after_s=RETRY_AFTER_MOST_S)
    now = [1000.0]
    averager = ReplicaAverager(
        runtime, swarm, ReplicasConfig(average_every_s=ROUND_S), clock=lambda: now[0]
    )
    async with trio.open_nursery() as nursery:
        await nursery.start(runtime.serve)
        await averager.run_round()
        now[0] += 24 * HOUR - 1
        await averager.run_round()
        assert swarm.calls["spent"] == 1
        now[0] += 1
        await averager.run_round()
        assert swarm.calls["spent"] == 2
        nursery.cancel_scope.cancel()


class Fakes(Swarm):
    """Eight fake replicas, listed first (announcing longer), refuse "busy" with a short
    ``retry_after_s``; "honest", listed last, answers."""

    FAKES = [f"fake{i}" for i in range(8)]  # max_peers of them

    async def replicas(self, uid: str) -> list[str]:
        return [*self.FAKES, "honest"]

    async def fetch(
        self,
        peer_id: str,
        uid: str,
        *,
        max_bytes: int,
        timeout_s: float | None = None,
        unless_version: str | None = None,
    ) -> tuple[ParamsReply, list[WireTensor]]:
        return await super().fetch(
            "spent" if peer_id.startswith("fake") else peer_id, uid, max_bytes=max_bytes
        )


@pytest.mark.usefixtures("inline_threads")
@pytest.mark.parametrize("retry_after_s", [0.001, 1.0])
async def test_short_spent_claims_do_not_keep_an_honest_newcomer_out(
    autojump_clock: trio.abc.Clock, caplog: pytest.LogCaptureFixture, retry_after_s: float
) -> None:
    """A short claim holds a peer off for a failure's backoff at least, a peer that
    refused sorts after never-asked ones, and after two claims in a row a refusal is a
    failure. Believed for any time and counted as nothing, 8 fakes answering "busy" for
    1 s were never-asked peers every round and took all 8 places: the honest replica
    was averaged in 0 of 24 rounds, and the claims logged 192 times."""
    runtime = small_runtime()
    swarm = Fakes(runtime, "busy", retry_after_s)
    now = [1000.0]
    averager = ReplicaAverager(
        runtime, swarm, ReplicasConfig(average_every_s=ROUND_S), clock=lambda: now[0]
    )
    averaged = []
    async with trio.open_nursery() as nursery:
        await nursery.start(runtime.serve)
        with caplog.at_level(logging.INFO, logger="volunteerd.runtime.averaging"):
            for _ in range(12):  # two hours
                averaged.append(await averager.run_round())
                now[0] += ROUND_S
        nursery.cancel_scope.cancel()
    assert averaged == [0] + [1] * 11  # the fakes had the first round's 8 places
    claims = [r.getMessage() for r in caplog.records if "quota used up" in r.getMessage()]
    assert len(claims) == 2 * len(Fakes.FAKES)  # each believed twice in a row, then failing
    assert averager.statistics().rejected["unreachable"] >= len(Fakes.FAKES)


# ----------------------------------------------------- a paused node says until when


async def test_a_node_paused_for_its_quota_tells_bulk_callers_until_when(
    autojump_clock: trio.abc.Clock,
) -> None:
    """A used-up daily quota pauses the node until midnight: a ``params`` or ``shard``
    request refused from its prefix says so (``retry_after_s``, as a spent share's
    refusal does), a forward's refusal says nothing (releases older than the field
    refuse a reply that carries it, and trainers need no time). Paused by the volunteer,
    nobody knows when: no time either. A used-up monthly quota says the month's end,
    held to what the wire allows (two days)."""
    now = [NOON]
    ledger = TransferLedger(None, clock=lambda: now[0])
    throttle = Throttle(LimitsConfig(daily_quota_gb=0.001), ledger)
    ledger.add(up=2_000_000)
    volunteer = Volunteer(
        None,
        throttle,
        LimitsConfig(daily_quota_gb=0.001),
        state_file=None,
        limits_file=None,
        grace_s=1,
    )

    async def never(request: Request) -> Reply:
        raise AssertionError("a paused node answered")

    config = Config()
    network = MemoryNetwork()
    async with (
        network.open_host() as server_host,
        network.open_host() as client_host,
        trio.open_nursery() as nursery,
    ):
        await nursery.start(volunteer.serve)
        assert volunteer.gate.closed
        server = RpcServer(
            server_host,
            {Verb.PARAMS: never, Verb.SHARD: never, Verb.FORWARD: never},
            config.wire,
            config.timeouts,
            config.peer_limits,
        )
        server.refuse_unread = refusal_before_reading(volunteer.gate, None)
        server.install()
        client = RpcClient(client_host, config.wire, config.timeouts)
        meta = TensorMeta(dtype="float32", shape=(1, 8))
        requests = {
            Verb.PARAMS: (ParamsRequest(uid="ffn.0.0"), []),
            Verb.SHARD: (ShardRequest(uid="ffn.0.0"), []),
            Verb.FORWARD: (ForwardRequest(uid="ffn.0.0", tensors=[meta]), [bytes(32)]),
        }

        async def refused() -> dict[Verb, tuple[str, float | None]]:
            told = {}
            for verb, (header, body) in requests.items():
                with pytest.raises(RemoteError) as caught:
                    await client.call_raw(server_host.address, verb, header, body)
                told[verb] = (caught.value.code, caught.value.retry_after_s)
            return told

        left = to_local_midnight(NOON)
        told = await refused()
        assert told[Verb.FORWARD] == ("paused", None)
        for verb in (Verb.PARAMS, Verb.SHARD):
            assert told[verb][0] == "paused"
            assert told[verb][1] == pytest.approx(left)
        # the handlers' own gate (a request read before the pause) says the same
        assert volunteer.gate.refusal(bulk=True).retry_after_s == pytest.approx(left)

        await volunteer.pause()
        assert all(told == ("paused", None) for told in (await refused()).values())
        await volunteer.resume()  # the quota still holds it

        throttle.apply(LimitsConfig(monthly_quota_gb=0.001))  # the month's, now
        told = await refused()
        assert told[Verb.PARAMS] == (
            "paused",
            min(ledger.seconds_left_this_month(), RETRY_AFTER_MOST_S),
        )
        assert told[Verb.FORWARD] == ("paused", None)
        await client.aclose()
        nursery.cancel_scope.cancel()


class QuotaUntil(Swarm):
    """One replica, "spent", whose quota is used up until a wall-clock time."""

    def __init__(self, runtime: ExpertRuntime, wall: Callable[[], float], until: float) -> None:
        super().__init__(runtime, "busy", 0.0)
        self.wall, self.until = wall, until

    async def replicas(self, uid: str) -> list[str]:
        return ["spent"]

    async def fetch(
        self,
        peer_id: str,
        uid: str,
        *,
        max_bytes: int,
        timeout_s: float | None = None,
        unless_version: str | None = None,
    ) -> tuple[ParamsReply, list[WireTensor]]:
        self.retry_after_s = self.until - self.wall()
        if self.retry_after_s <= 0:
            self.calls[peer_id] += 1
            return await super().fetch("honest", uid, max_bytes=max_bytes)
        return await super().fetch(peer_id, uid, max_bytes=max_bytes)


@pytest.mark.usefixtures("inline_threads")
async def test_a_spent_replicas_time_counts_the_night_the_laptop_slept(
    autojump_clock: trio.abc.Clock,
) -> None:
    """A replica's quota is used up at 18:00 until midnight; this laptop sleeps 18:00 to
    08:00 and catches up on waking with that replica. On time.monotonic (stopped in the
    sleep) the replica was skipped 14 h more and the expert served un-caught-up after
    CATCH_UP_S; the averager's deadlines go by the clock that counts the sleep."""
    runtime = small_runtime()
    slept = [0.0]
    t0 = trio.current_time()
    wall0 = NOON + 6 * HOUR  # 18:00

    def awake() -> float:  # CLOCK_BOOTTIME: counts the sleep
        return 1000.0 + trio.current_time() - t0 + slept[0]

    def wall() -> float:
        return wall0 + trio.current_time() - t0 + slept[0]

    swarm = QuotaUntil(runtime, wall, until=wall0 + 6 * HOUR)
    averager = ReplicaAverager(
        runtime,
        swarm,
        ReplicasConfig(average_every_s=ROUND_S),
        awake_clock=awake,
        wall_clock=wall,
    )
    async with trio.open_nursery() as nursery:
        await nursery.start(runtime.serve)
        assert await averager.run_round() == 0  # 18:00: refused until midnight
        assert swarm.calls == {"spent": 1}
        slept[0] = 14 * HOUR  # 18:00 -> 08:00
        await averager.catch_up(14 * HOUR)  # what watch_freezes does on waking
        nursery.cancel_scope.cancel()
    assert swarm.calls["honest"] >= 1  # it gave: asked again, not skipped till 14:00
    assert averager.statistics().averaged >= 1
