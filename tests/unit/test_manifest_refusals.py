"""Why a storing peer did not keep a manifest travels back to its owner: strangers filling
the name's owner slots, a clock ahead, a newer manifest held. Before, ``volunteerd
publish`` read only that nobody stored it and blamed the clock (audit-join)."""

from __future__ import annotations

import time
from types import SimpleNamespace

from volunteerd.config import Config, DHTConfig, TimeoutsConfig
from volunteerd.identity import Identity
from volunteerd.net.dht import UNEXPLAINED, ExpertDHT
from volunteerd.net.peers import peer_id_for
from volunteerd.net.protocols import Verb
from volunteerd.net.records import (
    ManifestRecord,
    ManifestStoreRequest,
    StoreReply,
    StoreRequest,
    sign_record,
)
from volunteerd.net.rpc import Request
from volunteerd.swarm.manifest import ExperimentManifest
from volunteerd.swarm.publish import refusal_message
from volunteerd.wire.frames import decode_header

# The storing peer checks times on the real clock: each record is dated when it is made
# (a time read at import was 27 minutes old by this test's turn in a one-process run,
# and a record "120 s ahead" was in the past).


def storing_peer() -> ExpertDHT:
    host = SimpleNamespace(
        get_id=lambda: peer_id_for(Identity.generate()),
        get_network=lambda: SimpleNamespace(connections={}),
    )
    kad = SimpleNamespace(add_peer=None)
    return ExpertDHT(host, kad, None, DHTConfig(), TimeoutsConfig())  # type: ignore[arg-type]


def signed(owner: Identity, ahead_s: float = 0.0, name: str = "exp") -> ManifestRecord:
    issued = time.time() + ahead_s
    return ManifestRecord(
        name=name,
        owner=str(peer_id_for(owner)),
        body='{"a":1}',
        issued_at=issued,
        expires_at=issued + 3600,
    ).signed(owner)


async def store(dht: ExpertDHT, *records: ManifestRecord) -> StoreReply:
    on_store = dht.handlers()[Verb.MANIFEST_STORE]
    request = ManifestStoreRequest(records=list(records))
    reply = (await on_store(Request("sender", request, []))).header
    assert isinstance(reply, StoreReply)
    # what the sender reads is what was written
    assert decode_header(StoreReply, reply.model_dump_json().encode()) == reply
    return reply


async def test_a_manifest_store_reply_says_the_name_is_full_of_other_owners() -> None:
    dht = storing_peer()
    for _ in range(16):
        assert (await store(dht, signed(Identity.generate()))).stored == 1
    reply = await store(dht, signed(Identity.generate()))
    assert reply == StoreReply(stored=0, rejected=1, refused={"name_full": 1})


async def test_a_manifest_store_reply_tells_a_clock_ahead_from_a_newer_manifest_held() -> None:
    dht = storing_peer()
    owner = Identity.generate()
    reply = await store(dht, signed(owner, ahead_s=120))
    assert reply == StoreReply(stored=0, rejected=1, refused={"future": 1})
    assert dht.manifests.statistics().refused == {"future": 1}
    assert (await store(dht, signed(owner))).stored == 1
    reply = await store(dht, signed(owner, ahead_s=-60))
    assert reply == StoreReply(stored=0, rejected=1, refused={"stale": 1})


async def test_a_store_reply_that_kept_everything_reads_as_older_versions_wrote_it() -> None:
    """Older peers refuse a header with a field they do not know: the reasons are left
    out when there are none, and expert-record replies never carry them."""
    dht = storing_peer()
    reply = await store(dht, signed(Identity.generate()))
    assert reply.model_dump_json() == '{"status":"ok","stored":1,"rejected":0}'
    writer = Identity.generate()
    expired = sign_record(
        writer, str(peer_id_for(writer)), key="ffn.", addrs=[], children=[1], ttl_s=1, now=1.0
    )
    on_store = dht.handlers()[Verb.DHT_STORE]
    header = (await on_store(Request("sender", StoreRequest(records=[expired]), []))).header
    assert header.model_dump_json() == '{"status":"ok","stored":0,"rejected":1}'


def manifest_of(owner: Identity) -> ExperimentManifest:
    return ExperimentManifest(
        name="exp", grid=(2, 2), hidden_dim=16, owner=str(peer_id_for(owner)),
        issued_at=time.time(), expires_at=time.time() + 3600,
    )  # fmt: skip


def test_publish_blames_a_full_name_not_the_clock_when_peers_say_so() -> None:
    owner = Identity.generate()
    message = refusal_message(manifest_of(owner), {"name_full": 3}, Config())
    assert message.startswith("no peer stored the manifest of 'exp'")
    assert "3 peers refused it: the name 'exp' already has the most owners a peer keeps (16)" in (
        message
    )
    assert "publish under another name" in message
    assert "clock" not in message


def test_publish_names_the_clock_only_when_peers_refused_a_manifest_from_the_future() -> None:
    owner = Identity.generate()
    message = refusal_message(manifest_of(owner), {"future": 1, UNEXPLAINED: 2}, Config())
    assert "1 peer refused it as issued more than 30 s ahead of their clocks" in message
    assert "2 peers refused it without saying why" in message
    silent = refusal_message(manifest_of(owner), {}, Config())
    assert "clock" not in silent
    assert "owners" not in silent
