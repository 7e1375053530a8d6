"""The control API: the one way into a running daemon. Every route is in ``ROUTES``.

The app is built around ``Controls``, what the daemon shows and lets change (the
daemon implements it in ``volunteerd.server.control_view``); this module knows HTTP, not the
daemon. Errors are JSON, ``{"error": "...", "field": "..."}``:

* 401 no or wrong token, 403 a foreign Host or Origin (see ``auth``),
* 404 no such route, 405 wrong method (with an ``Allow`` header),
* 413 a body over ``MAX_BODY_BYTES``,
* 422 a body or query that does not validate, with the first bad field named: not
  JSON, nested deeper than ``MAX_BODY_DEPTH``, an unknown field, a number that is not
  finite or out of its range,
* 400 an invitation that is not one (``POST /projects``; the message says why),
* 409 a change the daemon refused (e.g. limits it cannot apply),
* 500 a file the daemon could not read or write while answering (``OSError``: a full
  disk, a read-only data folder); the message names it, the log has the traceback.
  Any other failure while answering (a bug) is a JSON 500 too, the traceback logged.

Bodies are validated completely before anything changes, and replies are always
valid JSON: a non-finite number in a snapshot is sent as ``null`` (and logged) rather
than failing the reply, so one bad value cannot silence the status of a daemon.
"""

from __future__ import annotations

import json
import logging
import math
import sqlite3
from collections.abc import Awaitable, Callable
from pathlib import Path
from typing import Any, Protocol

from pydantic import BaseModel, ValidationError
from starlette.applications import Starlette
from starlette.requests import ClientDisconnect, Request
from starlette.responses import JSONResponse, PlainTextResponse, Response
from starlette.routing import BaseRoute, Mount, Route
from starlette.staticfiles import StaticFiles
from starlette.types import ASGIApp, Message, Receive, Scope, Send

from volunteerd import __version__
from volunteerd.control.auth import MAX_CHALLENGE_CHARS, allowed_hosts, check_token, prove
from volunteerd.control.events import EventLog
from volunteerd.control.models import (
    API_PREFIX,
    Events,
    ExpertView,
    Health,
    History,
    LimitsChange,
    LimitsView,
    PeerView,
    ProjectJoin,
    ProjectJoined,
    ProjectLeft,
    ScheduleChange,
    ScheduleView,
    SnoozeBody,
    Stats,
    Status,
)
from volunteerd.errors import ConfigError, VolunteerdError

__all__ = ["MAX_BODY_BYTES", "MAX_BODY_DEPTH", "ROUTES", "STATIC_DIR", "Controls", "build_app"]

logger = logging.getLogger(__name__)

STATIC_DIR = Path(__file__).resolve().parent.parent / "dashboard" / "static"
MAX_BODY_BYTES = 64 << 10
# Bodies are flat objects; a deeper one is an attack on the parser (Python's json
# recurses once per level and raises RecursionError near 1,000 levels).
MAX_BODY_DEPTH = 32
# An over-size body is still read (and dropped) up to this much, so that the client
# that sent it reads the 413 instead of a connection reset; beyond it, we stop reading.
_DRAIN_BYTES = 1 << 20
_MAX_WAIT_S = 60.0


class Controls(Protocol):
    """What the daemon shows and lets change, as the API needs it."""

    events: EventLog

    async def status(self) -> Status: ...
    def experts(self) -> list[ExpertView]: ...
    def peers(self) -> list[PeerView]: ...
    async def stats(self, since: float) -> Stats: ...
    def history(self) -> History: ...
    def limits(self) -> LimitsView: ...
    async def set_limits(self, change: LimitsChange) -> LimitsView: ...
    def schedule(self) -> ScheduleView: ...
    async def set_schedule(self, change: ScheduleChange) -> ScheduleView: ...
    async def pause(self) -> None: ...
    async def resume(self) -> None: ...
    async def snooze(self, seconds: float) -> None: ...
    async def metrics(self) -> str: ...
    def shutdown(self) -> None: ...
    async def join_project(self, body: ProjectJoin) -> ProjectJoined: ...
    async def leave_project(self, name: str) -> ProjectLeft | None: ...


class _Refused(Exception):
    def __init__(self, status: int, message: str, field: str | None = None) -> None:
        super().__init__(message)
        self.status = status
        self.field = field


