"""Third-party chatter (py-libp2p's "Failed to read DHT message from stream", dozens a
minute) stays off a volunteer's or researcher's terminal unless volunteerd logs at
DEBUG, in a program that never configures logging too; repeated lines are summarised."""

from __future__ import annotations

import json
import logging
import subprocess
import sys
import textwrap
from collections.abc import Iterator

import pytest

from volunteerd import logs
from volunteerd.errors import MalformedFrame
from volunteerd.shown import escaped
from volunteerd.wire import InfoRequest, decode_header

DHT_LOGGER = "libp2p.kad_dht.kad_dht"
MESSAGE = "Failed to read DHT message from stream: %s"


def run_python(code: str) -> str:
    """The stderr of ``code`` run in a fresh interpreter (logging is process-wide)."""
    result = subprocess.run(
        [sys.executable, "-c", "import logging\n" + textwrap.dedent(code)],
        capture_output=True,
        text=True,
        timeout=120,
        check=True,
    )
    return result.stderr


FLOOD = f"""
    for _ in range(49):
        logging.getLogger({DHT_LOGGER!r}).warning({MESSAGE!r}, "stream reset")
    logging.getLogger("libp2p.network.auto_connector").info("an info line")
"""


def test_a_library_user_who_configures_nothing_sees_no_libp2p_warnings() -> None:
    stderr = run_python("import volunteerd.moe\n" + textwrap.dedent(FLOOD))
    assert stderr == ""


def test_a_libp2p_warning_does_not_reach_stderr_at_the_default_level() -> None:
    code = """
        import volunteerd.net
        from volunteerd.logs import configure_logging
        configure_logging("INFO")
        logging.getLogger("volunteerd.test").info("ours")
    """
    stderr = run_python(textwrap.dedent(code) + textwrap.dedent(FLOOD))
    assert "volunteerd.test: ours" in stderr
    assert "Failed to read DHT message" not in stderr
    assert "an info line" not in stderr


@pytest.mark.parametrize("first", ["import volunteerd.net", "pass"])
def test_at_debug_it_does_rate_limited_whichever_is_set_up_first(first: str) -> None:
    # configure_logging before py-libp2p's import (which resets its loggers) or after.
    code = f"""
        {first}
        from volunteerd.logs import configure_logging
        configure_logging("DEBUG")
        import volunteerd.net
    """
    stderr = run_python(textwrap.dedent(code) + textwrap.dedent(FLOOD))
    lines = [line for line in stderr.splitlines() if "Failed to read DHT message" in line]
    assert len(lines) == 3
    assert f"WARNING {DHT_LOGGER}: Failed to read DHT message from stream: stream reset" in lines[0]
    assert "an info line" in stderr  # a module that set its own level is shown too


class Shown(logging.Handler):
    """What reaches the root logger's handlers, where volunteerd's (or a program's own)
    handler is. (pytest attaches its capture to non-propagating loggers too, so its
    caplog would also see what is left out.)"""

    def __init__(self) -> None:
        super().__init__()
        self.messages: list[str] = []

    def emit(self, record: logging.LogRecord) -> None:
        self.messages.append(record.getMessage())


@pytest.fixture
def shown() -> Iterator[Shown]:
    handler = Shown()
    logging.getLogger().addHandler(handler)
    try:
        yield handler
    finally:
        logging.getLogger().removeHandler(handler)
        logging.getLogger("volunteerd").setLevel(logging.INFO)
        logs.tame_third_party()


def test_critical_third_party_records_are_always_shown(shown: Shown) -> None:
    logging.getLogger(DHT_LOGGER).warning(MESSAGE, "quiet")
    logging.getLogger("multiaddr.codecs").critical("the sky fell")
    assert shown.messages == ["the sky fell"]


def test_identical_lines_beyond_three_a_minute_are_left_out_and_then_counted(
    shown: Shown, monkeypatch: pytest.MonkeyPatch
) -> None:
    now = [1000.0]
    monkeypatch.setattr(logs._ROUTED, "repeats", logs._Repeats(lambda: now[0]))
    logging.getLogger("volunteerd").setLevel(logging.DEBUG)
    logs.tame_third_party()
    dht = logging.getLogger(DHT_LOGGER)
    for _ in range(49):
        dht.warning(MESSAGE, "stream reset")
    dht.warning(MESSAGE, "another reason")  # another text: its own count
    now[0] += 61
    dht.warning(MESSAGE, "stream reset")
    reset = "Failed to read DHT message from stream: stream reset"
    assert shown.messages == [
        reset,
        reset,
        reset,
        "Failed to read DHT message from stream: another reason",
        f"{reset} (46 more like this in the last minute not shown)",
    ]


