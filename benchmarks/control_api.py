"""Control API: how fast it answers, and what watching it costs a working daemon.

What it measures
    Starts ``volunteerd serve`` as its own process on 127.0.0.1 (``--experts`` ffn experts
    of hidden size ``--hidden``) and a trainer thread that sends forward+backward pairs to
    it as fast as it can. Then, through the typed client (one HTTP connection per call,
    as the CLI and the tray do):

    * latency of ``health``, ``status``, ``experts``, ``stats`` and ``/metrics`` over
      ``--calls`` calls each (p50, p99), while the trainer runs;
    * the trainer's throughput (samples/s) with nobody watching, and while a client polls
      ``status`` every 0.1 s (20 times what the dashboard does), so the cost of watching shows;
    * the daemon's CPU share spent while idle with a dashboard-like poll (``status``
      every 2 s, ``stats`` every 10 s) — the idle cost a volunteer pays for an open page.

Run::

    .venv/bin/python benchmarks/control_api.py
    .venv/bin/python benchmarks/control_api.py --calls 500 --window-s 10

Linux only (/proc for CPU time). Prints one table to stdout.
"""

from __future__ import annotations

import argparse
import statistics
import threading
import time
from collections.abc import Callable

import torch
from daemon_proc import cpu_seconds, daemon_process

from volunteerd.control.client import ControlClient
from volunteerd.identity import Identity
from volunteerd.moe import RemoteExpert
from volunteerd.net import parse_peer_multiaddr
from volunteerd.net.background import BackgroundNode
from volunteerd.testing import local_config


def percentiles(samples: list[float]) -> tuple[float, float]:
    ordered = sorted(samples)
    return statistics.median(ordered), ordered[min(len(ordered) - 1, int(len(ordered) * 0.99))]


def main() -> int:
    p = argparse.ArgumentParser(description="control API latency and cost")
    p.add_argument("--experts", type=int, default=4)
    p.add_argument("--hidden", type=int, default=256)
    p.add_argument("--calls", type=int, default=200)
    p.add_argument("--window-s", type=float, default=8.0)
    args = p.parse_args()

    with daemon_process(args.experts, args.hidden) as daemon:
        client = ControlClient.for_data_dir(daemon.data_dir)
        rows = run(args, daemon.process.pid, daemon.info, client)

    print(f"control API — 1 daemon, {args.experts} ffn experts of {args.hidden}, CPU")
    print(f"{'measure':44} {'value':>22}")
    for name, value in rows:
        print(f"{name:44} {value:>22}")
    return 0


def run(
    args: argparse.Namespace, pid: int, info: dict[str, object], client: ControlClient
) -> list[tuple[str, str]]:
    rows: list[tuple[str, str]] = []
    # Idle cost of an open dashboard: status every 2 s, stats every 10 s.
    start_cpu, start = cpu_seconds(pid), time.monotonic()
    while time.monotonic() - start < 20:
        client.status()
        if int(time.monotonic() - start) % 10 == 0:
            client.stats()
        time.sleep(2)
    idle = (cpu_seconds(pid) - start_cpu) / (time.monotonic() - start)
    rows.append(("daemon CPU, idle, dashboard polling", f"{idle * 100:.2f} % of a core"))

    addrs = info["multiaddrs"]
    assert isinstance(addrs, list)
    address = parse_peer_multiaddr(addrs[0])
    done = 0
    stop = threading.Event()
    with BackgroundNode(Identity.generate(), local_config()) as node:
        experts = [RemoteExpert(f"ffn.0.{i}", address, node) for i in range(args.experts)]

        def train() -> None:
            nonlocal done
            x = torch.randn(64, args.hidden, requires_grad=True)
            while not stop.is_set():
                for expert in experts:
                    expert(x).sum().backward()
                    done += 64

        trainer = threading.Thread(target=train, daemon=True)
        trainer.start()
        time.sleep(5)  # warm up

        def rate(poll: Callable[[], object] | None) -> float:
            polling = threading.Event()

            def poller() -> None:
                while not polling.is_set():
                    poll()  # type: ignore[misc]
                    time.sleep(0.1)

            thread = threading.Thread(target=poller, daemon=True) if poll else None
            if thread:
                thread.start()
            before, t0 = done, time.monotonic()
            time.sleep(args.window_s)
            result = (done - before) / (time.monotonic() - t0)
            polling.set()
            if thread:
                thread.join()
            return result

        # alone, watched, alone again: warm-up and drift do not favour either side
        before = rate(None)
        watched = rate(client.status)
        alone = (before + rate(None)) / 2
        rows.append(("trainer samples/s, nobody watching (mean of 2)", f"{alone:,.0f}"))
        rows.append(("trainer samples/s, status polled every 0.1 s", f"{watched:,.0f}"))
        rows.append(("  change", f"{(watched / alone - 1) * 100:+.1f} %"))

        calls: dict[str, Callable[[], object]] = {
            "health": client.health,
            "status": client.status,
            "experts": client.experts,
            "stats": client.stats,
            "metrics": client.metrics,
        }
        for name, call in calls.items():
            times = []
            for _ in range(args.calls):
                t0 = time.perf_counter()
                call()
                times.append((time.perf_counter() - t0) * 1000)
            p50, p99 = percentiles(times)
            rows.append((f"{name} latency under load (p50 / p99)", f"{p50:.1f} / {p99:.1f} ms"))
        stop.set()
        trainer.join(30)
    return rows


if __name__ == "__main__":
    raise SystemExit(main())
