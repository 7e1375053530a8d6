"""Serving the control API inside the daemon's trio nursery (hypercorn's trio worker),
on 127.0.0.1 only, and telling local clients where it is (``control.json``)."""

from __future__ import annotations

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
from volunteerd.errors import ResourceUnavailable

if TYPE_CHECKING:
    from trio_typing import TaskStatus

__all__ = ["serve_control"]

logger = logging.getLogger(__name__)


async def serve_control(
    controls: Controls,
    *,
    port: int,
    token_file: Path,
    control_file: Path,
    task_status: TaskStatus[str] = trio.TASK_STATUS_IGNORED,
) -> None:
    """Serve until cancelled; ``started`` with the URL (``http://127.0.0.1:PORT``), after
    ``control_file`` names it. Raises ResourceUnavailable if the port is taken."""
    token = load_or_create_token(token_file)
    app = build_app(controls, token=token)
    # Bound here, not by hypercorn: a taken port becomes a clear error, and the port
    # (for the Host check) is known before the first request.
    sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    try:
        if os.name == "posix":
            sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        sock.bind(("127.0.0.1", port))
    except OSError as exc:
        sock.close()
        raise ResourceUnavailable(
            f"the control API cannot listen on 127.0.0.1:{port} ({exc.strerror}); "
            "set control.port to a free port, or 0 for any"
        ) from None
    bound = sock.getsockname()[1]
    url = f"http://127.0.0.1:{bound}"
    app.set_port(bound)
    config = HypercornConfig()
    config.bind = [f"fd://{sock.detach()}"]  # hypercorn owns (and closes) it from here
    config.accesslog = None
    config.errorlog = logging.getLogger("volunteerd.control.http")
    config.graceful_timeout = 1.0
    config.keep_alive_timeout = 30.0
    async with trio.open_nursery() as nursery:
        await nursery.start(serve, app, config)
        write_atomic(control_file, json.dumps({"url": url, "pid": os.getpid()}) + "\n")
        logger.info("control API and dashboard on %s", url)
        try:
            task_status.started(url)
            await trio.sleep_forever()
        finally:
            # on the way out, even when cancelled: a tiny local file, no await
            control_file.unlink(missing_ok=True)  # noqa: ASYNC240
