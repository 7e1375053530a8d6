"""Reachability over real libp2p on 127.0.0.1: peers dial a node back to judge whether
it is directly reachable, and a node nobody can dial serves through a circuit relay."""

from __future__ import annotations

import copy
import logging
import socket
import time
from pathlib import Path

import pytest
import torch
import trio
from libp2p.abc import INetConn, INetStream, INetwork, INotifee
from libp2p.peer.id import ID
from libp2p.peer.peerinfo import PeerInfo
from libp2p.relay.circuit_v2 import transport as circuit_transport
from libp2p.relay.circuit_v2.pb.circuit_pb2 import PeerId as CircuitPeerId
from libp2p.relay.circuit_v2.pb.circuit_pb2 import StopMessage
from libp2p.relay.circuit_v2.protocol import STOP_PROTOCOL_ID
from libp2p.relay.circuit_v2.utils import read_delimited_msg, write_delimited_msg
from multiaddr import Multiaddr

from volunteerd.awake import awake_time
from volunteerd.errors import PeerError, RemoteError
from volunteerd.identity import Identity
from volunteerd.moe import RemoteExpert
from volunteerd.net import Node, PeerAddress, Verb, open_node, reachability
from volunteerd.net import dht as dht_module
from volunteerd.net.background import BackgroundNode
from volunteerd.net.dialback import DialBackReply, DialBackRequest
from volunteerd.net.peers import peer_id_for
from volunteerd.net.reachability import UpgradeStats
from volunteerd.net.rpc import Reply, Request
from volunteerd.net.swarm_clock import SwarmClock
from volunteerd.testing import Restartable, local_config, open_daemon, open_peer
from volunteerd.wire import TensorMeta
from volunteerd.wire.messages import ForwardRequest, TensorReply

# Real libp2p nodes on loopback, in wall-clock time: a swarm, or a node and its clients.
pytestmark = pytest.mark.slow

UID = "ffn.0.1"


def closed_port() -> int:
    """A loopback port nothing listens on (bound, then released)."""
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        port: int = probe.getsockname()[1]
    return port


async def test_loopback_node_is_judged_direct() -> None:
    async with (
        open_peer(local_config()) as boot,
        open_peer(local_config(bootstrap=boot.multiaddrs)) as node,
    ):
        assert node.reachability is not None
        report = node.reachability.report()
        assert report.mode == "direct"
        assert report.direct_addrs == tuple(node.addrs)
        assert report.announce_addrs == tuple(node.addrs)
        assert "nothing to do" in report.advice
        assert report.observed_ips == ("127.0.0.1",)
        assert report.upgrades == UpgradeStats(
            upgraded=0, failed=0, last_upgrade_at=None, last_upgrade_peer=None
        )


async def test_undialable_node_is_not_direct_and_is_told_which_port_to_forward() -> None:
    dead = closed_port()
    async with open_peer(local_config()) as boot:
        config = local_config(
            bootstrap=boot.multiaddrs,
            network={"announce_addrs": [f"/ip4/127.0.0.1/tcp/{dead}"]},
        )
        async with open_peer(config) as node:
            assert node.reachability is not None
            report = node.reachability.report()
            # The bootstrap peer is no relay, so no reservation: unreachable.
            assert report.mode == "unreachable"
            assert report.direct_addrs == ()
            listening = node.host.get_transport_addrs()[0].value_for_protocol("tcp")
            assert f"forward TCP port {listening}" in report.advice
            assert "network.announce_addrs" in report.advice


async def test_undialable_node_falls_back_to_its_bootstrap_relay() -> None:
    dead = closed_port()
    async with open_node(Identity.generate(), local_config(), relay=True) as boot:
        config = local_config(
            bootstrap=boot.multiaddrs,
            network={"announce_addrs": [f"/ip4/127.0.0.1/tcp/{dead}"]},
        )
        async with open_peer(config) as node:
            assert node.reachability is not None
            assert node.reachability.mode == "relayed"
            assert node.addrs == [f"{boot.addrs[0]}/p2p/{boot.peer_id}/p2p-circuit"]
            assert "forward TCP port" in node.reachability.report().advice


