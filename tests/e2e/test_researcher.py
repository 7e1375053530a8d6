"""What a researcher does, with the files docs/training.md shows (so the page cannot
rot): publish examples/experiment.toml, train with examples/trainer.toml, run
examples/own_model.py, against a swarm started by hand; and `train` reaching a
hand-started `ffn.*` swarm by naming the grid (`model.layer_names`)."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from tests.e2e.conftest import cli_env, publish
from volunteerd.errors import ExitCode
from volunteerd.swarm.invitation import parse_invitation

# Each test starts a bootstrap node and a daemon, and trains against them.
pytestmark = pytest.mark.slow

ROOT = Path(__file__).resolve().parents[2]
EXAMPLES = ROOT / "examples"

HAND_STARTED = """
[data]
max_bytes = 100000
[model]
layer_names = ["ffn"]
grid = [2, 2]
hidden_dim = 32
num_heads = 2
seq_len = 16
[training]
batch_size = 4
eval_batches = 1
eval_every = 1000
"""


def train(home: Path, config: Path, *swarm: str, steps: int) -> dict:  # type: ignore[type-arg]
    home.mkdir(exist_ok=True)
    summary = home / "summary.json"
    result = subprocess.run(
        [sys.executable, "-m", "volunteerd", "train", "--config", str(config), *swarm,
         "--listen-host", "127.0.0.1", "--steps", str(steps), "--summary-json", str(summary)],
        env=cli_env(home), capture_output=True, text=True, timeout=240, check=False,
    )  # fmt: skip
    assert result.returncode == ExitCode.OK, result.stderr[-3000:]
    data: dict = json.loads(summary.read_text())  # type: ignore[type-arg]
    return data


def serve(spawn, boot: str, experts: str, hidden_dim: int):  # type: ignore[no-untyped-def]
    server = spawn(
        "server", "serve", "--experts", experts, "--bootstrap", boot,
        "--set", f"experts.hidden_dim={hidden_dim}", "--set", 'runtime.device="cpu"',
    )  # fmt: skip
    server.wait_ready()
    return server


def test_train_reaches_a_hand_started_ffn_swarm_by_naming_its_grid(spawn, tmp_path: Path) -> None:  # type: ignore[no-untyped-def]
    boot = spawn("boot", "bootstrap").wait_ready()["multiaddrs"][0]
    serve(spawn, boot, "ffn.[0:2].[0:2]", 32)
    config = tmp_path / "hand.toml"
    config.write_text(HAND_STARTED)

    summary = train(tmp_path / "trainer", config, "--bootstrap", boot, steps=3)

    assert summary["steps"] == 3
    assert summary["expert_calls"] > 0
    assert set(summary["experts"]) <= {f"ffn.{i}.{j}" for i in range(2) for j in range(2)}


@pytest.mark.timeout(420)
def test_the_examples_publish_train_and_run_a_model_of_ones_own(spawn, tmp_path: Path) -> None:  # type: ignore[no-untyped-def]
    boot = spawn("boot", "bootstrap").wait_ready()["multiaddrs"][0]
    # The experts examples/experiment.toml names, hosted by a daemon started by hand.
    serve(spawn, boot, "ffn.[0:4].[0:4]", 128)

    owner_home = tmp_path / "owner"
    line = publish(owner_home, EXAMPLES / "experiment.toml", boot)
    invitation = parse_invitation(line)
    assert invitation.name == "stdlib-chars"

    # examples/trainer.toml as it is, with the invitation (as docs/training.md says).
    summary = train(owner_home, EXAMPLES / "trainer.toml", "--invitation", line, steps=2)
    assert summary["steps"] == 2
    assert summary["expert_calls"] > 0
    assert set(summary["experts"]) <= {f"ffn.{i}.{j}" for i in range(4) for j in range(4)}

    own = subprocess.run(
        [sys.executable, str(EXAMPLES / "own_model.py"), "--bootstrap", boot, "--steps", "5"],
        env=cli_env(tmp_path / "own"), capture_output=True, text=True, timeout=240, check=False,
    )  # fmt: skip
    assert own.returncode == 0, own.stderr[-3000:]
    assert "step 1: loss" in own.stdout
    done = own.stdout.strip().splitlines()[-1]
    assert done.startswith("done: ")
    answers = int(done.split()[1])
    assert answers > 0, own.stdout
