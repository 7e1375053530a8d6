"""Experiment manifests: signed by the owner, refused when forged, expired or too big;
the store keeps one per (name, owner); a daemon accepts only trusted owners."""

from __future__ import annotations

import base64
import json
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest

from volunteerd.config import DHTConfig
from volunteerd.errors import ConfigError, InvalidRecord, UntrustedManifest
from volunteerd.identity import Identity
from volunteerd.net.announce import children_by_key
from volunteerd.net.peers import peer_id_for
from volunteerd.net.records import (
    EXPERT_RECORDS,
    MANIFESTS,
    MAX_MANIFEST_BODY,
    ManifestRecord,
    sign_record,
)
from volunteerd.net.store import SignedRecordStore, Source
from volunteerd.swarm.manifest import (
    ExperimentManifest,
    choose_trusted,
    load_manifest_file,
    parse_manifest,
    sign_manifest,
)

NOW = 1_800_000_000.0
DAY = 86400.0
CONFIG = DHTConfig(max_manifest_ttl_s=30 * DAY, max_clock_skew_s=30)
OWNER = Identity.generate()
OWNER_ID = str(peer_id_for(OWNER))


def manifest(
    owner: Identity = OWNER, *, issued: float = NOW, expires_days: float = 7, **kw
) -> ExperimentManifest:  # type: ignore[no-untyped-def]
    kw.setdefault("name", "stdlib-chars")
    kw.setdefault("grid", (4, 4))
    kw.setdefault("hidden_dim", 16)
    return ExperimentManifest(
        owner=str(peer_id_for(owner)),
        issued_at=issued,
        expires_at=issued + expires_days * DAY,
        **kw,
    )


def check(record: ManifestRecord, now: float = NOW) -> None:
    MANIFESTS.validate(record, CONFIG, now=now)


def test_signed_manifest_validates_and_round_trips() -> None:
    m = manifest(replication=3, seed=11, layers=2, uid_prefix="mlp")
    record = sign_manifest(m, OWNER)
    check(record)
    assert parse_manifest(record) == m
    assert m.uids()[:2] == ["mlp0.0.0", "mlp0.0.1"]
    assert len(m.uids()) == 32
    experts = m.experts_config()
    assert (experts.hidden_dim, experts.seed, experts.uid_list()) == (16, 11, m.uids())


@pytest.mark.parametrize(
    "change",
    [
        {"body": '{"name": "x"}'},
        {"name": "other"},
        {"issued_at": NOW - 1},
        {"owner": str(peer_id_for(Identity.generate()))},
    ],
)
def test_any_change_after_signing_breaks_the_signature(change: dict[str, object]) -> None:
    record = sign_manifest(manifest(), OWNER).model_copy(update=change)
    with pytest.raises(InvalidRecord):
        check(record)


def test_signature_is_domain_separated_from_expert_records() -> None:
    record = sign_manifest(manifest(), OWNER)
    # The same key signing the bare JSON (no domain) does not make a valid manifest.
    forged = record.model_copy(
        update={
            "signature": base64.b64encode(
                OWNER.sign(record.signing_bytes().split(b"\n", 1)[1])
            ).decode()
        }
    )
    with pytest.raises(InvalidRecord, match="bad signature"):
        check(forged)


def test_expired_future_and_overlong_manifests_are_refused() -> None:
    record = sign_manifest(manifest(), OWNER)
    with pytest.raises(InvalidRecord, match="expired"):
        check(record, now=NOW + 8 * DAY)
    with pytest.raises(InvalidRecord, match="future"):
        check(record, now=NOW - 3600)
    long = manifest()
    long = long.model_copy(update={"expires_at": NOW + 60 * DAY})
    with pytest.raises(InvalidRecord, match="longer"):
        check(sign_manifest(long, OWNER))


def test_oversized_body_does_not_parse() -> None:
    with pytest.raises(ValueError):
        ManifestRecord(
            name="x",
            owner=OWNER_ID,
            body="x" * (MAX_MANIFEST_BODY + 1),
            issued_at=NOW,
            expires_at=NOW + 1,
        )


def test_body_that_disagrees_with_its_envelope_is_refused() -> None:
    m = manifest()
    record = sign_manifest(m, OWNER)
    other = sign_manifest(manifest(name="other"), OWNER)
    # Correctly signed envelope of "stdlib-chars" carrying another experiment's body.
    swapped = ManifestRecord(
        name=m.name, owner=OWNER_ID, body=other.body, issued_at=NOW, expires_at=NOW + 7 * DAY
    ).signed(OWNER)
    check(swapped)
    with pytest.raises(InvalidRecord, match="disagrees"):
        parse_manifest(swapped)
    assert parse_manifest(record) == m


