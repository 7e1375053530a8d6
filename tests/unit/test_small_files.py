"""Whatever stands at the name of a small file of ours (``atomic.read_small``): a FIFO,
a link to ``/dev/zero``, a link to nothing, a link to someone else's file.

Found by an outside probe that damaged a data folder by hand: a FIFO at ``state.json``,
``transfer.json``, ``identity.key`` or ``api-token`` held the daemon at its start for
good, a link to ``/dev/zero`` read until memory ran out, a dangling ``projects.toml`` or
``config.toml`` read as "no file" (out of every project, on default settings), an
``api-token`` link gave another file's text as the token and made that file 0600, and 64
random bytes in ``identity.key`` started the node as another peer, silently."""

from __future__ import annotations

import errno
import json
import os
import stat
from pathlib import Path

import pytest

from volunteerd.atomic import DanglingLink, read_small
from volunteerd.config import LimitsConfig, load_config
from volunteerd.control.auth import is_token_text, load_or_create_token
from volunteerd.errors import ConfigError, ExitCode, IdentityError, exit_code
from volunteerd.identity import Identity
from volunteerd.identity.keys import load_or_create_identity
from volunteerd.net import Throttle
from volunteerd.net.throttle import TransferLedger
from volunteerd.server.pausing import Volunteer
from volunteerd.swarm.projects import load_projects

pytestmark = [
    pytest.mark.skipif(os.name != "posix", reason="FIFOs, /dev/zero"),
    pytest.mark.timeout(30),  # a FIFO read plainly blocks: fail, not hang
]

ZERO = Path("/dev/zero")


def fifo(path: Path) -> Path:
    os.mkfifo(path)
    return path


def test_what_is_no_regular_file_is_refused_without_reading_it(tmp_path: Path) -> None:
    for odd in (fifo(tmp_path / "fifo"), tmp_path, ZERO):
        with pytest.raises(OSError, match="not a regular file"):
            read_small(odd, 1024)
    zero = tmp_path / "zero"
    zero.symlink_to(ZERO)
    with pytest.raises(OSError, match="not a regular file"):
        read_small(zero, 1024)
    big = tmp_path / "big"
    big.write_bytes(b"x" * 1025)
    with pytest.raises(OSError, match="larger than 1 KiB") as refused:
        read_small(big, 1024)
    assert refused.value.errno == errno.EFBIG
    assert read_small(big, 1025) == b"x" * 1025
    with pytest.raises(FileNotFoundError):
        read_small(tmp_path / "none", 1024)


def test_a_link_to_nothing_is_no_missing_file(tmp_path: Path) -> None:
    link = tmp_path / "projects.toml"
    link.symlink_to(tmp_path / "usb" / "projects.toml")
    with pytest.raises(DanglingLink, match=r"a link to .*usb/projects\.toml, which does not"):
        read_small(link, 1024)
    assert not isinstance(DanglingLink(errno.ENOENT, "x"), FileNotFoundError)
    # the projects joined, the config: an error naming the link, not "none", "defaults"
    with pytest.raises(ConfigError, match=r"projects\.toml: cannot read: a link to") as dangling:
        load_projects(link)
    # ...that exits 5, which the service manager restarts (the drive may be mounted by
    # then), not 3 ("restarting will not help"), as a key file's link to nothing does
    assert exit_code(dangling.value) == ExitCode.UNAVAILABLE
    config = tmp_path / "config.toml"
    config.symlink_to(tmp_path / "usb" / "config.toml")
    with pytest.raises(ConfigError, match=r"config\.toml: cannot read: a link to") as dangling:
        load_config(config, env={})
    assert exit_code(dangling.value) == ExitCode.UNAVAILABLE
    folder = tmp_path / "folder.toml"
    folder.mkdir()
    with pytest.raises(ConfigError, match="cannot read") as unreadable:
        load_config(folder, env={})
    assert exit_code(unreadable.value) == ExitCode.CONFIG  # a folder stays a folder
    assert load_config(tmp_path / "absent.toml", env={}) is not None  # none at all: defaults


def test_a_link_is_refused_where_links_are_not_followed(tmp_path: Path) -> None:
    target = tmp_path / "target"
    target.write_text("text")
    link = tmp_path / "link"
    link.symlink_to(target)
    assert read_small(link, 1024) == b"text"
    with pytest.raises(OSError, match="a link to") as refused:
        read_small(link, 1024, links=False)
    assert refused.value.errno == errno.ELOOP


def test_a_key_file_that_is_a_fifo_or_endless_is_a_clear_error(tmp_path: Path) -> None:
    zero = tmp_path / "zero.key"
    zero.symlink_to(ZERO)
    for path in (fifo(tmp_path / "identity.key"), zero):
        with pytest.raises(IdentityError, match="not a regular file: restore it from a copy"):
            load_or_create_identity(path)


def test_a_key_file_of_64_bytes_must_be_a_seed_and_its_public_key(tmp_path: Path) -> None:
    identity = Identity.generate()
    path = tmp_path / "identity.key"
    path.write_bytes(identity.seed + identity.public_key)  # the Go form
    path.chmod(0o600)
    assert load_or_create_identity(path).seed == identity.seed
    path.write_bytes(identity.seed + os.urandom(32))
    with pytest.raises(IdentityError, match="public key does not match its seed"):
        load_or_create_identity(path)
    path.write_bytes(b"")
    with pytest.raises(IdentityError, match="move it away to start as a new peer"):
        load_or_create_identity(path)


def test_a_token_file_that_links_elsewhere_is_replaced_and_its_target_left_alone(
    tmp_path: Path,
) -> None:
    elsewhere = tmp_path / "hostname"
    elsewhere.write_text("a-name-that-reads-like-a-token\n")
    elsewhere.chmod(0o644)
    path = tmp_path / "api-token"
    path.symlink_to(elsewhere)
    token = load_or_create_token(path)
    assert token != "a-name-that-reads-like-a-token"
    assert is_token_text(token)
    assert not path.is_symlink()
    assert path.read_text().strip() == token
    assert stat.S_IMODE(path.stat().st_mode) == 0o600
    assert elsewhere.read_text() == "a-name-that-reads-like-a-token\n"
    assert stat.S_IMODE(elsewhere.stat().st_mode) == 0o644
    assert load_or_create_token(path) == token
    # a FIFO there: replaced too, without waiting for a writer
    os.unlink(path)
    fifo(path)
    assert is_token_text(load_or_create_token(path))
    assert stat.S_ISREG(path.stat().st_mode)


def test_state_files_that_are_fifos_or_endless_start_afresh(tmp_path: Path) -> None:
    state = fifo(tmp_path / "state.json")
    volunteer = Volunteer(
        None,
        Throttle(LimitsConfig()),
        LimitsConfig(),
        state_file=state,
        limits_file=tmp_path / "limits.toml",
        grace_s=0,
    )
    volunteer.restore()
    assert not volunteer.gate.closed  # unpaused
    transfer = tmp_path / "transfer.json"
    transfer.symlink_to(ZERO)
    assert TransferLedger(transfer).total == 0
    # a damaged one that is still a file is moved aside for a look, as before
    os.unlink(transfer)
    transfer.write_text(json.dumps({"month": 3}))
    assert TransferLedger(transfer).total == 0
    assert (tmp_path / "transfer.json.damaged").exists()
