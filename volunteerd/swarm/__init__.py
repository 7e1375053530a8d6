"""The swarm side of a volunteer: experiment manifests, which experts to host, and
joining an experiment (downloading experts' state from replicas)."""

from __future__ import annotations

from volunteerd.swarm.assignment import Choice, choose_experts
from volunteerd.swarm.manifest import (
    ExperimentManifest,
    choose_trusted,
    load_manifest_file,
    parse_manifest,
    sign_manifest,
)

__all__ = [
    "Choice",
    "ExperimentManifest",
    "choose_experts",
    "choose_trusted",
    "load_manifest_file",
    "parse_manifest",
    "sign_manifest",
]
