"""The embedded default: a local swarm and a trainer on text every machine has."""

from __future__ import annotations

from volunteerd.demo.run import run_demo, run_training, trainer_config
from volunteerd.demo.swarm import LocalSwarm, SwarmNode

__all__ = ["LocalSwarm", "SwarmNode", "run_demo", "run_training", "trainer_config"]
