"""Config file formats: bring a file written for an older volunteerd up to this one's.

The file's ``version`` key names its format (``CONFIG_VERSION`` is the one this
volunteerd writes and validates). When a release changes the format (renames a key,
moves a section, changes a unit) it raises ``CONFIG_VERSION`` by one and registers in
``MIGRATIONS`` the function that turns a file of the previous version into the new one;
loading runs them in order, so a file of any older version keeps working.

Migrations apply in memory, before validation: the user's file (and its comments) is
never rewritten. ``volunteerd config show`` prints the migrated form, to copy over.

* No ``version`` key: version 1 (the first format; files before the key existed).
* A version above ``CONFIG_VERSION``: the file was written by a newer volunteerd, which
  this one cannot read; a ConfigError says to upgrade.
"""

from __future__ import annotations

import copy
import logging
from collections.abc import Callable
from typing import Any

from volunteerd import __version__
from volunteerd.config.models import CONFIG_VERSION
from volunteerd.errors import ConfigError

__all__ = ["FIRST_VERSION", "MIGRATIONS", "Migration", "migrate"]

logger = logging.getLogger(__name__)

Migration = Callable[[dict[str, Any]], dict[str, Any]]

FIRST_VERSION = 1  # a file without a ``version`` key

# from_version -> the function that turns a file of that version into from_version + 1.
# Empty: version 1 is the only format so far.
MIGRATIONS: dict[int, Migration] = {}


def migrate(data: dict[str, Any], source: str, *, current: int | None = None) -> dict[str, Any]:
    """``data`` (a parsed config file, from ``source``) in the format ``current``
    (default ``CONFIG_VERSION``). Returns a new dict; ``data`` is left as it was.
    Raises ConfigError for a version that is not a number, newer than ``current``, or
    older than any migration knows."""
    target = CONFIG_VERSION if current is None else current
    version = data.get("version", FIRST_VERSION)
    if isinstance(version, bool) or not isinstance(version, int):
        raise ConfigError(f"version = {version!r}: not a config format version ({source})")
    if version > target:
        raise ConfigError(
            f"{source} was written by a newer volunteerd (config format version {version}; "
            f"volunteerd {__version__} reads versions up to {target}): upgrade volunteerd"
        )
    if version == target:
        return data
    if any(step not in MIGRATIONS for step in range(version, target)):
        raise ConfigError(
            f"version = {version}: not a config format this volunteerd can read "
            f"(it reads versions {min(MIGRATIONS, default=target)} to {target}) ({source})"
        )
    migrated = copy.deepcopy(data)
    for step in range(version, target):
        migrated = MIGRATIONS[step](migrated)
        migrated["version"] = step + 1
    logger.info(
        "%s: config format version %d read as version %d (the file is unchanged; "
        "`volunteerd config show` prints the new form)",
        source,
        version,
        target,
    )
    return migrated
