"""Checkpointer: the hosted experts' state saved to disk, and restored on start.

``restore`` runs once before the daemon takes requests: it refuses a checkpoints folder
that cannot be reached (``checkpoint_folders.unreachable``), deletes the temporary files
an interrupted save left, then loads each expert's newest good checkpoint (damaged or
foreign files are skipped and logged, the damaged ones set aside where no pruning
deletes them; an expert with none says that it starts from its initial weights, with an
error when its files were damaged: ``damaged``, which a project's joiner calls too,
saying whether the expert was downloaded from a replica instead). For each expert loaded
from a file, ``take_restored`` tells until when the file held its weights (the daemon
holds back experts that far behind their replicas: ``runtime.averaging``,
``hold_restored``): the time in its header (a backup put back with ``cp -r`` makes old
files look new), or the last graceful stop's when the file was that expert's newest then
(``mark_stopped`` writes ``STOPPED_FILE``: an expert nobody trained keeps an old file).
``serve`` then saves, every ``every_s``, each expert whose weights changed since its
last save; ``save_changed`` is also the final save on a graceful stop. A save copies the
tensors on the device's worker in its turn (between optimizer steps, so the copy is
consistent) and writes the file in another thread, never on the event loop. See
``experts.checkpoint`` for the file format.

Saves of one expert run one at a time, from the copy of its state to the written file
(a lock per uid): a dropped expert's final save waits for a periodic save of it still
writing, then writes a newer file, so its newest file always holds its newest state
saved. Two at once shared a file name and mixed their bytes, and the older state could
be written last.

A state with a NaN or an infinity is never written (the store refuses it): the last good
files stay, the refusal is logged and counted, and the same state is not tried again.
Steps that the runtime undid never reach a checkpoint: a step, its check and its undoing
run in one turn of the worker, and the copy for a save is taken in another.

The checkpoints of experts no longer hosted (dropped for a later rejoin, moved to
another volunteer, of a project left) keep only their newest file, and only the
``OTHERS_KEPT`` saved last keep any (``checkpoint_folders.trim_others``, after each
round but the first, when whoever adds experts has added them; the daemon does it at a
start that hosts nothing).

The disk budget (``limits.disk_budget_gb``, read at every save) bounds what the
checkpoints and the downloaded shards in the data folder take together. A save that
would pass it first deletes the files set aside as damaged, then older checkpoints (the
oldest first: every file but a hosted expert's newest, so those of experts no longer
hosted too); one that still would
not fit is skipped, with a warning (``on_warning``) and a count, and tried again at the
next round: the disk never fills up with checkpoints.

No round ends the daemon: a save, or the trimming, that fails with OSError (too many
open files, a drive gone) is logged, once per streak at WARNING, and tried again at the
next round. A trim whose listing of the folder raised EMFILE, under a process's
open-file limit full of connections, stopped the daemon with exit 5.
"""

from __future__ import annotations

import contextlib
import logging
import time
from collections.abc import AsyncIterator, Awaitable, Callable, Iterable, Sequence
from dataclasses import dataclass
from functools import partial
from pathlib import Path
from typing import TYPE_CHECKING

import trio
from pydantic import BaseModel, ConfigDict, ValidationError

from volunteerd.atomic import STATE_MAX_BYTES, read_small, write_atomic
from volunteerd.checkpoint_folders import OTHERS_KEPT, damaged, newer_format, unreachable
from volunteerd.config import CheckpointConfig
from volunteerd.errors import CheckpointError, ResourceUnavailable, UnknownExpert
from volunteerd.experts import ExpertBackend
from volunteerd.experts.checkpoint_file import CheckpointStore, ExpertState
from volunteerd.runtime.service import ExpertRuntime

if TYPE_CHECKING:
    # trio's TaskStatus as libp2p's trio-typing stubs spell it
    from trio_typing import TaskStatus

__all__ = ["CheckpointStats", "Checkpointer"]

logger = logging.getLogger(__name__)


@dataclass(frozen=True, slots=True)
class CheckpointStats:
    restored: dict[str, str]  # uid -> file it was loaded from
    saves: int
    failures: int
    last_round_s: float
    refused: int = 0  # states not written because a value was not finite
    over_budget: int = 0  # saves skipped because they did not fit the disk budget
    disk_bytes: int = 0  # checkpoints and downloaded shards, at the last save
    round_failures: int = 0  # steps of periodic rounds that failed with OSError


_HEADER_SLACK = 64 << 10  # a new file's header, beyond its tensors' bytes
# In the checkpoints folder, written at a graceful stop (``mark_stopped``)
STOPPED_FILE = "stopped.json"


