"""What an idle volunteer pays: bytes, disk writes, CPU and wake-ups of idle daemons.

What it measures
    A swarm of processes on 127.0.0.1: a seed (``volunteerd bootstrap``) on which an
    owner publishes a small project (``--grid`` experts of hidden size ``--hidden``, two
    copies of each: replication 2), and daemons (``volunteerd serve``, each in its own
    throw-away home) that join it with ``volunteerd join``:

    - ``serve-a`` and ``serve-b``: serving, with no trainer anywhere, so the only work
      is upkeep (announcing, stats, the quota ledger) and replica averaging every
      ``--average-every-s`` between the copies they share;
    - ``paused``: paused with ``volunteerd pause`` (through its control API);
    - ``off-hours`` (with ``--off-hours``): its network hours set to a window hours
      from now (``volunteerd schedule --network-hours``).

    After ``--settle-s`` seconds, over ``--seconds`` seconds, per process: bytes sent
    and received per hour by the daemon's own counters (``volunteerd status --json``:
    ``today.bytes_sent`` / ``bytes_received``), disk writes per hour
    (``/proc/PID/io`` ``write_bytes``), CPU as % of one core (``/proc/PID/stat``),
    context switches per second (summed over ``/proc/PID/task/*/status``) and RSS.

    The counters are the daemon's: since the session-40 fixes they count every byte of
    its TCP connections; before, only RPC streams (so counted bytes of two releases are
    not comparable; disk, CPU and context switches are).

Run::

    nice -n 10 .venv/bin/python benchmarks/idle_cost.py
    nice -n 10 .venv/bin/python benchmarks/idle_cost.py --seconds 300 --hidden 1024 --off-hours

The processes import the ``volunteerd`` this script imports, so an earlier release is
measured by putting its checkout first on ``PYTHONPATH`` (the script may come from a
newer one)::

    PYTHONPATH=/path/to/old-checkout .venv/bin/python /path/to/new/benchmarks/idle_cost.py

Linux only (/proc). Prints one table to stdout.
"""

from __future__ import annotations

import argparse
import datetime
import glob
import json
import os
import signal
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterator
from contextlib import ExitStack, contextmanager
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import volunteerd
from volunteerd.demo.local_swarm import VOLUNTEERD, importing_this_package

HZ = os.sysconf("SC_CLK_TCK")


@dataclass
class Proc:
    name: str
    home: Path
    process: subprocess.Popen[bytes]
    daemon: bool = True  # has a control API (the seed is a plain bootstrap node)
    experts: list[str] = field(default_factory=list)


def env_for(home: Path) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if not k.startswith("VOLUNTEERD_")}
    env.update(
        VOLUNTEERD_DATA_DIR=str(home / "data"),
        VOLUNTEERD_CONFIG=str(home / "config.toml"),
        VOLUNTEERD_CACHE_DIR=str(home / "cache"),
        VOLUNTEERD_CONTROL__PORT="0",
        PYTHONUNBUFFERED="1",
        OMP_NUM_THREADS="1",
    )
    return importing_this_package(env)


def cli(home: Path, *args: str, timeout: float = 120) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [*VOLUNTEERD, *args], env=env_for(home), capture_output=True, text=True, timeout=timeout
    )


@contextmanager
def started(name: str, root: Path, *args: str) -> Iterator[Proc]:
    """``volunteerd ARGS`` in its own home under ``root``, until ready; SIGTERM after."""
    home = root / name
    home.mkdir()
    ready = home / "ready.json"
    with (home / "log.txt").open("wb") as log:
        cmd = [*VOLUNTEERD, *args, "--listen-host", "127.0.0.1", "--port", "0"]
        cmd += ["--ready-file", str(ready), "--set", 'logging.level="WARNING"']
        process = subprocess.Popen(
            cmd, env=env_for(home), stdout=log, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL
        )
        try:
            deadline = time.monotonic() + 180
            while not (ready.exists() and ready.read_text().strip()):
                if process.poll() is not None or time.monotonic() > deadline:
                    tail = (home / "log.txt").read_text(errors="replace")[-3000:]
                    raise SystemExit(f"{name} did not start:\n{tail}")
                time.sleep(0.2)
            yield Proc(name, home, process, daemon=args[0] == "serve")
        finally:
            process.send_signal(signal.SIGTERM)
            try:
                process.wait(30)
            except subprocess.TimeoutExpired:
                process.kill()
                process.wait()


