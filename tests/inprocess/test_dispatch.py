"""The trainer's timing rules in virtual time: ``moe.dispatch.call_many`` (k_min, grace,
timeout, batching) and the expert directory's bans, against handler stubs on memory
links with set latencies. Every duration asserted is trio's mock clock, exact."""

from __future__ import annotations

from collections import Counter
from collections.abc import AsyncIterator
from contextlib import AsyncExitStack, asynccontextmanager

import pytest
import trio

from volunteerd.config import Config
from volunteerd.errors import Busy, RemoteError, RequestTimeout
from volunteerd.moe.directory import ExpertDirectory, info_verifier
from volunteerd.moe.dispatch import Call, call_many
from volunteerd.moe.timing import STRAGGLER_FACTOR
from volunteerd.net import Reply, Request, RpcClient, RpcServer, Verb
from volunteerd.testing.inprocess import WorldLookup
from volunteerd.testing.memnet import Link, MemoryHost, MemoryNetwork
from volunteerd.wire import BatchReply, ForwardRequest, TensorMeta, TensorReply
from volunteerd.wire.messages import MAX_BATCH_ITEMS

CONFIG = Config()
ROW = TensorMeta(dtype="float32", shape=(1, 1))


class Stub:
    """A server that answers every forward at once with its input; counts requests."""

    def __init__(self, refuse: bool = False) -> None:
        self.refuse = refuse
        self.requests: Counter[Verb] = Counter()

    async def forward(self, request: Request) -> Reply:
        self.requests[Verb.FORWARD] += 1
        if self.refuse:
            raise Busy("loaded")
        return Reply(TensorReply(tensors=[ROW]), [bytes(request.tensors[0].data)])

    async def forward_batch(self, request: Request) -> Reply:
        self.requests[Verb.FORWARD_BATCH] += 1
        items = request.header.items
        return Reply(
            BatchReply(items=[TensorReply(tensors=[ROW]) for _ in items]),
            [bytes(t.data) for t in request.tensors],
        )

    async def info(self, request: Request) -> Reply:
        raise Busy("a stub: any typed answer proves a live server")

    def handlers(self) -> dict[Verb, object]:
        return {
            Verb.FORWARD: self.forward,
            Verb.FORWARD_BATCH: self.forward_batch,
            Verb.INFO: self.info,
        }


@asynccontextmanager
async def servers(
    network: MemoryNetwork, trainer: MemoryHost, latencies: list[float], **stub: bool
) -> AsyncIterator[list[tuple[MemoryHost, Stub]]]:
    """One stub server per one-way latency to ``trainer``, connected already (the
    connection's round trip is not part of what the tests time)."""
    async with AsyncExitStack() as stack:
        out = []
        for latency in latencies:
            host = await stack.enter_async_context(network.open_host())
            network.set_link(host, trainer, Link(latency_s=latency))
            server = Stub(**stub)
            RpcServer(
                host,
                server.handlers(),  # type: ignore[arg-type]
                CONFIG.wire,
                CONFIG.timeouts,
                CONFIG.peer_limits,
            ).install()
            await trainer.connect(host.address)
            out.append((host, server))
        yield out


@asynccontextmanager
async def stubs(
    latencies: list[float], **stub: bool
) -> AsyncIterator[tuple[MemoryNetwork, MemoryHost, RpcClient, list[tuple[MemoryHost, Stub]]]]:
    """A trainer's host and RpcClient, and its stub servers (see ``servers``)."""
    network = MemoryNetwork()
    async with network.open_host() as trainer:
        rpc = RpcClient(trainer, CONFIG.wire, CONFIG.timeouts)
        try:
            async with servers(network, trainer, latencies, **stub) as hosts:
                yield network, trainer, rpc, hosts
        finally:
            await rpc.aclose()


def call(host: MemoryHost, uid: str, rows: list[int]) -> Call:
    header = ForwardRequest(uid=uid, tensors=[ROW])
    return Call(uid, host.address, header, [bytes(4)], rows)