class _Stopped(BaseModel):
    """``STOPPED_FILE``: at ``stopped_at`` (time.time()), the newest checkpoint of each
    hosted expert (uid -> file name) held the weights it was served with."""

    model_config = ConfigDict(frozen=True, extra="forbid")
    stopped_at: float
    newest: dict[str, str]


class Checkpointer:
    """Saves and restores ``runtime``'s experts under ``directory``.

    ``budget_bytes`` gives the disk budget at each save (0: none) for ``directory`` and
    ``also_counted`` (the downloaded shards) together; ``on_warning`` hears, once per
    episode, that saves are skipped for want of room, and of each expert that starts
    from elsewhere because its checkpoints were damaged (``damaged``)."""

    def __init__(
        self,
        runtime: ExpertRuntime,
        directory: Path,
        config: CheckpointConfig,
        *,
        budget_bytes: Callable[[], int] = lambda: 0,
        also_counted: Sequence[Path] = (),
        on_warning: Callable[[str], object] | None = None,
    ) -> None:
        self.runtime = runtime
        self.store = CheckpointStore(directory, keep=config.keep)
        self.budget_bytes = budget_bytes
        self._counted = [directory, *also_counted]
        self.on_warning = on_warning
        self._over_budget = 0
        self._short_of_room = False  # warned, until a save fits again
        self._disk_bytes = 0
        # An expert whose weights a step broke beyond undoing is restored from here.
        runtime.restore_checkpoint = self.restore_into
        self._config = config
        self._saved: dict[str, tuple[int, int]] = {}  # uid -> (updates, revision) on disk
        self._refused: dict[str, tuple[int, int]] = {}  # uid -> version found non-finite
        self._restored: dict[str, str] = {}
        self.saved_at: dict[str, float] = {}  # uid -> time.time() of its newest file
        # uid -> when the checkpoint it was loaded from was written (its header's time,
        # not the file's: a backup put back with `cp -r` looks new), until the daemon
        # takes it (``take_restored``) to hold back experts that start far behind
        self._restored_saved_at: dict[str, float] = {}
        self._stopped: _Stopped | None = None  # the last graceful stop's STOPPED_FILE
        self._saves = 0
        self._failures = 0
        self._refused_count = 0
        self._last_round_s = 0.0
        self._locks: dict[str, tuple[trio.Lock, list[int]]] = {}  # uid -> lock, users
        self._round_failures = 0  # steps of rounds that raised OSError
        self._failing: dict[str, int] = {}  # step -> rounds it failed in a row

    @contextlib.asynccontextmanager
    async def _saving(self, uid: str) -> AsyncIterator[None]:
        """Hold ``uid``'s save lock: the copy of its state and its write, one save of
        an expert at a time (kept only while someone holds or awaits it)."""
        lock, users = self._locks.setdefault(uid, (trio.Lock(), [0]))
        users[0] += 1
        try:
            async with lock:
                yield
        finally:
            users[0] -= 1
            if not users[0]:
                del self._locks[uid]

    async def restore(self) -> dict[str, Path]:
        """Load each expert's newest good checkpoint; experts without one keep their
        seeded initial weights (logged, one line each). Returns the files loaded, by uid.
        Raises ResourceUnavailable, loading nothing, when the checkpoints folder (or a
        hosted expert's own folder in it) exists but cannot be reached (a link to a
        drive not mounted, or to a file): every
        expert would start again from its initial weights, and its next save would bury
        the checkpoints on that drive."""

        def reason() -> str | None:
            return unreachable(self.store.directory) or next(
                filter(None, map(self.store.unreachable, self.runtime.uids)), None
            )

        problem = await trio.to_thread.run_sync(reason)
        if problem is not None:
            raise ResourceUnavailable(problem)
        await trio.to_thread.run_sync(self.store.remove_temporaries)
        self._stopped = await trio.to_thread.run_sync(self._read_stopped)
        loaded: dict[str, Path] = {}
        for uid in self.runtime.uids:
            moved: list[Path] = []
            path = await self._restore(self.runtime.backend(uid), moved)
            if path is not None:
                loaded[uid] = path
            elif moved:
                self.damaged(uid, moved, "starts from its initial weights")
            else:
                logger.info("no checkpoint of %s to load: it starts from its initial weights", uid)
        if loaded:
            logger.info(
                "restored %d of %d experts from checkpoints", len(loaded), len(self.runtime.uids)
            )
        return loaded

    async def restore_into(
        self, backend: ExpertBackend, moved_aside: list[Path] | None = None
    ) -> Path | None:
        """Load ``backend.uid``'s newest good checkpoint into ``backend`` (not yet hosted,
        or hosted: the load runs in the worker's turn). Returns the file, or None when
        there is none and the backend keeps what it has. Damaged files are set aside,
        and appended to ``moved_aside``: a caller that found none good says where the
        expert starts from instead (``damaged``)."""
        return await self._restore(backend, [] if moved_aside is None else moved_aside)

    def damaged(self, uid: str, moved: Sequence[Path], instead: str) -> None:
        """Say that ``uid`` had no good checkpoint, only damaged ones (set aside as
        ``moved``), and where it starts from ``instead``: logged at ERROR, and to
        ``on_warning`` (the daemon's error events). Its trained weights here are lost."""
        message = (
            f"{uid} {instead}: every checkpoint of it that could be read is damaged; the "
            f"damaged files are kept in {moved[0].parent} (*.damaged)"
        )
        logger.error("%s", message)
        if self.on_warning is not None:
            self.on_warning(message)

    async def _restore(self, backend: ExpertBackend, moved_aside: list[Path]) -> Path | None:
        """``restore_into``, appending the damaged files set aside to ``moved_aside``."""
        uid = backend.uid
        self._restored_saved_at.pop(uid, None)
        found = await trio.to_thread.run_sync(
            partial(
                self.store.load_newest,
                uid,
                backend.check_state,
                max_bytes=backend.largest_state_bytes(),
                moved_aside=moved_aside,
            )
        )
        if found is None:
            # The seeded weights are a function of the config: nothing to save yet.
            self._saved[uid] = (backend.updates, backend.revision)
            return None
        state, path = found
        await self.runtime.executor.run(partial(ExpertBackend.load_state, backend, state=state))
        self._saved[uid] = (backend.updates, backend.revision)
        self._restored[uid] = str(path)
        if state.saved_at is not None:
            self.saved_at[uid] = state.saved_at
            current_at = state.saved_at
            stopped = self._stopped
            # A stop in the future (a clock that was ahead, set right since) says
            # nothing of how old the weights are: the header's time goes.
            if (
                stopped is not None
                and stopped.newest.get(uid) == path.name
                and stopped.stopped_at <= time.time()
            ):
                current_at = max(current_at, stopped.stopped_at)  # unchanged until the stop
            self._restored_saved_at[uid] = current_at
        logger.info("loaded checkpoint %s for %s (%d updates)", path, uid, state.updates)
        return path

    def take_restored(self, uids: Iterable[str]) -> dict[str, float]:
        """Until when the checkpoints that ``uids`` were last loaded from held their
        weights (``time.time()``): when they were written (their headers' time), or the
        last graceful stop's time for an expert's newest file then (``mark_stopped``).
        For those loaded since the last call that took them; each is given once."""
        return {
            uid: self._restored_saved_at.pop(uid) for uid in uids if uid in self._restored_saved_at
        }

    def mark_stopped(self) -> None:
        """(Blocking; after the final save of a graceful stop.) Record that the newest
        checkpoint of each hosted expert saved as it is held its weights until now: an
        expert that did not change for a while (nobody trained it) has an old file, and
        a restart soon after (a join restarts the daemon within seconds) must not take
        it for weights that far behind its replicas. A backup put back with an older
        file, or with this file of an earlier stop, names other files. An OSError is
        logged: the restart then goes by the files' own times."""
        newest = {}
        for uid in list(self.runtime.uids):
            try:
                backend = self.runtime.backend(uid)
            except UnknownExpert:
                continue
            files = self.store.files(uid)
            if files and self._saved.get(uid) == (backend.updates, backend.revision):
                newest[uid] = files[0].name
        if not newest:
            return
        stopped = _Stopped(stopped_at=time.time(), newest=newest)
        try:
            write_atomic(self.store.directory / STOPPED_FILE, stopped.model_dump_json())
        except OSError as exc:
            logger.warning("could not record the stop in %s: %s", STOPPED_FILE, exc)

    def _read_stopped(self) -> _Stopped | None:
        """(Blocking.) ``STOPPED_FILE``, or None when there is none or it is damaged."""
        path = self.store.directory / STOPPED_FILE
        try:
            return _Stopped.model_validate_json(read_small(path, STATE_MAX_BYTES))
        except FileNotFoundError:
            return None
        except (OSError, ValidationError) as exc:
            logger.warning("ignoring %s: %s", path, exc)
            return None

    def has_checkpoint(self, uid: str) -> bool:
        """Whether a checkpoint file of ``uid`` exists (not checked)."""
        return bool(self.store.files(uid))

    async def save(self, backend: ExpertBackend) -> None:
        """Save ``backend`` now if it changed (one that is being removed, for a later
        rejoin); after a save of it in progress, if any. A failed write is logged."""
        async with self._saving(backend.uid):
            if not self._wants(backend):
                return
            state, version = await self.runtime.executor.run(partial(_state_and_version, backend))
            try:
                if await self._write(state) is None:
                    return
            except CheckpointError as exc:
                self._refuse(backend.uid, version, exc)
                return
            except OSError as exc:
                self._failures += 1
                logger.error("could not save a checkpoint of %s: %s", backend.uid, exc)
                return
            self._saved[backend.uid] = version
            self.saved_at[backend.uid] = time.time()
            self._saves += 1

    async def serve(self, *, task_status: TaskStatus[None] = trio.TASK_STATUS_IGNORED) -> None:
        """Save changed experts every ``every_s`` until cancelled. A save in progress
        when cancelled finishes first (the file is never left half-renamed). A step of a
        round that fails with OSError is logged and tried again at the next round
        (``_step``): it never ends the daemon."""
        task_status.started()
        while True:
            await self._step("save the experts that changed", self.save_changed)
            await trio.sleep(self._config.every_s)
            hosted = frozenset(self.runtime.uids)
            trim = partial(self.store.trim_others, hosted, OTHERS_KEPT)
            await self._step(
                "trim the checkpoints of experts no longer hosted",
                partial(trio.to_thread.run_sync, trim),
            )

    async def _step(self, what: str, step: Callable[[], Awaitable[object]]) -> None:
        """Run one step of a round. An OSError is counted and logged: at WARNING the
        first of a streak, then at DEBUG (a round every ``every_s`` for as long as the
        cause lasts would fill the log), and at INFO when the step works again. Too many
        open files (a listing of the checkpoints folder raised EMFILE) ended the daemon
        with exit 5; the next round tries again, and by then the files may be back."""
        try:
            await step()
        except OSError as exc:
            self._round_failures += 1
            streak = self._failing.get(what, 0) + 1
            self._failing[what] = streak
            log = logger.warning if streak == 1 else logger.debug
            log(
                "checkpoints: could not %s (tried again every %g s): %s",
                what,
                self._config.every_s,
                exc,
            )
            return
        streak = self._failing.pop(what, 0)
        if streak:
            logger.info("checkpoints: could %s again, after %d failed rounds", what, streak)

    async def save_changed(self) -> int:
        """Save every expert whose weights changed since its last save (or since it was
        restored or seeded); returns how many were saved. A failed write is logged and
        counted, and retried at the next round."""
        start = time.perf_counter()
        saved = 0
        for uid in self.runtime.uids:
            async with self._saving(uid):
                try:
                    backend = self.runtime.backend(uid)
                    if not self._wants(backend):
                        continue
                    state, version = await self.runtime.with_expert(uid, _state_and_version)
                except UnknownExpert:
                    continue  # removed meanwhile (its last state was saved when it left)
                try:
                    path = await self._write(state)
                except CheckpointError as exc:
                    self._refuse(uid, version, exc)
                    continue
                except OSError as exc:
                    self._failures += 1
                    logger.error("could not save a checkpoint of %s: %s", uid, exc)
                    continue
                if path is None:
                    continue  # no room: tried again next round
                self._saved[uid] = version
                self.saved_at[uid] = time.time()
                self._saves += 1
                saved += 1
                logger.debug("saved %s (%d updates) to %s", uid, state.updates, path)
        if saved:
            self._last_round_s = time.perf_counter() - start
            logger.info("saved %d checkpoints in %.2f s", saved, self._last_round_s)
        return saved

    async def _write(self, state: ExpertState) -> Path | None:
        """Save ``state`` within the disk budget: the new file's path, or None when it
        does not fit. Raises CheckpointError (a non-finite state) or OSError."""
        budget = self.budget_bytes()
        if budget <= 0:
            return await trio.to_thread.run_sync(self.store.save, state)
        hosted = frozenset([*self.runtime.uids, state.uid])
        path = await trio.to_thread.run_sync(self._save_within, state, budget, hosted)
        if path is None:
            self._over_budget += 1
            message = (
                f"checkpoints not saved: the disk budget of {budget / 1e9:g} GB is used up "
                f"({self._disk_bytes / 1e9:.3g} GB in checkpoints and downloads); raise "
                "limits.disk_budget_gb to save them again"
            )
            if not self._short_of_room:
                self._short_of_room = True
                logger.warning("%s", message)
                if self.on_warning is not None:
                    self.on_warning(message)
            else:
                logger.debug("%s: %s", state.uid, message)
            return None
        if self._short_of_room:
            self._short_of_room = False
            logger.info("checkpoints fit the disk budget again")
        return path

    def _save_within(self, state: ExpertState, budget: int, hosted: frozenset[str]) -> Path | None:
        """(Worker thread.) Save ``state`` within ``budget``, deleting older checkpoints
        (the oldest first, never the newest of an expert in ``hosted``) before the save
        as far as needed, and after it too (this expert's previous file, which is kept
        until the new one is written). Returns None, deleting nothing, when even that
        would not fit."""
        sizes = self._disk_usage()
        mine = self.store.files(state.uid)
        # the new file is about as large as the last one (first save: its tensors)
        size = sizes.get(mine[0], 0) if mine else _HEADER_SLACK + _tensor_bytes(state)
        spare = self._spare_files(hosted)
        total = sum(sizes.values())
        self._disk_bytes = total
        # what stays whatever is deleted: downloads, the other experts' newest, the new file
        floor = total - sum(sizes.get(p, 0) for p in spare) + size
        floor -= sizes.get(mine[0], 0) if mine else 0
        if floor > budget:
            return None
        self._delete_spare(spare, sizes, total + size - budget)
        path = self.store.save(state)
        sizes = self._disk_usage()
        self._delete_spare(self._spare_files(hosted), sizes, sum(sizes.values()) - budget)
        self._disk_bytes = sum(self._disk_usage().values())
        return path

    def _delete_spare(self, spare: list[Path], sizes: dict[Path, int], excess: int) -> None:
        """(Worker thread.) Delete ``spare`` files in order until ``excess`` bytes went."""
        for old in spare:
            if excess <= 0:
                return
            old.unlink(missing_ok=True)
            excess -= sizes.get(old, 0)
            logger.info("deleted %s to stay within the disk budget", old)

    def _disk_usage(self) -> dict[Path, int]:
        """(Worker thread.) The files the budget counts, with their sizes."""
        return _sizes(path for directory in self._counted for path in _files_under(directory))

    def _spare_files(self, hosted: frozenset[str]) -> list[Path]:
        """(Worker thread.) Files set aside as damaged (they count, and are of use to no
        expert), then checkpoints that are not the newest of an expert in ``hosted``;
        each oldest first. Never a newer version's file: it counts, and stays."""
        directory = self.store.directory
        if not directory.is_dir():
            return []
        spare: list[tuple[int, float, Path]] = []
        for folder in directory.iterdir():
            if folder.is_dir():
                files = self.store.files(folder.name)
                older = files[1:] if folder.name in hosted else files
                older = [p for p in older if newer_format(p) is None]
                for rank, paths in enumerate(([p for _, p in damaged(folder)], older)):
                    for old in paths:
                        with contextlib.suppress(OSError):
                            spare.append((rank, old.stat().st_mtime, old))
        return [path for _, _, path in sorted(spare)]

    def _wants(self, backend: ExpertBackend) -> bool:
        """Whether ``backend`` changed since it was last saved, or last refused."""
        version = (backend.updates, backend.revision)
        return version not in (self._saved.get(backend.uid), self._refused.get(backend.uid))

    def _refuse(self, uid: str, version: tuple[int, int], exc: CheckpointError) -> None:
        self._refused[uid] = version
        self._refused_count += 1
        logger.error("%s; its last good checkpoint stays", exc)

    def statistics(self) -> CheckpointStats:
        return CheckpointStats(
            restored=dict(self._restored),
            saves=self._saves,
            failures=self._failures,
            last_round_s=self._last_round_s,
            refused=self._refused_count,
            over_budget=self._over_budget,
            disk_bytes=self._disk_bytes,
            round_failures=self._round_failures,
        )


def _state_and_version(backend: ExpertBackend) -> tuple[ExpertState, tuple[int, int]]:
    return backend.state(), (backend.updates, backend.revision)


def _tensor_bytes(state: ExpertState) -> int:
    return sum(t.numel() * t.element_size() for _, t in state.named_tensors())


def _files_under(directory: Path) -> list[Path]:
    if not directory.is_dir():
        return []
    return [p for p in directory.rglob("*") if p.is_file()]


def _sizes(paths: Iterable[Path]) -> dict[Path, int]:
    sizes = {}
    for path in paths:
        with contextlib.suppress(OSError):  # deleted meanwhile
            sizes[path] = path.stat().st_size
    return sizes
