"""The control API: the one way into a running daemon. Every route is in ``ROUTES``.

The app is built around ``Controls``, what the daemon shows and lets change (the
daemon implements it in ``volunteerd.controls``); this module knows HTTP, not the
daemon. Errors are JSON, ``{"error": "...", "field": "..."}``:

* 401 no or wrong token, 403 a foreign Host or Origin (see ``auth``),
* 404 no such route, 405 wrong method,
* 422 a body or query that does not validate, with the first bad field named,
* 409 a change the daemon refused (e.g. limits it cannot apply).
"""

from __future__ import annotations

import json
import logging
from collections.abc import Awaitable, Callable
from pathlib import Path
from typing import Any, Protocol

from pydantic import BaseModel, ValidationError
from starlette.applications import Starlette
from starlette.requests import Request
from starlette.responses import JSONResponse, PlainTextResponse, Response
from starlette.routing import BaseRoute, Mount, Route
from starlette.staticfiles import StaticFiles
from starlette.types import ASGIApp, Message, Receive, Scope, Send

from volunteerd import __version__
from volunteerd.control.auth import allowed_hosts, check_token
from volunteerd.control.events import EventLog
from volunteerd.control.models import (
    API_PREFIX,
    Events,
    ExpertView,
    Health,
    LimitsChange,
    LimitsView,
    PeerView,
    SnoozeBody,
    Stats,
    Status,
)
from volunteerd.errors import VolunteerdError

__all__ = ["ROUTES", "STATIC_DIR", "Controls", "build_app"]

logger = logging.getLogger(__name__)

STATIC_DIR = Path(__file__).resolve().parent.parent / "dashboard" / "static"
_MAX_BODY = 64 << 10
_MAX_WAIT_S = 60.0


class Controls(Protocol):
    """What the daemon shows and lets change, as the API needs it."""

    events: EventLog

    def status(self) -> Status: ...
    def experts(self) -> list[ExpertView]: ...
    def peers(self) -> list[PeerView]: ...
    async def stats(self, since: float) -> Stats: ...
    def limits(self) -> LimitsView: ...
    async def set_limits(self, change: LimitsChange) -> LimitsView: ...
    async def pause(self) -> None: ...
    async def resume(self) -> None: ...
    async def snooze(self, seconds: float) -> None: ...
    def metrics(self) -> str: ...
    def shutdown(self) -> None: ...


class _Refused(Exception):
    def __init__(self, status: int, message: str, field: str | None = None) -> None:
        super().__init__(message)
        self.status = status
        self.field = field


def _error(status: int, message: str, field: str | None = None) -> JSONResponse:
    body: dict[str, Any] = {"error": message}
    if field is not None:
        body["field"] = field
    return JSONResponse(body, status_code=status)


def _json(model: BaseModel | list[Any]) -> JSONResponse:
    if isinstance(model, list):
        return JSONResponse([m.model_dump(mode="json") for m in model])
    return JSONResponse(model.model_dump(mode="json"))


def _invalid(exc: ValidationError, prefix: str = "") -> _Refused:
    first = exc.errors()[0]
    field = ".".join(str(p) for p in first["loc"]) or prefix or "body"
    return _Refused(422, f"{field}: {first['msg']}", field)


async def _body(request: Request, model: type[Any]) -> Any:
    raw = await request.body()
    if len(raw) > _MAX_BODY:
        raise _Refused(413, f"the body is over {_MAX_BODY} bytes")
    try:
        data = json.loads(raw) if raw.strip() else {}
    except ValueError as exc:
        raise _Refused(422, f"body: not JSON ({exc})", "body") from None
    try:
        return model.model_validate(data)
    except ValidationError as exc:
        raise _invalid(exc) from None


def _query_float(request: Request, name: str, default: float, low: float, high: float) -> float:
    raw = request.query_params.get(name)
    if raw is None:
        return default
    try:
        value = float(raw)
    except ValueError:
        raise _Refused(422, f"{name}: not a number: {raw!r}", name) from None
    if not low <= value <= high:  # also refuses nan
        raise _Refused(422, f"{name}: must be between {low:g} and {high:g}", name)
    return value


Handler = Callable[[Request, Controls], Awaitable[Response]]


async def health(request: Request, controls: Controls) -> Response:
    return _json(Health(ok=True, version=__version__))


async def status(request: Request, controls: Controls) -> Response:
    return _json(controls.status())


async def experts(request: Request, controls: Controls) -> Response:
    return _json(controls.experts())


async def peers(request: Request, controls: Controls) -> Response:
    return _json(controls.peers())


async def stats(request: Request, controls: Controls) -> Response:
    since = _query_float(request, "since", 0.0, 0.0, 1e11)
    return _json(await controls.stats(since))


async def get_limits(request: Request, controls: Controls) -> Response:
    return _json(controls.limits())


async def set_limits(request: Request, controls: Controls) -> Response:
    change = await _body(request, LimitsChange)
    return _json(await controls.set_limits(change))


async def pause(request: Request, controls: Controls) -> Response:
    await _body(request, _Empty)
    await controls.pause()
    return _json(controls.status())


async def resume(request: Request, controls: Controls) -> Response:
    await _body(request, _Empty)
    await controls.resume()
    return _json(controls.status())


