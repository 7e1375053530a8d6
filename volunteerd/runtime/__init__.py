"""The expert runtime: bounded per-expert lanes, one batcher and one worker per device."""

from __future__ import annotations

from volunteerd.runtime.batching import DeviceBatcher, Lane, QueueStats
from volunteerd.runtime.devices import choose_device
from volunteerd.runtime.executor import DeviceExecutor, ExecutorStats
from volunteerd.runtime.retained import RetainedStats, RetainedStore
from volunteerd.runtime.service import ExpertRuntime, ExpertStats

__all__ = [
    "DeviceBatcher",
    "DeviceExecutor",
    "ExecutorStats",
    "ExpertRuntime",
    "ExpertStats",
    "Lane",
    "QueueStats",
    "RetainedStats",
    "RetainedStore",
    "choose_device",
]