def status(proc: Proc) -> dict[str, Any] | None:
    r = cli(proc.home, "status", "--json")
    return json.loads(r.stdout) if r.returncode == 0 and r.stdout.strip() else None


def wait_joined(proc: Proc) -> None:
    deadline = time.monotonic() + 240
    while time.monotonic() < deadline:
        s = status(proc)
        projects = (s or {}).get("projects") or []
        if s and projects and projects[0].get("state") == "joined" and s.get("experts"):
            proc.experts = list(s["experts"])
            return
        time.sleep(1)
    raise SystemExit(f"{proc.name} did not join:\n{(proc.home / 'log.txt').read_text()[-3000:]}")


def publish(root: Path, boot: str, hidden: int, grid: tuple[int, int]) -> str:
    owner = root / "owner"
    owner.mkdir()
    (owner / "experiment.toml").write_text(
        f'name = "idle-cost"\ndescription = "benchmarks/idle_cost.py"\nowner_name = "bench"\n'
        f'hidden_dim = {hidden}\nuid_prefix = "ffn"\ngrid = [{grid[0]}, {grid[1]}]\n'
        "replication = 2\nlifetime_days = 1\n"
    )
    r = cli(
        owner, "publish", str(owner / "experiment.toml"), "--bootstrap", boot,
        "--set", 'network.listen_host="127.0.0.1"',
    )  # fmt: skip
    if r.returncode != 0:
        raise SystemExit(f"publish failed:\n{r.stdout}\n{r.stderr}")
    return next(x for x in r.stdout.split() if x.startswith("volunteerd://join/"))


def sample(pid: int) -> dict[str, Any]:
    stat = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    io = dict(line.split(": ") for line in Path(f"/proc/{pid}/io").read_text().splitlines())
    ctx: dict[str, int] = {}
    for task in glob.glob(f"/proc/{pid}/task/*"):
        try:
            lines = Path(task, "status").read_text().splitlines()
        except OSError:
            continue  # the thread ended
        ctx[task] = sum(int(x.split()[1]) for x in lines if "ctxt_switches:" in x)
    rss = next(
        int(x.split()[1]) for x in Path(f"/proc/{pid}/status").read_text().splitlines()
        if x.startswith("VmRSS")
    )  # fmt: skip
    return {
        "t": time.monotonic(),
        "cpu": (int(stat[11]) + int(stat[12])) / HZ,
        "write_bytes": int(io["write_bytes"]),
        "ctx": ctx,
        "rss_kb": rss,
    }


def counted(proc: Proc) -> tuple[int, int] | None:
    """The daemon's own counts of bytes sent and received today."""
    s = status(proc) if proc.daemon else None
    if s is None:
        return None
    return int(s["today"]["bytes_sent"]), int(s["today"]["bytes_received"])


