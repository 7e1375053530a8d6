"""The volunteer's controls over a running daemon: pause, resume, snooze and limits.

The control API (and through it the tray and the CLI) and SIGHUP call these methods;
each change posts its ``state`` or ``limits`` event as it is made. Three things decide
whether the daemon serves experts: the person's choice (running, paused, or snoozed
until a time), the transfer quotas, and the schedule (``volunteerd.schedule``: the
computer in use, on battery, outside the hours to compute or use the network)::

             pause()                       snooze(s)
    running ─────────▶ paused     running ───────────▶ snoozed (paused until now + s)
       ▲                 │           ▲                    │
       └─── resume() ────┘           └── resume(), or the deadline passes

    serving  =  choice is running
           and  no quota is used up ("quota" otherwise, until the month or the day
                rolls over, or the quota is raised)
           and  the schedule allows it ("scheduled" otherwise, with the schedule's
                reason; resuming does not override it: the daemon waits)

The state shown is the first of those that holds it back: the person's pause hides
the schedule's hold (and the daemon still waits for the schedule once resumed).

Experts held back (``RequestGate.held``: the replica averager's ``stale`` experts, after
the daemon did not run for a while) are refused the same way, each on its own, while
the rest serve on (``hold_back``).

Stopping to serve: expert requests (forward, backward, their batches, params, shard)
are refused at once with ``Paused``, which trainers treat as "choose another expert"
(a ``params`` or ``shard`` refusal while a transfer quota is used up says until when:
``retry_after_s``, to the end of the quota's day or month; joiners and replicas leave
the node alone until then); the announcer withdraws this node's records so lookups
stop returning it; requests already in flight finish (bounded by
``timeouts.shutdown_grace_s``); the experts move off the device (``runtime.residency``).
The node stays connected: DHT, bootstrap, info. Serving again reverses it: experts back
on the device, requests accepted, records announced (done when ``resume`` returns).

The choice is kept in ``state.json`` in the data folder (written atomically), so a
restarted daemon comes back paused, or snoozed until the same time. Limits changed at
run time are applied at once and written to ``limits.toml`` (see ``config.loading``);
the quotas' byte counts live in ``transfer.json``. ``cpu_threads`` is applied on the
device's worker (torch keeps its thread count per thread).
"""

from __future__ import annotations

import contextlib
import json
import logging
import math
import time
from collections.abc import AsyncIterator, Callable, Iterable
from contextlib import asynccontextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any, Literal

import trio
from pydantic import ValidationError

from volunteerd import localtime
from volunteerd.atomic import STATE_MAX_BYTES, read_small, write_atomic
from volunteerd.config import LimitsConfig, run_time_changes, updated_overlay_toml
from volunteerd.config.toml_files import MAX_BYTES as TOML_MAX_BYTES
from volunteerd.config.words import changes_in_words
from volunteerd.control.events import EventSink
from volunteerd.control.models import MAX_SNOOZE_S
from volunteerd.errors import ConfigError, Paused, VolunteerdError
from volunteerd.net import Announcer, Handler, Reply, Request, Throttle, Verb
from volunteerd.schedule import ALLOWED, Decision

if TYPE_CHECKING:
    # trio's TaskStatus as libp2p's trio-typing stubs spell it
    from trio_typing import TaskStatus

    # Only for types: a daemon that hosts nothing never imports torch.
    from volunteerd.runtime import ExpertRuntime
    from volunteerd.server.contribution import Accountant

__all__ = [
    "GATED_VERBS",
    "RequestGate",
    "Volunteer",
    "VolunteerState",
    "hold_back",
    "refusal_before_reading",
]

logger = logging.getLogger(__name__)

_CHECK_EVERY_S = 1.0  # snooze deadline and quota

Mode = Literal["running", "paused", "snoozed", "quota", "scheduled"]


