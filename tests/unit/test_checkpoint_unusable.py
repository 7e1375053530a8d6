"""Checkpoints the daemon cannot use, said out loud and kept: a checkpoints folder out of
reach (a link to a drive not mounted, or to a file) stops the start with one line naming
it; an expert that starts from its initial weights says so; a damaged file is set aside
as ``<name>.damaged``, where no save prunes it (the newest two of an expert kept)."""

from __future__ import annotations

import logging
import re
from pathlib import Path

import pytest
import torch

from volunteerd.checkpoint_folders import DAMAGED_KEPT, damaged, trim_others
from volunteerd.config import ExpertsConfig, RuntimeConfig, WireLimits
from volunteerd.config.models import CheckpointConfig
from volunteerd.errors import ExitCode, ResourceUnavailable, exit_code
from volunteerd.experts import ExpertBackend
from volunteerd.experts.checkpoint_file import CheckpointStore
from volunteerd.runtime import ExpertRuntime
from volunteerd.runtime.checkpointer import Checkpointer

UIDS = ["ffn.0.0", "ffn.0.1"]
HIDDEN = 16
EXPERTS = ExpertsConfig(hidden_dim=HIDDEN, optimizer={"name": "adam", "lr": 0.01})


def runtime() -> ExpertRuntime:
    return ExpertRuntime(
        list(UIDS), EXPERTS, RuntimeConfig(device="cpu"), WireLimits(), torch.device("cpu")
    )


def trained(uid: str, steps: int) -> ExpertBackend:
    b = ExpertBackend(uid, EXPERTS, torch.device("cpu"), 64)
    generator = torch.Generator().manual_seed(1)
    for _ in range(steps):
        x = torch.randn(8, HIDDEN, generator=generator)
        b.backward([x], [torch.randn(8, HIDDEN, generator=generator)])
        b.step()
    return b


async def test_a_checkpoints_link_to_a_drive_not_mounted_stops_the_start_saying_what_to_do(
    tmp_path: Path,
) -> None:
    """It started every expert from its initial weights without a word, and each save
    logged ``[Errno 17] File exists``."""
    drive = tmp_path / "usb" / "checkpoints"
    CheckpointStore(drive).save(trained(UIDS[0], 3).state())
    (tmp_path / "usb").rename(tmp_path / "usb.unmounted")
    link = tmp_path / "checkpoints"
    link.symlink_to(drive)
    host = runtime()
    with pytest.raises(ResourceUnavailable) as raised:
        await Checkpointer(host, link, CheckpointConfig()).restore()
    message = str(raised.value)
    assert f"checkpoints folder {link} is a link to {drive}, which is missing" in message
    assert "mount the drive" in message
    assert "\n" not in message  # the command line shows it as one line
    assert exit_code(raised.value) == ExitCode.UNAVAILABLE  # the service manager retries
    assert host.backend(UIDS[0]).updates == 0

    # a save meanwhile (the drive unmounted while serving) says why it cannot
    with pytest.raises(OSError, match=r"is a link to .*, which is missing"):
        CheckpointStore(link).save(trained(UIDS[0], 1).state())

    (tmp_path / "usb.unmounted").rename(tmp_path / "usb")  # mounted: the start goes on
    loaded = await Checkpointer(host, link, CheckpointConfig()).restore()
    assert list(loaded) == [UIDS[0]]
    assert host.backend(UIDS[0]).updates == 3


async def test_a_checkpoints_path_that_is_a_file_stops_the_start(tmp_path: Path) -> None:
    target = tmp_path / "notes.txt"
    target.write_text("not a folder")
    link = tmp_path / "checkpoints"
    link.symlink_to(target)
    with pytest.raises(ResourceUnavailable, match=r"is a link to .*notes\.txt, which is not a"):
        await Checkpointer(runtime(), link, CheckpointConfig()).restore()
    with pytest.raises(OSError, match="which is not a folder"):
        CheckpointStore(link).save(trained(UIDS[0], 1).state())

    link.unlink()
    target.rename(link)
    with pytest.raises(
        ResourceUnavailable, match=re.escape(f"checkpoints folder {link} is not a folder")
    ):
        await Checkpointer(runtime(), link, CheckpointConfig()).restore()


