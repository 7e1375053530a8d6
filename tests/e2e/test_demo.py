"""``volunteerd demo``: the embedded default trains, reports, and cleans up after itself."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from tests.e2e.conftest import cli_env

# Each test starts volunteerd as a process (most, a daemon or a swarm of them).
pytestmark = pytest.mark.slow


def descendants(pid: int) -> list[int]:
    out = subprocess.run(
        ["ps", "-eo", "pid=,ppid="], capture_output=True, text=True, check=True
    ).stdout
    children: dict[int, list[int]] = {}
    for line in out.splitlines():
        child, parent = map(int, line.split())
        children.setdefault(parent, []).append(child)
    found, todo = [], [pid]
    while todo:
        for child in children.get(todo.pop(), []):
            found.append(child)
            todo.append(child)
    return found


def alive(pids: list[int]) -> list[int]:
    result = []
    for pid in pids:
        try:
            os.kill(pid, 0)
        except ProcessLookupError:
            continue
        state = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
        if state != "Z":
            result.append(pid)
    return result


def test_demo_trains_a_language_model_on_a_local_swarm(tmp_path: Path) -> None:
    summary_path = tmp_path / "summary.json"
    result = subprocess.run(
        [sys.executable, "-m", "volunteerd", "demo", "--steps", "60", "--nodes", "2",
         "--summary-json", str(summary_path)],
        env=cli_env(tmp_path), capture_output=True, text=True, timeout=600, check=False,
    )  # fmt: skip
    assert result.returncode == 0, result.stderr[-3000:]
    summary = json.loads(summary_path.read_text())
    assert summary["steps"] == 60
    assert summary["nodes"] == 2
    assert summary["expert_calls"] > 0
    assert summary["failed_calls"] == 0
    # It learns: clearly below where it started, and below a context-free model.
    assert summary["final_val_loss"] < 0.6 * summary["initial_val_loss"]
    assert summary["final_val_loss"] < summary["unigram_loss"]
    assert "validation loss" in result.stderr
    assert "who served what" in result.stderr
    for name in ("node1", "node2"):
        assert name in result.stderr
    assert "watch node1 at work in a browser: http://127.0.0.1:" in result.stderr
    assert "/#token=" in result.stderr


def test_demo_ctrl_c_stops_every_process_it_started(tmp_path: Path) -> None:
    process = subprocess.Popen(
        [sys.executable, "-m", "volunteerd", "demo", "--steps", "5000", "--nodes", "2"],
        env=cli_env(tmp_path), stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True,
    )  # fmt: skip
    try:
        assert process.stderr is not None
        deadline = time.monotonic() + 120
        for line in process.stderr:
            if "training 5000 steps" in line:
                break
            assert time.monotonic() < deadline, "the swarm did not start"
        children = descendants(process.pid)
        assert len(children) >= 3, "a bootstrap node and two daemons"
        time.sleep(2)
        process.send_signal(signal.SIGINT)
        assert process.wait(60) == 130
        deadline = time.monotonic() + 15
        while alive(children) and time.monotonic() < deadline:
            time.sleep(0.2)
        assert alive(children) == []
    finally:
        if process.poll() is None:
            process.kill()
        process.wait(10)
        process.stderr.close()


def test_demo_local_baseline_needs_no_swarm(tmp_path: Path) -> None:
    summary_path = tmp_path / "local.json"
    result = subprocess.run(
        [sys.executable, "-m", "volunteerd", "demo", "--local", "--steps", "15",
         "--summary-json", str(summary_path)],
        env=cli_env(tmp_path), capture_output=True, text=True, timeout=300, check=False,
    )  # fmt: skip
    assert result.returncode == 0, result.stderr[-3000:]
    summary = json.loads(summary_path.read_text())
    assert summary["mode"] == "local"
    assert summary["nodes"] == 0
    assert summary["expert_calls"] == 0
    assert summary["final_val_loss"] < summary["initial_val_loss"]


EXPERIMENT = """
name = "tiny"
[data]
max_bytes = 200000
[model]
hidden_dim = 32
num_blocks = 1
num_heads = 2
seq_len = 16
grid = [2, 2]
uid_prefix = "tiny"
k_best = 2
[training]
batch_size = 4
steps = 6
eval_every = 3
eval_batches = 2
"""


def test_train_runs_an_experiment_file_against_a_swarm(spawn, tmp_path: Path) -> None:  # type: ignore[no-untyped-def]
    boot = spawn("boot", "bootstrap").wait_ready()
    server = spawn(
        "server", "serve", "--experts", "tiny0.[0:2].[0:2]", "--bootstrap",
        boot["multiaddrs"][0], "--set", "experts.hidden_dim=32", "--set", 'runtime.device="cpu"',
    )  # fmt: skip
    server.wait_ready()
    experiment = tmp_path / "experiment.toml"
    experiment.write_text(EXPERIMENT)
    summary_path = tmp_path / "train.json"
    result = subprocess.run(
        [sys.executable, "-m", "volunteerd", "train", "--config", str(experiment),
         "--bootstrap", boot["multiaddrs"][0], "--summary-json", str(summary_path)],
        env=cli_env(tmp_path), capture_output=True, text=True, timeout=300, check=False,
    )  # fmt: skip
    assert result.returncode == 0, result.stderr[-3000:]
    summary = json.loads(summary_path.read_text())
    assert summary["steps"] == 6
    assert summary["expert_calls"] > 0
    assert summary["failed_calls"] == 0
    assert set(summary["experts"]) <= {f"tiny0.{i}.{j}" for i in range(2) for j in range(2)}

    experiment.write_text(EXPERIMENT.replace("k_best = 2", "k_best = 2\nk_worst = 1"))
    bad = subprocess.run(
        [sys.executable, "-m", "volunteerd", "train", "--config", str(experiment)],
        env=cli_env(tmp_path), capture_output=True, text=True, timeout=60, check=False,
    )  # fmt: skip
    assert bad.returncode == 3
    assert "model.k_worst: unknown key" in bad.stderr


def test_a_swarm_process_runs_the_package_its_parent_imported(tmp_path: Path) -> None:
    """A folder named ``volunteerd`` in the working folder (another checkout; a worktree
    of an earlier commit) is what ``python -m volunteerd`` imports first; the swarm's
    processes run the parent's package wherever they are started."""
    from volunteerd.demo.local_swarm import VOLUNTEERD, child_env

    decoy = tmp_path / "volunteerd"
    decoy.mkdir()
    (decoy / "__init__.py").write_text("raise SystemExit('the decoy ran')\n")
    (decoy / "__main__.py").write_text("raise SystemExit('the decoy ran')\n")
    env = child_env(tmp_path / "home")

    plain = subprocess.run(
        [sys.executable, "-m", "volunteerd", "--version"],
        cwd=tmp_path, env=env, capture_output=True, text=True, timeout=120,
    )  # fmt: skip
    assert "the decoy ran" in plain.stderr  # the trap is real

    run = subprocess.run(
        [*VOLUNTEERD, "--version"],
        cwd=tmp_path, env=env, capture_output=True, text=True, timeout=120,
    )  # fmt: skip
    assert run.returncode == 0, run.stderr
    assert run.stdout.startswith("volunteerd ")
    code = "import volunteerd; print(volunteerd.__file__)"
    where = subprocess.run(
        [VOLUNTEERD[0], "-P", "-c", code],
        cwd=tmp_path, env=env, capture_output=True, text=True, timeout=120, check=True,
    )  # fmt: skip
    import volunteerd

    assert Path(where.stdout.strip()) == Path(volunteerd.__file__).resolve()
