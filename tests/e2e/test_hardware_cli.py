"""`volunteerd hardware` in a real memory cgroup, as in a container or under systemd's
``MemoryMax=``. Making a cgroup takes root and a cgroup file system; elsewhere the test
is skipped."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import pytest

from tests.e2e.conftest import cli_env

pytestmark = pytest.mark.slow

GIB = 1 << 30


def _make(parent: Path, limit_file: str) -> Path:
    folder = parent / f"volunteerd-test-{os.getpid()}"
    folder.mkdir()
    try:
        (folder / limit_file).write_text(str(GIB))
    except OSError:
        folder.rmdir()
        raise
    return folder


@pytest.fixture
def memory_cgroup() -> Iterator[Path]:
    """A memory cgroup limited to 1 GiB (v1, else v2), removed afterwards."""
    tries = [
        (Path("/sys/fs/cgroup/memory"), "memory.limit_in_bytes"),
        (Path("/sys/fs/cgroup"), "memory.max"),  # v2: needs memory in subtree_control
    ]
    folder = None
    for parent, limit_file in tries:
        if (parent / limit_file).exists() or (parent / "cgroup.subtree_control").exists():
            try:
                folder = _make(parent, limit_file)
                break
            except OSError:
                continue
    if folder is None:
        pytest.skip("no memory cgroup can be made here (needs root and a cgroup file system)")
    try:
        yield folder
    finally:
        folder.rmdir()  # its process has exited; a v1 cgroup's charges go to the parent


def test_hardware_in_a_1_gib_cgroup_budgets_under_the_limit(
    memory_cgroup: Path, tmp_path: Path
) -> None:
    """In a 1 GiB memory cgroup on a 24 GiB machine the budget was 10.1 GiB, "58 fit",
    and `serve` was OOM-killed (an outside audit)."""
    (tmp_path / "config.toml").write_text('[experts]\nhidden_dim = 32\n[runtime]\ndevice = "cpu"\n')
    result = subprocess.run(
        [
            "sh", "-c", 'echo $$ > "$1/cgroup.procs" && exec "$0" -m volunteerd hardware --json',
            sys.executable, str(memory_cgroup),
        ],
        env=cli_env(tmp_path),
        capture_output=True,
        text=True,
        timeout=120,
        check=False,
    )  # fmt: skip
    assert result.returncode == 0, result.stderr
    report = json.loads(result.stdout)
    assert report["hardware"]["memory_bytes"] <= GIB
    assert f"/{memory_cgroup.name}: limit 1.0 GiB," in report["hardware"]["memory_limit"]
    assert 0 < report["capacity"]["budget_bytes"] <= GIB // 2
    assert report["capacity"]["budget_source"].startswith("half of the available memory under")
