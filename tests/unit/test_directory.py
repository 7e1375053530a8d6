"""The trainer's expert directory: cache, bans, and not believing a sudden empty answer."""

from __future__ import annotations

from collections.abc import Sequence

import trio
import trio.testing

from volunteerd.identity import Identity
from volunteerd.moe import ExpertDirectory
from volunteerd.moe import directory as directory_module
from volunteerd.moe.directory import BAN_MEMORY_S, RELAY_HOLD_S
from volunteerd.net import ExpertRecord, PeerAddress, peer_id_for
from volunteerd.net.records import sign_record


class FakeDHT:
    def __init__(self) -> None:
        self.answers: dict[str, list[ExpertRecord]] = {}
        self.calls = 0

    async def get(self, keys: Sequence[str]) -> dict[str, list[ExpertRecord]]:
        self.calls += 1
        return {k: list(self.answers.get(k, [])) for k in keys}


class Clock:
    def __init__(self) -> None:
        self.now = 1000.0

    def __call__(self) -> float:
        return self.now


def record(identity: Identity, key: str, children: list[int]) -> ExpertRecord:
    return sign_record(
        identity, str(peer_id_for(identity)), key=key, addrs=["/ip4/127.0.0.1/tcp/1"],
        children=children, ttl_s=60,
    )  # fmt: skip


async def test_an_empty_refresh_right_after_servers_answered_is_not_believed() -> None:
    server = Identity.generate()
    dht, clock = FakeDHT(), Clock()
    directory = ExpertDirectory(dht, refresh_s=5.0, clock=clock)  # type: ignore[arg-type]
    dht.answers["ffn."] = [record(server, "ffn.", [0, 1])]
    assert set((await directory.children(["ffn."]))["ffn."]) == {0, 1}

    dht.answers["ffn."] = []  # a lookup that found nobody
    await directory._fetch(["ffn."])
    assert set((await directory.children(["ffn."]))["ffn."]) == {0, 1}
    assert directory.empty_answers == 1

    clock.now += 16.0  # the last real answer is stale now: nobody it is
    assert (await directory.children(["ffn."]))["ffn."] == {}

    directory.ban(str(peer_id_for(server)), "timeout: test")
    dht.answers["ffn."] = [record(server, "ffn.", [0])]
    clock.now += 16.0
    assert (await directory.children(["ffn."]))["ffn."] == {}  # banned
    assert directory.ban_reasons["timeout"] == 1


async def test_a_short_refresh_keeps_servers_listed_moments_ago() -> None:
    """A lookup that reaches only some storing nodes lists only some servers: the others
    stay offered until they have been missing for three refresh periods."""
    kept, listed = Identity.generate(), Identity.generate()
    dht, clock = FakeDHT(), Clock()
    directory = ExpertDirectory(dht, refresh_s=5.0, clock=clock)  # type: ignore[arg-type]
    dht.answers["ffn."] = [record(kept, "ffn.", [0, 1]), record(listed, "ffn.", [1])]
    await directory.children(["ffn."])

    dht.answers["ffn."] = [record(listed, "ffn.", [1])]  # a short answer
    clock.now += 6.0
    await directory._fetch(["ffn."])
    children = (await directory.children(["ffn."]))["ffn."]
    assert [p.peer_id for p in children[0]] == [str(peer_id_for(kept))]
    assert {p.peer_id for p in children[1]} == {str(peer_id_for(kept)), str(peer_id_for(listed))}

    clock.now += 10.0  # missing for 16 s since it was last listed: gone
    await directory._fetch(["ffn."])
    children = (await directory.children(["ffn."]))["ffn."]
    assert 0 not in children
    assert [p.peer_id for p in children[1]] == [str(peer_id_for(listed))]


def flood(honest: list[Identity], junk: int, key: str = "ffn.0.") -> list[ExpertRecord]:
    """What a storing node answers: the writers it has seen longest (honest) first."""
    records = [record(i, key, [0, 1]) for i in honest]
    return records + [record(Identity.generate(), key, [0, 1]) for _ in range(junk)]


class Verifier:
    """Answers for the honest peers only; counts every dial."""

    def __init__(self, honest: list[Identity]) -> None:
        self.honest = {str(peer_id_for(i)) for i in honest}
        self.asked: list[str] = []

    async def __call__(self, peer: PeerAddress, uid: str) -> bool:
        self.asked.append(peer.peer_id)
        await trio.sleep(0.01)
        return peer.peer_id in self.honest


