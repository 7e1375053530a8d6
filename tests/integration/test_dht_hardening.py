"""Kademlia over real libp2p keeps nothing for others: volunteerd routes with it only."""

from __future__ import annotations

import contextlib
import functools
import hashlib
import os
from collections.abc import AsyncIterator, Awaitable, Callable
from contextlib import AsyncExitStack
from typing import Any

import multiaddr
import pytest
import trio
import varint
from libp2p.kad_dht.common import MAX_DHT_MESSAGE_SIZE, PROTOCOL_ID
from libp2p.kad_dht.pb.kademlia_pb2 import Message
from libp2p.utils.varint import read_varint_prefixed_bytes_limited

from volunteerd.identity import Identity
from volunteerd.net.peers import peer_id_for
from volunteerd.net.records import sign_record
from volunteerd.testing import local_config, open_node_and_peers, open_peer

pytestmark = pytest.mark.slow


def _add_provider(sender_id: bytes, key: bytes) -> bytes:
    """An ADD_PROVIDER naming its sender (the only provider py-libp2p accepts) with
    many addresses: what a node that serves providers keeps for 48 h."""
    message = Message()
    message.type = Message.MessageType.ADD_PROVIDER
    message.key = key
    provider = message.providerPeers.add()
    provider.id = sender_id
    provider.addrs.extend(
        multiaddr.Multiaddr(f"/ip4/10.0.{j >> 8}.{j & 255}/tcp/1").to_bytes() for j in range(1000)
    )
    data = message.SerializeToString()
    return bytes(varint.encode(len(data))) + data


async def test_an_add_provider_message_is_not_stored() -> None:
    async with (
        open_peer(local_config()) as victim,
        open_peer(local_config(bootstrap=victim.multiaddrs)) as sender,
    ):
        await sender.rpc.connect(victim.address)
        providers = victim.dht._kad.provider_store.providers
        for _ in range(3):
            stream = await sender.host.new_stream(victim.host.get_id(), [PROTOCOL_ID])
            await stream.write(_add_provider(sender.host.get_id().to_bytes(), os.urandom(32)))
            with trio.move_on_after(5):
                try:
                    await read_varint_prefixed_bytes_limited(stream, MAX_DHT_MESSAGE_SIZE)
                except Exception:  # refused: the stream is reset
                    pass
            await stream.close()
        await trio.sleep(0.5)
        assert providers == {}
        # Kademlia's routing still works between them.
        closest = await sender.dht._kad.peer_routing.find_closest_peers_network(b"ffn.0.")
        assert victim.host.get_id() in closest


# -- one hostile Kademlia peer answering FIND_NODE with made-up peers ---------------------

TARGET = "ffn.0."
_ED25519_ID = b"\x00\x24\x08\x01\x12\x20"  # an identity multihash of an Ed25519 key


def _distance(key: bytes, raw_id: bytes) -> int:
    target = int.from_bytes(hashlib.sha256(key).digest(), "big")
    return target ^ int.from_bytes(hashlib.sha256(raw_id).digest(), "big")


def _made_up_ids(key: bytes, count: int) -> list[bytes]:
    """Peer ids no node holds the key of, ground to be closer to ``key`` than any real
    node is likely to be."""
    raws = [_ED25519_ID + os.urandom(32) for _ in range(4000)]
    return sorted(raws, key=lambda raw: _distance(key, raw))[:count]


def _identity_near(key: str) -> Identity:
    """An ordinary identity close to ``key``: the attacker's one real node."""
    return min(
        (Identity.generate() for _ in range(1000)),
        key=lambda ident: _distance(key.encode(), peer_id_for(ident).to_bytes()),
    )


