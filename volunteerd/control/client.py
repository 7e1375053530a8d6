"""The typed client of the control API, for the CLI, the tray and tests.

Blocking (the standard library's ``http.client``), so the tray's threads and the CLI
use it as is; trio code calls it through ``trio.to_thread.run_sync``. It finds the
daemon through two files in the data folder: ``control.json`` (the address, written
by the daemon once the API listens, removed when it stops) and ``api-token`` (0600).

Errors: ``DaemonNotRunning`` when nothing answers at the recorded address (or none is
recorded), ``ControlError`` (with ``status`` and ``field``) when the daemon refuses a
request.
"""

from __future__ import annotations

import http.client
import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any, TypeVar
from urllib.parse import quote, urlencode, urlsplit

from pydantic import BaseModel, ValidationError

from volunteerd.control.models import (
    API_PREFIX,
    Events,
    ExpertView,
    Health,
    History,
    LimitsView,
    PeerView,
    ProjectJoined,
    ProjectLeft,
    ScheduleView,
    Staleness,
    Stats,
    Status,
)
from volunteerd.errors import ControlError, DaemonNotRunning

__all__ = ["ControlClient", "Endpoint", "read_endpoint"]

M = TypeVar("M", bound=BaseModel)


@dataclass(frozen=True, slots=True)
class Endpoint:
    url: str  # http://127.0.0.1:PORT
    token: str
    pid: int | None = None


def read_endpoint(control_file: Path, token_file: Path) -> Endpoint:
    """The running daemon's address and token. Raises DaemonNotRunning if the daemon
    has not recorded an address (not started, or stopped cleanly)."""
    try:
        data: Any = json.loads(control_file.read_text())
        url, pid = str(data["url"]), data.get("pid")
    except FileNotFoundError:
        raise DaemonNotRunning(
            f"volunteerd is not running (no {control_file}); start it with `volunteerd serve`"
        ) from None
    except (OSError, ValueError, KeyError, TypeError) as exc:
        raise DaemonNotRunning(f"{control_file} is unreadable ({exc})") from None
    try:
        token = token_file.read_text().strip()
    except OSError as exc:
        raise ControlError(f"cannot read the API token in {token_file}: {exc}") from None
    return Endpoint(url, token, int(pid) if isinstance(pid, int) else None)


