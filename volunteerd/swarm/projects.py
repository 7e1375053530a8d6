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

Every entry is checked as an invitation is (``swarm.invitation``), each on its own
(``read_projects``): an entry written by an older or newer release, whose rules
differ, or edited by hand, must not stop the daemon nor the volunteer's other
projects. A peer today's checks refuse is left out (with a warning); an entry left
without a usable peer, or with a bad name, owner or share, or repeated, is set aside:
kept in the file as it is, listed by ``volunteerd projects``, not hosted, removed by
``volunteerd leave``. Keys this release does not know are ignored and kept. Only a
file that is no list of entries (not TOML, not UTF-8, ``project`` not
``[[project]]`` tables) is a ConfigError naming the file, and the daemon does not
start (rather than silently leave its projects); nothing is written over it.

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
import shlex
import threading
from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from functools import partial
from pathlib import Path
from typing import Any, TypeGuard

import tomli_w

from volunteerd.atomic import make_private_dirs, write_atomic
from volunteerd.config import ExperimentsConfig
from volunteerd.config.toml_files import read_toml
from volunteerd.errors import ConfigError
from volunteerd.shown import short_id
from volunteerd.swarm.invitation import MAX_PEERS, Invitation, check_peer

__all__ = [
    "MAX_PROJECTS",
    "MAX_SHARE",
    "Project",
    "Recorded",
    "SetAside",
    "check_share",
    "join_project",
    "leave_project",
    "load_projects",
    "read_projects",
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


@dataclass(frozen=True, slots=True)
class SetAside:
    """An entry of the projects file that this release does not host, and why: one an
    older or newer release wrote under other rules (a peer address it accepted), or one
    edited by hand. It stays in the file as it is; ``leave`` removes it."""

    name: str  # as recorded ("" when it has none)
    owner: str  # as recorded ("" when it has none)
    problem: str  # what today's checks refuse in it
    twice: bool = False  # a second entry of a name hosted from an earlier one

    def advice(self) -> str:
        """What the volunteer can do about it, in one sentence, with a command that can
        be pasted into a shell (the name quoted: a file edited by hand may hold any)."""
        leave = f"`volunteerd leave {shlex.quote(self.name)}`"
        if self.twice:  # leave takes every entry of the name, the hosted one too
            return (
                "the first entry of that name is hosted; delete this one from the file, or "
                f"leave the project with {leave} (both entries) and join it again"
            )
        return f"join it again from a new invitation of its owner, or remove it with {leave}"


@dataclass(frozen=True, slots=True)
class Recorded:
    """What ``read_projects`` found in the projects file."""

    projects: list[Project]  # to host, in the file's order
    set_aside: list[SetAside]  # not hosted: ``SetAside.problem`` says why
    warnings: list[str]  # what was left out of entries hosted, and every entry set aside

    def entries(self) -> list[Project | SetAside]:
        return [*self.projects, *self.set_aside]


_KEYS = frozenset({"name", "owner", "peers", "share", "joined_at"})


def read_projects(path: Path) -> Recorded:
    """The projects in ``path`` (none if it does not exist), each entry on its own.

    A stored entry was checked when it was joined, by the release of that day; today's
    checks may refuse part of it. One such entry must not cost the volunteer the other
    projects, nor the daemon its start, nor ``leave`` its way to remove it: a peer
    today's rules refuse is left out (the others still join), an entry without a name,
    an owner, a usable peer or a valid share is set aside (listed, not hosted), and
    keys this release does not know are ignored (all of them stay in the file as they
    were). Raises ConfigError naming the file only when it is no list of entries at
    all: not TOML, not UTF-8, ``project`` not ``[[project]]`` tables."""
    return _recorded(path, _read(path))


def _recorded(path: Path, data: dict[str, Any]) -> Recorded:
    warnings: list[str] = []
    unknown = sorted(set(data) - {"project"})
    if unknown:
        shown = ", ".join(map(_shown, unknown))
        warnings.append(f"{path}: {shown}: not known to this release; ignored")
    projects: list[Project] = []
    set_aside: list[SetAside] = []
    for index, entry in enumerate(data.get("project", [])):
        where = f"{path}: project {index + 1}"
        if isinstance(entry.get("name"), str):
            where += f" ({_shown(entry['name'])})"
        checked = _checked(where, entry, warnings)
        if isinstance(checked, Project) and any(p.name == checked.name for p in projects):
            checked = SetAside(checked.name, checked.owner, "its name is listed twice", True)
        elif isinstance(checked, Project) and len(projects) >= MAX_PROJECTS:
            checked = SetAside(checked.name, checked.owner, f"at most {MAX_PROJECTS} are hosted")
        if isinstance(checked, SetAside):
            warnings.append(f"{where} is not hosted: {checked.problem}; {checked.advice()}")
            set_aside.append(checked)
        else:
            projects.append(checked)
    return Recorded(projects, set_aside, warnings)


def load_projects(path: Path) -> list[Project]:
    """The projects in ``path`` to host (``read_projects``: entries set aside left out).
    Raises ConfigError naming the file when it is no list of entries."""
    return read_projects(path).projects


def _read(path: Path) -> dict[str, Any]:
    try:
        data = read_toml(path)
    except FileNotFoundError:
        return {}
    entries = data.get("project", [])
    if not isinstance(entries, list) or not all(isinstance(e, dict) for e in entries):
        raise ConfigError(f"{path}: project: expected [[project]] tables, one a project")
    return data


def _checked(where: str, entry: dict[str, Any], warnings: list[str]) -> Project | SetAside:
    """``entry`` as a Project to host, or set aside; ``warnings`` gets what is ignored."""
    name, owner = entry.get("name"), entry.get("owner")
    name = name if isinstance(name, str) else ""
    owner = owner if isinstance(owner, str) else ""
    aside = partial(SetAside, name, owner)
    if not name:
        return aside("it names no experiment")
    unknown = sorted(set(entry) - _KEYS)
    if unknown:
        shown = ", ".join(map(_shown, unknown))
        warnings.append(f"{where}: {shown}: not known to this release; ignored")
    share = entry.get("share", 1.0)
    if not _number(share) or not 0 < share <= MAX_SHARE:
        return aside(f"its share {_shown(share)} is not above 0 and at most {MAX_SHARE:g}")
    joined_at = entry.get("joined_at", 0.0)
    if not _number(joined_at) or joined_at < 0:
        warnings.append(f"{where}: joined_at {_shown(joined_at)} is no time; ignored")
        joined_at = 0.0
    peers = entry.get("peers")
    if not isinstance(peers, list):
        return aside("it names no list of peers to join through")
    usable: list[str] = []
    refused: list[str] = []
    for peer in peers:
        try:
            check_peer(peer)
        except ConfigError as exc:
            refused.append(_reason(exc))
        else:
            if peer not in usable:
                usable.append(peer)
    if refused and not usable:
        return aside(f"none of its peers is one this release joins through: {refused[0]}")
    warnings.extend(f"{where}: {why}: left out, joined through its other peers" for why in refused)
    try:
        invitation = Invitation(name, owner, tuple(usable[:MAX_PEERS]))
    except ConfigError as exc:
        return aside(_reason(exc))
    return Project.invited(invitation, share=float(share), joined_at=float(joined_at))


def _number(value: object) -> TypeGuard[float]:
    return isinstance(value, int | float) and not isinstance(value, bool) and math.isfinite(value)


def _reason(exc: ConfigError) -> str:
    return str(exc).removeprefix("not a valid invitation: ")


def _shown(value: object) -> str:
    """A stored value in a message: short and escaped (the file may be anything)."""
    text = ascii(value)
    return text if len(text) <= 60 else f"{text[:44]}...{text[-13:]}"


def _name_of(entry: dict[str, Any]) -> str:
    name = entry.get("name")
    return name if isinstance(name, str) else ""


def _stored(project: Project) -> dict[str, Any]:
    return {
        "name": project.name,
        "owner": project.owner,
        "peers": list(project.peers),
        "share": project.share,
        "joined_at": project.joined_at,
    }


def _write(path: Path, data: dict[str, Any]) -> None:
    write_atomic(path, _HEADER + tomli_w.dumps(data))


def save_projects(path: Path, projects: Sequence[Project]) -> None:
    """Write ``projects`` to ``path`` atomically. Raises OSError."""
    _write(path, {"project": [_stored(p) for p in projects if not p.from_config]})


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


def replaced_owner(projects: Sequence[Project | SetAside], project: Project) -> str | None:
    """The owner of the project of ``project.name`` in ``projects`` when that is another
    owner (joining ``project`` would replace another owner's project); else None (also
    for an entry set aside that names no owner: there is nobody to tell of)."""
    old = next((p for p in projects if p.name == project.name and p.owner), None)
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
        data = _read(path)
        entries: list[dict[str, Any]] = data.get("project", [])
        stored = _stored(project)
        if any(_same_entry(e, stored) for e in entries):
            return False
        # set aside or not: an entry of that name of another owner is another project
        old_owner = replaced_owner(_recorded(path, data).entries(), project)
        if old_owner is not None and not replace:
            raise ConfigError(
                f"joining {project.name!r} of owner {short_id(project.owner)}: "
                f"{replacing(project.name, old_owner)}; nothing was changed without a yes"
            )
        kept = [e for e in entries if _name_of(e) != project.name]
        if len(kept) >= MAX_PROJECTS:
            raise ConfigError(f"at most {MAX_PROJECTS} projects; leave one first")
        # the others' entries are written back as they were read, unknown keys and all
        _write(path, {**data, "project": [*kept, stored]})
        return True


def _same_entry(entry: dict[str, Any], stored: dict[str, Any]) -> bool:
    """Whether ``entry``, as recorded, is ``stored`` (the join time aside)."""
    return {k: v for k, v in entry.items() if k != "joined_at"} == {
        k: v for k, v in stored.items() if k != "joined_at"
    }


def leave_project(path: Path, name: str) -> bool:
    """Remove project ``name`` from ``path``; False when it was not there. Raises
    ConfigError (a bad file) or OSError."""
    with _one_change_at_a_time(path):
        data = _read(path)
        entries: list[dict[str, Any]] = data.get("project", [])
        kept = [e for e in entries if _name_of(e) != name]  # set aside or not
        if len(kept) == len(entries):
            return False
        _write(path, {**data, "project": kept})
        return True