async def test_only_peers_that_answered_are_offered_and_junk_costs_a_few_dials() -> None:
    honest = [Identity.generate() for _ in range(2)]
    dht, verify = FakeDHT(), Verifier(honest)
    dht.answers["ffn.0."] = flood(honest, junk=1000)
    directory = ExpertDirectory(dht, verify=verify, max_verifying=4)  # type: ignore[arg-type]
    async with trio.open_nursery() as nursery:
        await nursery.start(directory.serve)
        children = (await directory.children(["ffn.0."]))["ffn.0."]
        assert {c: {p.peer_id for p in peers} for c, peers in children.items()} == {
            0: verify.honest,
            1: verify.honest,
        }
        # Verified peers are enough: the thousand others were never dialled.
        await directory.children(["ffn.0."])
        assert len(verify.asked) <= 4
        nursery.cancel_scope.cancel()


async def test_junk_listed_first_is_tried_a_few_at_a_time_and_not_again() -> None:
    honest = [Identity.generate()]
    dht, verify = FakeDHT(), Verifier(honest)
    junk = flood([], junk=50)
    dht.answers["ffn.0."] = junk[:10] + flood(honest, junk=0) + junk[10:]
    clock = Clock()
    directory = ExpertDirectory(dht, verify=verify, ban_s=60.0, clock=clock)  # type: ignore[arg-type]
    async with trio.open_nursery() as nursery:
        await nursery.start(directory.serve)
        for _ in range(5):  # each step tries the next few candidates
            children = (await directory.children(["ffn.0."]))["ffn.0."]
            if children:
                break
        assert {p.peer_id for p in children[0]} == verify.honest
        asked = len(verify.asked)
        assert asked <= 11 + 4, "at most a few candidates beyond the honest one"
        assert len(set(verify.asked)) == asked, "nobody is asked twice within ban_s"
        await directory.children(["ffn.0."])
        assert len(verify.asked) == asked
        assert directory.verifications["failed"] >= 10
        nursery.cancel_scope.cancel()


def test_a_peer_banned_again_is_banned_longer_until_it_behaves_for_a_day() -> None:
    # One that misbehaved, waited its ban out and misbehaved again cost a ban's worth
    # of steps every time, for good.
    clock = Clock()
    directory = ExpertDirectory(FakeDHT(), ban_s=60.0, clock=clock)  # type: ignore[arg-type]

    lengths = []
    for _ in range(9):
        start = clock.now
        directory.ban("peer", "timeout: test")
        directory.ban("peer", "timeout: test")  # more failures of the same moment
        lengths.append(directory.banned["peer"] - start)
        clock.now = directory.banned["peer"]
        assert not directory.is_banned("peer")
    assert lengths == [60.0 * f for f in (1, 2, 4, 8, 16, 32, 64, 64, 64)]
    assert directory.ban_reasons["timeout"] == 9

    directory.ban("peer", "late 8 times in a row: x", 10.0)  # its own length, grown too
    assert directory.banned["peer"] - clock.now == 640.0
    clock.now = directory.banned["peer"] + BAN_MEMORY_S + 1  # a day without a ban
    directory.ban("peer", "timeout: test")
    assert directory.banned["peer"] - clock.now == 60.0
    directory.ban("other", "timeout: test")  # another peer starts from the ban asked for
    assert directory.banned["other"] - clock.now == 60.0


async def test_a_relayed_peer_whose_relay_failed_is_held_off_that_relay_not_banned() -> None:
    """A call that could not get through a volunteer's relays: its circuits through them
    are left out for RELAY_HOLD_S, never longer on a repeat; a circuit through another
    relay it announces is offered at once, and the peer is never banned for it."""
    server = Identity.generate()
    relay_a, relay_b = (str(peer_id_for(Identity.generate())) for _ in range(2))
    via_a = f"/ip4/127.0.0.1/tcp/1/p2p/{relay_a}/p2p-circuit"
    via_b = f"/ip4/127.0.0.1/tcp/2/p2p/{relay_b}/p2p-circuit"
    dht, clock = FakeDHT(), Clock()
    directory = ExpertDirectory(dht, refresh_s=5.0, clock=clock)  # type: ignore[arg-type]

    def announce(*addrs: str) -> None:
        signed = sign_record(
            server, str(peer_id_for(server)), key="ffn.", addrs=list(addrs),
            children=[0], ttl_s=60,
        )  # fmt: skip
        dht.answers["ffn."] = [signed]

    announce(via_a, via_b)
    peer = (await directory.children(["ffn."]))["ffn."][0][0]
    for _ in range(3):  # flaky relay: the same hold each time
        assert directory.relay_failed(PeerAddress(peer.peer_id, (via_a,)), "unreachable: x")
        offered = (await directory.children(["ffn."]))["ffn."]
        assert offered == {0: [PeerAddress(peer.peer_id, (via_b,))]}
        clock.now += RELAY_HOLD_S
    assert not directory.is_banned(peer.peer_id)
    assert (await directory.children(["ffn."]))["ffn."] == {0: [peer]}

    # Both relays failed: the peer is left out for RELAY_HOLD_S ...
    assert directory.relay_failed(peer, "unreachable: x")
    assert (await directory.children(["ffn."]))["ffn."] == {}
    clock.now += RELAY_HOLD_S
    assert (await directory.children(["ffn."]))["ffn."] == {0: [peer]}
    # ... but its records are looked up again at once: the relay it moved to is offered.
    assert directory.relay_failed(peer, "unreachable: x")
    via_c = f"/ip4/127.0.0.1/tcp/3/p2p/{peer_id_for(Identity.generate())}/p2p-circuit"
    announce(via_c)
    assert (await directory.children(["ffn."]))["ffn."] == {
        0: [PeerAddress(peer.peer_id, (via_c,))]
    }
    assert not directory.is_banned(peer.peer_id)
    # A peer with a direct address is the caller's to judge.
    assert not directory.relay_failed(PeerAddress(peer.peer_id, ("/ip4/1.2.3.4/tcp/5",)), "x")


