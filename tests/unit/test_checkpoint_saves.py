"""Saving checkpoints safely: two saves of one expert at once (a periodic one and the
final one of an expert being dropped) run one after the other, each in a temporary file
of its own, and the newest file holds the newest state; nothing is deleted before the
new file is written and read back; only regular files named like checkpoints count.

The interleavings are forced with hooks (no timing luck): a save is held inside the
store until the other one is either inside too (the old, unserialized code) or waiting
for its turn."""

from __future__ import annotations

import errno
import logging
import os
import stat
import threading
import time
from collections.abc import Callable
from pathlib import Path

import pytest
import torch
import trio
import trio.testing

from volunteerd.config import ExpertsConfig, RuntimeConfig, WireLimits
from volunteerd.config.models import CheckpointConfig
from volunteerd.experts import ExpertBackend, checkpoint_file
from volunteerd.experts.checkpoint_file import (
    CheckpointError,
    CheckpointStore,
    ExpertState,
    read_checkpoint,
)
from volunteerd.runtime import ExpertRuntime
from volunteerd.runtime.checkpointer import Checkpointer

UID = "ffn.0.0"
HIDDEN = 32
EXPERTS = ExpertsConfig(hidden_dim=HIDDEN, optimizer={"name": "adam", "lr": 0.001})


def make() -> ExpertBackend:
    return ExpertBackend(UID, EXPERTS, torch.device("cpu"), 64)


def train(b: ExpertBackend) -> None:
    b.backward([torch.randn(4, HIDDEN)], [torch.randn(4, HIDDEN)])
    b.step()


def waiting_for(locks: object, uid: str) -> int:
    """How many saves of ``uid`` hold or await its lock (0 where there is none)."""
    entry = locks.get(uid) if isinstance(locks, dict) else None
    return int(entry[1][0]) if entry else 0


def until(condition: Callable[[], bool], what: str, limit_s: float = 60.0) -> None:
    deadline = time.monotonic() + limit_s
    while not condition():
        assert time.monotonic() < deadline, f"never {what}"
        time.sleep(0.001)


def assert_all_good(store: CheckpointStore, newest_updates: int) -> None:
    files = store.files(UID)
    assert files, "no checkpoint left"
    states = [read_checkpoint(p) for p in files]  # raises on a damaged one
    assert states[0].updates == newest_updates
    assert not [p.name for p in (store.directory / UID).iterdir() if p.name.endswith(".tmp")]


