"""Checkpoints the daemon cannot use, said out loud: a checkpoints folder out of reach
(a link to a drive not mounted, or to a file) stops the start with one line naming it,
and an expert that starts from its initial weights says so."""

from __future__ import annotations

import logging
import re
from pathlib import Path

import pytest
import torch

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