async def test_dialback_refuses_another_peers_addresses_and_dials_only_the_observed_ip() -> None:
    async with open_peer(local_config()) as a, open_peer(local_config()) as b:
        other = str(peer_id_for(Identity.generate()))
        with pytest.raises(RemoteError) as refused:
            await a.rpc.call(
                b.address,
                Verb.DIALBACK,
                DialBackRequest(addrs=[f"{a.addrs[0]}/p2p/{other}"]),
            )
        assert refused.value.code == "rejected"
        # Another IP than the one the request came from is dialled at the observed IP
        # (here loopback), same port: nothing answers on a closed port.
        dead = closed_port()
        reply, _ = await a.rpc.call(
            b.address, Verb.DIALBACK, DialBackRequest(addrs=[f"/ip4/10.9.8.7/tcp/{dead}"])
        )
        assert reply == DialBackReply(reachable=None, dialled=1, observed="127.0.0.1")
        # Its own address, with or without its own /p2p/ suffix, is dialled.
        reply, _ = await a.rpc.call(
            b.address,
            Verb.DIALBACK,
            DialBackRequest(addrs=[f"{a.addrs[0]}/p2p/{a.peer_id}"]),
        )
        assert reply == DialBackReply(reachable=a.addrs[0], dialled=1, observed="127.0.0.1")
        # A port int() takes and multiaddr does not: refused as such, not an "internal"
        # error with a traceback in the dialling peer's log (its reply failed its pattern)
        head, port = a.addrs[0].rsplit("/", 1)
        arabic = "".join(chr(0x660 + int(d)) for d in port)
        for odd in [f"{head}/ {port}", f"{head}/{arabic}"]:
            with pytest.raises(RemoteError) as refused:
                await a.rpc.call(b.address, Verb.DIALBACK, DialBackRequest(addrs=[odd]))
            assert refused.value.code == "rejected"


class _ConnectionsOf(INotifee):
    """Counts a network's connections to and from one peer as they open and close."""

    def __init__(self, peer_id: str) -> None:
        self.peer_id = peer_id
        self.opened = 0
        self.closed = 0
        self.changed = trio.Event()

    def _count(self, conn: INetConn, attr: str) -> None:
        if str(conn.muxed_conn.peer_id) == self.peer_id:
            setattr(self, attr, getattr(self, attr) + 1)
            self.changed.set()
            self.changed = trio.Event()

    async def connected(self, network: INetwork, conn: INetConn) -> None:
        self._count(conn, "opened")

    async def disconnected(self, network: INetwork, conn: INetConn) -> None:
        self._count(conn, "closed")

    async def opened_stream(self, network: INetwork, stream: INetStream) -> None:
        pass

    async def closed_stream(self, network: INetwork, stream: INetStream) -> None:
        pass

    async def listen(self, network: INetwork, multiaddr: Multiaddr) -> None:
        pass

    async def listen_close(self, network: INetwork, multiaddr: Multiaddr) -> None:
        pass


async def test_dialback_probe_is_a_whole_connection_closed_cleanly() -> None:
    """The peer dialling back finishes the upgrade (Noise and the muxer) before it
    hangs up: the requester sees a connection open and close, and py-libp2p logs no
    failed upgrade there (a probe closed right after Noise logged an ERROR on every
    probe)."""
    errors: list[logging.LogRecord] = []
    catch = logging.Handler(logging.ERROR)
    catch.emit = errors.append  # type: ignore[method-assign]
    libp2p_logger = logging.getLogger("libp2p")
    libp2p_logger.addHandler(catch)
    try:
        async with open_peer(local_config()) as a, open_peer(local_config()) as b:
            nowhere = DialBackRequest(addrs=[f"/ip4/127.0.0.1/tcp/{closed_port()}"])
            await a.rpc.call(b.address, Verb.DIALBACK, nowhere)  # connected now
            probes = _ConnectionsOf(b.peer_id)
            a.host.get_network().register_notifee(probes)
            reply, _ = await a.rpc.call(b.address, Verb.DIALBACK, DialBackRequest(addrs=a.addrs))
            assert reply.reachable == a.addrs[0]
            with trio.fail_after(10):
                while probes.closed < 1:
                    await probes.changed.wait()
            assert probes.opened == 1
            # The connection the request came over is still there.
            reply, _ = await a.rpc.call(b.address, Verb.DIALBACK, nowhere)
            assert reply.observed == "127.0.0.1"
    finally:
        libp2p_logger.removeHandler(catch)
    # (A dial to the closed port is logged as an error by py-libp2p's TCP transport.)
    assert [r.getMessage() for r in errors if "upgrade" in r.getMessage()] == []


