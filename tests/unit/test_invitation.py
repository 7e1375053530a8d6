"""Invitations: what `publish` prints round-trips through `join`, and anything else a
volunteer might paste (truncated, wrapped, retyped, hostile) is refused with a message
that says what is wrong."""

from __future__ import annotations

import random
from dataclasses import replace

import pytest

from volunteerd.errors import ConfigError
from volunteerd.identity import Identity
from volunteerd.net.peers import parse_peer_multiaddr, peer_id_for
from volunteerd.swarm.invitation import (
    MAX_INVITATION_LENGTH,
    MAX_PEERS,
    PREFIX,
    Invitation,
    parse_invitation,
)
from volunteerd.swarm.manifest import ExperimentManifest
from volunteerd.swarm.publish import make_invitation

# Fixed keys: the ids below name parametrized tests, which must be the same in every
# process that collects them (pytest-xdist's workers compare their lists).
OWNER = str(peer_id_for(Identity(bytes([1]) * 32)))
BOOT = str(peer_id_for(Identity(bytes([2]) * 32)))
PEER = f"/ip4/203.0.113.7/tcp/38400/p2p/{BOOT}"
PEER2 = f"/dns4/boot.example.org/tcp/38400/p2p/{BOOT}"
INVITATION = Invitation(name="stdlib-chars", owner=OWNER, peers=(PEER, PEER2))


def refused(text: str, *words: str) -> str:
    with pytest.raises(ConfigError) as info:
        parse_invitation(text)
    message = str(info.value)
    assert message.startswith("not a valid invitation")
    for word in words:
        assert word in message, message
    # A hostile input never comes back whole in the message (a terminal or log line).
    assert "\n" not in message
    assert len(message) < 400
    return message


def test_url_round_trips_with_percent_encoded_multiaddrs() -> None:
    url = INVITATION.url()
    assert url.startswith(f"{PREFIX}stdlib-chars?owner={OWNER}&peer=%2Fip4%2F203.0.113.7")
    assert "\n" not in url
    assert " " not in url
    assert parse_invitation(url) == INVITATION
    assert str(INVITATION) == url


def test_surrounding_whitespace_of_a_paste_is_ignored() -> None:
    assert parse_invitation(f"  \n{INVITATION.url()}\r\n\t") == INVITATION


def test_unencoded_multiaddrs_are_accepted_too() -> None:
    text = f"{PREFIX}stdlib-chars?peer={PEER}&owner={OWNER}"
    assert parse_invitation(text) == Invitation("stdlib-chars", OWNER, (PEER,))


def test_the_order_of_peers_is_kept() -> None:
    other = f"/ip4/198.51.100.1/tcp/1/p2p/{OWNER}"
    parsed = parse_invitation(replace(INVITATION, peers=(other, PEER)).url())
    assert parsed.peers == (other, PEER)


def test_eight_peers_are_accepted_and_nine_refused() -> None:
    peers = tuple(f"/ip4/198.51.100.{i}/tcp/38400/p2p/{BOOT}" for i in range(MAX_PEERS + 1))
    eight = Invitation("x", OWNER, peers[:MAX_PEERS])
    assert parse_invitation(eight.url()) == eight
    nine = eight.url() + f"&peer={peers[-1]}"
    refused(nine, "at most 8")
    refused(nine + f"&peer={PEER}&peer={PEER2}", "more than 8")
    with pytest.raises(ConfigError, match="at most 8"):
        Invitation("x", OWNER, peers)


