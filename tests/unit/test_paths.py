"""Where volunteerd's files go (volunteerd/paths.py), from the environment it runs in."""

from __future__ import annotations

from pathlib import Path

import appdirs
import pytest

from volunteerd.paths import ENV_CACHE_DIR, ENV_CONFIG, ENV_DATA_DIR, Paths, xdg_home
from volunteerd.service.managers import Systemd

XDG = ("XDG_CONFIG_HOME", "XDG_DATA_HOME", "XDG_CACHE_HOME")


@pytest.fixture
def home(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    """A Linux home with no volunteerd or XDG settings, and a current folder elsewhere."""
    monkeypatch.setattr(appdirs, "system", "linux")
    monkeypatch.setenv("HOME", str(tmp_path / "home"))
    for name in (*XDG, ENV_CONFIG, ENV_DATA_DIR, ENV_CACHE_DIR):
        monkeypatch.delenv(name, raising=False)
    (tmp_path / "cwd").mkdir()
    monkeypatch.chdir(tmp_path / "cwd")
    return tmp_path / "home"


def test_absolute_xdg_variables_are_followed(home: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    for name in XDG:
        monkeypatch.setenv(name, f"/x/{name}")
    paths = Paths.resolve()
    assert paths.config_file == Path("/x/XDG_CONFIG_HOME/volunteerd/config.toml")
    assert paths.data_dir == Path("/x/XDG_DATA_HOME/volunteerd")
    assert paths.cache_dir == Path("/x/XDG_CACHE_HOME/volunteerd")


@pytest.mark.parametrize("value", ["", "relative", "./here", "~/tilde"])
def test_empty_or_relative_xdg_variables_mean_the_home_defaults(
    home: Path, monkeypatch: pytest.MonkeyPatch, value: str
) -> None:
    # XDG_DATA_HOME= (empty) put the identity key in whichever folder a command ran from
    for name in XDG:
        monkeypatch.setenv(name, value)
    paths = Paths.resolve()
    assert paths.config_file == home / ".config/volunteerd/config.toml"
    assert paths.data_dir == home / ".local/share/volunteerd"
    assert paths.cache_dir == home / ".cache/volunteerd"
    assert all(Path(p).is_absolute() for p in paths.as_dict().values())


def test_flags_and_volunteerd_variables_come_before_xdg(
    home: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("XDG_DATA_HOME", "")
    monkeypatch.setenv(ENV_CACHE_DIR, "/c")
    monkeypatch.setenv(ENV_DATA_DIR, "/d")
    assert Paths.resolve().data_dir == Path("/d")
    assert Paths.resolve(data_dir="/flag").data_dir == Path("/flag")
    assert Paths.resolve().cache_dir == Path("/c")


def test_the_tray_icon_goes_beside_the_data_folder(
    home: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    for value in ("", "relative", str(home / "elsewhere")):
        monkeypatch.setenv("XDG_DATA_HOME", value)
        data_home = Paths.resolve().data_dir.parent
        icon = Systemd().locations(Paths.resolve())["volunteerd.svg"]
        assert icon.is_relative_to(data_home), (value, icon, data_home)
        assert data_home == xdg_home("XDG_DATA_HOME", ".local/share")


def test_macos_keeps_its_own_folders(home: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(appdirs, "system", "darwin")
    monkeypatch.setenv("XDG_DATA_HOME", "/x")
    assert Paths.resolve().data_dir == home / "Library/Application Support/volunteerd"