async def test_no_checkpoints_folder_yet_is_a_first_start_and_each_expert_says_it_starts_afresh(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    def afresh() -> list[str]:
        lines = [r.getMessage() for r in caplog.records if "initial weights" in r.getMessage()]
        assert all(r.levelno < logging.WARNING for r in caplog.records)
        caplog.clear()
        return lines

    with caplog.at_level(logging.INFO, logger="volunteerd.runtime.checkpointer"):
        first = await Checkpointer(
            runtime(), tmp_path / "checkpoints", CheckpointConfig()
        ).restore()
        assert first == {}
        assert afresh() == [
            f"no checkpoint of {uid} to load: it starts from its initial weights" for uid in UIDS
        ]
        CheckpointStore(tmp_path / "checkpoints").save(trained(UIDS[1], 2).state())
        later = await Checkpointer(
            runtime(), tmp_path / "checkpoints", CheckpointConfig()
        ).restore()
        assert list(later) == [UIDS[1]]
        assert afresh() == [
            f"no checkpoint of {UIDS[0]} to load: it starts from its initial weights"
        ]


def damage(path: Path) -> bytes:
    """Flip a bit of ``path``'s payload (its checksum no longer matches); its bytes."""
    data = bytearray(path.read_bytes())
    data[-10] ^= 0xFF
    path.write_bytes(bytes(data))
    return bytes(data)


@pytest.mark.parametrize("keep", [1, 2])
async def test_an_expert_whose_every_checkpoint_is_damaged_says_so_and_its_files_outlive_the_saves(
    tmp_path: Path, caplog: pytest.LogCaptureFixture, keep: int
) -> None:
    """It was re-initialised with two warnings and "restored 2 of 3 experts" (49 updates
    to 0), and pruning then deleted the damaged files within two save rounds (one with
    ``keep = 1``)."""
    store = CheckpointStore(tmp_path, keep=keep)
    for steps in (2, 3):
        store.save(trained(UIDS[0], steps).state())
    store.save(trained(UIDS[1], 2).state())
    kept = {path.name + ".damaged": damage(path) for path in store.files(UIDS[0])}
    assert len(kept) == keep

    host = runtime()
    saver = Checkpointer(host, tmp_path, CheckpointConfig(keep=keep))
    with caplog.at_level(logging.INFO):
        loaded = await saver.restore()
    assert list(loaded) == [UIDS[1]]
    errors = [r.getMessage() for r in caplog.records if r.levelno >= logging.ERROR]
    assert errors == [
        f"{UIDS[0]} starts from its initial weights: every checkpoint of it that could be "
        f"read is damaged; the damaged files are kept in {tmp_path / UIDS[0]} (*.damaged)"
    ]
    assert saver.store.files(UIDS[0]) == []

    for seed in range(3):  # save rounds: pruning leaves the damaged files alone
        await host.with_expert(
            UIDS[0], lambda b, seed=seed: b.load_state(trained(UIDS[0], seed + 1).state())
        )
        assert await saver.save_changed() == 1
    folder = tmp_path / UIDS[0]
    assert {p.name: p.read_bytes() for _, p in damaged(folder)} == kept
    assert len(saver.store.files(UIDS[0])) == keep
    newest = saver.store.files(UIDS[0])[0].name  # numbered past the damaged ones
    assert newest == f"{2 + 3:012d}.v2.ckpt"


async def test_a_damaged_newest_file_is_set_aside_and_the_older_one_loads(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    store = CheckpointStore(tmp_path, keep=2)
    older = store.save(trained(UIDS[0], 2).state())
    newer = store.save(trained(UIDS[0], 4).state())
    damage(newer)
    host = runtime()
    saver = Checkpointer(host, tmp_path, CheckpointConfig(keep=2))
    with caplog.at_level(logging.WARNING):
        loaded = await saver.restore()
    assert loaded == {UIDS[0]: older}
    assert host.backend(UIDS[0]).updates == 2
    assert f"skipping checkpoint {newer}: {newer.name}: payload checksum mismatch; kept as " in (
        caplog.text
    )
    assert not [r for r in caplog.records if r.levelno >= logging.ERROR]
    aside = newer.with_name(newer.name + ".damaged")
    for seed in range(3):
        await host.with_expert(
            UIDS[0], lambda b, seed=seed: b.load_state(trained(UIDS[0], seed + 5).state())
        )
        assert await saver.save_changed() == 1
    assert [p for _, p in damaged(tmp_path / UIDS[0])] == [aside]


def test_only_the_newest_damaged_files_of_an_expert_are_kept(tmp_path: Path) -> None:
    """A disk that damages every file cannot fill up with them."""
    store = CheckpointStore(tmp_path, keep=1)
    for n in range(DAMAGED_KEPT + 3):
        damage(store.save(trained(UIDS[0], n).state()))
        assert store.load_newest(UIDS[0]) is None
    folder = tmp_path / UIDS[0]
    assert sorted(p.name for p in folder.iterdir()) == [
        f"{n:012d}.v2.ckpt.damaged" for n in range(4, 4 + DAMAGED_KEPT)
    ]


def test_damaged_files_go_with_the_folder_of_an_expert_no_longer_kept(tmp_path: Path) -> None:
    store = CheckpointStore(tmp_path, keep=2)
    damage(store.save(trained(UIDS[0], 1).state()))
    assert store.load_newest(UIDS[0]) is None
    store.save(trained(UIDS[0], 2).state())
    trim_others(tmp_path, (), 0)
    assert not (tmp_path / UIDS[0]).exists()


async def test_the_disk_budget_deletes_damaged_files_before_good_ones(tmp_path: Path) -> None:
    budget = [0]
    host = runtime()
    saver = Checkpointer(host, tmp_path, CheckpointConfig(keep=2), budget_bytes=lambda: budget[0])
    good = saver.store.save(trained(UIDS[0], 1).state())
    bad = saver.store.save(trained(UIDS[0], 2).state())
    damage(bad)
    assert (await saver.restore())[UIDS[0]] == good
    size = good.stat().st_size
    budget[0] = 2 * size + size // 2  # the new file and one more
    await host.with_expert(UIDS[0], lambda b: b.load_state(trained(UIDS[0], 3).state()))
    assert await saver.save_changed() == 1
    assert damaged(tmp_path / UIDS[0]) == []
    assert saver.store.files(UIDS[0])[1] == good


async def test_an_experts_own_folder_linked_to_a_drive_not_mounted_stops_the_start(
    tmp_path: Path,
) -> None:
    """The check looked only at the checkpoints folder: one expert's folder that was a
    link to a drive not mounted read as "no checkpoints" (the expert started from its
    initial weights) and each save of it failed with ``[Errno 17] File exists``."""
    drive = tmp_path / "usb"
    CheckpointStore(drive).save(trained(UIDS[0], 3).state())
    checkpoints = tmp_path / "checkpoints"
    checkpoints.mkdir()
    link = checkpoints / UIDS[0]
    link.symlink_to(drive / UIDS[0])
    drive.rename(tmp_path / "usb.unmounted")
    host = runtime()
    with pytest.raises(ResourceUnavailable) as raised:
        await Checkpointer(host, checkpoints, CheckpointConfig()).restore()
    assert str(raised.value) == (
        f"checkpoints folder of {UIDS[0]} {link} is a link to {drive / UIDS[0]}, which is "
        "missing: mount the drive it is on, or remove the link"
    )
    assert host.backend(UIDS[0]).updates == 0
    with pytest.raises(OSError, match=r"checkpoints folder of ffn\.0\.0 .*, which is missing"):
        CheckpointStore(checkpoints).save(trained(UIDS[0], 1).state())

    (tmp_path / "usb.unmounted").rename(drive)  # mounted: the start goes on
    loaded = await Checkpointer(host, checkpoints, CheckpointConfig()).restore()
    assert list(loaded) == [UIDS[0]]
    assert host.backend(UIDS[0]).updates == 3


@pytest.mark.parametrize("replica", [True, False])
async def test_a_joiners_expert_whose_every_checkpoint_is_damaged_says_so_as_an_error_event(
    tmp_path: Path,
    caplog: pytest.LogCaptureFixture,
    autojump_clock: object,
    replica: bool,
) -> None:
    """A project's expert (the joiner's path, not ``restore``) was set aside with only a
    warning in the log, then downloaded from a replica or started from its initial
    weights: no error, no event, so nobody learnt that its trained weights were lost."""
    import types

    from volunteerd.config import ExperimentsConfig
    from volunteerd.net import PeerAddress
    from volunteerd.swarm.joiner import Joiner

    uid = UIDS[0]
    store = CheckpointStore(tmp_path)
    damage(store.save(trained(uid, 3).state()))
    origin = trained(uid, 5)

    async def run(fn: object) -> object:
        return fn()  # type: ignore[operator]

    host = types.SimpleNamespace(executor=types.SimpleNamespace(run=run))
    saver = Checkpointer(host, tmp_path, CheckpointConfig())  # type: ignore[arg-type]
    posted: list[str] = []
    saver.on_warning = posted.append  # the daemon's error events

    class Downloads:
        async def download(self, peer: PeerAddress, backend: ExpertBackend) -> object:
            return origin.state()

        async def discard(self, uid: str) -> None:
            pass

    joiner = Joiner(
        None,  # type: ignore[arg-type]  # not looked up: the replicas are given
        host,  # type: ignore[arg-type]
        lambda: None,
        saver,
        Downloads(),
        ExperimentsConfig(),
        lambda experts: 1,
    )

    async def no_replicas(uids: list[str]) -> dict[str, list[PeerAddress]]:
        return {uid: [] for uid in uids}

    joiner.live_replicas = no_replicas  # type: ignore[method-assign]
    peer = "12D3KooWReplicaOfTheExpert00000001"
    replicas = [PeerAddress(peer, ["/ip4/127.0.0.1/tcp/1"])] if replica else []
    expert = ExpertBackend(uid, EXPERTS, torch.device("cpu"), 64)
    with caplog.at_level(logging.INFO):
        source = await joiner._initial_state(expert, replicas)
    assert source == (f"replica {peer}" if replica else "seed")
    instead = (
        f"was downloaded from a replica (…{peer[-8:]})"
        if replica
        else "starts from its initial weights (no replica could give it)"
    )
    said = (
        f"{uid} {instead}: every checkpoint of it that could be read is damaged; the "
        f"damaged files are kept in {tmp_path / uid} (*.damaged)"
    )
    assert [r.getMessage() for r in caplog.records if r.levelno >= logging.ERROR] == [said]
    assert posted == [said]
    assert expert.updates == (5 if replica else 0)
    assert len(damaged(tmp_path / uid)) == 1
