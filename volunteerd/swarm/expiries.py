"""When each project's last manifest expires, kept across restarts in
``<data dir>/manifests.json``.

A manifest lives until its ``expires_at``; then storing peers drop it, and a daemon
that looks for it finds nothing, as it does when the network is down or the bootstrap
peers are wrong. The joiner records the expiry of each manifest it takes, so that
"not found" after that time can say what happened: the owner let it expire and must
publish it again (``swarm.joiner``). The file is the daemon's (one runs per data
folder)::

    {"tiny-lm": {"12D3KooW...": 1767830400.0}}
"""

from __future__ import annotations

import json
import logging
import math
import threading
from collections.abc import Iterable
from pathlib import Path

from volunteerd.atomic import read_small, write_atomic

__all__ = ["ManifestExpiries"]

logger = logging.getLogger(__name__)

# Names kept: a volunteer is in at most 16 projects (swarm.projects); the latest ones
# stay when more were seen over time.
_MAX_NAMES = 64
_MAX_BYTES = 1 << 20


class ManifestExpiries:
    """The ``expires_at`` of the last manifest taken of each (name, owner)."""

    def __init__(self, path: Path) -> None:
        self._path = path
        self._lock = threading.Lock()  # the joiners' threads, one at a time

    def remember(self, name: str, owner: str, expires_at: float) -> None:
        """Record ``expires_at`` for ``name`` of ``owner``. A file that cannot be
        written is logged (the expiry is then not known after a restart)."""
        with self._lock:
            kept = self._read()
            kept.setdefault(name, {})[owner] = expires_at
            if len(kept) > _MAX_NAMES:
                latest = sorted(kept, key=lambda n: max(kept[n].values()), reverse=True)
                kept = {n: kept[n] for n in latest[:_MAX_NAMES]}
            try:
                write_atomic(self._path, json.dumps(kept, sort_keys=True))
            except OSError as exc:
                logger.warning("could not record when manifest %r expires: %s", name, exc)

    def expired_at(self, name: str, owners: Iterable[str], now: float) -> float | None:
        """When the last manifest of ``name`` from one of ``owners`` expired, if all
        known ones did by ``now``; None when none is known or one is still valid."""
        with self._lock:
            known = self._read().get(name, {})
        times = [known[o] for o in owners if o in known]
        if not times or max(times) > now:
            return None
        return max(times)

    def _read(self) -> dict[str, dict[str, float]]:
        """What the file holds; nothing when it is missing or not as written here."""
        try:
            data = json.loads(read_small(self._path, _MAX_BYTES))
        except FileNotFoundError:
            return {}
        except (OSError, ValueError) as exc:
            logger.warning("ignoring %s: %s", self._path, exc)
            return {}
        if not isinstance(data, dict):
            return {}
        return {
            name: {
                owner: float(at)
                for owner, at in owners.items()
                if isinstance(owner, str)
                and isinstance(at, int | float)
                and not isinstance(at, bool)
                and math.isfinite(at)
            }
            for name, owners in data.items()
            if isinstance(name, str) and isinstance(owners, dict)
        }
