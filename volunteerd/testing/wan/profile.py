"""Link profiles: what each host's access link looks like.

A `LinkSpec` is one host's link, concrete numbers. A `Profile` describes a whole world:
a `default` link for every host and per-host overrides (`host.0` is often the
datacentre bootstrap), where any number may be a range `[lo, hi]` drawn per host from
a seeded RNG. Profiles come from a TOML file or from the built-in ones:

    description = "homes around a datacentre bootstrap"
    [default]
    delay_ms = [10, 75]      # one-way host -> core, drawn per host
    up_mbit = 10
    down_mbit = 50
    loss = 0.001
    nat = "cone"
    [host.0]
    delay_ms = 2
    up_mbit = 1000
    down_mbit = 1000
    loss = 0
    nat = "none"
"""

from __future__ import annotations

import math
import random
import tomllib
from dataclasses import dataclass, fields
from pathlib import Path
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, ValidationError, field_validator

NatKind = Literal["none", "cone", "symmetric"]
NAT_KINDS: tuple[NatKind, ...] = ("none", "cone", "symmetric")


class ProfileError(ValueError):
    """A profile (file, name or fields) that cannot describe a WAN."""


@dataclass(frozen=True, slots=True)
class LinkSpec:
    """One host's access link to the core, in both directions.

    `delay_ms` is one-way host -> core, so two hosts are `delay_a + delay_b` apart;
    `jitter_ms` adds up to that much uniform random delay per packet (never reordering
    one direction of one host pair); `up_mbit`/`down_mbit` serialise packets at that rate
    behind a drop-tail queue of `queue_ms` worth of bytes (`math.inf` = no limit);
    `loss` is the probability that a packet crossing this link (either way) is dropped;
    `nat` puts the host behind its own home router.
    """

    delay_ms: float = 0.0
    jitter_ms: float = 0.0
    up_mbit: float = 1000.0
    down_mbit: float = 1000.0
    loss: float = 0.0
    queue_ms: float = 100.0
    nat: NatKind = "none"

    def __post_init__(self) -> None:
        for name in ("delay_ms", "jitter_ms", "queue_ms"):
            value = getattr(self, name)
            if not (math.isfinite(value) and value >= 0):
                raise ProfileError(f"{name} must be a finite number >= 0, not {value!r}")
        for name in ("up_mbit", "down_mbit"):
            if not getattr(self, name) > 0:
                raise ProfileError(f"{name} must be > 0 (math.inf: unlimited)")
        if not 0 <= self.loss < 1:
            raise ProfileError(f"loss is a probability in [0, 1), not {self.loss!r}")
        if self.nat not in NAT_KINDS:
            raise ProfileError(f"nat must be one of {', '.join(NAT_KINDS)}, not {self.nat!r}")


_NUMBERS = ("delay_ms", "jitter_ms", "up_mbit", "down_mbit", "loss", "queue_ms")
Number = float | tuple[float, float]


class LinkTemplate(BaseModel):
    """Some fields of a `LinkSpec`; a number may be a range `[lo, hi]` drawn per host."""

    model_config = ConfigDict(frozen=True, extra="forbid")

    delay_ms: Number | None = None
    jitter_ms: Number | None = None
    up_mbit: Number | None = None
    down_mbit: Number | None = None
    loss: Number | None = None
    queue_ms: Number | None = None
    nat: NatKind | None = None

    @field_validator(*_NUMBERS)
    @classmethod
    def _ordered_range(cls, value: Number | None) -> Number | None:
        if isinstance(value, tuple) and not value[0] <= value[1]:
            raise ValueError(f"a range is [low, high], got {list(value)}")
        return value

    def merged(self, over: LinkTemplate) -> LinkTemplate:
        """These fields, with those that `over` sets replaced."""
        return self.model_copy(update=over.model_dump(exclude_none=True))

    def draw(self, rng: random.Random) -> LinkSpec:
        """A concrete link: ranges drawn from `rng` (in field order), unset fields default."""
        values: dict[str, Any] = {}
        for name in _NUMBERS:
            value = getattr(self, name)
            if isinstance(value, tuple):
                value = rng.uniform(*value)
            if value is not None:
                values[name] = float(value)
        if self.nat is not None:
            values["nat"] = self.nat
        return LinkSpec(**values)


