"""A real daemon's activity in ``/api/v1/status`` (real libp2p and HTTP on loopback):
hosting nothing it is not in a project; alone it has no peers; joined it waits for
work until a trainer calls, then contributes; paused it says so (the rules
themselves: tests/unit/test_activity.py)."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
import trio

from volunteerd.control.client import ControlClient
from volunteerd.control.verbs import format_status
from volunteerd.experts import to_wire
from volunteerd.net import Verb
from volunteerd.net.records import FindRequest
from volunteerd.testing import local_config, open_daemon, open_peer
from volunteerd.testing.clients import open_bare_client
from volunteerd.wire import ForwardRequest

pytestmark = pytest.mark.slow

HIDDEN = 16
GRID = "ffn.[0:2].[0:1]"


async def test_a_daemon_in_no_project_says_so_and_how_to_join(tmp_path: Path) -> None:
    async with open_daemon(local_config(uids=""), tmp_path / "idle"):
        client = ControlClient.for_data_dir(tmp_path / "idle")
        status = await trio.to_thread.run_sync(client.status)
        assert status.experts == []
        assert status.activity.state == "not_in_project"
        assert status.activity.message == "not in a project"
        shown = format_status(status)
        assert "state         not in a project\n" in shown
        assert "volunteerd join <invitation>" in shown
        assert "limits        up unlimited, down unlimited\n" in shown
        # a quota that is set is on the limits line (a soak: only the rates were)
        limits = status.limits.model_copy(update={"daily_quota_gb": 2.0, "day_bytes": 5 * 10**8})
        shown = format_status(status.model_copy(update={"limits": limits}))
        assert (
            "limits        up unlimited, down unlimited; daily quota 2 GB (500.0 MB used)\n"
            in shown
        )


async def test_a_daemon_whose_announcements_reach_nobody_says_it_is_cut_off(
    tmp_path: Path,
) -> None:
    # A peer is connected, but no other peer keeps its records: trainers that look its
    # experts up cannot find them ("waiting for work" said all was well).
    alone = local_config(uids=GRID, experts={"hidden_dim": HIDDEN})
    async with (
        open_daemon(alone, tmp_path / "alone") as daemon,
        open_bare_client(local_config()) as client,
    ):
        with trio.fail_after(30):
            await client.call(daemon.node.address, Verb.DHT_FIND, FindRequest(keys=["ffn."]))
        control = ControlClient.for_data_dir(tmp_path / "alone")
        status = await trio.to_thread.run_sync(control.status)
        assert status.connected_peers >= 1
        assert (status.activity.state, status.activity.message) == (
            "no_peers",
            "cut off: its announcements reach no other peer",
        )


async def test_a_daemon_says_what_it_does_as_it_changes(tmp_path: Path) -> None:
    alone = local_config(uids=GRID, experts={"hidden_dim": HIDDEN})
    async with open_daemon(alone, tmp_path / "alone"):
        client = ControlClient.for_data_dir(tmp_path / "alone")
        status = await trio.to_thread.run_sync(client.status)
        assert status.activity.state == "no_peers"
        assert "bootstrap" in status.activity.hint

    async with open_peer(local_config()) as boot:
        config = local_config(uids=GRID, bootstrap=boot.multiaddrs, experts={"hidden_dim": HIDDEN})
        async with (
            open_daemon(config, tmp_path / "a") as daemon,
            open_peer(local_config(bootstrap=boot.multiaddrs)) as trainer,
        ):
            client = ControlClient.for_data_dir(tmp_path / "a")
            status = await trio.to_thread.run_sync(client.status)
            assert (status.activity.state, status.activity.message) == (
                "waiting",
                "waiting for work",
            )

            meta, data = to_wire(torch.randn(2, HIDDEN))
            await trainer.rpc.call(
                daemon.node.address,
                Verb.FORWARD,
                ForwardRequest(uid="ffn.0.0", tensors=[meta]),
                [data],
            )
            status = await trio.to_thread.run_sync(client.status)
            assert status.activity.state == "contributing"

            status = await trio.to_thread.run_sync(client.pause)
            assert status.activity.state == "paused"
            assert status.activity.message == "paused by you"
            shown = format_status(status)
            assert "state         paused by you\n" in shown
            assert "paused: paused" not in shown
            assert "volunteerd resume" in shown


async def test_a_daemon_hosting_nothing_starts_though_its_checkpoints_cannot_be_listed(
    tmp_path: Path, caplog: pytest.LogCaptureFixture, monkeypatch: pytest.MonkeyPatch
) -> None:
    # A start that hosts nothing tidies the checkpoints of experts left; an error
    # listing them (out of files under a low limit: EMFILE) ended the start. (Root, who
    # runs CI, lists any folder: the listing's failure is made here.)
    import errno

    import volunteerd.daemon

    def out_of_files(directory: Path, *args: object) -> list[Path]:
        raise OSError(errno.EMFILE, "Too many open files", str(directory))

    monkeypatch.setattr(volunteerd.daemon, "trim_others", out_of_files)
    data = tmp_path / "idle"
    async with open_daemon(local_config(uids=""), data):
        client = ControlClient.for_data_dir(data)
        status = await trio.to_thread.run_sync(client.status)
        assert status.activity.state == "not_in_project"
    assert any("could not trim the checkpoints" in r.getMessage() for r in caplog.records)