def test_store_keeps_newest_per_owner_and_never_lets_one_owner_hide_another() -> None:
    clock = [NOW]
    store = SignedRecordStore(MANIFESTS, CONFIG, clock=lambda: clock[0])
    stranger = Identity.generate()
    old, new = sign_manifest(manifest(), OWNER), sign_manifest(manifest(issued=NOW + 5), OWNER)
    theirs = sign_manifest(manifest(stranger, issued=NOW + 10), stranger)
    clock[0] = NOW + 10
    assert store.put(new)
    assert not store.put(old)
    assert store.put(new)
    assert store.put(theirs)
    assert {r.owner for r in store.get("stdlib-chars")} == {OWNER_ID, theirs.owner}
    assert [r for r in store.get("stdlib-chars") if r.owner == OWNER_ID] == [new]
    forged = new.model_copy(update={"owner": theirs.owner})
    assert not store.put(forged)
    clock[0] = NOW + 8 * DAY
    assert store.get("stdlib-chars") == []


def test_a_trusted_manifest_this_version_cannot_read_says_why() -> None:
    """A manifest from a newer volunteerd (a field this one lacks) was skipped without
    a word, and the join failed as "not found: check the internet connection"."""
    m = manifest()
    record = sign_manifest(m, OWNER)
    newer = json.loads(record.body)
    newer["sparsity"] = 0.5
    unreadable = ManifestRecord(
        name=m.name, owner=OWNER_ID, body=json.dumps(newer), issued_at=NOW, expires_at=NOW + 7 * DAY
    ).signed(OWNER)
    reasons: list[str] = []
    assert choose_trusted("stdlib-chars", [unreadable], [OWNER_ID], reasons) is None
    assert reasons == ["manifest 'stdlib-chars': sparsity: Extra inputs are not permitted"]


def unknown_key_error(change: Callable[[dict[str, Any]], None]) -> str:
    m = manifest()
    body = json.loads(sign_manifest(m, OWNER).body)
    change(body)
    record = ManifestRecord(
        name=m.name, owner=OWNER_ID, body=json.dumps(body), issued_at=NOW, expires_at=NOW + DAY
    ).signed(OWNER)
    with pytest.raises(InvalidRecord) as refused:
        parse_manifest(record)
    return str(refused.value)


def test_an_unknown_keys_name_is_quoted_short_and_escaped() -> None:
    """The name of a key this version does not know is the owner's text: it went whole
    (10 KB, with ESC and line breaks) into the join's error, the log, the tray and the
    dashboard."""
    evil = "\x1b]0;PWNED\x07\x1b[2J\n12:00:00 INFO forged <img src=x>" + "A" * 10_000 + "end"
    assert unknown_key_error(lambda body: body.update({evil: 1})) == (
        "manifest 'stdlib-chars': '\\x1b]0;PWNED\\x07\\x1b[2J\\n12:00:00 INFO for"
        "...AAAAAAAAAAend': Extra inputs are not permitted"
    )
    assert unknown_key_error(lambda body: body["optimizer"].update({"beta\u202e": 1})) == (
        "manifest 'stdlib-chars': 'optimizer.beta\\u202e': Extra inputs are not permitted"
    )
    # A key of the schema's own kind is named as it was.
    assert unknown_key_error(lambda body: body["optimizer"].update({"beta_3": 1})) == (
        "manifest 'stdlib-chars': optimizer.beta_3: Extra inputs are not permitted"
    )


def test_an_unknown_key_in_a_manifest_file_is_quoted_too(tmp_path: Path) -> None:
    path = tmp_path / "experiment.toml"
    path.write_text('name = "x"\ngrid = [2]\n"bad\\u001b[2Jkey" = 1\n')
    with pytest.raises(ConfigError) as refused:
        load_manifest_file(path, owner=OWNER_ID)
    assert "  'bad\\x1b[2Jkey': unknown key" in str(refused.value)
    assert "\x1b" not in str(refused.value)


def test_trusted_owner_chosen_and_untrusted_refused_with_a_clear_error() -> None:
    stranger = Identity.generate()
    mine = sign_manifest(manifest(), OWNER)
    theirs = sign_manifest(manifest(stranger, issued=NOW + 100), stranger)
    assert choose_trusted("stdlib-chars", [theirs, mine], [OWNER_ID]) == parse_manifest(mine)
    assert choose_trusted("stdlib-chars", [], [OWNER_ID]) is None
    # No owner trusted yet: the error names who published, as a hint.
    with pytest.raises(UntrustedManifest) as info:
        choose_trusted("stdlib-chars", [theirs], [])
    message = str(info.value)
    assert theirs.owner in message
    assert "experiments.trusted_owners" in message
    assert isinstance(info.value, ConfigError)  # exit code 3


