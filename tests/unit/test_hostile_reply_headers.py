"""A reply header nested too deep for a recursive JSON parser is one failed call, never
the trainer's round.

Probed from outside (2026-12): an expert server answered a forward before reading the
request with a header of 60,000 ``[`` (under the 64 KiB header cap). The client's
``_says_ok`` parsed it with ``json.loads``, whose ``RecursionError`` escaped
``RpcClient.call`` and ``call_many`` and ended the trainer's training run. Over the
in-memory network, in virtual time."""

from __future__ import annotations

import struct
from typing import Any

import pytest
import trio

from volunteerd.config import Config
from volunteerd.errors import PeerError, RemoteError
from volunteerd.moe.dispatch import Call, call_many
from volunteerd.net import PeerAddress, Verb
from volunteerd.net.protocols import PROTOCOLS
from volunteerd.net.rpc import RpcClient, _says_ok
from volunteerd.net.transport import Stream
from volunteerd.testing.memnet import Link, MemoryNetwork
from volunteerd.wire import ForwardRequest, TensorMeta

CONFIG = Config()
DEEP = 60_000  # far past any recursion limit, under wire.max_header_bytes


def nested_reply(depth: int = DEEP) -> bytes:
    """A reply frame (prefix and header, no body) whose header is ``depth`` ``[``."""
    header = b"[" * depth
    return struct.pack("<2sBBIQ", b"VD", 1, 0, len(header), 0) + header


def test_a_header_nested_past_any_recursion_limit_is_not_ok_and_raises_nothing() -> None:
    assert CONFIG.wire.max_header_bytes > DEEP
    for header in (b"[" * DEEP, b"{" * DEEP, b'{"status":' + b"[" * DEEP, b'[{"a":' * DEEP):
        assert _says_ok(header) is False
        assert _says_ok(memoryview(header)) is False
    assert _says_ok(b'{"status": "ok"}') is True
    assert _says_ok(b'["status", "ok"]') is False  # not an object
    assert _says_ok(b"\xff\xfe") is False  # not text


async def test_a_deeply_nested_reply_before_the_request_is_written_is_a_peer_error(
    autojump_clock: trio.abc.Clock,
) -> None:
    network = MemoryNetwork()
    async with network.open_host() as server_host, network.open_host() as client_host:
        # The request crawls to the server: the reply comes while it is still written.
        network.set_link(client_host, server_host, Link(bytes_per_s=10_000), both_ways=False)

        async def answer_unread(stream: Stream) -> None:
            await stream.write(nested_reply())
            await trio.sleep(60)

        server_host.set_stream_handler(PROTOCOLS[Verb.FORWARD].protocol_id, answer_unread)
        client = RpcClient(client_host, CONFIG.wire, CONFIG.timeouts)
        header = ForwardRequest(
            uid="ffn.0.0", tensors=[TensorMeta(dtype="float32", shape=(64, 1024))]
        )
        try:
            with pytest.raises(PeerError, match=r"bad reply|malformed|stream"):
                await client.call(server_host.address, Verb.FORWARD, header, [bytes(64 * 4096)])
            assert client.pooled_streams() == 0  # the stream is out of step: not kept

            # Through a trainer's round: the call fails, the round goes on.
            call = Call("ffn.0.0", server_host.address, header, [bytes(64 * 4096)], [0])
            outcomes = await call_many(
                client, Verb.FORWARD, [call], n_rows=1, k_min=1, timeout_s=30, grace_s=1
            )
            assert isinstance(outcomes[0].error, PeerError)
        finally:
            await client.aclose()


class Exploding:
    """An RPC client whose calls to one peer fail with an exception no layer names."""

    def __init__(self, bad_peer: str) -> None:
        self.bad_peer = bad_peer

    async def call(self, peer: PeerAddress, verb: Verb, header: Any, buffers: Any) -> Any:
        await trio.sleep(0.01)
        if peer.peer_id == self.bad_peer:
            raise RecursionError("maximum recursion depth exceeded")
        if peer.peer_id == "refusing":
            raise RemoteError("busy", "try later")
        return header, []


async def test_an_unexpected_exception_from_one_call_is_that_calls_outcome(
    autojump_clock: trio.abc.Clock,
) -> None:
    header = ForwardRequest(uid="ffn.0.0", tensors=[])
    calls = [
        Call("ffn.0.0", PeerAddress(peer, ()), header, [], [row])
        for row, peer in enumerate(["good", "bad", "refusing"])
    ]
    outcomes = await call_many(
        Exploding("bad"),  # type: ignore[arg-type]
        Verb.FORWARD,
        calls,
        n_rows=3,
        k_min=1,
        timeout_s=5,
        grace_s=1,
    )
    assert outcomes[0].ok
    assert isinstance(outcomes[1].error, RecursionError)
    assert not outcomes[1].ok
    assert not outcomes[1].late
    assert isinstance(outcomes[2].error, RemoteError)
