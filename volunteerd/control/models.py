"""What the control API sends and accepts: one pydantic model per body, shared by the
server (which validates requests and builds replies) and the typed client (which
parses the replies). Request bodies forbid unknown fields; replies ignore them, so an
older client keeps working against a newer daemon.

Times are Unix seconds (UTC); rates are per second over the last few seconds.
"""

from __future__ import annotations

import re
from typing import Annotated, Any, Literal

from pydantic import AfterValidator, BaseModel, ConfigDict, Field

__all__ = [
    "API_PREFIX",
    "MAX_SNOOZE_S",
    "Activity",
    "ActivityState",
    "Event",
    "EventKind",
    "Events",
    "ExpertView",
    "Health",
    "History",
    "HistorySample",
    "LimitsChange",
    "LimitsView",
    "PeerView",
    "ProjectJoin",
    "ProjectJoined",
    "ProjectLeft",
    "ProjectView",
    "Rates",
    "Reachability",
    "ScheduleChange",
    "ScheduleStatus",
    "ScheduleView",
    "SnoozeBody",
    "Staleness",
    "Stats",
    "StatsBucket",
    "Status",
    "Totals",
]

API_PREFIX = "/api/v1"

Mode = Literal["running", "paused", "snoozed", "quota", "scheduled"]


class _Reply(BaseModel):
    model_config = ConfigDict(frozen=True, extra="ignore")


class _Body(BaseModel):
    # A request never carries infinity or NaN (JSON has neither; Python's parser reads
    # ``Infinity``, ``NaN`` and ``1e999`` as such, and pydantic the strings "inf", "nan").
    # Strict: a value of the wrong JSON type is refused, not converted (``true`` was a
    # limit of 1 Mbit/s, ``"7"`` one of 7, ``"yes"`` a yes); an integer is a number.
    model_config = ConfigDict(frozen=True, extra="forbid", allow_inf_nan=False, strict=True)


# -- request bodies ---------------------------------------------------------------------


# the longest snooze: the API's bound, which the CLI checks before asking
MAX_SNOOZE_S = 7 * 86400.0


class SnoozeBody(_Body):
    seconds: float = Field(
        gt=0, le=MAX_SNOOZE_S, description="pause for this long (at most a week)"
    )


# ``swarm.projects.MAX_SHARE`` (this package imports no swarm; a unit test keeps them equal)
MAX_PROJECT_SHARE = 100.0


class ProjectJoin(_Body):
    invitation: str = Field(max_length=8192, description="volunteerd://join/<name>?owner=...")
    share: float = Field(
        1.0, gt=0, le=MAX_PROJECT_SHARE, description="of the room for experts, against others"
    )
    dry_run: bool = Field(False, description="only check the invitation: nothing is recorded")
    replace: bool = Field(
        False,
        description="join even though it replaces the project of the same name of another "
        "owner (refused with 409 without it)",
    )


# The ranges of ``config.LimitsConfig`` (this package imports no config; a unit test
# keeps them equal), so that a change that validates here can also be applied.
MAX_RATE_MBIT = 100_000.0  # 100 Gbit/s
MAX_QUOTA_GB = 1_000_000.0  # 1 PB a month
MAX_BATCH_SIZE = 1 << 20
MAX_CPU_THREADS = 1024


def _plain_zero(value: float) -> float:
    # ``ge=0`` lets -0.0 through, which would be stored and echoed as "-0.0"
    return value + 0.0


# a number of at least 0 (-0.0 becomes 0.0)
_AtLeastZero = Annotated[float, AfterValidator(_plain_zero)]


