"""The one exception tree of volunteerd, and its two mappings.

::

    VolunteerdError
    ├── ConfigError            bad config file, environment variable or flag
    │   ├── ConfigUnavailable  ... that cannot be read for now (a drive not mounted)
    │   └── UntrustedManifest  the experiment to join is signed by no trusted owner
    ├── CheckpointError        a checkpoint file is damaged or does not fit
    │   └── NewerCheckpoint    ... because a newer version wrote it (``.version``): not damaged
    ├── IdentityError          unreadable or invalid key file
    ├── ResourceUnavailable    a port or the data folder is already in use
    ├── WireError              bad input from the network (each has a wire code)
    │   ├── FrameTooLarge      a declared size is over a cap          -> "too_large"
    │   ├── MalformedFrame     bytes that do not parse                -> "malformed"
    │   ├── UnsupportedVersion a frame version we do not speak        -> "unsupported_version"
    │   ├── BadDtype           tensor dtype not allowed by the schema -> "bad_dtype"
    │   └── BadShape           tensor shape not allowed by the schema -> "bad_shape"
    ├── UnknownExpert          no such expert on this server          -> "unknown_expert"
    ├── ActivationsExpired     a backward's handle is not (any longer) known -> "expired"
    ├── SnapshotExpired        a shard snapshot is no longer kept      -> "expired"
    ├── Busy                   the expert's queue is full             -> "busy"
    ├── Paused                 the volunteer paused serving           -> "paused"
    ├── RateLimited            a peer is over its per-peer limits     -> "rate_limited"
    ├── Rejected               tensors refused on their values        -> "rejected"
    ├── InvalidRecord          a DHT record failed validation
    ├── PeerError              talking to a peer failed (client side)
    │   ├── PeerUnreachable    could not open a stream to the peer
    │   │   └── StreamTimedOut  ... because nothing answered in time (a dead connection?)
    │   ├── RequestTimeout     the peer did not answer in time
    │   │   └── ReplyTooSlow   ... its reply was arriving, too slowly to be whole in time
    │   ├── RemoteError        the peer answered with a typed error (``.code``)
    │   ├── ReplyTooLarge      a reply declared more than its call asked for (also a FrameTooLarge)
    │   ├── ShardError         a shard download failed (bad bytes, or the peer kept failing)
    │   │   └── ShardTooSlow   ... because its bytes came slower than the least rate (``.fetched``)
    │   └── TrainerStateError  another trainer's state is not usable (too large, not a trainer's)
    ├── NoExpertsAvailable     no expert of a layer is alive or answers (a trainer skips the step)
    ├── ModelDiverging         the output checks refused every answer, blaming no peer
    ├── ShuttingDown           the service is stopping                -> "shutting_down"
    ├── ControlError           the control API refused a request (``.status``, ``.field``)
    │   └── DaemonNotRunning   no daemon answers on this data folder's control address
    │       └── DaemonNotAnswering  its daemon runs but did not answer in time (busy)
    ├── UsageError             a command-line value that argparse could not check
    └── Interrupted            the user asked a command to stop (Ctrl-C)

``wire_code`` maps an exception to the error code sent to a peer (anything not in
the tree is an internal error and never leaks its message), and ``retry_after`` to the
seconds its reply says to wait, when it says (a ``Busy`` or ``RateLimited`` for a
transfer quota's share used up until midnight, a ``Paused`` for the quota itself).
``exit_code`` maps an exception that ended the process to the exit status that service
managers rely on.
"""

from __future__ import annotations

from enum import IntEnum