def _made_up_answers(addr: str = "/ip4/127.0.0.1/tcp/9") -> Any:
    """A Kademlia handler that names 20 made-up peers, all at ``addr`` (by default a
    closed port), in every FIND_NODE answer: fresh ones each time."""
    packed = multiaddr.Multiaddr(addr).to_bytes()

    async def answer_with_made_up_peers(stream: Any) -> None:
        try:
            while True:
                raw = await read_varint_prefixed_bytes_limited(stream, MAX_DHT_MESSAGE_SIZE)
                request = Message()
                request.ParseFromString(raw)
                answer = Message()
                answer.type = request.type
                answer.key = request.key
                if request.type == Message.MessageType.FIND_NODE:
                    for raw_id in _made_up_ids(request.key, 20):
                        peer = answer.closerPeers.add()
                        peer.id = raw_id
                        peer.addrs.append(packed)
                data = answer.SerializeToString()
                await stream.write(bytes(varint.encode(len(data))) + data)
        except Exception:  # the asker hung up: nothing more to answer
            pass
        finally:
            with contextlib.suppress(Exception):
                await stream.close()

    return answer_with_made_up_peers


async def _swarm_with_a_liar(
    stack: AsyncExitStack, addr: str, dht: dict[str, Any], timeouts: dict[str, Any] | None = None
) -> tuple[Any, ...]:
    """A bootstrap node, three honest nodes in touch all round, and an attacker near
    ``TARGET`` that every honest node has connected and in its routing table, whose
    FIND_NODE answers name made-up peers at ``addr``."""
    timeouts = timeouts or {}
    boot = await stack.enter_async_context(open_peer(local_config(dht=dht, timeouts=timeouts)))
    joining = local_config(bootstrap=boot.multiaddrs, dht=dht, timeouts=timeouts)
    others = [await stack.enter_async_context(open_peer(joining)) for _ in range(3)]
    attacker = await stack.enter_async_context(open_peer(joining, _identity_near(TARGET)))
    attacker.host.set_stream_handler(PROTOCOL_ID, _made_up_answers(addr))
    honest_nodes = (boot, *others)
    for node in honest_nodes:  # a small swarm: everyone in touch with everyone
        for other in honest_nodes:
            if other is not node:
                await node.rpc.connect(other.address)
    for node in honest_nodes:
        await attacker.rpc.connect(node.address)
        await node.dht._kad.routing_table.add_peer(attacker.host.get_id())
        node.dht._closest_cache.clear()
    return honest_nodes, attacker


async def test_one_hostile_kademlia_peer_cannot_eclipse_a_key() -> None:
    """py-libp2p takes every peer a FIND_NODE answer names as found; records for the key
    then went to made-up ids only (0 acks, 0 found). Peers the node never reached are
    not found now (net/lookup.py), and the real ones it is in touch with are
    candidates too: writer and reader meet on the same real peers."""
    dht = {"replication": 3, "record_ttl_s": 60.0, "announce_period_s": 30.0}
    async with AsyncExitStack() as stack:
        honest_nodes, attacker = await _swarm_with_a_liar(stack, "/ip4/127.0.0.1/tcp/9", dht)
        honest, client = honest_nodes[1], honest_nodes[2]
        real = {node.host.get_id() for node in (*honest_nodes, attacker)}
        closest = await honest.dht._closest(TARGET)
        assert set(closest) <= real, "only peers that exist"
        record = sign_record(
            honest.identity, honest.peer_id, key=TARGET, addrs=honest.addrs, children=[0], ttl_s=60
        )
        stored = await honest.dht.put([record])
        assert stored.acks[TARGET] >= 1
        found = await client.dht.get([TARGET])
        assert [r.peer_id for r in found[TARGET]] == [honest.peer_id]


@contextlib.asynccontextmanager
async def _liar_pointing_at(
    listener: Callable[[trio.SocketStream], Awaitable[None]], timeouts: dict[str, Any] | None = None
) -> AsyncIterator[tuple[tuple[Any, ...], set[Any]]]:
    """A swarm with a liar whose made-up peers all point at a local TCP port served by
    ``listener`` (the third party): the honest nodes, and the ids of all real nodes."""
    dht = {"replication": 3, "record_ttl_s": 60.0, "announce_period_s": 30.0}
    async with trio.open_nursery() as nursery, AsyncExitStack() as stack:
        [server] = await nursery.start(
            functools.partial(trio.serve_tcp, listener, 0, host="127.0.0.1")
        )
        port = server.socket.getsockname()[1]
        honest_nodes, attacker = await _swarm_with_a_liar(
            stack, f"/ip4/127.0.0.1/tcp/{port}", dht, timeouts
        )
        yield honest_nodes, {node.host.get_id() for node in (*honest_nodes, attacker)}
        nursery.cancel_scope.cancel()


