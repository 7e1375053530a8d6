"""Where a key's records live is decided by peers known to run the DHT, spread over
networks: idle strangers connected to a writer or a reader, and identities of one
network that take records and answer every find empty, no longer decide it."""

from __future__ import annotations

import hashlib
import re
from contextlib import AsyncExitStack

import pytest
import trio
from libp2p.peer.id import ID

from volunteerd.identity import Identity
from volunteerd.net import Verb
from volunteerd.net.announce import Announcer
from volunteerd.net.dht import ExpertDHT
from volunteerd.net.node import Node, open_node
from volunteerd.net.peers import peer_id_for
from volunteerd.net.records import FindReply, FindRequest, sign_record
from volunteerd.net.rpc import Reply, Request
from volunteerd.net.throttle import URGENT_MAX_BYTES
from volunteerd.testing import local_config, open_peer
from volunteerd.testing.clients import open_bare_client

pytestmark = pytest.mark.slow

DHT = {"replication": 3, "record_ttl_s": 120.0, "announce_period_s": 60.0}
STRANGERS = 30
KEYS = [f"ffn.{i}." for i in range(4)]


async def in_touch(nodes: list[Node]) -> None:
    """Every node connected to every other and holding it in its routing table."""
    for node in nodes:
        for other in nodes:
            if other is not node:
                await node.rpc.connect(other.address)
                await node.dht._kad.routing_table.add_peer(other.host.get_id())
    for node in nodes:
        node.dht._closest_cache.clear()


async def _swarm(count: int, stack: AsyncExitStack) -> list[Node]:
    """A bootstrap node and ``count`` nodes joined through it: ``[boot, ...]``."""
    boot = await stack.enter_async_context(open_peer(local_config(dht=DHT)))
    joining = local_config(bootstrap=boot.multiaddrs, dht=DHT)
    return [boot, *[await stack.enter_async_context(open_peer(joining)) for _ in range(count)]]


async def _idle_strangers(target: Node, count: int, nursery: trio.Nursery) -> None:
    """``count`` fresh identities that connect to ``target``, make one DHT find each (as
    a trainer's client would) and hold their connections; they serve no DHT."""
    ready = trio.Semaphore(0)

    async def stranger() -> None:
        async with open_bare_client(local_config()) as client:
            await client.call(target.address, Verb.DHT_FIND, FindRequest(keys=["ffn."]))
            ready.release()
            await trio.sleep_forever()

    for _ in range(count):
        nursery.start_soon(stranger)
    for _ in range(count):
        await ready.acquire()


async def test_idle_strangers_neither_take_a_writers_records_nor_hide_them_from_a_reader() -> None:
    """300 strangers that each made one find and held their connection were the closest
    "peers" to every key of the daemon they were connected to: its stores went to them
    and failed (0 acks for as long as they stayed), and a reader connected to them found
    nothing. A bare connection is no candidate now."""
    async with AsyncExitStack() as stack:
        nodes = await _swarm(4, stack)
        await in_touch(nodes)
        writer, reader = nodes[1], nodes[2]
        records = [
            sign_record(
                writer.identity, writer.peer_id, key=k, addrs=writer.addrs, children=[0], ttl_s=120
            )
            for k in KEYS
        ]
        async with trio.open_nursery() as nursery:
            await _idle_strangers(writer, STRANGERS, nursery)
            await _idle_strangers(reader, STRANGERS, nursery)
            assert len(writer.host.get_network().connections) >= STRANGERS
            stored = await writer.dht.put(records)
            found = await reader.dht.get(KEYS)
            nursery.cancel_scope.cancel()
        assert stored.acks == dict.fromkeys(KEYS, DHT["replication"])
        assert {k: [r.peer_id for r in found[k]] for k in KEYS} == {
            k: [writer.peer_id] for k in KEYS
        }


async def _withhold(request: Request) -> Reply:
    return Reply(FindReply(records=[]))


def _ground_near(key: str, honest: list[ID], count: int) -> list[Identity]:
    """``count`` identities closer to ``key`` than every peer of ``honest`` (a few dozen
    tries: with 4 honest peers one id in 5 is)."""
    target = int.from_bytes(hashlib.sha256(key.encode()).digest(), "big")

    def distance(peer_id: ID) -> int:
        return target ^ int.from_bytes(hashlib.sha256(peer_id.to_bytes()).digest(), "big")

    bound = min(distance(p) for p in honest)
    out: list[Identity] = []
    while len(out) < count:
        identity = Identity.generate()
        if distance(ID.from_base58(str(peer_id_for(identity)))) < bound:
            out.append(identity)
    return out