def test_our_own_failures_are_summarised_by_kind_whatever_their_arguments() -> None:
    """A failure a peer can trigger at its request rate (each time with its own peer id
    in the message) is shown a few times a minute, with its traceback, then counted."""
    now = [1000.0]
    own = logs._OwnRepeats(lambda: now[0])
    shown: list[logging.LogRecord] = []

    def log(level: int, msg: str, *args: object, error: Exception | None = None) -> None:
        exc_info = (type(error), error, None) if error else None
        record = logging.LogRecord("volunteerd.net.rpc", level, __file__, 1, msg, args, exc_info)
        if own.filter(record):
            shown.append(record)

    for i in range(500):  # 10 shown
        log(logging.ERROR, "%s handler failed for %s", "backward", f"peer{i}", error=KeyError())
    log(logging.ERROR, "%s handler failed for %s", "backward", "peer", error=ValueError())
    for i in range(15):
        log(logging.DEBUG, "debug %s", i)  # below INFO: every one
    now[0] += 61
    log(logging.ERROR, "%s handler failed for %s", "backward", "late", error=KeyError())
    formatter = logs._NotingFormatter("%(message)s")
    texts = [formatter.format(r).splitlines()[0] for r in shown]
    assert texts[:9] == [f"backward handler failed for peer{i}" for i in range(9)]
    assert texts[9] == (
        "backward handler failed for peer9 (more like this within a minute are counted, not shown)"
    )
    assert texts[10] == "backward handler failed for peer"  # another exception: its own kind
    assert texts[11:26] == [f"debug {i}" for i in range(15)]
    assert texts[26:] == [
        "backward handler failed for late (490 more like this in the last minute not shown)"
    ]
    assert shown[26].exc_info is not None  # still with its traceback
    # The note is the formatter's: any other handler sees the message as it was logged.
    assert shown[26].getMessage() == "backward handler failed for late"


def test_a_refusal_logged_at_info_is_summarised_too() -> None:
    """INFO is the default level, and a bad request's refusal is logged at INFO: one
    identity's bad headers wrote 132 bytes each, unbounded (an outside probe)."""
    now = [1000.0]
    own = logs._OwnRepeats(lambda: now[0])
    shown = 0
    for i in range(3000):
        record = logging.LogRecord(
            "volunteerd.net.rpc", logging.INFO, __file__, 1, "refused %s: bad header", (i,), None
        )
        shown += own.filter(record)
    assert shown == logs._OWN_BURST


def test_the_daemons_log_handler_summarises_our_repeated_failures() -> None:
    code = """
        from volunteerd.logs import configure_logging
        configure_logging("INFO")
        log = logging.getLogger("volunteerd.server.pipeline")
        for i in range(1000):
            try:
                raise RuntimeError("a bug")
            except RuntimeError:
                log.exception("forward of ffn.0.%s failed for %s", i % 7, i)
        logging.getLogger("volunteerd.test").warning("and life goes on")
    """
    stderr = run_python(code)
    assert stderr.count("RuntimeError: a bug") == 10
    assert stderr.count("are counted, not shown)\nTraceback") == 1
    assert "and life goes on" in stderr


FORGED = "\x1b]0;PWNED\x07\x1b[2J\n12:00:00 INFO    volunteerd.daemon: forged \u202edaolnwod"


def test_a_peers_text_in_a_message_is_escaped_not_acted_on() -> None:
    """A peer's error reply or an owner's manifest fault, logged with %s: its ESC, line
    break and bidi override are shown as escapes, on the one line of its record."""
    formatter = logs._NotingFormatter("%(levelname)s %(name)s: %(message)s")
    record = logging.LogRecord(
        "volunteerd.swarm.joiner", logging.WARNING, __file__, 1, "from peer: %s", (FORGED,), None
    )
    line = formatter.format(record)
    assert line == (
        "WARNING volunteerd.swarm.joiner: from peer: \\x1b]0;PWNED\\x07\\x1b[2J"
        "\\n12:00:00 INFO    volunteerd.daemon: forged \\u202edaolnwod"
    )
    # Tabs, DEL, C1 controls too; printable text (any script) is left as it is.
    record = logging.LogRecord(
        "volunteerd.x", logging.INFO, __file__, 1, "a\tb\x7fc\x9bd é 日本", None, None
    )
    assert formatter.format(record) == "INFO volunteerd.x: a\\tb\\x7fc\\x9bd é 日本"


