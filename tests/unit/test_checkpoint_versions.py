"""Checkpoint files across versions (an outside audit of a swarm of mixed versions).

A release of format 1 loads and prunes every ``<sequence>.ckpt`` and refuses a header
field it does not know: started on a data folder after a later version (a downgrade),
it took that version's files for damaged, served initial weights, and its next save
deleted them. So this version's files are named ``<sequence>.v2.ckpt``; it still reads
format 1's for migration, but never in place of its own; and a file of a newer format
than its own is neither read, nor set aside as damaged, nor deleted."""

from __future__ import annotations

import hashlib
import json
import logging
import re
from pathlib import Path
from typing import Any

import pytest
import torch

from volunteerd.checkpoint_folders import FORMAT_VERSION, trim_others
from volunteerd.config import ExpertsConfig, RuntimeConfig, WireLimits
from volunteerd.config.models import CheckpointConfig
from volunteerd.experts import ExpertBackend, checkpoint_file
from volunteerd.experts.checkpoint_file import (
    CheckpointStore,
    NewerCheckpoint,
    decode_checkpoint,
    encode_checkpoint,
    header_json,
    write_checkpoint,
)
from volunteerd.runtime import ExpertRuntime
from volunteerd.runtime.checkpointer import Checkpointer

UID = "ffn.0.0"
HIDDEN = 16
EXPERTS = ExpertsConfig(hidden_dim=HIDDEN, optimizer={"name": "adam", "lr": 0.01})
PROJECT = "12D3KooWownerA/proj-a"

# What every format-1 release loads and prunes (checkpoint_folders of 2026-12-05).
FORMAT_1_NAME = re.compile(r"^\d{1,12}\.ckpt$")


def trained(updates: int, experiment: str = "") -> ExpertBackend:
    b = ExpertBackend(UID, EXPERTS, torch.device("cpu"), 64)
    b.experiment = experiment
    torch.manual_seed(updates)
    for _ in range(updates):
        b.backward([torch.randn(4, HIDDEN)], [torch.randn(4, HIDDEN)])
        b.step()
    return b


def reformat(data: bytes, magic_version: int, **fields: Any) -> bytes:
    """``data`` (a checkpoint's bytes) with the magic of ``magic_version`` and the header
    fields ``fields`` set, checksums right: what another version would write."""
    prefix = checkpoint_file._PREFIX
    _, length, _ = prefix.unpack_from(data)
    header = json.loads(data[prefix.size : prefix.size + length])
    header.update(fields)
    raw = json.dumps(header).encode()
    magic = b"VCKPT\x00" + bytes([magic_version]) + b"\n"
    return (
        prefix.pack(magic, len(raw), hashlib.sha256(raw).digest())
        + raw
        + data[prefix.size + length :]
    )


def newer_warnings(caplog: pytest.LogCaptureFixture) -> list[str]:
    return [r.getMessage() for r in caplog.records if "written by a newer" in r.getMessage()]


def test_no_file_this_version_writes_has_a_name_format_1_releases_load_or_prune(
    tmp_path: Path,
) -> None:
    store = CheckpointStore(tmp_path, keep=2)
    paths = [store.save(trained(n, PROJECT).state()) for n in range(1, 4)]
    assert [p.name for p in paths] == [f"{n:012d}.v2.ckpt" for n in range(1, 4)]
    assert not [p for p in (tmp_path / UID).iterdir() if FORMAT_1_NAME.match(p.name)]
    assert FORMAT_VERSION == 2
    assert header_json(paths[-1])["version"] == 2
    assert paths[-1].read_bytes()[:8] == b"VCKPT\x00\x02\n"


@pytest.mark.parametrize("experiment", ["", PROJECT])
def test_a_format_1_file_is_loaded_until_a_file_of_ours_is_saved(
    tmp_path: Path, experiment: str
) -> None:
    """Upgrading keeps an expert's weights (format 1 as releases wrote it, and as this
    version wrote it for a project's expert before the format was in the name); the
    first save supersedes the old file."""
    folder = tmp_path / UID
    folder.mkdir()
    old = folder / "000000000004.ckpt"
    data = b"".join(bytes(p) for p in encode_checkpoint(trained(3, experiment).state()))
    old.write_bytes(reformat(data, 1, version=1))
    store = CheckpointStore(tmp_path, keep=2)
    found = store.load_newest(UID)
    assert found is not None
    assert (found[0].updates, found[0].experiment, found[1]) == (3, experiment, old)

    new = store.save(found[0])
    assert new.name == "000000000005.v2.ckpt"  # numbered past it
    assert sorted(p.name for p in folder.iterdir()) == [new.name]
    found = store.load_newest(UID)
    assert found is not None
    assert (found[0].updates, found[1]) == (3, new)


def test_a_format_1_file_a_downgraded_daemon_wrote_is_not_preferred_to_ours(
    tmp_path: Path,
) -> None:
    """An older daemon started after a downgrade sees none of our files: it starts its
    experts afresh and writes format-1 files, numbered from its own (here 9, past ours
    at 5). Back on this version, ours are loaded, and the next save deletes those."""
    store = CheckpointStore(tmp_path, keep=2)
    for n in range(1, 6):
        ours = store.save(trained(7).state())
        assert ours.name == f"{n:012d}.v2.ckpt"
    afresh = tmp_path / UID / "000000000009.ckpt"
    write_checkpoint(afresh, trained(0).state(), version=1)
    found = store.load_newest(UID)
    assert found is not None
    assert (found[0].updates, found[1]) == (7, ours)
    assert store.files(UID)[-1] == afresh  # tried last
    assert store.save(found[0]).name == "000000000010.v2.ckpt"
    assert not afresh.exists()