async def test_relay_only_daemon_serves_a_trainer_through_the_relay(tmp_path: Path) -> None:
    """The daemon listens on no address at all: the trainer finds its experts in the
    DHT under a circuit address and trains through the bootstrap node's relay."""
    async with open_node(Identity.generate(), local_config(), relay=True) as boot:
        circuit = f"{boot.addrs[0]}/p2p/{boot.peer_id}/p2p-circuit"
        server_config = local_config(
            bootstrap=boot.multiaddrs,
            uids="ffn.0.[0:2]",
            experts={"hidden_dim": 32, "optimizer": {"name": "sgd", "lr": 0.05}},
            reachability={"mode": "relay", "listen": False},
        )
        async with open_daemon(server_config, tmp_path / "server") as server:
            assert server.node.host.get_transport_addrs() == []  # listens on nothing
            assert server.node.reachability is not None
            assert server.node.reachability.mode == "relayed"
            assert server.node.addrs == [circuit]
            served = server.runtime.backend(UID).module
            before = copy.deepcopy(served)
            client_config = local_config(bootstrap=boot.multiaddrs)

            def train_step() -> list[str]:
                with BackgroundNode(Identity.generate(), client_config) as client:
                    peers = client.run(client.node.dht.find_expert, UID)
                    assert peers == [PeerAddress(server.node.peer_id, (circuit,))]
                    expert = RemoteExpert(UID, peers[0], client)

                    x = torch.randn(16, 32, requires_grad=True)
                    y = expert(x)
                    x_local = x.detach().clone().requires_grad_()
                    y_local = copy.deepcopy(before)(x_local)
                    torch.testing.assert_close(y, y_local, atol=1e-5, rtol=0)
                    grad = torch.randn_like(y)
                    y.backward(grad)
                    y_local.backward(grad)
                    assert x.grad is not None
                    assert x_local.grad is not None
                    torch.testing.assert_close(x.grad, x_local.grad, atol=1e-5, rtol=0)

                    async def connection_addrs() -> list[str]:
                        network = client.node.host.get_network()
                        conns = network.connections.get(ID.from_base58(server.node.peer_id))
                        return [str(a) for c in conns or [] for a in c.get_transport_addresses()]

                    return client.run(connection_addrs)

            addrs = await trio.to_thread.run_sync(train_step)
            # Through the relay; the daemon may since have dialled the trainer directly
            # (DCUtR: a relay-only node can still dial out), which leaves the relayed
            # connection open for a minute.
            assert any("/p2p-circuit" in a for a in addrs)
            await server.runtime.settled()
            assert server.runtime.backend(UID).updates == 1


async def test_dialback_fails_when_another_peer_answers_at_the_address() -> None:
    """The Noise handshake proves the key: an address where a different peer listens
    does not count as reaching the requester."""
    async with (
        open_peer(local_config()) as a,
        open_peer(local_config()) as b,
        open_peer(local_config()) as c,
    ):
        reply, _ = await a.rpc.call(b.address, Verb.DIALBACK, DialBackRequest(addrs=c.addrs))
        assert reply == DialBackReply(reachable=None, dialled=1, observed="127.0.0.1")