__all__ = [
    "RETRY_AFTER_MOST_S",
    "ActivationsExpired",
    "BadDtype",
    "BadShape",
    "Busy",
    "CheckpointError",
    "ConfigError",
    "ConfigUnavailable",
    "ControlError",
    "DaemonNotAnswering",
    "DaemonNotRunning",
    "ExitCode",
    "FrameTooLarge",
    "IdentityError",
    "Interrupted",
    "InvalidRecord",
    "MalformedFrame",
    "ModelDiverging",
    "NewerCheckpoint",
    "NoExpertsAvailable",
    "Paused",
    "PeerError",
    "PeerUnreachable",
    "RateLimited",
    "Rejected",
    "RemoteError",
    "ReplyTooLarge",
    "ReplyTooSlow",
    "RequestTimeout",
    "ResourceUnavailable",
    "ShardError",
    "ShardTooSlow",
    "ShuttingDown",
    "SnapshotExpired",
    "StreamTimedOut",
    "TrainerStateError",
    "UnknownExpert",
    "UnsupportedVersion",
    "UntrustedManifest",
    "UsageError",
    "VolunteerdError",
    "WireError",
    "exit_code",
    "retry_after",
    "wire_code",
]


class VolunteerdError(Exception):
    """Base of every error volunteerd raises on purpose."""

    code = "internal"


class ConfigError(VolunteerdError):
    """The configuration (file, environment or flags) is invalid."""


class UntrustedManifest(ConfigError):
    """The experiment named in ``experiments.join`` was found only with manifests signed
    by owners this daemon was not told to trust. Restarting will not help: trust the
    owner (``experiments.trusted_owners``) or join another experiment."""

    def __init__(self, name: str, owners: list[str], *, trainer: bool = False) -> None:
        listed = ", ".join(owners)
        first = owners[0] if owners else ""
        # A trainer has no --set and reads its owners from the experiment file's [swarm]
        # table: the daemon's hint sent researchers to a flag ``train`` refuses.
        how = (
            f"add it to swarm.trusted_owners in the experiment file (e.g. "
            f'trusted_owners = ["{first}"] under [swarm]), or train with --invitation'
            if trainer
            else f"add it to experiments.trusted_owners (e.g. "
            f"--set 'experiments.trusted_owners=[\"{first}\"]')"
        )
        super().__init__(
            f"experiment {name!r} is signed by {listed}, which is not a trusted owner; "
            f"to trust it, {how}"
        )
        self.name = name
        self.owners = owners


class ConfigUnavailable(ConfigError):
    """A configuration file that cannot be read for now: a link to nothing (a drive not
    mounted yet) or an I/O error of its drive. A ConfigError to the code that keeps the
    old settings on a bad file, but exit 5 (restarting may help), not 3: the service
    manager does not restart a 3, and a daemon whose ``projects.toml`` sat on a drive
    mounted after it started stayed down until the next login."""


class IdentityError(VolunteerdError):
    """The node's key file cannot be read or is not a valid Ed25519 key."""


class CheckpointError(VolunteerdError):
    """A checkpoint file is damaged, partial, or not one this expert can load."""


class NewerCheckpoint(CheckpointError):
    """A checkpoint of a format version above this version's (``version``): written by a
    newer volunteerd, sound as far as anyone here can tell. Never set aside as damaged."""

    def __init__(self, message: str, *, version: int) -> None:
        super().__init__(message)
        self.version = version


class ResourceUnavailable(VolunteerdError):
    """Something this process needs is held by another (a port, the data folder)."""


class ControlError(VolunteerdError):
    """The daemon's control API answered with an error: ``status`` is the HTTP status,
    ``field`` the request field it refused (if any)."""

    def __init__(self, message: str, *, status: int = 0, field: str | None = None) -> None:
        super().__init__(message)
        self.status = status
        self.field = field


class DaemonNotRunning(ControlError):
    """No daemon answers at the control address recorded in the data folder."""


class DaemonNotAnswering(DaemonNotRunning):
    """The daemon recorded in the data folder runs, but its control API did not answer
    within the client's timeout: a busy computer (the daemon runs at low priority)."""


class UsageError(VolunteerdError):
    """A command-line value that is not valid (exit code 2, as argparse's own)."""


class WireError(VolunteerdError):
    """Bytes from the network that we refuse; ``code`` is sent back to the peer."""

    code = "malformed"


class FrameTooLarge(WireError):
    code = "too_large"


