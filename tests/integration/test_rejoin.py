"""A node that lost the swarm joins it again through its bootstrap peers, by itself.

Probed from outside (2026-12-05): after a bootstrap node restarted, or a volunteer's
network went away for minutes, nodes never dialled their bootstrap peers again;
newcomers joining through the bootstrap node found none of their experts until a human
restarted them. Probed again (2026-12-07, network namespaces): after the router gave a
volunteer a new address, its connections from the old one stayed open, answering
nothing, and it counted itself joined for 11 minutes and more.
"""

from __future__ import annotations

from collections.abc import AsyncIterator, Callable
from contextlib import asynccontextmanager
from pathlib import Path
from typing import TYPE_CHECKING

import pytest
import trio
from libp2p.peer.peerinfo import PeerInfo

import volunteerd.net.node as node_module
from volunteerd.config import Config
from volunteerd.identity import Identity
from volunteerd.net import Announcer, Node, PeerAddress, Verb, open_node, reachability
from volunteerd.net.dialback import DialBackRequest
from volunteerd.testing import local_config, open_daemon, open_peer
from volunteerd.testing.ports import fixed_port

if TYPE_CHECKING:
    from trio_typing import TaskStatus

pytestmark = pytest.mark.slow


async def _until(check: Callable[[], bool], within_s: float = 30) -> None:
    with trio.fail_after(within_s):
        while not check():  # noqa: ASYNC110 - polling the nodes' state
            await trio.sleep(0.1)


def _knows(a: Node, b: Node) -> bool:
    return b.peer_id in a.connected_peers() and a.dht.knows(b.peer_id)


class _Stop:
    """Asks a peer run by ``_run_peer`` to stop, and waits until it has (its port free)."""

    def __init__(self) -> None:
        self.asked = trio.Event()
        self.done = trio.Event()

    async def __call__(self) -> None:
        self.asked.set()
        await self.done.wait()


async def _run_peer(
    config: Config,
    identity: Identity,
    stop: _Stop,
    relay: bool = False,
    *,
    task_status: TaskStatus[Node] = trio.TASK_STATUS_IGNORED,
) -> None:
    try:
        async with open_node(identity, config, relay=relay) as peer:
            task_status.started(peer)
            await stop.asked.wait()
    finally:
        stop.done.set()


@asynccontextmanager
async def _bootstrap_node(
    *, relay: bool = False
) -> AsyncIterator[tuple[Node, _Stop, Config, Identity]]:
    """A bootstrap node at a fixed port (a relay too with ``relay``), to stop with
    ``await stop()`` and start again with the same config and identity."""
    identity = Identity.generate()
    config = local_config(network={"listen_host": "127.0.0.1", "port": fixed_port()})
    async with trio.open_nursery() as nursery:
        stop = _Stop()
        boot: Node = await nursery.start(_run_peer, config, identity, stop, relay)
        yield boot, stop, config, identity
        await stop()


