"""The typed client of the control API, for the CLI, the tray and tests.

Blocking (the standard library's ``http.client``), so the tray's threads and the CLI
use it as is; trio code calls it through ``trio.to_thread.run_sync``. It finds the
daemon through two files in the data folder: ``control.json`` (the address, written
by the daemon once the API listens, removed when it stops) and ``api-token`` (0600).

Before it sends the token, the client makes sure the daemon that wrote ``control.json``
is the one answering: the pid recorded there must be alive, and what answers must prove
it knows the token (``auth.prove``, on the same connection the token then travels on).
A daemon killed with SIGKILL leaves ``control.json`` behind, and another local user's
program may listen on its port next; it must not receive the token.

Errors: ``DaemonNotRunning`` when nothing answers at the recorded address (or none is
recorded, or its daemon is gone, or what answers there cannot prove it is that daemon),
``ControlError`` (with ``status`` and ``field``) when the daemon refuses a request or
the token cannot be read.
"""

from __future__ import annotations

import contextlib
import hmac
import http.client
import json
import os
import secrets
import sys
from dataclasses import dataclass
from pathlib import Path
from typing import Any, TypeVar
from urllib.parse import quote, urlencode, urlsplit

from pydantic import BaseModel, ValidationError

from volunteerd.atomic import STATE_MAX_BYTES, read_small
from volunteerd.control.auth import is_token_text, prove
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
from volunteerd.errors import ControlError, DaemonNotAnswering, DaemonNotRunning

__all__ = ["ControlClient", "Endpoint", "read_endpoint"]

M = TypeVar("M", bound=BaseModel)


@dataclass(frozen=True, slots=True)
class Endpoint:
    url: str  # http://127.0.0.1:PORT
    token: str
    pid: int | None = None


def read_endpoint(control_file: Path, token_file: Path) -> Endpoint:
    """The running daemon's address and token. Raises DaemonNotRunning if the daemon
    has not recorded an address (not started, or stopped cleanly), or recorded one but
    its process is gone (killed: it could not remove the file); ControlError if the
    token cannot be read."""
    not_running = DaemonNotRunning(
        f"volunteerd is not running (no {control_file}); start it with `volunteerd serve`"
    )
    try:
        data: Any = json.loads(read_small(control_file, STATE_MAX_BYTES))
        url, pid = str(data["url"]), data.get("pid")
        _address(url)  # a damaged address is a damaged file
    except FileNotFoundError:
        raise not_running from None
    except (OSError, ValueError, KeyError, TypeError, RecursionError) as exc:
        raise DaemonNotRunning(f"{control_file} is unreadable ({exc})") from None
    # bool is an int to Python, and 0 or a negative pid names a process group
    recorded = pid if isinstance(pid, int) and not isinstance(pid, bool) and pid > 0 else None
    if recorded is not None and not _alive(recorded):
        # the port it names may be anyone's now: never ask there
        raise DaemonNotRunning(
            f"volunteerd is not running (process {recorded} of {control_file} has ended); "
            "start it with `volunteerd serve`"
        )
    try:
        token = read_small(token_file, 4096).strip().decode("ascii")
    except OSError as exc:
        raise ControlError(f"cannot read the API token in {token_file}: {exc}") from None
    except UnicodeDecodeError:
        token = ""
    if not is_token_text(token):
        raise ControlError(
            f"the API token in {token_file} is damaged (not plain text): restart volunteerd, "
            "which makes a new one"
        )
    return Endpoint(url, token, recorded)


def _address(url: str) -> tuple[str, int]:
    """The host and port of a control API address. Raises ValueError if it is not one."""
    parts = urlsplit(url)
    host, port = parts.hostname, parts.port  # ``port`` raises ValueError if malformed
    if parts.scheme != "http" or not host or not port:
        raise ValueError(f"not a control API address: {url!r}")
    return host, port


def _alive(pid: int) -> bool:
    """Whether process ``pid`` runs (a zombie does not: killed, and not reaped yet).
    True when this cannot be known (Windows, another user's process): the proof of
    the token then decides."""
    if sys.platform == "win32":  # pragma: no cover - os.kill(pid, 0) terminates it there
        return True
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except OSError:  # PermissionError: it runs, as another user
        return True
    with contextlib.suppress(OSError, IndexError):
        # bytes: a name cut at 15 bytes inside a letter is no UTF-8 (a reused pid's)
        stat = Path(f"/proc/{pid}/stat").read_bytes()
        return stat.rsplit(b")", 1)[1].split()[0] != b"Z"
    return True