class MalformedFrame(WireError):
    code = "malformed"


class UnsupportedVersion(WireError):
    code = "unsupported_version"


class BadDtype(WireError):
    code = "bad_dtype"


class BadShape(WireError):
    code = "bad_shape"


class UnknownExpert(VolunteerdError):
    code = "unknown_expert"


class _Later(VolunteerdError):
    """A refusal that may say how long until asking again is of use
    (``retry_after_s``, sent in the ``ErrorReply``): a transfer quota's share for bulk
    replies, used up until its day ends (``server.transfers``). None: soon, or unknown
    (a full queue)."""

    def __init__(self, *args: object, retry_after_s: float | None = None) -> None:
        super().__init__(*args)
        self.retry_after_s = retry_after_s


class Busy(_Later):
    code = "busy"


class RateLimited(_Later):
    """A peer is over its request rate, inbound byte rate or concurrent stream cap, or
    its share of the bulk replies' budget (``retry_after_s``)."""

    code = "rate_limited"


class Rejected(VolunteerdError):
    """The request's tensors were refused on their values (non-finite, an outlier)."""

    code = "rejected"


class ActivationsExpired(VolunteerdError):
    """The forward a backward refers to is no longer kept: send the inputs again."""

    code = "expired"


class SnapshotExpired(VolunteerdError):
    """The shard snapshot a download is resuming is no longer kept: start again."""

    code = "expired"


class InvalidRecord(VolunteerdError):
    """A DHT record that failed validation (signature, expiry, size or form)."""

    code = "invalid_record"


class Paused(_Later):
    """The volunteer paused serving (or a transfer quota is used up): choose another
    expert; this one may come back later. ``retry_after_s``: when serving resumes, where
    that is known (a used-up quota's day or month ending; sent to ``params`` and
    ``shard`` callers only, ``server.pausing``); None for a volunteer's pause."""

    code = "paused"


class NoExpertsAvailable(VolunteerdError):
    """No expert of the layer could be found alive, or none answered."""


class ModelDiverging(VolunteerdError):
    """Experts answered, but the output checks refused every answer a token could use,
    and they blame no peer: most answers of a round were non-finite, or exceeded
    ``max_abs`` without having grown there step by step. The model (its loss, learning
    rate, or ``max_abs``) needs the researcher's attention; retrying will not help."""


class ShuttingDown(VolunteerdError):
    code = "shutting_down"


class Interrupted(VolunteerdError):
    """The user asked a command to stop (Ctrl-C); it stopped cleanly."""


class PeerError(VolunteerdError):
    """A request to a peer failed; the peer may be fine for other requests. Its code
    (``broken``: the stream closed or the reply was unusable) is this side's, never
    sent; a ``RemoteError`` carries the peer's ("internal": a bug on its side)."""

    code = "broken"


class PeerUnreachable(PeerError):
    code = "unreachable"


class StreamTimedOut(PeerUnreachable):
    """No stream opened because the peer did not answer in time, where a refusal (a
    protocol it does not serve) would have come at once: its connection may be dead."""


class RequestTimeout(PeerError):
    code = "timeout"


class ReplyTooSlow(RequestTimeout):
    """The reply had begun (its prefix declared ``declared`` bytes) and ``received`` of
    them had arrived when the call's deadline cut it: the peer was answering, slower
    than the deadline allowed, not gone."""

    def __init__(self, message: str, *, received: int, declared: int) -> None:
        super().__init__(message)
        self.received = received
        self.declared = declared


# How much of a peer's error message is kept: the wire allows 1,000 characters of any
# text, and it goes on into the log and a project's error (the tray, the dashboard).
REMOTE_MESSAGE_CHARS = 300


class RemoteError(PeerError):
    """The peer answered with a typed error reply (its message's start, if long), and
    maybe how many seconds until asking again is of use (``retry_after_s``, None when
    it did not say: a peer's claim, bounded by the wire model)."""

    def __init__(self, code: str, message: str, retry_after_s: float | None = None) -> None:
        if len(message) > REMOTE_MESSAGE_CHARS:
            message = f"{message[:REMOTE_MESSAGE_CHARS]}... ({len(message)} characters)"
        super().__init__(f"{code}: {message}")
        self.code = code
        self.message = message
        self.retry_after_s = retry_after_s


