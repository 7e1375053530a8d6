"""Over libp2p: two daemons started from copies of one data folder (one identity.key)
each tell the volunteer that another daemon uses their identity, with its address (a
warning, an error event, ``Status.identity_clash``); a daemon restarted at another
port, its previous run's records still in the DHT, tells nothing."""

from __future__ import annotations

import logging
import time
from pathlib import Path

import pytest
import trio

from volunteerd.control.verbs import format_status
from volunteerd.daemon import Running
from volunteerd.identity import Identity
from volunteerd.net.records import sign_record
from volunteerd.testing import local_config, open_daemon, open_peer

pytestmark = pytest.mark.slow

# Records issued this long after a daemon's start can be a copy's (the margin for a
# previous run's clock): short, for a short test.
SKEW_S = 2.0
SAID = "another daemon uses this identity (identity.key)"


def told(running: Running) -> list[str]:
    return [
        e.message
        for e in running.controls.events.after(-1)
        if e.kind == "error" and SAID in e.message
    ]


async def test_copies_of_one_identity_each_tell_the_volunteer(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    identity = Identity.generate()  # what copying the data folder copies
    async with open_peer(local_config()) as boot:

        def config(uids: str):  # type: ignore[no-untyped-def]
            return local_config(
                bootstrap=boot.multiaddrs,
                uids=uids,
                dht={"max_clock_skew_s": SKEW_S},
                replicas={"enabled": False},
            )

        with caplog.at_level(logging.WARNING, logger="volunteerd.net.clones"):
            async with (
                open_daemon(config("ffn.0.[0:2]"), tmp_path / "a", identity) as a,
                open_daemon(config("ffn.1.[0:2]"), tmp_path / "b", identity) as b,
            ):
                with trio.fail_after(60):
                    while not (told(a) and told(b)):  # noqa: ASYNC110
                        await trio.sleep(0.2)
                port_a, port_b = (str(d.node.multiaddrs[0]).split("/")[4] for d in (a, b))
                assert f"/tcp/{port_b}" in told(a)[0]  # the other copy's address
                assert f"/tcp/{port_a}" in told(b)[0]
                status = await a.controls.status()
                assert status.identity_clash == told(a)[0]
                assert f"warning       {told(a)[0]}" in format_status(status)
                await trio.sleep(3)
                assert len(told(a)) == len(told(b)) == 1  # once, then at most hourly
        assert sum(SAID in r.getMessage() for r in caplog.records) == 2


async def test_a_daemon_restarted_at_another_port_is_not_its_own_copy(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    identity = Identity.generate()
    async with open_peer(local_config()) as boot:
        config = local_config(
            bootstrap=boot.multiaddrs,
            uids="ffn.0.[0:2]",
            # its records outlive its first run by far
            dht={"max_clock_skew_s": SKEW_S, "record_ttl_s": 60.0},
            replicas={"enabled": False},
        )
        with caplog.at_level(logging.WARNING, logger="volunteerd.net.clones"):
            async with open_daemon(config, tmp_path / "a", identity) as first:
                await trio.sleep(2 * SKEW_S + 1)  # records issued well after its start
                port = first.node.multiaddrs[0]
                keys = ["ffn.", "ffn.0.", "ffn.0.0", "ffn.0.1"]
                old = [r for rs in (await boot.dht.get(keys)).values() for r in rs]
                assert {r.key for r in old} == set(keys)
            async with open_daemon(config, tmp_path / "a", identity) as again:
                assert again.node.multiaddrs[0] != port
                await trio.sleep(2 * SKEW_S + 3)  # announced and looked for copies
                # a holder not reached by this run's announcements gives the old ones
                again.node.dht.clones.check(old)
                await again.node.dht.get(keys)
                assert told(again) == []
                assert (await again.controls.status()).identity_clash is None
        assert not any(SAID in r.getMessage() for r in caplog.records)


async def test_a_strangers_forgery_under_this_nodes_id_is_no_copy(tmp_path: Path) -> None:
    """A storing peer that adds to every find answer a record under the node's peer id,
    signed with another key and issued in the future, made it warn of a copy at an
    address of the stranger's choosing within 0.2 s (a re-check): find answers are not
    validated as a whole, and the read-back and the copy check took them as they came."""
    stranger = Identity.generate()
    async with open_peer(local_config()) as evil:
        honest_ranked = evil.dht.records.ranked
        victim: list[str] = []
        forged_answers = 0

        def ranked(key, writer=None):  # type: ignore[no-untyped-def]
            nonlocal forged_answers
            found = list(honest_ranked(key, writer))
            if not victim:
                return found
            forged_answers += 1
            forgery = sign_record(
                stranger,
                victim[0],
                key=key,
                addrs=["/ip4/6.6.6.6/tcp/4001"],
                children=[0],
                ttl_s=5.0,
                now=time.time() + 60,
            )
            return [forgery, *(r for r in found if r.peer_id != victim[0])]

        evil.dht.records.ranked = ranked  # type: ignore[method-assign]
        config = local_config(
            bootstrap=evil.multiaddrs, uids="ffn.0.[0:2]", replicas={"enabled": False}
        )
        async with open_daemon(config, tmp_path / "victim") as running:
            victim.append(str(running.node.peer_id))
            with trio.fail_after(60):
                while forged_answers < 3:  # noqa: ASYNC110 (its read-backs and lookups)
                    await trio.sleep(0.2)
            await trio.sleep(1)
            assert told(running) == []
            assert (await running.controls.status()).identity_clash is None
