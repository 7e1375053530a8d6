"""volunteerd: train huge neural networks together on home PCs (Learning@home over libp2p)."""

from __future__ import annotations

from importlib.metadata import PackageNotFoundError, version

try:
    __version__ = version("volunteerd")
except PackageNotFoundError:  # running from a checkout without an install
    __version__ = "0.0.0+unknown"

__all__ = ["__version__"]
