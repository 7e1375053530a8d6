"""Start a volunteerd command detached from this process, as a service manager would.

The tray (starting the daemon when none answers) and ``volunteerd service install``
(starting the daemon or the tray where no service manager does) both start programs
that must outlive them: no terminal, their own session (so a Ctrl-C or the end of the
starter does not stop them), output appended to a log file, and the starter's
environment without its ``VOLUNTEERD_<SECTION>__<KEY>`` settings (the daemon a service
manager starts does not see a shell's variables either; the file locations are passed
explicitly). A leaf: the tray may import nothing else of the daemon's.
"""

from __future__ import annotations

import os
import subprocess
import sys
from collections.abc import Mapping, Sequence
from pathlib import Path

__all__ = ["config_variables", "start_detached"]

# The prefix of the configuration's environment variables (volunteerd.config.loading
# reads the same names; tests/unit/test_service_process.py checks that they agree).
_PREFIX = "VOLUNTEERD_"


def config_variables(environ: Mapping[str, str]) -> list[str]:
    """The ``VOLUNTEERD_<SECTION>__<KEY>`` variables set in ``environ``."""
    return sorted(
        name for name in environ if name.startswith(_PREFIX) and "__" in name[len(_PREFIX) :]
    )


def start_detached(
    command: Sequence[str], log_file: Path, environment: Mapping[str, str]
) -> subprocess.Popen[bytes]:
    """Start ``command`` in its own session with no terminal, its output appended to
    ``log_file``, and this process's environment less its configuration variables plus
    ``environment``. It outlives this process."""
    env = {k: v for k, v in os.environ.items() if k not in config_variables(os.environ)}
    env.update(environment)
    log_file.parent.mkdir(parents=True, exist_ok=True)
    detach: dict[str, object] = {"start_new_session": True}
    if sys.platform == "win32":  # pragma: no cover - Windows uses Task Scheduler
        flags = subprocess.DETACHED_PROCESS | subprocess.CREATE_NEW_PROCESS_GROUP  # type: ignore[attr-defined,unused-ignore]
        detach = {"creationflags": flags}
    with log_file.open("ab") as out:
        return subprocess.Popen(  # type: ignore[call-overload,no-any-return,unused-ignore]
            list(command),
            stdin=subprocess.DEVNULL,
            stdout=out,
            stderr=subprocess.STDOUT,
            env=env,
            **detach,
        )