async def snooze(request: Request, controls: Controls) -> Response:
    body = await _body(request, SnoozeBody)
    await controls.snooze(body.seconds)
    return _json(controls.status())


async def events(request: Request, controls: Controls) -> Response:
    since = int(_query_float(request, "since", 0, 0, 2**53))
    wait_s = _query_float(request, "wait_s", 0.0, 0.0, _MAX_WAIT_S)
    found = await controls.events.wait_after(since, wait_s)
    return _json(Events(events=found, next=found[-1].id if found else since))


async def shutdown(request: Request, controls: Controls) -> Response:
    await _body(request, _Empty)
    controls.shutdown()
    return JSONResponse({"stopping": True}, status_code=202)


async def metrics(request: Request, controls: Controls) -> Response:
    return PlainTextResponse(controls.metrics(), media_type="text/plain; version=0.0.4")


class _Empty(BaseModel):
    model_config = {"extra": "forbid"}


# method, path, handler, needs the token
ROUTES: list[tuple[str, str, Handler, bool]] = [
    ("GET", f"{API_PREFIX}/health", health, False),
    ("GET", f"{API_PREFIX}/status", status, True),
    ("GET", f"{API_PREFIX}/experts", experts, True),
    ("GET", f"{API_PREFIX}/peers", peers, True),
    ("GET", f"{API_PREFIX}/stats", stats, True),
    ("GET", f"{API_PREFIX}/limits", get_limits, True),
    ("PATCH", f"{API_PREFIX}/limits", set_limits, True),
    ("POST", f"{API_PREFIX}/pause", pause, True),
    ("POST", f"{API_PREFIX}/resume", resume, True),
    ("POST", f"{API_PREFIX}/snooze", snooze, True),
    ("GET", f"{API_PREFIX}/events", events, True),
    ("POST", f"{API_PREFIX}/shutdown", shutdown, True),
    ("GET", "/metrics", metrics, True),
]


def _endpoint(handler: Handler, controls: Controls) -> Callable[[Request], Awaitable[Response]]:
    async def endpoint(request: Request) -> Response:
        try:
            return await handler(request, controls)
        except _Refused as exc:
            return _error(exc.status, str(exc), exc.field)
        except VolunteerdError as exc:
            return _error(409, str(exc))

    return endpoint


# On every reply: the page loads only its own files and talks only to this server; no
# other site may frame it (a hidden Pause button under a decoy), sniff types or see
# where a link came from.
_SECURITY_HEADERS = [
    (
        b"content-security-policy",
        b"default-src 'self'; img-src 'self' data:; frame-ancestors 'none'; "
        b"base-uri 'none'; form-action 'none'",
    ),
    (b"x-frame-options", b"DENY"),
    (b"x-content-type-options", b"nosniff"),
    (b"referrer-policy", b"no-referrer"),
]


class _Guard:
    """Host and Origin checks on every request, the token on the routes that want it."""

    def __init__(self, app: ASGIApp, token: str, open_paths: set[str]) -> None:
        self._app = app
        self._token = token
        self._hosts: frozenset[str] = frozenset()
        self._origins: set[str] = set()
        self._open_paths = open_paths

    def set_port(self, port: int) -> None:
        """The port the server listens on (known once it is bound)."""
        self._hosts = allowed_hosts(port)
        self._origins = {f"http://{host}" for host in self._hosts}

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self._app(scope, receive, send)
            return
        headers = {k.decode("latin-1").lower(): v.decode("latin-1") for k, v in scope["headers"]}
        response: Response | None = None
        path: str = scope["path"]
        if headers.get("host", "") not in self._hosts:
            response = _error(403, "this API answers only to 127.0.0.1 or localhost")
        elif "origin" in headers and headers["origin"] not in self._origins:
            response = _error(403, "requests from other sites are not allowed")
        elif (
            (path.startswith(API_PREFIX + "/") or path == "/metrics")
            and path not in self._open_paths
            and not check_token(headers.get("authorization"), self._token)
        ):
            response = _error(401, "missing or wrong API token (see `volunteerd dashboard`)")

        async def send_hardened(message: Message) -> None:
            if message["type"] == "http.response.start":
                message["headers"] = [*message.get("headers", []), *_SECURITY_HEADERS]
            await send(message)

        if response is not None:
            await response(scope, receive, send_hardened)
            return
        await self._app(scope, receive, send_hardened)


def build_app(controls: Controls, *, token: str) -> _Guard:
    """The ASGI app; call its ``set_port`` once the server's port is known (until then
    every request is refused as coming from a foreign host)."""
    routes: list[BaseRoute] = [
        Route(path, _endpoint(handler, controls), methods=[method])
        for method, path, handler, _ in ROUTES
    ]
    if STATIC_DIR.is_dir():
        routes.append(Mount("/", StaticFiles(directory=STATIC_DIR, html=True), name="dashboard"))

    async def not_found(request: Request, exc: Exception) -> Response:
        return _error(404, f"no such page: {request.url.path}")

    async def not_allowed(request: Request, exc: Exception) -> Response:
        return _error(405, f"{request.method} is not allowed on {request.url.path}")

    app = Starlette(routes=routes, exception_handlers={404: not_found, 405: not_allowed})
    open_paths = {path for _, path, _, needs_token in ROUTES if not needs_token}
    return _Guard(app, token, open_paths)
