"""A long statistics history: how long the dashboard's reads take, and whether counting
waits for them.

What it measures
    A ``stats.sqlite3`` of ``--experts`` experts x ``--days`` days of quarter-hour rows
    (written through ``StatsStore`` itself with a fake clock, then rolled up as the
    daemon does; 512 x 21 is 718k rows, 84 MB), or a copy of ``--file``. Reported: the
    time of each read that ``GET /status`` ("today") and ``GET /stats`` (the last
    25 hours, today, the week, all time) make, and the longest ``tick()`` and
    ``record()`` (what the daemon's event loop calls each second and on each answered
    call) while ``/stats``'s reads run in another thread, a flush every 0.1 s beside
    them. To see a version from before, run this script in a checkout of it
    (``PYTHONPATH`` set to that checkout).

Run::

    .venv/bin/python benchmarks/stats_queries.py
    .venv/bin/python benchmarks/stats_queries.py --file stats.sqlite3
"""

from __future__ import annotations

import argparse
import random
import shutil
import tempfile
import threading
import time
from pathlib import Path

from volunteerd.stats.store import StatsStore


def build(path: Path, experts: int, days: int) -> None:
    """Quarter-hour rows of ``experts`` experts over ``days`` days up to now."""
    now = time.time()
    clock = [now - days * 86400]
    store = StatsStore.open(path, clock=lambda: clock[0])
    rng = random.Random(1)
    uids = [f"ffn.{i // 32}.{i % 32}" for i in range(experts)]
    while clock[0] < now - 1800:
        for uid in uids:
            store.record(uid, forward=rng.randint(0, 50), backward=rng.randint(0, 50))
            if rng.random() < 0.05:
                store.reject(uid, "busy", rng.randint(1, 9))
        store.tick(600, paused=False)
        store.transferred(up=rng.randint(0, 10**8), down=rng.randint(0, 10**8))
        store.flush()
        clock[0] += 900
    clock[0] = now
    store.roll_up()
    store.close()


def timed(read: object) -> float:
    start = time.perf_counter()
    read()  # type: ignore[operator]
    return time.perf_counter() - start


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--experts", type=int, default=512)
    parser.add_argument("--days", type=int, default=21)
    parser.add_argument("--file", type=Path, help="a stats.sqlite3 to read (a copy of it)")
    args = parser.parse_args()
    with tempfile.TemporaryDirectory() as scratch:
        path = Path(scratch) / "stats.sqlite3"
        if args.file:
            shutil.copy(args.file, path)
        else:
            build(path, args.experts, args.days)
        store = StatsStore.open(path)
        now = time.time()
        midnight = now - now % 86400
        reads = {
            "today (/status)": lambda: store.current(midnight),
            "history, 25 h": lambda: (
                store.history(now - 90000),
                store.traffic_history(now - 90000),
            ),
            "week": lambda: store.current(now - 7 * 86400),
            "all time": lambda: store.current(0.0),
        }
        print(f"{store.file_rows():,} rows, {path.stat().st_size / 1e6:.0f} MB")
        print("| read | s (best of 3) |\n|---|---|")
        for name, read in reads.items():
            print(f"| {name} | {min(timed(read) for _ in range(3)):.3f} |")
        done = threading.Event()

        def stats_page() -> None:
            for read in reads.values():
                read()
            done.set()

        def flushes() -> None:
            while not done.wait(0.1):
                store.flush()

        longest = {"tick()": 0.0, "record()": 0.0}
        threads = [threading.Thread(target=stats_page), threading.Thread(target=flushes)]
        page_start = time.perf_counter()
        for thread in threads:
            thread.start()
        while not done.is_set():
            longest["tick()"] = max(
                longest["tick()"], timed(lambda: store.tick(0.001, paused=False))
            )
            longest["record()"] = max(
                longest["record()"], timed(lambda: store.record("ffn.0.0", forward=1))
            )
            time.sleep(0.001)
        page_s = time.perf_counter() - page_start
        for thread in threads:
            thread.join()
        print(f"\nwhile /stats's reads ran ({page_s:.2f} s), a flush each 0.1 s beside them:")
        print("| call | longest, s |\n|---|---|")
        for name, seconds in longest.items():
            print(f"| {name} | {seconds:.3f} |")
        store.close()


if __name__ == "__main__":
    main()
