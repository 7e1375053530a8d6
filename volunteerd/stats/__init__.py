"""Contribution accounting, persisted in SQLite in the user data folder."""

from __future__ import annotations

from volunteerd.stats.store import HOUR, StatsStore, Totals, Traffic, Work

__all__ = ["HOUR", "StatsStore", "Totals", "Traffic", "Work"]