async def test_made_up_peers_neither_enter_routing_tables_nor_make_nodes_dial_a_third_party() -> (
    None
):
    """Before net/lookup.py, every lookup that met the liar put its twenty made-up peers
    in the routing table (handed on to others) and dialled their address: 70-76
    connections to a third party's port in the probe. Now a made-up peer is a
    candidate only, and the address that failed once is not dialled again."""
    connections = 0

    async def third_party(stream: trio.SocketStream) -> None:
        nonlocal connections
        connections += 1
        await stream.aclose()

    async with _liar_pointing_at(third_party) as (honest_nodes, real):
        keys = [TARGET, *(f"ffn.{n}." for n in range(1, 6))]
        for node in honest_nodes:
            for key in keys:
                found = await node.dht._kad.peer_routing.find_closest_peers_network(
                    key.encode(), count=3
                )
                assert set(found) <= real
                assert found, "the real peers are still found"
        for node in honest_nodes:
            assert set(node.dht._kad.routing_table.get_peer_ids()) <= real
        # each honest node dialled the third party's address once at most: one dial is
        # two connections, py-libp2p's swarm retrying a failed one once (net/host.py)
        assert connections <= 2 * len(honest_nodes)


async def test_made_up_peers_at_a_silent_address_cost_one_query_timeout() -> None:
    """Made-up peers at an address that accepts and never speaks: each dial waits for
    its query's timeout. One dial per address, so a lookup ends within its budget and
    finds the real peers."""

    async def silent(stream: trio.SocketStream) -> None:
        await trio.sleep_forever()

    # a query gives up after 1 s: one such wait leaves most of the 5 s lookup budget to
    # the rest of the walk, busy machine or not (py-libp2p's queries wait 10 s)
    async with _liar_pointing_at(silent, {"dht_rpc_s": 1.0}) as (honest_nodes, real):
        with trio.fail_after(local_config().timeouts.dht_lookup_s):
            found = await honest_nodes[1].dht._kad.peer_routing.find_closest_peers_network(
                TARGET.encode(), count=3
            )
        assert found
        assert set(found) <= real


# -- Kademlia streams held open without a word ----------------------------------------------


async def _find_node(asker: Any, node: Any, key: bytes) -> Message:
    stream = await asker.host.new_stream(node.host.get_id(), [PROTOCOL_ID])
    try:
        request = Message(type=Message.MessageType.FIND_NODE, key=key)
        data = request.SerializeToString()
        await stream.write(bytes(varint.encode(len(data))) + data)
        answer = Message()
        answer.ParseFromString(
            await read_varint_prefixed_bytes_limited(stream, MAX_DHT_MESSAGE_SIZE)
        )
        return answer
    finally:
        with contextlib.suppress(Exception):
            await stream.close()


async def test_silent_kademlia_streams_do_not_take_every_handler_of_a_node() -> None:
    """py-libp2p serves at most 12 inbound Kademlia streams at once, resets any beyond,
    and waits on each for its next message without a deadline: one peer holding 12
    streams open without a word made a node answer no FIND_NODE to anyone, for as long
    as it liked. Now 32 are served at once, 4 of them for one peer (8 for one address),
    each for twice ``timeouts.dht_rpc_s`` at most."""
    timeouts = {"dht_rpc_s": 2.0}
    async with (
        open_peer(local_config(timeouts=timeouts)) as node,
        open_peer(local_config(timeouts=timeouts)) as attacker,
        open_peer(local_config(timeouts=timeouts)) as asker,
    ):
        await attacker.rpc.connect(node.address)
        await asker.rpc.connect(node.address)
        silent = []
        for _ in range(40):
            with contextlib.suppress(Exception):  # refused ones may fail to open
                silent.append(await attacker.host.new_stream(node.host.get_id(), [PROTOCOL_ID]))
        await trio.sleep(0.5)  # every silent stream has reached the node's handler
        with trio.fail_after(30):
            answer = await _find_node(asker, node, attacker.host.get_id().to_bytes())
        assert answer.type == Message.MessageType.FIND_NODE
        # Every silent stream ends: refused at once, or reset once its time is up.
        with trio.fail_after(10):
            for stream in silent:
                with contextlib.suppress(Exception):
                    assert await stream.read(1) == b""
        # And the attacker is served again, like anyone.
        with trio.fail_after(30):
            answer = await _find_node(attacker, node, asker.host.get_id().to_bytes())
        assert answer.type == Message.MessageType.FIND_NODE


