"""The scheduler: looks at the computer every few seconds and holds the daemon back
when its schedule says so.

Each check reads the local time, the idle time and the power source (the last two in
a worker thread: they may run a command), applies ``policy.decide`` and hands the
decision to its target (``server.pausing.Volunteer.follow_schedule``), which drains
and resumes exactly like the manual pause. A computer that becomes idle is noticed
when its idle time reaches ``idle_minutes`` (the check is timed for it), one in use at
the next check, at most ``check_every_s`` later.

The rules change at run time through ``set_rules`` (the control API: written to
``schedule.toml`` and posted as a ``schedule`` event) or ``reload`` (SIGHUP: read
again from the files, not written).
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any, Protocol, TypeVar

import trio
from pydantic import ValidationError

from volunteerd import localtime
from volunteerd.atomic import write_atomic
from volunteerd.config import ScheduleConfig, run_time_changes, updated_overlay_toml
from volunteerd.config.words import changes_in_words
from volunteerd.control.events import EventSink
from volunteerd.errors import ConfigError
from volunteerd.schedule.idle import IdleSource, choose_idle_source
from volunteerd.schedule.policy import ALLOWED, Decision, Observation, decide
from volunteerd.schedule.power import PowerSource, choose_power_source

if TYPE_CHECKING:
    # trio's TaskStatus as libp2p's trio-typing stubs spell it
    from trio_typing import TaskStatus

__all__ = ["ScheduleState", "ScheduleTarget", "Scheduler"]

logger = logging.getLogger(__name__)

CHECK_EVERY_S = 2.0

T = TypeVar("T")


class ScheduleTarget(Protocol):
    async def follow_schedule(self, decision: Decision) -> None:
        """Serve, or stop serving, as ``decision`` says (returns once done)."""
        ...


@dataclass(frozen=True, slots=True)
class ScheduleState:
    """The rules, and what the last check saw and decided."""

    rules: ScheduleConfig
    decision: Decision
    observation: Observation | None  # None before the first check
    idle_source: str  # "x11", "logind", "macos", "windows", "none", "fake"


def _minute_now() -> int:
    return localtime.minute_of_day()


class Scheduler:
    """Holds ``target`` back while ``rules`` say so. ``idle`` and ``power`` default to
    this machine's sources (chosen when ``serve`` starts); ``on_gpu``: the experts
    compute on a GPU (``gpu = "when_idle"`` applies). Start with
    ``await nursery.start(scheduler.serve)``: it returns after the first decision was
    followed."""

    def __init__(
        self,
        rules: ScheduleConfig,
        target: ScheduleTarget,
        *,
        on_gpu: bool,
        idle: IdleSource | None = None,
        power: PowerSource | None = None,
        schedule_file: Path | None = None,
        events: EventSink | None = None,
        check_every_s: float = CHECK_EVERY_S,
        minute_of_day: Callable[[], int] = _minute_now,
    ) -> None:
        self.rules = rules
        self._target = target
        self._on_gpu = on_gpu
        self._idle = idle
        self._power = power
        self._schedule_file = schedule_file
        self._events = events
        self._check_every_s = check_every_s
        self._minute_of_day = minute_of_day
        self._decision = ALLOWED
        self._observation: Observation | None = None
        self._wake = trio.Event()
        self._lock = trio.Lock()  # one check at a time
        self._failed: set[str] = set()  # sources whose failure was logged

    # -- running ---------------------------------------------------------------------

    async def serve(self, *, task_status: TaskStatus[None] = trio.TASK_STATUS_IGNORED) -> None:
        """Check and follow the schedule until cancelled."""
        if self._idle is None:
            self._idle = await trio.to_thread.run_sync(choose_idle_source)
        if self._power is None:
            self._power = choose_power_source()
        wait_s = await self.check()
        task_status.started()
        while True:
            with trio.move_on_after(wait_s):
                await self._wake.wait()
            self._wake = trio.Event()
            wait_s = await self.check()

    async def check(self) -> float:
        """Observe, decide and have the target follow; returns when to check next."""
        async with self._lock:
            idle, power = self._idle, self._power
            idle_s = None if idle is None else await self._read(idle.name, idle.idle_seconds)
            battery = None if power is None else await self._read(power.name, power.on_battery)
            seen = Observation(self._minute_of_day(), idle_s, battery, self._on_gpu)
            decision = decide(self.rules, seen)
            self._observation = seen
            if decision != self._decision:
                logger.info(
                    "schedule: %s",
                    "computing" if decision.serving else f"holding back ({decision.reason})",
                )
            self._decision = decision
            await self._target.follow_schedule(decision)
        return self._next_check_s(seen)

    async def _read(self, name: str, read: Callable[[], T]) -> T | None:
        """``read()`` in a worker thread; a source that fails is unknown (logged once):
        a broken sensor must never stop the daemon."""
        try:
            return await trio.to_thread.run_sync(read)
        except Exception:
            if name not in self._failed:
                self._failed.add(name)
                logger.exception("reading %s failed; taken as unknown", name)
            return None

    def _next_check_s(self, seen: Observation) -> float:
        # Waiting for the computer to become idle: look again the moment it would be.
        threshold_s = self.rules.idle_minutes * 60
        if seen.idle_s is not None and seen.idle_s < threshold_s:
            return max(0.05, min(self._check_every_s, threshold_s - seen.idle_s + 0.05))
        return self._check_every_s

    def state(self) -> ScheduleState:
        return ScheduleState(
            rules=self.rules,
            decision=self._decision,
            observation=self._observation,
            idle_source=self._idle.name if self._idle is not None else "none",
        )

    # -- changing the rules ------------------------------------------------------------

    async def set_rules(
        self,
        rules: ScheduleConfig | None = None,
        *,
        persist: bool = True,
        reloaded: bool = False,
        **changes: Any,
    ) -> ScheduleConfig:
        """Apply new rules at once (a whole ``rules``, or single ``changes`` such as
        ``run="when_idle"``), validated whole first; with ``persist`` written to
        ``schedule.toml``. Posts a ``schedule`` event naming what changed (nothing when
        nothing did). Returns once the daemon follows them. Raises ConfigError for an
        invalid value."""
        base = rules or self.rules
        try:
            new = ScheduleConfig.model_validate({**base.model_dump(), **changes})
        except ValidationError as exc:
            first = exc.errors()[0]
            where = ".".join(str(p) for p in first["loc"])
            raise ConfigError(f"schedule.{where}: {first['msg']}") from None
        if persist and self._schedule_file is not None:
            # Saved first: rules that cannot be saved are refused whole, instead of
            # answered "done" and lost at the next start. Only what changed at run time:
            # not a rule of the environment or a flag, for one run.
            overlay = run_time_changes(self.rules, new, changes)
            try:
                write_atomic(
                    self._schedule_file,
                    updated_overlay_toml(self._schedule_file, "schedule", overlay),
                )
            except OSError as exc:
                raise ConfigError(
                    f"cannot save the schedule to {self._schedule_file}: "
                    f"{exc.strerror or exc}; nothing changed"
                ) from None
            except ConfigError as exc:  # what it holds now is unreadable: left alone
                raise ConfigError(f"cannot save the schedule: {exc}; nothing changed") from None
        old, self.rules = self.rules, new
        before, after = old.model_dump(), new.model_dump()
        changed = changes_in_words(before, after)
        if changed:
            logger.info("schedule now %s", after)
            self._post(f"{changed}{' (reloaded from the config file)' * reloaded}")
        await self.check()
        return new

    async def reload(self, load: Callable[[], ScheduleConfig]) -> None:
        """Apply the rules ``load`` reads again (SIGHUP, after the limits: not written
        back). Rules that do not load are logged and the current ones stay; the
        ``error`` event is the limits' reload's, which read the same files just before."""
        try:
            await self.set_rules(load(), persist=False, reloaded=True)
        except ConfigError as exc:
            logger.error("configuration not reloaded, the schedule stays: %s", exc)
        except Exception:  # a bug on the way: still not worth the daemon
            logger.exception("configuration not reloaded, the schedule stays")

    def _post(self, message: str) -> None:
        if self._events is not None:
            self._events.post("schedule", message)
