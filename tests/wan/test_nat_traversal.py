"""Volunteers behind the emulated NATs: found through the DHT, served through the
bootstrap node's relay, and upgraded to a direct connection where the NATs allow it.

Every process runs on its own emulated host (``volunteerd.testing.wan``): the bootstrap
node (which relays) on a public host, the daemon behind a NAT, the trainer on a third
host. The trainer finds the daemon's expert in the DHT under a circuit address, calls
it, and reports over which connections it reaches the daemon; the daemon's own view
comes from its control API (what the dashboard's reachability panel shows). And nodes
that listen on every interface announce the address peers can dial.
"""

from __future__ import annotations

import dataclasses
import json
import sys
from pathlib import Path
from typing import Any

import pytest

from tests.wan.daemons import reachability, volunteerd_on
from volunteerd.demo.local_swarm import child_env
from volunteerd.testing.wan import LinkSpec, Wan, open_wan, wan_available

# Three processes on three emulated hosts, each starting in several seconds on a busy
# machine, then DCUtR's rounds: minutes, not the default two.
pytestmark = [pytest.mark.slow, pytest.mark.timeout(360)]

_available = wan_available()
if not _available:
    pytest.skip(f"needs the WAN emulator: {_available.reason}", allow_module_level=True)

UID = "ffn.0.0"
HIDDEN = 16
# A link with some latency, as between homes; no loss, so the test waits on nothing
# but the protocol.
_LINK = LinkSpec(delay_ms=5.0, down_mbit=100.0, up_mbit=100.0)

# The trainer: find UID in the DHT, call it once, wait until it has a direct connection
# to the daemon ("direct") or its own hole punching has an outcome ("punched"), call it
# again. Prints what it saw as JSON.
_TRAINER = r"""
import json, sys
import trio
from libp2p.peer.id import ID
from volunteerd.identity import Identity
from volunteerd.net import Verb, open_node
from volunteerd.testing import local_config
from volunteerd.wire import TensorMeta
from volunteerd.wire.messages import ForwardRequest

listen_host, bootstrap, uid, hidden, until = sys.argv[1:6]

async def main():
    config = local_config(
        bootstrap=[bootstrap],
        network={"listen_host": listen_host},
        timeouts={"connect_s": 20, "request_s": 60, "dht_lookup_s": 20},
    )
    async with open_node(Identity.generate(), config) as node:
        with trio.fail_after(60):
            while not (peers := await node.dht.find_expert(uid)):
                await trio.sleep(0.5)
        peer = peers[0]
        meta = TensorMeta(dtype="float32", shape=(2, int(hidden)))
        request = ForwardRequest(uid=uid, tensors=[meta])

        async def call():
            body = bytes(meta.nbytes)
            reply, tensors = await node.rpc.call(peer, Verb.FORWARD, request, [body])
            return [list(t.meta.shape) for t in tensors]

        def connections():
            conns = node.host.get_network().connections.get(ID.from_base58(peer.peer_id)) or []
            return [str(a) for c in conns for a in c.get_transport_addresses()]

        def settled():
            if until == "direct":
                return any("/p2p-circuit" not in a for a in connections())
            upgrades = node.reachability.report().upgrades
            return upgrades.upgraded + upgrades.failed > 0

        out = {"announced": list(peer.addrs), "first_reply": await call()}
        out["first_connections"] = connections()
        with trio.fail_after(120):
            while not settled():
                await trio.sleep(0.2)
        out["second_reply"] = await call()
        out["connections"] = connections()
        conns = node.host.get_network().connections.get(ID.from_base58(peer.peer_id)) or []
        out["streams_on_direct"] = sum(
            len(c.get_streams())
            for c in conns
            if all("/p2p-circuit" not in str(a) for a in c.get_transport_addresses())
        )
        upgrades = node.reachability.report().upgrades
        out["upgraded"], out["hole_punch_failed"] = upgrades.upgraded, upgrades.failed
        print(json.dumps(out), flush=True)

trio.run(main)
"""


def _swarm_call(wan: Wan, tmp_path: Path, until: str) -> dict[str, Any]:
    """Bootstrap on host 0, daemon on host 1, trainer on host 2; the trainer's report
    and the daemon's reachability, read after the trainer is done.

    The daemon announces once, at start (to the bootstrap node, the only peer then),
    and not again while the trainer runs: a later announce could store its records on
    the trainer, a DHT node too, and a daemon that can dial out would then connect to
    the trainer directly before or instead of the hole punch under test."""
    relay, daemon_host, trainer_host = wan.hosts
    with volunteerd_on(relay, tmp_path / "bootstrap", ["bootstrap"]) as (_, boot):
        bootstrap = next(a for a in boot["multiaddrs"] if relay.public_address in a)
        serve = [
            "serve", "--experts", UID, "--bootstrap", bootstrap,
            "--set", f"experts.hidden_dim={HIDDEN}", "--set", 'runtime.device="cpu"',
            "--set", "dht.announce_period_s=60", "--set", "dht.record_ttl_s=120",
        ]  # fmt: skip
        with volunteerd_on(daemon_host, tmp_path / "daemon", serve):
            trainer = trainer_host.run(
                [sys.executable, "-c", _TRAINER, trainer_host.address, bootstrap, UID,
                 str(HIDDEN), until],
                env=child_env(tmp_path / "trainer"), capture_output=True, text=True,
                timeout=240,
            )  # fmt: skip
            if trainer.returncode != 0:
                pytest.fail(f"trainer failed:\n{trainer.stderr[-3000:]}")
            daemon = reachability(daemon_host, tmp_path / "daemon")
    report: dict[str, Any] = json.loads(trainer.stdout.strip().splitlines()[-1])
    report["daemon"] = daemon
    return report


