"""A daemon and its projects (``projects.toml``): hosting nothing without one; one joiner
per project, each hosting only its own experiment's experts within its share of the
room; a project that cannot be joined shown as failed while the others serve; and
joining or leaving through the control API restarting the daemon into the new set."""

from __future__ import annotations

import os
import time
from collections.abc import AsyncIterator, Callable
from contextlib import asynccontextmanager
from pathlib import Path
from typing import Any

import pytest
import trio

from volunteerd.config import Config
from volunteerd.control.models import ProjectJoin
from volunteerd.daemon import Daemon, Running
from volunteerd.errors import ConfigError
from volunteerd.identity import Identity
from volunteerd.net import Node
from volunteerd.net.peers import peer_id_for
from volunteerd.paths import Paths
from volunteerd.swarm.invitation import Invitation
from volunteerd.swarm.manifest import ExperimentManifest, sign_manifest
from volunteerd.swarm.projects import Project, join_project, load_projects
from volunteerd.testing import local_config, open_peer

# Real libp2p nodes on loopback, in wall-clock time, and daemons hosting torch experts.
pytestmark = pytest.mark.slow


def daemon_config(bootstrap: list[str] | None = None, **experiments: Any) -> Config:
    """No experts.uids and (unless given) no bootstrap peers: what to host and whom to
    join through come from the projects."""
    return local_config(
        bootstrap=bootstrap or [],
        uids="",
        experiments={
            "max_experts": 4,
            "rebalance_every_s": 2.0,
            "min_stay_s": 0.0,
            "join_timeout_s": 10.0,
            **experiments,
        },
        replicas={"enabled": False},
        dht={"record_ttl_s": 10.0},
    )


async def publish(boot: Node, owner: Identity, name: str, prefix: str) -> ExperimentManifest:
    now = time.time()
    manifest = ExperimentManifest(
        name=name,
        description=f"the {name} experiment",
        owner_name="a test lab",
        hidden_dim=16,
        uid_prefix=prefix,
        grid=(2, 4),
        replication=1,
        owner=str(peer_id_for(owner)),
        issued_at=now,
        expires_at=now + 3600,
    )
    assert await boot.dht.put_manifest(sign_manifest(manifest, owner)) >= 1
    return manifest


def invitation(boot: Node, owner: Identity, name: str) -> Invitation:
    return Invitation(name, str(peer_id_for(owner)), (boot.multiaddrs[0],))


def record(data_dir: Path, *projects: tuple[Invitation, float]) -> None:
    for invited, share in projects:
        join_project(
            data_dir / "projects.toml", Project.invited(invited, share=share, joined_at=1.0)
        )


@asynccontextmanager
async def serving(
    config: Config, data_dir: Path, identity: Identity
) -> AsyncIterator[tuple[Daemon, Running, trio.Event]]:
    """A daemon, its ``Running``, and an event set once ``serve`` returned (a restart
    asked for, or stopped)."""
    paths = Paths(config_file=data_dir / "config.toml", data_dir=data_dir, cache_dir=data_dir)
    daemon = Daemon(config, paths, identity=identity)
    returned = trio.Event()

    async def serve(task_status: Any = trio.TASK_STATUS_IGNORED) -> None:
        try:
            await daemon.serve(task_status=task_status)
        finally:
            returned.set()

    async with trio.open_nursery() as nursery:
        running: Running = await nursery.start(serve)
        try:
            yield daemon, running, returned
        finally:
            daemon.request_stop()


async def until(check: Callable[[], bool], within_s: float = 60) -> None:
    with trio.fail_after(within_s):
        while not check():  # noqa: ASYNC110 - polling the daemon's state
            await trio.sleep(0.1)


