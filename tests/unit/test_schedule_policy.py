"""The schedule's rules as a pure function: each rule on its own, windows that wrap
midnight, which reason wins, unknown observations, and the config's checks."""

from __future__ import annotations

import re
from typing import Any

import pytest

from volunteerd.config import ScheduleConfig
from volunteerd.control.models import TIME_WINDOW, ScheduleChange
from volunteerd.errors import ConfigError
from volunteerd.schedule import Decision, Observation, decide, in_windows
from volunteerd.schedule.policy import parse_window


def at(hh_mm: str) -> int:
    hours, minutes = hh_mm.split(":")
    return int(hours) * 60 + int(minutes)


def seen(
    time: str = "12:00",
    idle_s: float | None = 3600.0,
    on_battery: bool | None = False,
    on_gpu: bool = False,
) -> Observation:
    return Observation(at(time), idle_s, on_battery, on_gpu)


def rules(**values: Any) -> ScheduleConfig:
    return ScheduleConfig(**values)


def test_the_defaults_compute_always_except_on_battery() -> None:
    assert decide(rules(), seen()) == Decision(compute=True, network=True)
    assert decide(rules(), seen(idle_s=0.0)).serving
    on_battery = decide(rules(), seen(on_battery=True))
    assert not on_battery.compute
    assert on_battery.network  # only computing stops
    assert on_battery.reason == "on battery"
    assert on_battery.waiting == "for mains power"


def test_on_battery_true_computes_on_battery() -> None:
    assert decide(rules(on_battery=True), seen(on_battery=True)).serving


def test_when_idle_waits_for_idle_minutes_without_input() -> None:
    when_idle = rules(run="when_idle", idle_minutes=5)
    in_use = decide(when_idle, seen(idle_s=299.0))
    assert not in_use.compute
    assert in_use.network
    assert in_use.reason == "computer in use"
    assert in_use.waiting == "for the computer to be idle for 5 min"
    assert decide(when_idle, seen(idle_s=300.0)).serving
    assert decide(when_idle, seen(idle_s=86400.0)).serving


def test_an_unknown_idle_time_or_power_source_holds_nothing_back() -> None:
    assert decide(rules(run="when_idle"), seen(idle_s=None)).serving
    assert decide(rules(), seen(on_battery=None)).serving


def test_gpu_when_idle_applies_only_with_the_experts_on_a_gpu() -> None:
    gpu_idle = rules(gpu="when_idle", idle_minutes=1)
    assert decide(gpu_idle, seen(idle_s=5.0, on_gpu=False)).serving
    held = decide(gpu_idle, seen(idle_s=5.0, on_gpu=True))
    assert not held.compute
    assert held.reason == "computer in use"
    assert decide(gpu_idle, seen(idle_s=61.0, on_gpu=True)).serving


def test_compute_hours_that_wrap_midnight() -> None:
    night = rules(compute_hours=["22:00-07:00"])
    for inside in ("22:00", "23:59", "00:00", "03:30", "06:59"):
        assert decide(night, seen(inside)).serving, inside
    for outside in ("07:00", "12:00", "21:59"):
        held = decide(night, seen(outside))
        assert not held.compute, outside
        assert held.network  # downloads and averaging go on
        assert held.reason == "outside compute hours 22:00-07:00"
        assert held.waiting == "until 22:00"


def test_several_windows_and_the_next_one_to_open() -> None:
    windows = ["09:00-12:00", "13:00-17:00"]
    assert in_windows(windows, at("09:00"))
    assert not in_windows(windows, at("12:00"))
    assert in_windows(windows, at("16:59"))
    assert not in_windows(windows, at("17:00"))
    assert in_windows([], at("04:00"))  # no window: any time
    held = decide(rules(compute_hours=windows), seen("12:30"))
    assert held.waiting == "until 13:00"
    assert decide(rules(compute_hours=windows), seen("20:00")).waiting == "until 09:00"
    assert parse_window("22:00-07:00") == (22 * 60, 7 * 60)


def test_outside_network_hours_neither_serves_nor_transfers() -> None:
    held = decide(rules(network_hours=["01:00-06:00"]), seen("12:00"))
    assert not held.network
    assert not held.compute
    assert held.reason == "outside network hours 01:00-06:00"
    assert held.waiting == "until 01:00"
    assert decide(rules(network_hours=["01:00-06:00"]), seen("02:00")).serving


