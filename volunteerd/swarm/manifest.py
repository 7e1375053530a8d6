"""Experiment manifests: what an experiment's experts are, signed by its owner.

A manifest names the experiment, the expert architecture and sizes, the uid grid, the
experts' optimizer, the wire compression, the replication target and the seed every
newcomer initialises from. Its owner writes it as TOML (``volunteerd publish
experiment.toml``), which signs it with the owner's key and stores it in the DHT
(``volunteerd.net.records`` carries it as an opaque signed envelope). A daemon joins
an experiment by (name, owner) for each owner in ``experiments.trusted_owners`` and
accepts only those owners' manifests; with no owner trusted yet, others' manifests
are refused with ``UntrustedManifest``, which names them.

The TOML file holds the manifest's fields except ``owner``, ``issued_at`` and
``expires_at``, which publishing fills in, plus an optional ``lifetime_days``::

    name = "stdlib-chars"
    description = "A character-level model of Python's standard library"
    homepage = "https://example.org/stdlib-chars"
    owner_name = "Ada's lab"
    expert_type = "ffn"
    hidden_dim = 128
    uid_prefix = "mlp"
    layers = 2            # grids mlp0.* and mlp1.*; 0 = one grid named uid_prefix
    grid = [4, 4]
    replication = 2
    seed = 0
    [optimizer]
    name = "adam"
    lr = 0.003

``description``, ``homepage`` and ``owner_name`` are what a volunteer is shown before
joining and while helping ("Helping: <description> by <owner_name>"); they are
optional, so manifests published before they existed still parse.

``rendezvous`` (optional, a valid uid such as ``"stdlib_trainers.0"``) is the DHT key
under which the experiment's trainers find each other (``swarm/trainers.py``); empty,
they use one derived from the name (``rendezvous_key(name)``). An empty one is left out
of the signed body, so daemons that predate the field still accept the manifest.
"""

from __future__ import annotations

import json
import re
import time
import unicodedata
from collections.abc import Iterable, Sequence
from pathlib import Path
from typing import Annotated, Literal, Self
from urllib.parse import urlsplit

import trio
from pydantic import AfterValidator, BaseModel, ConfigDict, Field, ValidationError, model_validator

from volunteerd import uids
from volunteerd.config import MAX_GRID_DIMENSION, ExpertsConfig, OptimizerConfig
from volunteerd.config.toml_files import read_toml
from volunteerd.errors import ConfigError, InvalidRecord, UntrustedManifest
from volunteerd.identity import Identity
from volunteerd.net import ExpertDHT
from volunteerd.net.records import NAME_PATTERN, ManifestRecord
from volunteerd.wire import Compression

__all__ = [
    "ExperimentManifest",
    "choose_trusted",
    "load_manifest_file",
    "lookup_manifests",
    "parse_manifest",
    "sign_manifest",
]

DEFAULT_LIFETIME_DAYS = 7.0
# What storing peers accept by default (dht.max_manifest_ttl_s, 30 days).
MAX_LIFETIME_DAYS = 30.0
MAX_EXPERTS = 4096
_MAX_OWNERS_ASKED = 16
_MAX_OWNERS_NAMED = 4
# Control, format (bidi, zero-width), surrogate, line and paragraph separators.
# Unassigned code points are not refused: daemons on older Pythons would disagree.
_HIDDEN_CATEGORIES = frozenset({"Cc", "Cf", "Cs", "Zl", "Zp"})


_MARKS = frozenset({"Mn", "Me"})  # combining marks drawn on the character before them
# Marks on one character: written languages stack up to 3 or so (Vietnamese tones over
# vowel marks, Hebrew points); hundreds drew a column of glyphs ~230 px tall over the
# dashboard's header and its Resume button.
_MAX_MARKS = 4


def _displayable(value: str) -> str:
    """Text a volunteer is shown (dashboard, tray, terminal): no control characters,
    line breaks or invisible formatting (bidi overrides could make "by Alice" read
    as someone else), and no stacks of more than ``_MAX_MARKS`` combining marks, which
    a signed manifest would otherwise carry to every screen."""
    marks = 0
    for char in value:
        category = unicodedata.category(char)
        if category in _HIDDEN_CATEGORIES:
            raise ValueError(f"contains a control or invisible character ({char!a})")
        marks = marks + 1 if category in _MARKS else 0
        if marks > _MAX_MARKS:
            raise ValueError(f"more than {_MAX_MARKS} combining marks on one character")
    return value


def _homepage(value: str) -> str:
    """An http(s) URL of printable ASCII (an internationalised domain in its xn--
    form): unicode look-alikes of a known site are refused, not shown."""
    if not value:
        return value
    if any(not ("!" <= char <= "~") for char in value):
        raise ValueError("must be a URL of printable ASCII without spaces")
    parts = urlsplit(value)  # a ValueError (a bad IPv6 host, or port) is the answer
    if parts.scheme not in ("http", "https") or not parts.hostname:
        raise ValueError("must be an http:// or https:// URL with a host")
    _ = parts.port  # parsed only when asked for
    return value