async def test_the_round_ends_grace_after_every_row_has_k_min_answers(
    autojump_clock: trio.abc.Clock,
) -> None:
    async with stubs([0.1, 0.2, 5.0]) as (_network, _trainer, rpc, hosts):
        calls = [call(host, f"ffn.{i}", [0]) for i, (host, _) in enumerate(hosts)]
        start = trio.current_time()
        outcomes = await call_many(
            rpc, Verb.FORWARD, calls, n_rows=1, k_min=2, timeout_s=30.0, grace_s=0.5
        )
        # second answer after a 0.4 s round trip, then 0.5 s of grace
        assert trio.current_time() - start == pytest.approx(0.9)
    assert [o.ok for o in outcomes] == [True, True, False]
    assert [o.late for o in outcomes] == [False, False, True]
    assert isinstance(outcomes[2].error, RequestTimeout)


async def test_an_expert_answering_within_the_grace_is_taken(
    autojump_clock: trio.abc.Clock,
) -> None:
    async with stubs([0.1, 0.2, 0.4]) as (_network, _trainer, rpc, hosts):
        calls = [call(host, f"ffn.{i}", [0]) for i, (host, _) in enumerate(hosts)]
        start = trio.current_time()
        outcomes = await call_many(
            rpc, Verb.FORWARD, calls, n_rows=1, k_min=2, timeout_s=30.0, grace_s=0.5
        )
        assert trio.current_time() - start == pytest.approx(0.8)  # all finished
    assert all(o.ok for o in outcomes)


async def test_fewer_than_half_answering_wait_for_the_timeout_and_are_not_late(
    autojump_clock: trio.abc.Clock,
) -> None:
    """One request of three answers: there is no typical pace to hold the others to,
    and the silent ones are timed out (failed), not late."""
    async with stubs([0.1, 0.1, 0.1]) as (network, trainer, rpc, hosts):
        calls = [call(host, f"ffn.{i}", [0]) for i, (host, _) in enumerate(hosts)]
        network.partition([hosts[1][0], hosts[2][0]], [trainer])  # cables pulled
        start = trio.current_time()
        outcomes = await call_many(
            rpc, Verb.FORWARD, calls, n_rows=1, k_min=2, timeout_s=3.0, grace_s=0.5
        )
        assert trio.current_time() - start == pytest.approx(3.0)
    assert outcomes[0].ok
    for outcome in outcomes[1:]:
        assert isinstance(outcome.error, RequestTimeout)
        assert not outcome.late, "not merely slower than the others: nobody was enough"


async def test_a_lone_request_waits_for_the_timeout(autojump_clock: trio.abc.Clock) -> None:
    async with stubs([0.1]) as (network, trainer, rpc, hosts):
        network.partition([hosts[0][0]], [trainer])
        start = trio.current_time()
        [outcome] = await call_many(
            rpc,
            Verb.FORWARD,
            [call(hosts[0][0], "ffn.0", [0])],
            n_rows=1,
            k_min=1,
            timeout_s=3.0,
            grace_s=0.5,
        )
        assert trio.current_time() - start == pytest.approx(3.0)
    assert isinstance(outcome.error, RequestTimeout)
    assert not outcome.late


async def test_k_min_counts_per_row(autojump_clock: trio.abc.Clock) -> None:
    """Row 0 has its k_min answers early, row 1 only from its slower expert (2.5x the
    others, within STRAGGLER_FACTOR): the round waits for row 1's."""
    async with stubs([0.1, 0.1, 0.25]) as (_network, _trainer, rpc, hosts):
        (a, _), (b, _), (slow, _) = hosts
        calls = [call(a, "ffn.0", [0]), call(b, "ffn.1", [0]), call(slow, "ffn.2", [1])]
        start = trio.current_time()
        outcomes = await call_many(
            rpc, Verb.FORWARD, calls, n_rows=2, k_min=2, timeout_s=30.0, grace_s=0.05
        )
        # row 1 has a single expert: its one answer (0.5 s) is all it needs
        assert trio.current_time() - start == pytest.approx(0.5)
    assert all(o.ok for o in outcomes)


