"""The dashboard's replica counts are looked up only while a client asks for the
experts, and never while network use is not allowed: a daemon nobody looked at, paused
by its volunteer, looked its experts up every 30 s all day (an outside audit). In
virtual time."""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path

import trio

from volunteerd.config import LimitsConfig, StatsConfig
from volunteerd.control.events import EventLog
from volunteerd.net.throttle import Throttle
from volunteerd.server.contribution import Accountant
from volunteerd.server.control_view import ControlView
from volunteerd.stats import StatsStore


class _Record:
    def __init__(self, peer_id: str) -> None:
        self.peer_id = peer_id


class _DHT:
    def __init__(self) -> None:
        self.lookups = 0

    async def get(self, keys: Sequence[str]) -> dict[str, list[_Record]]:
        self.lookups += 1
        return {key: [_Record("other"), _Record("me")] for key in keys}


class _Node:
    peer_id = "me"

    def __init__(self) -> None:
        self.dht = _DHT()


class _Runtime:
    uids = ["ffn.0.0", "ffn.0.1"]

    def statistics(self) -> list[object]:
        return []


class _Volunteer:
    network_allowed = True


def _view(node: _Node, volunteer: _Volunteer, tmp_path: Path) -> ControlView:
    accountant = Accountant(
        StatsStore.open(Path(":memory:")),
        None,
        Throttle(LimitsConfig()),
        StatsConfig(),
        serving=lambda: True,
    )
    return ControlView(
        node=node,  # type: ignore[arg-type]
        runtime=_Runtime(),  # type: ignore[arg-type]
        volunteer=volunteer,  # type: ignore[arg-type]
        checkpointer=None,
        accountant=accountant,
        projects=(),
        joiners=[],
        projects_file=tmp_path / "projects.toml",
        request_stop=lambda: None,
        request_restart=lambda: None,
        events=EventLog(),
    )


async def test_replicas_are_counted_only_while_a_client_asks(
    tmp_path: Path, autojump_clock: trio.abc.Clock
) -> None:
    node, volunteer = _Node(), _Volunteer()
    view = _view(node, volunteer, tmp_path)
    async with trio.open_nursery() as nursery:
        await nursery.start(view.serve)
        await trio.sleep(3600)  # an hour with no dashboard open
        assert node.dht.lookups == 0
        view.experts()  # the dashboard opens: counted at once
        await trio.sleep(1)
        assert node.dht.lookups == 1
        assert view._replicas == {"ffn.0.0": 1, "ffn.0.1": 1}
        await trio.sleep(3600)  # closed again: counted for five minutes more at most
        assert 2 <= node.dht.lookups <= 12
        nursery.cancel_scope.cancel()


async def test_replicas_are_not_counted_while_network_use_is_not_allowed(
    tmp_path: Path, autojump_clock: trio.abc.Clock
) -> None:
    node, volunteer = _Node(), _Volunteer()
    volunteer.network_allowed = False  # paused, outside the network hours, quota used
    view = _view(node, volunteer, tmp_path)
    async with trio.open_nursery() as nursery:
        await nursery.start(view.serve)
        for _ in range(60):  # a dashboard open for ten minutes
            view.experts()
            await trio.sleep(10)
        assert node.dht.lookups == 0
        volunteer.network_allowed = True  # resumed
        view.experts()
        await trio.sleep(31)
        assert node.dht.lookups >= 1
        nursery.cancel_scope.cancel()
