"""Configuration: typed models, and loading them from file, environment and flags."""

from __future__ import annotations

from volunteerd.config.loading import (
    LIMITS_FILE,
    dump_toml,
    limits_overlay_toml,
    load_config,
    parse_override,
)
from volunteerd.config.models import (
    CONFIG_VERSION,
    CheckpointConfig,
    Config,
    DHTConfig,
    ExperimentsConfig,
    ExpertsConfig,
    GuardConfig,
    HardwareConfig,
    LimitsConfig,
    LoggingConfig,
    NetworkConfig,
    OptimizerConfig,
    PeerLimitsConfig,
    ReachabilityConfig,
    ReplicasConfig,
    RuntimeConfig,
    TimeoutsConfig,
    WireLimits,
)

__all__ = [
    "CONFIG_VERSION",
    "LIMITS_FILE",
    "CheckpointConfig",
    "Config",
    "DHTConfig",
    "ExperimentsConfig",
    "ExpertsConfig",
    "GuardConfig",
    "HardwareConfig",
    "LimitsConfig",
    "LoggingConfig",
    "NetworkConfig",
    "OptimizerConfig",
    "PeerLimitsConfig",
    "ReachabilityConfig",
    "ReplicasConfig",
    "RuntimeConfig",
    "TimeoutsConfig",
    "WireLimits",
    "dump_toml",
    "limits_overlay_toml",
    "load_config",
    "parse_override",
]
