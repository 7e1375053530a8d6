"""Logging set-up, and the one place third-party chatter is tamed.

py-libp2p logs routine events as warnings and errors — a normally closed Kademlia
stream, a dial to a peer that left, a rejected value dumped in hex — thousands of lines
in a normal run. volunteerd reports the failures that matter itself, so py-libp2p's
loggers are silenced unless volunteerd runs at DEBUG, when they are shown in full.
"""

from __future__ import annotations

import logging
import sys

__all__ = ["configure_logging", "tame_third_party"]

_THIRD_PARTY = ("libp2p", "multiaddr", "async_service")


def tame_third_party(debug: bool = False) -> None:
    """Call after py-libp2p is imported: its import resets its own loggers."""
    # py-libp2p stops its records at the "libp2p" logger, so they would reach stderr
    # through logging's last-resort handler without time or name; route them via ours.
    logging.getLogger("libp2p").propagate = True
    for name in _THIRD_PARTY:
        logging.getLogger(name).setLevel(logging.DEBUG if debug else logging.CRITICAL)
    # Some of its modules set their own levels; bring them back under their parents.
    for name, logger in logging.root.manager.loggerDict.items():
        if (
            isinstance(logger, logging.Logger)
            and name.startswith(_THIRD_PARTY)
            and name not in _THIRD_PARTY
        ):
            logger.setLevel(logging.NOTSET)


def configure_logging(level: str = "INFO") -> None:
    """Log to stderr with timestamps; ``level`` applies to volunteerd's own loggers."""
    root = logging.getLogger()
    for handler in list(root.handlers):
        root.removeHandler(handler)
    handler = logging.StreamHandler(sys.stderr)
    handler.setFormatter(
        logging.Formatter("%(asctime)s %(levelname)-7s %(name)s: %(message)s", "%H:%M:%S")
    )
    root.addHandler(handler)
    root.setLevel(logging.WARNING)
    logging.getLogger("volunteerd").setLevel(level)
    tame_third_party(debug=level == "DEBUG")
