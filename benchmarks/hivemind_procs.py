"""Process bookkeeping shared by the hivemind baselines (run in hivemind's own venv).

hivemind starts helper processes (p2pd, DHT processes, task pools) that outlive a
benchmark killed in the middle; these helpers make the driver a subreaper, turn SIGTERM
into an exception so ``finally`` blocks run, and kill whatever is left below it. They
also find the unix socket files those processes bound in /tmp, which hivemind leaves
behind (see ``hivemind_socket_paths``), and read a process's CPU time. Both throughput
drivers (ours and hivemind's) count their timing windows with ``steps_in_window``.
"""

from __future__ import annotations

import contextlib
import ctypes
import logging
import os
import signal
import time
from pathlib import Path
from types import FrameType

PR_SET_CHILD_SUBREAPER = 36
SOCKET_PREFIX = "/tmp/hivemind-"  # hivemind.p2p.P2P._UNIX_SOCKET_PREFIX without "/unix"

logger = logging.getLogger(__name__)


class Interrupted(BaseException):
    """Raised from the SIGTERM handler so that ``finally`` blocks run."""


HANDLER_PID: list[int] = []


def raise_interrupted(signum: int, frame: FrameType | None) -> None:
    """SIGTERM handler for the driver (and the clients).

    hivemind forks processes (DHT, task pools, connection handlers) from the driver, so
    they inherit this handler; there it falls back to the default action (die), as
    hivemind expects.
    """
    if os.getpid() not in HANDLER_PID:
        signal.signal(signum, signal.SIG_DFL)
        os.kill(os.getpid(), signum)
        return
    raise Interrupted(f"received signal {signum}")


def install_sigterm_handler() -> None:
    HANDLER_PID[:] = [os.getpid()]
    signal.signal(signal.SIGTERM, raise_interrupted)


# ---------------------------------------------------------------------------------------------
# process bookkeeping


def children_map() -> dict[int, list[int]]:
    children: dict[int, list[int]] = {}
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit():
            continue
        try:
            stat = (entry / "stat").read_text()
        except OSError:
            continue
        # "pid (comm) state ppid ...": comm may contain spaces and parentheses.
        fields = stat[stat.rfind(")") + 2 :].split()
        if len(fields) < 2 or fields[0] == "Z":
            continue
        children.setdefault(int(fields[1]), []).append(int(entry.name))
    return children


def descendants(root: int) -> list[int]:
    children = children_map()
    found: list[int] = []
    stack = [root]
    while stack:
        for child in children.get(stack.pop(), []):
            found.append(child)
            stack.append(child)
    return found


def is_running(pid: int) -> bool:
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return False
    return stat[stat.rfind(")") + 2 :].split()[0] != "Z"


def cmdline(pid: int, limit: int = 4096) -> str:
    try:
        raw = Path(f"/proc/{pid}/cmdline").read_bytes()
    except OSError:
        return "?"
    return raw.replace(b"\0", b" ").decode(errors="replace").strip()[:limit]


def exits_by_itself(pid: int) -> bool:
    """Helpers that must outlive the driver's last tensor and exit on their own after it.

    multiprocessing's resource tracker ignores SIGTERM; killing torch_shm_manager while the
    driver still holds shared tensors makes torch abort the driver ("Broken pipe").
    """
    line = cmdline(pid)
    return "multiprocessing.resource_tracker" in line or "torch_shm_manager" in line


def reap(pid: int) -> None:
    with contextlib.suppress(ChildProcessError, OSError):
        os.waitpid(pid, os.WNOHANG)


def kill_descendants(grace: float = 3.0) -> None:
    """SIGTERM, then SIGKILL, every live process below this one (p2pd, handlers, servers,
    clients)."""
    me = os.getpid()
    pids = [pid for pid in descendants(me) if not exits_by_itself(pid)]
    if not pids:
        return
    logger.info(
        "terminating %d leftover process(es): %s",
        len(pids),
        {pid: cmdline(pid, 80) for pid in pids},
    )
    for pid in pids:
        with contextlib.suppress(ProcessLookupError):
            os.kill(pid, signal.SIGTERM)
    deadline = time.monotonic() + grace
    while time.monotonic() < deadline:
        for pid in pids:
            reap(pid)
        if not any(is_running(pid) for pid in pids):
            break
        time.sleep(0.1)
    for pid in set(pids) | set(descendants(me)):
        if is_running(pid) and not exits_by_itself(pid):
            logger.warning("process %d ignored SIGTERM; sending SIGKILL", pid)
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, signal.SIGKILL)
    time.sleep(0.1)
    for pid in pids:
        reap(pid)


