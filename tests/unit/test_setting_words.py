"""Events say changed settings in words (the dashboard, the tray and the CLI show them
as they are)."""

from volunteerd.config import LimitsConfig, ScheduleConfig
from volunteerd.config.words import changes_in_words


def test_changed_limits_are_said_in_words_and_unchanged_ones_not_at_all() -> None:
    before = LimitsConfig().model_dump()
    after = LimitsConfig(upload_mbit=7, duty_cycle=0.5, daily_quota_gb=1.5).model_dump()
    assert changes_in_words(before, after) == (
        "upload limit set to 7 Mbit/s, duty cycle set to 50 %, daily data quota set to 1.5 GB"
    )
    assert changes_in_words(after, before) == (
        "upload unlimited, duty cycle set to 100 %, no daily data quota"
    )
    assert changes_in_words(before, before) == ""


def test_schedule_changes_are_said_in_words() -> None:
    before = ScheduleConfig().model_dump()
    after = ScheduleConfig(
        run="when_idle", on_battery=True, compute_hours=["22:00-07:00", "12:00-13:00"]
    ).model_dump()
    assert changes_in_words(before, after) == (
        "compute only when the computer is idle, compute on battery too, "
        "compute hours 22:00-07:00 and 12:00-13:00"
    )


def test_a_key_without_words_is_named_as_it_is() -> None:
    assert changes_in_words({"x": 1}, {"x": 2}) == "x = 2"
