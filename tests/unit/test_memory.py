"""Between optimizer steps an expert's gradients are None, so every step's backward
allocates them afresh: with glibc's default thresholds each allocation faults in new
pages; once the runtime has set them (``volunteerd.malloc``) the freed buffers are reused.
On a worker thread (where the daemon computes) that takes one arena for every thread,
set before the threads start (``one_arena``, which the command line calls first).
Measured in child processes (the settings are process-wide)."""

from __future__ import annotations

import os
import platform
import subprocess
import sys
from pathlib import Path

import pytest

CHILD = """
import resource, sys, threading, torch
from volunteerd.config import ExpertsConfig
from volunteerd.experts import ExpertBackend
from volunteerd.malloc import one_arena, reuse_freed_memory
mode, count, where = sys.argv[1], int(sys.argv[2]), sys.argv[3]
if mode == "set":
    assert reuse_freed_memory()
if mode == "one_arena":
    assert one_arena()
torch.set_num_threads(1)
config = ExpertsConfig(hidden_dim=512)
experts = [ExpertBackend(f"ffn.0.{i}", config, torch.device("cpu"), 64) for i in range(count)]
x, g = torch.randn(16, 512), torch.randn(16, 512)
def steps(n):
    for _ in range(n):
        for expert in experts:
            expert.backward([x], [g])
        for expert in experts:
            expert.step()
def measure():
    steps(3)  # the first steps' pages, the optimizers' state
    before = resource.getrusage(resource.RUSAGE_SELF).ru_minflt
    steps(10)
    print(resource.getrusage(resource.RUSAGE_SELF).ru_minflt - before)
if where == "thread":
    worker = threading.Thread(target=measure)
    worker.start()
    worker.join()
else:
    measure()
"""
GLIBC = platform.system() == "Linux" and platform.libc_ver()[0] == "glibc"


def faults(mode: str, experts: int, where: str) -> int:
    out = subprocess.run(
        [sys.executable, "-c", CHILD, mode, str(experts), where],
        capture_output=True, text=True, check=True,
    )  # fmt: skip
    return int(out.stdout.split()[-1])


@pytest.mark.skipif(not GLIBC, reason="glibc only")
def test_gradient_buffers_are_reused_step_after_step_without_page_faults() -> None:
    pages = 10 * 4 * (8 << 20) // 4096  # every step's gradients (8 MiB each) on new pages
    assert faults("default", 4, "main") > pages // 4  # seen: 54,000-74,000 of 81,920
    assert faults("set", 4, "main") < pages // 10  # seen: 0-2048 (one buffer's first pages)


@pytest.mark.skipif(not GLIBC, reason="glibc only")
def test_on_a_worker_thread_the_buffers_are_reused_only_with_one_arena() -> None:
    """A thread's own arena grows in heaps of 64 MiB and unmaps a heap whole once it
    empties, whatever the thresholds: eight experts' gradients (67 MiB) emptied one
    after every step. The daemon computes on worker threads."""
    pages = 10 * 8 * (8 << 20) // 4096
    assert faults("set", 8, "thread") > pages // 20  # seen: 23,900-25,100 of 163,840
    assert faults("one_arena", 8, "thread") < pages // 40  # seen: 34-99


HEAPS = """
import ctypes, os, sys, tempfile, threading
if sys.argv[1] == "cli":
    from volunteerd.cli import main
    main(["paths"])  # any command: the command line sets the arena first
def work():
    for _ in range(20):
        block = bytearray(1 << 20)
        del block
threads = [threading.Thread(target=work) for _ in range(4)]
for t in threads:
    t.start()
for t in threads:
    t.join()
libc = ctypes.CDLL("libc.so.6")
libc.fdopen.restype = ctypes.c_void_p
libc.fdopen.argtypes = [ctypes.c_int, ctypes.c_char_p]
libc.malloc_info.argtypes = [ctypes.c_int, ctypes.c_void_p]
libc.fflush.argtypes = [ctypes.c_void_p]
with tempfile.TemporaryFile() as f:
    stream = libc.fdopen(os.dup(f.fileno()), b"w")
    libc.malloc_info(0, stream)
    libc.fflush(stream)
    f.seek(0)
    print(f.read().decode().count("<heap nr="))
"""


@pytest.mark.skipif(not GLIBC, reason="glibc only")
def test_the_command_line_gives_every_thread_the_main_arena(tmp_path: Path) -> None:
    env = {**os.environ, "VOLUNTEERD_DATA_DIR": str(tmp_path), "VOLUNTEERD_CONFIG": "none"}

    def heaps(mode: str) -> int:
        out = subprocess.run(
            [sys.executable, "-c", HEAPS, mode], capture_output=True, text=True, check=True,
            env=env,
        )  # fmt: skip
        return int(out.stdout.split()[-1])

    assert heaps("plain") > 1  # glibc's default: threads get arenas of their own
    assert heaps("cli") == 1
