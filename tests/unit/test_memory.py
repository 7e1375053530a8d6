"""Between optimizer steps an expert's gradients are None, so every step's backward
allocates them afresh: with glibc's default thresholds each allocation faults in new
pages; once the runtime has set them (``runtime.memory``) the freed buffers are reused.
Measured in child processes (the setting is process-wide)."""

from __future__ import annotations

import platform
import subprocess
import sys

import pytest

CHILD = """
import resource, sys, torch
from volunteerd.config import ExpertsConfig
from volunteerd.experts import ExpertBackend
from volunteerd.runtime.memory import reuse_freed_memory
if sys.argv[1] == "set":
    assert reuse_freed_memory()
torch.set_num_threads(1)
config = ExpertsConfig(hidden_dim=512)
experts = [ExpertBackend(f"ffn.0.{i}", config, torch.device("cpu"), 64) for i in range(4)]
x, g = torch.randn(16, 512), torch.randn(16, 512)
def steps(n):
    for _ in range(n):
        for expert in experts:
            expert.backward([x], [g])
        for expert in experts:
            expert.step()
steps(3)  # the first steps' pages, the optimizers' state
before = resource.getrusage(resource.RUSAGE_SELF).ru_minflt
steps(10)
print(resource.getrusage(resource.RUSAGE_SELF).ru_minflt - before)
"""


@pytest.mark.skipif(
    platform.system() != "Linux" or platform.libc_ver()[0] != "glibc", reason="glibc only"
)
def test_gradient_buffers_are_reused_step_after_step_without_page_faults() -> None:
    def faults(mode: str) -> int:
        out = subprocess.run(
            [sys.executable, "-c", CHILD, mode], capture_output=True, text=True, check=True
        )
        return int(out.stdout.split()[-1])

    pages = 10 * 4 * (8 << 20) // 4096  # every step's gradients (8 MiB each) on new pages
    assert faults("default") > pages // 4  # seen: 54,000-74,000 of 81,920
    assert faults("set") < pages // 10  # seen: 0-2048 (one buffer's first pages)
