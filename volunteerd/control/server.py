"""Serving the control API inside the daemon's trio nursery (hypercorn's trio worker),
on 127.0.0.1 only, and telling local clients where it is (``control.json``).

The daemon binds the port first thing (``bind_control``), before it joins a swarm: a
port another program holds ends it before anyone saw it. A port another volunteerd
holds (a second daemon on this machine, with its own ``--data-dir``) is no error: this
one takes a free port instead, and its ``control.json`` names it, which is how every
client finds it.
"""

from __future__ import annotations

import http.client
import json
import logging
import os
import socket
from pathlib import Path
from typing import TYPE_CHECKING

import trio
from hypercorn.config import Config as HypercornConfig
from hypercorn.trio import serve

from volunteerd.atomic import write_atomic
from volunteerd.control.api import Controls, build_app
from volunteerd.control.auth import load_or_create_token
from volunteerd.control.models import API_PREFIX
from volunteerd.errors import ResourceUnavailable

if TYPE_CHECKING:
    from trio_typing import TaskStatus

__all__ = ["bind_control", "serve_control"]

logger = logging.getLogger(__name__)

_PROBE_TIMEOUT_S = 2.0
# How often a control.json that could not be written (a full disk) is tried again.
CONTROL_FILE_RETRY_S = 10.0
# What hypercorn's error log gets when a client left while its reply was being written:
# its own task and the app's both wrote to the socket (BusyResourceError: seen when a
# client that announced 1 GiB of body read the 413 and hung up), or the socket was gone.
_CLIENT_GONE = (trio.BusyResourceError, trio.BrokenResourceError, trio.ClosedResourceError)


class _ClientGone(logging.Filter):
    """Hypercorn logs a client that hung up mid-reply as "Error in ASGI Framework" with
    its traceback: the client's doing, not the daemon's error. Shown at debug only."""

    def filter(self, record: logging.LogRecord) -> bool:
        error = record.exc_info[1] if record.exc_info else None
        while isinstance(error, BaseExceptionGroup) and len(error.exceptions) == 1:
            error = error.exceptions[0]
        if isinstance(error, _CLIENT_GONE):
            logger.debug("a client hung up while its reply was written: %r", error)
            return False
        return True


_HTTP_LOG = logging.getLogger("volunteerd.control.http")
_HTTP_LOG.addFilter(_ClientGone())


def bind_control(port: int) -> socket.socket:
    """A socket bound to 127.0.0.1:``port`` (0: any free port), to pass to
    ``serve_control``. When another volunteerd's control API holds ``port``, any free
    port instead (logged). Raises ResourceUnavailable if another program holds it."""
    try:
        return _bind(port)
    except OSError as exc:
        if port == 0 or not _volunteerd_answers(port):
            raise ResourceUnavailable(
                f"the control API cannot listen on 127.0.0.1:{port} ({exc.strerror}); "
                "set control.port to a free port, or 0 for any"
            ) from None
    sock = _bind(0)
    logger.info(
        "another volunteerd's control API uses port %d; this one's takes port %d "
        "(control.json in its data folder names it; set control.port to choose one)",
        port,
        sock.getsockname()[1],
    )
    return sock


def _bind(port: int) -> socket.socket:
    sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    try:
        if os.name == "posix":
            sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        sock.bind(("127.0.0.1", port))
    except OSError:
        sock.close()
        raise
    return sock


def _volunteerd_answers(port: int) -> bool:
    """Whether a volunteerd control API answers on 127.0.0.1:``port`` (its health
    route needs no token)."""
    connection = http.client.HTTPConnection("127.0.0.1", port, timeout=_PROBE_TIMEOUT_S)
    try:
        connection.request("GET", f"{API_PREFIX}/health")
        reply = connection.getresponse()
        body = json.loads(reply.read(4096))
        return reply.status == 200 and isinstance(body, dict) and "version" in body
    except (OSError, ValueError, http.client.HTTPException):
        return False
    finally:
        connection.close()


async def serve_control(
    controls: Controls,
    *,
    sock: socket.socket,
    token_file: Path,
    control_file: Path,
    task_status: TaskStatus[str] = trio.TASK_STATUS_IGNORED,
) -> None:
    """Serve on ``sock`` (from ``bind_control``; closed when done) until cancelled;
    ``started`` with the URL (``http://127.0.0.1:PORT``), after ``control_file`` names
    it."""
    token = load_or_create_token(token_file)
    app = build_app(controls, token=token)
    # Bound by us, not by hypercorn: a taken port is a clear error before the daemon
    # joins, and the port (for the Host check) is known before the first request.
    bound = sock.getsockname()[1]
    url = f"http://127.0.0.1:{bound}"
    app.set_port(bound)
    config = HypercornConfig()
    config.bind = [f"fd://{sock.detach()}"]  # hypercorn owns (and closes) it from here
    config.accesslog = None
    config.errorlog = _HTTP_LOG
    config.graceful_timeout = 1.0
    config.keep_alive_timeout = 30.0
    endpoint = json.dumps({"url": url, "pid": os.getpid()}) + "\n"
    async with trio.open_nursery() as nursery:
        await nursery.start(serve, app, config)
        written = _name_endpoint(control_file, endpoint, first=True)
        logger.info("control API and dashboard on %s", url)
        try:
            task_status.started(url)
            while not written:  # a full disk or a read-only folder: serve on, retry
                await trio.sleep(CONTROL_FILE_RETRY_S)
                written = _name_endpoint(control_file, endpoint, first=False)
            await trio.sleep_forever()
        finally:
            # on the way out, even when cancelled: a tiny local file, no await
            try:
                control_file.unlink(missing_ok=True)  # noqa: ASYNC240
            except OSError as exc:  # a read-only folder: the stop goes on
                logger.warning("%s could not be removed: %s", control_file, exc)


def _name_endpoint(control_file: Path, endpoint: str, *, first: bool) -> bool:
    """Write ``control_file``; False (logged on the first try) where it cannot be: the
    daemon serves on, and the CLI and tray find it once a later try succeeds."""
    try:
        write_atomic(control_file, endpoint)
    except OSError as exc:
        if first:
            logger.error(
                "%s cannot be written (%s): `volunteerd` commands and the tray cannot "
                "find this daemon until it can (retrying every %g s)",
                control_file,
                exc,
                CONTROL_FILE_RETRY_S,
            )
        return False
    if not first:
        logger.info("%s written: the control API can be found again", control_file)
    return True