_DisplayText = AfterValidator(_displayable)
# A field's path as this schema names them ("optimizer.lr", "grid.0"): shown as it is.
_FIELD_PATH = re.compile(r"[A-Za-z0-9_.]{1,64}")
_QUOTE_LIMIT = 48


def _where(loc: tuple[int | str, ...], empty: str) -> str:
    """Where a validation error is, for its message. A key the schema does not know is
    named by whoever wrote the manifest (a signed one reaches every joining volunteer's
    log, tray and dashboard): such a name is quoted short and escaped."""
    where = ".".join(str(part) for part in loc)
    if not where:
        return empty
    if _FIELD_PATH.fullmatch(where):
        return where
    if len(where) > _QUOTE_LIMIT:  # both ends, as swarm/invitation.py quotes
        where = f"{where[: _QUOTE_LIMIT - 16]}...{where[-13:]}"
    return ascii(where)


class ExperimentManifest(BaseModel):
    model_config = ConfigDict(frozen=True, extra="forbid", validate_default=True)

    name: Annotated[str, Field(pattern=NAME_PATTERN)]
    description: Annotated[str, Field(max_length=280), _DisplayText] = ""
    homepage: Annotated[str, Field(max_length=200), AfterValidator(_homepage)] = ""
    owner_name: Annotated[str, Field(max_length=64), _DisplayText] = ""
    expert_type: Literal["ffn", "transformer"] = "ffn"
    hidden_dim: int = Field(1024, ge=8, le=65536)
    num_heads: int = Field(8, ge=1, le=256)
    dtype: Literal["float32", "bfloat16", "float16"] = "float32"
    uid_prefix: str = Field("ffn", max_length=32)
    layers: int = Field(0, ge=0, le=64)
    grid: tuple[int, ...] = Field((4, 4), min_length=1, max_length=uids.MAX_DIMS)
    optimizer: OptimizerConfig = Field(default_factory=OptimizerConfig)
    compression: Compression = "none"
    replication: int = Field(2, ge=1, le=64)
    seed: int = Field(0, ge=0, lt=2**63)
    rendezvous: str = Field("", max_length=uids.MAX_UID_LENGTH)
    owner: str = Field("", max_length=128)
    issued_at: float = 0.0
    expires_at: float = 0.0

    @model_validator(mode="after")
    def _consistent(self) -> Self:
        if any(g < 1 for g in self.grid):
            raise ValueError("every grid dimension needs at least one expert")
        if max(self.grid) > MAX_GRID_DIMENSION:
            # Each daemon's record under a prefix then lists more children than peers
            # accept (dht.max_children_per_record): no trainer could find those experts.
            raise ValueError(
                f"a grid dimension of {max(self.grid)} experts; at most {MAX_GRID_DIMENSION} "
                "(what peers accept in one DHT record, dht.max_children_per_record)"
            )
        count = max(self.layers, 1)
        for g in self.grid:
            count *= g
        if count > MAX_EXPERTS:
            raise ValueError(f"the grid names {count} experts; at most {MAX_EXPERTS}")
        first = self.layer_names()[-1]
        if not uids.is_valid_uid(first + "".join(f".{g - 1}" for g in self.grid)):
            raise ValueError(f"uid_prefix {self.uid_prefix!r} does not make valid expert uids")
        if self.rendezvous and not uids.is_valid_uid(self.rendezvous):
            raise ValueError(f"rendezvous {self.rendezvous!r} is not a valid uid (e.g. 'x.0')")
        if self.expert_type == "transformer" and self.hidden_dim % self.num_heads:
            raise ValueError("hidden_dim must be a multiple of num_heads")
        return self

    def layer_names(self) -> list[str]:
        if not self.layers:
            return [self.uid_prefix]
        return [f"{self.uid_prefix}{i}" for i in range(self.layers)]

    def pattern(self) -> str:
        grid = "".join(f".[0:{g}]" for g in self.grid)
        return ",".join(name + grid for name in self.layer_names())

    def uids(self) -> list[str]:
        """Every expert of the experiment, sorted by coordinates."""
        return uids.expand_pattern(self.pattern())

    def experts_config(self) -> ExpertsConfig:
        """The experts section a daemon hosting this experiment's experts runs with."""
        return ExpertsConfig(
            uids=self.pattern(),
            type=self.expert_type,
            hidden_dim=self.hidden_dim,
            num_heads=self.num_heads,
            dtype=self.dtype,
            seed=self.seed,
            optimizer=self.optimizer,
        )


