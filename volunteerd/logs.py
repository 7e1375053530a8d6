"""Logging set-up, and the one place third-party chatter is tamed.

py-libp2p's Kademlia code logs a warning for every normally closed stream and dumps
rejected values in hex; its INFO level narrates every lookup. Those loggers are held
at ERROR/WARNING here unless volunteerd itself runs at DEBUG.
"""

from __future__ import annotations

import logging
import sys

__all__ = ["configure_logging"]

_NOISY = {
    "libp2p": logging.WARNING,
    "libp2p.kad_dht": logging.ERROR,
    "libp2p.host": logging.ERROR,
    "libp2p.network": logging.ERROR,
    "libp2p.transport": logging.ERROR,
    "libp2p.stream_muxer": logging.ERROR,
    "libp2p.security": logging.ERROR,
    "libp2p.identity": logging.ERROR,
    "libp2p.rcmgr": logging.ERROR,
    "libp2p.peer": logging.ERROR,
    "libp2p.network.auto_connector": logging.ERROR,
    "multiaddr": logging.WARNING,
    "async_service": logging.WARNING,
}


def tame_third_party(debug: bool = False) -> None:
    # py-libp2p stops its records at the "libp2p" logger, so they reach stderr through
    # logging's last-resort handler without time or name; route them through ours.
    logging.getLogger("libp2p").propagate = True
    for name, level in _NOISY.items():
        logging.getLogger(name).setLevel(logging.DEBUG if debug else level)


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