async def test_rows_only_a_far_slower_server_can_answer_stop_waiting_for_it(
    autojump_clock: trio.abc.Clock,
) -> None:
    """The outside audit's swarm: a token's experts in one grid row, the row on one
    server, that server 10x slower than the others. Its rows stop waiting
    STRAGGLER_FACTOR times the median request's time after the start (here 3 x 0.2 s),
    not for its 2 s answer, and its call is late (counted, not failed)."""
    async with stubs([0.1, 0.1, 0.1, 1.0]) as (_network, _trainer, rpc, hosts):
        calls = [call(host, f"ffn.{i}.0", [i]) for i, (host, _) in enumerate(hosts)]
        start = trio.current_time()
        outcomes = await call_many(
            rpc, Verb.FORWARD, calls, n_rows=4, k_min=1, timeout_s=30.0, grace_s=0.1
        )
        assert trio.current_time() - start == pytest.approx(STRAGGLER_FACTOR * 0.2)
    assert [o.ok for o in outcomes] == [True, True, True, False]
    assert isinstance(outcomes[3].error, RequestTimeout)
    assert outcomes[3].late


async def test_the_straggler_bound_is_at_least_the_grace_after_the_median(
    autojump_clock: trio.abc.Clock,
) -> None:
    """On a fast network (answers in milliseconds) a peer a few milliseconds behind is
    not cut: the bound is never shorter than the grace after the median answer."""
    async with stubs([0.001, 0.001, 0.01]) as (_network, _trainer, rpc, hosts):
        calls = [call(host, f"ffn.{i}.0", [i]) for i, (host, _) in enumerate(hosts)]
        outcomes = await call_many(
            rpc, Verb.FORWARD, calls, n_rows=3, k_min=1, timeout_s=30.0, grace_s=0.05
        )
    assert all(o.ok for o in outcomes)


async def test_a_silent_peer_costs_a_round_the_straggler_bound_not_the_timeout(
    autojump_clock: trio.abc.Clock,
) -> None:
    """A peer that takes requests and never answers (on purpose, or its cable pulled)
    holds its rows for max(STRAGGLER_FACTOR x median, median + grace), then is late: the
    layer bans it once it is late round after round."""
    async with stubs([0.1, 0.1, 0.1]) as (network, trainer, rpc, hosts):
        calls = [call(host, f"ffn.{i}.0", [i]) for i, (host, _) in enumerate(hosts)]
        network.partition([hosts[2][0]], [trainer])
        start = trio.current_time()
        outcomes = await call_many(
            rpc, Verb.FORWARD, calls, n_rows=3, k_min=1, timeout_s=30.0, grace_s=0.5
        )
        assert trio.current_time() - start == pytest.approx(0.2 + 0.5)
    assert outcomes[2].late


async def test_the_straggler_bound_follows_the_rounds_own_pace(
    autojump_clock: trio.abc.Clock,
) -> None:
    """When every answer is slow (the trainer's own link, or a busy swarm) the bound
    grows with them: a peer 1.5x the median is waited for at any scale."""
    async with stubs([1.0, 1.0, 1.5]) as (_network, _trainer, rpc, hosts):
        calls = [call(host, f"ffn.{i}.0", [i]) for i, (host, _) in enumerate(hosts)]
        start = trio.current_time()
        outcomes = await call_many(
            rpc, Verb.FORWARD, calls, n_rows=3, k_min=1, timeout_s=30.0, grace_s=0.5
        )
        assert trio.current_time() - start == pytest.approx(3.0)
    assert all(o.ok for o in outcomes)


async def test_a_refusal_is_its_typed_error_at_once(autojump_clock: trio.abc.Clock) -> None:
    async with stubs([0.1], refuse=True) as (_network, _trainer, rpc, hosts):
        start = trio.current_time()
        [outcome] = await call_many(
            rpc,
            Verb.FORWARD,
            [call(hosts[0][0], "ffn.0", [0])],
            n_rows=1,
            k_min=1,
            timeout_s=30.0,
            grace_s=0.5,
        )
        assert trio.current_time() - start == pytest.approx(0.2)
    assert isinstance(outcome.error, RemoteError)
    assert outcome.error.code == "busy"
    assert not outcome.late