class _JSONReply(JSONResponse):
    """A reply that is always valid JSON. Starlette's encoder refuses infinity and NaN
    by raising, which made every reply that holds one a 500; here such a number
    becomes ``null``, and the paths of the values are logged."""

    def render(self, content: Any) -> bytes:
        try:
            return _dumps(content)
        except ValueError:
            bad: list[str] = []
            cleaned = _finite(content, "", bad)
            logger.warning("a reply held non-finite numbers, sent as null: %s", ", ".join(bad))
            return _dumps(cleaned)


def _dumps(content: Any) -> bytes:
    # A file name that is not UTF-8 (a Latin-1 home on a UTF-8 system) holds surrogates
    # (Python's surrogateescape), which UTF-8 cannot encode: the UnicodeEncodeError, a
    # ValueError, went on to fail the same way in the handler of non-finite numbers,
    # and the reply holding it (the events, for good) was a 500. Escaped, it is the
    # JSON escape "\\udce9" of that surrogate: valid JSON, read as U+FFFD by a browser.
    return json.dumps(
        content, ensure_ascii=False, allow_nan=False, indent=None, separators=(",", ":")
    ).encode("utf-8", "backslashreplace")


def _finite(value: Any, path: str, bad: list[str]) -> Any:
    """``value`` with every non-finite float replaced by None (their paths in ``bad``)."""
    if isinstance(value, float) and not math.isfinite(value):
        bad.append(path or "(reply)")
        return None
    if isinstance(value, dict):
        return {k: _finite(v, f"{path}.{k}" if path else str(k), bad) for k, v in value.items()}
    if isinstance(value, list | tuple):
        return [_finite(v, f"{path}[{i}]", bad) for i, v in enumerate(value)]
    return value


def _error(
    status: int,
    message: str,
    field: str | None = None,
    headers: dict[str, str] | None = None,
) -> JSONResponse:
    body: dict[str, Any] = {"error": message}
    if field is not None:
        body["field"] = field
    return _JSONReply(body, status_code=status, headers=headers)


def _json(model: BaseModel | list[Any]) -> JSONResponse:
    if isinstance(model, list):
        return _JSONReply([m.model_dump(mode="json") for m in model])
    return _JSONReply(model.model_dump(mode="json"))


def _invalid(exc: ValidationError, prefix: str = "") -> _Refused:
    first = exc.errors()[0]
    field = ".".join(str(p) for p in first["loc"]) or prefix or "body"
    return _Refused(422, f"{field}: {first['msg']}", field)


async def _body(request: Request, model: type[Any]) -> Any:
    """The request's body as ``model``, validated whole (nothing is applied before).
    Raises _Refused: 413 over ``MAX_BODY_BYTES``; 422 not JSON, too deep, or invalid."""
    raw = await _read_capped(request)
    too_deep = _Refused(422, f"body: nested deeper than {MAX_BODY_DEPTH} levels", "body")
    try:
        data = json.loads(raw) if raw.strip() else {}
    except RecursionError:
        # The C parser gives up cleanly near the interpreter's recursion limit (~1,000
        # levels), before any Python code walks the result.
        raise too_deep from None
    except ValueError as exc:
        raise _Refused(422, f"body: not JSON ({exc})", "body") from None
    # fewer brackets than the limit cannot nest deeper: the walk is for odd bodies only
    if raw.count(b"[") + raw.count(b"{") > MAX_BODY_DEPTH and _deeper_than(data, MAX_BODY_DEPTH):
        raise too_deep
    try:
        return model.model_validate(data)
    except ValidationError as exc:
        raise _invalid(exc) from None


async def _read_capped(request: Request) -> bytes:
    """The body, or 413 once it passes ``MAX_BODY_BYTES``: never more than that is
    kept in memory, and a body announced above ``_DRAIN_BYTES`` is not read at all."""
    too_large = _Refused(413, f"body: over {MAX_BODY_BYTES} bytes (64 KiB)", "body")
    declared = request.headers.get("content-length", "")
    if declared.isdigit() and int(declared) > _DRAIN_BYTES:
        raise too_large
    kept: list[bytes] = []
    size = 0
    async for chunk in request.stream():
        size += len(chunk)
        if size <= MAX_BODY_BYTES:
            kept.append(chunk)
        elif size > _DRAIN_BYTES:
            break
    if size > MAX_BODY_BYTES:
        raise too_large
    return b"".join(kept)