def load_manifest_file(path: Path, *, owner: str, now: float | None = None) -> ExperimentManifest:
    """Read a manifest TOML file and stamp it with ``owner`` and its lifetime.

    Raises ConfigError naming each bad key."""
    try:
        data = read_toml(path)
    except FileNotFoundError:
        raise ConfigError(f"manifest file not found: {path}") from None
    lifetime_days = data.pop("lifetime_days", DEFAULT_LIFETIME_DAYS)
    # Checked here: storing peers refuse a lifetime over theirs (30 days by default) or
    # a non-finite one, and the owner read only "no peer stored the manifest".
    if (
        isinstance(lifetime_days, bool)
        or not isinstance(lifetime_days, int | float)
        or not 0 < lifetime_days <= MAX_LIFETIME_DAYS
    ):
        raise ConfigError(
            f"{path}: lifetime_days must be a number of days in (0, {MAX_LIFETIME_DAYS:g}], "
            f"not {lifetime_days!r}"
        )
    for key in ("owner", "issued_at", "expires_at"):
        if key in data:
            raise ConfigError(f"{path}: {key} is set by publishing, not in the file")
    issued = time.time() if now is None else now
    try:
        return ExperimentManifest.model_validate(
            {
                **data,
                "owner": owner,
                "issued_at": issued,
                "expires_at": issued + float(lifetime_days) * 86400,
            }
        )
    except (ValidationError, ValueError, TypeError) as exc:
        if not isinstance(exc, ValidationError):
            raise ConfigError(f"{path}: lifetime_days: {exc}") from None
        lines = [f"invalid manifest {path}:"]
        for error in exc.errors():
            key = _where(error["loc"], "(top level)")
            message = "unknown key" if error["type"] == "extra_forbidden" else error["msg"]
            lines.append(f"  {key}: {message}")
        raise ConfigError("\n".join(lines)) from None


def _canonical(manifest: ExperimentManifest) -> str:
    # Optional fields added later are left out when unset: older readers refuse keys
    # they do not know.
    body = manifest.model_dump(
        mode="json", exclude=set() if manifest.rendezvous else {"rendezvous"}
    )
    return json.dumps(body, sort_keys=True, separators=(",", ":"))


def sign_manifest(manifest: ExperimentManifest, identity: Identity) -> ManifestRecord:
    """The DHT envelope of ``manifest``, signed by ``identity`` (its owner)."""
    return ManifestRecord(
        name=manifest.name,
        owner=manifest.owner,
        body=_canonical(manifest),
        issued_at=manifest.issued_at,
        expires_at=manifest.expires_at,
    ).signed(identity)


def parse_manifest(record: ManifestRecord) -> ExperimentManifest:
    """The manifest inside an envelope whose signature was already checked (by the
    DHT). Raises InvalidRecord when the body is not a manifest or disagrees with its
    envelope (name, owner, times)."""
    try:
        manifest = ExperimentManifest.model_validate_json(record.body)
    except ValidationError as exc:
        first = exc.errors()[0]
        where = _where(first["loc"], "body")
        raise InvalidRecord(f"manifest {record.name!r}: {where}: {first['msg']}") from None
    envelope = (record.name, record.owner, record.issued_at, record.expires_at)
    if (manifest.name, manifest.owner, manifest.issued_at, manifest.expires_at) != envelope:
        raise InvalidRecord(f"manifest {record.name!r} disagrees with its signed envelope")
    return manifest


async def lookup_manifests(
    dht: ExpertDHT, name: str, trusted_owners: Iterable[str]
) -> list[ManifestRecord]:
    """The manifests of ``name`` in the DHT: asked for by (name, owner), one lookup per
    trusted owner, so that strangers' manifests under the same name are never even
    fetched; every owner's when no owner is trusted yet (to name them in the error)."""
    owners = list(dict.fromkeys(trusted_owners))[:_MAX_OWNERS_ASKED]
    if not owners:
        return await dht.get_manifests(name)
    found: list[ManifestRecord] = []

    async def ask(owner: str) -> None:
        found.extend(await dht.get_manifests(name, owner))

    async with trio.open_nursery() as nursery:
        for owner in owners:
            nursery.start_soon(ask, owner)
    return found


def choose_trusted(
    name: str,
    records: Sequence[ManifestRecord],
    trusted_owners: Iterable[str],
    unusable: list[str] | None = None,
) -> ExperimentManifest | None:
    """The newest well-formed manifest of ``name`` whose owner is trusted.

    None when there is no trusted manifest (not published yet, or not found yet).
    Raises UntrustedManifest, naming the owners, when no owner is trusted at all and
    others' manifests exist: the first run's hint of whom to trust. Once an owner is
    trusted, strangers' manifests are never suggested (anyone can publish under any
    name: a flood of fresh keys must not be offered as owners to trust). Why a trusted
    owner's manifest could not be used (a newer volunteerd's fields, an expert type
    this version lacks) is appended to ``unusable``."""
    trusted = set(trusted_owners)
    best: ExperimentManifest | None = None
    strangers: list[str] = []
    for record in records:
        if record.name != name:
            continue
        if record.owner not in trusted:
            strangers.append(record.owner)
            continue
        try:
            manifest = parse_manifest(record)
        except InvalidRecord as exc:
            if unusable is not None:
                unusable.append(str(exc))
            continue
        if best is None or manifest.issued_at > best.issued_at:
            best = manifest
    if best is None and strangers and not trusted:
        raise UntrustedManifest(name, sorted(set(strangers))[:_MAX_OWNERS_NAMED])
    return best