async def test_two_projects_share_the_room_and_each_hosts_only_its_own(tmp_path: Path) -> None:
    owner = Identity.generate()
    async with open_peer(local_config()) as boot:
        small = await publish(boot, owner, "small", "aa")
        big = await publish(boot, owner, "big", "bb")
        record(tmp_path, (invitation(boot, owner, "small"), 1.0))
        record(tmp_path, (invitation(boot, owner, "big"), 3.0))
        async with serving(daemon_config(), tmp_path, Identity.generate()) as (_, running, _):
            assert running.hosting is not None
            await until(lambda: all(j.state == "joined" for j in running.joiners))
            by_name = {j.name: j for j in running.joiners}
            # max_experts 4, shares 1 : 3
            assert set(by_name["small"].hosted) <= set(small.uids())
            assert set(by_name["big"].hosted) <= set(big.uids())
            assert (len(by_name["small"].hosted), len(by_name["big"].hosted)) == (1, 3)
            assert set(running.runtime.uids) == {*by_name["small"].hosted, *by_name["big"].hosted}

            assert running.controls is not None
            status = await running.controls.status()
            views = {p.name: p for p in status.projects}
            assert views["big"].state == "joined"
            assert views["big"].experts == 3
            assert views["big"].share == 3.0
            assert views["big"].description == "the big experiment"
            assert views["big"].owner_name == "a test lab"
            assert views["small"].owner == str(peer_id_for(owner))

            # Every joiner's experts are announced (by the one announcer).
            hosted = sorted(running.runtime.uids)
            with trio.fail_after(30):
                while True:
                    found = await boot.dht.get(hosted)
                    me = running.node.peer_id
                    if all(any(r.peer_id == me for r in found[uid]) for uid in hosted):
                        break
                    await trio.sleep(0.5)

            # A re-balancing round of one project leaves the other's experts alone.
            await by_name["small"].rebalance()
            assert set(by_name["big"].hosted) <= set(running.runtime.uids)


async def test_a_project_that_cannot_be_joined_fails_alone(tmp_path: Path) -> None:
    owner = Identity.generate()
    async with open_peer(local_config()) as boot:
        await publish(boot, owner, "first", "aa")
        await publish(boot, owner, "twin", "aa")  # the same expert uids as "first"
        record(
            tmp_path,
            (invitation(boot, owner, "first"), 1.0),
            (invitation(boot, owner, "twin"), 1.0),
            (invitation(boot, owner, "ghost"), 1.0),  # never published
        )
        config = daemon_config(join_timeout_s=2.0)
        async with serving(config, tmp_path, Identity.generate()) as (_, running, _):
            by_name = {j.name: j for j in running.joiners}
            await until(lambda: by_name["ghost"].state == "failed")
            assert "not found" in (by_name["ghost"].error or "")
            # whichever of the two found its manifest second refuses to host the clash
            await until(
                lambda: {by_name["first"].state, by_name["twin"].state} == {"joined", "failed"}
            )
            failed = next(j for j in running.joiners if j.state == "failed" and j.name != "ghost")
            assert "another experiment" in (failed.error or "")
            assert failed.hosted == {}
            assert running.controls is not None
            views = {p.name: p for p in (await running.controls.status()).projects}
            assert views["ghost"].state == "failed"
            assert views["ghost"].error is not None


async def test_an_older_releases_projects_file_still_hosts_what_it_can(tmp_path: Path) -> None:
    """An older release recorded invitations whose peers today's checks refuse (a
    /dnsaddr/ bootstrap peer): the new daemon stopped at its start (exit 3), every
    project with it. Now the project joins through its usable peer, one with none is
    set aside (an error event says so) and leaving it needs no restart."""
    owner = Identity.generate()
    dnsaddr = f"/dnsaddr/boot.example.org/p2p/{peer_id_for(Identity.generate())}"
    async with open_peer(local_config()) as boot:
        await publish(boot, owner, "vmix", "aa")
        (tmp_path / "projects.toml").write_text(
            f'[[project]]\nname = "vmix"\nowner = "{peer_id_for(owner)}"\n'
            f'peers = ["{boot.multiaddrs[0]}", "{dnsaddr}"]\n'
            f'[[project]]\nname = "dead"\nowner = "{peer_id_for(owner)}"\n'
            f'peers = ["{dnsaddr}"]\n'
        )
        async with serving(daemon_config(), tmp_path, Identity.generate()) as (
            daemon,
            running,
            _,
        ):
            (joiner,) = running.joiners
            await until(lambda: joiner.state == "joined")
            assert running.controls is not None
            status = await running.controls.status()
            # the entry set aside is listed too (the dashboard and `projects --json` showed
            # only the error event), and it makes no "joining" state
            assert [(p.name, p.state) for p in status.projects] == [
                ("vmix", "joined"),
                ("dead", "not_hosted"),
            ]
            dead = status.projects[1]
            assert dead.error is not None
            assert "none of its peers" in dead.error
            assert "`volunteerd leave dead`" in dead.advice
            assert status.activity.state != "joining"
            said = [e.message for e in running.controls.events.after(-1) if e.kind == "error"]
            assert any("project dead is not hosted" in m for m in said), said
            left = await running.controls.leave_project("dead")
            assert left is not None
            assert not left.restarting  # it was not hosted
            assert not daemon.restart_requested
            assert [p.name for p in (await running.controls.status()).projects] == ["vmix"]
        assert [p.name for p in load_projects(tmp_path / "projects.toml")] == ["vmix"]


