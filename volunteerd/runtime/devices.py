"""Choosing the torch device named in the config."""

from __future__ import annotations

import torch

from volunteerd.errors import ConfigError

__all__ = ["choose_device"]


def choose_device(setting: str) -> torch.device:
    """``"auto"`` picks CUDA, then Apple MPS, then the CPU; a named device must exist."""
    if setting == "auto":
        if torch.cuda.is_available():
            return torch.device("cuda", torch.cuda.current_device())
        if torch.backends.mps.is_available():
            return torch.device("mps")
        return torch.device("cpu")
    device = torch.device(setting)
    if device.type == "cuda" and (
        not torch.cuda.is_available()
        or (device.index is not None and device.index >= torch.cuda.device_count())
    ):
        raise ConfigError(f"runtime.device = {setting!r}: no such CUDA device on this machine")
    if device.type == "mps" and not torch.backends.mps.is_available():
        raise ConfigError(f"runtime.device = {setting!r}: Apple MPS is not available here")
    return device