def test_daemon_behind_symmetric_nat_serves_through_the_relay(tmp_path: Path) -> None:
    """Both the daemon and the trainer sit behind symmetric NATs: neither can be
    dialled, and neither NAT keeps a port the other could aim at, so hole punching
    fails and every call keeps going through the relay."""
    links = [_LINK, *[dataclasses.replace(_LINK, nat="symmetric")] * 2]
    with open_wan(links, seed=1) as wan:
        report = _swarm_call(wan, tmp_path, until="punched")
    assert report["first_reply"] == [[2, HIDDEN]]
    assert report["second_reply"] == [[2, HIDDEN]]
    assert all("/p2p-circuit" in a for a in report["announced"])
    assert report["connections"]
    assert all("/p2p-circuit" in a for a in report["connections"])
    assert report["hole_punch_failed"] >= 1
    assert report["upgraded"] == 0
    daemon = report["daemon"]
    assert daemon["mode"] == "relayed"
    assert daemon["upgraded"] == 0
    assert daemon["observed"] == [wan.hosts[1].public_address]


def test_daemon_behind_cone_nat_ends_up_on_a_direct_connection(tmp_path: Path) -> None:
    """The daemon sits behind a cone NAT, the trainer on a public host: the trainer
    first reaches the daemon through the relay, then over a direct connection, and
    the calls move to it.

    Which dial makes it is a race, and any winner is right: the daemon's DCUtR dialling
    out from its listening port, the trainer's dialling the daemon's observed address
    (a full cone lets it in), or the daemon dialling the trainer, a public Kademlia
    peer, outside DCUtR (neither side then counts an upgrade: under load most runs went
    that way). Hole punching itself is tested in tests/integration/test_reachability.py."""
    links = [_LINK, dataclasses.replace(_LINK, nat="cone"), _LINK]
    with open_wan(links, seed=2) as wan:
        report = _swarm_call(wan, tmp_path, until="direct")
    assert report["first_reply"] == [[2, HIDDEN]]
    assert report["second_reply"] == [[2, HIDDEN]]
    assert all("/p2p-circuit" in a for a in report["announced"])
    assert any("/p2p-circuit" not in a for a in report["connections"])
    # the second call left by the direct one
    assert report["streams_on_direct"] >= 1, json.dumps(report)
    daemon = report["daemon"]
    assert daemon["mode"] == "relayed"  # still unreachable for anyone it did not meet
    assert daemon["hole_punch_failed"] == 0, json.dumps(report)


def test_daemon_behind_symmetric_nat_reaches_a_public_trainer_directly(tmp_path: Path) -> None:
    """A symmetric NAT cannot be aimed at, but it lets its host dial out: with the
    trainer on a public host, DCUtR has the daemon dial the trainer, and the relayed
    connection gains a direct one all the same."""
    links = [_LINK, dataclasses.replace(_LINK, nat="symmetric"), _LINK]
    with open_wan(links, seed=3) as wan:
        report = _swarm_call(wan, tmp_path, until="direct")
    assert report["second_reply"] == [[2, HIDDEN]]
    assert any("/p2p-circuit" not in a for a in report["connections"])
    assert report["streams_on_direct"] >= 1
    assert report["daemon"]["mode"] == "relayed"


def test_nodes_listening_on_every_interface_announce_their_real_address(tmp_path: Path) -> None:
    """Bootstrap node and daemon listen on 0.0.0.0 on public hosts: what they advertise
    (ready file, records, dial-back) is the host's own address, never 0.0.0.0 or
    loopback, and the daemon is judged directly reachable there."""
    with open_wan([_LINK, _LINK], seed=4) as wan:
        boot_host, daemon_host = wan.hosts
        with volunteerd_on(
            boot_host, tmp_path / "bootstrap", ["bootstrap"], listen_host="0.0.0.0"
        ) as (_, boot):
            assert [a.split("/p2p/")[0].rsplit("/tcp/")[0] for a in boot["multiaddrs"]] == [
                f"/ip4/{boot_host.public_address}"
            ]
            serve = [
                "serve", "--experts", UID, "--bootstrap", boot["multiaddrs"][0],
                "--set", f"experts.hidden_dim={HIDDEN}", "--set", 'runtime.device="cpu"',
            ]  # fmt: skip
            daemon = volunteerd_on(daemon_host, tmp_path / "daemon", serve, listen_host="0.0.0.0")
            with daemon as (_, ready):
                reach = reachability(daemon_host, tmp_path / "daemon")
    assert reach["mode"] == "direct"
    assert reach["observed"] == [daemon_host.public_address]
    own = f"/ip4/{daemon_host.public_address}/tcp/"
    assert reach["addrs"]
    assert all(a.startswith(own) for a in reach["addrs"]), reach["addrs"]
    assert all(a.startswith(own) for a in ready["multiaddrs"]), ready["multiaddrs"]
