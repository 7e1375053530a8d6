"""Soak: thousands of peers joining, calling and leaving one daemon and one bootstrap node.

What it measures
    Starts ``volunteerd bootstrap`` and ``volunteerd serve`` (2 ``ffn`` experts of 64) as
    their own processes on 127.0.0.1. Then, for ``--duration-s`` seconds, ``--concurrency``
    chains of strangers run one after another: each is a fresh identity that connects,
    sends one request (a forward to the daemon, a DHT lookup to the bootstrap node) and
    leaves. Every ``--sample-s`` seconds it prints, for each node: the strangers answered
    so far, the connections open on its port (from /proc/net/tcp), its resident memory
    and its open file descriptors. Nothing may grow with the number of strangers served:
    before the fix in volunteerd/net/connections.py both nodes refused everyone after
    ~250 strangers. At the end, ``--burst`` strangers connect at once to each node
    (handshakes that fail are counted) and one newcomer must still be answered;
    ``--hold`` keeps a burst's connections open until all are answered (that many
    peers at once), ``--bursts`` repeats it.

Run::

    .venv/bin/python benchmarks/soak.py                       # 10 minutes
    .venv/bin/python benchmarks/soak.py --duration-s 3600     # the hour of the issue
    .venv/bin/python benchmarks/soak.py --duration-s 10 --burst 400 --bursts 4 --hold

Linux only (/proc). Prints one table to stdout.
"""

from __future__ import annotations

import argparse
import os
import subprocess
import time
from collections.abc import Callable, Iterator
from contextlib import ExitStack, contextmanager
from dataclasses import dataclass
from pathlib import Path

import torch
import trio
from daemon_proc import volunteerd_process

from volunteerd.experts import to_wire
from volunteerd.net import Verb, parse_peer_multiaddr
from volunteerd.net.peers import PeerAddress
from volunteerd.net.records import FindRequest
from volunteerd.testing import local_config
from volunteerd.testing.clients import open_bare_client
from volunteerd.wire import ForwardRequest

HIDDEN = 64


@dataclass
class NodeProc:
    name: str
    process: subprocess.Popen[bytes]
    address: PeerAddress
    port: int
    multiaddr: str


@contextmanager
def node_process(name: str, *args: str) -> Iterator[NodeProc]:
    with volunteerd_process(*args) as node:
        addr = node.info["multiaddrs"][0]
        port = int(addr.split("/tcp/")[1].split("/")[0])
        yield NodeProc(name, node.process, parse_peer_multiaddr(addr), port, addr)


def rss_mib(pid: int) -> float:
    status = Path(f"/proc/{pid}/status").read_text()
    return int(next(x for x in status.splitlines() if x.startswith("VmRSS")).split()[1]) / 1024


def fds(pid: int) -> int:
    return len(os.listdir(f"/proc/{pid}/fd"))


def open_connections(port: int) -> int:
    """Established TCP connections whose local port is ``port``."""
    rows = Path("/proc/net/tcp").read_text().splitlines()[1:]
    return sum(
        1 for r in rows if int(r.split()[1].split(":")[1], 16) == port and r.split()[3] == "01"
    )


# One process plays every stranger, so a burst's handshakes queue up here, not only at
# the node: generous timeouts make a failure the node's refusal, not this loop's backlog.
CLIENT_CONFIG = local_config(timeouts={"connect_s": 120, "request_s": 120})


async def call(node: NodeProc, answered: Callable[[], object] = lambda: None,
               held: trio.Event | None = None) -> None:  # fmt: skip
    """One stranger's request; then ``answered()``, and with ``held`` it keeps its
    connection until that is set."""
    async with open_bare_client(CLIENT_CONFIG) as client:
        with trio.fail_after(240):
            if node.name == "daemon":
                meta, data = to_wire(torch.randn(4, HIDDEN))
                request = ForwardRequest(uid="ffn.0.0", tensors=[meta])
                await client.call(node.address, Verb.FORWARD, request, [data])
            else:
                await client.call(node.address, Verb.DHT_FIND, FindRequest(keys=["ffn."]))
        answered()
        if held is not None:
            await held.wait()


