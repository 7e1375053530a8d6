"""A paused daemon refuses the expert verbs from a request's prefix: a peer that keeps
sending while the volunteer paused must not make it read (and download, against the
volunteer's quota) every byte first. Over the in-memory network, in virtual time."""

from __future__ import annotations

import pytest
import trio

from volunteerd.config import Config, LimitsConfig
from volunteerd.errors import RemoteError, UnknownExpert
from volunteerd.net import Verb
from volunteerd.net.rpc import Reply, Request, RpcClient, RpcServer
from volunteerd.net.throttle import Throttle
from volunteerd.server.pausing import RequestGate, refusal_before_reading
from volunteerd.testing.memnet import MemoryNetwork
from volunteerd.wire import ForwardRequest, InfoRequest, TensorMeta

CONFIG = Config()
BODY = 4 << 20


async def test_a_closed_gate_refuses_expert_calls_before_their_bodies_are_read(
    autojump_clock: trio.abc.Clock,
) -> None:
    handled: list[Verb] = []

    async def forward(request: Request) -> Reply:
        handled.append(Verb.FORWARD)
        raise AssertionError("a paused daemon computed")

    async def info(request: Request) -> Reply:
        handled.append(Verb.INFO)
        raise UnknownExpert("no ffn.0.0 here")

    gate = RequestGate()
    network = MemoryNetwork()
    async with network.open_host() as server_host, network.open_host() as client_host:
        server_throttle = Throttle(LimitsConfig())
        server = RpcServer(
            server_host,
            {Verb.FORWARD: forward, Verb.INFO: info},
            CONFIG.wire,
            CONFIG.timeouts,
            CONFIG.peer_limits,
            throttle=server_throttle,
        )
        server.refuse_unread = refusal_before_reading(gate, None)
        server.install()
        client = RpcClient(client_host, CONFIG.wire, CONFIG.timeouts)
        try:
            gate.closed = True
            meta = TensorMeta(dtype="float32", shape=(BODY // 32, 8))
            for _ in range(3):
                with pytest.raises(RemoteError, match="paused"):
                    await client.call(
                        server_host.address,
                        Verb.FORWARD,
                        ForwardRequest(uid="ffn.0.0", tensors=[meta]),
                        [bytes(BODY)],
                    )
            assert server.stats.bytes_in == 0  # no request was read past its prefix
            assert server_throttle.bytes_down < BODY  # nor taken off the wire, in all
            # What costs nothing still answers while paused.
            with pytest.raises(RemoteError, match="unknown_expert"):
                await client.call(server_host.address, Verb.INFO, InfoRequest(uid="ffn.0.0"))
            assert handled == [Verb.INFO]
        finally:
            await client.aclose()