def test_a_traceback_keeps_its_lines_but_its_message_is_escaped() -> None:
    formatter = logs._NotingFormatter("%(message)s")
    try:
        try:
            raise KeyError("inner \x1b[2J")
        except KeyError as inner:
            raise RuntimeError(f"internal: {FORGED}") from inner
    except RuntimeError as error:
        exc_info = (type(error), error, error.__traceback__)
    record = logging.LogRecord("volunteerd.x", logging.ERROR, __file__, 1, "failed", None, exc_info)
    text = formatter.format(record)
    assert text.startswith("failed\nTraceback (most recent call last):\n  File ")
    assert not {"\x1b", "\x07", "\u202e"} & set(text)
    assert "\n12:00:00" not in text  # the message's line break is not a line of the log
    assert "RuntimeError: internal: \\x1b]0;PWNED\\x07\\x1b[2J\\n12:00:00 INFO" in text
    assert "KeyError: 'inner \\x1b[2J'" in text  # the cause's message too
    assert "direct cause of the following exception:\n\nTraceback" in text


def test_the_daemons_log_shows_one_line_per_record_whatever_it_quotes() -> None:
    code = f"""
        from volunteerd.logs import configure_logging
        configure_logging("INFO")
        logging.getLogger("volunteerd.net.shard").warning("peer said: %s", {FORGED!r})
        logging.getLogger("libp2p.x").critical("third party: %s", {FORGED!r})
    """
    stderr = run_python(code)
    assert not {"\x1b", "\u202e"} & set(stderr)
    lines = stderr.splitlines()
    assert len(lines) == 2
    assert lines[0].endswith(
        "peer said: \\x1b]0;PWNED\\x07\\x1b[2J\\n12:00:00 INFO    "
        "volunteerd.daemon: forged \\u202edaolnwod"
    )
    assert "third party: \\x1b]0;PWNED" in lines[1]


@pytest.mark.parametrize("key", ["k" * 65_000, "\u200b" * 21_700])
def test_a_strangers_long_text_makes_one_bounded_line(key: str) -> None:
    """An unknown header key of 65,000 characters (or 21,700 zero-width spaces, six
    times longer escaped) went into the log whole, 130 KB a line: 1.1 GB a day from one
    request every 5 s (an outside probe). A line shows 2,000 characters and how many
    more there were; an exception's message in a traceback too."""
    formatter = logs._NotingFormatter("%(levelname)s %(name)s: %(message)s")
    record = logging.LogRecord(
        "volunteerd.net.rpc", logging.INFO, __file__, 1, "refused: %s", (key,), None
    )
    record.volunteerd_repeats = "3 more like this in the last minute not shown"
    line = formatter.format(record)
    assert len(line) < 2200
    assert line.startswith("INFO volunteerd.net.rpc: refused: " + escaped(key)[:100])
    assert line.endswith(
        " more characters not shown) (3 more like this in the last minute not shown)"
    )
    try:
        raise RuntimeError(key)
    except RuntimeError as error:
        exc_info = (type(error), error, error.__traceback__)
    record = logging.LogRecord("volunteerd.x", logging.ERROR, __file__, 1, "failed", None, exc_info)
    text = formatter.format(record)
    assert len(text) < 3000
    assert text.splitlines()[-1].startswith("RuntimeError: " + escaped(key)[:100])


def test_a_header_refusal_quotes_a_strangers_key_briefly() -> None:
    with pytest.raises(MalformedFrame) as refused:
        decode_header(InfoRequest, json.dumps({"uid": "ffn.0.0", "k" * 65_000: 1}).encode())
    assert len(str(refused.value)) < 500
    assert "kkkk" in str(refused.value)


def test_accepts_failing_for_want_of_descriptors_are_a_few_lines_of_ours_not_tracebacks() -> None:
    # trio's listener logs each failed accept with its traceback, ten a second while the
    # descriptors stay used up: 973 tracebacks in 100 s of an outside probe
    code = """
        import errno
        import trio
        from volunteerd.logs import configure_logging
        configure_logging("INFO")

        class UsedUp(trio.abc.Listener):
            async def accept(self):
                raise OSError(errno.EMFILE, "Too many open files")
            async def aclose(self):
                pass

        async def main():
            with trio.move_on_after(3):  # trio retries every 0.1 s: ~30 failures
                await trio.serve_listeners(lambda stream: None, [UsedUp()])

        trio.run(main)
    """
    stderr = run_python(code)
    assert "Traceback" not in stderr
    assert "accept returned" not in stderr
    ours = [line for line in stderr.splitlines() if "new connections cannot be accepted" in line]
    assert 1 <= len(ours) <= 10, stderr
    assert "(Too many open files)" in ours[0]
    assert "out of file descriptors" in ours[0]
