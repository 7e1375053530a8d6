"""A storing peer that holds its connections open but answers nothing (a frozen
process) costs a reader one short wait: finds and lookups return what the peers that
answered gave within the reader's bound, and skip the silent peer afterwards."""

from __future__ import annotations

from collections.abc import AsyncIterator
from contextlib import AsyncExitStack, asynccontextmanager
from typing import Any

import pytest
import trio
from libp2p.kad_dht.common import PROTOCOL_ID
from libp2p.kad_dht.utils import sort_peer_ids_by_distance
from libp2p.peer.id import ID

from tests.integration.test_dht_closest_set import in_touch
from volunteerd.net import Verb
from volunteerd.net.node import Node
from volunteerd.net.protocols import PROTOCOLS
from volunteerd.net.records import sign_record
from volunteerd.testing import local_config, open_peer

pytestmark = pytest.mark.slow

# A reader's bound on a find equals one DHT request's time, as the trainer's directory
# refresh (5 s) does with the default dht_rpc_s (5 s). Before, a find waited dht_rpc_s
# on the silent peer and the reader's bound ended it first: every refresh, for good.
RPC_S = 6.0
TIMEOUTS = {"dht_rpc_s": RPC_S, "dht_lookup_s": 2 * RPC_S}
DHT = {"record_ttl_s": 120.0, "announce_period_s": 30.0, "replication": 5}


async def _never_answer(stream: Any) -> None:
    await trio.sleep_forever()


def _silence(node: Node) -> None:
    """From now on ``node`` accepts streams for Kademlia and the record verbs and never
    answers on them (its connections stay open, as a stopped process's do)."""
    for protocol in (
        PROTOCOL_ID,
        PROTOCOLS[Verb.DHT_FIND].protocol_id,
        PROTOCOLS[Verb.DHT_STORE].protocol_id,
    ):
        node.host.set_stream_handler(protocol, _never_answer)  # type: ignore[arg-type]


def _key_nearest(peer: ID, peers: list[ID]) -> str:
    """A prefix key whose closest peer of ``peers`` is ``peer``: a lookup of it asks
    ``peer`` in its first round."""
    for i in range(10_000):
        key = f"ffn.{i}."
        if sort_peer_ids_by_distance(key.encode(), peers)[0] == peer:
            return key
    raise AssertionError("no key near the peer")


@asynccontextmanager
async def _swarm() -> AsyncIterator[tuple[Node, Node, Node, Node, Node, str]]:
    """boot, two replicas, the peer to be silenced, and a reader, all in touch with all;
    both replicas have stored their record for a key whose closest peer is the silent
    one. Yields (boot, a, b, silent, reader, key)."""
    async with AsyncExitStack() as stack:
        boot = await stack.enter_async_context(open_peer(local_config(dht=DHT, timeouts=TIMEOUTS)))
        joining = local_config(bootstrap=boot.multiaddrs, dht=DHT, timeouts=TIMEOUTS)
        a, b, silent, reader = [
            await stack.enter_async_context(open_peer(joining)) for _ in range(4)
        ]
        await in_touch([boot, a, b, silent, reader])
        others = [n.host.get_id() for n in (boot, a, b, silent)]
        key = _key_nearest(silent.host.get_id(), others)
        for replica in (a, b):
            record = sign_record(
                replica.identity,
                replica.peer_id,
                key=key,
                addrs=replica.addrs,
                children=[0],
                ttl_s=120,
            )
            outcome = await replica.dht.put([record])
            assert outcome.min_acks >= 4
        yield boot, a, b, silent, reader, key


async def _writers_found_within_bound(reader: Node, key: str) -> set[str] | None:
    with trio.move_on_after(RPC_S):
        return {r.peer_id for r in (await reader.dht.get([key]))[key]}
    return None


async def test_a_find_returns_the_live_replicas_while_a_storing_peer_is_silent() -> None:
    async with _swarm() as (_, a, b, silent, reader, key):
        assert await _writers_found_within_bound(reader, key) == {a.peer_id, b.peer_id}
        assert silent.host.get_id() in await reader.dht._closest(key), "the reader asks it"
        _silence(silent)
        reader.rpc.forget(silent.peer_id)  # its pooled streams would still be served
        for _ in range(3):  # the first find finds it out, the next ones skip it
            assert await _writers_found_within_bound(reader, key) == {a.peer_id, b.peer_id}


async def test_a_lookup_skips_a_connected_peer_that_never_answers() -> None:
    async with _swarm() as (boot, a, b, silent, reader, key):
        _silence(silent)
        reader.rpc.forget(silent.peer_id)
        reader.dht._closest_cache.clear()  # the next find looks its key up afresh
        for _ in range(3):
            assert await _writers_found_within_bound(reader, key) == {a.peer_id, b.peer_id}
        # and the node's own lookups (its routing refreshes too) no longer wait for it
        with trio.fail_after(RPC_S):
            found = await reader.dht._kad.peer_routing.find_closest_peers_network(
                key.encode(), count=20
            )
        assert set(found) == {n.host.get_id() for n in (boot, a, b)}
