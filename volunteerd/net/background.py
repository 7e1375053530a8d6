"""A node for synchronous code: its trio loop runs in a background thread.

Torch training code is synchronous; the trainer's libp2p node lives in a thread of its
own and is called through a portal (``trio.from_thread.run``). ``BackgroundNode`` is a
context manager: leaving it stops the loop and joins the thread.
"""

from __future__ import annotations

import threading
from collections.abc import Awaitable, Callable
from types import TracebackType
from typing import Any, TypeVar

import trio

from volunteerd.config import Config
from volunteerd.errors import VolunteerdError
from volunteerd.identity import Identity
from volunteerd.net.node import Node, open_node

__all__ = ["BackgroundNode"]

T = TypeVar("T")


class BackgroundNode:
    """Starts a ``Node`` in a daemon thread; ``run`` calls into it from any other thread."""

    def __init__(self, identity: Identity, config: Config, *, start_timeout_s: float = 60) -> None:
        self._identity = identity
        self._config = config
        self._start_timeout_s = start_timeout_s
        self._ready = threading.Event()
        self._token: trio.lowlevel.TrioToken | None = None
        self._stop: trio.Event | None = None
        self._node: Node | None = None
        self._nursery: trio.Nursery | None = None
        self._error: BaseException | None = None
        self._thread: threading.Thread | None = None

    def __enter__(self) -> BackgroundNode:
        self.start()
        return self

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        self.close()

    @property
    def node(self) -> Node:
        if self._node is None:
            raise VolunteerdError("the background node is not running")
        return self._node

    def start(self) -> None:
        """Start the thread and block until the node has joined the swarm."""
        self._thread = threading.Thread(target=self._main, name="volunteerd-node", daemon=True)
        self._thread.start()
        if not self._ready.wait(self._start_timeout_s):
            raise VolunteerdError(f"the node did not start within {self._start_timeout_s}s")
        if self._error is not None:
            raise self._error

    def _main(self) -> None:
        try:
            trio.run(self._serve)
        except BaseException as exc:  # reported to the thread that called start()
            self._error = exc
        finally:
            self._ready.set()

    async def _serve(self) -> None:
        self._stop = trio.Event()
        async with open_node(self._identity, self._config) as node, trio.open_nursery() as nursery:
            self._node = node
            self._nursery = nursery
            self._token = trio.lowlevel.current_trio_token()
            self._ready.set()
            await self._stop.wait()
            nursery.cancel_scope.cancel()
        self._node = None

    def start_service(self, serve: Callable[..., Awaitable[Any]]) -> None:
        """Start ``serve(task_status=...)`` on the node's loop, for the node's lifetime."""
        nursery = self._nursery
        if nursery is None:
            raise VolunteerdError("the background node is not running")
        self.run(nursery.start, serve)

    def run(self, fn: Callable[..., Awaitable[T]], *args: Any) -> T:
        """Run ``await fn(*args)`` on the node's loop and return its result (blocking)."""
        if self._token is None or self._node is None:
            raise VolunteerdError("the background node is not running")
        return trio.from_thread.run(fn, *args, trio_token=self._token)

    def close(self) -> None:
        token, stop = self._token, self._stop
        if token is not None and stop is not None:
            try:
                trio.from_thread.run_sync(stop.set, trio_token=token)
            except trio.RunFinishedError:
                pass
        if self._thread is not None:
            self._thread.join(timeout=30)
        self._token = None