def _deeper_than(data: Any, limit: int) -> bool:
    """Whether parsed JSON nests arrays and objects more than ``limit`` deep; level by
    level, without recursion (the depth may be near the interpreter's limit)."""
    level = [data]
    for depth in range(1, limit + 2):
        containers = [v for v in level if isinstance(v, dict | list)]
        if not containers:
            return False
        if depth > limit:
            return True
        level = [c for v in containers for c in (v.values() if isinstance(v, dict) else v)]
    return True  # not reached: the last round returns


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
    # ``?challenge=``: prove we hold the token, so that a client may send it (see auth)
    challenge = request.query_params.get("challenge")
    if challenge is None:
        return _json(Health(ok=True, version=__version__))
    if not 0 < len(challenge) <= MAX_CHALLENGE_CHARS:
        raise _Refused(422, f"challenge: 1 to {MAX_CHALLENGE_CHARS} characters", "challenge")
    proof = prove(request.app.state.token, challenge)
    return _json(Health(ok=True, version=__version__, proof=proof))


async def status(request: Request, controls: Controls) -> Response:
    return _json(await controls.status())


async def experts(request: Request, controls: Controls) -> Response:
    return _json(controls.experts())


async def peers(request: Request, controls: Controls) -> Response:
    return _json(controls.peers())


async def stats(request: Request, controls: Controls) -> Response:
    since = _query_float(request, "since", 0.0, 0.0, 1e11)
    return _json(await controls.stats(since))


async def history(request: Request, controls: Controls) -> Response:
    return _json(controls.history())


async def get_limits(request: Request, controls: Controls) -> Response:
    return _json(controls.limits())


async def set_limits(request: Request, controls: Controls) -> Response:
    change = await _body(request, LimitsChange)
    return _json(await controls.set_limits(change))


async def get_schedule(request: Request, controls: Controls) -> Response:
    return _json(controls.schedule())


async def set_schedule(request: Request, controls: Controls) -> Response:
    change = await _body(request, ScheduleChange)
    return _json(await controls.set_schedule(change))


async def pause(request: Request, controls: Controls) -> Response:
    await _body(request, _Empty)
    await controls.pause()
    return _json(await controls.status())


async def resume(request: Request, controls: Controls) -> Response:
    await _body(request, _Empty)
    await controls.resume()
    return _json(await controls.status())


async def snooze(request: Request, controls: Controls) -> Response:
    body = await _body(request, SnoozeBody)
    await controls.snooze(body.seconds)
    return _json(await controls.status())


async def events(request: Request, controls: Controls) -> Response:
    since = int(_query_float(request, "since", 0, 0, 2**53))
    wait_s = _query_float(request, "wait_s", 0.0, 0.0, _MAX_WAIT_S)
    found = await controls.events.wait_after(since, wait_s)
    return _json(Events(events=found, next=found[-1].id if found else since))


async def shutdown(request: Request, controls: Controls) -> Response:
    await _body(request, _Empty)
    controls.shutdown()
    return _JSONReply({"stopping": True}, status_code=202)


async def join_project(request: Request, controls: Controls) -> Response:
    body = await _body(request, ProjectJoin)
    try:
        return _json(await controls.join_project(body))
    except ConfigError as exc:  # what is wrong with the invitation (or the projects file)
        raise _Refused(400, str(exc), "invitation") from None


async def leave_project(request: Request, controls: Controls) -> Response:
    await _body(request, _Empty)
    name = request.path_params["name"]
    left = await controls.leave_project(name)
    if left is None:
        raise _Refused(404, f"not in a project named {name!r}")
    return _json(left)


async def metrics(request: Request, controls: Controls) -> Response:
    return PlainTextResponse(await controls.metrics(), media_type="text/plain; version=0.0.4")


class _Empty(BaseModel):
    model_config = {"extra": "forbid"}