@dataclass(frozen=True, slots=True)
class VolunteerState:
    mode: Mode
    serving: bool  # what the daemon does now (a transition may be under way)
    until: float | None  # the end of a snooze, in time.time() seconds
    reason: str  # for people: why it is not serving ("" while serving)
    limits: LimitsConfig
    quota: Literal["monthly", "daily"] | None = None  # the one used up (mode "quota")


# The verbs that cost the volunteer compute or bandwidth: refused while paused.
GATED_VERBS = frozenset(
    {Verb.FORWARD, Verb.BACKWARD, Verb.FORWARD_BATCH, Verb.BACKWARD_BATCH, Verb.PARAMS, Verb.SHARD}
)
# Of those, the bulk transfers: their refusals say until when, where known.
BULK_VERBS = frozenset({Verb.PARAMS, Verb.SHARD})


class RequestGate:
    """Refuses requests while closed and counts the ones in flight (the pipeline's
    pause stage, ``server.pipeline``)."""

    def __init__(self) -> None:
        self.closed = False
        self.reason = "paused by the volunteer"
        self.in_flight = 0
        # experts refused while the gate is open: stale after a freeze, until averaged
        self.held: frozenset[str] = frozenset()
        # Seconds until the gate opens again, where that is known (a used-up transfer
        # quota: to the end of its day or month); None otherwise. Set by ``Volunteer``.
        self.opens_in: Callable[[], float | None] = lambda: None
        self._idle = trio.Event()
        self._idle.set()

    def refusal(self, *, bulk: bool = False) -> Paused | None:
        """What to refuse a request with now: None while open. A ``bulk`` request's
        (``params``, ``shard``) says until when, where known (``opens_in``): joiners
        and replicas then leave this node alone until then. Only theirs: releases older
        than ``retry_after_s`` refuse a reply that carries it, and a trainer's forward
        refused so would read as a broken server, not a paused one."""
        if self.closed:
            return Paused(
                f"this volunteer is not serving: {self.reason}",
                retry_after_s=self.opens_in() if bulk else None,
            )
        return None

    def refusal_of(self, uids: Iterable[str]) -> Paused | None:
        """What to refuse a request for ``uids`` with while the gate is open: None
        unless one of them is held back."""
        held = sorted(self.held.intersection(uids))
        if held:
            return Paused(
                f"{held[0]} is catching up with its replicas (this volunteer did not run "
                "for a while)"
            )
        return None

    @asynccontextmanager
    async def admitted(self) -> AsyncIterator[None]:
        """Count the block as a request in flight (``wait_idle`` waits for it)."""
        if self.in_flight == 0:
            self._idle = trio.Event()
        self.in_flight += 1
        try:
            yield
        finally:
            self.in_flight -= 1
            if self.in_flight == 0:
                self._idle.set()

    async def wait_idle(self) -> None:
        """Return when no gated request is in flight."""
        await self._idle.wait()


def refusal_before_reading(
    gate: RequestGate, accountant: Accountant | None
) -> Callable[[Verb, str], VolunteerdError | None]:
    """For ``RpcServer.refuse_unread``: while ``gate`` is closed, a gated verb's request
    is refused from its prefix, its header and body never read, and counted as one
    refused call (of no uid: none was read). The gate's own refusal in the pipeline
    stays for requests read before the pause."""

    def refuse(verb: Verb, peer_id: str) -> VolunteerdError | None:
        if verb not in GATED_VERBS:
            return None
        refusal = gate.refusal(bulk=verb in BULK_VERBS)
        if refusal is not None and accountant is not None and verb in _COUNTED_VERBS:
            accountant.refused("", peer_id, refusal)
        return refusal

    return refuse