class LimitsChange(_Body):
    """Only the limits to change; the others keep their values."""

    upload_mbit: _AtLeastZero | None = Field(
        None, ge=0, le=MAX_RATE_MBIT, description="Mbit/s, 0 = unlimited"
    )
    download_mbit: _AtLeastZero | None = Field(
        None, ge=0, le=MAX_RATE_MBIT, description="Mbit/s, 0 = unlimited"
    )
    monthly_quota_gb: _AtLeastZero | None = Field(
        None, ge=0, le=MAX_QUOTA_GB, description="GB per month, 0 = none"
    )
    duty_cycle: float | None = Field(None, gt=0, le=1)
    max_batch_size: int | None = Field(None, ge=0, le=MAX_BATCH_SIZE)
    daily_quota_gb: _AtLeastZero | None = Field(
        None, ge=0, le=MAX_QUOTA_GB, description="GB per day, 0 = none"
    )
    disk_budget_gb: _AtLeastZero | None = Field(
        None, ge=0, le=MAX_QUOTA_GB, description="GB for checkpoints and downloads, 0 = none"
    )
    cpu_threads: int | None = Field(None, ge=0, le=MAX_CPU_THREADS, description="0 = default")

    def changes(self) -> dict[str, float | int]:
        return {k: v for k, v in self.model_dump().items() if v is not None}


# "HH:MM-HH:MM" as ``config.ScheduleConfig`` checks it (a unit test keeps them equal)
TIME_WINDOW = r"^([01][0-9]|2[0-3]):[0-5][0-9]-([01][0-9]|2[0-3]):[0-5][0-9]$"
MAX_IDLE_MINUTES = 1440.0


def _a_window(window: str) -> str:
    # ``config.ScheduleConfig``'s rule, word for word: a change accepted here must also
    # be one the config accepts, or the daemon refuses it late (409, and in the CLI
    # only after asking the daemon). Its message too: pydantic's own for a pattern
    # showed the regular expression (`volunteerd schedule --compute-hours 7:00-8:00`).
    if not re.fullmatch(TIME_WINDOW, window):
        raise ValueError(f'not a time window: {window!r} (expected "HH:MM-HH:MM")')
    start, end = window.split("-")
    if start == end:
        raise ValueError(f"an empty time window: {window!r} (leave the list empty for any time)")
    return window


_Window = Annotated[str, AfterValidator(_a_window)]


class ScheduleChange(_Body):
    """Only the schedule's rules to change; the others keep their values."""

    run: Literal["always", "when_idle"] | None = None
    idle_minutes: float | None = Field(None, gt=0, le=MAX_IDLE_MINUTES)
    on_battery: bool | None = None
    compute_hours: list[_Window] | None = Field(None, max_length=48)
    network_hours: list[_Window] | None = Field(None, max_length=48)
    gpu: Literal["always", "when_idle"] | None = None

    def changes(self) -> dict[str, Any]:
        return {k: v for k, v in self.model_dump().items() if v is not None}


# -- replies -------------------------------------------------------------------------------


class Health(_Reply):
    ok: bool
    version: str
    # the answer to ``?challenge=``: ``auth.prove(token, challenge)`` (None: not asked)
    proof: str | None = None


class LimitsView(_Reply):
    upload_mbit: float
    download_mbit: float
    monthly_quota_gb: float
    duty_cycle: float
    max_batch_size: int
    daily_quota_gb: float = 0.0
    disk_budget_gb: float = 0.0
    cpu_threads: int = 0
    month_bytes: int = 0  # sent + received this calendar month (for the quota)
    day_bytes: int = 0  # sent + received today, local time (for the daily quota)


class ScheduleView(_Reply):
    """The schedule's rules (as ``[schedule]`` in the config names them)."""

    run: str  # "always" or "when_idle"
    idle_minutes: float
    on_battery: bool
    compute_hours: list[str]
    network_hours: list[str]
    gpu: str  # "always" or "when_idle"
    idle_source: str = "none"  # how idle time is read here: x11, logind, macos, windows


class ScheduleStatus(_Reply):
    """What the schedule allows now, and what it saw."""

    computing: bool = True
    network: bool = True
    reason: str | None = None  # what holds the daemon back ("computer in use", ...)
    idle_s: float | None = None  # since the last input (None: unknown here)
    on_battery: bool | None = None  # None: unknown
    # The time zone the hours go by (Europe/Berlin, or an abbreviation where the zone
    # file names none) and how far ahead of UTC it is now; None: an older daemon.
    zone: str | None = None
    utc_offset_s: int | None = None