async def test_joining_and_leaving_through_the_api_restarts_the_daemon(tmp_path: Path) -> None:
    owner, me = Identity.generate(), Identity.generate()
    async with open_peer(local_config()) as boot:
        manifest = await publish(boot, owner, "tiny", "aa")
        invited = invitation(boot, owner, "tiny").url()
        config = daemon_config()

        # No project, no experts.uids: nothing hosted (no runtime at all).
        async with serving(config, tmp_path, me) as (daemon, running, returned):
            assert running.hosting is None
            assert running.controls is not None
            status = await running.controls.status()
            assert (status.projects, status.experts, status.device) == ([], [], "none")
            with pytest.raises(ConfigError, match="not a valid invitation"):
                await running.controls.join_project(ProjectJoin(invitation="volunteerd://x"))
            joined = await running.controls.join_project(ProjectJoin(invitation=invited))
            assert joined.restarting
            assert joined.project.state == "joining"
            with trio.fail_after(30):
                await returned.wait()
            assert daemon.restart_requested
        assert [p.name for p in load_projects(tmp_path / "projects.toml")] == ["tiny"]

        # Started again: in the project.
        async with serving(config, tmp_path, me) as (daemon, running, returned):
            assert running.hosting is not None
            (joiner,) = running.joiners
            await until(lambda: joiner.state == "joined")
            assert joiner.hosted
            assert set(joiner.hosted) <= set(manifest.uids())
            assert running.controls is not None
            again = await running.controls.join_project(ProjectJoin(invitation=invited))
            assert not again.restarting  # joined already, as asked: nothing to restart for
            assert again.project.state == "joined"
            assert await running.controls.leave_project("elsewhere") is None
            left = await running.controls.leave_project("tiny")
            assert left is not None
            assert left.restarting
            with trio.fail_after(30):
                await returned.wait()
            assert daemon.restart_requested
        assert load_projects(tmp_path / "projects.toml") == []

        # The config's own project cannot be left through the API.
        configured = daemon_config(boot.multiaddrs, join="tiny", trusted_owners=[manifest.owner])
        async with serving(configured, tmp_path, me) as (daemon, running, returned):
            assert running.controls is not None
            (view,) = (await running.controls.status()).projects
            assert view.state == "joined"
            with pytest.raises(ConfigError, match="config file"):
                await running.controls.leave_project("tiny")
            assert not daemon.restart_requested