# -- Kademlia messages asked faster than a node should answer -----------------------------


def _find_nodes(count: int) -> bytes:
    """``count`` FIND_NODE requests for random keys, back to back."""
    frames = []
    for _ in range(count):
        data = Message(type=Message.MessageType.FIND_NODE, key=os.urandom(34)).SerializeToString()
        frames.append(bytes(varint.encode(len(data))) + data)
    return b"".join(frames)


async def _flood(attacker: Any, node: Any, seconds: float) -> tuple[int, float]:
    """Pipeline FIND_NODE requests to ``node`` on one stream and read answers for
    ``seconds``: how many came back, and in how long."""
    stream = await attacker.host.new_stream(node.host.get_id(), [PROTOCOL_ID])
    await stream.write(_find_nodes(400))
    answers = 0
    started = trio.current_time()
    with trio.move_on_after(seconds):
        while True:
            await read_varint_prefixed_bytes_limited(stream, MAX_DHT_MESSAGE_SIZE)
            answers += 1
    elapsed = trio.current_time() - started
    with contextlib.suppress(Exception):
        await stream.reset()
    return answers, elapsed


async def test_a_peer_asking_kademlia_as_fast_as_it_can_is_answered_at_its_rate() -> None:
    """One peer pipelining FIND_NODE requests was answered as fast as the node could
    (about 1,500 a second on one stream here, at a few hundred microseconds of the
    node's CPU each). Now its messages wait for its tokens (burst, then a rate), while
    another peer, with its own budget, is answered at once."""
    limits = {"dht_messages_per_s": 5, "dht_message_burst": 10}
    async with open_node_and_peers(limits) as (node, attacker, asker):
        async with trio.open_nursery() as nursery:
            flooded: list[tuple[int, float]] = []

            async def flood() -> None:
                flooded.append(await _flood(attacker, node, 3.0))

            nursery.start_soon(flood)
            await trio.sleep(1.0)  # the flood has used its burst and is waiting now
            with trio.fail_after(30):
                answer = await _find_node(asker, node, attacker.host.get_id().to_bytes())
            assert answer.type == Message.MessageType.FIND_NODE
        [(answers, elapsed)] = flooded
        assert 10 <= answers <= 10 + 5 * elapsed + 2
        assert node.kademlia is not None
        assert node.kademlia.waits > 0


async def test_the_peers_of_one_address_share_its_kademlia_rate() -> None:
    """Identities cost nothing: with ``limit_loopback`` (loopback counted as an
    address) and ``per_address`` 1, two flooding peers on one address together get one
    peer's worth of answers."""
    limits = {
        "dht_messages_per_s": 5,
        "dht_message_burst": 10,
        "per_address": 1,
        "limit_loopback": True,
    }
    async with open_node_and_peers(limits) as (node, first, second):
        flooded: list[tuple[int, float]] = []

        async def flood(attacker: Any) -> None:
            flooded.append(await _flood(attacker, node, 3.0))

        async with trio.open_nursery() as nursery:
            nursery.start_soon(flood, first)
            nursery.start_soon(flood, second)
        total = sum(answers for answers, _ in flooded)
        longest = max(elapsed for _, elapsed in flooded)
        assert 10 <= total <= 10 + 5 * longest + 2