class Reachability(_Reply):
    mode: str  # "direct", "relayed", "unreachable", "unknown" or "local"
    addrs: list[str] = []
    relay: str | None = None
    advice: str = ""
    # The IPs peers see this node at (behind NAT: the router's public address).
    observed: list[str] = []
    # Relayed connections that became direct (hole punching, or a dial from one side).
    upgraded: int = 0
    # Hole punches that failed (a symmetric NAT, a firewall): those peers stay relayed.
    hole_punch_failed: int = 0
    # hole punches peers asked for and were refused (too many, too soon: docs/security.md)
    hole_punch_refused: int = 0
    last_upgrade_at: float | None = None


class Rates(_Reply):
    samples_per_s: float = 0.0
    requests_per_s: float = 0.0
    upload_bytes_per_s: float = 0.0
    download_bytes_per_s: float = 0.0


class HistorySample(Rates):
    t: float  # when the daemon took it


class History(_Reply):
    """The live charts' recent past, so that a page loaded now starts with it."""

    every_s: float  # between samples
    window_s: float  # how far back the samples reach
    samples: list[HistorySample]  # oldest first


class Totals(_Reply):
    forward: int = 0
    backward: int = 0
    samples: int = 0
    compute_s: float = 0.0
    bytes_in: int = 0  # the tensors of expert calls only (their inputs and gradients)
    bytes_out: int = 0  # their outputs and gradients
    # all the bytes this node sent and received, what the transfer quotas count: expert
    # calls, parameters and shards, replica averaging, relayed circuits, the DHT
    bytes_sent: int = 0
    bytes_received: int = 0
    running_s: float = 0.0
    paused_s: float = 0.0
    rejected: dict[str, int] = {}  # reason -> count

    @property
    def requests(self) -> int:
        return self.forward + self.backward


# What the daemon is doing for the volunteer, in one word (``Status.activity``).
ActivityState = Literal[
    "not_in_project", "joining", "contributing", "waiting", "no_peers", "unreachable", "paused"
]


class Activity(_Reply):
    """The one line to show a person (``message``) and what they can do about it
    (``hint``, "" when nothing)."""

    state: str  # an ActivityState (a plain str here: older clients read newer states)
    message: str
    hint: str = ""


class Staleness(_Reply):
    """How stale the gradients the experts applied were, over the experts hosted now:
    for each backward through a kept forward, the optimizer updates its expert took
    between the forward and the backward (other trainers' backwards, and the same
    trainer's other batches in flight). Stateless backwards are counted apart."""

    backwards: int = 0  # backwards through kept forwards measured
    mean: float | None = None  # None: none yet
    max: int = 0
    # "0", "1", "2-3", "4-7", "8+" -> backwards
    histogram: dict[str, int] = {}
    stateless: int = 0  # stateless backwards (their staleness is unknown)

    @classmethod
    def combined(cls, views: list[Staleness]) -> Staleness:
        """Several daemons' staleness as one (e.g. the whole swarm's)."""
        backwards = sum(v.backwards for v in views)
        total = sum(v.mean * v.backwards for v in views if v.mean is not None)
        histogram: dict[str, int] = {}
        for v in views:
            for bucket, count in v.histogram.items():
                histogram[bucket] = histogram.get(bucket, 0) + count
        return cls(
            backwards=backwards,
            mean=total / backwards if backwards else None,
            max=max((v.max for v in views), default=0),
            histogram=histogram,
            stateless=sum(v.stateless for v in views),
        )