def hold_back(
    handlers: dict[Verb, Handler], gate: RequestGate, accountant: Accountant | None
) -> dict[Verb, Handler]:
    """``handlers`` with their ``GATED_VERBS`` refusing a request for an expert in
    ``gate.held`` (a batch: for any of its experts) with ``Paused``, counted as refused
    calls as the pipeline's gate counts them."""

    def held_back(verb: Verb, handler: Handler) -> Handler:
        async def refuse_held(request: Request) -> Reply:
            if gate.held:
                header = request.header
                uids = [str(item.uid) for item in getattr(header, "items", None) or [header]]
                refusal = gate.refusal_of(uids)
                if refusal is not None:
                    if accountant is not None and verb in _COUNTED_VERBS:
                        for uid in uids:
                            accountant.refused(uid, request.peer_id, refusal)
                    raise refusal
            return await handler(request)

        return refuse_held

    return {
        verb: held_back(verb, handler) if verb in GATED_VERBS else handler
        for verb, handler in handlers.items()
    }


# The gated verbs whose refusals are counted as refused expert calls (``gated``).
_COUNTED_VERBS = frozenset({Verb.FORWARD, Verb.BACKWARD, Verb.FORWARD_BATCH, Verb.BACKWARD_BATCH})


@dataclass(slots=True)
class _Choice:
    paused: bool = False
    until: float | None = None  # a snooze's deadline (time.time(): saved, shown)
    # The same deadline on the monotonic clock, which decides: a wall clock set right
    # (NTP) or by hand must not end a snooze early or make it last an hour longer.
    ends: float | None = None