def become_subreaper() -> None:
    """Adopt orphaned descendants (e.g. a killed server's p2pd) so cleanup can find them."""
    try:
        libc = ctypes.CDLL(None, use_errno=True)
        if libc.prctl(PR_SET_CHILD_SUBREAPER, 1, 0, 0, 0) != 0:
            logger.warning("prctl(PR_SET_CHILD_SUBREAPER) failed: errno %d", ctypes.get_errno())
    except (OSError, AttributeError) as exc:
        logger.warning("cannot become a child subreaper: %s", exc)


def cpu_seconds(pid: int) -> float | None:
    """User + system CPU time of ``pid`` (all its threads) so far; None once it is gone."""
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return None
    fields = stat[stat.rfind(")") + 2 :].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


# ---------------------------------------------------------------------------------------------
# unix socket files


def hivemind_socket_paths(pids: list[int]) -> set[str]:
    """hivemind's unix socket files (p2pd control, p2p client) bound by any of ``pids``.

    Every ``hivemind.P2P`` binds ``/tmp/hivemind-p2pclient-<random>.sock`` (and one that
    starts a p2pd, ``/tmp/hivemind-p2pd-<random>.sock``); only ``P2P.shutdown()`` (or the
    object's ``__del__``) removes them. A server's connection handlers each hold a replica
    (``DHT.replicate_p2p``) that hivemind never shuts down, and their processes end with
    ``os._exit``, so each handler leaves its client socket behind (8 per expert by default).
    Read while the processes are alive: /proc/<pid>/fd names socket inodes, /proc/net/unix
    maps them to paths, so only this run's files are ever named.
    """
    inodes: set[str] = set()
    for pid in pids:
        try:
            fds = os.listdir(f"/proc/{pid}/fd")
        except OSError:
            continue
        for fd in fds:
            with contextlib.suppress(OSError):
                target = os.readlink(f"/proc/{pid}/fd/{fd}")
                if target.startswith("socket:["):
                    inodes.add(target[len("socket:[") : -1])
    return {path for inode, path in _bound_hivemind_sockets() if inode in inodes}


def _bound_hivemind_sockets() -> list[tuple[str, str]]:
    """(inode, path) of every bound hivemind unix socket, from /proc/net/unix."""
    found: list[tuple[str, str]] = []
    try:
        lines = Path("/proc/net/unix").read_text().splitlines()[1:]
    except OSError:
        return found
    for line in lines:
        # Num RefCount Protocol Flags Type St Inode Path
        fields = line.split()
        if len(fields) >= 8 and fields[7].startswith(SOCKET_PREFIX):
            found.append((fields[6], fields[7]))
    return found


def remove_stale_sockets(paths: set[str]) -> int:
    """Delete those of ``paths`` that no live process has bound any more; how many."""
    in_use = {path for _, path in _bound_hivemind_sockets()}
    removed = 0
    for path in sorted(paths - in_use):
        with contextlib.suppress(FileNotFoundError):
            os.remove(path)
            removed += 1
    if removed:
        logger.info("removed %d hivemind socket file(s) this run left in /tmp", removed)
    return removed


def steps_in_window(finished: list[float], start: float, end: float) -> float:
    """Steps one client did between ``start`` and ``end``, counting the step under way at
    ``end`` by the share of it done by then. ``finished`` (when each step finished) must
    reach past ``end``. Counting whole steps only would undercount by half a step per
    client on average (the clients start together, in phase)."""
    done = sum(t <= end for t in finished)
    since = finished[done - 1] if done else start
    return done + (end - since) / (finished[done] - since)
