from __future__ import annotations

import logging

import pytest

from volunteerd.logs import tame_third_party


@pytest.fixture(autouse=True)
def _quiet_libp2p() -> None:
    tame_third_party()
    logging.getLogger("volunteerd").setLevel(logging.INFO)
