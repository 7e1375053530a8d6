"""What the command line prints from the daemon's answers: text that came from peers (a
project's error, an address in the reachability advice) is shown, never acted on by
the terminal."""

from __future__ import annotations

from volunteerd.control.models import ProjectView
from volunteerd.control.verbs import format_projects


def test_control_characters_from_peers_are_printed_as_escapes() -> None:
    error = "refused\x1b[31m by /ip4/6.6.6.6/tcp/1\nstate         running\u202egnp.exe\x00"
    shown = format_projects(
        [ProjectView(name="lm", owner="12D3KooWx", share=1.0, state="failed", error=error)],
        running=True,
    )
    lines = shown.split("\n")
    assert lines[-1] == (
        "  last error: refused\\x1b[31m by /ip4/6.6.6.6/tcp/1\\nstate         "
        "running\\u202egnp.exe\\x00"
    )
    assert all(c.isprintable() for line in lines for c in line)
    # Text of the world's scripts is shown as it is.
    fine = "échec: 节点 не ответил"
    view = ProjectView(name="lm", owner="o", share=1.0, state="failed", error=fine)
    assert format_projects([view], running=True).endswith(f"last error: {fine}")
