"""Shipped helpers for tests and benchmarks: real local swarms on 127.0.0.1."""

from __future__ import annotations

from volunteerd.testing.nodes import (
    Restartable,
    local_config,
    open_daemon,
    open_node_and_peers,
    open_peer,
)

__all__ = ["Restartable", "local_config", "open_daemon", "open_node_and_peers", "open_peer"]
