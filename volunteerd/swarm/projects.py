"""The projects a volunteer has joined, kept in ``<data dir>/projects.toml``.

``volunteerd join INVITATION`` (or the control API's ``POST /api/v1/projects``) adds
one, ``volunteerd leave NAME`` removes it. The daemon reads the file when it starts
and hosts a share of each project's experiment (one ``swarm.joiner.Joiner`` each), so
a running daemon restarts itself after a change (``daemon``). Written atomically::

    [[project]]
    name = "tiny-lm"                # the experiment (its manifest's name)
    owner = "12D3KooW..."           # the one key whose signed manifest is trusted
    peers = ["/ip4/203.0.113.7/tcp/38400/p2p/12D3KooW..."]  # joined through
    share = 1.0                     # of this machine's room for experts, against the others'
    joined_at = 1767225600.0

Every entry is checked as an invitation is (``swarm.invitation``): a file that does
not parse, or holds a bad or repeated entry, is a ConfigError naming the file, and the
daemon does not start (rather than silently leave a project).

A project may also come from the config file (``experiments.join``, with its
``trusted_owners``): it is run like the others but is not in this file, and ``leave``
cannot remove it (the config file says so; edit it there).

Joining a project of the name of one joined already replaces it. Under the same owner
that is the same project (new peers to join through, a new share); under another
owner it is another project, and ``join_project`` refuses it unless asked to
``replace`` it: the person joining must have been told (``replacing``) and have said
yes. The new owner's experts do not start from the old owner's weights, though
checkpoints are kept by uid: a checkpoint records the ``<owner>/<name>`` it was trained
for, and one of another owner's is not loaded (``ExpertBackend.check_state``), so each
starts from a replica, else its initial weights. The old files stay until the new
saves prune them (``checkpoints.keep``).
"""

from __future__ import annotations

import contextlib
import math
import threading
from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path

import tomli_w
from pydantic import BaseModel, ConfigDict, Field, ValidationError

from volunteerd.atomic import make_private_dirs, write_atomic
from volunteerd.config import ExperimentsConfig
from volunteerd.config.toml_files import read_toml
from volunteerd.errors import ConfigError
from volunteerd.shown import short_id
from volunteerd.swarm.invitation import Invitation

__all__ = [
    "MAX_PROJECTS",
    "MAX_SHARE",
    "Project",
    "check_share",
    "join_project",
    "leave_project",
    "load_projects",
    "replaced_owner",
    "replacing",
    "save_projects",
    "share_of",
]

MAX_PROJECTS = 16
MAX_SHARE = 100.0  # control.models repeats it (control imports no swarm); a test keeps both

_HEADER = (
    "# The projects this volunteer has joined: `volunteerd join INVITATION` adds one,\n"
    "# `volunteerd leave NAME` removes it (a running daemon restarts to apply either).\n"
)


@dataclass(frozen=True, slots=True)
class Project:
    """One experiment this daemon contributes to, and whose it is."""

    name: str
    owner: str  # the peer id whose signed manifest is trusted ("" for a config project)
    peers: tuple[str, ...]  # multiaddrs to join through, besides network.bootstrap_peers
    share: float = 1.0  # of the room for experts, against the other projects' shares
    joined_at: float = 0.0
    from_config: bool = False  # experiments.join: not in projects.toml, cannot be left

    @classmethod
    def invited(cls, invitation: Invitation, *, share: float, joined_at: float) -> Project:
        check_share(share)
        return cls(invitation.name, invitation.owner, invitation.peers, share, joined_at)

    @classmethod
    def from_experiments(cls, experiments: ExperimentsConfig) -> Project | None:
        """The project the config file names (``experiments.join``), if any."""
        if not experiments.join:
            return None
        owners = experiments.trusted_owners
        return cls(experiments.join, owners[0] if len(owners) == 1 else "", (), from_config=True)

    def experiments(self, base: ExperimentsConfig) -> ExperimentsConfig:
        """``base`` (the config's joining settings) for this project: its name, and its
        owner as the one trusted (a config project keeps ``base`` as it is)."""
        if self.from_config:
            return base
        return base.model_copy(update={"join": self.name, "trusted_owners": [self.owner]})

    def same_entry(self, other: Project) -> bool:
        """Whether joining ``other`` would change nothing (the join time aside)."""
        return (self.name, self.owner, self.peers, self.share) == (
            other.name,
            other.owner,
            other.peers,
            other.share,
        )


def check_share(share: float) -> None:
    """Raises ConfigError unless ``share`` is a finite number in (0, MAX_SHARE]."""
    if not (math.isfinite(share) and 0 < share <= MAX_SHARE):
        raise ConfigError(f"a project's share must be above 0 and at most {MAX_SHARE:g}")


def share_of(total: int, project: Project, projects: Sequence[Project]) -> int:
    """How many of ``total`` places for experts go to ``project``: in proportion to its
    share of all ``projects``' shares, at least one."""
    shares = sum(p.share for p in projects) or project.share
    return max(1, int(total * project.share / shares))


