"""Every file location volunteerd uses, with one name each. The only user of appdirs.

A location comes from, in order: an explicit argument (a command-line flag), an
environment variable, then the platform's per-user directory (XDG on Linux,
``~/Library/Application Support`` on macOS, ``%LOCALAPPDATA%`` on Windows).

=====================  ==============================  ======================
name                   default                         override
=====================  ==============================  ======================
``config_file``        <user config dir>/config.toml   ``--config``, ``VOLUNTEERD_CONFIG``
``limits_file``        <config dir>/limits.toml        (limits set at run time)
``data_dir``           <user data dir>                 ``--data-dir``, ``VOLUNTEERD_DATA_DIR``
``identity_file``      <data dir>/identity.key
``lock_file``          <data dir>/volunteerd.lock      (held while a node runs)
``checkpoints_dir``    <data dir>/checkpoints
``downloads_dir``      <data dir>/downloads            (expert state from replicas)
``state_file``         <data dir>/state.json           (paused or snoozed, kept on restart)
``transfer_file``      <data dir>/transfer.json        (bytes this month, for the quota)
``stats_file``         <data dir>/stats.sqlite3        (contribution accounting)
``token_file``         <data dir>/api-token            (the control API's token, 0600)
``control_file``       <data dir>/control.json         (the control API's address, while up)
``daemon_log_file``    <data dir>/daemon.log           (output of a daemon the tray started)
``tray_pid_file``      <data dir>/tray.pid             (the running tray's pid)
``cache_dir``          <user cache dir>                ``VOLUNTEERD_CACHE_DIR``
=====================  ==============================  ======================
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from pathlib import Path

import appdirs

APP_NAME = "volunteerd"
ENV_CONFIG = "VOLUNTEERD_CONFIG"
ENV_DATA_DIR = "VOLUNTEERD_DATA_DIR"
ENV_CACHE_DIR = "VOLUNTEERD_CACHE_DIR"


@dataclass(frozen=True, slots=True)
class Paths:
    config_file: Path
    data_dir: Path
    cache_dir: Path

    @property
    def identity_file(self) -> Path:
        return self.data_dir / "identity.key"

    @property
    def lock_file(self) -> Path:
        return self.data_dir / "volunteerd.lock"

    @property
    def checkpoints_dir(self) -> Path:
        return self.data_dir / "checkpoints"

    @property
    def downloads_dir(self) -> Path:
        return self.data_dir / "downloads"

    @property
    def limits_file(self) -> Path:
        return self.config_file.parent / "limits.toml"

    @property
    def state_file(self) -> Path:
        return self.data_dir / "state.json"

    @property
    def transfer_file(self) -> Path:
        return self.data_dir / "transfer.json"

    @property
    def stats_file(self) -> Path:
        return self.data_dir / "stats.sqlite3"

    @property
    def token_file(self) -> Path:
        return self.data_dir / "api-token"

    @property
    def control_file(self) -> Path:
        return self.data_dir / "control.json"

    @property
    def daemon_log_file(self) -> Path:
        return self.data_dir / "daemon.log"

    @property
    def tray_pid_file(self) -> Path:
        return self.data_dir / "tray.pid"

    @classmethod
    def resolve(
        cls, *, config_file: str | Path | None = None, data_dir: str | Path | None = None
    ) -> Paths:
        """Locations from flags, then the environment, then the platform defaults."""
        config = config_file or os.environ.get(ENV_CONFIG)
        data = data_dir or os.environ.get(ENV_DATA_DIR)
        cache = os.environ.get(ENV_CACHE_DIR)
        return cls(
            config_file=Path(config).expanduser()
            if config
            else Path(appdirs.user_config_dir(APP_NAME)) / "config.toml",
            data_dir=Path(data).expanduser() if data else Path(appdirs.user_data_dir(APP_NAME)),
            cache_dir=Path(cache).expanduser() if cache else Path(appdirs.user_cache_dir(APP_NAME)),
        )

    def as_dict(self) -> dict[str, str]:
        return {
            "config_file": str(self.config_file),
            "data_dir": str(self.data_dir),
            "identity_file": str(self.identity_file),
            "lock_file": str(self.lock_file),
            "checkpoints_dir": str(self.checkpoints_dir),
            "downloads_dir": str(self.downloads_dir),
            "limits_file": str(self.limits_file),
            "state_file": str(self.state_file),
            "transfer_file": str(self.transfer_file),
            "stats_file": str(self.stats_file),
            "token_file": str(self.token_file),
            "control_file": str(self.control_file),
            "daemon_log_file": str(self.daemon_log_file),
            "tray_pid_file": str(self.tray_pid_file),
            "cache_dir": str(self.cache_dir),
        }
