"""Several ``volunteerd train`` processes of one experiment: they average their
trainer-side weights, survive one of them being killed, and a late one starts from
their state; ``volunteerd demo --trainers N`` runs several against the demo swarm."""

from __future__ import annotations

import json
import signal
import subprocess
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest

from tests.e2e.conftest import cli_env
from tests.e2e.test_demo import alive, descendants
from volunteerd.demo.local_swarm import (
    LocalSwarm,
    TrainerProcess,
    start_trainer,
    stop_trainers,
    wait_trainers,
    write_experiment,
)
from volunteerd.train import Experiment

# Each test starts a swarm of processes and several trainers.
pytestmark = pytest.mark.slow

# A model small enough for 3 trainers, 3 daemons and a bootstrap node on 2 cores (about
# 4 steps/s each), averaging every 3 s. 3 daemons host one row of the 3x2 grid each.
STEPS = 240
LATE_STEPS = 30
EXPERIMENT = Experiment.model_validate(
    {
        "name": "e2e-trainers",
        "data": {"max_bytes": 300_000},
        "model": {
            "hidden_dim": 32,
            "num_blocks": 1,
            "num_heads": 2,
            "seq_len": 32,
            "grid": [3, 2],
            "uid_prefix": "avg",
            "k_best": 2,
        },
        "training": {
            "batch_size": 8,
            "steps": STEPS,
            "eval_every": 10,
            "eval_batches": 2,
            "lr": 0.01,
        },
        "experts": {"name": "adam", "lr": 0.01},
        "averaging": {"every_s": 3.0, "timeout_s": 10.0, "group_size": 3},
    }
)


def wait_for(
    condition: Callable[[], bool], trainers: list[TrainerProcess], timeout_s: float, what: str
) -> None:
    """Poll ``condition`` until it holds; fail (with the logs) if a trainer exits first
    or it does not hold within ``timeout_s``."""
    deadline = time.monotonic() + timeout_s
    while not condition():
        for t in trainers:
            if t.process.poll() is not None:
                raise AssertionError(
                    f"{t.name} exited with {t.process.returncode} before {what}:\n"
                    + t.log_file.read_text(errors="replace")[-3000:]
                )
        if time.monotonic() > deadline:
            logs = "\n".join(
                f"--- {t.name}\n{t.log_file.read_text(errors='replace')[-1500:]}" for t in trainers
            )
            raise AssertionError(f"not {what} within {timeout_s:.0f}s:\n{logs}")
        time.sleep(0.2)


def round_peers(summary: dict[str, Any]) -> set[str]:
    return {peer for _, peers in summary["rounds_log"] for peer in peers}


def rounds_after(summary: dict[str, Any], moment: float) -> list[list[str]]:
    """The peers of each round that completed after ``moment`` (``time.time()``):
    ``rounds_log`` counts seconds from the start of training, ``started_at``."""
    return [
        peers for offset, peers in summary["rounds_log"] if summary["started_at"] + offset > moment
    ]