def test_strangers_are_never_suggested_once_an_owner_is_trusted() -> None:
    strangers = [Identity.generate() for _ in range(16)]
    theirs = [sign_manifest(manifest(s, issued=NOW + 100), s) for s in strangers]
    assert choose_trusted("stdlib-chars", theirs, [OWNER_ID]) is None


def test_sixteen_untrusted_owners_cannot_evict_a_trusted_manifest() -> None:
    clock = [NOW]
    store = SignedRecordStore(MANIFESTS, CONFIG, clock=lambda: clock[0], trusted_writers=[OWNER_ID])
    clock[0] = NOW + 10
    attackers = [Identity.generate() for _ in range(16)]
    for attacker in attackers:  # 30-day manifests, all there before the owner's
        record = sign_manifest(manifest(attacker, issued=NOW + 10, expires_days=30), attacker)
        assert store.put(record, Source(str(peer_id_for(attacker)), "203.0.113.0/24"))
    mine = sign_manifest(manifest(), OWNER)
    assert store.put(mine, Source("someone", "198.51.100.0/24"))
    assert store.get("stdlib-chars", OWNER_ID) == [mine]
    for attacker in [Identity.generate() for _ in range(16)]:
        record = sign_manifest(manifest(attacker, issued=NOW + 10, expires_days=30), attacker)
        store.put(record, Source(str(peer_id_for(attacker)), "203.0.113.0/24"))
    assert store.get("stdlib-chars", OWNER_ID) == [mine]
    assert store.get("stdlib-chars")[0] == mine  # trusted first
    assert len(store.get("stdlib-chars")) == 16


def test_one_key_with_1023_junk_names_cannot_crowd_out_a_new_experiment() -> None:
    clock = [NOW]
    store = SignedRecordStore(MANIFESTS, CONFIG, clock=lambda: clock[0])
    junk = Identity.generate()
    source = Source(str(peer_id_for(junk)), "203.0.113.0/24")
    outcomes = [
        store.offer(sign_manifest(manifest(junk, name=f"junk-{i}"), junk), source)
        for i in range(1023)
    ]
    assert outcomes.count(None) == CONFIG.max_manifests_per_owner
    assert store.statistics().refused == {}  # offer() does not count; put() does
    mine = sign_manifest(manifest(name="new-experiment"), OWNER)
    assert store.put(mine, Source("owner", "198.51.100.0/24"))
    assert store.get("new-experiment") == [mine]


def test_manifest_file_is_stamped_by_publishing(tmp_path: Path) -> None:
    path = tmp_path / "experiment.toml"
    path.write_text(
        'name = "demo"\nhidden_dim = 32\ngrid = [2, 8]\nreplication = 2\nseed = 5\n'
        'lifetime_days = 2\n[optimizer]\nname = "sgd"\nlr = 0.01\n'
    )
    m = load_manifest_file(path, owner=OWNER_ID, now=NOW)
    assert (m.owner, m.issued_at, m.expires_at) == (OWNER_ID, NOW, NOW + 2 * DAY)
    assert m.optimizer.name == "sgd"
    assert len(m.uids()) == 16
    path.write_text('name = "demo"\nowner = "me"\n')
    with pytest.raises(ConfigError, match="set by publishing"):
        load_manifest_file(path, owner=OWNER_ID)
    path.write_text('name = "demo"\ngrid = [0]\ncolour = "red"\n')
    with pytest.raises(ConfigError, match="colour: unknown key"):
        load_manifest_file(path, owner=OWNER_ID)


@pytest.mark.parametrize("lifetime", ["inf", "nan", "0", "-1", "1e300", "31", '"7"', "true"])
def test_a_lifetime_storing_peers_would_refuse_is_an_error_before_publishing(
    tmp_path: Path, lifetime: str
) -> None:
    """Peers refuse a manifest that lives longer than 30 days (or not a number of days);
    the owner read only "no peer stored the manifest", as if the network had failed."""
    path = tmp_path / "experiment.toml"
    path.write_text(f'name = "demo"\ngrid = [2, 8]\nlifetime_days = {lifetime}\n')
    with pytest.raises(ConfigError, match=r"lifetime_days must be a number of days in \(0, 30\]"):
        load_manifest_file(path, owner=OWNER_ID)
    path.write_text('name = "demo"\ngrid = [2, 8]\nlifetime_days = 30\n')
    assert load_manifest_file(path, owner=OWNER_ID, now=NOW).expires_at == NOW + 30 * DAY