async def test_a_node_joins_again_through_a_bootstrap_node_that_restarted(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    # a and b stay connected to each other, and still list the bootstrap node in their
    # routing tables: they join through it again on the periodic turn
    monkeypatch.setattr(node_module, "REJOIN_CHECK_S", 0.5)
    monkeypatch.setattr(node_module, "REJOIN_EVERY_S", 3.0)
    async with _bootstrap_node() as (boot, stop, boot_config, boot_identity):
        address = boot.multiaddrs
        async with (
            open_peer(local_config(bootstrap=address)) as a,
            open_peer(local_config(bootstrap=address)) as b,
        ):
            await _until(lambda: _knows(boot, a) and _knows(boot, b))
            await stop()  # the bootstrap node goes away ...
            await _until(lambda: boot.peer_id not in a.connected_peers())

            # ... and comes back with its identity and port, and an empty routing table
            async with open_peer(boot_config, boot_identity) as again:
                await _until(lambda: _knows(again, a) and _knows(again, b))
                # a newcomer joining through it now finds the others
                async with open_peer(local_config(bootstrap=again.multiaddrs)) as newcomer:
                    await _until(lambda: newcomer.dht.knows(a.peer_id))


@asynccontextmanager
async def _bootstrap_gone() -> AsyncIterator[tuple[Node, Config, Identity]]:
    """A node joined through a bootstrap node that has stopped since, and left with no
    connection; gives the node and what restarts the bootstrap node as it was."""
    async with (
        _bootstrap_node() as (boot, stop, boot_config, boot_identity),
        open_peer(local_config(bootstrap=boot.multiaddrs)) as a,
    ):
        await _until(lambda: _knows(boot, a))
        await stop()
        await _until(lambda: not a.connected_peers())
        yield a, boot_config, boot_identity


async def test_a_node_left_with_no_connection_joins_again_once_the_bootstrap_answers(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    # A network gone for minutes (or a laptop's sleep) leaves a node with no connection;
    # it keeps trying, waiting twice as long each time, and is back once one answers.
    monkeypatch.setattr(node_module, "REJOIN_CHECK_S", 0.2)
    async with _bootstrap_gone() as (a, boot_config, boot_identity):
        await trio.sleep(3)  # several tries that find nobody
        assert not a.connected_peers()
        async with open_peer(boot_config, boot_identity) as again:
            await _until(lambda: _knows(again, a) and _knows(a, again))


async def test_a_node_connected_again_to_a_restarted_bootstrap_node_joins_through_it(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    # A relayed node reserves again on its restarted relay (a bootstrap node) before it
    # notices it lost the swarm: connected, but in neither routing table. Counting that
    # connection as joined, it announced to nobody and newcomers found none of its
    # experts (an outside probe, 2026-12-07: 0 of 5 calls, 46 s after the restart).
    monkeypatch.setattr(node_module, "REJOIN_CHECK_S", 0.5)
    monkeypatch.setattr(node_module, "REJOIN_EVERY_S", 3600.0)
    async with (
        _bootstrap_gone() as (a, boot_config, boot_identity),
        open_peer(boot_config, boot_identity) as again,
    ):
        await a.host.connect(PeerInfo(again.host.get_id(), again.host.get_addrs()))
        await _until(lambda: _knows(again, a) and _knows(a, again))


async def test_a_relayed_daemon_is_found_at_its_circuit_soon_after_its_only_relay_restarts(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    # Its relay is its one bootstrap peer. The daemon reserves on it again, which
    # connects it; it then joins the swarm through it again, and its stores go to it at
    # once, not a minute later (a peer that failed is asked nothing for 60 s). Before, a
    # newcomer found none of its experts 46 s after the relay was back (an outside probe).
    monkeypatch.setattr(reachability, "_WATCH_RELAY_S", 0.5)
    monkeypatch.setattr(node_module, "REJOIN_CHECK_S", 0.5)
    async with _bootstrap_node(relay=True) as (boot, stop, boot_config, boot_identity):
        config = local_config(
            bootstrap=boot.multiaddrs,
            uids="ffn.0.[0:2]",
            reachability={"mode": "relay", "listen": False},
        )
        async with open_daemon(config, tmp_path / "hidden") as hidden:
            await stop()
            await trio.sleep(2)  # its stores and its reservation fail meanwhile
            async with (
                open_node(boot_identity, boot_config, relay=True) as again,
                open_peer(local_config(bootstrap=again.multiaddrs)) as newcomer,
            ):
                circuit = f"{again.addrs[0]}/p2p/{again.peer_id}/p2p-circuit"
                wanted = [PeerAddress(hidden.node.peer_id, (circuit,))]
                with trio.fail_after(25):
                    while await newcomer.dht.find_expert("ffn.0.0") != wanted:  # noqa: ASYNC110
                        await trio.sleep(0.5)


async def test_a_node_whose_addresses_changed_joins_again_at_once(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    # A laptop back on a network after a time without waited out its doubled wait
    # between tries (up to 5 minutes) before joining again. Its addresses are watched:
    # a change ends the wait. (The addresses the machine reports are stood in for.)
    monkeypatch.setattr(node_module, "REJOIN_CHECK_S", 20.0)  # the first try after 16-24 s
    monkeypatch.setattr(node_module, "_WATCH_ADDRS_S", 0.1, raising=False)
    async with _bootstrap_node() as (boot, stop, boot_config, boot_identity):
        address = boot.multiaddrs
        await stop()  # no network: nobody answers
        async with open_peer(local_config(bootstrap=address)) as a:
            assert not a.connected_peers()
            async with open_peer(boot_config, boot_identity) as again:
                ours, real = a.host.get_id(), node_module.transport_addrs
                monkeypatch.setattr(
                    node_module,
                    "transport_addrs",
                    lambda host: ["/ip4/127.0.0.2/tcp/1"] if host.get_id() == ours else real(host),
                )
                await _until(lambda: _knows(a, again), within_s=10)


async def test_announcements_that_reach_no_other_peer_are_told_once(
    caplog: pytest.LogCaptureFixture,
) -> None:
    # "announcement reached no peer" could never be logged: the count includes the
    # node itself, and a node cut off from everyone said nothing.
    config = local_config()
    async with open_peer(config) as alone:
        announcer = Announcer(
            alone.dht, alone.identity, alone.peer_id, alone.addrs, config.dht, config.timeouts
        )
        announcer.set_uids(["ffn.0.0"])
        for _ in range(2):
            await announcer.announce_now()
        assert announcer.unheard
        told = [r for r in caplog.records if "reach no other peer" in r.getMessage()]
        assert len(told) == 1
        assert told[0].levelname == "WARNING"
        async with open_peer(local_config(bootstrap=alone.multiaddrs)) as other:
            # In its routing table, not merely connected: a store goes only to peers
            # that answered a lookup or asked a Kademlia question, and the connection
            # shows before the other's first question (or before identify lets it in).
            await _until(lambda: _knows(alone, other))
            await announcer.announce_now()
            assert not announcer.unheard
            assert any("reach other peers again" in r.getMessage() for r in caplog.records)


class _FreezableProxy:
    """A TCP relay on 127.0.0.1 to ``port``. ``freeze()`` makes the connections open at
    that moment pass nothing either way while their sockets stay open (a peer whose
    address vanished, a NAT that forgot the mapping); later connections pass."""

    def __init__(self, port: int) -> None:
        self._port = port
        self._frozen: list[trio.Event] = []
        self.port = 0

    def freeze(self) -> None:
        for event in self._frozen:
            event.set()

    async def serve(self, *, task_status: TaskStatus[None] = trio.TASK_STATUS_IGNORED) -> None:
        listeners = await trio.open_tcp_listeners(0, host="127.0.0.1")
        self.port = listeners[0].socket.getsockname()[1]
        task_status.started()
        await trio.serve_listeners(self._relay, listeners)

    async def _relay(self, client: trio.SocketStream) -> None:
        frozen = trio.Event()
        self._frozen.append(frozen)

        async def pump(source: trio.SocketStream, sink: trio.SocketStream) -> None:
            while data := await source.receive_some():
                if frozen.is_set():
                    await trio.sleep_forever()
                await sink.send_all(data)

        server = await trio.open_tcp_stream("127.0.0.1", self._port)
        async with client, server, trio.open_nursery() as nursery:
            nursery.start_soon(pump, client, server)
            nursery.start_soon(pump, server, client)


async def test_a_bootstrap_connection_that_stopped_answering_is_closed_and_joined_again(
    monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    # The node's connection to its bootstrap peer stays open but answers nothing (after
    # a new address from the router, its other end is gone): its announcement goes
    # unanswered under the DHT's deadline. The node pings the connection, closes it when
    # no pong comes, joins again at once on a fresh connection, and its next
    # announcement reaches the bootstrap peer.
    monkeypatch.setattr(node_module, "REJOIN_CHECK_S", 0.2)
    async with open_peer(local_config()) as boot, trio.open_nursery() as proxies:
        proxy = _FreezableProxy(int(boot.addrs[0].rsplit("/", 1)[1]))
        await proxies.start(proxy.serve)
        through = f"/ip4/127.0.0.1/tcp/{proxy.port}/p2p/{boot.peer_id}"
        config = local_config(bootstrap=[through])
        async with open_peer(config) as a:
            await _until(lambda: _knows(boot, a) and _knows(a, boot))
            announcer = Announcer(
                a.dht, a.identity, a.peer_id, a.addrs, config.dht, config.timeouts
            )
            announcer.set_uids(["ffn.0.0"])
            proxy.freeze()
            await announcer.announce_now()
            assert announcer.unheard
            await _until(lambda: a.rpc.hung_up >= 1, within_s=20)
            # Waited for, not asserted at once: ``hung_up`` counts as the close begins,
            # and the old connection (until it is closed) or the join's fresh one (before
            # the join's lookups end and it is logged) already reads as "knows the
            # bootstrap peer": a race lost beside a busy process in CI.
            await _until(
                lambda: any("joined the swarm again" in r.getMessage() for r in caplog.records),
                within_s=20,
            )
            await _until(lambda: _knows(a, boot))
            with trio.fail_after(10):  # the connection it has now answers
                await a.rpc.call(
                    PeerAddress(boot.peer_id, ()), Verb.DIALBACK, DialBackRequest(addrs=a.addrs)
                )
            await announcer.announce_now()
            assert not announcer.unheard
            proxies.cancel_scope.cancel()