class ReplyTooLarge(FrameTooLarge, PeerError):
    """A reply declared a header or body over the cap of its call; refused from its
    prefix, before the rest was read. A ``FrameTooLarge`` (wire code ``too_large``) and a
    ``PeerError``, so callers that treat a failed peer as failed need no new case."""


class ShardError(PeerError):
    """A shard download failed: its bytes do not match their SHA-256, the peer's replies
    contradict each other, or the peer kept failing. ``.resumable`` says whether the
    partial file was kept for a later call to resume."""

    def __init__(self, message: str, *, resumable: bool) -> None:
        super().__init__(message)
        self.resumable = resumable


class ShardTooSlow(ShardError):
    """A shard download fell behind its least rate (``download_shard``'s ``min_rate``);
    the partial file is kept. ``fetched``: the bytes this call received (0: the peer
    sent nothing, and the ``__cause__`` is a RequestTimeout)."""

    def __init__(self, message: str, *, fetched: int) -> None:
        super().__init__(message, resumable=True)
        self.fetched = fetched


class TrainerStateError(PeerError):
    """Another trainer's published state or info cannot be used: larger than allowed,
    not a trainer's checkpoint, or an answer for another experiment."""


# Codes a peer may send us; anything else is reported as "internal".
WIRE_CODES = frozenset(
    {
        "malformed",
        "too_large",
        "unsupported_version",
        "bad_dtype",
        "bad_shape",
        "unknown_expert",
        "busy",
        "rate_limited",
        "rejected",
        "expired",
        "invalid_record",
        "shutting_down",
        "paused",
        "internal",
    }
)


def wire_code(exc: BaseException) -> str:
    """The error code to send to a peer for ``exc``; unknown failures are "internal"."""
    if isinstance(exc, VolunteerdError) and exc.code in WIRE_CODES:
        return exc.code
    return "internal"


# The longest ``retry_after_s`` an ``ErrorReply`` may carry: a quota's day ends within
# one (two, with a clock set back across midnight, or a daylight-saving change).
RETRY_AFTER_MOST_S = 2 * 86400.0


def retry_after(exc: BaseException) -> float | None:
    """The ``retry_after_s`` to send to a peer with ``exc``'s error code: a ``Busy``'s,
    ``RateLimited``'s or ``Paused``'s, within what the wire allows (two days); None for
    every other error, and when it says none."""
    if not isinstance(exc, _Later) or exc.retry_after_s is None:
        return None
    return min(max(0.0, float(exc.retry_after_s)), RETRY_AFTER_MOST_S)


class ExitCode(IntEnum):
    """Process exit statuses; packaging/ service units rely on these numbers."""

    OK = 0
    ERROR = 1  # unexpected failure: a bug
    USAGE = 2  # bad command line (argparse's own convention)
    CONFIG = 3  # the configuration is invalid: restarting will not help
    UNAVAILABLE = 5  # a needed resource (port, key file) is not available
    INTERRUPTED = 130  # stopped by SIGINT/SIGTERM, cleanly


def exit_code(exc: BaseException) -> ExitCode:
    """The process exit status for an exception that ended a command."""
    if isinstance(exc, ConfigUnavailable):
        return ExitCode.UNAVAILABLE
    if isinstance(exc, ConfigError):
        return ExitCode.CONFIG
    if isinstance(exc, UsageError) or (isinstance(exc, ControlError) and exc.status == 422):
        return ExitCode.USAGE
    if isinstance(exc, IdentityError | ResourceUnavailable | DaemonNotRunning | OSError):
        return ExitCode.UNAVAILABLE
    if isinstance(exc, KeyboardInterrupt | Interrupted):
        return ExitCode.INTERRUPTED
    return ExitCode.ERROR