async def test_experts_of_one_server_travel_in_one_message(
    autojump_clock: trio.abc.Clock,
) -> None:
    async with stubs([0.1, 0.1]) as (_network, _trainer, rpc, hosts):
        (a, stub_a), (b, stub_b) = hosts
        calls = [call(a, f"ffn.{i}", [i]) for i in range(6)]
        calls += [call(b, f"ffn.{i}", [6 + i]) for i in range(MAX_BATCH_ITEMS + 1)]
        outcomes = await call_many(
            rpc, Verb.FORWARD, calls, n_rows=len(calls), k_min=1, timeout_s=30.0, grace_s=0.5
        )
    assert all(o.ok for o in outcomes)
    assert stub_a.requests == {Verb.FORWARD_BATCH: 1}
    # past the largest batch a message may carry, one more (a single call)
    assert stub_b.requests == {Verb.FORWARD_BATCH: 1, Verb.FORWARD: 1}


async def test_a_banned_peer_is_offered_again_after_ban_s(autojump_clock: trio.abc.Clock) -> None:
    async with stubs([0.05, 0.05]) as (_network, _trainer, rpc, hosts):
        lookup = WorldLookup()
        for host, _ in hosts:
            lookup.announce(host.identity, host.peer_id, ["ffn.0", "ffn.1"])
        directory = ExpertDirectory(
            lookup,
            refresh_s=5.0,
            ban_s=60.0,
            verify=info_verifier(rpc, 10.0),
            clock=trio.current_time,
        )
        (a, _), (b, _) = hosts
        async with trio.open_nursery() as nursery:
            await nursery.start(directory.serve)

            async def offered() -> set[str]:
                children = (await directory.children(["ffn."]))["ffn."]
                return {p.peer_id for peers in children.values() for p in peers}

            assert await offered() == {a.peer_id, b.peer_id}
            directory.ban(b.peer_id, "timeout: ffn.0")
            assert await offered() == {a.peer_id}
            await trio.sleep(59.0)
            assert await offered() == {a.peer_id}, "still banned"
            await trio.sleep(2.0)
            assert await offered() == {a.peer_id, b.peer_id}
            assert directory.ban_reasons == {"timeout": 1}
            nursery.cancel_scope.cancel()


async def test_a_server_that_cannot_be_reached_is_not_offered_until_it_answers(
    autojump_clock: trio.abc.Clock,
) -> None:
    async with stubs([0.05, 0.05]) as (network, trainer, rpc, hosts):
        (a, _), (b, _) = hosts
        lookup = WorldLookup()
        for host in (a, b):
            lookup.announce(host.identity, host.peer_id, ["ffn.0"])
        network.partition([b], [trainer])
        await rpc.aclose()  # no pooled stream to b either
        directory = ExpertDirectory(
            lookup,
            refresh_s=5.0,
            ban_s=60.0,
            verify=info_verifier(rpc, 10.0),
            verify_wait_s=15.0,
            clock=trio.current_time,
        )
        async with trio.open_nursery() as nursery:
            await nursery.start(directory.serve)
            children = (await directory.children(["ffn."]))["ffn."]
            assert [p.peer_id for p in children[0]] == [a.peer_id]
            await trio.sleep(10.0)  # b's `info` times out
            assert directory.verifications == {"ok": 1, "failed": 1}
            network.heal()
            await trio.sleep(30.0)
            children = (await directory.children(["ffn."]))["ffn."]
            await trio.sleep(1.0)
            assert directory.verifications == {"ok": 1, "failed": 1}, "not asked again yet"
            await trio.sleep(30.0)  # ban_s after it failed: asked again
            await directory.children(["ffn."])
            await trio.sleep(1.0)
            children = (await directory.children(["ffn."]))["ffn."]
            assert {p.peer_id for p in children[0]} == {a.peer_id, b.peer_id}
            nursery.cancel_scope.cancel()
