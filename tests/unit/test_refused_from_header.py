"""An expert call over the batch cap is refused from its header, before its tensors are
read: 610 forwards of 8192 rows (1 MB each) against a cap of 2048 were all read, ~640
MB counted against the volunteer's quotas, only to be refused `too_large` (a re-check).
Over the in-memory network, in virtual time."""

from __future__ import annotations

import pytest
import trio

from volunteerd.config import Config, LimitsConfig
from volunteerd.errors import FrameTooLarge, RemoteError
from volunteerd.net import Verb
from volunteerd.net.rpc import Reply, Request, RpcClient, RpcServer
from volunteerd.net.throttle import Throttle
from volunteerd.testing.memnet import MemoryNetwork
from volunteerd.wire import ForwardBatchRequest, ForwardRequest, TensorMeta

CONFIG = Config()
CAP = 2048
ROW = 32 * 4  # 32 float32s


def call(rows: int) -> tuple[ForwardRequest, bytes]:
    meta = TensorMeta(dtype="float32", shape=(rows, 32))
    return ForwardRequest(uid="ffn.0.0", tensors=[meta]), bytes(rows * ROW)


async def test_a_call_over_the_batch_cap_is_refused_before_its_tensors_are_read(
    autojump_clock: trio.abc.Clock,
) -> None:
    handled: list[int] = []

    async def forward(request: Request) -> Reply:
        # what the expert service does with a batch over its cap
        handled.append(request.header.tensors[0].shape[0])
        raise FrameTooLarge(f"read whole: {request.header.tensors[0].shape[0]} samples")

    async def forward_batch(request: Request) -> Reply:
        handled.extend(item.tensors[0].shape[0] for item in request.header.items)
        raise FrameTooLarge("read whole")

    network = MemoryNetwork()
    async with network.open_host() as server_host, network.open_host() as client_host:
        server_throttle = Throttle(LimitsConfig())
        server = RpcServer(
            server_host,
            {Verb.FORWARD: forward, Verb.FORWARD_BATCH: forward_batch},
            CONFIG.wire,
            CONFIG.timeouts,
            CONFIG.peer_limits,
            throttle=server_throttle,
        )
        server.max_request_samples = CAP
        server.install()
        client = RpcClient(client_host, CONFIG.wire, CONFIG.timeouts)
        try:
            header, body = call(8192)  # 1 MiB
            for _ in range(5):
                with pytest.raises(RemoteError, match="8192 samples exceeds the cap of 2048"):
                    await client.call(server_host.address, Verb.FORWARD, header, [body])
            assert handled == []
            assert server.stats.bytes_in == 0  # no body read
            # what was taken off the stream: the window in flight at most, not 5 MiB
            assert server_throttle.bytes_down < len(body)
            # within the cap: read and handed to the expert as before
            with pytest.raises(RemoteError, match="read whole: 2048 samples"):
                await client.call(server_host.address, Verb.FORWARD, *_one(call(CAP)))
            # a batch with one call within the cap is read: that call is answered
            small, large = call(16), call(8192)
            batch = ForwardBatchRequest(items=[large[0], small[0]])
            with pytest.raises(RemoteError, match="read whole"):
                await client.call(
                    server_host.address, Verb.FORWARD_BATCH, batch, [large[1], small[1]]
                )
            assert handled == [CAP, 8192, 16]
            # a batch whose every call is over it is not
            batch = ForwardBatchRequest(items=[large[0], large[0]])
            with pytest.raises(RemoteError, match="8192 samples exceeds the cap"):
                await client.call(
                    server_host.address, Verb.FORWARD_BATCH, batch, [large[1], large[1]]
                )
            assert handled == [CAP, 8192, 16]
        finally:
            await client.aclose()


def _one(request: tuple[ForwardRequest, bytes]) -> tuple[ForwardRequest, list[bytes]]:
    return request[0], [request[1]]