@pytest.mark.parametrize(
    ("text", "words"),
    [
        ("", ("empty",)),
        ("   \n ", ("empty",)),
        ("https://join/x?owner=a", ("does not start with",)),
        ("VOLUNTEERD://JOIN/x", ("does not start with",)),
        ("volunteerd://leave/x?owner=a", ("does not start with",)),
        ("volunteerd:/join/x", ("does not start with",)),
        (f"{PREFIX}", ("experiment name",)),
        (f"{PREFIX}Stdlib?owner={OWNER}&peer={PEER}", ("experiment name", "'Stdlib'")),
        (f"{PREFIX}a/b?owner={OWNER}&peer={PEER}", ("experiment name",)),
        (f"{PREFIX}%41b?owner={OWNER}&peer={PEER}", ("experiment name",)),
        (f"{PREFIX}{'a' * 65}?owner={OWNER}&peer={PEER}", ("experiment name",)),
        (f"{PREFIX}x", ("no owner and no peer",)),
        (f"{PREFIX}x?", ("no owner and no peer",)),
        (f"{PREFIX}x?peer={PEER}", ("no owner",)),
        (f"{PREFIX}x?owner=&peer={PEER}", ("no owner",)),
        (f"{PREFIX}x?owner={OWNER}", ("no peer",)),
        (f"{PREFIX}x?owner={OWNER}&owner={OWNER}&peer={PEER}", ("more than once",)),
        (f"{PREFIX}x?owner={OWNER}&owner={BOOT}&peer={PEER}", ("more than once",)),
        (f"{PREFIX}x?owner={OWNER}&peer={PEER}&trust=all", ("unknown key", "'trust'")),
        (f"{PREFIX}x?owner={OWNER}&Peer={PEER}", ("unknown key",)),
        (f"{PREFIX}x?owner={OWNER}&peer={PEER}&", ("malformed",)),
        (f"{PREFIX}x?owner={OWNER}&&peer={PEER}", ("malformed",)),
        (f"{PREFIX}x?owner={OWNER}&peer", ("malformed",)),
        (f"{PREFIX}x?owner={OWNER}&peer=%ff%fe", ("malformed",)),
        (f"{PREFIX}x?owner={OWNER}&peer={PEER}#frag", ("fragment",)),
        (f"{PREFIX}x?owner=Qm{OWNER[2:]}&peer={PEER}", ("owner", "Ed25519")),
        (f"{PREFIX}x?owner={OWNER[:-4]}&peer={PEER}", ("owner", "Ed25519")),
        (f"{PREFIX}x?owner=QmYyQSo1c1Ym7orWxLYvCrM2EmxFTANf8wXmmE7DWjhx5N&peer={PEER}", ("owner",)),
        (f"{PREFIX}x?owner=0OIl&peer={PEER}", ("owner",)),
        (f"{PREFIX}x?owner={OWNER}%0Afake&peer={PEER}", ("owner",)),
        (f"{PREFIX}x?owner={OWNER}&peer=/ip4/203.0.113.7/tcp/38400", ("/p2p/",)),
        (f"{PREFIX}x?owner={OWNER}&peer=/ip4/1.2.3.999/tcp/1/p2p/{BOOT}", ("valid multiaddr",)),
        (f"{PREFIX}x?owner={OWNER}&peer=/ip4/1.2.3.4/tcp/1/p2p/{BOOT[:-3]}", ("valid multiaddr",)),
        (f"{PREFIX}x?owner={OWNER}&peer=/p2p/{BOOT}", ("transport address",)),
        # a socket path takes in the /p2p/ part: it escaped as multiaddr's own error
        (f"{PREFIX}x?owner={OWNER}&peer=/unix/a/p2p/{BOOT}", ("valid multiaddr",)),
        (f"{PREFIX}x?owner={OWNER}&peer=%2Funix%2Fa%2Fp2p%2F{BOOT}", ("valid multiaddr",)),
        (f"{PREFIX}x?owner={OWNER}&peer={PEER[:-40]}", ("cut short",)),
        (
            f"{PREFIX}x?owner={OWNER}&peer=/ip4/1.2.3.4/tcp/1/p2p/QmYyQSo1c1Ym7orWxLYvCrM2EmxFTANf8wXmmE7DWjhx5N",
            ("Ed25519",),
        ),
        (f"{PREFIX}x?owner={OWNER}&peer={PEER}/tcp/1", ("ending in /p2p/",)),
        (f"{PREFIX}x?owner={OWNER}&peer={PEER}/p2p-circuit", ("direct address",)),
        (f"{PREFIX}x?owner={OWNER}&peer={PEER}/p2p/{OWNER}", ("direct address",)),
        (f"{PREFIX}x?owner={OWNER}&peer=ip4/1.2.3.4/tcp/1/p2p/{BOOT}", ("not a multiaddr",)),
        (f"{PREFIX}x?owner={OWNER}&peer={PEER}%0A{PEER}", ("not a multiaddr",)),
        (f"{PREFIX}x?owner={OWNER}&peer=%2Fip4%2F1.2.3.4+%2Ftcp%2F1", ("not a multiaddr",)),
        (f"{PREFIX}x?owner={OWNER}&peer={PEER}&peer={PEER}", ("listed twice",)),
        (f"{PREFIX}x?owner={OWNER}&peer=/ip4/1.2.3.4/tcp/{'1' * 200}/p2p/{BOOT}", ("longer",)),
    ],
)
def test_malformed_invitations_are_refused_saying_what_is_wrong(
    text: str, words: tuple[str, ...]
) -> None:
    refused(text, *words)


