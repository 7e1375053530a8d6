"""The dashboard's limits form notes a daily or monthly quota set below what the daemon's
upkeep alone moves (quota.js), as ``volunteerd limit`` warns: by the daemon's count of
its hours serving nothing, else the documented floor (0.5 GB a day, 15 GB a month)."""

from __future__ import annotations

import json
import shutil
import subprocess
from pathlib import Path
from typing import Any

import pytest

import volunteerd

QUOTA_JS = Path(volunteerd.__file__).parent / "dashboard" / "static" / "quota.js"
NODE = shutil.which("node")
pytestmark = pytest.mark.skipif(NODE is None, reason="no node to run the page's script")
NOW = 1_800_000_000.0


def warnings(limits: dict[str, float], history: list[dict[str, Any]] | None) -> list[str]:
    stats = None if history is None else {"history": history}
    script = (
        f"import {{ quotaWarnings, upkeepGbADay }} from {json.dumps(QUOTA_JS.as_uri())};\n"
        f"const upkeep = upkeepGbADay({json.dumps(stats)}, {NOW});\n"
        f"console.log(JSON.stringify(quotaWarnings({json.dumps(limits)}, upkeep)));\n"
    )
    done = subprocess.run(
        [str(NODE), "--input-type=module", "-e", script],
        capture_output=True,
        text=True,
        timeout=60,
        check=True,
    )
    return list(json.loads(done.stdout))


def hour(ago: int, moved: int, calls: int = 0) -> dict[str, Any]:
    start = NOW // 3600 * 3600 - 3600 * ago
    return {
        "start": start,
        "size_s": 3600,
        "forward": calls,
        "backward": 0,
        "bytes_sent": moved // 2,
        "bytes_received": moved - moved // 2,
    }


def test_a_quota_below_the_daemons_own_count_of_its_upkeep_is_noted() -> None:
    history = [hour(i, 16_100_000) for i in range(1, 7)] + [hour(9, 900_000_000, calls=5)]
    history.append(hour(0, 1))  # the hour under way
    found = warnings({"daily_quota_gb": 0.2, "monthly_quota_gb": 0}, history)
    assert len(found) == 1
    assert "daily quota of 0.2 GB is below what upkeep alone uses" in found[0]
    assert "moved 0.39 GB a day while it served nothing" in found[0]
    assert warnings({"daily_quota_gb": 0.5, "monthly_quota_gb": 12}, history) == []


def test_without_enough_idle_hours_the_floor_is_the_mark() -> None:
    found = warnings({"daily_quota_gb": 0.4, "monthly_quota_gb": 14}, None)
    assert [w.split(" GB")[0] for w in found] == [
        "The daily quota of 0.4",
        "The monthly quota of 14",
    ]
    assert "about 0.5 GB a day" in found[0]
    assert warnings({"daily_quota_gb": 0, "monthly_quota_gb": 15}, [hour(1, 10)]) == []


def test_an_hour_of_averaging_or_one_barely_run_does_not_set_the_mark() -> None:
    """As ``volunteerd limit``: the median of the idle hours that moved anything, so an
    hour of replica averaging (1 GB: 24 GB a day in a mean) or hours the daemon ran
    minutes of do not set it."""
    history = [hour(i, 16_100_000) for i in range(1, 6)] + [hour(6, 1_000_000_000)]
    history += [hour(i, 0) for i in range(7, 13)]
    assert warnings({"daily_quota_gb": 2, "monthly_quota_gb": 0}, history) == []
    found = warnings({"daily_quota_gb": 0.2, "monthly_quota_gb": 0}, history)
    assert "moved 0.39 GB a day while it served nothing" in found[0]