class ControlClient:
    """One daemon's control API. Each call opens its own connection (calls are rare
    and small; this keeps the client safe to share between threads)."""

    def __init__(self, endpoint: Endpoint, *, timeout_s: float = 10.0) -> None:
        self.endpoint = endpoint
        self.timeout_s = timeout_s
        try:
            self._host, self._port = _address(endpoint.url)
        except ValueError as exc:
            raise ControlError(str(exc)) from None

    @classmethod
    def for_data_dir(cls, data_dir: Path, **kwargs: Any) -> ControlClient:
        """The client of the daemon that uses ``data_dir`` (see ``volunteerd paths``)."""
        return cls(read_endpoint(data_dir / "control.json", data_dir / "api-token"), **kwargs)

    @property
    def dashboard_url(self) -> str:
        """The dashboard's address with the token in the fragment (never sent to a
        server, so it stays out of logs and Referer headers). Asks the daemon first: the
        page at that address reads the fragment, so it must be the daemon's. Raises
        DaemonNotRunning if it does not answer, or cannot prove it is the daemon."""
        self.verify()
        return f"{self.endpoint.url}/#token={self.endpoint.token}"

    def verify(self) -> None:
        """Make sure the daemon answers at the endpoint and knows the token. Raises
        DaemonNotRunning if not."""
        conn = self._connection(self.timeout_s)
        try:
            self._verify(conn)
        finally:
            conn.close()

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
        self, invitation: str, *, share: float = 1.0, dry_run: bool = False, replace: bool = False
    ) -> ProjectJoined:
        """Join the project ``invitation`` names: the daemon records it and restarts
        into it (``restarting``). ``dry_run``: only check the invitation. A bad one is
        a ControlError with status 400 saying what is wrong; one that replaces another
        owner's project of the same name, status 409 unless ``replace``."""
        body: dict[str, object] = {"invitation": invitation, "share": share, "dry_run": dry_run}
        if replace:  # only then: a daemon from before the field refuses fields it lacks
            body["replace"] = True
        return ProjectJoined.model_validate(self._call("POST", "/projects", body=body))

    def leave_project(self, name: str) -> ProjectLeft:
        """Leave project ``name``; the daemon restarts without it. Not in such a
        project: a ControlError with status 404."""
        try:
            # bytes of the command line that are not UTF-8 (kept as surrogates) have no
            # URL: no project is named so either
            segment = quote(name, safe="")
        except UnicodeEncodeError:
            segment = ""
        if not segment or "/" in name or name in {".", ".."}:
            # not one path segment, so no route of the daemon would see it (a "/" the
            # server decodes into the path; "." and ".." a URL resolves away): no
            # project is named so, whatever the daemon would answer
            raise ControlError(f"not in a project named {name!r}", status=404)
        path = "/projects/" + segment
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
        conn = self._connection(self.timeout_s + extra)
        try:
            # the proof and the request share the connection: the token goes only to
            # the process that gave the proof (never over a new connection, which
            # http.client would open by itself were this one closed meanwhile)
            self._verify(conn)
            conn.auto_open = 0
            try:
                conn.request(method, path, body=payload, headers=headers)
                response = conn.getresponse()
                data = response.read()
            except (OSError, http.client.HTTPException) as exc:
                raise self._unanswered(exc) from None
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

    def _unanswered(self, exc: Exception) -> DaemonNotRunning:
        """What a failed exchange means: DaemonNotAnswering when it timed out and the
        recorded process still runs (busy, not gone), else DaemonNotRunning."""
        pid = self.endpoint.pid
        if isinstance(exc, TimeoutError) and pid is not None and _alive(pid):
            return DaemonNotAnswering(
                f"volunteerd runs (pid {pid}) but did not answer at {self.endpoint.url} "
                "in time: the computer may be busy (volunteerd runs at low priority)"
            )
        return DaemonNotRunning(f"volunteerd does not answer at {self.endpoint.url} ({exc})")

    def _connection(self, timeout_s: float) -> http.client.HTTPConnection:
        return http.client.HTTPConnection(self._host, self._port, timeout=timeout_s)

    def _verify(self, conn: http.client.HTTPConnection) -> None:
        """Ask what answers on ``conn`` to prove it knows the token (it is then the
        daemon that wrote ``control.json``, not a program that took its port after it
        died). Raises DaemonNotRunning if it does not answer or cannot."""
        challenge = secrets.token_urlsafe(24)
        try:
            conn.request("GET", f"{API_PREFIX}/health?{urlencode({'challenge': challenge})}")
            response = conn.getresponse()
            data = response.read(64 << 10)
            if response.status == 200:
                proof = json.loads(data).get("proof")
                if isinstance(proof, str) and hmac.compare_digest(
                    proof.encode(), prove(self.endpoint.token, challenge).encode()
                ):
                    return
        except (OSError, http.client.HTTPException) as exc:
            raise self._unanswered(exc) from None
        except (ValueError, AttributeError):
            pass  # not JSON, or not an object: not the daemon
        raise DaemonNotRunning(
            f"what answers at {self.endpoint.url} is not the volunteerd that recorded it "
            "(it cannot prove it knows the API token, which was not sent): that daemon "
            "stopped, or its token file was replaced since it started"
        )