class ControlClient:
    """One daemon's control API. Each call opens its own connection (calls are rare
    and small; this keeps the client safe to share between threads)."""

    def __init__(self, endpoint: Endpoint, *, timeout_s: float = 10.0) -> None:
        self.endpoint = endpoint
        self.timeout_s = timeout_s
        parts = urlsplit(endpoint.url)
        if parts.scheme != "http" or not parts.hostname or not parts.port:
            raise ControlError(f"not a control API address: {endpoint.url!r}")
        self._host = parts.hostname
        self._port = parts.port

    @classmethod
    def for_data_dir(cls, data_dir: Path, **kwargs: Any) -> ControlClient:
        """The client of the daemon that uses ``data_dir`` (see ``volunteerd paths``)."""
        return cls(read_endpoint(data_dir / "control.json", data_dir / "api-token"), **kwargs)

    @property
    def dashboard_url(self) -> str:
        """The dashboard's address with the token in the fragment (never sent to a
        server, so it stays out of logs and Referer headers)."""
        return f"{self.endpoint.url}/#token={self.endpoint.token}"

    # -- the routes ----------------------------------------------------------------------

    def health(self) -> Health:
        return self._get("/health", Health)

    def status(self) -> Status:
        return self._get("/status", Status)

    def staleness(self) -> Staleness:
        """How stale the gradients this daemon's experts applied were (``status``'s
        ``staleness``); ``Staleness.combined`` adds up several daemons'."""
        return self.status().staleness

    def experts(self) -> list[ExpertView]:
        return [ExpertView.model_validate(e) for e in self._call("GET", "/experts")]

    def peers(self) -> list[PeerView]:
        return [PeerView.model_validate(p) for p in self._call("GET", "/peers")]

    def stats(self, since: float | None = None) -> Stats:
        query = {} if since is None else {"since": since}
        return self._get("/stats", Stats, query)

    def history(self) -> History:
        """The last minutes of the dashboard's live charts (rates every few seconds)."""
        return self._get("/history", History)

    def limits(self) -> LimitsView:
        return self._get("/limits", LimitsView)

    def set_limits(self, **changes: float | int) -> LimitsView:
        """Change some limits (e.g. ``upload_mbit=10``); the others stay as they are."""
        return LimitsView.model_validate(self._call("PATCH", "/limits", body=changes))

    def schedule(self) -> ScheduleView:
        return self._get("/schedule", ScheduleView)

    def set_schedule(self, **changes: Any) -> ScheduleView:
        """Change some of the schedule's rules (e.g. ``run="when_idle"``,
        ``compute_hours=["22:00-07:00"]``); the others stay as they are."""
        return ScheduleView.model_validate(self._call("PATCH", "/schedule", body=changes))

    def pause(self) -> Status:
        return Status.model_validate(self._call("POST", "/pause", body={}))

    def resume(self) -> Status:
        return Status.model_validate(self._call("POST", "/resume", body={}))

    def snooze(self, seconds: float) -> Status:
        return Status.model_validate(self._call("POST", "/snooze", body={"seconds": seconds}))

    def events(self, since: int = 0, *, wait_s: float = 0.0) -> Events:
        """Events after ``since``; with ``wait_s``, wait that long for one to happen."""
        return self._get("/events", Events, {"since": since, "wait_s": wait_s})

    def shutdown(self) -> None:
        """Ask the daemon to stop (gracefully); returns at once."""
        self._call("POST", "/shutdown", body={})

    def join_project(
        self, invitation: str, *, share: float = 1.0, dry_run: bool = False
    ) -> ProjectJoined:
        """Join the project ``invitation`` names: the daemon records it and restarts
        into it (``restarting``). ``dry_run``: only check the invitation. A bad one is
        a ControlError with status 400 saying what is wrong."""
        body = {"invitation": invitation, "share": share, "dry_run": dry_run}
        return ProjectJoined.model_validate(self._call("POST", "/projects", body=body))

    def leave_project(self, name: str) -> ProjectLeft:
        """Leave project ``name``; the daemon restarts without it. Not in such a
        project: a ControlError with status 404."""
        path = "/projects/" + quote(name, safe="")
        return ProjectLeft.model_validate(self._call("DELETE", path, body={}))

    def metrics(self) -> str:
        body = self._request("GET", "/metrics")
        return body.decode()

    # -- plumbing ------------------------------------------------------------------------

    def _get(self, path: str, model: type[M], query: dict[str, Any] | None = None) -> M:
        data = self._call("GET", path + ("?" + urlencode(query) if query else ""))
        try:
            return model.model_validate(data)
        except ValidationError as exc:
            raise ControlError(f"unexpected reply from {path}: {exc}") from None

    def _call(self, method: str, path: str, body: Any = None) -> Any:
        raw = self._request(method, API_PREFIX + path, body)
        try:
            return json.loads(raw)
        except ValueError:
            raise ControlError(f"{path}: the daemon's reply is not JSON") from None

    def _request(self, method: str, path: str, body: Any = None) -> bytes:
        headers = {"Authorization": f"Bearer {self.endpoint.token}"}
        payload = None
        if body is not None:
            try:
                # never send Python's Infinity/NaN, which are not JSON (the daemon
                # would refuse them too, with the same status)
                payload = json.dumps(body, allow_nan=False).encode()
            except ValueError:
                raise ControlError(
                    f"{path}: a value is not a finite number: {body}", status=422
                ) from None
            headers["Content-Type"] = "application/json"
        extra = 0.0
        if "wait_s=" in path:  # a long poll may take its wait, then some
            extra = float(path.rsplit("wait_s=", 1)[1].split("&")[0] or 0)
        conn = http.client.HTTPConnection(self._host, self._port, timeout=self.timeout_s + extra)
        try:
            try:
                conn.request(method, path, body=payload, headers=headers)
                response = conn.getresponse()
                data = response.read()
            except (TimeoutError, ConnectionError, OSError) as exc:
                raise DaemonNotRunning(
                    f"volunteerd does not answer at {self.endpoint.url} ({exc})"
                ) from None
        finally:
            conn.close()
        if response.status >= 400:
            message, field = f"HTTP {response.status}", None
            try:
                error = json.loads(data)
                message, field = str(error.get("error", message)), error.get("field")
            except (ValueError, AttributeError):
                pass
            raise ControlError(message, status=response.status, field=field)
        return data
