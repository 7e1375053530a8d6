"""Freed weight-sized buffers are reused without fresh page faults once the runtime has
set glibc's thresholds (measured in a child process: the setting is process-wide)."""

from __future__ import annotations

import platform
import subprocess
import sys

import pytest

CHILD = """
import resource, sys, torch
from volunteerd.runtime.memory import reuse_freed_memory
if sys.argv[1] == "set":
    assert reuse_freed_memory()
def faults():
    return resource.getrusage(resource.RUSAGE_SELF).ru_minflt
grads = [torch.empty(2 << 20).fill_(1.0) for _ in range(4)]  # the first step's pages
del grads
before = faults()
for _ in range(20):  # 8 MiB gradient buffers, freed after each "step"
    grads = [torch.empty(2 << 20).fill_(1.0) for _ in range(4)]
    del grads
print(faults() - before)
"""


@pytest.mark.skipif(
    platform.system() != "Linux" or platform.libc_ver()[0] != "glibc", reason="glibc only"
)
def test_freed_gradient_buffers_are_reused_without_page_faults() -> None:
    def faults(mode: str) -> int:
        out = subprocess.run(
            [sys.executable, "-c", CHILD, mode], capture_output=True, text=True, check=True
        )
        return int(out.stdout.split()[-1])

    pages = 20 * 4 * (8 << 20) // 4096  # every buffer on fresh pages
    reused = faults("set")
    assert reused <= pages // 40
    # glibc's adaptive default keeps some (how many varies from run to run), never all
    assert faults("default") > 2 * reused
