"""Profiles: the TOML format, built-in profiles, per-host overrides and seeded ranges."""

from __future__ import annotations

import math
from pathlib import Path

import pytest

from volunteerd.testing.wan import BUILTIN, LinkSpec, Profile, ProfileError


def test_home_is_fifty_down_ten_up_forty_ms_between_hosts() -> None:
    first, second = Profile.load("home").link_specs(2, seed=0)
    assert (first.down_mbit, first.up_mbit, first.loss) == (50, 10, 0.001)
    assert first.delay_ms + second.delay_ms == 40


def test_every_builtin_profile_draws_links() -> None:
    for name, profile in BUILTIN.items():
        assert profile.name == name
        assert len(profile.link_specs(5, seed=1)) == 5


def test_a_toml_file_with_host_overrides_and_ranges(tmp_path: Path) -> None:
    path = tmp_path / "mine.toml"
    path.write_text(
        'description = "homes around a datacentre"\n'
        "[default]\n"
        "delay_ms = [20, 150]\n"
        "up_mbit = 10\n"
        'nat = "cone"\n'
        "[host.0]\n"
        "delay_ms = 1\n"
        'nat = "none"\n'
    )
    profile = Profile.load(path)
    assert profile.name == "mine"
    specs = profile.link_specs(6, seed=7)
    assert specs[0] == LinkSpec(delay_ms=1, up_mbit=10)
    assert all(20 <= spec.delay_ms <= 150 and spec.nat == "cone" for spec in specs[1:])
    assert len({spec.delay_ms for spec in specs[1:]}) == 5
    assert profile.link_specs(6, seed=7) == specs
    assert profile.link_specs(6, seed=8) != specs


def test_override_changes_one_host_and_keeps_the_rest() -> None:
    profile = Profile.load("home").override(1, nat="symmetric").override(1, loss=0.05)
    first, second = profile.link_specs(2, seed=0)
    assert first.nat == "none"
    assert (second.nat, second.loss, second.up_mbit) == ("symmetric", 0.05, 10)


def test_unlimited_rate_is_inf() -> None:
    profile = Profile.parse("[default]\nup_mbit = inf\n")
    assert math.isinf(profile.link_specs(1, seed=0)[0].up_mbit)


@pytest.mark.parametrize(
    ("text", "complaint"),
    [
        ("[default]\ndelay = 5\n", "default.delay"),
        ("[default]\nnat = 'full'\n", "default.nat"),
        ("[default]\ndelay_ms = [150, 20]\n", "a range is [low, high]"),
        ("[default]\nloss = 1.5\n", "loss is a probability"),
        ("[host.0]\nup_mbit = 0\n", "up_mbit must be > 0"),
        ("[default]\ndelay_ms = -1\n", "delay_ms must be a finite number >= 0"),
        ("[default\n", "is not TOML"),
    ],
)
def test_a_bad_profile_says_what_is_wrong(text: str, complaint: str) -> None:
    with pytest.raises(ProfileError, match=rf"profile 'bad'.*{__import__('re').escape(complaint)}"):
        Profile.parse(text, name="bad")


def test_an_unknown_profile_names_the_builtin_ones() -> None:
    with pytest.raises(ProfileError, match="built in: dsl, home, internet, lan"):
        Profile.load("cable")


def test_a_link_spec_validates_its_fields() -> None:
    with pytest.raises(ProfileError, match="nat must be one of"):
        LinkSpec(nat="full")  # type: ignore[arg-type]
    with pytest.raises(ProfileError, match="jitter_ms"):
        LinkSpec(jitter_ms=math.nan)
