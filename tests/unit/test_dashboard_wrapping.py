"""Every box of the dashboard that shows the daemon's text wraps a long word: that text
can quote a peer or a project's owner (a failed join's error names a manifest's key),
and one unbroken word pushed the whole page sideways (``#activity-message``, 116,174 px
wide). The browser test measures the page; this checks the stylesheet, fast."""

from __future__ import annotations

import re
from pathlib import Path

import pytest

STYLE = Path(__file__).resolve().parents[2] / "volunteerd" / "dashboard" / "static" / "style.css"

# Where app.js and projects.js put text that the daemon (or a peer, through it) wrote.
DAEMON_TEXT = [
    "#activity-message",
    "#activity-hint",
    "#state-detail",
    "#reach-detail",
    "#auth-reason",
    ".banner",
    ".error",  # #action-error: the daemon's refusal of an action
    ".join-status",
    ".field-error",
    "#limits-status",
    ".small-print",  # #schedule-now, #rejected-reasons, #quota-use
    ".advice",
    ".project-error",
    ".project-title",
    ".event-list .message",
    ".facts dd",
]


def wrapping_selectors() -> set[str]:
    css = re.sub(r"/\*.*?\*/", "", STYLE.read_text(), flags=re.S)
    wrapping = set()
    for selectors, body in re.findall(r"([^{}]+)\{([^{}]*)\}", css):
        if re.search(r"overflow-wrap:\s*anywhere", body):
            wrapping.update(" ".join(s.split()) for s in selectors.split(","))
    return wrapping


@pytest.mark.parametrize("selector", DAEMON_TEXT)
def test_a_box_of_daemon_text_wraps_a_long_word(selector: str) -> None:
    assert selector in wrapping_selectors()
