"""The daemon's activity, decided from its signals: every state, and which rule wins."""

from __future__ import annotations

import dataclasses
import time
from dataclasses import dataclass

from volunteerd.server.activity import WAITING_AFTER_S, Signals, decide_activity

NOW = 1_800_000_000.0


@dataclass(frozen=True)
class Project:
    name: str
    state: str
    error: str | None = None
    expired_at: float | None = None
    too_big: bool = False
    waiting: str | None = None


def signals(**changes: object) -> Signals:
    """A daemon contributing: experts hosted, peers connected, reachable, called lately."""
    contributing = Signals(
        experts=4,
        projects=(Project("tinylm", "joined"),),
        mode="running",
        serving=True,
        reason="",
        snoozed_until=None,
        connected_peers=3,
        reachability="direct",
        port=38400,
        last_answered_at=NOW - 5,
        now=NOW,
    )
    return dataclasses.replace(contributing, **changes)  # type: ignore[arg-type]


def test_serving_called_and_reachable_is_contributing() -> None:
    activity = decide_activity(signals())
    assert (activity.state, activity.message, activity.hint) == ("contributing", "contributing", "")


def test_hosting_nothing_without_a_project_says_how_to_join() -> None:
    activity = decide_activity(signals(experts=0, projects=(), connected_peers=0))
    assert activity.state == "not_in_project"
    assert activity.message == "not in a project"
    assert "volunteerd join <invitation>" in activity.hint
    assert "Join a project" in activity.hint


def test_experts_named_by_hand_without_a_project_are_not_idle() -> None:
    # the README's hand-made swarm: experts.uids set, no project recorded
    assert decide_activity(signals(projects=())).state == "contributing"


def test_a_recorded_project_without_experts_yet_is_joining() -> None:
    activity = decide_activity(
        signals(experts=0, projects=(Project("tinylm", "joining"), Project("big", "failed")))
    )
    assert activity.state == "joining"
    assert activity.message == "joining tinylm"


def test_a_join_waiting_for_a_busy_replica_says_so() -> None:
    # "joining" alone while a crowd queued at a busy seed: the volunteer saw nothing move
    waiting = "waiting for a busy replica of ffn.3.1, retrying in 40 s"
    activity = decide_activity(
        signals(experts=0, projects=(Project("tinylm", "joining", waiting=waiting),))
    )
    assert activity.state == "joining"
    assert activity.message == f"joining tinylm: {waiting}"
    assert "replicas are serving others" in activity.hint


def test_a_join_downloading_a_big_expert_says_how_far_and_how_long() -> None:
    # "joining" and a rate for the ~30 min a big expert takes over a slow uplink
    waiting = "downloading ffn.3.1: 141 of 384 MiB at 2.0 Mbit/s, ~16 min left"
    activity = decide_activity(
        signals(experts=0, projects=(Project("tinylm", "joining", waiting=waiting),))
    )
    assert activity.message == f"joining tinylm: {waiting}"
    assert "downloads its experts' trained weights" in activity.hint


def test_a_join_waiting_for_spent_replicas_says_until_when() -> None:
    waiting = (
        "2 experts wait for replicas whose daily transfer quota is used up, until 00:00 "
        "(in 7 h 12 min)"
    )
    activity = decide_activity(
        signals(experts=0, projects=(Project("tinylm", "joining", waiting=waiting),))
    )
    assert activity.message == f"joining tinylm: {waiting}"
    assert "used their transfer quota for the day" in activity.hint


