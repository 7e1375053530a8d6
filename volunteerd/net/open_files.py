"""The open-file limit (``RLIMIT_NOFILE``) and the connections it leaves room for.

Every connection is a socket, and a socket is one of the process's open files. A daemon
whose connections took every file it may open could open nothing else: its listener's
accepts failed with EMFILE, newcomers were refused, and the checkpointer's listing of
its folder raised EMFILE and stopped the daemon (exit 5). macOS starts programs with a
soft limit of 256 files, Linux with 1,024; ``network.max_connections`` is 1,000, so on
either 1,000 connections never fitted, and idle strangers (trimmed only past half of
900 inbound slots) could hold every file for good. So:

* ``raise_open_file_limit`` (first thing in ``serve`` and ``bootstrap``; in ``train``
  and ``demo`` before the trainer's node starts) raises the soft
  limit to what ``network.max_connections`` needs plus ``FD_RESERVE``, as far as the
  hard limit allows (on macOS at most ``OPEN_MAX``, 10,240, where the hard limit says
  unlimited and the kernel refuses more). It never lowers the limit.
* ``connection_cap`` holds a node to the soft limit less ``FD_RESERVE`` connections,
  whatever ``network.max_connections`` says. The inbound slots (the cap less a tenth)
  and the idle trimming's threshold (half of those slots) follow from the capped value,
  so idle strangers are trimmed before the files run out.

``FD_RESERVE`` is 64. A daemon serving experts on a CPU holds 17-19 files besides its
connections (``/proc/PID/fd``, torch loaded: libraries, the event loop, its listeners,
the stats database, the log); a checkpoint save, a shard download, the control API's
clients and connections accepted only to be refused take a few more each, at times
together. 64 leaves room for all of them at once with about 40 to spare.

Windows has no such limit in ``resource`` (there is no module): nothing is raised or
capped there.
"""

from __future__ import annotations

import logging
import sys

if sys.platform != "win32":
    import resource

__all__ = ["FD_RESERVE", "connection_cap", "open_file_limit", "raise_open_file_limit"]

logger = logging.getLogger(__name__)

FD_RESERVE = 64
# however low the limit, a node keeps this many connections (8 inbound slots)
_FEWEST_CONNECTIONS = 16
# macOS: setrlimit refuses a soft limit above OPEN_MAX even under an unlimited hard one
_DARWIN_OPEN_MAX = 10240


def open_file_limit() -> int | None:
    """This process's soft limit on open files now; None where there is none (unlimited,
    or no such limit on this platform)."""
    if sys.platform == "win32":  # pragma: no cover - Windows
        return None
    soft, _ = resource.getrlimit(resource.RLIMIT_NOFILE)
    return None if soft == resource.RLIM_INFINITY else soft


def connection_cap(max_connections: int, limit: int | None) -> int:
    """The connections a node may hold under an open-file ``limit`` (None: none):
    ``max_connections``, or ``limit - FD_RESERVE`` where that is less (at least 16)."""
    if limit is None:
        return max_connections
    return min(max_connections, max(_FEWEST_CONNECTIONS, limit - FD_RESERVE))


def raise_open_file_limit(max_connections: int) -> str | None:
    """Raise this process's soft limit on open files to ``max_connections +
    FD_RESERVE``, as far as the hard limit allows; never lower it. Returns a line for
    the log saying what it got (None: no such limit on this platform); ``open_node``
    says how many connections that leaves."""
    if sys.platform == "win32":  # pragma: no cover - Windows
        return None
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    wanted = max_connections + FD_RESERVE
    unlimited = resource.RLIM_INFINITY
    if soft != unlimited and soft < wanted:
        target = wanted if hard == unlimited else min(wanted, hard)
        for candidate in dict.fromkeys((target, min(target, _DARWIN_OPEN_MAX))):
            if candidate <= soft:
                break
            try:
                resource.setrlimit(resource.RLIMIT_NOFILE, (candidate, hard))
                break
            except (ValueError, OSError) as exc:
                logger.debug("cannot raise the open-file limit to %d: %s", candidate, exc)
    got = open_file_limit()
    line = "open files: at most " + ("unlimited" if got is None else str(got))
    if got != soft:
        line += f" (raised from {soft})"
    return line + ", hard limit " + ("unlimited" if hard == unlimited else str(hard))
