"""The trainer side: remote experts as torch modules."""

from __future__ import annotations

from volunteerd.moe.remote_expert import RemoteExpert

__all__ = ["RemoteExpert"]
