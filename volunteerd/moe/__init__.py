"""The trainer side: remote experts and decentralized mixtures of experts as torch modules.

``NoExpertsAvailable`` and ``ModelDiverging`` live in ``volunteerd.errors`` with every
other error; they are named here too, where a researcher looks for them.
"""

from __future__ import annotations

from volunteerd.errors import ModelDiverging, NoExpertsAvailable
from volunteerd.moe.checks import OutputChecks
from volunteerd.moe.client import SwarmClient
from volunteerd.moe.directory import ExpertDirectory
from volunteerd.moe.layer import (
    LocalMixtureOfExperts,
    MixtureOfExperts,
    MoEStats,
    RemoteMixtureOfExperts,
    grid_uids,
)
from volunteerd.moe.remote_expert import RemoteExpert
from volunteerd.moe.routing import Route, beam_search

__all__ = [
    "ExpertDirectory",
    "LocalMixtureOfExperts",
    "MixtureOfExperts",
    "MoEStats",
    "ModelDiverging",
    "NoExpertsAvailable",
    "OutputChecks",
    "RemoteExpert",
    "RemoteMixtureOfExperts",
    "Route",
    "SwarmClient",
    "beam_search",
    "grid_uids",
]
