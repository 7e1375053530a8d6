"""Daemon footprint: memory and idle CPU of one ``volunteerd serve`` process.

What it measures
    First a fresh install's daemon: ``volunteerd serve`` with no project and no experts
    (it hosts nothing and loads no torch), idle. Then ``volunteerd serve`` as its own
    process on 127.0.0.1 hosting ``--experts`` ``ffn`` experts of hidden size
    ``--hidden`` (default 8 experts of 512) once they are announced. Each is read from
    /proc: resident memory (RSS), proportional memory (PSS, shared libraries split
    fairly), threads, and the CPU it uses while idle over ``--idle-s`` seconds. Then a
    client sends one forward and one backward to every expert (so each expert's Adam
    state exists, as on a working server) and memory is read again.
    hivemind's figure on this machine for 8 experts of 512: ~1.5 GB PSS in 24 processes.

Run::

    .venv/bin/python benchmarks/footprint.py
    .venv/bin/python benchmarks/footprint.py --experts 16 --hidden 1024

Linux only (/proc). Prints one table to stdout.
"""

from __future__ import annotations

import argparse
import time
from pathlib import Path

import torch
from daemon_proc import cpu_seconds, daemon_process, volunteerd_process

from volunteerd.identity import Identity
from volunteerd.moe import RemoteExpert
from volunteerd.net import parse_peer_multiaddr
from volunteerd.net.background import BackgroundNode
from volunteerd.testing import local_config


def read_memory(pid: int) -> dict[str, float]:
    rollup = Path(f"/proc/{pid}/smaps_rollup").read_text().splitlines()
    fields = {line.split(":")[0]: line.split()[1] for line in rollup if ":" in line}
    status = Path(f"/proc/{pid}/status").read_text()
    threads = next(
        int(line.split()[1]) for line in status.splitlines() if line.startswith("Threads")
    )
    return {
        "rss_mb": int(fields["Rss"]) / 1024,
        "pss_mb": int(fields["Pss"]) / 1024,
        "threads": threads,
    }


def main() -> int:
    p = argparse.ArgumentParser(description="memory and idle CPU of one daemon")
    p.add_argument("--experts", type=int, default=8)
    p.add_argument("--hidden", type=int, default=512)
    p.add_argument("--idle-s", type=float, default=10.0)
    args = p.parse_args()

    with volunteerd_process("serve") as fresh:
        time.sleep(2)  # let start-up work settle
        nothing = read_memory(fresh.process.pid)
        cpu0, t0 = cpu_seconds(fresh.process.pid), time.monotonic()
        time.sleep(args.idle_s)
        nothing_cpu = (cpu_seconds(fresh.process.pid) - cpu0) / (time.monotonic() - t0)

    with daemon_process(args.experts, args.hidden) as daemon:
        pid, info = daemon.process.pid, daemon.info
        time.sleep(2)  # let start-up work settle
        idle = read_memory(pid)
        cpu0, t0 = cpu_seconds(pid), time.monotonic()
        time.sleep(args.idle_s)
        idle_cpu = (cpu_seconds(pid) - cpu0) / (time.monotonic() - t0)

        peer = parse_peer_multiaddr(info["multiaddrs"][0])
        # The client dials the daemon by its address and joins no swarm (it needs none:
        # joining would only add a dial-back probe to what is measured).
        config = local_config()
        with BackgroundNode(Identity.generate(), config) as node:
            for e in range(args.experts):
                expert = RemoteExpert(f"ffn.0.{e}", peer, node)
                expert(torch.randn(64, args.hidden, requires_grad=True)).sum().backward()
        time.sleep(1)
        trained = read_memory(pid)
        startup_s = daemon.startup_s

    params_mb = args.experts * (8 * args.hidden**2 + 5 * args.hidden) * 4 / 2**20
    print("\nvolunteerd serve, fresh install: no project, no experts (no torch loaded)")
    print(f"{'state':32} {'RSS MB':>8} {'PSS MB':>8} {'threads':>8}")
    print(f"{'idle':32} {nothing['rss_mb']:8.0f} {nothing['pss_mb']:8.0f} {nothing['threads']:8d}")
    print(f"idle CPU: {nothing_cpu:.1%} of one core")
    print(
        f"\nvolunteerd serve: {args.experts} ffn experts, hidden {args.hidden} "
        f"({params_mb:.0f} MB of weights, x3 with Adam state), one process"
    )
    print(f"{'state':32} {'RSS MB':>8} {'PSS MB':>8} {'threads':>8}")
    for name, m in (("idle, after start", idle), ("after one step per expert", trained)):
        print(f"{name:32} {m['rss_mb']:8.0f} {m['pss_mb']:8.0f} {m['threads']:8d}")
    print(f"start-up until announced: {startup_s:.1f} s; idle CPU: {idle_cpu:.1%} of one core")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
