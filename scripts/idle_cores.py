"""Print how many pytest workers scripts/test should start: the cores idle over one
second, rounded down (with a quarter core of slack), at most 2; 0 means one process."""

from __future__ import annotations

import os
import time

MAX_WORKERS = 2


def _idle_and_total() -> tuple[int, int]:
    with open("/proc/stat") as stat:
        ticks = [int(x) for x in stat.readline().split()[1:]]
    return ticks[3] + ticks[4], sum(ticks)  # idle + iowait, all


def idle_cores() -> float:
    cores = os.cpu_count() or 1
    try:
        idle0, total0 = _idle_and_total()
        time.sleep(1.0)
        idle1, total1 = _idle_and_total()
    except OSError:  # no /proc (macOS): the load average instead
        return cores - os.getloadavg()[0]
    return cores * (idle1 - idle0) / max(1, total1 - total0)


if __name__ == "__main__":
    workers = min(MAX_WORKERS, int(idle_cores() + 0.25))
    print(workers if workers >= 2 else 0)
