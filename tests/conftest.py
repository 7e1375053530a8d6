from __future__ import annotations

import logging
import traceback
from collections.abc import Generator, Iterator

import pytest

from volunteerd.logs import tame_third_party


@pytest.fixture(autouse=True)
def _quiet_libp2p() -> None:
    tame_third_party()
    logging.getLogger("volunteerd").setLevel(logging.INFO)


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