def test_a_join_held_back_waits_and_says_why_and_what_to_do() -> None:
    # Nothing downloads while bulk transfers are held: "downloading the experts" lasted
    # until midnight for a used-up daily quota.
    joining = {"experts": 0, "projects": (Project("tinylm", "joining"),), "network": False}
    until = NOW + 3600
    cases = [
        (dict(mode="paused", reason="paused"), "paused by you", "`volunteerd resume`"),
        (
            dict(mode="snoozed", snoozed_until=until),
            "snoozed until " + time.strftime("%H:%M", time.localtime(until)),
            "`volunteerd resume` resumes now",
        ),
        (
            dict(mode="quota", quota="daily"),
            "the daily transfer quota is used up",
            "`volunteerd limit --daily-gb GB`",
        ),
        (
            dict(mode="quota", quota="monthly"),
            "the monthly transfer quota is used up",
            "`volunteerd limit --quota GB`",
        ),
        (
            dict(mode="scheduled", reason="outside network hours 22:00-06:00: waiting until 22:00"),
            "outside network hours 22:00-06:00: waiting until 22:00",
            "the dashboard's schedule",
        ),
    ]
    for held, why, remedy in cases:
        activity = decide_activity(signals(serving=False, **joining, **held))
        assert activity.state == "joining"
        assert activity.message == f"joining tinylm: waiting, {why}"
        assert remedy in activity.hint
        assert "downloading" not in activity.hint


def test_a_join_held_from_computing_only_still_downloads() -> None:
    # outside the compute hours, or the computer in use: transfers go on
    activity = decide_activity(
        signals(
            experts=0,
            projects=(Project("tinylm", "joining"),),
            mode="scheduled",
            serving=False,
            reason="computer in use: waiting for the computer to be idle for 5 min",
        )
    )
    assert activity.message == "joining tinylm"
    assert "downloading the experts" in activity.hint


def test_a_failed_join_says_why_and_how_to_forget_it() -> None:
    activity = decide_activity(
        signals(experts=0, projects=(Project("tinylm", "failed", "no peer answered"),))
    )
    assert activity.state == "joining"
    assert activity.message == "could not join tinylm: no peer answered"
    assert "volunteerd leave tinylm" in activity.hint


def test_a_failed_joins_error_is_one_line_escaped_and_bounded() -> None:
    """The error can quote a peer or an owner (an error reply, a manifest's key): the
    message is the dashboard's header and the tray's first line."""
    error = "manifest 'x': \x1b]0;PWNED\x07\n\n  forged\u2028line \u202eright" + "A" * 10_000
    activity = decide_activity(signals(experts=0, projects=(Project("tinylm", "failed", error),)))
    assert activity.message.startswith(
        "could not join tinylm: manifest 'x': \\x1b]0;PWNED\\x07 forged line \\u202eright"
    )
    assert activity.message.endswith("AAA...")
    assert len(activity.message) == len("could not join tinylm: ") + 400
    assert activity.message.isprintable()


def test_paused_by_hand_says_who_and_how_to_resume() -> None:
    activity = decide_activity(signals(mode="paused", serving=False, reason="paused"))
    assert activity.state == "paused"
    assert activity.message == "paused by you"
    assert "volunteerd resume" in activity.hint


def test_snoozed_says_until_when() -> None:
    until = NOW + 3600
    activity = decide_activity(signals(mode="snoozed", serving=False, snoozed_until=until))
    assert activity.state == "paused"
    assert activity.message == "snoozed until " + time.strftime("%H:%M", time.localtime(until))


def test_a_snooze_ending_on_another_day_names_the_day() -> None:
    # "snoozed until 13:44" for a 3-day snooze read as "now" (an outside audit)
    for days, shown in ((3, "%a %H:%M"), (10, "%Y-%m-%d %H:%M")):
        until = NOW + days * 86400
        activity = decide_activity(signals(mode="snoozed", serving=False, snoozed_until=until))
        assert activity.message == "snoozed until " + time.strftime(shown, time.localtime(until))
        joining = {"experts": 0, "projects": (Project("tinylm", "joining"),), "network": False}
        held = decide_activity(signals(mode="snoozed", snoozed_until=until, **joining))
        assert time.strftime(shown, time.localtime(until)) in held.message


def test_a_used_up_quota_names_it() -> None:
    reason = "the monthly transfer quota of 5 GB is used up"
    activity = decide_activity(signals(mode="quota", serving=False, reason=reason, quota="monthly"))
    assert activity.state == "paused"
    assert activity.message == f"paused: {reason}"
    assert "the monthly quota with `volunteerd limit --quota GB`" in activity.hint
    assert "--daily-gb" not in activity.hint