class _Entry(BaseModel):
    model_config = ConfigDict(frozen=True, extra="forbid", allow_inf_nan=False, strict=True)

    name: str
    owner: str
    peers: list[str]
    share: float = Field(1.0, gt=0, le=MAX_SHARE)
    joined_at: float = Field(0.0, ge=0)


class _File(BaseModel):
    model_config = ConfigDict(frozen=True, extra="forbid")

    project: list[_Entry] = Field(default_factory=list, max_length=MAX_PROJECTS)


def load_projects(path: Path) -> list[Project]:
    """The projects in ``path`` (none if it does not exist). Raises ConfigError naming
    the file and what is wrong in it."""
    try:
        data = read_toml(path)
    except FileNotFoundError:
        return []
    try:
        entries = _File.model_validate(data).project
    except ValidationError as exc:
        first = exc.errors()[0]
        where = ".".join(str(p) for p in first["loc"])
        raise ConfigError(f"{path}: {where}: {first['msg']}") from None
    projects: list[Project] = []
    for index, entry in enumerate(entries):
        try:
            invitation = Invitation(entry.name, entry.owner, tuple(entry.peers))
        except ConfigError as exc:
            raise ConfigError(f"{path}: project {index + 1}: {exc}") from None
        if any(p.name == entry.name for p in projects):
            raise ConfigError(f"{path}: project {entry.name!r} is listed twice")
        projects.append(Project.invited(invitation, share=entry.share, joined_at=entry.joined_at))
    return projects


def save_projects(path: Path, projects: Sequence[Project]) -> None:
    """Write ``projects`` to ``path`` atomically. Raises OSError."""
    entries = [
        {
            "name": p.name,
            "owner": p.owner,
            "peers": list(p.peers),
            "share": p.share,
            "joined_at": p.joined_at,
        }
        for p in projects
        if not p.from_config
    ]
    write_atomic(path, _HEADER + tomli_w.dumps({"project": entries}))


# Joins and leaves read, change and write the whole file: one at a time, or of two at
# once (the dashboard and `volunteerd join`, or eight requests of a script) the one that
# wrote last erased the other's change, though both were answered "done".
_CHANGING = threading.Lock()


@contextlib.contextmanager
def _one_change_at_a_time(path: Path) -> Iterator[None]:
    """This process's threads in turn, and (where the OS has ``flock``) other processes
    changing the same file too."""
    with _CHANGING:
        try:
            import fcntl
        except ImportError:  # pragma: no cover - Windows: one process changes it, the daemon
            yield
            return
        make_private_dirs(path.parent)
        with open(path.with_name(f".{path.name}.lock"), "a") as lock:
            fcntl.flock(lock.fileno(), fcntl.LOCK_EX)
            try:
                yield
            finally:
                fcntl.flock(lock.fileno(), fcntl.LOCK_UN)


def replaced_owner(projects: Sequence[Project], project: Project) -> str | None:
    """The owner of the project of ``project.name`` in ``projects`` when that is another
    owner (joining ``project`` would replace another owner's project); else None."""
    old = next((p for p in projects if p.name == project.name), None)
    return old.owner if old is not None and old.owner != project.owner else None


def replacing(name: str, old_owner: str) -> str:
    """What a person is told before joining ``name`` replaces ``old_owner``'s project."""
    return (
        f"this replaces the project {name!r} of owner {short_id(old_owner)} (this "
        "computer stops helping it; the new project's experts do not start from its weights)"
    )


def join_project(path: Path, project: Project, *, replace: bool = False) -> bool:
    """Record ``project`` in ``path``, in place of an entry of the same name; of another
    owner's only with ``replace`` (the person was told, ``replacing``, and said yes).
    Returns False when an equal entry was there already (nothing written). Raises
    ConfigError (a bad file, too many projects, or another owner's project of that
    name without ``replace``) or OSError."""
    with _one_change_at_a_time(path):
        projects = load_projects(path)
        if any(p.same_entry(project) for p in projects):
            return False
        old_owner = replaced_owner(projects, project)
        if old_owner is not None and not replace:
            raise ConfigError(
                f"joining {project.name!r} of owner {short_id(project.owner)}: "
                f"{replacing(project.name, old_owner)}; nothing was changed without a yes"
            )
        kept = [p for p in projects if p.name != project.name]
        if len(kept) >= MAX_PROJECTS:
            raise ConfigError(f"at most {MAX_PROJECTS} projects; leave one first")
        save_projects(path, [*kept, project])
        return True


def leave_project(path: Path, name: str) -> bool:
    """Remove project ``name`` from ``path``; False when it was not there. Raises
    ConfigError (a bad file) or OSError."""
    with _one_change_at_a_time(path):
        projects = load_projects(path)
        kept = [p for p in projects if p.name != name]
        if len(kept) == len(projects):
            return False
        save_projects(path, kept)
        return True
