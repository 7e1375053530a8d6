"""Configuration: typed models, and loading them from file, environment and flags."""

from __future__ import annotations

from volunteerd.config.loading import dump_toml, load_config, parse_override
from volunteerd.config.models import (
    CONFIG_VERSION,
    CheckpointConfig,
    Config,
    DHTConfig,
    ExpertsConfig,
    GuardConfig,
    LoggingConfig,
    NetworkConfig,
    OptimizerConfig,
    PeerLimitsConfig,
    ReplicasConfig,
    RuntimeConfig,
    TimeoutsConfig,
    WireLimits,
)

__all__ = [
    "CONFIG_VERSION",
    "CheckpointConfig",
    "Config",
    "DHTConfig",
    "ExpertsConfig",
    "GuardConfig",
    "LoggingConfig",
    "NetworkConfig",
    "OptimizerConfig",
    "PeerLimitsConfig",
    "ReplicasConfig",
    "RuntimeConfig",
    "TimeoutsConfig",
    "WireLimits",
    "dump_toml",
    "load_config",
    "parse_override",
]