def test_two_saves_of_one_expert_at_once_run_one_after_the_other(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """They shared one temporary name (``<seq>.ckpt.tmp``, opened with O_TRUNC) and one
    sequence number: bytes of both in one file, a rename that raised, and the pruning
    of the good files."""
    store = CheckpointStore(tmp_path, keep=2)
    b = make()
    train(b)
    store.save(b.state())
    train(b)
    first = b.state()
    train(b)
    second = b.state()

    real = checkpoint_file.write_checkpoint
    inside = [0]
    most = [0]
    entered: list[int] = []
    guard = threading.Lock()

    def held_write(path: Path, state: ExpertState) -> None:
        with guard:
            inside[0] += 1
            most[0] = max(most[0], inside[0])
            entered.append(state.updates)
            mine = len(entered)
        try:
            if mine == 1:  # hold the first until the second is inside too, or waits
                until(
                    lambda: (
                        len(entered) > 1 or waiting_for(getattr(store, "_locks", None), UID) > 1
                    ),
                    "saw the second save",
                )
            real(path, state)
        finally:
            with guard:
                inside[0] -= 1

    monkeypatch.setattr(checkpoint_file, "write_checkpoint", held_write)
    errors: list[BaseException] = []
    paths: list[Path] = []

    def save(state: ExpertState) -> None:
        try:
            paths.append(store.save(state))
        except BaseException as exc:
            errors.append(exc)

    one = threading.Thread(target=save, args=(first,))
    one.start()
    until(lambda: bool(entered), "started the first save")
    two = threading.Thread(target=save, args=(second,))
    two.start()
    one.join(60)
    two.join(60)
    assert not one.is_alive()
    assert not two.is_alive()
    assert errors == []
    assert most[0] == 1  # never two writers of one expert at once
    assert len(set(paths)) == 2
    assert_all_good(store, newest_updates=second.updates)  # the second finished last
    assert len(store.files(UID)) == 2


def test_a_save_whose_file_reads_back_wrong_deletes_no_good_file(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Older files are deleted only once the new one is on disk and reads back as what
    was written: with keep=1, a new file that went short used to take the only good
    one with it."""
    store = CheckpointStore(tmp_path, keep=1)
    b = make()
    train(b)
    good = store.save(b.state())
    train(b)

    real_fsync = os.fsync

    def short_fsync(fd: int) -> None:
        if stat.S_ISREG(os.fstat(fd).st_mode):
            os.ftruncate(fd, os.fstat(fd).st_size - 1)  # the disk lost its last byte
        real_fsync(fd)

    monkeypatch.setattr(checkpoint_file.os, "fsync", short_fsync)
    with pytest.raises((CheckpointError, OSError)):
        store.save(b.state())
    monkeypatch.undo()
    assert store.files(UID) == [good]
    assert read_checkpoint(good).updates == 1
    assert sorted(p.name for p in (tmp_path / UID).iterdir()) == [good.name]  # no temporary


async def test_a_dropped_experts_save_waits_for_a_periodic_one_and_is_the_newest(
    tmp_path: Path,
) -> None:
    """``Joiner._drop`` (remove_expert, then ``Checkpointer.save``) while the periodic
    ``save_changed`` writes the same expert: the periodic save (its older state) used
    to be written last, so a rejoin restored an older state, or a mixed file."""
    runtime = ExpertRuntime(
        [], EXPERTS, RuntimeConfig(device="cpu"), WireLimits(), torch.device("cpu")
    )
    saver = Checkpointer(runtime, tmp_path, CheckpointConfig(keep=2))
    real = saver.store.save
    calls: list[int] = []
    done: list[int] = []
    release = threading.Event()

    def held_save(state: ExpertState) -> Path:
        calls.append(state.updates)
        if len(calls) == 1:
            assert release.wait(60)
        path = real(state)
        done.append(state.updates)
        return path

    saver.store.save = held_save  # type: ignore[method-assign]
    with trio.fail_after(60):
        async with trio.open_nursery() as nursery:
            await nursery.start(runtime.serve)
            await runtime.add_expert(runtime.make_backend(UID, EXPERTS))
            await runtime.with_expert(UID, train)
            async with trio.open_nursery() as saves:
                saves.start_soon(saver.save_changed)
                # the periodic save copied the state and is writing
                while not calls:  # noqa: ASYNC110 - set in a worker thread
                    await trio.sleep(0.001)
                await runtime.with_expert(UID, train)  # queued work finishing
                removed = await runtime.remove_expert(UID)
                saves.start_soon(saver.save, removed)
                # the drop's save is either writing too (old) or waits for its turn
                while not done and waiting_for(getattr(saver, "_locks", None), UID) < 2:  # noqa: ASYNC110
                    await trio.sleep(0.001)
                release.set()
            runtime.close()
            nursery.cancel_scope.cancel()
    assert calls == [1, 2]
    found = saver.store.load_newest(UID)
    assert found is not None
    assert found[0].updates == removed.updates == 2  # a rejoin gets the dropped state
    assert_all_good(saver.store, newest_updates=2)
    stats = saver.statistics()
    assert (stats.saves, stats.failures) == (2, 0)


def _saved(store: CheckpointStore, b: ExpertBackend) -> Path:
    train(b)
    return store.save(b.state())


def test_a_folder_named_like_a_checkpoint_is_neither_read_nor_deleted(tmp_path: Path) -> None:
    """Pruning it raised IsADirectoryError at every save after it (and the checkpointer
    rewrote the unchanged state forever)."""
    store = CheckpointStore(tmp_path, keep=2)
    b = make()
    first = _saved(store, b)
    junk = [tmp_path / UID / "000000000009.v2.ckpt", tmp_path / UID / "000000000002.v2.ckpt"]
    for folder in junk:
        folder.mkdir()
    saved = [_saved(store, b) for _ in range(3)]
    assert store.files(UID) == [saved[2], saved[1]]
    assert first not in saved
    assert all(p not in junk for p in saved)
    assert all(folder.is_dir() for folder in junk)
    found = store.load_newest(UID)
    assert found is not None
    assert found[1] == saved[2]
    assert found[0].updates == 4
    (tmp_path / UID / "000000000003.ckpt.tmp").mkdir()  # not a temporary of ours
    assert store.remove_temporaries() == 0


def test_a_fifo_named_like_the_newest_checkpoint_does_not_block_the_start(tmp_path: Path) -> None:
    """``read_bytes`` waited for a writer to the FIFO: the daemon never started."""
    store = CheckpointStore(tmp_path, keep=2)
    good = _saved(store, make())
    fifo = tmp_path / UID / "000000000005.v2.ckpt"
    os.mkfifo(fifo)
    result: dict[str, object] = {}

    def load() -> None:
        result["newest"] = store.load_newest(UID)
        try:
            read_checkpoint(fifo)
        except (CheckpointError, OSError) as exc:
            result["fifo"] = exc

    thread = threading.Thread(target=load, daemon=True)
    thread.start()
    thread.join(30)
    if thread.is_alive():  # release the old code's reader before failing
        os.close(os.open(fifo, os.O_WRONLY | os.O_NONBLOCK))
        pytest.fail("reading a FIFO named like a checkpoint blocked")
    newest = result["newest"]
    assert isinstance(newest, tuple)
    assert newest[1] == good
    assert "not a regular file" in str(result["fifo"])
    assert store.files(UID) == [good]
    assert _saved(store, make()).name == "000000000002.v2.ckpt"
    assert stat.S_ISFIFO(fifo.lstat().st_mode)  # left alone


def test_a_symlink_named_like_a_checkpoint_is_not_followed(tmp_path: Path) -> None:
    """A link to /dev/zero: ``read_bytes`` read until the memory ran out."""
    store = CheckpointStore(tmp_path, keep=2)
    good = _saved(store, make())
    link = tmp_path / UID / "000000000007.v2.ckpt"
    link.symlink_to("/dev/zero")
    assert store.files(UID) == [good]  # first: the old code would read it below
    with pytest.raises(OSError):
        read_checkpoint(link)
    found = store.load_newest(UID)
    assert found is not None
    assert found[1] == good
    assert link.is_symlink()


def test_a_file_larger_than_the_expert_can_have_is_not_read(tmp_path: Path) -> None:
    """What is read is bounded by the expert's largest state (a sparse file of 64 GiB
    named like the newest checkpoint is refused from its size)."""
    store = CheckpointStore(tmp_path, keep=2)
    b = make()
    good = _saved(store, b)
    huge = tmp_path / UID / "000000000002.v2.ckpt"
    with huge.open("wb") as f:
        f.truncate(64 << 30)
    limit = b.largest_state_bytes()
    assert good.stat().st_size <= limit
    with pytest.raises(CheckpointError, match="more than"):
        read_checkpoint(huge, max_bytes=limit)
    found = store.load_newest(UID, b.check_state, max_bytes=limit)
    assert found is not None
    assert found[1] == good


@pytest.mark.usefixtures("inline_threads")
async def test_rounds_that_fail_with_too_many_open_files_are_logged_and_tried_again(
    tmp_path: Path, autojump_clock: trio.abc.Clock, caplog: pytest.LogCaptureFixture
) -> None:
    """Under an open-file limit full of connections, the trimming's listing of the
    checkpoints folder raised EMFILE out of ``serve`` and the daemon stopped (exit 5).
    Now each failed step is logged (at WARNING once per streak) and tried again at the
    next round; a save that fails so is too."""
    runtime = ExpertRuntime(
        [], EXPERTS, RuntimeConfig(device="cpu"), WireLimits(), torch.device("cpu")
    )
    saver = Checkpointer(runtime, tmp_path, CheckpointConfig(every_s=10))
    emfile = OSError(errno.EMFILE, "Too many open files", str(tmp_path))
    real_trim, real_save = saver.store.trim_others, saver.save_changed
    trims: list[str] = []
    saves: list[str] = []

    def trim(hosted: frozenset[str], keep: int) -> list[Path]:
        trims.append("failed" if len(trims) < 3 else "done")
        if trims[-1] == "failed":
            raise emfile
        return real_trim(hosted, keep)

    async def save_changed() -> int:
        saves.append("failed" if len(saves) in (1, 2) else "done")
        if saves[-1] == "failed":
            raise emfile
        return await real_save()

    saver.store.trim_others = trim  # type: ignore[method-assign]
    saver.save_changed = save_changed  # type: ignore[method-assign]
    with caplog.at_level(logging.DEBUG, logger="volunteerd.runtime.checkpointer"):
        async with trio.open_nursery() as nursery:
            await nursery.start(saver.serve)
            await trio.sleep(55)  # rounds at 0, 10, ... 50 s: five trims
            nursery.cancel_scope.cancel()
    assert trims == ["failed"] * 3 + ["done"] * 2
    assert saves == ["done", "failed", "failed", "done", "done", "done"]
    assert saver.statistics().round_failures == 5
    warnings = [r.getMessage() for r in caplog.records if r.levelno == logging.WARNING]
    assert len(warnings) == 2  # one per streak of each step
    assert any("could not trim" in w and "Too many open files" in w for w in warnings)
    back = [r.getMessage() for r in caplog.records if r.levelno == logging.INFO]
    assert any("after 3 failed rounds" in m for m in back)
    assert any("after 2 failed rounds" in m for m in back)
