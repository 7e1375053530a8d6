"""Upload limit: does a 10 Mbit/s limit hold, and do expert requests still get through?

What it measures
    One volunteerd daemon (in this process: real libp2p host, Kademlia, runtime) hosts
    two ``ffn`` experts of hidden size ``--hidden``. A second peer downloads one expert's
    shard (``shard`` verb, ``net/shard.py``: 1 MiB chunks, SHA-256 checked) while a third
    peer sends small forward requests (``--probe-batch`` rows) to the other expert every
    ``--probe-every-s``. All on 127.0.0.1 over TCP + Noise + Yamux.

    For each upload limit in ``--limits`` (Mbit/s; 0 = none) the daemon's limit is set
    at run time through its volunteer controls (``set_limits``, no restart), then the
    shard is downloaded. Throughput is the bytes between the first and the last chunk
    over the time between them (the snapshot's encoding before the first chunk is not
    network time), in Mbit/s (10^6 bits). The daemon's own byte counter (every stream
    it wrote to) is reported next to it. Forward latency is measured during each
    transfer and, as a baseline, with no transfer running.

Run::

    .venv/bin/python benchmarks/throttle.py                      # limits 0, 10, 20
    .venv/bin/python benchmarks/throttle.py --limits 10 --hidden 1024
    .venv/bin/python benchmarks/throttle.py --limits 10 --probe-every-s 0   # shard alone

Prints one table (and ``--json`` a JSON line) to stdout; logs go to stderr.
"""

from __future__ import annotations

import argparse
import json
import logging
import statistics
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import torch
import trio

from volunteerd.daemon import Running
from volunteerd.errors import PeerError
from volunteerd.experts import to_wire
from volunteerd.logs import configure_logging
from volunteerd.net import Node, Verb
from volunteerd.net.shard import download_shard
from volunteerd.net.throttle import BYTES_PER_MBIT
from volunteerd.testing import local_config, open_daemon, open_peer
from volunteerd.wire import ForwardRequest

logger = logging.getLogger("benchmarks.throttle")


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--limits", default="0,10,20", help="upload limits in Mbit/s, 0 = none")
    p.add_argument("--hidden", type=int, default=768, help="expert width (shard ~ 19 MB)")
    p.add_argument("--probe-batch", type=int, default=8)
    p.add_argument("--probe-every-s", type=float, default=0.25, help="0 = no probes")
    p.add_argument("--baseline-probes", type=int, default=20)
    p.add_argument("--json", action="store_true")
    return p.parse_args(argv)


def forward_header(hidden: int, rows: int) -> tuple[ForwardRequest, bytes]:
    meta, data = to_wire(torch.randn(rows, hidden))
    return ForwardRequest(uid="ffn.0.1", tensors=[meta]), data


async def probe(
    client: Node, daemon: Running, args: argparse.Namespace, latencies: list[float]
) -> int:
    """One forward request; its latency is appended. Returns 1 on failure, else 0."""
    header, data = forward_header(args.hidden, args.probe_batch)
    started = time.perf_counter()
    try:
        with trio.fail_after(30):
            await client.rpc.call(daemon.node.address, Verb.FORWARD, header, [data])
    except (PeerError, trio.TooSlowError) as exc:
        logger.warning("probe failed: %s", exc)
        return 1
    latencies.append(time.perf_counter() - started)
    return 0


def pct(values: list[float], q: float) -> float:
    if not values:
        return float("nan")
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, round(q * (len(ordered) - 1)))]


