from __future__ import annotations

import faulthandler
import logging
import traceback
from collections.abc import Callable, Generator, Iterator
from typing import Any

import pytest
import trio
from _pytest.faulthandler import fault_handler_stderr_fd_key

from volunteerd.logs import tame_third_party


@pytest.fixture(autouse=True)
def _quiet_libp2p() -> None:
    tame_third_party()
    logging.getLogger("volunteerd").setLevel(logging.INFO)


@pytest.hookimpl(tryfirst=True)
@pytest.fixture
def inline_threads(monkeypatch: pytest.MonkeyPatch) -> None:
    """``trio.to_thread.run_sync`` runs its function inline. For tests in virtual time
    (``autojump_clock``), which jumps whenever every task waits, a worker thread's work
    included: with threads, a busy machine let the clock run past a deadline while a
    check ran in one (a round measured 30 s where its peer's deadline was 7.5 s)."""

    async def run_sync(fn: Callable[..., Any], *args: Any, **_: Any) -> Any:
        await trio.lowlevel.checkpoint()
        return fn(*args)

    monkeypatch.setattr(trio.to_thread, "run_sync", run_sync)


def pytest_runtest_setup(item: pytest.Item) -> None:
    """``faulthandler_timeout`` dumps every thread's stack a little before the default
    per-test ``timeout``; a test marked with a longer timeout gets its dump as long
    before its own (else a slow test that is not hung would dump its stacks too)."""
    mark = item.get_closest_marker("timeout")
    dump_s = float(item.config.getini("faulthandler_timeout") or 0)
    if mark is None or not mark.args or dump_s <= 0:
        return
    margin = float(item.config.getini("timeout")) - dump_s
    stderr = item.config.stash[fault_handler_stderr_fd_key]  # the terminal, not a capture
    faulthandler.dump_traceback_later(float(mark.args[0]) - margin, file=stderr)


def _leaves(exc: BaseException) -> Iterator[BaseException]:
    if isinstance(exc, BaseExceptionGroup):
        for inner in exc.exceptions:
            yield from _leaves(inner)
    else:
        yield exc


@pytest.hookimpl(wrapper=True)
def pytest_runtest_makereport(
    item: pytest.Item, call: pytest.CallInfo[None]
) -> Generator[None, pytest.TestReport, pytest.TestReport]:
    """A failure inside nested trio nurseries arrives wrapped in more exception groups
    than pytest prints: add the innermost exceptions to the report, so that a failure
    seen once in CI can be diagnosed."""
    report = yield
    if report.failed and call.excinfo is not None:
        exc = call.excinfo.value
        if isinstance(exc, BaseExceptionGroup):
            text = "\n".join(
                "".join(traceback.format_exception(leaf))[-4000:] for leaf in _leaves(exc)
            )
            report.sections.append(("innermost exceptions", text))
    return report


_SERIAL_TIERS = ("e2e", "wan")


@pytest.hookimpl(optionalhook=True)
def pytest_xdist_make_scheduler(config: pytest.Config, log: Any) -> Any:
    """Under pytest-xdist (``scripts/test`` runs two workers): the end-to-end tests run
    one after another on one worker, and so do the WAN tests, since each of them starts
    many processes or namespaces and was written for a machine it shares with one other
    busy process, not with a second such test; every other test (unit, in-process and
    integration tests, which mostly wait on timers and sockets) goes to whichever worker
    is free. The largest groups are handed out first, so the two tiers start at once on
    different workers. Only for ``--dist load`` (what ``-n`` means by itself)."""
    if config.getvalue("dist") != "load":
        return None
    from xdist.scheduler import LoadScopeScheduling

    class TierScheduling(LoadScopeScheduling):  # type: ignore[misc]
        def _split_scope(self, nodeid: str) -> str:
            parts = nodeid.split("/", 2)
            if len(parts) == 3 and parts[0] == "tests" and parts[1] in _SERIAL_TIERS:
                return f"tests/{parts[1]}"
            return nodeid

    return TierScheduling(config, log)