@pytest.mark.timeout(600)
def test_three_trainers_average_survive_a_kill_and_a_late_one_starts_from_their_state(
    tmp_path: Path,
) -> None:
    config = write_experiment(EXPERIMENT, tmp_path / "experiment.toml")
    with LocalSwarm.for_experiment(EXPERIMENT, 3) as swarm:
        bootstrap = swarm.bootstrap_addrs[0]
        trainers = [
            start_trainer(name, config, bootstrap, steps=STEPS, workdir=tmp_path)
            for name in ("first", "second", "victim")
        ]
        first, second, victim = trainers
        late: TrainerProcess | None = None
        try:
            # Well into training (a third of the steps: rounds every 3 s since the start),
            # the victim is killed outright, in whatever it is doing.
            wait_for(
                lambda: all(t.steps_done() >= STEPS // 3 for t in trainers),
                trainers,
                300,
                "a third of the steps done",
            )
            victim.process.kill()
            killed_at = time.time()
            victim.process.wait(10)
            # A fourth trainer joins while the other two train on.
            late = start_trainer("late", config, bootstrap, steps=LATE_STEPS, workdir=tmp_path)
            wait_trainers([first, second, late], timeout_s=400)
        finally:
            stop_trainers([*trainers, *([late] if late else [])])
    assert late is not None
    a, b, d = first.summary(), second.summary(), late.summary()

    # Both survivors trained all their steps, and learnt.
    for s in (a, b):
        assert s["steps"] == STEPS
        assert s["skipped_steps"] == 0
        assert s["final_val_loss"] < 0.7 * s["initial_val_loss"]
        assert s["trainers"] >= 3
        assert s["averaging_rounds"] >= 1
        assert s["started_from"] == "seed"
    assert a["peer_id"] != b["peer_id"]

    # They averaged with each other and with the victim (before it died: after, it
    # could not answer).
    assert b["peer_id"] in round_peers(a)
    assert a["peer_id"] in round_peers(b)
    (victim_id,) = (round_peers(a) | round_peers(b)) - {a["peer_id"], b["peer_id"], d["peer_id"]}

    # After the kill both went on: rounds completed without the victim. A round is
    # logged when the training thread applies it, up to a step (and a check) after its
    # replies came in: one applied just after the kill may hold what the victim sent
    # just before it, so the victim's absence is asserted from 3 s after the kill on.
    for s, trainer in ((a, first), (b, second)):
        after = rounds_after(s, killed_at)
        assert after, f"{trainer.name} completed no round after the kill: {s['rounds_log']}"
        assert all(peers for peers in after)
        assert all(victim_id not in peers for peers in rounds_after(s, killed_at + 3.0))

    # The late trainer started from a survivor's averaged state, not from the seed: its
    # first validation loss is its source's at about the same update, far below the
    # seed's (where the survivors started).
    assert d["steps"] == LATE_STEPS
    assert d["started_from"] in {a["peer_id"], b["peer_id"]}
    source = a if d["started_from"] == a["peer_id"] else b
    assert d["join_s"] > 0  # it looked for, downloaded and checked a state
    version = d["started_from_version"]
    assert version > 0
    step, loss = min(source["val_curve"], key=lambda point: abs(point[0] - version))
    assert abs(d["initial_val_loss"] - loss) <= 0.10 * loss, (d["initial_val_loss"], step, loss)
    assert d["initial_val_loss"] < 0.7 * source["initial_val_loss"]


@pytest.mark.timeout(400)
def test_demo_with_two_trainers_reports_each_and_ctrl_c_stops_them_all(tmp_path: Path) -> None:
    # One run covers both: a demo of two trainers stopped with Ctrl-C stops every
    # process it started, and still reports each trainer (a table, and the other
    # trainer's summary in the summary JSON).
    summary_path = tmp_path / "summary.json"
    process = subprocess.Popen(
        [sys.executable, "-m", "volunteerd", "demo", "--trainers", "2", "--nodes", "2",
         "--steps", "5000", "--summary-json", str(summary_path)],
        env=cli_env(tmp_path), stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True,
    )  # fmt: skip
    try:
        assert process.stderr is not None
        deadline = time.monotonic() + 180
        for line in process.stderr:
            if "training 5000 steps" in line:
                break
            assert time.monotonic() < deadline, "the swarm did not start"
        for line in process.stderr:
            if line.startswith("model:"):  # the demo's own trainer is about to train
                break
        children = descendants(process.pid)
        assert len(children) >= 4, "a bootstrap node, two daemons and one more trainer"
        process.send_signal(signal.SIGINT)
        assert process.wait(120) == 130
        deadline = time.monotonic() + 30
        while alive(children) and time.monotonic() < deadline:
            time.sleep(0.2)
        assert alive(children) == []
        rest = process.stderr.read()
        assert "trainer1" in rest
        assert "trainer2" in rest
        assert "all trainers together:" in rest
        summary = json.loads(summary_path.read_text())
        assert summary["interrupted"]
        (other,) = summary["other_trainers"]
        assert other is not None, "the other trainer wrote its summary when stopped"
        assert other["interrupted"]
        assert other["peer_id"] != summary["peer_id"]
    finally:
        if process.poll() is None:
            process.kill()
        process.wait(10)
        process.stderr.close()