async def one_limit(
    limit: float,
    daemon: Running,
    receiver: Node,
    prober: Node,
    args: argparse.Namespace,
    workdir: Path,
) -> dict[str, Any]:
    assert daemon.volunteer is not None
    await daemon.volunteer.set_limits(upload_mbit=limit, persist=False)
    chunks: list[tuple[float, int]] = []
    latencies: list[float] = []
    failures = 0
    sent_before = daemon.node.throttle.bytes_up
    done = trio.Event()

    async def probes() -> None:
        nonlocal failures
        while not done.is_set():
            failures += await probe(prober, daemon, args, latencies)
            with trio.move_on_after(args.probe_every_s):
                await done.wait()

    async with trio.open_nursery() as nursery:
        if args.probe_every_s > 0:
            nursery.start_soon(probes)
        started = time.perf_counter()
        result = await download_shard(
            receiver.rpc,
            daemon.node.address,
            "ffn.0.0",
            workdir / f"shard-{limit:g}.ckpt",
            on_chunk=lambda received, total: chunks.append((time.perf_counter(), received)),
        )
        elapsed = time.perf_counter() - started
        done.set()
    (t0, b0), (t1, b1) = chunks[0], chunks[-1]
    mbit = (b1 - b0) * 8 / 1e6 / (t1 - t0)
    sent_mbit = (daemon.node.throttle.bytes_up - sent_before) * 8 / 1e6 / elapsed
    row = {
        "limit_mbit": limit,
        "shard_mb": result.size / 1e6,
        "chunks": len(chunks),
        "seconds": t1 - t0,
        "measured_mbit": mbit,
        "vs_limit_pct": (mbit / limit - 1) * 100 if limit else None,
        "daemon_sent_mbit": sent_mbit,
        "probes": len(latencies) + failures,
        "probe_failures": failures,
        "probe_p50_ms": pct(latencies, 0.5) * 1e3,
        "probe_p95_ms": pct(latencies, 0.95) * 1e3,
        "probe_max_ms": max(latencies, default=float("nan")) * 1e3,
    }
    logger.info("limit %g Mbit/s: %s", limit, row)
    return row


async def run(args: argparse.Namespace) -> dict[str, Any]:
    limits = [float(x) for x in args.limits.split(",")]
    with tempfile.TemporaryDirectory(prefix="volunteerd-throttle-") as tmp:
        workdir = Path(tmp)
        async with open_peer(local_config()) as boot:
            config = local_config(
                bootstrap=boot.multiaddrs,
                uids="ffn.0.[0:2]",
                experts={"hidden_dim": args.hidden},
                dht={"announce_period_s": 5.0, "record_ttl_s": 15.0},
                checkpoints={"enabled": False},
                replicas={"enabled": False},
                timeouts={"request_s": 60},
            )
            peer_config = local_config(bootstrap=boot.multiaddrs, timeouts={"request_s": 60})
            async with (
                open_daemon(config, workdir / "daemon") as daemon,
                open_peer(peer_config) as receiver,
                open_peer(peer_config) as prober,
            ):
                baseline: list[float] = []
                base_failures = 0
                for _ in range(args.baseline_probes):
                    base_failures += await probe(prober, daemon, args, baseline)
                rows = [
                    await one_limit(limit, daemon, receiver, prober, args, workdir)
                    for limit in limits
                ]
    return {
        "hidden": args.hidden,
        "probe_batch": args.probe_batch,
        "baseline": {
            "probes": len(baseline) + base_failures,
            "probe_failures": base_failures,
            "probe_p50_ms": statistics.median(baseline) * 1e3,
            "probe_p95_ms": pct(baseline, 0.95) * 1e3,
        },
        "rows": rows,
        "bytes_per_mbit": BYTES_PER_MBIT,
    }


def print_table(report: dict[str, Any]) -> None:
    base = report["baseline"]
    print(
        f"\nshard transfer under an upload limit (ffn hidden {report['hidden']}; forward "
        f"probes of {report['probe_batch']} rows; no transfer: p50 "
        f"{base['probe_p50_ms']:.1f} ms, p95 {base['probe_p95_ms']:.1f} ms, "
        f"{base['probe_failures']}/{base['probes']} failed)\n"
    )
    print(
        "| upload limit | shard | measured | vs limit | daemon sent | forwards ok "
        "| forward p50 | p95 | max |"
    )
    print("|---|---:|---:|---:|---:|---:|---:|---:|---:|")
    for row in report["rows"]:
        limit = f"{row['limit_mbit']:g} Mbit/s" if row["limit_mbit"] else "none"
        versus = f"{row['vs_limit_pct']:+.1f} %" if row["vs_limit_pct"] is not None else "—"
        ok = row["probes"] - row["probe_failures"]
        print(
            f"| {limit} | {row['shard_mb']:.1f} MB | {row['measured_mbit']:.2f} Mbit/s "
            f"| {versus} | {row['daemon_sent_mbit']:.2f} Mbit/s | {ok}/{row['probes']} "
            f"| {row['probe_p50_ms']:.0f} ms | {row['probe_p95_ms']:.0f} ms "
            f"| {row['probe_max_ms']:.0f} ms |"
        )


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    configure_logging("WARNING")
    logger.setLevel(logging.INFO)
    report = trio.run(run, args)
    print_table(report)
    if args.json:
        print(json.dumps(report))
    return 0


if __name__ == "__main__":
    sys.exit(main())
