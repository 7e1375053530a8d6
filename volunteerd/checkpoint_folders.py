"""The checkpoint folders on disk, without torch (a daemon hosting nothing tidies them
too): ``<checkpoints>/<uid>/<sequence>.v<format>.ckpt``, newest the highest sequence.

The format version (``FORMAT_VERSION``) is in each file's name, in its magic and in its
header. Releases up to format 1 named their files ``<sequence>.ckpt`` and load and prune
every file of that name: a format-1 reader refuses a header field it does not know, so
it took a later version's file for damaged, served its experts' initial weights, and
its next save deleted the later version's files (an outside audit: a project's trained
weights lost after a downgrade). Files of format 2 have a name those releases neither
load nor prune. The rule, for every later change: whatever a version writes that an
earlier reader would refuse (a new header field, a new tensor name, a new dtype, another
layout) raises ``FORMAT_VERSION``, and with it the name.

Which files a version uses:

- its own format's: loaded newest first, pruned to ``keep`` by its saves;
- an older format's (``<sequence>.ckpt``): loaded, for migration, only after its own
  (none, or none good: an older daemon started after a downgrade wrote those from
  scratch or from a replica, and they are not preferred over ours), and deleted as
  superseded once a file of its own format is saved;
- a newer format's (a higher version in the name, or in the magic or header of a file of
  another name: ``newer_format``): never loaded, never set aside as damaged, never
  deleted, by a save, the trimming below or the disk budget. The expert is started as
  one with no checkpoint here (from a replica, or its initial weights), with a warning
  to upgrade, and the file stays for the version that wrote it.

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
``<name>.damaged``, a name that neither loading nor pruning sees, the newest
``DAMAGED_KEPT`` of an expert kept. Counted among the checkpoints, pruning deleted them
within two save rounds (one with ``checkpoints.keep = 1``), and with them what was left
of an expert whose every file was damaged.
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import logging
import os
import re
import stat
import struct
from collections.abc import Callable, Collection
from contextlib import AbstractContextManager
from pathlib import Path
from typing import NamedTuple

from volunteerd.atomic import fsync_dir

__all__ = [
    "DAMAGED_KEPT",
    "DAMAGED_SUFFIX",
    "FORMAT_VERSION",
    "OTHERS_KEPT",
    "SUFFIX",
    "Entry",
    "checkpoint_name",
    "damaged",
    "loadable",
    "magic",
    "newer_format",
    "numbered",
    "set_aside",
    "stated_version",
    "trim_others",
    "unreachable",
]

logger = logging.getLogger(__name__)

OTHERS_KEPT = 16
"""Experts no longer hosted whose newest checkpoint is kept (the ones saved last)."""

FORMAT_VERSION = 2
"""The checkpoint format this version writes and the highest it reads (see above)."""

SUFFIX = ".ckpt"
# "<sequence>.ckpt" (format 1) or "<sequence>.v<format>.ckpt"
# (ASCII digits, the whole name: "\d" takes "٣" and "$" a name's trailing newline)
_NAME = re.compile(r"([0-9]{1,12})(?:\.v([1-9][0-9]{0,5}))?\.ckpt")

DAMAGED_SUFFIX = ".damaged"
DAMAGED_KEPT = 2
"""Files set aside as damaged that each expert keeps (its newest): for a person to look
at, bounded so that a disk that keeps damaging them cannot fill up."""
_DAMAGED_NAME = re.compile(r"([0-9]{1,12})(?:\.v([1-9][0-9]{0,5}))?\.ckpt\.damaged")

# A file's first bytes: the magic (b"VCKPT\x00", the format version, b"\n"), the
# header's length and the header's SHA-256 (experts.checkpoint_file has the rest).
_MAGIC_START = b"VCKPT\x00"
PREFIX = struct.Struct("<8sI32s")
MAX_HEADER_BYTES = 4 << 20


def magic(version: int) -> bytes:
    """The 8 bytes a checkpoint of format ``version`` starts with."""
    return _MAGIC_START + bytes([version]) + b"\n"


def checkpoint_name(sequence: int, version: int = FORMAT_VERSION) -> str:
    """The file name of checkpoint ``sequence`` in format ``version``."""
    return f"{sequence:012d}{SUFFIX}" if version == 1 else f"{sequence:012d}.v{version}{SUFFIX}"


class Entry(NamedTuple):
    """An entry of an expert's folder named like a checkpoint."""

    sequence: int
    path: Path
    regular: bool  # a regular file (a folder, a FIFO or a link of the name is not ours)
    version: int  # the format version its name states (1: "<sequence>.ckpt")


