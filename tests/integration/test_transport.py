"""The transport offers only what we trust, and reuses connections and streams."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
import trio

from volunteerd.experts import to_wire
from volunteerd.identity import Identity
from volunteerd.moe import RemoteExpert
from volunteerd.net import Verb
from volunteerd.net.background import BackgroundNode
from volunteerd.net.host import build_host
from volunteerd.testing import local_config, open_daemon, open_peer
from volunteerd.wire import (
    BatchReply,
    ErrorReply,
    ForwardBatchRequest,
    ForwardRequest,
    TensorReply,
)

# Real libp2p nodes on loopback, in wall-clock time: a swarm, or a node and its clients.
pytestmark = pytest.mark.slow


def test_host_negotiates_noise_and_yamux_only() -> None:
    upgrader = build_host(Identity.generate()).get_network().upgrader
    security = upgrader.security_multistream._selector.get_protocols()
    muxers = upgrader.muxer_multistream._selector.get_protocols()
    assert list(security) == ["/noise"]
    assert list(muxers) == ["/yamux/1.0.0"]


async def test_sequential_requests_share_one_connection_and_stream(tmp_path: Path) -> None:
    async with open_peer(local_config()) as boot:
        config = local_config(bootstrap=boot.multiaddrs, uids="ffn.0.0")
        async with (
            open_daemon(config, tmp_path / "s") as server,
            open_peer(local_config(bootstrap=boot.multiaddrs)) as client,
        ):
            meta, data = to_wire(torch.randn(2, 32))
            request = ForwardRequest(uid="ffn.0.0", tensors=[meta])
            for _ in range(10):
                await client.rpc.call(server.node.address, Verb.FORWARD, request, [data])
            assert server.node.server.stats.requests[Verb.FORWARD] == 10
            assert server.node.server.stats.streams[Verb.FORWARD] == 1
            connections = client.host.get_network().connections
            assert len(connections[server.node.host.get_id()]) == 1


async def test_transformer_expert_over_the_wire_matches_local(tmp_path: Path) -> None:
    async with open_peer(local_config()) as boot:
        config = local_config(
            bootstrap=boot.multiaddrs,
            uids="attn.0.0",
            experts={"type": "transformer", "hidden_dim": 32, "num_heads": 4},
        )
        async with open_daemon(config, tmp_path / "s") as server:
            module = server.runtime.backend("attn.0.0").module
            client_config = local_config(bootstrap=boot.multiaddrs)

            def check() -> None:
                with BackgroundNode(Identity.generate(), client_config) as node:
                    expert = RemoteExpert("attn.0.0", server.node.address, node)
                    for seq_len in (5, 9):  # the sequence dimension is free
                        x = torch.randn(3, seq_len, 32)
                        with torch.no_grad():
                            torch.testing.assert_close(expert(x), module(x), atol=1e-5, rtol=0)

            await trio.to_thread.run_sync(check)


async def test_batched_request_answers_each_item_on_its_own(tmp_path: Path) -> None:
    async with open_peer(local_config()) as boot:
        config = local_config(bootstrap=boot.multiaddrs, uids="ffn.0.[0:2]")
        async with (
            open_daemon(config, tmp_path / "s") as server,
            open_peer(local_config(bootstrap=boot.multiaddrs)) as client,
        ):
            good, good_data = to_wire(torch.randn(2, 32))
            bad, bad_data = to_wire(torch.randn(3, 7))
            items = [
                ForwardRequest(uid="ffn.0.0", tensors=[good]),
                ForwardRequest(uid="ffn.9.9", tensors=[good]),  # not hosted here
                ForwardRequest(uid="ffn.0.1", tensors=[bad]),  # wrong shape
                ForwardRequest(uid="ffn.0.1", tensors=[good]),
            ]
            reply, tensors = await client.rpc.call(
                server.node.address,
                Verb.FORWARD_BATCH,
                ForwardBatchRequest(items=items),
                [good_data, good_data, bad_data, good_data],
            )
            assert isinstance(reply, BatchReply)
            kinds = [type(item) for item in reply.items]
            assert kinds == [TensorReply, ErrorReply, ErrorReply, TensorReply]
            assert [i.code for i in reply.items if isinstance(i, ErrorReply)] == [
                "unknown_expert",
                "bad_shape",
            ]
            assert [t.shape for t in tensors] == [(2, 32), (2, 32)]
            assert server.node.server.stats.requests[Verb.FORWARD_BATCH] == 1