# method, path, handler, needs the token
ROUTES: list[tuple[str, str, Handler, bool]] = [
    ("GET", f"{API_PREFIX}/health", health, False),
    ("GET", f"{API_PREFIX}/status", status, True),
    ("GET", f"{API_PREFIX}/experts", experts, True),
    ("GET", f"{API_PREFIX}/peers", peers, True),
    ("GET", f"{API_PREFIX}/stats", stats, True),
    ("GET", f"{API_PREFIX}/history", history, True),
    ("GET", f"{API_PREFIX}/limits", get_limits, True),
    ("PATCH", f"{API_PREFIX}/limits", set_limits, True),
    ("GET", f"{API_PREFIX}/schedule", get_schedule, True),
    ("PATCH", f"{API_PREFIX}/schedule", set_schedule, True),
    ("POST", f"{API_PREFIX}/pause", pause, True),
    ("POST", f"{API_PREFIX}/resume", resume, True),
    ("POST", f"{API_PREFIX}/snooze", snooze, True),
    ("GET", f"{API_PREFIX}/events", events, True),
    ("POST", f"{API_PREFIX}/shutdown", shutdown, True),
    ("POST", f"{API_PREFIX}/projects", join_project, True),
    ("DELETE", f"{API_PREFIX}/projects/{{name}}", leave_project, True),
    ("GET", "/metrics", metrics, True),
]


class _Endpoint:
    """One path of ``ROUTES``, with its handlers by method. An ASGI app, so that its
    Starlette route takes every method and this answers a wrong one with 405 itself:
    a route that names its methods lets a wrong one fall through to the dashboard's
    static files, which made it a 404."""

    def __init__(self, path: str, handlers: dict[str, Handler], controls: Controls) -> None:
        self._path = path
        self._handlers = handlers
        self._controls = controls
        self._allow = ", ".join(sorted({*handlers, *(["HEAD"] if "GET" in handlers else [])}))

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        try:
            response = await self._respond(Request(scope, receive))
        except ClientDisconnect:
            # It hung up before its body was read: nobody to answer, and not the
            # daemon's error (it was logged as one, traceback and all, each time).
            logger.debug(
                "%s %s: the client hung up before its body came", scope["method"], self._path
            )
            return
        await response(scope, receive, send)

    async def _respond(self, request: Request) -> Response:
        handler = self._handlers.get("GET" if request.method == "HEAD" else request.method)
        if handler is None:
            return _error(
                405,
                f"{request.method} is not allowed on {self._path} (use {self._allow})",
                headers={"Allow": self._allow},
            )
        try:
            return await handler(request, self._controls)
        except _Refused as exc:
            return _error(exc.status, str(exc), exc.field)
        except VolunteerdError as exc:
            return _error(409, str(exc))
        except OSError as exc:
            # A file that cannot be read or written (a full disk, a read-only folder):
            # the volunteer must read which and why, not a bare 500 from the framework.
            logger.exception("%s %s failed", request.method, self._path)
            return _error(500, f"the daemon could not read or write a file: {exc}")
        except sqlite3.Error as exc:
            # The statistics file failing under the daemon (a disk error): which and
            # why, in one line (it is no bug of ours: "failed to answer" said nothing).
            logger.error("%s %s failed: the statistics file: %s", request.method, self._path, exc)
            return _error(500, f"the daemon could not read its statistics file: {exc}")
        except ClientDisconnect:
            raise  # nobody to answer (``__call__``)
        except Exception:
            # A bug of the daemon's: still JSON, as every reply (clients parse it), and
            # the traceback in the log; not the framework's bare text 500.
            logger.exception("%s %s failed", request.method, self._path)
            return _error(500, "the daemon failed to answer this request (its log says why)")


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
    by_path: dict[str, dict[str, Handler]] = {}
    for method, path, handler, _ in ROUTES:
        by_path.setdefault(path, {})[method] = handler
    routes: list[BaseRoute] = [
        Route(path, _Endpoint(path, handlers, controls)) for path, handlers in by_path.items()
    ]
    if STATIC_DIR.is_dir():
        routes.append(Mount("/", StaticFiles(directory=STATIC_DIR, html=True), name="dashboard"))

    async def not_found(request: Request, exc: Exception) -> Response:
        return _error(404, f"no such page: {request.url.path}")

    async def not_allowed(request: Request, exc: Exception) -> Response:
        # only the dashboard's static files get here (the API's routes answer 405
        # themselves), and they are read-only
        return _error(
            405,
            f"{request.method} is not allowed on {request.url.path}",
            headers={"Allow": "GET, HEAD"},
        )

    app = Starlette(routes=routes, exception_handlers={404: not_found, 405: not_allowed})
    app.state.token = token  # for ``health``'s proof
    open_paths = {path for _, path, _, needs_token in ROUTES if not needs_token}
    return _Guard(app, token, open_paths)