async def soak(nodes: list[NodeProc], args: argparse.Namespace) -> None:
    answered = {n.name: 0 for n in nodes}
    failed = {n.name: 0 for n in nodes}
    started = time.monotonic()
    deadline = started + args.duration_s

    async def chain(node: NodeProc) -> None:
        while time.monotonic() < deadline:
            try:
                await call(node)
                answered[node.name] += 1
            except Exception:
                failed[node.name] += 1

    def sample() -> None:
        cells = [f"{time.monotonic() - started:7.0f}"]
        for n in nodes:
            pid = n.process.pid
            cells += [
                f"{answered[n.name]:8d}",
                f"{failed[n.name]:6d}",
                f"{open_connections(n.port):5d}",
                f"{rss_mib(pid):7.0f}",
                f"{fds(pid):5d}",
            ]
        print(" | ".join(cells), flush=True)

    head = ["   t(s)"]
    for n in nodes:
        head += [f"{n.name[:4]} ok", "failed", "conns", "RSS MiB", "fds"]
    print(" | ".join(head), flush=True)
    async with trio.open_nursery() as nursery:
        for node in nodes:
            for _ in range(args.concurrency):
                nursery.start_soon(chain, node)
        while time.monotonic() < deadline:
            sample()
            await trio.sleep(min(args.sample_s, max(0.0, deadline - time.monotonic())))
    sample()

    for node in nodes:
        for _ in range(args.bursts):
            await burst(node, args.burst, hold=args.hold)


async def burst(node: NodeProc, count: int, *, hold: bool = False) -> None:
    """``count`` strangers at once (with ``hold``: each keeps its connection until all
    are answered or have failed, so that many peers are connected at the same time),
    then one newcomer; prints what failed and why."""
    ok = 0
    errors: dict[str, int] = {}
    held = trio.Event() if hold else None

    def answered() -> None:
        nonlocal ok
        ok += 1

    async def one() -> None:
        try:
            await call(node, answered, held)
        except Exception as exc:
            while isinstance(exc, BaseExceptionGroup):
                exc = exc.exceptions[0]
            text = f"{type(exc).__name__}: {str(exc)[:150]}"
            errors[text] = errors.get(text, 0) + 1

    at_once = ""
    async with trio.open_nursery() as nursery:
        for _ in range(count):
            nursery.start_soon(one)
            if held is not None:
                await trio.sleep(0.005)  # this one process's handshakes, not the node's
        if held is not None:
            while ok + sum(errors.values()) < count:  # noqa: ASYNC110 - polling counts
                await trio.sleep(0.1)
            at_once = f"{open_connections(node.port)} connections open at once; "
            held.set()
    print(
        f"{node.name}: burst of {count} at once: {ok} answered, {count - ok} failed; "
        f"{at_once}RSS {rss_mib(node.process.pid):.0f} MiB, {fds(node.process.pid)} fds",
        flush=True,
    )
    for text, n in sorted(errors.items(), key=lambda e: -e[1])[:3]:
        print(f"  {n} x {text}", flush=True)
    errors.clear()
    ok = 0
    await one()  # a newcomer after all that
    print(f"{node.name}: a newcomer afterwards: {'answered' if ok else 'refused'}", flush=True)
    for text, n in sorted(errors.items(), key=lambda e: -e[1])[:3]:
        print(f"  {n} x {text}", flush=True)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--duration-s", type=float, default=600.0)
    parser.add_argument("--concurrency", type=int, default=4, help="chains per node")
    parser.add_argument("--sample-s", type=float, default=60.0)
    parser.add_argument("--burst", type=int, default=300)
    parser.add_argument("--bursts", type=int, default=1, help="bursts, one after another")
    parser.add_argument(
        "--hold",
        action="store_true",
        help="a burst's strangers keep their connections until all are answered",
    )
    args = parser.parse_args()
    with ExitStack() as stack:
        boot = stack.enter_context(node_process("bootstrap", "bootstrap"))
        serve = ["serve", "--experts", "ffn.0.[0:2]", "--bootstrap", boot.multiaddr]
        sizes = ["--set", f"experts.hidden_dim={HIDDEN}", "--set", 'runtime.device="cpu"']
        daemon = stack.enter_context(node_process("daemon", *serve, *sizes))
        trio.run(soak, [daemon, boot], args)


if __name__ == "__main__":
    main()