def test_a_peer_that_could_not_be_dialled_is_not_banned_longer_each_time() -> None:
    """An honest volunteer that restarted (down ~45 s, once every three hours) failed a
    call each time. Grown like a liar's, its bans kept it unused for 15 s after it was
    back the first time, 64 min from the seventh restart on (outside probe
    ban_escalation); a fresh identity escaped them. A liar's bans still grow."""
    clock = Clock()
    directory = ExpertDirectory(FakeDHT(), ban_s=60.0, clock=clock)  # type: ignore[arg-type]
    lengths = []
    for _ in range(8):
        clock.now += 3 * 3600.0
        directory._issued["peer"] = clock.now - 60.0  # it announced itself as it restarted
        start = clock.now
        directory.ban("peer", "unreachable: ffn.0: no addresses established a connection")
        directory.ban("peer", "unreachable: ffn.1: no addresses established a connection")
        lengths.append(directory.banned["peer"] - start)
    assert lengths == [60.0] * 8
    assert directory.ban_reasons["unreachable"] == 8

    clock.now += 3 * 3600.0
    directory.ban("peer", "timeout: test")  # its first offence: unreachable was none
    assert directory.banned["peer"] - clock.now == 60.0
    clock.now = directory.banned["peer"]
    directory.ban("peer", "timeout: test")
    assert directory.banned["peer"] - clock.now == 120.0


def test_a_peer_dialled_in_vain_again_without_announcing_itself_anew_is_banned_longer() -> None:
    """One that answers ``info`` but whose calls cannot dial it, and never signs a newer
    record: no restart. Its bans grow (a re-check: a ban that never grew cost a step's
    failed call every ~70 s, for good)."""
    clock = Clock()
    directory = ExpertDirectory(FakeDHT(), ban_s=60.0, clock=clock)  # type: ignore[arg-type]
    directory._issued["peer"] = clock.now
    lengths = []
    for _ in range(5):
        start = clock.now
        directory.ban("peer", "unreachable: ffn.0: no addresses established a connection")
        lengths.append(directory.banned["peer"] - start)
        clock.now = directory.banned["peer"] + 10.0  # verified again, chosen, dialled in vain
    # the second ban is its first offence as one; from then on they grow
    assert lengths == [60.0, 60.0, 120.0, 240.0, 480.0]


def signed_at(identity: Identity, issued_at: float) -> ExpertRecord:
    return sign_record(
        identity, str(peer_id_for(identity)), key="ffn.", addrs=["/ip4/127.0.0.1/tcp/1"],
        children=[0], ttl_s=60, now=issued_at,
    )  # fmt: skip


async def settle() -> None:
    """Until the directory's background verifications are done."""
    await trio.testing.wait_all_tasks_blocked(cushion=0.05)


def one_server() -> tuple[Identity, str, FakeDHT, Clock, Verifier, ExpertDirectory]:
    """A directory (``ban_s`` 60 s, verifying) and the one honest server it will find."""
    server = Identity.generate()
    dht, clock, verify = FakeDHT(), Clock(), Verifier([server])
    directory = ExpertDirectory(
        dht, refresh_s=1000.0, ban_s=60.0, verify=verify, clock=clock,  # type: ignore[arg-type]
    )  # fmt: skip
    return server, str(peer_id_for(server)), dht, clock, verify, directory


