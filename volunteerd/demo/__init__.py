"""The embedded default: a local swarm and a trainer on text every machine has."""

from __future__ import annotations

from volunteerd.demo.local_swarm import LocalSwarm, SwarmNode
from volunteerd.demo.run import run_demo, run_training, trainer_config

__all__ = ["LocalSwarm", "SwarmNode", "run_demo", "run_training", "trainer_config"]
