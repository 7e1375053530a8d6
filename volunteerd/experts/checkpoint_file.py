"""Expert checkpoints: one expert's weights, optimizer state and update count on disk.

The format is our own and holds no code (no pickle, no ``torch.save``)::

    b"VCKPT\\x00\\x02\\n"              8 bytes: magic and format version (2)
    header length                    4 bytes, unsigned little-endian
    SHA-256 of the header            32 bytes
    header                           JSON (``CheckpointHeader``)
    payload                          the tensors' raw bytes, little-endian, C order,
                                     back to back in the header's order

The format version is in the magic, in the header (``version``) and in the file's name
(``checkpoint_folders``): whatever a version writes that an earlier reader would refuse
(a new header field, a new tensor name, a new dtype, another layout) raises it. Format 2
is format 1 with the header's ``experiment``: a format-1 reader refuses the field, so a
file that holds it must not have a name that reader loads and prunes. A reader takes
its own version and older ones; a file or a replica's state of a newer one raises
``NewerCheckpoint`` (a ``CheckpointError``), which is not damage. Bytes for the wire (a
replica's state, a trainer's) carry the lowest version that holds them: 1 when they
name no experiment, so that earlier versions still take them.

The header names every tensor with its dtype and shape and carries the payload's
length and SHA-256, so a truncated file, a flipped bit or a foreign file is detected
before a byte of it is used. Tensor names: ``param/<module parameter name>`` and
``optim/<parameter index>/<state key>`` (Adam: ``step``, ``exp_avg``, ``exp_avg_sq``;
SGD: ``momentum_buffer``), and in a trainer's own saved state (``volunteerd.train.state``)
``progress/<key>``: where its run stands (step count, data position). The optimizer's
hyperparameters are not stored: they come from the configuration.

Files live in ``<checkpoints dir>/<uid>/<sequence>.v2.ckpt``; those of format 1
(``<sequence>.ckpt``) are read when an expert has none of format 2 that is good, and
deleted by its first save, and those of a newer format are left as they are, with a
warning to upgrade (``checkpoint_folders``). A save writes a temporary
file of its own in the same folder (``<name>.<random>.tmp``), flushes and fsyncs it,
reads it back and compares it with what it meant to write, renames it into place and
fsyncs the folder, so a crash at any moment leaves either the previous set of files or
the new one, plus temporary files that ``remove_temporaries`` deletes on the next
start. Only then are older files deleted (the newest ``keep`` per expert are kept): a
save that fails deletes nothing. Saves of one expert are serialized (a lock per uid:
two at once, a periodic one and one of an expert being dropped, shared one temporary
file and one sequence number, mixed their bytes and pruned the good files).
A file that fails its checks when loaded is set aside as ``<name>.damaged`` (the newest
two of an expert kept), where neither loading nor pruning sees it: pruning deleted the
damaged files like good ones, so an expert whose every file was damaged lost them within
two save rounds. ``CheckpointStore.save`` refuses a state with a non-finite value (it
could only replace a good file with one that is refused on load), so the last good files
stay.

Only regular files count: a folder, a FIFO or a symlink named like a checkpoint is
neither read (a FIFO blocked the start, a link to ``/dev/zero`` filled the memory) nor
deleted, and no save writes over it (the new file takes the next free number).
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import logging
import os
import re
import stat
import tempfile
import threading
import time
from collections.abc import Callable, Collection, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Annotated, Literal

import torch
from pydantic import BaseModel, ConfigDict, Field, ValidationError

from volunteerd.atomic import fsync_dir
from volunteerd.checkpoint_folders import (
    FORMAT_VERSION,
    MAX_HEADER_BYTES,
    PREFIX,
    Entry,
    checkpoint_name,
    damaged,
    loadable,
    magic,
    newer_format,
    numbered,
    set_aside,
    stated_version,
    trim_others,
    unreachable,
)
from volunteerd.errors import CheckpointError, NewerCheckpoint

__all__ = [
    "FORMAT_VERSION",
    "MAX_UPDATES",
    "CheckpointError",
    "CheckpointHeader",
    "CheckpointStore",
    "ExpertState",
    "NewerCheckpoint",
    "decode_checkpoint",
    "read_checkpoint",
    "write_checkpoint",
]

logger = logging.getLogger(__name__)

MAGIC = magic(FORMAT_VERSION)
_PREFIX = PREFIX
_MAX_HEADER_BYTES = MAX_HEADER_BYTES
_TEMP_SUFFIX = ".tmp"
_INDEX = re.compile(r"[0-9]+")  # an optimizer state's parameter index

_DTYPES: dict[str, torch.dtype] = {
    "float32": torch.float32,
    "float64": torch.float64,
    "float16": torch.float16,
    "bfloat16": torch.bfloat16,
    "int64": torch.int64,
    "int32": torch.int32,
}
_DTYPE_NAMES = {v: k for k, v in _DTYPES.items()}


class _Header(BaseModel):
    model_config = ConfigDict(frozen=True, extra="forbid")


# More updates than any expert makes (a billion a second for 285 years), and still exact
# as a float and in JSON: a replica's 10**40 was taken and served on as it was. A file or
# a replica's state counting more is refused when it is decoded, so no reader (the
# joiner, a trainer, a tool) gets a count it could not publish.
MAX_UPDATES = 2**53

# A dimension of a stored tensor: a dimension of 2**64 next to one of 0 takes no bytes,
# passed every size check, and overflowed torch.empty (a replica's state raised
# TypeError out of the joiner).
_MAX_DIM = 1 << 40


class TensorEntry(_Header):
    name: Annotated[str, Field(min_length=1, max_length=256)]
    dtype: Literal["float32", "float64", "float16", "bfloat16", "int64", "int32"]
    shape: Annotated[tuple[Annotated[int, Field(ge=0, le=_MAX_DIM)], ...], Field(max_length=8)]

    @property
    def nbytes(self) -> int:
        n = 1
        for d in self.shape:
            n *= d
        return n * _DTYPES[self.dtype].itemsize


class CheckpointHeader(_Header):
    format: Literal["volunteerd-expert-checkpoint"] = "volunteerd-expert-checkpoint"
    # 2: the experiment may be set (checkpoint_folders.FORMAT_VERSION says why)
    version: Annotated[int, Field(ge=1, le=FORMAT_VERSION)] = FORMAT_VERSION
    uid: Annotated[str, Field(min_length=1, max_length=256)]
    expert_type: Annotated[str, Field(max_length=32)]
    hidden_dim: Annotated[int, Field(ge=1)]
    optimizer: Annotated[str, Field(max_length=32)]
    updates: Annotated[int, Field(ge=0, le=MAX_UPDATES)]
    # time.time() at the save (0 in a replica's state); finite: a NaN was in no age's
    # comparison, and an expert restored from an old file served at once (a fuzzing audit)
    saved_at: Annotated[float, Field(ge=0, allow_inf_nan=False)]
    tensors: Annotated[list[TensorEntry], Field(max_length=4096)]
    payload_bytes: Annotated[int, Field(ge=0)]
    payload_sha256: Annotated[str, Field(pattern=r"^[0-9a-f]{64}$")]
    # written only when set (format 2): format 1's readers refuse it
    experiment: Annotated[str, Field(max_length=256)] = ""


@dataclass(slots=True)
class ExpertState:
    """One expert's state as plain CPU tensors: what a checkpoint holds.

    ``optimizer_state`` is keyed by parameter index (the module's parameter order), as
    ``torch.optim.Optimizer.state_dict()["state"]`` is."""

    uid: str
    expert_type: str
    hidden_dim: int
    optimizer: str
    updates: int
    params: dict[str, torch.Tensor]
    optimizer_state: dict[int, dict[str, torch.Tensor]] = field(default_factory=dict)
    # Whose weights these are: "<owner>/<name>" of a project's experiment; "" for the
    # experts of the config's experts.uids (and in files written before it was kept).
    experiment: str = ""
    # a trainer's saved state only (volunteerd.train.state): its step count, data
    # position, ...; empty for an expert, and ignored wherever an expert's is read
    progress: dict[str, torch.Tensor] = field(default_factory=dict)
    # when the file it was read from was written (its header's ``saved_at``, time.time());
    # None for a state not read from a file. Never written: a save stamps its own time.
    saved_at: float | None = None

    def non_finite(self) -> list[str]:
        """The names (as in the file) of the floating-point tensors holding a NaN or an
        infinity; empty when the state is sound."""
        return [
            name
            for name, t in self.named_tensors()
            if t.is_floating_point() and not bool(torch.isfinite(t).all())
        ]

    def named_tensors(self) -> list[tuple[str, torch.Tensor]]:
        out = [(f"param/{name}", t) for name, t in self.params.items()]
        for index in sorted(self.optimizer_state):
            for key, t in sorted(self.optimizer_state[index].items()):
                out.append((f"optim/{index}/{key}", t))
        out += [(f"progress/{key}", t) for key, t in sorted(self.progress.items())]
        return out


def _tensor_bytes(tensor: torch.Tensor) -> memoryview:
    flat = tensor.detach().to("cpu").contiguous().reshape(-1)
    if not flat.numel():
        return memoryview(b"")
    return memoryview(flat.view(torch.uint8).numpy().data)


def encode_checkpoint(
    state: ExpertState, *, saved_at: float | None = None, version: int | None = None
) -> list[bytes | memoryview]:
    """The file's bytes, in pieces (the tensors are not copied into one buffer), in
    format ``version``; None: the lowest that holds ``state`` (1 unless it names an
    experiment), what the wire sends so that earlier versions still read it."""
    if version is None:
        version = 2 if state.experiment else 1
    if not 1 <= version <= FORMAT_VERSION or (state.experiment and version < 2):
        raise CheckpointError(f"{state.uid}: cannot store it in format {version}")
    entries: list[TensorEntry] = []
    pieces: list[memoryview] = []
    digest = hashlib.sha256()
    total = 0
    for name, tensor in state.named_tensors():
        dtype = _DTYPE_NAMES.get(tensor.dtype)
        if dtype is None:
            raise CheckpointError(f"{state.uid}: cannot store {name} of dtype {tensor.dtype}")
        entries.append(TensorEntry(name=name, dtype=dtype, shape=tuple(tensor.shape)))  # type: ignore[arg-type]
        data = _tensor_bytes(tensor)
        digest.update(data)
        pieces.append(data)
        total += data.nbytes
    try:
        header = CheckpointHeader(
            uid=state.uid,
            expert_type=state.expert_type,
            hidden_dim=state.hidden_dim,
            optimizer=state.optimizer,
            updates=state.updates,
            saved_at=time.time() if saved_at is None else saved_at,
            tensors=entries,
            payload_bytes=total,
            payload_sha256=digest.hexdigest(),
            experiment=state.experiment,
            version=version,
        )
    except ValidationError as exc:  # what decode would refuse: never written
        raise CheckpointError(f"{state.uid}: cannot store it: {_first_error(exc)}") from None
    raw = header.model_dump_json(exclude=None if state.experiment else {"experiment"}).encode()
    prefix = _PREFIX.pack(magic(version), len(raw), hashlib.sha256(raw).digest())
    return [prefix, raw, *pieces]


_READ_CHUNK = 1 << 20


def write_checkpoint(path: Path, state: ExpertState, version: int = FORMAT_VERSION) -> None:
    """Write ``state`` to ``path`` atomically, in format ``version``: a temporary file
    of this write's own next to it, fsync, read back and compared, rename, fsync of the
    folder. A crash leaves ``path`` as it was (or absent) and at most a ``*.tmp`` file;
    a failure (OSError, or CheckpointError when the bytes read back are not those
    written) leaves ``path`` as it was and no temporary file."""
    pieces = encode_checkpoint(state, version=version)
    fd, name = tempfile.mkstemp(dir=path.parent, prefix=f"{path.name}.", suffix=_TEMP_SUFFIX)
    tmp = Path(name)
    try:
        digest = hashlib.sha256()
        size = 0
        with os.fdopen(fd, "wb") as f:
            for piece in pieces:
                f.write(piece)
                digest.update(piece)
                size += memoryview(piece).nbytes
            f.flush()
            os.fsync(f.fileno())
        _verify_written(tmp, size, digest.digest())
        os.replace(tmp, path)
    except BaseException:
        with contextlib.suppress(OSError):
            tmp.unlink()
        raise
    fsync_dir(path.parent)


def _verify_written(path: Path, size: int, sha256: bytes) -> None:
    """Raise CheckpointError unless ``path`` holds exactly ``size`` bytes of digest
    ``sha256`` (what was written: another writer's bytes, or a write that went short,
    must never replace a good file)."""
    digest = hashlib.sha256()
    got = 0
    with path.open("rb") as f:
        while chunk := f.read(_READ_CHUNK):
            digest.update(chunk)
            got += len(chunk)
    if got != size or digest.digest() != sha256:
        raise CheckpointError(
            f"{path.name}: read back {got} bytes that differ from the {size} written"
        )


def read_checkpoint(path: Path, max_bytes: int | None = None) -> ExpertState:
    """Read and verify one checkpoint file. Raises CheckpointError saying what is wrong
    (truncated, checksum mismatch, unknown format, not a regular file, larger than
    ``max_bytes``), NewerCheckpoint for a file of a newer format; OSError when it
    cannot be read (a symlink is not followed)."""
    return decode_checkpoint(_read_regular(path, max_bytes), path.name)


def _read_regular(path: Path, max_bytes: int | None) -> bytes:
    """The bytes of the regular file ``path``, at most ``max_bytes`` of them (and at most
    its size when opened). Neither a symlink (its target could be ``/dev/zero``) nor a
    FIFO or a device is read: opening does not follow the link nor wait for a writer."""
    flags = os.O_RDONLY | getattr(os, "O_NOFOLLOW", 0) | getattr(os, "O_NONBLOCK", 0)
    flags |= getattr(os, "O_BINARY", 0)
    fd = os.open(path, flags)
    with os.fdopen(fd, "rb") as f:
        info = os.fstat(fd)
        if not stat.S_ISREG(info.st_mode):
            raise CheckpointError(f"{path.name}: not a regular file")
        if max_bytes is not None and info.st_size > max_bytes:
            raise CheckpointError(
                f"{path.name}: {info.st_size} bytes, more than this expert's {max_bytes}"
            )
        # its size now: a file that grows meanwhile is read no further (and then fails
        # its checks); the memory taken is what the file takes
        data = f.read(info.st_size)
    return data


def decode_checkpoint(data: bytes | bytearray, name: str = "checkpoint") -> ExpertState:
    """Verify and decode a checkpoint's bytes (``encode_checkpoint``'s, joined); raises
    CheckpointError as ``read_checkpoint`` does, naming ``name``."""
    if len(data) < _PREFIX.size:
        raise CheckpointError(f"{name}: truncated ({len(data)} bytes)")
    magic_bytes, header_len, header_sha = _PREFIX.unpack_from(data)
    version = stated_version(magic_bytes)
    if version is None:
        raise CheckpointError(f"{name}: not a volunteerd checkpoint (bad magic)")
    if version > FORMAT_VERSION:  # its layout may differ from here on
        raise _newer(name, version)
    if header_len > _MAX_HEADER_BYTES:
        raise CheckpointError(f"{name}: header of {header_len} bytes is too large")
    start = _PREFIX.size
    raw = data[start : start + header_len]
    if len(raw) != header_len:
        raise CheckpointError(f"{name}: truncated header")
    if hashlib.sha256(raw).digest() != header_sha:
        raise CheckpointError(f"{name}: header checksum mismatch")
    stated = stated_version(magic_bytes, bytes(raw))
    if stated is not None and stated > FORMAT_VERSION:  # fields this version does not know
        raise _newer(name, stated)
    try:
        header = CheckpointHeader.model_validate_json(raw)
    except ValidationError as exc:
        raise CheckpointError(f"{name}: bad header: {_first_error(exc)}") from None
    if header.version != version:
        raise CheckpointError(
            f"{name}: format {header.version} in the header, {version} in the magic"
        )
    payload = memoryview(data)[start + header_len :]
    if payload.nbytes != header.payload_bytes:
        raise CheckpointError(
            f"{name}: payload is {payload.nbytes} bytes, header says {header.payload_bytes}"
        )
    if sum(e.nbytes for e in header.tensors) != header.payload_bytes:
        raise CheckpointError(f"{name}: tensor sizes do not add up to the payload")
    if hashlib.sha256(payload).hexdigest() != header.payload_sha256:
        raise CheckpointError(f"{name}: payload checksum mismatch")
    try:
        return _state_from(header, payload, name)
    except CheckpointError:
        raise
    except (ValueError, KeyError, TypeError, OverflowError, RuntimeError) as exc:
        # a header its model took that still builds no state: damaged all the same (the
        # caller sets aside a CheckpointError's file, and any other error stopped it)
        raise CheckpointError(f"{name}: {type(exc).__name__}: {exc}") from None


def _newer(name: str, version: int) -> NewerCheckpoint:
    return NewerCheckpoint(
        f"{name}: written by a newer volunteerd (format {version}; this one reads up to "
        f"{FORMAT_VERSION})",
        version=version,
    )


def _first_error(exc: ValidationError) -> str:
    first = exc.errors()[0]
    where = ".".join(str(p) for p in first["loc"]) or "header"
    return f"{where}: {first['msg']}"


def _state_from(header: CheckpointHeader, payload: memoryview, where: str) -> ExpertState:
    params: dict[str, torch.Tensor] = {}
    optim: dict[int, dict[str, torch.Tensor]] = {}
    progress: dict[str, torch.Tensor] = {}
    offset = 0
    for entry in header.tensors:
        chunk = payload[offset : offset + entry.nbytes]
        offset += entry.nbytes
        dtype = _DTYPES[entry.dtype]
        try:
            if entry.nbytes:
                tensor = torch.frombuffer(bytearray(chunk), dtype=dtype).reshape(entry.shape)
            else:
                tensor = torch.empty(entry.shape, dtype=dtype)
        except (RuntimeError, ValueError, TypeError, OverflowError) as exc:
            # bytes from a stranger (a replica's state): its error, not a crash
            raise CheckpointError(f"{where}: {entry.name}: {exc}") from None
        kind, _, rest = entry.name.partition("/")
        if kind == "param" and rest and rest not in params:
            params[rest] = tensor
            continue
        if kind == "progress" and rest and "/" not in rest and rest not in progress:
            progress[rest] = tensor
            continue
        index, _, key = rest.partition("/")
        # ASCII digits only: str.isdigit() takes "²", which int() refuses (a ValueError,
        # no CheckpointError, left load_newest: a fuzzing audit)
        if (
            kind == "optim"
            and _INDEX.fullmatch(index)
            and key
            and key not in optim.get(int(index), {})
        ):
            optim.setdefault(int(index), {})[key] = tensor
            continue
        raise CheckpointError(f"{where}: unexpected tensor name {entry.name!r}")
    return ExpertState(
        uid=header.uid,
        expert_type=header.expert_type,
        hidden_dim=header.hidden_dim,
        optimizer=header.optimizer,
        updates=header.updates,
        params=params,
        optimizer_state=optim,
        experiment=header.experiment,
        progress=progress,
        saved_at=header.saved_at,
    )


def _safe_dir_name(uid: str) -> str:
    if not uid or uid in {".", ".."} or "/" in uid or "\\" in uid or "\x00" in uid:
        raise CheckpointError(f"{uid!r} cannot name a checkpoint folder")
    return uid


class CheckpointStore:
    """The checkpoints of every expert under ``directory``. Blocking file I/O: call it
    from a worker thread, never on the event loop. Saves of one uid from several threads
    run one at a time. One process per data folder (the daemon's lock) is assumed.

    Files of this format are read and written, an older format's read only after them
    and deleted by the first save, and a newer format's never touched (the module
    docstring of ``checkpoint_folders``)."""

    def __init__(self, directory: Path, keep: int = 2) -> None:
        self.directory = directory
        self.keep = keep
        self._guard = threading.Lock()
        self._locks: dict[str, tuple[threading.Lock, list[int]]] = {}  # uid -> lock, users
        self._told_newer: set[str] = set()  # uids whose newer-format file was logged

    def _dir(self, uid: str) -> Path:
        return self.directory / _safe_dir_name(uid)

    @contextlib.contextmanager
    def _saving(self, uid: str) -> Iterator[None]:
        """Hold ``uid``'s save lock (kept only while someone holds or awaits it)."""
        with self._guard:
            lock, users = self._locks.setdefault(uid, (threading.Lock(), [0]))
            users[0] += 1
        try:
            with lock:
                yield
        finally:
            with self._guard:
                users[0] -= 1
                if not users[0]:
                    del self._locks[uid]

    def _numbered(self, uid: str) -> list[Entry]:
        """Every entry of ``uid``'s folder named like a checkpoint of any format, newest
        first."""
        return numbered(self._dir(uid))

    def unreachable(self, uid: str) -> str | None:
        """Why ``uid``'s own folder cannot be used (``checkpoint_folders.unreachable``);
        None when it is a folder or not there yet."""
        return unreachable(self._dir(uid), f"checkpoints folder of {uid}")

    def files(self, uid: str) -> list[Path]:
        """Checkpoint files of ``uid`` that this version reads, in the order they are
        tried: this format's newest first, then an older format's. Regular files only (a
        folder, a FIFO or a symlink of the name is not a checkpoint of ours), and none
        named as of a newer format."""
        return loadable(self._numbered(uid))

    def trim_others(self, hosted: Collection[str], keep_experts: int) -> list[Path]:
        """``checkpoint_folders.trim_others`` here, each folder under its save lock."""
        return trim_others(self.directory, hosted, keep_experts, locked=self._saving)

    def remove_temporaries(self) -> int:
        """Delete temporary files a crash left behind; returns how many."""
        removed = 0
        if not self.directory.is_dir():
            return 0
        for folder in self.directory.iterdir():
            if not folder.is_dir() or folder.is_symlink():
                continue
            for path in folder.glob(f"*{_TEMP_SUFFIX}"):
                if path.is_dir() and not path.is_symlink():
                    continue  # not one of ours
                logger.warning("removing %s, left by an interrupted checkpoint", path)
                path.unlink(missing_ok=True)
                removed += 1
        return removed

    def save(self, state: ExpertState) -> Path:
        """Write a new checkpoint for ``state.uid`` atomically, then delete all but the
        newest ``keep``. Returns the new file's path. Raises CheckpointError, writing and
        deleting nothing, when a value of ``state`` is not finite (or its update count
        is not one a file may hold); a write that fails (OSError, CheckpointError when
        the file reads back wrong) deletes nothing either. Saves of one uid run one at
        a time: the new file is numbered past the newest (and past any folder or other
        entry that took a name), and holds the state of the save that finished last."""
        broken = state.non_finite()
        if broken:
            raise CheckpointError(
                f"{state.uid}: not saved, {', '.join(broken[:3])}"
                f"{' and more' if len(broken) > 3 else ''} not finite"
            )
        folder = self._dir(state.uid)
        with self._saving(state.uid):
            if not folder.is_dir():
                # a link to a drive not mounted: say so ("File exists" said nothing)
                reason = unreachable(self.directory) or self.unreachable(state.uid)
                if reason is not None:
                    raise OSError(reason)
                folder.mkdir(parents=True, exist_ok=True)
                fsync_dir(folder.parent)
            entries = self._numbered(state.uid)
            ours = [e.path for e in entries if e.regular and e.version == FORMAT_VERSION]
            superseded = [e.path for e in entries if e.regular and e.version < FORMAT_VERSION]
            taken = {e.path.name for e in entries}
            # past every format's and the files set aside too: the names keep the order
            # of the writes
            newest = next((e.sequence for e in entries if e.regular), 0)
            sequence = max([newest, *(n for n, _ in damaged(folder)[:1])]) + 1
            while checkpoint_name(sequence) in taken:  # a folder or a FIFO: not ours
                sequence += 1
            path = folder / checkpoint_name(sequence)
            # written, fsynced and read back before anything is deleted
            write_checkpoint(path, state)
            for old in ours[max(self.keep - 1, 0) :] + superseded:
                newer = newer_format(old)
                if newer is None:
                    old.unlink(missing_ok=True)
                else:  # a newer version's, under a name of ours: it stays
                    self._tell_newer(state.uid, old, newer)
        return path

    def load_newest(
        self,
        uid: str,
        accept: Callable[[ExpertState], None] | None = None,
        *,
        max_bytes: int | None = None,
        moved_aside: list[Path] | None = None,
    ) -> tuple[ExpertState, Path] | None:
        """The newest checkpoint of ``uid`` that reads back intact, of at most
        ``max_bytes`` (None: any size), and that ``accept`` does not refuse (it raises
        CheckpointError saying why). Each file skipped is logged with its reason. None
        when there is no good one.

        A file that fails its checks (truncated, a checksum that does not match, not a
        checkpoint) is set aside (``checkpoint_folders.set_aside``) and its new path
        appended to ``moved_aside``: no save prunes it. A sound file that does not fit
        (another expert's, another size's) stays, and the saves prune it as before. A
        file of a newer format (by its name, or by what it says inside) is not read and
        stays as it is, with one warning per expert to upgrade."""
        entries = self._numbered(uid)
        for entry in entries:
            if entry.regular and entry.version > FORMAT_VERSION:
                self._tell_newer(uid, entry.path, entry.version)
                break
        for path in loadable(entries):
            try:
                data = _read_regular(path, max_bytes)
            except CheckpointError as exc:
                logger.warning("skipping checkpoint %s: %s", path, exc)
                continue
            except OSError as exc:
                logger.warning("skipping checkpoint %s: cannot read it: %s", path, exc)
                continue
            try:
                state = decode_checkpoint(data, path.name)
            except NewerCheckpoint as exc:
                self._tell_newer(uid, path, exc.version)
                continue
            except CheckpointError as exc:
                moved = self._set_aside(uid, path)
                if moved is not None and moved_aside is not None:
                    moved_aside.append(moved)
                kept = f"; kept as {moved.name}" if moved is not None else ""
                logger.warning("skipping checkpoint %s: %s%s", path, exc, kept)
                continue
            try:
                if state.uid != uid:
                    raise CheckpointError(f"{path.name}: holds {state.uid!r}, not {uid!r}")
                if accept is not None:
                    accept(state)
            except CheckpointError as exc:
                logger.warning("skipping checkpoint %s: %s", path, exc)
                continue
            return state, path
        return None

    def _tell_newer(self, uid: str, path: Path, version: int) -> None:
        """Warn, once per expert, that ``path`` is of a newer format and stays."""
        with self._guard:
            if uid in self._told_newer:
                return
            self._told_newer.add(uid)
        logger.warning(
            "checkpoint %s was written by a newer volunteerd (format %d); left as it is "
            "— upgrade to use it",
            path,
            version,
        )

    def _set_aside(self, uid: str, path: Path) -> Path | None:
        """``checkpoint_folders.set_aside(path)`` under ``uid``'s save lock; None (logged)
        when it cannot be renamed (it is then pruned as before)."""
        with self._saving(uid):
            try:
                return set_aside(path)
            except OSError as exc:
                logger.warning("could not set %s aside: %s", path, exc)
                return None


def header_json(path: Path) -> dict[str, object]:
    """The header of a checkpoint file as a dict, unverified (for tools and tests)."""
    with path.open("rb") as f:
        prefix = f.read(_PREFIX.size)
        _, header_len, _ = _PREFIX.unpack(prefix)
        result: dict[str, object] = json.loads(f.read(header_len))
        return result
