"""The faulty-expert helper (volunteerd/testing/faulty.py) over real RPC on memory
links: answers come back NaN, scaled, noisy, late or refused, for the experts chosen."""

from __future__ import annotations

from collections.abc import AsyncIterator
from contextlib import asynccontextmanager

import pytest
import torch
import trio

from volunteerd.config import Config
from volunteerd.errors import Busy, RemoteError, UnknownExpert
from volunteerd.experts import from_wire, to_wire
from volunteerd.net.protocols import Verb
from volunteerd.net.rpc import Handler, Reply, Request, RpcClient, RpcServer
from volunteerd.testing.faulty import HONEST, Fault, Faults, nan, noise, scaled_by
from volunteerd.testing.memnet import Link, MemoryHost, MemoryNetwork
from volunteerd.wire import (
    BatchReply,
    ErrorReply,
    ForwardBatchRequest,
    ForwardRequest,
    InfoRequest,
    TensorReply,
)

CONFIG = Config()


async def echo(request: Request) -> Reply:
    """An expert computing the identity."""
    return Reply(
        TensorReply(tensors=[t.meta for t in request.tensors]), [t.data for t in request.tensors]
    )


async def echo_batch(request: Request) -> Reply:
    items: list[TensorReply | ErrorReply] = [
        TensorReply(tensors=item.tensors) for item in request.header.items
    ]
    return Reply(BatchReply(items=items), [t.data for t in request.tensors])


async def info(request: Request) -> Reply:
    raise UnknownExpert("answered by the honest handler")


HANDLERS: dict[Verb, Handler] = {
    Verb.FORWARD: echo,
    Verb.FORWARD_BATCH: echo_batch,
    Verb.INFO: info,
}


@asynccontextmanager
async def faulty_server(faults: Faults) -> AsyncIterator[tuple[MemoryHost, RpcClient]]:
    network = MemoryNetwork(default=Link(latency_s=0.01))
    async with network.open_host() as server_host, network.open_host() as client_host:
        RpcServer(
            server_host, faults.wrap(HANDLERS), CONFIG.wire, CONFIG.timeouts, CONFIG.peer_limits
        ).install()
        client = RpcClient(client_host, CONFIG.wire, CONFIG.timeouts)
        try:
            yield server_host, client
        finally:
            await client.aclose()


X = torch.arange(8, dtype=torch.float32).reshape(2, 4) + 1


async def forward(client: RpcClient, host: MemoryHost, uid: str = "ffn.0") -> torch.Tensor:
    meta, data = to_wire(X)
    _, tensors = await client.call(
        host.address, Verb.FORWARD, ForwardRequest(uid=uid, tensors=[meta]), [data]
    )
    return from_wire(tensors[0])


async def test_answers_are_honest_until_a_fault_is_set(autojump_clock: trio.abc.Clock) -> None:
    faults = Faults()
    async with faulty_server(faults) as (host, client):
        assert torch.equal(await forward(client, host), X)
        faults.fault = Fault(outputs=nan)
        assert torch.isnan(await forward(client, host)).all()
        faults.fault = Fault(outputs=scaled_by(1e6))
        assert torch.equal(await forward(client, host), X * 1e6)
        faults.fault = Fault(outputs=noise(seed=1))
        noisy = await forward(client, host)
        assert torch.isfinite(noisy).all()
        assert not torch.allclose(noisy, X)
        faults.fault = HONEST
        assert torch.equal(await forward(client, host), X)
        assert faults.faulty_replies == 3


async def test_a_slow_expert_answers_late_in_virtual_time(autojump_clock: trio.abc.Clock) -> None:
    faults = Faults(Fault(delay_s=30.0))
    async with faulty_server(faults) as (host, client):
        await forward(client, host)  # connected
        started = trio.current_time()
        assert torch.equal(await forward(client, host), X)
        assert trio.current_time() - started == pytest.approx(30.02)


async def test_a_refusing_expert_answers_a_typed_error(autojump_clock: trio.abc.Clock) -> None:
    async with faulty_server(Faults(Fault(refuse=Busy("queue full")))) as (host, client):
        for _ in range(2):  # the same refusal, every time
            with pytest.raises(RemoteError) as refused:
                await forward(client, host)
            assert refused.value.code == "busy"


async def test_only_the_chosen_experts_misbehave(autojump_clock: trio.abc.Clock) -> None:
    faults = Faults(Fault(outputs=nan, uids=frozenset({"ffn.1"})))
    async with faulty_server(faults) as (host, client):
        assert torch.equal(await forward(client, host, "ffn.0"), X)
        assert torch.isnan(await forward(client, host, "ffn.1")).all()
        meta, data = to_wire(X)
        items = [ForwardRequest(uid=f"ffn.{i}", tensors=[meta]) for i in range(3)]
        _, tensors = await client.call(
            host.address, Verb.FORWARD_BATCH, ForwardBatchRequest(items=items), [data] * 3
        )
        answers = [from_wire(t) for t in tensors]
        assert torch.equal(answers[0], X)
        assert torch.equal(answers[2], X)
        assert torch.isnan(answers[1]).all()


async def test_other_verbs_pass_through(autojump_clock: trio.abc.Clock) -> None:
    async with faulty_server(Faults(Fault(refuse=Busy("no")))) as (host, client):
        with pytest.raises(RemoteError) as answered:
            await client.call(host.address, Verb.INFO, InfoRequest(uid="ffn.0"))
        assert answered.value.code == "unknown_expert"  # not "busy"