async def test_a_peer_that_could_not_be_dialled_is_chosen_again_once_it_is_back() -> None:
    """Banned as unreachable when its call failed (it restarted): a record it signed
    since, and an ``info`` answer, end the ban before ``ban_s``. Records it signed
    before (the DHT still holds them) are no sign of it."""
    server, pid, dht, clock, verify, directory = one_server()
    issued = 1_800_000_000.0
    dht.answers["ffn."] = [signed_at(server, issued)]
    async with trio.open_nursery() as nursery:
        await nursery.start(directory.serve)
        assert [p.peer_id for p in (await directory.children(["ffn."]))["ffn."][0]] == [pid]
        directory.ban(pid, "unreachable: ffn.0: no addresses established a connection")
        asked = len(verify.asked)

        clock.now += 10.0
        await directory._fetch(["ffn."])  # the old record again
        assert (await directory.children(["ffn."]))["ffn."] == {}
        await settle()
        assert len(verify.asked) == asked  # not dialled while banned

        dht.answers["ffn."] = [signed_at(server, issued + 50.0)]  # it is back, announcing
        await directory._fetch(["ffn."])
        await directory.children(["ffn."])
        await settle()
        assert [p.peer_id for p in (await directory.children(["ffn."]))["ffn."][0]] == [pid]
        assert not directory.is_banned(pid)
        assert len(verify.asked) == asked + 1

        # Again within the hour (or a peer that answers info and refuses calls): it
        # waits its ban out, then answers info before it is chosen.
        clock.now += 60.0
        directory.ban(pid, "unreachable: ffn.0: no addresses established a connection")
        dht.answers["ffn."] = [signed_at(server, issued + 120.0)]
        await directory._fetch(["ffn."])
        await directory.children(["ffn."])
        await settle()
        assert directory.is_banned(pid)
        clock.now += 60.0
        await directory.children(["ffn."])
        await settle()
        assert [p.peer_id for p in (await directory.children(["ffn."]))["ffn."][0]] == [pid]
        assert len(verify.asked) == asked + 2

        clock.now += directory_module.EARLY_RETURN_EVERY_S  # an hour on: let back early again
        directory.ban(pid, "unreachable: ffn.0: no addresses established a connection")
        dht.answers["ffn."] = [signed_at(server, issued + 4000.0)]
        await directory._fetch(["ffn."])
        await directory.children(["ffn."])
        await settle()
        assert not directory.is_banned(pid)
        nursery.cancel_scope.cancel()


async def test_a_dead_address_is_dialled_in_the_background_once_per_ban_not_by_steps() -> None:
    """After a ban as unreachable, a peer is offered again only once it has answered
    ``info``: a record pointing at a dead address costs one background dial per
    ``ban_s``, and no step calls it."""
    server, pid, dht, clock, verify, directory = one_server()
    dht.answers["ffn."] = [signed_at(server, 1_800_000_000.0)]
    async with trio.open_nursery() as nursery:
        await nursery.start(directory.serve)
        await directory.children(["ffn."])
        directory.ban(pid, "unreachable: ffn.0: no addresses established a connection")
        verify.honest.clear()  # gone for good
        asked = len(verify.asked)
        for _ in range(3):
            clock.now += 61.0
            await directory.children(["ffn."])
            await settle()
            assert (await directory.children(["ffn."]))["ffn."] == {}
            clock.now += 30.0
            await directory.children(["ffn."])
            await settle()
            clock.now -= 30.0
        assert len(verify.asked) == asked + 3

        verify.honest.add(pid)  # back at the same address
        clock.now += 61.0
        await directory.children(["ffn."])
        await settle()
        assert [p.peer_id for p in (await directory.children(["ffn."]))["ffn."][0]] == [pid]
        nursery.cancel_scope.cancel()


async def test_a_peer_banned_for_more_than_a_failed_dial_is_not_let_back_early() -> None:
    """Unreachable, then a bad answer of the same moment: that ban is a liar's; a fresh
    record and an ``info`` answer do not end it."""
    server, pid, dht, clock, _, directory = one_server()
    dht.answers["ffn."] = [signed_at(server, 1_800_000_000.0)]
    async with trio.open_nursery() as nursery:
        await nursery.start(directory.serve)
        await directory.children(["ffn."])
        directory.ban(pid, "unreachable: ffn.0: no addresses established a connection")
        directory.ban(pid, "bad_shape: ffn.0", 600.0)
        assert directory.banned[pid] - clock.now == 600.0
        dht.answers["ffn."] = [signed_at(server, 1_800_000_100.0)]
        await directory._fetch(["ffn."])
        await directory.children(["ffn."])
        await settle()
        assert directory.is_banned(pid)
        assert (await directory.children(["ffn."]))["ffn."] == {}
        nursery.cancel_scope.cancel()
