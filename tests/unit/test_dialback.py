"""The pure rules of reachability: which addresses a dial-back may dial, which
circuit addresses an expert record may carry, and which addresses a node announces."""

from __future__ import annotations

import ipaddress
import json

import pytest
from multiaddr import Multiaddr
from pydantic import ValidationError

from volunteerd.errors import InvalidRecord, Rejected
from volunteerd.identity import Identity
from volunteerd.net import interfaces
from volunteerd.net.dialback import (
    MAX_DIALBACK_ADDRS,
    DialBackReply,
    DialBackRequest,
    dialable_addrs,
    tcp_endpoint,
)
from volunteerd.net.peers import dialable_part, parse_circuit_addr, peer_id_for
from volunteerd.net.records import EXPERT_RECORDS, sign_record

ME = str(peer_id_for(Identity.generate()))
RELAY = str(peer_id_for(Identity.generate()))
CIRCUIT = f"/ip4/203.0.113.5/tcp/38400/p2p/{RELAY}/p2p-circuit"


def test_addresses_are_dialled_at_the_observed_ip_only() -> None:
    addrs = ["/ip4/198.51.100.7/tcp/38400", "/ip4/10.0.0.2/tcp/4001", "/ip6/2001:db8::1/tcp/1"]
    # Behind NAT: the LAN address is tried at the router's (observed) address, same port.
    assert dialable_addrs(addrs, ME, ["198.51.100.7"]) == [
        "/ip4/198.51.100.7/tcp/38400",
        "/ip4/198.51.100.7/tcp/4001",
    ]
    # Nothing observed (the request came over a relay): nothing dialled.
    assert dialable_addrs(addrs, ME, []) == []


def test_loopback_answers_for_loopback() -> None:
    addrs = ["/ip4/127.0.0.1/tcp/5000", "/ip6/::1/tcp/5000"]
    assert dialable_addrs(addrs, ME, ["127.0.0.2"]) == addrs[:1]
    assert dialable_addrs(addrs, ME, ["192.0.2.1"]) == ["/ip4/192.0.2.1/tcp/5000"]


def test_another_peers_id_or_a_non_tcp_address_is_refused() -> None:
    other = str(peer_id_for(Identity.generate()))
    with pytest.raises(Rejected):
        dialable_addrs([f"/ip4/127.0.0.1/tcp/5000/p2p/{other}"], ME, ["127.0.0.1"])
    for bad in ["/dns4/example.org/tcp/1", "/ip4/127.0.0.1/udp/1/quic-v1", "/ip4/1.2.3/tcp/1"]:
        with pytest.raises(Rejected):
            dialable_addrs([bad], ME, ["127.0.0.1"])
    own = f"/ip4/127.0.0.1/tcp/5000/p2p/{ME}"
    assert dialable_addrs([own], ME, ["127.0.0.1"]) == ["/ip4/127.0.0.1/tcp/5000"]


@pytest.mark.parametrize(
    "port", [" 4001", "+4001", "40_01", "4001 ", "\u0664\u0660\u0660\u0661", "004001", "0", "65536"]
)
def test_a_port_of_anything_but_a_few_ascii_digits_is_refused(port: str) -> None:
    """``int()`` takes " 4001", "+4001", "40_01" and Arabic-Indic digits: dial-back
    echoed such an address, and its reply then failed its pattern inside the handler
    (an "internal" error and a traceback in the log, a fuzzing audit)."""
    assert tcp_endpoint(f"/ip4/203.0.113.9/tcp/{port}") is None
    with pytest.raises(Rejected):
        dialable_addrs([f"/ip4/203.0.113.9/tcp/{port}"], ME, ["203.0.113.9"])


def test_dialled_addresses_are_written_anew_from_what_was_parsed() -> None:
    assert tcp_endpoint("/ip6/fe80::1%eth0/tcp/4001") is None  # no multiaddr has a scope
    sent = ["/ip6/2001:DB8:0:0::7/tcp/04001", "/ip4/127.0.0.5/tcp/5000"]
    out = dialable_addrs(sent, ME, ["2001:db8::7", "127.0.0.1"])
    assert out == ["/ip6/2001:db8::7/tcp/4001", "/ip4/127.0.0.5/tcp/5000"]
    for addr in out:
        assert str(Multiaddr(addr)) == addr
        DialBackReply(reachable=addr)


def test_a_dialback_request_carries_few_addresses() -> None:
    with pytest.raises(ValidationError):
        DialBackRequest(addrs=["/ip4/127.0.0.1/tcp/1"] * (MAX_DIALBACK_ADDRS + 1))
    with pytest.raises(ValidationError):
        DialBackRequest(addrs=[])


def test_circuit_addresses_parse_and_garbage_does_not() -> None:
    assert parse_circuit_addr(CIRCUIT) == ("/ip4/203.0.113.5/tcp/38400", RELAY)
    for bad in [
        f"/p2p/{RELAY}/p2p-circuit",  # no transport to reach the relay
        f"{CIRCUIT}/p2p/{ME}",  # the destination's own id is not announced
        f"{CIRCUIT}/p2p/{RELAY}/p2p-circuit",  # no chains
        "/ip4/203.0.113.5/tcp/38400/p2p/notapeerid/p2p-circuit",
        "/ip4/999.0.113.5/tcp/38400/p2p/" + RELAY + "/p2p-circuit",
        "/ip4/203.0.113.5/tcp/38400/p2p-circuit",
    ]:
        assert parse_circuit_addr(bad) is None, bad