def test_grid_too_large_is_refused() -> None:
    with pytest.raises(ValueError, match="at most"):
        manifest(grid=(100, 100))


@pytest.mark.parametrize("grid", [[4096], [4, 300], [257, 2]])
def test_a_grid_dimension_peers_cannot_list_is_refused_before_publishing(
    tmp_path: Path, grid: list[int]
) -> None:
    """Every daemon hosting experts of a dimension over 256 announced a prefix record
    that every peer refuses (dht.max_children_per_record): no trainer could find them.
    ``volunteerd publish`` loads the file with load_manifest_file before storing it."""
    path = tmp_path / "experiment.toml"
    path.write_text(f'name = "wide"\nhidden_dim = 16\ngrid = {grid}\n')
    with pytest.raises(ConfigError, match=f"grid dimension of {max(grid)} experts; at most 256"):
        load_manifest_file(path, owner=OWNER_ID)


@pytest.mark.parametrize(("grid", "layers"), [((256,), 0), ((2, 256), 2), ((256, 16), 0)])
def test_every_record_of_an_accepted_grid_is_one_peers_accept(
    grid: tuple[int, ...], layers: int
) -> None:
    m = manifest(grid=grid, layers=layers)
    for key, children in children_by_key(m.experts_config().uid_list()).items():
        record = sign_record(
            OWNER, OWNER_ID, key=key, addrs=(), children=children, ttl_s=30, now=NOW
        )
        EXPERT_RECORDS.validate(record, DHTConfig(), now=NOW)


def test_description_homepage_and_owner_name_are_signed_and_round_trip(tmp_path: Path) -> None:
    path = tmp_path / "experiment.toml"
    path.write_text(
        'name = "demo"\ndescription = "Next-character prediction on Python\'s stdlib 🐍"\n'
        'homepage = "https://example.org/demo?x=1"\nowner_name = "Ada\'s lab"\n'
    )
    m = load_manifest_file(path, owner=OWNER_ID, now=NOW)
    assert m.description == "Next-character prediction on Python's stdlib 🐍"
    assert (m.homepage, m.owner_name) == ("https://example.org/demo?x=1", "Ada's lab")
    record = sign_manifest(m, OWNER)
    check(record)
    assert parse_manifest(record) == m


def test_a_manifest_published_before_the_display_fields_still_parses() -> None:
    old = manifest().model_dump(mode="json")
    for key in ("description", "homepage", "owner_name"):
        del old[key]
    parsed = ExperimentManifest.model_validate(old)
    assert (parsed.description, parsed.homepage, parsed.owner_name) == ("", "", "")


@pytest.mark.parametrize(
    ("field", "value", "message"),
    [
        ("description", "x" * 281, "at most 280"),
        ("description", "line one\nline two", "control or invisible"),
        ("description", "by Alice\u202eecilA", "control or invisible"),
        ("description", "zero\u200bwidth", "control or invisible"),
        ("description", "bell\x07", "control or invisible"),
        ("owner_name", "x" * 65, "at most 64"),
        ("owner_name", "Ada\r\nowner: someone else", "control or invisible"),
        ("owner_name", "para\u2029graph", "control or invisible"),
        ("description", "Z" + "\u0300" * 279, "combining marks"),  # drawn over the header
        ("owner_name", "A" + "\u20dd" * 5, "combining marks"),  # enclosing ones too
        ("homepage", "ftp://example.org", "http:// or https://"),
        ("homepage", "javascript:alert(1)", "http:// or https://"),
        ("homepage", "example.org", "http:// or https://"),
        ("homepage", "https://", "http:// or https://"),
        ("homepage", "https://ex\u0430mple.org", "printable ASCII"),  # a Cyrillic a
        ("homepage", "https://example.org/a b", "printable ASCII"),
        ("homepage", "https://example.org:99999/", "Port out of range"),
        ("homepage", "https://example.org/" + "a" * 190, "at most 200"),
    ],
)
def test_display_fields_are_bounded_and_free_of_control_characters(
    tmp_path: Path, field: str, value: str, message: str
) -> None:
    with pytest.raises(ValueError, match=message):
        manifest(**{field: value})
    path = tmp_path / "experiment.toml"
    path.write_text(f'name = "demo"\n{field} = {json.dumps(value)}\n')
    with pytest.raises(ConfigError, match=f"{field}: "):
        load_manifest_file(path, owner=OWNER_ID)


def test_written_languages_keep_their_marks() -> None:
    text = "Vi\u1ec7t \u05e9\u05c1\u05bc\u05b8 a\u0301\u0323\u0302\u0306"  # 4 marks at most
    assert manifest(description=text, owner_name=text).description == text