async def test_withholders_of_one_network_do_not_hide_a_key_from_a_reader(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """Identities ground near a key, all from one address, that accept every store and
    answer every find empty took the whole closest set: writers counted full acks and
    readers found nothing. At most a minority of the set is of one network now, so the
    writer's record also reaches honest peers, and the reader asks them."""
    async with AsyncExitStack() as stack:
        nodes = await _swarm(3, stack)
        joining = local_config(bootstrap=nodes[0].multiaddrs, dht=DHT)
        key = "ffn.0."
        honest = [n.host.get_id() for n in nodes]
        withholding = {Verb.DHT_FIND: _withhold}
        withholders = [
            await stack.enter_async_context(open_node(identity, joining, withholding))
            for identity in _ground_near(key, honest, DHT["replication"])
        ]
        await in_touch([*nodes, *withholders])
        their_ids = {w.host.get_id() for w in withholders}

        def network_of(self: ExpertDHT, peer_id: ID) -> str:
            # one public /24 for the withholders; every honest peer a network of its own
            return "203.0.113.0/24" if peer_id in their_ids else f"peer:{peer_id}"

        monkeypatch.setattr(ExpertDHT, "_network_of", network_of, raising=False)
        writer, reader = nodes[1], nodes[2]
        record = sign_record(
            writer.identity, writer.peer_id, key=key, addrs=writer.addrs, children=[0], ttl_s=120
        )
        stored = await writer.dht.put([record])
        assert stored.acks[key] == DHT["replication"]
        assert not their_ids.issuperset(writer.dht._holders[key]), "honest peers hold it"
        found = await reader.dht.get([key])
        assert [r.peer_id for r in found[key]] == [writer.peer_id]


async def test_newcomers_closest_to_a_key_that_hold_nothing_yet_do_not_hide_it() -> None:
    """Peers that joined nearer a key than its holders, before the writer's next round,
    answer its finds empty: the reader then asks the next candidates once, and finds
    the record where the writer put it (before, nothing until the writer's next round;
    peers that take records and withhold them are found out the same way if the
    writer also stored past them)."""
    async with AsyncExitStack() as stack:
        nodes = await _swarm(3, stack)
        await in_touch(nodes)
        writer, reader = nodes[1], nodes[2]
        key = "ffn.0."
        record = sign_record(
            writer.identity, writer.peer_id, key=key, addrs=writer.addrs, children=[0], ttl_s=120
        )
        assert (await writer.dht.put([record])).acks[key] == DHT["replication"]
        joining = local_config(bootstrap=nodes[0].multiaddrs, dht=DHT)
        honest = [n.host.get_id() for n in nodes]
        newcomers = [
            await stack.enter_async_context(open_peer(joining, identity))
            for identity in _ground_near(key, honest, DHT["replication"])
        ]
        await in_touch([*nodes, *newcomers])
        assert set(await reader.dht._closest(key)) == {n.host.get_id() for n in newcomers}
        found = await reader.dht.get([key])
        assert [r.peer_id for r in found[key]] == [writer.peer_id]


async def test_an_announcer_whose_holders_withhold_its_record_says_so(
    caplog: pytest.LogCaptureFixture,
) -> None:
    """Its acks were full (every holder took the record), so nothing was said while no
    reader could find it. It now reads one record back from its holders every round."""
    async with AsyncExitStack() as stack:
        nodes = await _swarm(2, stack)
        uid = "ffn.0.0"
        honest = [n.host.get_id() for n in nodes]
        joining = local_config(bootstrap=nodes[0].multiaddrs, dht=DHT)
        withholders = [
            await stack.enter_async_context(
                open_node(identity, joining, {Verb.DHT_FIND: _withhold})
            )
            for identity in _ground_near(uid, honest, DHT["replication"])
        ]
        await in_touch([*nodes, *withholders])
        writer = nodes[1]
        config = local_config(dht=DHT)
        announcer = Announcer(
            writer.dht, writer.identity, writer.peer_id, writer.addrs, config.dht, config.timeouts
        )
        announcer.set_uids([uid])
        outcome = await announcer.announce_now()
        assert outcome.acks[uid] == DHT["replication"]
        assert "gave it back" in caplog.text
        assert announcer.withheld


async def test_withholders_of_a_prefix_alone_are_seen_by_the_announcer(
    caplog: pytest.LogCaptureFixture,
) -> None:
    """Trainers find experts through the prefixes. Withholders ground near ``ffn.`` alone
    hid it from every reader while the uid's own record read back: the read-back
    checked uids only (an outside re-check)."""
    async with AsyncExitStack() as stack:
        nodes = await _swarm(2, stack)
        honest = [n.host.get_id() for n in nodes]
        joining = local_config(bootstrap=nodes[0].multiaddrs, dht=DHT)
        withholders = [
            await stack.enter_async_context(
                open_node(identity, joining, {Verb.DHT_FIND: _withhold})
            )
            for identity in _ground_near("ffn.", honest, DHT["replication"])
        ]
        await in_touch([*nodes, *withholders])
        writer = nodes[1]
        config = local_config(dht=DHT)
        announcer = Announcer(
            writer.dht, writer.identity, writer.peer_id, writer.addrs, config.dht, config.timeouts
        )
        announcer.set_uids(["ffn.0.0"])
        await announcer.announce_now()
        assert re.search(r"record for ffn\. (and \S+ )?gave it back", caplog.text)
        assert announcer.withheld


async def test_a_writer_with_hundreds_of_keys_stores_them_all_on_a_peer_closest_for_each() -> None:
    """A daemon sends a storing peer all the keys it is among the closest for in one
    request of up to 256 records: ~81 KB of header against the receiver's 64 KiB cap, so
    in a small swarm (or with 128 experts of a 4-D grid) that peer refused every one of
    the daemon's records, and the daemon said it was cut off. Requests are now cut by
    bytes too."""
    async with AsyncExitStack() as stack:
        boot, writer = await _swarm(1, stack)
        await in_touch([boot, writer])
        keys = [f"ffn.{i}.{j}" for i in range(20) for j in range(15)]  # 300 keys
        records = [
            sign_record(writer.identity, writer.peer_id, key=k, addrs=writer.addrs, ttl_s=120)
            for k in keys
        ]
        stored = await writer.dht.put(records)
        assert stored.acks == dict.fromkeys(keys, 2)  # the writer itself and boot
        assert all(boot.dht.records.get(k) for k in keys)


async def test_a_limited_writer_cuts_its_stores_into_requests_that_take_turns_with_bulk() -> None:
    """Under an upload limit a request of at most ``URGENT_MAX_BYTES`` takes turns with the
    bulk reply pieces going out, and a larger one queues behind them: a limited
    volunteer's store of 25 records or more (one ~50 KB request) waited out the DHT's
    deadline behind its own replies. Its stores are cut to fit the urgent class now."""
    async with AsyncExitStack() as stack:
        boot = await stack.enter_async_context(open_peer(local_config(dht=DHT)))
        limited = local_config(bootstrap=boot.multiaddrs, dht=DHT, limits={"upload_mbit": 50})
        writer = await stack.enter_async_context(open_peer(limited))
        await in_touch([boot, writer])
        keys = [f"ffn.{i}.{j}" for i in range(6) for j in range(10)]
        records = [
            sign_record(writer.identity, writer.peer_id, key=k, addrs=writer.addrs, ttl_s=120)
            for k in keys
        ]
        assert sum(len(r.model_dump_json()) for r in records) > 2 * URGENT_MAX_BYTES
        writes: list[tuple[int, bool]] = []
        consume = writer.throttle.up.consume

        async def counted(n: int, *, urgent: bool = False, party: object = None) -> None:
            writes.append((n, urgent))
            await consume(n, urgent=urgent, party=party)

        writer.throttle.up.consume = counted  # type: ignore[method-assign]
        stored = await writer.dht.put(records)
        assert stored.acks == dict.fromkeys(keys, 2)  # the writer itself and boot
        assert all(boot.dht.records.get(k) for k in keys)
        urgent = [n for n, u in writes if u]
        assert len(urgent) >= 3, writes  # the store went as several requests
        assert max(urgent) <= URGENT_MAX_BYTES, writes  # each within the urgent class