class ProjectView(_Reply):
    name: str  # the experiment
    owner: str  # the peer id whose signed manifest is trusted
    owner_name: str = ""  # the owner's display name, once the manifest is found
    description: str = ""
    homepage: str = ""
    share: float
    # not_hosted: an entry of projects.toml this release does not host (``error`` says
    # why, ``advice`` what to do: join again or leave); never tried again by itself
    state: Literal["joining", "joined", "failed", "not_hosted"]
    experts: int = 0  # hosted for it now
    error: str | None = None  # why joining failed (it is tried again)
    expired_at: float | None = None  # when its manifest expired, if that is why it failed
    # it failed because not even one of its experts fits this computer's memory budget
    too_big: bool = False
    # what its join waits for now ("waiting for a busy replica of ffn.3.1, retrying in
    # 40 s": an expert whose replicas are busy is downloaded later, not seeded;
    # "downloading ffn.3.1: 141 of 384 MiB at 2.0 Mbit/s, ~16 min left")
    waiting: str | None = None
    advice: str = ""  # what the volunteer can do about a project not hosted

    @classmethod
    def not_hosted(cls, name: str, owner: str, problem: str, advice: str) -> ProjectView:
        """An entry of the projects file set aside (``swarm.projects.SetAside``)."""
        return cls(
            name=name, owner=owner, share=0.0, state="not_hosted", error=problem, advice=advice
        )


class ProjectJoined(_Reply):
    project: ProjectView
    restarting: bool  # the daemon restarts to join (false: a dry run, or already joined)
    # the owner of the project of the same name that this join replaces (or would, in a
    # dry run): another owner's project, joined only with ``ProjectJoin.replace``
    replaces_owner: str | None = None


class ProjectLeft(_Reply):
    left: str
    restarting: bool


class Status(_Reply):
    version: str
    peer_id: str
    state: Mode
    serving: bool  # what the daemon does now (a change may be under way)
    reason: str  # why it is not serving ("" while serving)
    snoozed_until: float | None = None
    experiment: str | None = None
    projects: list[ProjectView] = []  # joined (and the config's experiments.join)
    device: str
    experts: list[str]
    reachability: Reachability
    limits: LimitsView
    started_at: float
    uptime_s: float
    connected_peers: int
    rates: Rates
    today: Totals  # since local midnight, including the last few unflushed seconds
    schedule: ScheduleStatus = ScheduleStatus()
    activity: Activity  # what it does for the volunteer, honestly (server/activity.py)
    staleness: Staleness = Staleness()  # since the daemon started, experts hosted now
    # another daemon uses this node's identity.key (seen within the last hour): what to
    # do, with its addresses (net/clones.py); None when none was seen
    identity_clash: str | None = None


class ExpertView(_Reply):
    uid: str
    forward: int  # requests since the daemon started
    backward: int
    samples: int
    compute_s: float
    last_used: float | None
    updates: int  # optimizer steps applied (all time, from the checkpoint)
    waiting: int  # requests queued now
    replicas: int | None  # other peers announcing this uid (None: not looked up yet)
    checkpoint_age_s: float | None  # None: never saved
    # updates between a kept forward and its backward, since start (None: none yet)
    staleness_mean: float | None = None
    staleness_max: int | None = None


class PeerView(_Reply):
    peer_id: str
    requests: int  # expert calls this daemon answered for the peer since it started
    refused: int  # its calls refused (paused, busy, over its limits, bad values...)
    connected: bool  # a libp2p connection is open now
    # every expert call of the peer is refused for banned_s more seconds (it sent
    # gradients or inputs that would have wrecked an expert: docs/security.md)
    banned: bool = False
    banned_s: float = 0.0


class StatsBucket(_Reply):
    start: float
    size_s: int  # 3600 (hourly) or 86400 (daily, older than two weeks)
    forward: int
    backward: int
    samples: int
    compute_s: float
    bytes_in: int
    bytes_out: int
    bytes_sent: int = 0  # all traffic, as ``Totals``
    bytes_received: int = 0


class Stats(_Reply):
    today: Totals
    week: Totals  # the last 7 days
    all_time: Totals
    history: list[StatsBucket]  # since the ``since`` asked for, oldest first


# What an event is about; the dashboard colours and refreshes by it.
EventKind = Literal[
    "started",
    "state",
    "limits",
    "schedule",
    "projects",
    "experts",
    "reachability",
    "peers",
    "bans",
    "error",
]


class Event(_Reply):
    id: int
    time: float
    kind: str  # an EventKind (a plain str here: older clients read newer kinds)
    message: str


class Events(_Reply):
    events: list[Event]
    next: int  # pass as ``since`` to wait for the ones after these
