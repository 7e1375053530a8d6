"""The open-file limit and the connections it leaves room for (``net/open_files.py``):
a daemon raises its soft limit as far as the hard one allows, and holds its
connections to what is left after ``FD_RESERVE`` files of its own."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest

from volunteerd.net.open_files import FD_RESERVE, connection_cap

resource = pytest.importorskip("resource")


def test_connections_are_capped_below_the_open_file_limit() -> None:
    assert FD_RESERVE == 64
    assert connection_cap(1000, None) == 1000  # no limit
    assert connection_cap(1000, 20_000) == 1000
    assert connection_cap(1000, 1024) == 960  # Linux's default soft limit
    assert connection_cap(1000, 256) == 192  # macOS's
    assert connection_cap(1000, 40) == 16  # a few slots however low


# One child process (importing the package takes seconds) goes through the cases in
# turn: a soft limit may go down and up again, a hard one only down, so the low hard
# limit comes last.
CASES = [(2048, 4096), (256, 4096), (128, 256)]
CHILD = """
import json, resource, sys
from volunteerd.net.open_files import raise_open_file_limit
out = []
for soft, hard in json.loads(sys.argv[1]):
    resource.setrlimit(resource.RLIMIT_NOFILE, (soft, hard))
    line = raise_open_file_limit(1000)
    out.append([resource.getrlimit(resource.RLIMIT_NOFILE)[0], line])
print(json.dumps(out))
"""


@pytest.mark.skipif(
    sys.platform == "win32" or resource.getrlimit(resource.RLIMIT_NOFILE)[1] < 4096,
    reason="no RLIMIT_NOFILE, or a hard limit below the cases'",
)
def test_the_soft_limit_is_raised_as_far_as_the_hard_one_allows_and_never_lowered() -> None:
    done = subprocess.run(
        [sys.executable, "-c", CHILD, json.dumps(CASES)],
        preexec_fn=lambda: resource.setrlimit(resource.RLIMIT_NOFILE, (4096, 4096)),
        capture_output=True,
        text=True,
        timeout=120,
        check=True,
    )
    (above, got), (raised, line), (capped, short) = json.loads(done.stdout)
    assert above == 2048  # more than 1,000 connections need: left as it is
    assert got == "open files: at most 2048, hard limit 4096"
    assert raised == 1000 + FD_RESERVE
    assert line == "open files: at most 1064 (raised from 256), hard limit 4096"
    assert capped == 256  # all the hard limit allows
    assert short == "open files: at most 256 (raised from 128), hard limit 256"


# ``train`` and ``demo`` run a node of their own in the process: the CLI raises the
# limit before training starts. The demo itself is replaced by a function that reports
# the limit it was started under (the swarm it would start is not the point here).
TRAINER = """
import resource, sys
resource.setrlimit(resource.RLIMIT_NOFILE, (256, 4096))
import volunteerd.demo

def report(**kwargs):
    print(resource.getrlimit(resource.RLIMIT_NOFILE)[0])
    raise SystemExit(0)

volunteerd.demo.run_demo = report
from volunteerd.cli import main
sys.exit(main(["demo", "--local", "--steps", "1"]))
"""


@pytest.mark.skipif(
    sys.platform == "win32" or resource.getrlimit(resource.RLIMIT_NOFILE)[1] < 4096,
    reason="no RLIMIT_NOFILE, or a hard limit below the case's",
)
def test_a_trainer_raises_the_limit_before_it_trains() -> None:
    done = subprocess.run(
        [sys.executable, "-c", TRAINER],
        capture_output=True,
        text=True,
        timeout=120,
        check=True,
    )
    assert int(done.stdout.split()[-1]) == 1000 + FD_RESERVE