async def test_a_daemon_follows_its_projects_manifest_until_it_expires(tmp_path: Path) -> None:
    """The owner's newer manifest (wider experts, a larger grid) is taken while the
    daemon runs, and an expired one is no longer hosted, saying why; so does a restart
    after it. The daemon read the manifest once: it served the old shapes under the new
    manifest's uids, hosted an expired one for as long as it ran, and after a restart
    said "not found: are the bootstrap peers right?" (an outside probe)."""
    owner, me = Identity.generate(), Identity.generate()
    config = daemon_config(manifest_check_every_s=1.0, join_timeout_s=3.0)

    async def publish_wide(boot: Node, hidden_dim: int, lifetime_s: float) -> ExperimentManifest:
        now = time.time()
        manifest = ExperimentManifest(
            name="upd",
            hidden_dim=hidden_dim,
            uid_prefix="aa",
            grid=(2, 2),
            replication=1,
            owner=str(peer_id_for(owner)),
            issued_at=now,
            expires_at=now + lifetime_s,
        )
        assert await boot.dht.put_manifest(sign_manifest(manifest, owner)) >= 1
        return manifest

    async with open_peer(local_config()) as boot:
        await publish_wide(boot, 16, 3600)
        record(tmp_path, (invitation(boot, owner, "upd"), 1.0))
        async with serving(config, tmp_path, me) as (_, running, _):
            (joiner,) = running.joiners
            await until(lambda: joiner.state == "joined" and bool(joiner.hosted))
            runtime = running.runtime
            assert runtime is not None

            def widths() -> set[int]:
                return {runtime.backend(uid).info.hidden_dim for uid in runtime.uids}

            assert widths() == {16}
            newer = await publish_wide(boot, 32, 15)
            await until(lambda: joiner.manifest == newer and bool(joiner.hosted), 30)
            assert widths() == {32}  # every uid re-seated in the new shape

            await until(lambda: joiner.state == "failed", 30)
            assert runtime.uids == []
            assert running.controls is not None
            status = await running.controls.status()
            (view,) = status.projects
            assert view.expired_at == newer.expires_at
            assert "manifest expired on" in (view.error or "")
            assert status.activity.message == f"could not join upd: {view.error}"
            assert "internet" not in status.activity.hint

        async with serving(config, tmp_path, me) as (_, running, _):
            (joiner,) = running.joiners
            await until(lambda: joiner.state == "failed", 30)
            assert joiner.error is not None
            assert joiner.error.startswith("the experiment's manifest expired on ")


async def test_a_daemon_that_left_its_projects_trims_the_checkpoints_they_left(
    tmp_path: Path,
) -> None:
    """A daemon hosting nothing (its projects left) runs no checkpointer: at its start it
    keeps the newest checkpoint of the experts saved last and deletes the rest."""
    import torch

    from volunteerd.checkpoint_folders import OTHERS_KEPT
    from volunteerd.config import ExpertsConfig
    from volunteerd.experts import ExpertBackend
    from volunteerd.experts.checkpoint_file import CheckpointStore

    store = CheckpointStore(tmp_path / "checkpoints")
    gone = [f"ffn.9.{n}" for n in range(OTHERS_KEPT + 2)]
    for n, uid in enumerate(gone):
        state = ExpertBackend(uid, ExpertsConfig(hidden_dim=8), torch.device("cpu"), 64).state()
        for _ in range(2):
            path = store.save(state)
            os.utime(path, (time.time() - 3600 + n,) * 2)
    async with serving(daemon_config(), tmp_path, Identity.generate()) as (_, running, _):
        assert running.hosting is None
        kept = [len(store.files(uid)) for uid in gone]
    assert kept == [0, 0] + [1] * OTHERS_KEPT


async def test_publishing_from_a_computer_whose_clock_is_fast_says_to_check_the_clock(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Every peer refuses a manifest issued more than 30 s ahead of its clock: an owner
    whose clock was 2 h fast read only "no peer stored the manifest", as if the network
    had failed."""
    import types

    from volunteerd.errors import ResourceUnavailable
    from volunteerd.swarm import manifest as manifest_module
    from volunteerd.swarm.publish import publish_manifest

    path = tmp_path / "experiment.toml"
    path.write_text(
        'name = "fast"\ndescription = "a test"\nowner_name = "a lab"\nhidden_dim = 16\n'
        'uid_prefix = "ffn"\ngrid = [2, 2]\nreplication = 1\nlifetime_days = 1\n'
    )
    async with open_peer(local_config()) as boot:
        config = local_config(bootstrap=boot.multiaddrs)
        fast = types.SimpleNamespace(time=lambda: time.time() + 7200)
        monkeypatch.setattr(manifest_module, "time", fast)
        with pytest.raises(ResourceUnavailable, match="is this computer's clock right"):
            await publish_manifest(config, Identity.generate(), path)
        monkeypatch.setattr(manifest_module, "time", time)
        published = await publish_manifest(config, Identity.generate(), path)
        assert published.acks >= 1