class Profile(BaseModel):
    """A WAN: the `default` link of every host, overridden per host index (`host`)."""

    model_config = ConfigDict(frozen=True, extra="forbid")

    name: str = "custom"
    description: str = ""
    default: LinkTemplate = LinkTemplate()
    host: dict[int, LinkTemplate] = {}

    def link_specs(self, hosts: int, seed: int) -> list[LinkSpec]:
        """The links of hosts `0..hosts-1`; the same seed draws the same links."""
        if hosts < 1:
            raise ProfileError(f"a WAN needs at least one host, not {hosts}")
        rng = random.Random(seed)
        try:
            return [
                self.default.merged(self.host.get(i, LinkTemplate())).draw(rng)
                for i in range(hosts)
            ]
        except ProfileError as exc:
            raise ProfileError(f"profile {self.name!r}: {exc}") from None

    def override(self, index: int, **link_fields: Any) -> Profile:
        """This profile with host `index`'s link changed, e.g. `override(1, nat="symmetric")`."""
        try:
            over = LinkTemplate(**link_fields)
        except ValidationError as exc:
            raise ProfileError(_describe(exc, f"override of host {index}")) from None
        current = self.host.get(index, LinkTemplate())
        return self.model_copy(update={"host": {**self.host, index: current.merged(over)}})

    @classmethod
    def of(cls, spec: LinkSpec, name: str = "custom") -> Profile:
        """Every host on the same link."""
        values = {f.name: getattr(spec, f.name) for f in fields(spec)}
        return cls(name=name, default=LinkTemplate(**values))

    @classmethod
    def parse(cls, text: str, name: str = "custom") -> Profile:
        """A profile from TOML text (see the module docstring)."""
        try:
            data = tomllib.loads(text)
        except (ValueError, RecursionError) as exc:  # see config/toml_files.py
            raise ProfileError(f"profile {name!r} is not TOML: {exc}") from None
        data.setdefault("name", name)
        try:
            profile = cls.model_validate(data)
        except ValidationError as exc:
            raise ProfileError(_describe(exc, f"profile {name!r}")) from None
        profile.link_specs(max(profile.host, default=0) + 1, seed=0)  # cross-field checks
        return profile

    @classmethod
    def load(cls, source: str | Path) -> Profile:
        """A built-in profile by name, or a TOML file by path."""
        if isinstance(source, str) and source in BUILTIN:
            return BUILTIN[source]
        path = Path(source)
        if not path.is_file():
            known = ", ".join(sorted(BUILTIN))
            raise ProfileError(f"no built-in profile or file {str(source)!r} (built in: {known})")
        return cls.parse(path.read_text(), name=path.stem)


def _describe(exc: ValidationError, what: str) -> str:
    problems = "; ".join(
        f"{'.'.join(str(part) for part in error['loc'])}: {error['msg']}" for error in exc.errors()
    )
    return f"{what}: {problems}"


def _spec(**values: Any) -> LinkTemplate:
    return LinkTemplate(**values)


# Figures are round numbers of the kind broadband surveys report (e.g. the FCC's
# "Measuring Broadband America" and Ofcom's home broadband reports), not a measurement
# of any one network: they set the order of magnitude an experiment has to survive.
BUILTIN: dict[str, Profile] = {
    # one switch: what a cluster or a home LAN gives
    "lan": Profile(
        name="lan",
        description="1000 Mbit/s, no delay, no loss",
        default=_spec(delay_ms=0, up_mbit=1000, down_mbit=1000),
    ),
    # cable/fibre-to-the-cabinet home: asymmetric 50/10 Mbit/s, ~20 ms to the ISP's core
    # (so 40 ms between two homes), 0.1 % loss, a home router's ~100 ms buffer
    "home": Profile(
        name="home",
        description="50 down / 10 up Mbit/s, 20 ms per host (40 ms host to host), 0.1 % loss",
        default=_spec(delay_ms=20, up_mbit=10, down_mbit=50, loss=0.001, queue_ms=100),
    ),
    # ADSL2+ as sold (ITU G.992.5 lines sync at up to ~24/1.4 Mbit/s; long lines get far
    # less): 16/1 Mbit/s, interleaving adds latency, deep modem buffers
    "dsl": Profile(
        name="dsl",
        description="16 down / 1 up Mbit/s, 30 ms per host, 2 ms jitter, 0.5 % loss",
        default=_spec(delay_ms=30, jitter_ms=2, up_mbit=1, down_mbit=16, loss=0.005, queue_ms=300),
    ),
    # the demo world: host 0 (bootstrap) in a datacentre, the others homes spread
    # over a continent: 10-75 ms each, so 20-150 ms one-way between two homes
    "internet": Profile(
        name="internet",
        description=(
            "host 0 a datacentre (1000 Mbit/s, 2 ms); the rest homes: 50/10 Mbit/s, "
            "10-75 ms each (20-150 ms host to host), 2 ms jitter, 0.1 % loss"
        ),
        default=_spec(
            delay_ms=(10, 75), jitter_ms=2, up_mbit=10, down_mbit=50, loss=0.001, queue_ms=100
        ),
        host={0: _spec(delay_ms=2, jitter_ms=0, up_mbit=1000, down_mbit=1000, loss=0)},
    ),
}