def test_the_first_rule_that_holds_back_gives_the_reason() -> None:
    everything = rules(
        run="when_idle", compute_hours=["22:00-07:00"], network_hours=["20:00-08:00"]
    )
    busy_on_battery = {"idle_s": 0.0, "on_battery": True}
    reasons = [
        decide(everything, seen("12:00", **busy_on_battery)).reason,
        decide(everything, seen("21:00", **busy_on_battery)).reason,
        decide(everything, seen("23:00", **busy_on_battery)).reason,
        decide(everything, seen("23:00", idle_s=0.0)).reason,
        decide(everything, seen("23:00")).reason,
    ]
    assert reasons == [
        "outside network hours 20:00-08:00",
        "outside compute hours 22:00-07:00",
        "on battery",
        "computer in use",
        None,
    ]


@pytest.mark.parametrize(
    "bad", ["7:00-8:00", "24:00-01:00", "10:60-11:00", "22:00", "x", "08:00-09:00\n"]
)
def test_a_malformed_window_is_refused_by_the_config_and_the_api(bad: str) -> None:
    with pytest.raises(ValueError, match="not a time window"):
        rules(compute_hours=[bad])
    with pytest.raises(ValueError):
        ScheduleChange(network_hours=[bad])


def test_an_empty_window_is_refused() -> None:
    with pytest.raises(ValueError, match="empty time window"):
        rules(network_hours=["10:00-10:00"])


@pytest.mark.parametrize("window", ["7:00-8:00", "00:00-24:00", "12:00 - 13:00", "noon"])
def test_a_window_in_another_form_is_named_as_the_config_names_it(window: str) -> None:
    """The API's message was pydantic's, with the regular expression in it."""
    expected = f'not a time window: {window!r} (expected "HH:MM-HH:MM")'
    with pytest.raises(ValueError, match=re.escape(expected)):
        rules(compute_hours=[window])
    with pytest.raises(ValueError, match=re.escape(expected)) as refused:
        ScheduleChange.model_validate({"compute_hours": [window]})
    assert "pattern" not in str(refused.value)


def test_the_api_checks_what_the_config_checks() -> None:
    """``control`` imports no config, so ScheduleChange repeats the rules."""
    from volunteerd.config import models

    assert TIME_WINDOW == models._WINDOW
    assert set(ScheduleChange.model_fields) == set(ScheduleConfig.model_fields)
    for name, field in ScheduleConfig.model_fields.items():
        if name == "idle_minutes":
            assert ScheduleChange.model_fields[name].metadata == field.metadata
    assert ScheduleChange.model_config.get("allow_inf_nan") is False


def test_the_schedule_file_overlays_the_config(tmp_path: Any) -> None:
    from volunteerd.config import load_config, schedule_overlay_toml

    (tmp_path / "config.toml").write_text('[schedule]\nrun = "when_idle"\nidle_minutes = 10\n')
    (tmp_path / "data").mkdir()
    overlay = rules(run="when_idle", idle_minutes=2, compute_hours=["22:00-07:00"])
    (tmp_path / "data" / "schedule.toml").write_text(schedule_overlay_toml(overlay))
    loaded = load_config(tmp_path / "config.toml", run_time_dir=tmp_path / "data")
    assert loaded.schedule == overlay
    flagged = load_config(
        tmp_path / "config.toml",
        run_time_dir=tmp_path / "data",
        overrides=["schedule.idle_minutes=7"],
    )
    assert flagged.schedule.idle_minutes == 7  # flags still win

    (tmp_path / "data" / "schedule.toml").write_text("[limits]\nupload_mbit = 1\n")
    with pytest.raises(ConfigError, match=r"only a \[schedule\] section"):
        load_config(tmp_path / "config.toml", run_time_dir=tmp_path / "data")


async def test_a_schedule_change_keeps_only_what_was_changed_at_run_time(tmp_path: Any) -> None:
    """As for the limits: a rule of the environment or a flag, for one run, was written
    to ``schedule.toml`` with any change of another."""
    import tomllib

    from volunteerd.config import load_config
    from volunteerd.schedule import FakeIdle, FakePower, Scheduler

    class Target:
        async def follow_schedule(self, decision: Decision) -> None:
            pass

    rules = load_config(None, env={"VOLUNTEERD_SCHEDULE__ON_BATTERY": "true"}).schedule
    schedule_file = tmp_path / "schedule.toml"
    scheduler = Scheduler(
        rules,
        Target(),
        on_gpu=False,
        idle=FakeIdle(),
        power=FakePower(),
        schedule_file=schedule_file,
    )
    await scheduler.set_rules(idle_minutes=7)
    assert tomllib.loads(schedule_file.read_text()) == {"schedule": {"idle_minutes": 7}}
    await scheduler.set_rules(compute_hours=["08:00-09:00"])
    assert tomllib.loads(schedule_file.read_text()) == {
        "schedule": {"idle_minutes": 7, "compute_hours": ["08:00-09:00"]}
    }
    assert scheduler.rules.on_battery  # still applied, for this run
    assert not load_config(None, env={}, run_time_dir=tmp_path).schedule.on_battery