def test_a_file_of_ours_that_fails_the_strict_check_is_still_damaged(tmp_path: Path) -> None:
    store = CheckpointStore(tmp_path, keep=2)
    good = store.save(trained(2).state())
    bad = tmp_path / UID / "000000000002.v2.ckpt"
    bad.write_bytes(reformat(good.read_bytes(), 2, version=2, unknown_field="x"))
    moved: list[Path] = []
    found = store.load_newest(UID, moved_aside=moved)
    assert found is not None
    assert found[1] == good
    assert moved == [bad.with_name(bad.name + ".damaged")]


@pytest.mark.parametrize(
    ("name", "magic_version", "fields"),
    [
        ("000000000009.v3.ckpt", 3, {"version": 3}),  # by its name
        ("000000000009.v2.ckpt", 3, {"version": 3}),  # by its magic
        ("000000000009.v2.ckpt", 2, {"version": 3, "future_field": "x"}),  # by its header
        # the audit's file: a field of a later format, under format 1's name
        ("000000000009.ckpt", 1, {"version": 3, "future_field": "x"}),
    ],
)
def test_a_file_of_a_newer_format_is_left_as_it_is_with_one_warning(
    tmp_path: Path,
    caplog: pytest.LogCaptureFixture,
    name: str,
    magic_version: int,
    fields: dict[str, Any],
) -> None:
    """Not loaded, not set aside as damaged, not deleted by saves nor by the trimming of
    experts no longer hosted; one warning per expert says to upgrade, and the expert
    goes on as if it had no checkpoint of that version (here: ours, older)."""
    store = CheckpointStore(tmp_path, keep=1)
    ours = store.save(trained(2, PROJECT).state())
    planted = tmp_path / UID / name
    data = reformat(ours.read_bytes(), magic_version, **fields)
    planted.write_bytes(data)

    with caplog.at_level(logging.WARNING):
        for _ in range(2):
            found = store.load_newest(UID)
            assert found is not None
            assert found[1] == ours
        for n in range(3):  # keep = 1: every save prunes
            store.save(trained(n, PROJECT).state())
        assert planted.read_bytes() == data
        assert trim_others(tmp_path, hosted=(), keep_experts=0)  # ours go, not that one
    assert newer_warnings(caplog) == [
        f"checkpoint {planted} was written by a newer volunteerd (format 3); left as it is "
        "— upgrade to use it"
    ]
    assert not [r for r in caplog.records if "skipping" in r.getMessage()]
    assert sorted(p.name for p in (tmp_path / UID).iterdir()) == [name]
    assert planted.read_bytes() == data
    assert store.load_newest(UID) is None  # none of ours: as for an expert with none
    assert sorted(p.name for p in (tmp_path / UID).iterdir()) == [name]


def test_a_replicas_state_of_a_newer_format_is_refused_as_newer() -> None:
    """On the wire, bytes carry the lowest format that holds them: a state of no project
    is format 1, which every release reads; one naming its project is format 2."""
    plain = b"".join(bytes(p) for p in encode_checkpoint(trained(1).state()))
    assert plain[:8] == b"VCKPT\x00\x01\n"
    of_project = b"".join(bytes(p) for p in encode_checkpoint(trained(1, PROJECT).state()))
    assert of_project[:8] == b"VCKPT\x00\x02\n"
    assert decode_checkpoint(of_project).experiment == PROJECT
    for magic_version in (2, 3):
        with pytest.raises(NewerCheckpoint, match="newer volunteerd \\(format 3") as caught:
            decode_checkpoint(reformat(of_project, magic_version, version=3), "replica")
        assert caught.value.version == 3


async def test_the_disk_budget_does_not_delete_a_file_of_a_newer_format(tmp_path: Path) -> None:
    """It counts (it takes the disk), but only its own version may delete it: a save
    that would need its room is skipped, as when the hosted experts' newest fill it."""
    hosted = "ffn.0.1"
    runtime = ExpertRuntime(
        [hosted], EXPERTS, RuntimeConfig(device="cpu"), WireLimits(), torch.device("cpu")
    )
    store = CheckpointStore(tmp_path)
    ours = store.save(trained(2, PROJECT).state())
    planted = tmp_path / UID / "000000000009.ckpt"  # of an expert no longer hosted
    data = reformat(ours.read_bytes(), 1, version=3, future_field="x")
    planted.write_bytes(data)
    ours.unlink()
    warnings: list[str] = []
    saver = Checkpointer(
        runtime,
        tmp_path,
        CheckpointConfig(keep=2),
        # room for the new file (its tensors and 64 KiB of slack), not with that one
        budget_bytes=lambda: (64 << 10) + len(data) + len(data) // 2,
        on_warning=warnings.append,
    )
    await runtime.with_expert(hosted, lambda b: b.load_state(trained(1).state()))
    assert await saver.save_changed() == 0
    assert "disk budget" in warnings[0]
    assert planted.read_bytes() == data