def test_peerstore_circuit_addresses_keep_their_relay_part() -> None:
    assert dialable_part(f"{CIRCUIT}/p2p/{ME}") == CIRCUIT
    assert dialable_part(f"/ip4/1.2.3.4/tcp/5/p2p/{ME}") == "/ip4/1.2.3.4/tcp/5"


def test_records_carry_circuit_addresses_but_not_other_p2p_addresses() -> None:
    identity = Identity.generate()
    peer_id = str(peer_id_for(identity))

    def record(addr: str) -> bytes:
        signed = sign_record(identity, peer_id, key="ffn.0.1", addrs=[CIRCUIT], ttl_s=30)
        data = signed.model_dump(mode="json")
        data["addrs"] = [addr]
        return json.dumps(data).encode()

    assert EXPERT_RECORDS.decode(record(CIRCUIT)).addrs == (CIRCUIT,)
    for bad in [f"{CIRCUIT}/p2p/{peer_id}", f"/ip4/1.2.3.4/tcp/5/p2p/{RELAY}", "p2p-circuit"]:
        with pytest.raises(InvalidRecord):
            EXPERT_RECORDS.decode(record(bad))


def test_wildcard_listen_address_is_announced_as_the_interface_addresses() -> None:
    found = {4: ["192.0.2.10", "198.51.100.3", "127.0.0.1"], 6: ["::1", "fe80::1"]}

    def expand(addrs: list[Multiaddr]) -> list[str]:
        out = interfaces.expand_wildcards(
            addrs, interfaces=lambda family: found[family], ipv4_on_ipv6=False, if_inet6=None
        )
        return [str(a) for a in out]

    wildcard, fixed = Multiaddr("/ip4/0.0.0.0/tcp/4001"), Multiaddr("/ip4/203.0.113.9/tcp/7")
    assert expand([wildcard, fixed]) == [
        "/ip4/192.0.2.10/tcp/4001",
        "/ip4/198.51.100.3/tcp/4001",
        "/ip4/203.0.113.9/tcp/7",
    ]
    # Only a machine with no other interface offers loopback.
    found[4] = ["127.0.0.1"]
    assert expand([wildcard]) == ["/ip4/127.0.0.1/tcp/4001"]
    assert expand([Multiaddr("/ip6/::/tcp/9")]) == ["/ip6/::1/tcp/9"]


def test_interface_addresses_leave_out_loopback_and_link_local() -> None:
    addrs = interfaces.dialable_addrs([Multiaddr("/ip4/0.0.0.0/tcp/4001")])
    ips = [ipaddress.ip_address(a.value_for_protocol("ip4")) for a in addrs]
    assert ips
    assert not any(ip.is_unspecified or ip.is_link_local for ip in ips)
    # loopback only as the last resort of a machine without another address
    assert ips == [ipaddress.ip_address("127.0.0.1")] or not any(ip.is_loopback for ip in ips)


def test_dialback_reply_says_which_ip_the_request_came_from() -> None:
    reply = DialBackReply(reachable=None, dialled=1, observed="198.51.100.7")
    assert DialBackReply.model_validate_json(reply.model_dump_json()) == reply
    assert DialBackReply().observed is None  # over a relay: nothing observed
    with pytest.raises(ValidationError):
        DialBackReply(observed="x" * 65)


def test_a_reply_is_believed_only_where_the_dialling_rules_could_have_reached() -> None:
    from volunteerd.net.dialback import DialBackReply, believable

    sent = ["/ip4/192.168.1.5/tcp/4001", "/ip4/127.0.0.1/tcp/4001"]

    def reply(reachable: str, observed: str | None = "203.0.113.7") -> DialBackReply:
        return DialBackReply(reachable=reachable, dialled=1, observed=observed)

    assert believable(reply("/ip4/203.0.113.7/tcp/4001"), sent) == "/ip4/203.0.113.7/tcp/4001"
    assert believable(reply("/ip4/192.168.1.5/tcp/4001", None), sent) == "/ip4/192.168.1.5/tcp/4001"
    for wrong in (
        "/ip4/203.0.113.7/tcp/1",  # a port that was not sent
        "/ip4/6.6.6.6/tcp/4001",  # neither sent nor the IP it says it saw
        "/dns4/evil.example/tcp/4001",
        "/ip4/0.0.0.0/tcp/4001",
    ):
        assert believable(reply(wrong, "6.6.6.6" if "0.0.0.0" in wrong else None), sent) is None
    with pytest.raises(ValueError):  # text that is no address never gets this far
        reply("/ip4/203.0.113.7/tcp/4001\nstate running")
    with pytest.raises(ValueError):
        reply("/ip4/1.2.3.4/tcp/1" + "1" * 300)


def test_an_address_counts_only_if_the_peer_that_says_it_reached_it_could_have() -> None:
    """A peer on the internet cannot have dialled a private address behind NAT: a node
    believing it would announce that address and take no relay."""
    from volunteerd.net.reachability import _routable_from

    lan, home = "/ip4/192.168.1.5/tcp/4001", "/ip4/127.0.0.1/tcp/4001"
    assert _routable_from(lan, ["192.168.1.7"])
    assert not _routable_from(lan, ["8.8.4.4"])
    assert _routable_from(home, ["127.0.0.1"])
    assert not _routable_from(home, ["192.168.1.7"])
    assert _routable_from("/ip4/9.9.9.9/tcp/4001", ["8.8.4.4"])
    assert not _routable_from(lan, [])  # reached only through a relay: nothing checked
