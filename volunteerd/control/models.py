"""What the control API sends and accepts: one pydantic model per body, shared by the
server (which validates requests and builds replies) and the typed client (which
parses the replies). Request bodies forbid unknown fields; replies ignore them, so an
older client keeps working against a newer daemon.

Times are Unix seconds (UTC); rates are per second over the last few seconds.
"""

from __future__ import annotations

from typing import Literal

from pydantic import BaseModel, ConfigDict, Field

__all__ = [
    "API_PREFIX",
    "Event",
    "EventKind",
    "Events",
    "ExpertView",
    "Health",
    "LimitsChange",
    "LimitsView",
    "PeerView",
    "Rates",
    "Reachability",
    "SnoozeBody",
    "Stats",
    "StatsBucket",
    "Status",
    "Totals",
]

API_PREFIX = "/api/v1"

Mode = Literal["running", "paused", "snoozed", "quota"]


class _Reply(BaseModel):
    model_config = ConfigDict(frozen=True, extra="ignore")


class _Body(BaseModel):
    # A request never carries infinity or NaN (JSON has neither; Python's parser reads
    # ``Infinity``, ``NaN`` and ``1e999`` as such, and pydantic the strings "inf", "nan")
    model_config = ConfigDict(frozen=True, extra="forbid", allow_inf_nan=False)


# -- request bodies ---------------------------------------------------------------------


class SnoozeBody(_Body):
    seconds: float = Field(gt=0, le=7 * 86400, description="pause for this long (at most a week)")


# The ranges of ``config.LimitsConfig`` (this package imports no config; a unit test
# keeps them equal), so that a change that validates here can also be applied.
MAX_RATE_MBIT = 100_000.0  # 100 Gbit/s
MAX_QUOTA_GB = 1_000_000.0  # 1 PB a month
MAX_BATCH_SIZE = 1 << 20


class LimitsChange(_Body):
    """Only the limits to change; the others keep their values."""

    upload_mbit: float | None = Field(
        None, ge=0, le=MAX_RATE_MBIT, description="Mbit/s, 0 = unlimited"
    )
    download_mbit: float | None = Field(
        None, ge=0, le=MAX_RATE_MBIT, description="Mbit/s, 0 = unlimited"
    )
    monthly_quota_gb: float | None = Field(
        None, ge=0, le=MAX_QUOTA_GB, description="GB per month, 0 = none"
    )
    duty_cycle: float | None = Field(None, gt=0, le=1)
    max_batch_size: int | None = Field(None, ge=0, le=MAX_BATCH_SIZE)

    def changes(self) -> dict[str, float | int]:
        return {k: v for k, v in self.model_dump().items() if v is not None}


# -- replies -------------------------------------------------------------------------------


class Health(_Reply):
    ok: bool
    version: str


class LimitsView(_Reply):
    upload_mbit: float
    download_mbit: float
    monthly_quota_gb: float
    duty_cycle: float
    max_batch_size: int
    month_bytes: int = 0  # sent + received this calendar month (for the quota)


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
    last_upgrade_at: float | None = None


class Rates(_Reply):
    samples_per_s: float = 0.0
    requests_per_s: float = 0.0
    upload_bytes_per_s: float = 0.0
    download_bytes_per_s: float = 0.0


class Totals(_Reply):
    forward: int = 0
    backward: int = 0
    samples: int = 0
    compute_s: float = 0.0
    bytes_in: int = 0
    bytes_out: int = 0
    running_s: float = 0.0
    paused_s: float = 0.0
    rejected: dict[str, int] = {}  # reason -> count

    @property
    def requests(self) -> int:
        return self.forward + self.backward


class Status(_Reply):
    version: str
    peer_id: str
    state: Mode
    serving: bool  # what the daemon does now (a change may be under way)
    reason: str  # why it is not serving ("" while serving)
    snoozed_until: float | None = None
    experiment: str | None = None
    device: str
    experts: list[str]
    reachability: Reachability
    limits: LimitsView
    started_at: float
    uptime_s: float
    connected_peers: int
    rates: Rates
    today: Totals  # since local midnight, including the last few unflushed seconds


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


class PeerView(_Reply):
    peer_id: str
    requests: int  # expert calls this daemon answered for the peer since it started
    refused: int  # its calls refused (paused, busy, over its limits, bad values...)
    connected: bool  # a libp2p connection is open now


class StatsBucket(_Reply):
    start: float
    size_s: int  # 3600 (hourly) or 86400 (daily, older than two weeks)
    forward: int
    backward: int
    samples: int
    compute_s: float
    bytes_in: int
    bytes_out: int


class Stats(_Reply):
    today: Totals
    week: Totals  # the last 7 days
    all_time: Totals
    history: list[StatsBucket]  # since the ``since`` asked for, oldest first


# What an event is about; the dashboard colours and refreshes by it.
EventKind = Literal[
    "started", "state", "limits", "experts", "reachability", "peers", "bans", "error"
]


class Event(_Reply):
    id: int
    time: float
    kind: str  # an EventKind (a plain str here: older clients read newer kinds)
    message: str


class Events(_Reply):
    events: list[Event]
    next: int  # pass as ``since`` to wait for the ones after these