def main() -> int:
    p = argparse.ArgumentParser(description="what an idle volunteer pays")
    p.add_argument("--seconds", type=float, default=150, help="measured window")
    p.add_argument("--settle-s", type=float, default=30, help="wait after joining")
    p.add_argument("--hidden", type=int, default=32, help="the experts' hidden size")
    p.add_argument("--grid", type=int, nargs=2, default=(2, 2), help="experts: a x b")
    p.add_argument("--average-every-s", type=float, default=30.0, help="replica averaging")
    p.add_argument("--off-hours", action="store_true", help="add a daemon outside network hours")
    args = p.parse_args()

    print(f"volunteerd from {Path(volunteerd.__file__).resolve().parents[1]}", flush=True)
    names = ["serve-a", "serve-b", "paused"] + (["off-hours"] if args.off_hours else [])
    serve = [
        "serve", "--set", 'runtime.device="cpu"', "--set", "experiments.max_experts=4",
        "--set", f"replicas.average_every_s={args.average_every_s}",
    ]  # fmt: skip
    with tempfile.TemporaryDirectory(prefix="idle-cost-") as tmp, ExitStack() as stack:
        root = Path(tmp)
        seed = stack.enter_context(started("seed", root, "bootstrap"))
        boot = json.loads((seed.home / "ready.json").read_text())["multiaddrs"][0]
        invitation = publish(root, boot, args.hidden, args.grid)
        daemons = [stack.enter_context(started(n, root, *serve)) for n in names]
        for d in daemons:
            r = cli(d.home, "join", invitation, "--yes")
            if r.returncode != 0:
                raise SystemExit(f"{d.name}: join failed:\n{r.stdout}\n{r.stderr}")
        for d in daemons:
            wait_joined(d)
            print(f"{d.name} joined, hosting {', '.join(d.experts)}", flush=True)
        by_name = {d.name: d for d in daemons}
        r = cli(by_name["paused"].home, "pause")
        print(f"paused: {r.stdout.strip() or r.stderr.strip()}", flush=True)
        if args.off_hours:
            # a window starting 3 h from now (a whole hour, as the schedule wants)
            now = datetime.datetime.now()
            start, end = (now + datetime.timedelta(hours=h) for h in (3, 4))
            hours = f"{start:%H}:00-{end:%H}:00"
            r = cli(by_name["off-hours"].home, "schedule", "--network-hours", hours)
            said = [x for x in r.stdout.splitlines() if x.startswith("now")] or [r.stderr.strip()]
            print(f"off-hours: network hours {hours}; {said[0]}", flush=True)
        shared = set(by_name["serve-a"].experts) & set(by_name["serve-b"].experts)
        print(f"experts both serving daemons host (averaged): {len(shared)}", flush=True)
        print(f"settling {args.settle_s:.0f} s, then measuring {args.seconds:.0f} s", flush=True)
        time.sleep(args.settle_s)

        procs = [seed, *daemons]
        count0 = {x.name: counted(x) for x in procs}
        before = {x.name: sample(x.process.pid) for x in procs}
        time.sleep(args.seconds)
        after = {x.name: sample(x.process.pid) for x in procs}
        count1 = {x.name: counted(x) for x in procs}
        for x in procs:
            if x.process.poll() is not None:
                print(f"warning: {x.name} exited during the window", flush=True)

    print(
        f"\nidle swarm on 127.0.0.1: {args.grid[0]}x{args.grid[1]} experts of hidden "
        f"{args.hidden}, replication 2, averaging every {args.average_every_s:g} s; "
        f"window {args.seconds:.0f} s after {args.settle_s:.0f} s settling"
    )
    print(
        f"{'process':10} {'sent MB/h':>10} {'recv MB/h':>10} {'disk MB/h':>10} "
        f"{'CPU %':>7} {'ctx/s':>7} {'RSS MiB':>8}"
    )
    for x in procs:
        b, a = before[x.name], after[x.name]
        dt = a["t"] - b["t"]
        per_h = 3600 / dt / 1e6
        c0, c1 = count0[x.name], count1[x.name]
        if c0 and c1 and c1[0] >= c0[0]:
            sent, recv = f"{(c1[0] - c0[0]) * per_h:10.3f}", f"{(c1[1] - c0[1]) * per_h:10.3f}"
        else:  # the seed has no control API (or the day turned)
            sent = recv = f"{'-':>10}"
        ctx = sum(v - b["ctx"][t] for t, v in a["ctx"].items() if t in b["ctx"])
        print(
            f"{x.name:10} {sent} {recv} {(a['write_bytes'] - b['write_bytes']) * per_h:10.3f} "
            f"{100 * (a['cpu'] - b['cpu']) / dt:7.2f} {ctx / dt:7.1f} {a['rss_kb'] / 1024:8.0f}"
        )
    return 0


if __name__ == "__main__":
    sys.exit(main())
