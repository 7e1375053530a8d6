"""The checkpoint folders on disk, without torch (a daemon hosting nothing tidies them
too): ``<checkpoints>/<uid>/<sequence>.ckpt``, newest the highest sequence.

``trim_others`` bounds what experts no longer hosted keep: dropped for a later rejoin,
moved to another volunteer, or of a project left, each keeps only its newest file, and
only the ``keep_experts`` saved last keep any. Nothing deleted them before: a daemon
whose experts moved every few minutes gathered two files of every expert it ever hosted
(an outside probe: 43 folders, 134 MB after 40 moves at hidden 128, ~200 MB a move at
hidden 1024).

``unreachable`` tells a checkpoints folder that is missing because nothing was saved
yet (a first start) from one that cannot be reached: a link to a drive not mounted, or
to a file. ``numbered`` sees no checkpoint in either, and a daemon started on such a
link served every expert from its initial weights without a word, then logged
"File exists" at every save.

A file that fails its checks when loaded is set aside (``set_aside``): renamed
``<sequence>.ckpt.damaged``, a name that neither loading nor pruning sees, the newest
``DAMAGED_KEPT`` of an expert kept. Counted among the checkpoints, pruning deleted them
within two save rounds (one with ``checkpoints.keep = 1``), and with them what was left
of an expert whose every file was damaged.
"""

from __future__ import annotations

import contextlib
import logging
import os
import re
import stat
from collections.abc import Callable, Collection
from contextlib import AbstractContextManager
from pathlib import Path

from volunteerd.atomic import fsync_dir

__all__ = [
    "DAMAGED_KEPT",
    "DAMAGED_SUFFIX",
    "OTHERS_KEPT",
    "SUFFIX",
    "damaged",
    "numbered",
    "set_aside",
    "trim_others",
    "unreachable",
]

logger = logging.getLogger(__name__)

OTHERS_KEPT = 16
"""Experts no longer hosted whose newest checkpoint is kept (the ones saved last)."""

SUFFIX = ".ckpt"
_NAME = re.compile(r"^(\d{1,12})\.ckpt$")

DAMAGED_SUFFIX = ".damaged"
DAMAGED_KEPT = 2
"""Files set aside as damaged that each expert keeps (its newest): for a person to look
at, bounded so that a disk that keeps damaging them cannot fill up."""
_DAMAGED_NAME = re.compile(r"^(\d{1,12})\.ckpt\.damaged$")


def numbered(folder: Path) -> list[tuple[int, Path, bool]]:
    """(sequence, path, whether a regular file) of every entry of ``folder`` named like a
    checkpoint, newest first."""
    try:
        entries = list(os.scandir(folder))
    except (FileNotFoundError, NotADirectoryError):
        return []
    found = []
    for entry in entries:
        match = _NAME.match(entry.name)
        if match:
            try:
                regular = entry.is_file(follow_symlinks=False)
            except OSError:
                regular = False
            found.append((int(match.group(1)), folder / entry.name, regular))
    return sorted(found, reverse=True)


def damaged(folder: Path) -> list[tuple[int, Path]]:
    """(sequence, path) of the regular files of ``folder`` set aside as damaged, newest
    first."""
    try:
        entries = list(os.scandir(folder))
    except OSError:
        return []
    found = []
    for entry in entries:
        match = _DAMAGED_NAME.match(entry.name)
        with contextlib.suppress(OSError):
            if match and entry.is_file(follow_symlinks=False):
                found.append((int(match.group(1)), folder / entry.name))
    return sorted(found, reverse=True)


def set_aside(path: Path) -> Path:
    """(Blocking.) Rename the damaged checkpoint ``path`` to ``<name>.damaged``, out of
    what is loaded and pruned, and delete its folder's damaged files beyond the newest
    ``DAMAGED_KEPT``. Returns the new path; raises OSError (nothing renamed)."""
    moved = path.with_name(path.name + DAMAGED_SUFFIX)
    os.replace(path, moved)
    with contextlib.suppress(OSError):  # not durable: found damaged again, set aside again
        fsync_dir(path.parent)
    for _, old in damaged(path.parent)[DAMAGED_KEPT:]:
        try:
            old.unlink(missing_ok=True)
        except OSError as exc:
            logger.warning("%s: not deleted (%s)", old, exc)
    return moved


def unreachable(directory: Path, what: str = "checkpoints folder") -> str | None:
    """(Blocking.) Why the checkpoints folder ``directory`` (``what`` names it: an
    expert's own folder too) cannot be used, in a sentence that names it and says what
    to do; None when it is a folder, or when there is nothing at all of that name yet
    (the first save makes it)."""
    try:
        info = os.stat(directory)  # through a link
    except FileNotFoundError:
        if not directory.is_symlink():
            return None
        return (
            f"{what} {directory} is a link to {_target(directory)}, which is "
            "missing: mount the drive it is on, or remove the link"
        )
    except OSError as exc:
        return f"{what} {directory} cannot be reached: {exc.strerror or exc}"
    if stat.S_ISDIR(info.st_mode):
        return None
    if directory.is_symlink():
        return (
            f"{what} {directory} is a link to {_target(directory)}, which is "
            "not a folder: link it to a folder, or remove the link"
        )
    return f"{what} {directory} is not a folder: move it away"


def _target(link: Path) -> str:
    try:
        return os.readlink(link)
    except OSError:  # replaced meanwhile
        return "?"


def _files(folder: Path) -> list[Path]:
    return [path for _, path, regular in numbered(folder) if regular]


def trim_others(
    directory: Path,
    hosted: Collection[str],
    keep_experts: int,
    locked: Callable[[str], AbstractContextManager[object]] = lambda uid: contextlib.nullcontext(),
) -> list[Path]:
    """(Blocking.) Delete what the checkpoints of experts not in ``hosted`` hold beyond
    each one's newest file, and all of those beyond the ``keep_experts`` saved last (by
    their newest file); ``locked(uid)`` is held while a folder is trimmed (the store's
    save lock). Returns the files deleted. Raises OSError when ``directory`` cannot be
    listed (too many open files): a file that cannot be deleted is only logged."""
    if not directory.is_dir():
        return []
    others: list[tuple[float, str]] = []
    for folder in directory.iterdir():
        if folder.name in hosted or not folder.is_dir() or folder.is_symlink():
            continue
        files = _files(folder)
        with contextlib.suppress(OSError):
            if files:
                others.append((files[0].stat().st_mtime, folder.name))
    deleted: list[Path] = []
    for rank, (_, uid) in enumerate(sorted(others, reverse=True)):
        folder = directory / uid
        with locked(uid):  # listed again: a save of it may have finished since
            files = _files(folder)
            if rank >= keep_experts:  # those set aside go with the folder
                files += [path for _, path in damaged(folder)]
            for path in files[1:] if rank < keep_experts else files:
                try:
                    path.unlink(missing_ok=True)
                except OSError as exc:
                    logger.warning("%s: not deleted (%s)", path, exc)
                    continue
                deleted.append(path)
            if rank >= keep_experts:
                with contextlib.suppress(OSError):  # not empty: not only ours in it
                    folder.rmdir()
    if deleted:
        logger.info(
            "deleted %d checkpoint files of experts no longer hosted (the %d saved last "
            "keep their newest)",
            len(deleted),
            keep_experts,
        )
    return deleted
