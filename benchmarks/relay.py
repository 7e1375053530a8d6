"""Relayed vs direct RPCs over the same link: small-call latency and bulk throughput.

Three processes: a relay (a bootstrap node, which relays circuits), a server that holds
a reservation on it (``reachability.mode = relay``; it still listens, so it can be
reached both ways) and answers ``forward`` with an empty reply, and a client with two
nodes, one dialling the server's direct address and one its circuit address. The two
paths take turns, round after round, so both see the same load on the machine.

* small: a forward carrying 1 KiB (256 float32), answered with no tensors: p50/p90 ms;
* bulk: a forward carrying ``--bulk-mib`` MiB, same answer: MiB/s from the p50 call.

On loopback (default) the three run on this machine; with ``--wan`` each runs on its own
emulated host (``volunteerd.testing.wan``; root), relay on host 0, server on host 1,
client on host 2, all with the same link:

    .venv/bin/python benchmarks/relay.py
    .venv/bin/python benchmarks/relay.py --wan --delay-ms 20 --down-mbit 50 --up-mbit 10
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import logging
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

import trio
from libp2p.peer.id import ID

from volunteerd.config import Config
from volunteerd.identity import Identity
from volunteerd.net import Node, PeerAddress, Verb, open_node
from volunteerd.net.host import transport_addrs
from volunteerd.net.rpc import Reply, Request
from volunteerd.testing import local_config
from volunteerd.wire import TensorMeta
from volunteerd.wire.messages import ForwardRequest, TensorReply

SMALL_BYTES = 1024
_READY_S = 60.0


def _config(
    listen_host: str, bootstrap: Sequence[str] = (), reachability: dict[str, Any] | None = None
) -> Config:
    return local_config(
        bootstrap=bootstrap,
        network={"listen_host": listen_host},
        # The relayed path must stay relayed: DCUtR would make it direct within seconds.
        reachability={"hole_punching": False, **(reachability or {})},
        logging={"level": "WARNING"},
        timeouts={"connect_s": 10, "request_s": 120},
    )


def _wait_for(path: Path) -> dict[str, Any]:
    deadline = time.monotonic() + _READY_S
    while time.monotonic() < deadline:
        if path.exists() and path.stat().st_size:
            data: dict[str, Any] = json.loads(path.read_text())
            return data
        time.sleep(0.1)
    raise SystemExit(f"no {path.name} within {_READY_S:.0f} s")


# -- roles (each its own process) ----------------------------------------------------------


async def _relay(args: argparse.Namespace) -> None:
    async with open_node(Identity.generate(), _config(args.listen_host), relay=True) as node:
        args.ready.write_text(json.dumps({"multiaddr": node.multiaddrs[0]}))
        await trio.sleep_forever()


async def _answer(request: Request) -> Reply:
    return Reply(TensorReply(tensors=[]))


async def _server(args: argparse.Namespace) -> None:
    config = _config(args.listen_host, bootstrap=[args.relay], reachability={"mode": "relay"})
    handlers = {Verb.FORWARD: _answer}
    async with open_node(Identity.generate(), config, handlers) as node:
        if node.reachability is None or node.reachability.mode != "relayed":
            raise SystemExit("the server holds no reservation on the relay")
        args.ready.write_text(
            json.dumps(
                {
                    "peer_id": node.peer_id,
                    "direct": transport_addrs(node.host),
                    "relayed": node.addrs,
                }
            )
        )
        await trio.sleep_forever()


async def _timed(node: Node, peer: PeerAddress, header: ForwardRequest, body: bytes) -> float:
    start = time.perf_counter()
    await node.rpc.call(peer, Verb.FORWARD, header, [body])
    return time.perf_counter() - start


async def _client(args: argparse.Namespace) -> None:
    server = json.loads(args.server.read_text())
    samples: dict[str, dict[str, list[float]]] = {}
    small = ForwardRequest(uid="ffn.0.0", tensors=[TensorMeta(dtype="float32", shape=(256,))])
    bulk_bytes = int(args.bulk_mib * 2**20)
    bulk = ForwardRequest(
        uid="ffn.0.0", tensors=[TensorMeta(dtype="float32", shape=(bulk_bytes // 4,))]
    )
    small_body, bulk_body = bytes(SMALL_BYTES), bytes(bulk_bytes)
    async with (
        open_node(Identity.generate(), _config(args.listen_host)) as direct,
        open_node(Identity.generate(), _config(args.listen_host)) as relayed,
    ):
        paths = {"direct": direct, "relayed": relayed}
        for name, node in paths.items():
            peer = PeerAddress(server["peer_id"], tuple(server[name]))
            await node.rpc.call(peer, Verb.FORWARD, bulk, [bulk_body])  # connect, warm up
            samples[name] = {"small": [], "bulk": []}
        for _ in range(args.rounds):
            for name, node in paths.items():
                peer = PeerAddress(server["peer_id"], tuple(server[name]))
                for _ in range(args.small):
                    samples[name]["small"].append(await _timed(node, peer, small, small_body))
                for _ in range(args.bulk):
                    samples[name]["bulk"].append(await _timed(node, peer, bulk, bulk_body))
        for name, node in paths.items():
            conns = node.host.get_network().connections.get(ID.from_base58(server["peer_id"]))
            addrs = [str(a) for c in conns or [] for a in c.get_transport_addresses()]
            samples[name]["via"] = addrs  # type: ignore[assignment]
    args.ready.write_text(json.dumps(samples))


# -- the run ----------------------------------------------------------------------------


def _role_argv(role: str, listen_host: str, ready: Path, *extra: str) -> list[str]:
    return [
        sys.executable,
        str(Path(__file__).resolve()),
        "--role",
        role,
        "--listen-host",
        listen_host,
        "--ready",
        str(ready),
        *extra,
    ]


def _orchestrate(
    args: argparse.Namespace,
    hosts: Sequence[tuple[str, Callable[[list[str]], list[str]]]],
) -> dict[str, Any]:
    """Run relay, server and client; ``hosts``: (listen address, argv wrapper) of each."""
    processes: list[subprocess.Popen[bytes]] = []
    with tempfile.TemporaryDirectory(prefix="relay-bench-") as folder:
        tmp = Path(folder)
        try:
            (relay_ip, relay_wrap), (server_ip, server_wrap), (client_ip, client_wrap) = hosts
            processes.append(
                subprocess.Popen(relay_wrap(_role_argv("relay", relay_ip, tmp / "relay.json")))
            )
            relay = _wait_for(tmp / "relay.json")["multiaddr"]
            server_argv = _role_argv("server", server_ip, tmp / "server.json", "--relay", relay)
            processes.append(subprocess.Popen(server_wrap(server_argv)))
            _wait_for(tmp / "server.json")
            client_argv = _role_argv(
                "client",
                client_ip,
                tmp / "client.json",
                "--server",
                str(tmp / "server.json"),
                *("--rounds", str(args.rounds), "--small", str(args.small)),
                *("--bulk", str(args.bulk), "--bulk-mib", str(args.bulk_mib)),
            )
            client = subprocess.run(client_wrap(client_argv), check=False)
            if client.returncode != 0:
                raise SystemExit(f"client failed ({client.returncode})")
            result: dict[str, Any] = json.loads((tmp / "client.json").read_text())
            return result
        finally:
            for process in processes:
                process.terminate()
            for process in processes:
                try:
                    process.wait(timeout=10)
                except subprocess.TimeoutExpired:
                    process.kill()


def _print_table(title: str, samples: dict[str, Any], bulk_mib: float) -> None:
    rows = {}
    for name in ("direct", "relayed"):
        small = sorted(samples[name]["small"])
        bulk = statistics.median(samples[name]["bulk"])
        rows[name] = (
            statistics.median(small) * 1000,
            small[int(0.9 * (len(small) - 1))] * 1000,
            bulk_mib / bulk,
        )
    print(f"\n{title}")
    print(f"{'path':<16}{'small p50 ms':>14}{'small p90 ms':>14}{'bulk MiB/s':>12}")
    for name, (p50, p90, mibs) in rows.items():
        print(f"{name:<16}{p50:>14.2f}{p90:>14.2f}{mibs:>12.2f}")
    d, r = rows["direct"], rows["relayed"]
    print(f"{'relayed/direct':<16}{r[0] / d[0]:>13.2f}x{r[1] / d[1]:>13.2f}x{d[2] / r[2]:>11.2f}x")
    for name in ("direct", "relayed"):
        print(f"  {name} connection: {', '.join(samples[name]['via'])}")


def main(argv: Sequence[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--small", type=int, default=40, help="small calls per path per round")
    parser.add_argument("--bulk", type=int, default=2, help="bulk calls per path per round")
    parser.add_argument("--bulk-mib", type=float, default=4.0)
    parser.add_argument("--wan", action="store_true", help="run on emulated hosts (root)")
    parser.add_argument("--delay-ms", type=float, default=20.0, help="--wan: one-way, per host")
    parser.add_argument("--down-mbit", type=float, default=50.0)
    parser.add_argument("--up-mbit", type=float, default=10.0)
    parser.add_argument(
        "--relay-delay-ms", type=float, help="--wan: the relay's own link (default: --delay-ms)"
    )
    # the roles, started by the run itself
    parser.add_argument("--role", choices=("relay", "server", "client"), help=argparse.SUPPRESS)
    parser.add_argument("--listen-host", default="127.0.0.1", help=argparse.SUPPRESS)
    parser.add_argument("--ready", type=Path, help=argparse.SUPPRESS)
    parser.add_argument("--relay", help=argparse.SUPPRESS)
    parser.add_argument("--server", type=Path, help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    logging.basicConfig(level=logging.ERROR)
    logging.getLogger("libp2p").setLevel(logging.CRITICAL)

    if args.role:
        trio.run({"relay": _relay, "server": _server, "client": _client}[args.role], args)
        return
    if not args.wan:
        same: Callable[[list[str]], list[str]] = lambda argv: argv  # noqa: E731
        samples = _orchestrate(args, [("127.0.0.1", same)] * 3)
        _print_table("loopback (3 processes on this machine)", samples, args.bulk_mib)
        return

    from volunteerd.testing.wan import LinkSpec, open_wan, wan_available

    available = wan_available()
    if not available:
        raise SystemExit(f"--wan needs the emulator: {available.reason}")
    link = LinkSpec(delay_ms=args.delay_ms, down_mbit=args.down_mbit, up_mbit=args.up_mbit)
    relay_delay_ms = args.delay_ms if args.relay_delay_ms is None else args.relay_delay_ms
    relay_link = dataclasses.replace(link, delay_ms=relay_delay_ms)
    with open_wan([relay_link, link, link]) as wan:
        hosts = [(h.address, h.argv) for h in wan.hosts]
        samples = _orchestrate(args, hosts)
    _print_table(
        f"emulated hosts: {args.delay_ms:g} ms one-way per host (relay {relay_delay_ms:g} ms), "
        f"{args.down_mbit:g}/{args.up_mbit:g} Mbit/s down/up",
        samples,
        args.bulk_mib,
    )


if __name__ == "__main__":
    main()