def test_a_used_up_daily_quota_says_how_to_raise_the_daily_one() -> None:
    # Raising the monthly quota, as the hint said, left the daemon paused until midnight.
    reason = "daily transfer quota used (0.5 GB): waiting until midnight"
    activity = decide_activity(signals(mode="quota", serving=False, reason=reason, quota="daily"))
    assert activity.message == f"paused: {reason}"
    assert "after midnight" in activity.hint
    assert "the daily quota with `volunteerd limit --daily-gb GB`" in activity.hint
    assert "--quota" not in activity.hint


def test_the_schedule_pauses_with_its_reason() -> None:
    activity = decide_activity(
        signals(mode="scheduled", serving=False, reason="the computer is in use")
    )
    assert activity.state == "paused"
    assert activity.message == "paused: the computer is in use"
    assert "schedule" in activity.hint


def test_pausing_wins_over_missing_peers() -> None:
    assert decide_activity(signals(mode="paused", connected_peers=0)).state == "paused"


def test_no_connected_peer_is_no_peers() -> None:
    activity = decide_activity(signals(connected_peers=0, reachability="unknown"))
    assert activity.state == "no_peers"
    assert "internet connection" in activity.hint
    assert "bootstrap_peers" in activity.hint


def test_undialable_without_relay_is_unreachable_and_names_the_port() -> None:
    activity = decide_activity(signals(reachability="unreachable"))
    assert activity.state == "unreachable"
    assert "forward TCP port 38400" in activity.hint
    assert 'reachability.mode = "relay"' in activity.hint


def test_relayed_is_reachable() -> None:
    assert decide_activity(signals(reachability="relayed")).state == "contributing"


def test_no_call_answered_lately_is_waiting_for_work() -> None:
    for last in (None, NOW - WAITING_AFTER_S - 1):
        activity = decide_activity(signals(last_answered_at=last))
        assert activity.state == "waiting"
        assert activity.message == "waiting for work"
        assert "4 experts and 3 peers" in activity.hint


def test_a_resume_under_way_is_not_contributing_yet() -> None:
    activity = decide_activity(signals(serving=False))
    assert (activity.state, activity.message) == ("waiting", "resuming")


def test_idle_and_unheard_is_cut_off_not_waiting_for_work() -> None:
    # Connections that died with the network stay open until the kernel gives up on
    # them (minutes): "waiting for work" beside them said all was well.
    idle = NOW - WAITING_AFTER_S - 1
    for answered in (None, idle):
        activity = decide_activity(signals(last_answered_at=answered, unheard=True))
        assert activity.state == "no_peers"
        assert activity.message == "cut off: its announcements reach no other peer"
        assert "internet connection" in activity.hint
    # calls answered lately: trainers reach it (they dialled it directly)
    assert decide_activity(signals(unheard=True)).state == "contributing"
    # no peer at all says so first
    assert decide_activity(signals(connected_peers=0, unheard=True)).message == "no peers"


def test_with_an_upload_limit_idle_and_unheard_names_the_limit_not_the_connection() -> None:
    """A volunteer limited to 2 Mbit/s up, 7 peers connected, whose DHT stores timed out
    behind its replies: "cut off ... check the internet connection" (a soak)."""
    idle = NOW - WAITING_AFTER_S - 1
    activity = decide_activity(
        signals(last_answered_at=idle, unheard=True, connected_peers=7, upload_mbit=2.0)
    )
    assert activity.state == "no_peers"
    assert activity.message == "its announcements reach no other peer"
    assert "upload limit (2 Mbit/s)" in activity.hint
    assert "volunteerd limit --up" in activity.hint
    assert "internet connection" in activity.hint  # it may still be that


def test_waiting_for_work_with_an_upload_limit_says_trainers_may_pass_it_over() -> None:
    idle = NOW - WAITING_AFTER_S - 1
    activity = decide_activity(signals(last_answered_at=idle, upload_mbit=0.5))
    assert (activity.state, activity.message) == ("waiting", "waiting for work")
    assert "upload limit of 0.5 Mbit/s" in activity.hint
    assert "slow" in activity.hint
    assert "slow" not in decide_activity(signals(last_answered_at=idle)).hint
