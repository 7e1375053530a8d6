"""A new stream that broke before its protocol was negotiated is tried once more; a
refusal is not (real libp2p nodes on loopback; the break is injected where py-libp2p
reports it, as a CI run saw it: "handshake write failed")."""

from __future__ import annotations

from typing import Any

import pytest
import trio
from libp2p.host.exceptions import StreamFailure
from libp2p.protocol_muxer.exceptions import MultiselectClientError

from volunteerd.errors import PeerUnreachable
from volunteerd.net import Node, Verb
from volunteerd.net.protocols import PROTOCOLS
from volunteerd.net.records import FindRequest
from volunteerd.testing import local_config, open_peer
from volunteerd.wire import ShardRequest

pytestmark = pytest.mark.slow


def break_next_streams(node: Node, verb: Verb, how_many: int) -> list[int]:
    """Make ``node``'s next ``how_many`` new streams for ``verb`` fail as a broken one
    does; returns a list that grows by one at each try of such a stream (the node's
    other streams, e.g. its DHT's, go on as they are)."""
    host: Any = node.host
    real = host.new_stream
    protocol = PROTOCOLS[verb].protocol_id
    tries: list[int] = []

    async def new_stream(peer_id: Any, protocols: Any) -> Any:
        if str(protocols[0]) == protocol:
            tries.append(1)
            if len(tries) <= how_many:
                try:
                    raise MultiselectClientError("handshake write failed: stream reset")
                except MultiselectClientError as error:
                    raise StreamFailure(f"failed to open a stream to peer {peer_id}") from error
        return await real(peer_id, protocols)

    host.new_stream = new_stream
    return tries


async def test_a_stream_that_broke_in_its_handshake_is_opened_once_more() -> None:
    async with open_peer(local_config()) as server, open_peer(local_config()) as client:
        with trio.fail_after(30):
            await client.rpc.call(server.address, Verb.DHT_FIND, FindRequest(keys=["ffn."]))
        await client.rpc.aclose()  # no pooled stream: the next call opens one
        asked = break_next_streams(client, Verb.DHT_FIND, 1)
        with trio.fail_after(30):
            await client.rpc.call(server.address, Verb.DHT_FIND, FindRequest(keys=["ffn."]))
        assert len(asked) == 2

        await client.rpc.aclose()
        asked = break_next_streams(client, Verb.DHT_FIND, 2)  # broken twice: the caller hears of it
        with trio.fail_after(30), pytest.raises(PeerUnreachable, match="failed to open"):
            await client.rpc.call(server.address, Verb.DHT_FIND, FindRequest(keys=["ffn."]))
        assert len(asked) == 2


async def test_a_protocol_the_peer_refuses_is_not_asked_for_twice() -> None:
    async with open_peer(local_config()) as server, open_peer(local_config()) as client:
        asked = break_next_streams(client, Verb.SHARD, 0)  # a peer with no expert serves no shards
        with trio.fail_after(30), pytest.raises(PeerUnreachable, match="failed to open"):
            await client.rpc.call(server.address, Verb.SHARD, ShardRequest(uid="ffn.0.0"))
        assert len(asked) == 1