def numbered(folder: Path) -> list[Entry]:
    """Every entry of ``folder`` named like a checkpoint of any format, newest (highest
    sequence) first."""
    try:
        entries = list(os.scandir(folder))
    except (FileNotFoundError, NotADirectoryError):
        return []
    found = []
    for entry in entries:
        match = _NAME.fullmatch(entry.name)
        if match:
            try:
                regular = entry.is_file(follow_symlinks=False)
            except OSError:
                regular = False
            version = int(match.group(2) or 1)
            found.append(Entry(int(match.group(1)), folder / entry.name, regular, version))
    return sorted(found, reverse=True)


def loadable(entries: list[Entry]) -> list[Path]:
    """The regular files among ``entries`` that this version reads, in the order to try
    them: its own format's newest first, then an older format's newest first. None of a
    newer format (by its name)."""
    ours = [e for e in entries if e.regular and e.version <= FORMAT_VERSION]
    return [e.path for e in sorted(ours, key=lambda e: (e.version, e.sequence), reverse=True)]


def stated_version(magic_bytes: bytes, header: bytes | None = None) -> int | None:
    """The format version that a checkpoint's magic states, or its header (``header``,
    its checksum already verified; read loosely, before the strict check) when that is
    higher; None when ``magic_bytes`` are not a checkpoint's."""
    if len(magic_bytes) != 8 or not magic_bytes.startswith(_MAGIC_START):
        return None
    if magic_bytes[7:] != b"\n" or not magic_bytes[6]:
        return None
    version = magic_bytes[6]
    # not JSON, or nested past Python's recursion limit (a RecursionError, which left
    # decode_checkpoint untyped): the strict check says why
    with contextlib.suppress(ValueError, RecursionError):
        fields = json.loads(header) if header is not None else None
        stated = fields.get("version") if isinstance(fields, dict) else None
        if isinstance(stated, int) and not isinstance(stated, bool):
            version = max(version, stated)
    return version


def newer_format(path: Path) -> int | None:
    """(Blocking.) The format version of the checkpoint ``path`` when it is above
    ``FORMAT_VERSION``, by its name, its magic or its header (with a matching checksum);
    None when it is not above, or the file cannot be read. Whoever deletes checkpoints
    asks first: a newer version's file is not ours to delete."""
    match = _NAME.fullmatch(path.name) or _DAMAGED_NAME.fullmatch(path.name)
    if match and int(match.group(2) or 1) > FORMAT_VERSION:
        return int(match.group(2))
    flags = os.O_RDONLY | getattr(os, "O_NOFOLLOW", 0) | getattr(os, "O_NONBLOCK", 0)
    try:
        fd = os.open(path, flags | getattr(os, "O_BINARY", 0))
    except OSError:
        return None
    with os.fdopen(fd, "rb") as f:
        try:
            if not stat.S_ISREG(os.fstat(fd).st_mode):
                return None
            prefix = f.read(PREFIX.size)
            if len(prefix) < PREFIX.size:
                return None
            magic_bytes, header_len, header_sha = PREFIX.unpack(prefix)
            header = f.read(header_len) if header_len <= MAX_HEADER_BYTES else b""
        except OSError:
            return None
    if hashlib.sha256(header).digest() != header_sha:
        header = b""  # damaged, or another layout: the magic alone says
    version = stated_version(magic_bytes, header or None)
    return version if version is not None and version > FORMAT_VERSION else None


def damaged(folder: Path) -> list[tuple[int, Path]]:
    """(sequence, path) of the regular files of ``folder`` set aside as damaged, of this
    format or an older one, newest first."""
    try:
        entries = list(os.scandir(folder))
    except OSError:
        return []
    found = []
    for entry in entries:
        match = _DAMAGED_NAME.fullmatch(entry.name)
        if not match or int(match.group(2) or 1) > FORMAT_VERSION:
            continue
        with contextlib.suppress(OSError):
            if entry.is_file(follow_symlinks=False):
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
    return loadable(numbered(folder))


def trim_others(
    directory: Path,
    hosted: Collection[str],
    keep_experts: int,
    locked: Callable[[str], AbstractContextManager[object]] = lambda uid: contextlib.nullcontext(),
) -> list[Path]:
    """(Blocking.) Delete what the checkpoints of experts not in ``hosted`` hold beyond
    each one's newest file, and all of those beyond the ``keep_experts`` saved last (by
    their newest file); ``locked(uid)`` is held while a folder is trimmed (the store's
    save lock). An expert's newest is its newest of this format, or of an older one when
    it has none; a newer version's file (``newer_format``) is neither counted nor
    deleted. Returns the files deleted. Raises OSError when ``directory`` cannot be
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
                if newer_format(path) is not None:
                    continue  # a newer version's, under a name of ours: not ours to delete
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