class Volunteer:
    """Pause, resume, snooze and limits for one daemon.

    Wire it in this order: ``restore()`` (reads ``state.json``) before the node opens,
    put ``gate`` in the request pipeline, ``attach(announcer)`` before the announcer
    starts, then start ``serve`` (which releases the device if the daemon starts paused,
    and watches the snooze deadline and the quota). Changes are posted to ``events``."""

    def __init__(
        self,
        runtime: ExpertRuntime | None,
        throttle: Throttle,
        limits: LimitsConfig,
        *,
        state_file: Path | None,
        limits_file: Path | None,
        grace_s: float,
        events: EventSink | None = None,
        clock: Callable[[], float] = time.time,
    ) -> None:
        self._runtime = runtime
        self._throttle = throttle
        self._state_file = state_file
        self._limits_file = limits_file
        self._grace_s = grace_s
        self._events = events
        self._posted = ""  # the state last posted (serve starts from the current one)
        self._clock = clock
        self._ticking: Callable[[], float] = time.monotonic
        self.gate = RequestGate()
        self.gate.opens_in = self._quota_ends_in
        self.limits = limits
        self._changing_limits = trio.Lock()
        self._choice = _Choice()
        self._announcer: Announcer | None = None
        self._serving = True  # the runtime starts with its experts on the device
        self._schedule = ALLOWED
        self._network_changed = trio.Event()
        self._started = False  # serve has brought the daemon to the wanted state
        self._threads = 0  # cpu_threads applied (0: torch's default)
        self._default_threads: int | None = None  # torch's, before the first change
        self._lock = trio.Lock()
        self._wake = trio.Event()
        self._apply_compute_limits(limits)

    # -- wiring --------------------------------------------------------------------

    def restore(self) -> None:
        """Read the saved choice; a daemon that was paused starts paused. An expired
        snooze, or an unreadable file (logged), means running."""
        if self._state_file is None:
            return
        try:
            data: Any = json.loads(read_small(self._state_file, STATE_MAX_BYTES))
            paused, until = data["paused"], data.get("until")
            if not isinstance(paused, bool):  # bool("no") is True
                raise ValueError(f"paused is {paused!r}, not true or false")
            until = None if until is None else float(until)
            # A snooze lasts at most a week; a deadline past that (1e300, inf, NaN), with a
            # day to spare for a clock set back, was never written by us and made every
            # start fail while describing it.
            if until is not None and not (
                math.isfinite(until) and until <= time.time() + MAX_SNOOZE_S + 86400
            ):
                raise ValueError(f"a snooze until {until!r}")
        except FileNotFoundError:
            return
        except OSError as exc:  # a folder, a FIFO, a link to nothing: nothing to keep
            logger.warning("%s is unreadable (%s); starting unpaused", self._state_file, exc)
            return
        except (ValueError, KeyError, TypeError, ArithmeticError, RecursionError) as exc:
            # kept for a look (the next save would write over it)
            aside = self._state_file.with_name(f"{self._state_file.name}.damaged")
            try:
                self._state_file.replace(aside)
            except OSError:
                aside = self._state_file
            logger.warning(
                "%s is unreadable (%s); starting unpaused (the file: %s)",
                self._state_file,
                exc,
                aside,
            )
            return
        left = None if until is None else until - self._clock()
        if paused and left is not None and left <= 0:
            paused, until, left = False, None, None
        self._choice = _Choice(paused, until, None if left is None else self._ticking() + left)
        if paused:
            self.gate.closed = True
            self.gate.reason = self._reason()
            logger.info("starting %s (saved in %s)", self._describe(), self._state_file)

    def attach(self, announcer: Announcer) -> None:
        """The announcer to silence while not serving (before it starts serving)."""
        self._announcer = announcer
        if not self._wanted():
            announcer.set_paused(True)

    async def serve(self, *, task_status: TaskStatus[None] = trio.TASK_STATUS_IGNORED) -> None:
        """Bring the daemon to the saved state, then follow the snooze deadline and the
        quota until cancelled."""
        await self._reconcile()
        await self._apply_threads(self.limits.cpu_threads)
        self._started = True
        self._posted = self.described
        task_status.started()
        while True:
            with trio.move_on_after(_CHECK_EVERY_S):
                await self._wake.wait()
            self._wake = trio.Event()
            if self._snooze_over():
                logger.info("the snooze is over: serving again")
                self._choice = _Choice()
                self._recheck_network()
                self._save_choice()
            await self._reconcile()
            self._post_state()  # a snooze that ended, a quota used up or renewed

    # -- the controls --------------------------------------------------------------

    async def pause(self) -> None:
        """Stop serving until ``resume``; returns when the experts are withdrawn, the
        requests in flight are done (or the grace period is over) and the device is
        released."""
        await self._choose(_Choice(paused=True))

    async def snooze(self, seconds: float) -> None:
        """Pause for ``seconds``, then serve again by itself."""
        if not seconds > 0:
            raise ValueError(f"snooze for a positive number of seconds, not {seconds}")
        await self._choose(
            _Choice(paused=True, until=self._clock() + seconds, ends=self._ticking() + seconds)
        )

    def _snooze_over(self) -> bool:
        ends = self._choice.ends
        return self._choice.paused and ends is not None and ends <= self._ticking()

    async def resume(self) -> None:
        """Serve again (unless a quota is used up or the schedule holds the daemon
        back: it then waits for them); returns once re-announced."""
        await self._choose(_Choice())

    async def follow_schedule(self, decision: Decision) -> None:
        """The schedule's hold (``schedule.Scheduler`` calls this at every check):
        serving stops, draining like a pause, while ``decision`` does not allow it, and
        starts again once it does (unless paused or over a quota). Before ``serve``
        starts, only the gate and the announcer follow (``serve`` does the rest)."""
        if decision == self._schedule:
            return
        if decision.network != self._schedule.network:
            self._recheck_network()
        self._schedule = decision
        if not self._started:
            self.gate.closed = not self._wanted()
            self.gate.reason = self._reason() or self.gate.reason
            if self._announcer is not None:
                self._announcer.set_paused(self.gate.closed)
            return
        self._wake.set()
        await self._reconcile()
        self._post_state()

    @property
    def schedule(self) -> Decision:
        """The schedule's last decision."""
        return self._schedule

    @property
    def network_allowed(self) -> bool:
        """Whether bulk transfers (downloading experts, averaging replicas) may run now:
        not while paused or snoozed by the volunteer, nor while a quota is used up (they
        went on: an outside probe saw a used-up daily quota of 10 MB spent 6.5 times
        over by replica averaging, and a paused daemon download its experts), nor
        outside the schedule's network hours. The schedule's other holds (the computer
        in use, on battery, outside compute hours) stop computing only."""
        return (
            self._schedule.network
            and not self._choice.paused
            and not self._throttle.quota_exhausted
        )

    async def wait_for_network(self) -> None:
        """Return once bulk transfers may run (at once when ``network_allowed``)."""
        while not self.network_allowed:
            # woken by a resume or the network hours; a quota renewed is seen by the
            # next check (the quota's day or month turning over is not announced)
            with trio.move_on_after(_CHECK_EVERY_S):
                await self._network_changed.wait()

    def _recheck_network(self) -> None:
        """Wake ``wait_for_network``'s waiters to look again."""
        self._network_changed.set()
        self._network_changed = trio.Event()

    async def set_limits(
        self,
        limits: LimitsConfig | None = None,
        *,
        persist: bool = True,
        reloaded: bool = False,
        **changes: Any,
    ) -> LimitsConfig:
        """Apply new limits at once: a whole ``limits``, or single ``changes`` such as
        ``upload_mbit=10``. With ``persist`` they are written to ``limits.toml``. A
        ``limits`` event names what changed (``reloaded``: posted even if nothing did).
        All or nothing: the complete new limits are validated first, and if applying
        them still fails half-way the old ones are put back. Raises ConfigError for an
        invalid value or a failed change (the old limits hold then)."""
        # One change at a time: applying the CPU threads waits for the device, and a
        # change made meanwhile on the old limits would be undone by this one's result.
        async with self._changing_limits:
            return await self._set_limits(limits, persist=persist, reloaded=reloaded, **changes)

    async def _set_limits(
        self,
        limits: LimitsConfig | None,
        *,
        persist: bool,
        reloaded: bool,
        **changes: Any,
    ) -> LimitsConfig:
        base = limits or self.limits
        try:
            new = LimitsConfig.model_validate({**base.model_dump(), **changes})
        except ValidationError as exc:
            first = exc.errors()[0]
            where = ".".join(str(p) for p in first["loc"])
            raise ConfigError(f"limits.{where}: {first['msg']}") from None
        old = self.limits
        # Saved first: a change that cannot be saved (a full disk, a read-only folder)
        # is refused whole, instead of answered "done" and lost at the next start.
        saving = persist and self._limits_file is not None
        saved_before = self._saved_limits() if saving else None
        if saving:
            self._save_limits(run_time_changes(old, new, changes))
        try:
            self._throttle.apply(new)
            self._apply_compute_limits(new)
            await self._apply_threads(new.cpu_threads)
        except Exception as exc:
            # not expected within the validated ranges; but a rate applied before a
            # quota that failed must not stay behind
            logger.exception("applying the limits %s failed; keeping the old ones", new)
            self._throttle.apply(old)
            self._apply_compute_limits(old)
            if saving:
                self._restore_saved_limits(saved_before)
            raise ConfigError(f"the limits could not be applied ({exc}); nothing changed") from exc
        self.limits = new
        logger.info("limits now %s", new.model_dump())
        described = changes_in_words(old.model_dump(), new.model_dump())
        if described:
            reload_note = " (reloaded from the config file)" * reloaded
            self._post("limits", f"{described}{reload_note}")
        elif reloaded:
            self._post("limits", "limits reloaded: unchanged")
        self._wake.set()  # a changed quota may pause or resume serving
        await self._reconcile()
        self._post_state()
        return new

    async def reload_limits(self, load: Callable[[], LimitsConfig]) -> None:
        """Apply the limits ``load`` reads again (SIGHUP; not written to ``limits.toml``,
        they came from the files). A configuration that does not load or apply is
        logged and posted as an ``error``; the current limits stay."""
        try:
            await self.set_limits(load(), persist=False, reloaded=True)
        except ConfigError as exc:
            logger.error("configuration not reloaded, the limits stay: %s", exc)
            self._post("error", f"configuration not reloaded, the limits stay: {exc}")
        except Exception as exc:  # a bug on the way: still not worth the daemon
            logger.exception("configuration not reloaded, the limits stay")
            self._post("error", f"configuration not reloaded, the limits stay: {exc!r}")

    @property
    def described(self) -> str:
        """The state for people, as the ``state`` events say it."""
        state = self.state
        if state.mode == "running":
            return "contributing"
        if state.mode == "paused":
            return "paused by the volunteer"
        if state.mode in ("snoozed", "scheduled"):
            return state.reason  # "snoozed until <time>", "on battery: waiting for ..."
        return f"paused: {state.reason}"

    @property
    def state(self) -> VolunteerState:
        choice = self._choice
        quota = self._throttle.exhausted_quota
        mode: Mode
        if choice.paused:
            mode = "snoozed" if choice.until is not None else "paused"
        elif quota is not None:
            mode = "quota"
        elif not self._schedule.serving:
            mode = "scheduled"
        else:
            mode = "running"
        return VolunteerState(
            mode=mode,
            serving=self._serving,
            until=choice.until,
            reason="" if mode == "running" else self._reason(),
            limits=self.limits,
            quota=quota if mode == "quota" else None,
        )

    # -- the machinery -------------------------------------------------------------

    async def _choose(self, choice: _Choice) -> None:
        """Apply ``choice`` and save it; where it cannot be saved (a full disk) it is
        applied all the same (a pause must pause), and OSError raised afterwards: the
        caller learns it will not survive a restart."""
        self._choice = choice
        self._recheck_network()
        unsaved = self._save_choice()
        logger.info("volunteer: %s", self._describe())
        self._wake.set()
        await self._reconcile()
        self._post_state()
        if unsaved is not None:
            self._post(
                "error",
                f"{self._describe()}, but not saved ({unsaved.strerror or unsaved}): "
                "a restart forgets it",
            )
            raise OSError(
                unsaved.errno,
                f"{self._describe()}, but {self._state_file} could not be written "
                f"({unsaved.strerror or unsaved}): a restart forgets it",
            )

    def _post_state(self) -> None:
        if (described := self.described) != self._posted:
            self._posted = described
            self._post("state", described)

    def _post(self, kind: Literal["state", "limits", "error"], message: str) -> None:
        if self._events is not None:
            self._events.post(kind, message)

    def _wanted(self) -> bool:
        return (
            not self._choice.paused
            and not self._throttle.quota_exhausted
            and self._schedule.serving
        )

    def _quota_ends_in(self) -> float | None:
        """Seconds until the used-up transfer quota starts afresh (its day's or month's
        end), unless the volunteer paused too (then nobody knows when): the gate's
        ``opens_in``. The schedule may hold serving longer; asking again then is cheap."""
        quota = self._throttle.exhausted_quota
        if self._choice.paused or quota is None:
            return None
        ledger = self._throttle.ledger
        return ledger.seconds_left_today() if quota == "daily" else ledger.seconds_left_this_month()

    def _reason(self) -> str:
        if self._choice.paused:
            return self._describe()
        quota = self._throttle.exhausted_quota
        if quota == "monthly":
            quota_gb = self._throttle.quota_bytes / 1e9
            return f"the monthly transfer quota of {quota_gb:g} GB is used up"
        if quota == "daily":
            quota_gb = self._throttle.daily_quota_bytes / 1e9
            return f"daily transfer quota used ({quota_gb:g} GB): waiting until midnight"
        if not self._schedule.serving:
            decision = self._schedule
            return f"{decision.reason}: waiting {decision.waiting}"
        return ""

    def _describe(self) -> str:
        until = self._choice.until
        if not self._choice.paused:
            return "running"
        if until is None:
            return "paused"
        return "snoozed until " + localtime.strftime("%Y-%m-%d %H:%M:%S", until)

    async def _reconcile(self) -> None:
        """Make serving match the wanted state (one transition at a time)."""
        async with self._lock:
            wanted = self._wanted()
            self.gate.reason = self._reason() or self.gate.reason
            if wanted == self._serving:
                return
            if wanted:
                await self._start_serving()
            else:
                await self._stop_serving()
            self._serving = wanted

    async def _stop_serving(self) -> None:
        reason = self._reason()
        self.gate.closed = True
        logger.info("stopping to serve: %s", reason)
        if self._announcer is not None:
            self._announcer.set_paused(True)
            await _announce(self._announcer)
        with trio.move_on_after(self._grace_s):
            await self.gate.wait_idle()
        if self.gate.in_flight:
            logger.warning(
                "%d requests still running after %ss; releasing the device anyway",
                self.gate.in_flight,
                self._grace_s,
            )
        if self._runtime is not None:
            from volunteerd.runtime.residency import release_device  # imports torch

            await release_device(self._runtime)

    async def _start_serving(self) -> None:
        if self._runtime is not None:
            from volunteerd.runtime.residency import restore_device  # imports torch

            await restore_device(self._runtime)
        self.gate.closed = False
        if self._announcer is not None:
            self._announcer.set_paused(False)
            await _announce(self._announcer)
        logger.info("serving again")

    def _saved_limits(self) -> bytes | None:
        """What ``limits.toml`` holds now (None: no such file, or unreadable)."""
        if self._limits_file is None:
            return None
        try:
            return read_small(self._limits_file, TOML_MAX_BYTES)
        except OSError:
            return None

    def _restore_saved_limits(self, content: bytes | None) -> None:
        """Put ``limits.toml`` back as it was before a change that failed."""
        if self._limits_file is None:
            return
        with contextlib.suppress(OSError):
            if content is None:
                self._limits_file.unlink(missing_ok=True)
            else:
                write_atomic(self._limits_file, content)

    def _save_limits(self, changed: dict[str, Any]) -> None:
        """Write the ``changed`` limits into ``limits.toml``, over what it holds: only
        what was changed at run time is kept there, not a limit of the environment or a
        flag. Raises ConfigError."""
        limits_file = self._limits_file
        if limits_file is None:  # pragma: no cover - callers check
            return
        try:
            write_atomic(limits_file, updated_overlay_toml(limits_file, "limits", changed))
        except OSError as exc:
            raise ConfigError(
                f"cannot save the limits to {limits_file}: {exc.strerror or exc}; nothing changed"
            ) from None
        except ConfigError as exc:  # what it holds now is unreadable: left alone
            raise ConfigError(f"cannot save the limits: {exc}; nothing changed") from None

    def _apply_compute_limits(self, limits: LimitsConfig) -> None:
        if self._runtime is None:
            return
        executor = self._runtime.executor
        executor.duty_cycle = limits.duty_cycle
        executor.max_batch_size = limits.max_batch_size

    async def _apply_threads(self, threads: int) -> None:
        """torch's CPU threads (0: its default), set on the device's worker: torch
        keeps the count per thread and takes the latest for threads it meets anew."""
        if self._runtime is None or threads == self._threads:
            return
        import torch  # only a daemon that hosts experts has imported torch

        executor = self._runtime.executor
        if self._default_threads is None:
            self._default_threads = await executor.run(torch.get_num_threads)
        count = threads or self._default_threads
        await executor.run(lambda: torch.set_num_threads(count))
        self._threads = threads
        logger.info("computing with %d CPU threads", count)

    def _save_choice(self) -> OSError | None:
        """Write the choice to the state file; the error where it cannot be (logged)."""
        if self._state_file is None:
            return None
        data = {"paused": self._choice.paused, "until": self._choice.until}
        try:
            write_atomic(self._state_file, json.dumps(data) + "\n")
        except OSError as exc:
            logger.warning("cannot save the pause state to %s: %s", self._state_file, exc)
            return exc
        return None


async def _announce(announcer: Announcer) -> None:
    try:
        await announcer.announce_now()
    except Exception:  # the announcer's own rounds retry
        logger.exception("announcing the change failed; the next round retries")