async def test_relayed_node_reserves_again_after_losing_its_relay_connection(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.setattr(reachability, "_WATCH_RELAY_S", 0.2)
    async with open_node(Identity.generate(), local_config(), relay=True) as boot:
        config = local_config(
            bootstrap=boot.multiaddrs, reachability={"mode": "relay", "listen": False}
        )
        async with open_peer(config) as hidden:
            await boot.host.get_network().close_peer(ID.from_base58(hidden.peer_id))
            # The swarm has no event for "connected"; poll until the node dialled back in.
            with trio.fail_after(10):
                while not boot.host.get_network().connections.get(ID.from_base58(hidden.peer_id)):  # noqa: ASYNC110
                    await trio.sleep(0.05)
            async with open_peer(local_config(bootstrap=boot.multiaddrs)) as client:
                with trio.fail_after(10):
                    reply, _ = await client.rpc.call(
                        hidden.address, Verb.DIALBACK, DialBackRequest(addrs=client.addrs)
                    )
                # Through the relay the requester's IP is not observed: nothing dialled.
                assert reply == DialBackReply(reachable=None, dialled=0)


async def test_a_relayed_node_reserves_again_soon_after_its_only_relay_restarts(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """The relay goes down, so the node's try to reserve again fails and leaves it
    unreachable; when the relay is back on the same port and identity the node reserves
    again on its own, long before the next full check (ten minutes), and a peer reaches
    it through the relay. Before, it stayed unreachable until that check (and py-libp2p
    refused for a minute to dial a relay whose addresses had all failed once)."""
    monkeypatch.setattr(reachability, "_WATCH_RELAY_S", 0.5)
    async with trio.open_nursery() as nursery:
        restarts = Restartable(nursery, relay=True)
        boot = await restarts.start()
        config = local_config(
            bootstrap=boot.multiaddrs, reachability={"mode": "relay", "listen": False}
        )
        async with open_peer(config) as hidden:
            assert hidden.reachability is not None
            assert hidden.reachability.mode == "relayed"
            circuit = hidden.addrs
            restarts.stop()
            with trio.fail_after(20):
                while hidden.reachability.mode != "unreachable":  # noqa: ASYNC110
                    await trio.sleep(0.1)
            # Meanwhile it announces the circuit, not its own addresses (undialable
            # behind NAT: trainers that tried them banned it).
            assert hidden.addrs == circuit
            boot = await restarts.start()
            with trio.fail_after(25):
                while hidden.reachability.mode != "relayed":  # noqa: ASYNC110
                    await trio.sleep(0.1)
            assert hidden.addrs == circuit
            async with open_peer(local_config(bootstrap=boot.multiaddrs)) as client:
                with trio.fail_after(15):
                    reply, _ = await client.rpc.call(
                        PeerAddress(hidden.peer_id, tuple(circuit)),
                        Verb.DIALBACK,
                        DialBackRequest(addrs=client.addrs),
                    )
                assert reply == DialBackReply(reachable=None, dialled=0)
        restarts.stop()


async def test_a_relayed_node_reserves_again_when_it_reconnected_to_a_restarted_relay(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """The relay restarts and the node is connected to it again before its watch looks
    (its DHT dials its bootstrap peers again): the new connection carries no
    reservation, so the node reserves again and circuits through the relay reach it.
    Before, a connection to the relay counted as a reservation, and every circuit was
    refused until the next full check."""
    monkeypatch.setattr(reachability, "_WATCH_RELAY_S", 2.0)
    relay_identity = Identity.generate()
    relay_config = local_config(network={"listen_host": "127.0.0.1", "port": closed_port()})

    async def run_relay(
        stop: trio.Event, done: trio.Event, *, task_status: trio.TaskStatus[Node]
    ) -> None:
        async with open_node(relay_identity, relay_config, relay=True) as relay:
            task_status.started(relay)
            await stop.wait()
        done.set()

    async with trio.open_nursery() as nursery:
        stop, done = trio.Event(), trio.Event()
        boot = await nursery.start(run_relay, stop, done)
        config = local_config(
            bootstrap=boot.multiaddrs, reachability={"mode": "relay", "listen": False}
        )
        async with open_peer(config) as hidden:
            assert hidden.reachability is not None
            circuit = PeerAddress(hidden.peer_id, tuple(hidden.addrs))
            stop.set()
            await done.wait()
            stop, done = trio.Event(), trio.Event()
            boot = await nursery.start(run_relay, stop, done)
            await hidden.host.connect(PeerInfo(boot.host.get_id(), boot.host.get_addrs()))
            async with open_peer(local_config(bootstrap=boot.multiaddrs)) as client:
                with trio.fail_after(25):
                    while True:
                        try:
                            with trio.fail_after(5):
                                reply, _ = await client.rpc.call(
                                    circuit, Verb.DIALBACK, DialBackRequest(addrs=client.addrs)
                                )
                            break
                        except (PeerError, trio.TooSlowError):
                            await trio.sleep(0.5)
                assert reply == DialBackReply(reachable=None, dialled=0)
        stop.set()


class _SkewedTime:
    """The ``time`` module as a computer whose wall clock is ``off`` seconds wrong sees it."""

    def __init__(self, off: float) -> None:
        self.off = off

    def time(self) -> float:
        return time.time() + self.off

    def monotonic(self) -> float:
        return time.monotonic()


@pytest.mark.parametrize("off", [2 * 3600.0, -2 * 3600.0], ids=["ahead", "behind"])
async def test_a_relayed_node_whose_clock_is_hours_off_keeps_its_reservation(
    off: float, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    """A relay says when a reservation ends on its own wall clock. py-libp2p judged that on
    the node's clock: 2 h ahead, it dropped the reservation as soon as it was made and
    the node refused every circuit (an outside probe: 0 of 6 calls through the relay); 2
    h behind, it would renew an hour after the relay had dropped it. The node now keeps
    the reservation on the monotonic clock, and one whose end reads implausible is
    renewed within 10 minutes."""
    monkeypatch.setattr(reachability, "_WATCH_RELAY_S", 0.2)
    caplog.set_level(logging.INFO, logger=reachability.__name__)
    async with (
        open_node(Identity.generate(), local_config(), relay=True) as boot,
        open_peer(local_config(bootstrap=boot.multiaddrs)) as client,
    ):
        # only the relayed node's clock is off (py-libp2p's client side reads it too)
        skewed = _SkewedTime(off)
        monkeypatch.setattr(circuit_transport, "time", skewed)
        monkeypatch.setattr(dht_module, "SwarmClock", lambda: SwarmClock(wall=skewed.time))
        config = local_config(
            bootstrap=boot.multiaddrs, reachability={"mode": "relay", "listen": False}
        )
        async with open_peer(config) as hidden:
            assert hidden.reachability is not None
            assert hidden.reachability.mode == "relayed"
            for _ in range(3):
                await trio.sleep(0.5)  # the node's checks of its relay run meanwhile
                assert hidden.reachability.relaying.reserved_with(boot.host.get_id())
                # through the relay (later perhaps over the direct connection that
                # hole punching opens from there)
                with trio.fail_after(10):
                    await client.rpc.call(
                        hidden.address, Verb.DIALBACK, DialBackRequest(addrs=client.addrs)
                    )
    assert "renewed in 600 s" in caplog.text


async def test_a_relayed_node_that_slept_past_its_reservation_reserves_again_on_waking(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """A laptop closed for a night: the monotonic clock stood still, so a node that kept
    its reservation's end on it woke trusting an hour-long reservation the relay had
    dropped hours ago. Kept on the awake clock, the night counts and the node reserves
    again on waking (here the connection to the relay survived the night)."""
    monkeypatch.setattr(reachability, "_WATCH_RELAY_S", 0.2)
    async with open_node(Identity.generate(), local_config(), relay=True) as boot:
        config = local_config(
            bootstrap=boot.multiaddrs, reachability={"mode": "relay", "listen": False}
        )
        async with open_peer(config) as hidden:
            assert hidden.reachability is not None
            relaying = hidden.reachability.relaying
            relay_id = boot.host.get_id()
            assert relaying.reserved_with(relay_id)
            reserve = relaying.reserve
            reserved: list[float] = []

            async def counted(relay: PeerAddress) -> float:
                reserved.append(await reserve(relay))
                return reserved[-1]

            monkeypatch.setattr(relaying, "reserve", counted)
            await trio.sleep(1.0)
            assert reserved == []  # awake, the reservation stands until its renewal
            night = 8 * 3600.0
            monkeypatch.setattr(
                reachability, "awake_time", lambda: awake_time() + night, raising=False
            )
            assert not relaying.reserved_with(relay_id)
            with trio.fail_after(10):
                while not reserved:  # noqa: ASYNC110
                    await trio.sleep(0.05)
            assert relaying.reserved_with(relay_id)
            assert hidden.reachability.mode == "relayed"


async def _echo(request: Request) -> Reply:
    return Reply(
        TensorReply(tensors=[t.meta for t in request.tensors]), [t.data for t in request.tensors]
    )


def _conns(node: Node, peer_id: str) -> list[tuple[bool, int]]:
    """(relayed?, open streams) of each connection of ``node`` to ``peer_id``."""
    conns = node.host.get_network().connections.get(ID.from_base58(peer_id)) or []
    return [
        (any("/p2p-circuit" in str(a) for a in c.get_transport_addresses()), len(c.get_streams()))
        for c in conns
    ]


async def test_relayed_calls_arrive_whole_and_move_to_the_direct_connection_dcutr_opens() -> None:
    """A relayed connection is Noise and Yamux inside a stream of the relay's connections,
    written in pieces that fit one frame of them: several MiB cross intact both ways.
    The server announces only its circuit address but listens on loopback, so DCUtR
    (its first step, a plain dial of the known direct address) upgrades the connection;
    the next call leaves by the direct connection, not by a pooled relayed stream."""
    async with open_node(Identity.generate(), local_config(), relay=True) as boot:
        config = local_config(bootstrap=boot.multiaddrs, reachability={"mode": "relay"})
        async with (
            open_node(Identity.generate(), config, {Verb.FORWARD: _echo}) as server,
            open_peer(local_config()) as client,
        ):
            assert server.reachability is not None
            assert client.reachability is not None
            assert server.reachability.mode == "relayed"
            relayed = PeerAddress(server.peer_id, tuple(server.addrs))
            payload = torch.randn(3 * 2**18).numpy().tobytes()  # 3 MiB of float32
            request = ForwardRequest(
                uid="ffn.0.0", tensors=[TensorMeta(dtype="float32", shape=(3 * 2**18,))]
            )
            with trio.fail_after(60):
                _, tensors = await client.rpc.call(relayed, Verb.FORWARD, request, [payload])
            assert bytes(tensors[0].data) == payload
            assert (True, 1) in _conns(client, server.peer_id)  # its pooled stream

            server_reach, client_reach = server.reachability, client.reachability

            def upgrades() -> int:
                return (
                    server_reach.report().upgrades.upgraded
                    + client_reach.report().upgrades.upgraded
                )

            # DCUtR looks for relayed connections every 2 s; nothing to signal on.
            with trio.fail_after(60):
                while not upgrades():  # noqa: ASYNC110
                    await trio.sleep(0.1)
            # The client hears of the new connection from the swarm, on its own time:
            # calls move to it as soon as it has (each still arriving whole).
            with trio.fail_after(60):
                while not any(not circuit and n for circuit, n in _conns(client, server.peer_id)):
                    _, tensors = await client.rpc.call(relayed, Verb.FORWARD, request, [payload])
                    assert bytes(tensors[0].data) == payload


async def test_a_circuit_is_accepted_only_from_a_relay_the_node_reserved_with() -> None:
    """py-libp2p accepts a STOP from any peer and upgrades a new connection over it: one
    peer connected directly could open a "relayed" connection per made-up identity over
    its one TCP connection, none counted against its address. Now a STOP from a peer
    the node holds no reservation with is reset before anything is read; the node's
    own relay still brings circuits (the tests above)."""
    async with open_peer(local_config()) as node, open_peer(local_config()) as stranger:
        await stranger.rpc.connect(node.address)
        stream = await stranger.host.new_stream(node.host.get_id(), [STOP_PROTOCOL_ID])
        made_up = peer_id_for(Identity.generate())
        stop = StopMessage(type=StopMessage.CONNECT, peer=CircuitPeerId(id=made_up.to_bytes()))
        answer = None
        with trio.fail_after(10):
            try:  # the reset may come before the write or after it
                await write_delimited_msg(stream, stop)
                answer = await read_delimited_msg(stream, StopMessage)
            except Exception:  # reset: refused before anything was read
                pass
        assert answer is None, f"the node answered the circuit: {answer}"
        assert node.reachability is not None
        assert node.reachability.relaying.refused_circuits == 1
        assert str(made_up) not in node.connected_peers()


async def test_streams_flooding_from_the_nodes_own_relay_are_refused_without_cutting_it() -> None:
    """A stranger opening streams faster than they are served loses its connection
    (tests/integration/test_paced_services.py); the node's own relay, which anyone can
    make open STOP streams to the node, keeps its connection, or every circuit to the
    node would go with it: its excess streams are only reset."""
    limits = {"streams_per_s": 20, "stream_burst": 50}
    async with open_node(Identity.generate(), local_config(), relay=True) as boot:
        config = local_config(
            bootstrap=boot.multiaddrs, reachability={"mode": "relay"}, peer_limits=limits
        )
        async with open_peer(config) as node:
            assert node.reachability is not None
            assert node.reachability.relaying.reserved_with(boot.host.get_id())
            connection = boot.host.get_network().connections[node.host.get_id()][0]
            assert node.negotiations is not None
            with trio.fail_after(30):
                while node.negotiations.refused < 20:
                    stream = await connection.muxed_conn.open_stream()
                    await stream.reset()
            await trio.sleep(0.5)  # a close, were there one, has happened by now
            assert not connection.muxed_conn.is_closed
            assert node.addrs == [f"{boot.addrs[0]}/p2p/{boot.peer_id}/p2p-circuit"]


async def test_a_lone_peers_word_puts_no_stranger_address_in_the_nodes_records() -> None:
    """A peer answering dial-back names the address it reached the node at, and the
    IP it saw. Taken on its word, a stranger's address went first into the node's
    signed records (and any text into its status): now one at another IP than the
    node's own needs a second peer's agreement, and one no rule could produce (another
    port, not an address) is ignored."""
    lies = ["/ip4/6.6.6.6/tcp/PORT"]  # from the first check, at the start

    async def lying(request: Request) -> Reply:
        port = request.header.addrs[0].rsplit("/", 1)[-1]
        lie = lies[0].replace("PORT", port)
        return Reply(DialBackReply(reachable=lie, dialled=1, observed="6.6.6.6"), [])

    async with (
        open_peer(local_config()) as boot,
        open_node(Identity.generate(), local_config(), {Verb.DIALBACK: lying}) as liar,
        open_peer(local_config(bootstrap=[*boot.multiaddrs, *liar.multiaddrs])) as node,
    ):
        reach = node.reachability
        assert reach is not None
        for lie in ("/ip4/6.6.6.6/tcp/PORT", "/ip4/6.6.6.6/tcp/1", "/dns4/evil.example/tcp/1"):
            lies[:] = [lie]
            with trio.fail_after(60):
                while len(node.host.get_network().connections) < 2:  # noqa: ASYNC110 - polling
                    await trio.sleep(0.1)
                assert await reach.check() == "direct"  # the honest peer reached it
            report = reach.report()
            assert report.direct_addrs == tuple(node.addrs), lie
            assert report.announce_addrs == tuple(node.addrs), lie
            assert not any("6.6.6.6" in a or "evil" in a for a in report.announce_addrs)


async def _addresses_become(monkeypatch: pytest.MonkeyPatch, node: Node, addrs: list[str]) -> None:
    """From now on the machine gives ``node`` the addresses ``addrs`` (stood in for:
    test traffic stays on 127.0.0.1); returns once its reachability checked again."""
    assert node.reachability is not None
    before = node.reachability.report()
    await trio.sleep(0.5)  # the watch has read the addresses it starts from
    ours = node.host.get_id()
    real = reachability.transport_addrs
    monkeypatch.setattr(
        reachability,
        "transport_addrs",
        lambda host: addrs if host.get_id() == ours else real(host),
    )
    with trio.fail_after(30):
        while node.reachability.report().checked_at == before.checked_at:  # noqa: ASYNC110
            await trio.sleep(0.1)


async def test_a_node_whose_address_changes_stops_announcing_the_old_one_at_once(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """Moved to another network (a laptop, a new DHCP lease), a node kept its dialled-
    back address first in its records until the next check, ten minutes later, and
    trainers that dialled it failed and banned it (an outside probe re-addressed a
    daemon's veth). Its own addresses are watched: the old one is dropped at once and
    reachability checked again. (The addresses the machine reports are stood in for:
    test traffic stays on 127.0.0.1.)"""
    monkeypatch.setattr(reachability, "_WATCH_ADDRS_S", 0.2, raising=False)
    async with (
        open_peer(local_config()) as boot,
        open_peer(local_config(bootstrap=boot.multiaddrs)) as node,
    ):
        assert node.reachability is not None
        old = node.addrs[0]
        assert node.reachability.report().announce_addrs[0] == old
        port = old.rsplit("/", 1)[1]
        moved = f"/ip4/127.0.0.2/tcp/{port}"  # the new network's address
        await _addresses_become(monkeypatch, node, [moved])
        after = node.reachability.report()
        assert old not in after.direct_addrs
        assert old not in after.announce_addrs
        assert node.addrs == [moved]


async def test_the_announcer_is_told_an_address_the_computer_gained(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """A daemon started offline (only 127.0.0.1) kept 127.0.0.1 in its DHT records for
    as long as it ran after the network came up, though ``status`` showed the new
    address (an outside probe, with network namespaces): the watchers were told only of
    a change between two reads of the live address list, and both reads already held
    the new address. They are told whenever the list differs from what they were told.
    (The addresses the machine reports are stood in for: test traffic stays on
    127.0.0.1.)"""
    monkeypatch.setattr(reachability, "_WATCH_ADDRS_S", 0.2, raising=False)
    async with (
        open_peer(local_config()) as boot,
        open_peer(local_config(bootstrap=boot.multiaddrs)) as node,
    ):
        assert node.reachability is not None
        told: list[list[str]] = []
        node.reachability.watch_addrs(told.append)  # as the daemon's announcer does
        old = node.addrs[0]
        gained = f"/ip4/127.0.0.2/tcp/{old.rsplit('/', 1)[1]}"  # a new network's address
        await _addresses_become(monkeypatch, node, [old, gained])
        assert told
        assert told[-1] == node.addrs
        assert gained in told[-1]


async def test_a_node_that_no_peer_could_judge_checks_again_soon(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """A daemon started offline (no peer to ask) said "unknown" for ten minutes, the
    full check period, though peers connected right after (an outside probe with
    network namespaces); the same after an address change whose re-check went out over
    dead connections. A check no peer answered is made again soon."""
    monkeypatch.setattr(reachability, "_UNKNOWN_RECHECK_S", 0.5, raising=False)
    async with open_peer(local_config()) as alone:
        assert alone.reachability is not None
        assert alone.reachability.report().mode == "unknown"  # nobody to ask
        async with open_peer(local_config(bootstrap=alone.multiaddrs)):
            with trio.fail_after(20):
                while alone.reachability.report().mode != "direct":  # noqa: ASYNC110
                    await trio.sleep(0.1)


@pytest.mark.parametrize("bootstrap", ["relay", "none"])
async def test_a_relay_listed_by_two_addresses_is_announced_and_dialled_at_the_one_that_works(
    bootstrap: str,
) -> None:
    """A relay listed by two addresses, one of them unreachable from the node (as an
    IPv4 address is from an IPv6-only network; here a closed port on 127.0.0.1 beside
    the relay's ::1). The node announces the circuit it reserved over first, and a fresh
    caller given the unreachable circuit first still gets through the other one. The
    node reserves whether it was connected to the relay already (its bootstrap peer) or
    dials it itself.

    Before, each listed address was a relay of its own: the node announced the circuit
    through the first listed (the unreachable one) only, and a caller that had tried a
    relay's dead address dialled that one again for its good circuit too (py-libp2p
    dials the first address its peer store holds)."""
    v6 = local_config(network={"listen_host": "::1", "port": 0, "bootstrap_peers": []})
    async with open_node(Identity.generate(), v6, relay=True) as relay:
        good = next(a for a in relay.multiaddrs if a.startswith("/ip6/::1/"))
        dead = f"/ip4/127.0.0.1/tcp/{closed_port()}/p2p/{relay.peer_id}"
        config = local_config(
            bootstrap=[good] if bootstrap == "relay" else [],
            reachability={"mode": "relay", "listen": False, "relays": [dead, good]},
        )
        async with open_peer(config) as hidden:
            good_circuit = f"{good}/p2p-circuit"
            dead_circuit = f"{dead}/p2p-circuit"
            assert hidden.addrs == [good_circuit, dead_circuit]
            for order in ([good_circuit, dead_circuit], [dead_circuit, good_circuit]):
                async with open_peer(local_config()) as caller:
                    with trio.fail_after(20):
                        reply, _ = await caller.rpc.call(
                            PeerAddress(hidden.peer_id, tuple(order)),
                            Verb.DIALBACK,
                            DialBackRequest(addrs=caller.addrs),
                        )
                    assert reply == DialBackReply(reachable=None, dialled=0)
