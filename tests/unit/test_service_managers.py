"""The service managers' commands as they answer on a computer set up in another
language: ``schtasks`` on a Turkish Windows writes its errors to a pipe in the OEM code
page (cp857), which is not what Python reads a pipe in. A stand-in ``schtasks`` on PATH
prints such bytes."""

from __future__ import annotations

import os
from pathlib import Path

import pytest

from volunteerd.service import managers
from volunteerd.service.managers import TaskScheduler

# schtasks /Query for a task that does not exist, on a Turkish Windows
NOT_FOUND = "HATA: Sistem belirtilen dosyay\u0131 bulam\u0131yor."  # \u0131: dotless i


@pytest.fixture
def turkish_schtasks(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    """A ``schtasks`` that answers every call with NOT_FOUND in cp857 (its dotless i is the
    byte 0x8d, never valid UTF-8), with Windows' line ends, and fails."""
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    (bin_dir / "words").write_bytes(NOT_FOUND.encode("cp857") + b"\r\n")
    fake = bin_dir / "schtasks"
    fake.write_text('#!/bin/sh\ncat "$(dirname "$0")/words" >&2\nexit 1\n')
    fake.chmod(0o755)
    monkeypatch.setenv("PATH", f"{bin_dir}{os.pathsep}{os.environ['PATH']}")
    return bin_dir


def test_output_in_another_code_page_is_shown_not_raised(turkish_schtasks: Path) -> None:
    tasks = TaskScheduler()
    assert tasks.describe() == (
        "Task Scheduler: volunteerd\\daemon absent, volunteerd\\tray absent"
    )
    done = tasks.register({"volunteerd-daemon.xml": turkish_schtasks / "x.xml"}, changed=True)
    assert not done.ok
    assert done.output.startswith("HATA: Sistem belirtilen dosyay")
    assert done.output.endswith("yor.")


def test_output_is_read_in_the_managers_code_page(
    turkish_schtasks: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    # Windows reads it as "oem", which is cp857 there (no "oem" codec elsewhere)
    assert managers.output_encoding("win32") == "oem"
    monkeypatch.setattr(managers, "output_encoding", lambda: "cp857")
    assert managers.run(["schtasks", "/Query"]) == managers.Outcome(False, NOT_FOUND)