@pytest.mark.parametrize(
    "text",
    [
        f"{INVITATION.url()}\nvolunteerd://join/evil?owner={OWNER}&peer={PEER}",
        INVITATION.url().replace("&peer=", "\n&peer=", 1),
        INVITATION.url().replace("?", " ?"),
        INVITATION.url().replace("stdlib", "stdl\u0456b"),  # a Cyrillic i
        INVITATION.url() + "\u202e",
        INVITATION.url().replace("owner", "own\x00er"),
        "\ufeff" + INVITATION.url(),
    ],
)
def test_line_breaks_spaces_and_unicode_inside_are_refused(text: str) -> None:
    refused(text, "printable ASCII")


def test_huge_input_is_refused_by_its_length_first() -> None:
    refused(INVITATION.url() + "&peer=" + "x" * 10_000_000, "longer than 4096")
    refused("\x00" * (MAX_INVITATION_LENGTH + 1), "longer than 4096")


def test_every_truncation_of_a_valid_invitation_is_refused_or_a_valid_prefix() -> None:
    url = INVITATION.url()
    for end in range(len(url)):
        try:
            parsed = parse_invitation(url[:end])
        except ConfigError:
            continue
        # Cut right after a whole first peer: still a complete, valid invitation.
        assert parsed == replace(INVITATION, peers=(PEER,))


def test_random_corruptions_raise_config_error_only() -> None:
    url = INVITATION.url()
    rng = random.Random(15)
    alphabet = "%&=?#/+:. \n\x00aZ9\u00e9\U0001f600" + url
    for _ in range(3000):
        chars = list(url)
        for _ in range(rng.randint(1, 4)):
            at = rng.randrange(len(chars))
            action = rng.random()
            if action < 0.4:
                chars[at] = rng.choice(alphabet)
            elif action < 0.7:
                del chars[at]
            else:
                chars.insert(at, rng.choice(alphabet))
        text = "".join(chars)
        try:
            parsed = parse_invitation(text)
        except ConfigError:
            continue
        # Whatever still parses is a real invitation: it round-trips.
        assert parse_invitation(parsed.url()) == parsed


def test_constructing_a_bad_invitation_raises_config_error() -> None:
    with pytest.raises(ConfigError, match="experiment name"):
        Invitation("Bad Name", OWNER, (PEER,))
    with pytest.raises(ConfigError, match="owner"):
        Invitation("x", "12D3KooW", (PEER,))
    with pytest.raises(ConfigError, match="no peer"):
        Invitation("x", OWNER, ())
    with pytest.raises(ConfigError, match="tuple"):
        Invitation("x", OWNER, [PEER])  # type: ignore[arg-type]


def manifest_of(name: str = "stdlib-chars") -> ExperimentManifest:
    return ExperimentManifest(name=name, hidden_dim=16, owner=OWNER)


def test_publish_invites_through_the_first_eight_usable_bootstrap_peers() -> None:
    peers = [f"/ip4/198.51.100.{i}/tcp/38400/p2p/{BOOT}" for i in range(10)]
    circuit = f"{PEER}/p2p-circuit"
    invitation, left_out = make_invitation(manifest_of(), [circuit, PEER, PEER, *peers])
    assert invitation.owner == OWNER
    assert invitation.peers == (PEER, *peers[:7])
    assert [reason.split(":")[0] for reason in left_out] == [circuit.split(":")[0], *peers[7:]]
    assert "direct address" in left_out[0]
    assert "at most 8" in left_out[-1]


def test_publish_with_no_peer_fit_for_an_invitation_is_a_config_error() -> None:
    with pytest.raises(ConfigError, match="no bootstrap peer can go in the invitation"):
        make_invitation(manifest_of(), [f"{PEER}/p2p-circuit"])


@pytest.mark.parametrize(
    "text",
    [
        f"/unix/a/p2p/{BOOT}",
        f"/unix/p2p/{BOOT}",
        f"/foo/bar/p2p/{BOOT}",
        f"{PEER}/tcp/1",
        "/ip4/1.2.3.4/tcp/1",
        "",
        "/",
        "p2p",
    ],
)
def test_a_peer_multiaddr_that_does_not_parse_is_a_config_error(text: str) -> None:
    with pytest.raises(ConfigError, match="multiaddr"):
        parse_peer_multiaddr(text)


def test_a_peer_multiaddr_parses_into_its_transport_and_peer_id() -> None:
    address = parse_peer_multiaddr(PEER)
    assert (address.peer_id, address.addrs) == (BOOT, ("/ip4/203.0.113.7/tcp/38400",))
    assert parse_peer_multiaddr(f"/p2p/{BOOT}").addrs == ()
