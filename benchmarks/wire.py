"""What moving tensors over volunteerd's libp2p stack costs: bulk request/reply pairs
between two processes on 127.0.0.1 (TCP + Noise + Yamux, the RPC framing, no expert).

A server process answers every ``forward`` with as many bytes as it was sent; a client
process calls it back to back for ``--seconds`` per size. Per message size: calls per
second, MiB/s (both directions counted) and the CPU time per MiB moved of each side
(its process's user + system time over the window, divided by the MiB it sent and
received). Run::

    .venv/bin/python benchmarks/wire.py
    .venv/bin/python benchmarks/wire.py --sizes-kib 128,2048 --seconds 10
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time
from collections.abc import Sequence
from pathlib import Path

import trio
from arguments import int_list
from hivemind_procs import cpu_seconds  # the benchmarks folder: no hivemind import

from volunteerd.config import Config
from volunteerd.identity import Identity
from volunteerd.net import PeerAddress, Verb, open_node
from volunteerd.net.host import transport_addrs
from volunteerd.net.rpc import Reply, Request
from volunteerd.testing import local_config
from volunteerd.wire import TensorMeta
from volunteerd.wire.messages import ForwardRequest, TensorReply

_READY_S = 60.0


def _cpu_s(pid: int) -> float:
    seconds = cpu_seconds(pid)
    if seconds is None:
        raise SystemExit(f"the server process {pid} is gone")
    return seconds


def _config() -> Config:
    # The server's per-peer limits (200 requests/s, 256 MiB/s) would meter the client.
    return local_config(
        network={"listen_host": "127.0.0.1"},
        peer_limits={
            "requests_per_s": 100_000,
            "request_burst": 100_000,
            "inbound_mib_per_s": 100_000,
            "inbound_burst_mib": 100_000,
        },
        logging={"level": "WARNING"},
        timeouts={"connect_s": 10, "request_s": 120},
    )


def _meta(nbytes: int) -> TensorMeta:
    return TensorMeta(dtype="float32", shape=(nbytes // 4,))


async def _echo_size(request: Request) -> Reply:
    """As many bytes back as came in (the body itself is not looked at)."""
    nbytes = sum(m.nbytes for m in request.header.tensors)
    return Reply(TensorReply(tensors=[_meta(nbytes)]), [bytes(nbytes)])


async def _server(ready: Path) -> None:
    handlers = {Verb.FORWARD: _echo_size}
    async with open_node(Identity.generate(), _config(), handlers) as node:
        info = {"peer_id": node.peer_id, "addrs": transport_addrs(node.host)}
        await trio.Path(ready).write_text(json.dumps(info))
        await trio.sleep_forever()


async def _client(ready: Path, sizes_kib: list[int], seconds: float, server_pid: int) -> None:
    server = json.loads(await trio.Path(ready).read_text())
    rows = []
    async with open_node(Identity.generate(), _config()) as node:
        peer = PeerAddress(server["peer_id"], tuple(server["addrs"]))
        for kib in sizes_kib:
            nbytes = kib * 1024
            header, body = ForwardRequest(uid="ffn.0.0", tensors=[_meta(nbytes)]), bytes(nbytes)
            for _ in range(3):  # connect, warm up
                await node.rpc.call(peer, Verb.FORWARD, header, [body])
            server_cpu, cpu, start = _cpu_s(server_pid), time.process_time(), time.perf_counter()
            calls = 0
            while time.perf_counter() - start < seconds:
                await node.rpc.call(peer, Verb.FORWARD, header, [body])
                calls += 1
            wall = time.perf_counter() - start
            mib = calls * 2 * nbytes / 2**20
            rows.append(
                {
                    "kib": kib,
                    "calls_per_s": calls / wall,
                    "mib_per_s": mib / wall,
                    "client_ms_per_mib": (time.process_time() - cpu) * 1000 / mib,
                    "server_ms_per_mib": (_cpu_s(server_pid) - server_cpu) * 1000 / mib,
                }
            )
    print(json.dumps(rows))


def parse_args(argv: Sequence[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--sizes-kib", type=int_list, default=[16, 128, 512, 2048])
    p.add_argument("--seconds", type=float, default=5.0, help="timing window per size")
    p.add_argument("--role", choices=["server", "client"], help=argparse.SUPPRESS)
    p.add_argument("--ready", type=Path, help=argparse.SUPPRESS)
    p.add_argument("--server-pid", type=int, help=argparse.SUPPRESS)
    return p.parse_args(argv)


def main(argv: Sequence[str] | None = None) -> None:
    args = parse_args(argv)
    if args.role == "server":
        trio.run(_server, args.ready)
        return
    if args.role == "client":
        trio.run(_client, args.ready, args.sizes_kib, args.seconds, args.server_pid)
        return
    me = [sys.executable, str(Path(__file__).resolve())]
    with tempfile.TemporaryDirectory(prefix="wire-bench-") as folder:
        ready = Path(folder) / "server.json"
        server = subprocess.Popen([*me, "--role", "server", "--ready", str(ready)])
        try:
            deadline = time.monotonic() + _READY_S
            while not (ready.exists() and ready.stat().st_size):
                if time.monotonic() > deadline or server.poll() is not None:
                    raise SystemExit("the server process did not start")
                time.sleep(0.1)
            sizes = ",".join(str(s) for s in args.sizes_kib)
            role = ["--role", "client", "--ready", str(ready), "--server-pid", str(server.pid)]
            client = subprocess.run(
                [*me, *role, "--sizes-kib", sizes, "--seconds", str(args.seconds)],
                capture_output=True,
                text=True,
                check=False,
            )
            if client.returncode != 0:
                raise SystemExit(f"client failed ({client.returncode}): {client.stderr[-2000:]}")
            rows = json.loads(client.stdout.strip().splitlines()[-1])
        finally:
            server.terminate()
            try:
                server.wait(timeout=10)
            except subprocess.TimeoutExpired:
                server.kill()
    print(
        f"request/reply pairs of equal size over TCP + Noise + Yamux on 127.0.0.1, "
        f"{args.seconds:g} s per size, {os.cpu_count()} cores"
    )
    print(f"{'size':>10}{'calls/s':>10}{'MiB/s':>9}{'client ms/MiB':>15}{'server ms/MiB':>15}")
    for row in rows:
        print(
            f"{row['kib']:>6} KiB{row['calls_per_s']:>10.0f}{row['mib_per_s']:>9.0f}"
            f"{row['client_ms_per_mib']:>15.2f}{row['server_ms_per_mib']:>15.2f}"
        )
    print("MiB/s and ms/MiB count both directions: a 2 MiB call moves 4 MiB")


if __name__ == "__main__":
    main()
