"""The installers, as a volunteer runs them: ``installers/install.sh`` into a throw-away
home from this checkout's wheel (files placed, daemon answering, an upgrade that keeps
the peer id and the statistics, an uninstall that keeps only the data, a purge that
keeps nothing), the torch rule on machines faked with stand-in ``uname``,
``nvidia-smi`` and ``rocminfo``, what it refuses to install, the Debian package built,
installed and removed with dpkg, and the scripts' static checks (shellcheck; the
PowerShell scripts parsed)."""

from __future__ import annotations

import os
import re
import shutil
import signal
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path

import pytest
import torch

from volunteerd.control.client import ControlClient
from volunteerd.control.models import Status, Totals
from volunteerd.errors import DaemonNotRunning
from volunteerd.identity import Identity
from volunteerd.moe import RemoteExpert
from volunteerd.net import parse_peer_multiaddr
from volunteerd.net.background import BackgroundNode
from volunteerd.testing import local_config

ROOT = Path(__file__).parents[2]
INSTALLERS = ROOT / "installers"
INSTALL = INSTALLERS / "install.sh"
UNINSTALL = INSTALLERS / "uninstall.sh"
BUILD_DEB = INSTALLERS / "debian" / "build.sh"
SHELL_SCRIPTS = [
    INSTALL,
    UNINSTALL,
    BUILD_DEB,
    INSTALLERS / "debian" / "postinst",
    INSTALLERS / "debian" / "prerm",
]
POWERSHELL_SCRIPTS = [INSTALLERS / "install.ps1", INSTALLERS / "uninstall.ps1"]
TORCH_VERSION = "2.13.0"  # installers' TORCH_VERSION, scripts/setup's pin
HIDDEN = 16
# Small and quick: two experts, any free ports, a short stop.
CONFIG = f"""\
[network]
listen_host = "127.0.0.1"
port = 0
[control]
port = 0
[experts]
uids = "ffn.[0:2].[0:1]"
hidden_dim = {HIDDEN}
[runtime]
device = "cpu"
[stats]
flush_s = 0.5
[timeouts]
shutdown_grace_s = 1
"""
SCRIPT_TIMEOUT_S = 600


def user_environment(home: Path, *, path_prefix: Path | None = None) -> dict[str, str]:
    """A login of a new user whose home is ``home``: no XDG_* or VOLUNTEERD_* settings,
    no desktop session, no Python environment of ours. The machine's pip settings stay
    (global files, and the real user's file through PIP_CONFIG_FILE), and so do pip's
    cache and rustup's home (pip asks rustc its version)."""
    real_home = Path.home()
    venv_bin = str(Path(sys.prefix) / "bin")
    dropped = {"DISPLAY", "WAYLAND_DISPLAY", "DBUS_SESSION_BUS_ADDRESS", "VIRTUAL_ENV"}
    env = {
        k: v
        for k, v in os.environ.items()
        if not k.startswith(("XDG_", "VOLUNTEERD_", "PYTHON")) and k not in dropped
    }
    path = [p for p in env.get("PATH", os.defpath).split(os.pathsep) if p and p != venv_bin]
    if path_prefix is not None:
        path.insert(0, str(path_prefix))
    env.update(HOME=str(home), PATH=os.pathsep.join(path), PYTHONUNBUFFERED="1")
    env.setdefault("PIP_CACHE_DIR", str(real_home / ".cache" / "pip"))
    for variable, where in (
        ("PIP_CONFIG_FILE", real_home / ".config" / "pip" / "pip.conf"),
        ("RUSTUP_HOME", real_home / ".rustup"),
        ("CARGO_HOME", real_home / ".cargo"),
    ):
        if where.exists():
            env.setdefault(variable, str(where))
    return env


def run_script(
    script: Path, *args: str | Path, env: dict[str, str]
) -> subprocess.CompletedProcess[str]:
    """Run ``script``; fail the test with its output if it fails."""
    done = subprocess.run(
        ["sh", str(script), *map(str, args)],
        env=env,
        stdin=subprocess.DEVNULL,
        capture_output=True,
        text=True,
        timeout=SCRIPT_TIMEOUT_S,
        check=False,
    )
    print(f"$ {script.name} {' '.join(map(str, args))}\n{done.stdout}{done.stderr}")
    assert done.returncode == 0, f"{script.name} exited {done.returncode}:\n{done.stderr}"
    return done


def files_under(folder: Path) -> list[Path]:
    """Every file and link (not folders) under ``folder``."""
    return sorted(p for p in folder.rglob("*") if p.is_file() or p.is_symlink())


def is_running(pid: int) -> bool:
    """Whether ``pid`` runs (a zombie no one reaps in a container does not)."""
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return False
    return stat.rsplit(")", 1)[1].split()[0] != "Z"


def nice_of(pid: int) -> int:
    """The nice value of ``pid`` (/proc/PID/stat's 19th field)."""
    return int(Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[16])


def command_line(pid: int) -> list[str]:
    return Path(f"/proc/{pid}/cmdline").read_bytes().decode().rstrip("\0").split("\0")


def kill_daemon(data_dir: Path) -> None:
    """Kill a daemon a failed test left running in the throw-away home (it runs detached,
    outside the test's process tree)."""
    try:
        pid = ControlClient.for_data_dir(data_dir).endpoint.pid
    except DaemonNotRunning:
        return
    if pid is not None and is_running(pid) and "volunteerd" in " ".join(command_line(pid)):
        os.kill(pid, signal.SIGKILL)


def call_every_expert(status: Status, calls: int = 3) -> None:
    """A trainer's forward and backward passes through each of the daemon's experts."""
    addr = next(a for a in status.reachability.addrs if "/ip4/127.0.0.1/" in a)
    if "/p2p/" not in addr:
        addr = f"{addr}/p2p/{status.peer_id}"
    with BackgroundNode(Identity.generate(), local_config(bootstrap=[addr])) as node:
        for uid in status.experts:
            expert = RemoteExpert(uid, parse_peer_multiaddr(addr), node)
            for _ in range(calls):
                expert(torch.randn(4, HIDDEN, requires_grad=True)).sum().backward()


def settled_totals(client: ControlClient, timeout_s: float = 20) -> Totals:
    """The all-time totals once they stop changing (written to disk)."""
    deadline = time.monotonic() + timeout_s
    last = client.stats().all_time
    while time.monotonic() < deadline:
        time.sleep(1.0)
        now = client.stats().all_time
        if (now.forward, now.backward, now.samples) == (last.forward, last.backward, last.samples):
            return now
        last = now
    raise AssertionError(f"the statistics kept changing: {last}")


def check_unit_file(unit: Path) -> None:
    if shutil.which("systemd-analyze") is None:
        print("systemd-analyze is missing: unit file not verified")
        return
    done = subprocess.run(
        ["systemd-analyze", "verify", str(unit)], capture_output=True, text=True, check=False
    )
    assert (done.returncode, done.stderr) == (0, ""), done.stderr


def check_desktop_entry(entry: Path) -> None:
    if shutil.which("desktop-file-validate") is None:
        print("desktop-file-validate is missing (apt install desktop-file-utils): not validated")
        return
    done = subprocess.run(
        ["desktop-file-validate", str(entry)], capture_output=True, text=True, check=False
    )
    assert (done.returncode, done.stdout + done.stderr) == (0, ""), done.stdout + done.stderr


@pytest.fixture(scope="session")
def wheel(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """This checkout's wheel, built from a copy (setuptools' build/ folder in a checkout
    may hold files deleted since)."""
    work = tmp_path_factory.mktemp("wheel")
    source = work / "src"
    shutil.copytree(
        ROOT,
        source,
        ignore=shutil.ignore_patterns(
            ".git", ".venv", "build", "dist", "*.egg-info", "__pycache__", ".*_cache",
            ".hypothesis", "test-artifacts",
        ),
    )  # fmt: skip
    subprocess.run(
        [sys.executable, "-m", "pip", "wheel", "--quiet", "--no-deps", "--wheel-dir", work, source],
        check=True,
        capture_output=True,
        timeout=SCRIPT_TIMEOUT_S,
    )
    return next(work.glob("volunteerd-*.whl"))


@pytest.fixture
def home(tmp_path: Path) -> Iterator[Path]:
    """A new user's home with a small configuration; any daemon left is killed."""
    home = tmp_path / "home"
    config = home / ".config" / "volunteerd" / "config.toml"
    config.parent.mkdir(parents=True)
    config.write_text(CONFIG)
    yield home
    kill_daemon(home / ".local" / "share" / "volunteerd")


@pytest.mark.slow
@pytest.mark.timeout(1200)
def test_install_upgrade_and_uninstall_in_a_new_home(wheel: Path, home: Path) -> None:
    env = user_environment(home)
    # Not byte-compiling what pip installs (torch: thousands of files) saves much of the
    # install's time; compiling is pip's work, not the installer's (and Python compiles
    # what it imports anyway). PIP_NO_COMPILE=1 would, oddly, mean the opposite.
    env["PIP_COMPILE"] = "0"
    data_dir = home / ".local" / "share" / "volunteerd"
    env_dir = data_dir / "env"
    link = home / ".local" / "bin" / "volunteerd"
    unit = home / ".config" / "systemd" / "user" / "volunteerd.service"
    tray_entry = home / ".config" / "autostart" / "volunteerd-tray.desktop"

    started = time.monotonic()
    installed = run_script(INSTALL, "--wheel", wheel, env=env)
    print(f"install: {time.monotonic() - started:.0f} s")

    # The files it placed.
    assert (env_dir / "bin" / "python").exists()
    assert link.is_symlink()
    assert link.resolve() == (env_dir / "bin" / "volunteerd").resolve()
    version = subprocess.run(
        [str(link), "--version"], env=env, capture_output=True, text=True, check=True
    ).stdout
    assert version.strip() == f"volunteerd {wheel.name.split('-')[1]}"
    torch_version = subprocess.run(
        [str(env_dir / "bin" / "python"), "-c", "import torch; print(torch.__version__)"],
        capture_output=True,
        text=True,
        check=True,
    ).stdout.strip()
    assert torch_version.startswith(TORCH_VERSION)
    assert f"ExecStart={env_dir}/bin/python -m volunteerd serve\n" in unit.read_text()
    check_unit_file(unit)
    check_desktop_entry(tray_entry)
    assert f"Exec={env_dir}/bin/python -m volunteerd tray" in tray_entry.read_text()

    # The daemon runs from the installed environment and its API answers.
    client = ControlClient.for_data_dir(data_dir)
    assert f"The dashboard: {client.endpoint.url}/" in installed.stdout
    first = client.status()
    pid = client.endpoint.pid
    assert pid is not None
    assert command_line(pid)[:3] == [
        str(env_dir / "bin" / "python"),
        "-m",
        "volunteerd",
    ]
    # polite by default: started detached here (no user systemd), yet at low priority
    assert nice_of(pid) == 10
    call_every_expert(first)
    before = settled_totals(client)
    assert before.forward == before.backward == 3 * len(first.experts) > 0

    # Again: an upgrade in place, with the same identity and statistics.
    started = time.monotonic()
    upgraded = run_script(INSTALL, "--wheel", wheel, env=env)
    print(f"upgrade: {time.monotonic() - started:.0f} s")
    assert f"keeping torch {torch_version}" in upgraded.stdout
    assert not is_running(pid)
    client = ControlClient.for_data_dir(data_dir)
    assert client.endpoint.pid != pid
    second = client.status()
    assert second.peer_id == first.peer_id
    after = client.stats().all_time
    assert (after.forward, after.backward, after.samples) == (
        before.forward,
        before.backward,
        before.samples,
    )
    pid = client.endpoint.pid
    assert pid is not None

    # Uninstall: the daemon stops; only the user's data and settings are left.
    removed = run_script(UNINSTALL, env=env)
    assert "are not touched by this command" in removed.stdout
    assert not is_running(pid)
    assert not env_dir.exists()
    assert not link.is_symlink()
    kept = [data_dir, home / ".config" / "volunteerd", home / ".cache" / "volunteerd"]
    left = files_under(home)
    assert [p for p in left if not any(p.is_relative_to(k) for k in kept)] == []
    assert (data_dir / "identity.key").exists()
    assert (data_dir / "stats.sqlite3").exists()
    # no empty folders of the autostart left behind
    assert not (home / ".config" / "systemd").exists()
    assert not (home / ".config" / "autostart").exists()
    assert not (home / ".local" / "share" / "icons").exists()

    # Purge: nothing at all, and it does not claim to keep anything.
    purged = run_script(UNINSTALL, "--purge", env=env)
    assert "volunteerd and all its data are removed" in purged.stdout
    assert "kept" not in purged.stdout
    assert "not touched" not in purged.stdout
    assert files_under(home) == []


def fake_machine(folder: Path, *, system: str, machine: str, gpu: bool) -> Path:
    """Stand-ins for ``uname`` and ``nvidia-smi``, to put first on PATH."""
    folder.mkdir()
    (folder / "uname").write_text(
        f'#!/bin/sh\ncase "$1" in -m) echo {machine} ;; *) echo {system} ;; esac\n'
    )
    smi = (
        'echo "GPU 0: NVIDIA GeForce RTX 4090 (UUID: GPU-0)"'
        if gpu
        else "echo \"NVIDIA-SMI has failed because it couldn't communicate with the NVIDIA "
        'driver."; exit 9'
    )
    (folder / "nvidia-smi").write_text(f"#!/bin/sh\n{smi}\n")
    for tool in folder.iterdir():
        tool.chmod(0o755)
    return folder


CPU_LINE = (
    f"torch=={TORCH_VERSION}+cpu, the CPU build (from the configured package index if it "
    "has it, else https://download.pytorch.org/whl/cpu)"
)
CUDA_LINE = (
    f"torch=={TORCH_VERSION} from the package index (on Linux its CUDA build: an NVIDIA GPU "
    "was found)"
)
INDEX_LINE = f"torch=={TORCH_VERSION} from the package index"
ROCM_LINE = (
    f"torch=={TORCH_VERSION}+rocm7.2, the ROCm build for AMD GPUs (from "
    "https://download.pytorch.org/whl/rocm7.2)"
)


@pytest.mark.parametrize(
    ("system", "machine", "gpu", "torch_plan", "env_dir"),
    [
        ("Linux", "x86_64", False, CPU_LINE, ".local/share"),
        ("Linux", "x86_64", True, CUDA_LINE, ".local/share"),
        ("Linux", "aarch64", False, INDEX_LINE, ".local/share"),
        ("Darwin", "arm64", True, INDEX_LINE, "Library/Application Support"),
    ],
    ids=["linux-cpu", "linux-nvidia", "linux-arm", "macos"],
)
def test_install_picks_torch_and_places_by_the_machine(
    tmp_path: Path, system: str, machine: str, gpu: bool, torch_plan: str, env_dir: str
) -> None:
    tools = fake_machine(tmp_path / "bin", system=system, machine=machine, gpu=gpu)
    home = tmp_path / "home"
    env = user_environment(home, path_prefix=tools)
    plan = run_script(INSTALL, "--dry-run", "--no-tray", env=env).stdout
    assert f"would install torch: {torch_plan}\n" in plan
    assert f"would create the environment {home / env_dir / 'volunteerd' / 'env'} " in plan
    assert "would run: volunteerd service install --no-tray\n" in plan
    assert not home.exists(), "a dry run changes nothing"


def test_install_follows_xdg_data_home_and_an_explicit_torch(tmp_path: Path) -> None:
    tools = fake_machine(tmp_path / "bin", system="Linux", machine="x86_64", gpu=True)
    env = user_environment(tmp_path / "home", path_prefix=tools)
    env["XDG_DATA_HOME"] = str(tmp_path / "data")
    plan = run_script(INSTALL, "--dry-run", "--torch", "cpu", env=env).stdout
    assert f"would create the environment {tmp_path / 'data' / 'volunteerd' / 'env'} " in plan
    assert f"would install torch: {CPU_LINE}\n" in plan
    # by default, the checkout the script is in (volunteerd is not on the package index)
    assert f"would install volunteerd from the checkout {ROOT}\n" in plan
    # empty or relative: invalid (the XDG spec), as volunteerd/paths.py reads it
    for invalid in ("", "relative"):
        env["XDG_DATA_HOME"] = invalid
        plan = run_script(INSTALL, "--dry-run", "--torch", "cpu", env=env).stdout
        default = tmp_path / "home/.local/share/volunteerd/env"
        assert f"would create the environment {default} " in plan


def test_install_offers_amd_gpus_the_rocm_build(tmp_path: Path) -> None:
    tools = fake_machine(tmp_path / "bin", system="Linux", machine="x86_64", gpu=False)
    env = user_environment(tmp_path / "home", path_prefix=tools)
    plan = run_script(INSTALL, "--dry-run", "--torch", "rocm", env=env).stdout
    assert f"would install torch: {ROCM_LINE}\n" in plan
    # found by itself when ROCm's rocminfo lists a GPU
    (tools / "rocminfo").write_text("#!/bin/sh\necho '  Name:                    gfx1100'\n")
    (tools / "rocminfo").chmod(0o755)
    plan = run_script(INSTALL, "--dry-run", env=env).stdout
    assert f"would install torch: {ROCM_LINE}\n" in plan


def refused(script: Path, *args: str, env: dict[str, str]) -> str:
    """Run ``script``, which must fail; its error output."""
    done = subprocess.run(
        ["sh", str(script), *args], env=env, capture_output=True, text=True, check=False
    )
    assert done.returncode != 0, done.stdout
    return done.stderr


def test_install_refuses_what_it_cannot_install(tmp_path: Path) -> None:
    tools = fake_machine(tmp_path / "bin", system="Linux", machine="aarch64", gpu=False)
    env = user_environment(tmp_path / "home", path_prefix=tools)
    # a package called "rocm" (or anything else) is not a torch build
    assert "--torch takes auto, cpu, cuda or rocm, not 'banana'" in refused(
        INSTALL, "--dry-run", "--torch", "banana", env=env
    )
    assert "x86_64 Linux only" in refused(INSTALL, "--dry-run", "--torch", "rocm", env=env)
    # a copy of the script without its checkout has nothing to install by default
    alone = tmp_path / "alone" / "install.sh"
    alone.parent.mkdir()
    shutil.copy(INSTALL, alone)
    assert "--source DIR" in refused(alone, "--dry-run", env=env)
    assert not (tmp_path / "home").exists()


@pytest.mark.parametrize("char", ["$", '"', "`", "\\", "\n"])
def test_install_refuses_a_folder_whose_launchers_could_not_run(tmp_path: Path, char: str) -> None:
    """pip writes the environment's launchers as ``exec "<its python>"`` for /bin/sh when
    the path has a space (macOS: always), where these characters are shell syntax."""
    tools = fake_machine(tmp_path / "bin", system="Linux", machine="x86_64", gpu=False)
    env = user_environment(tmp_path / "home", path_prefix=tools)
    env["XDG_DATA_HOME"] = str(tmp_path / f"Jos\u00e9 {char}HOME")
    error = refused(INSTALL, "--dry-run", "--torch", "cpu", env=env)
    assert f"the environment would be '{env['XDG_DATA_HOME']}/volunteerd/env'" in error
    assert "breaks the launchers pip writes there" in error
    # spaces and letters outside ASCII: installed there
    env["XDG_DATA_HOME"] = str(tmp_path / "Jos\u00e9 M\u00fcller 100%")
    plan = run_script(INSTALL, "--dry-run", "--torch", "cpu", env=env).stdout
    assert f"would create the environment {env['XDG_DATA_HOME']}/volunteerd/env " in plan


FAKE_PYTHON = r"""#!/bin/sh
[ "$1" = -m ] || exec "REAL" "$@"
printf 'python %s\n' "$*" >>"$FAKE_LOG"
case "python $*" in $FAKE_FAIL) exit 1 ;; esac
if [ "$2" = venv ]; then
    mkdir -p "$3/bin" && cp "$FAKES/python" "$FAKES/volunteerd" "$3/bin/"
fi
"""
FAKE_VOLUNTEERD = r"""#!/bin/sh
printf 'volunteerd %s\n' "$*" >>"$FAKE_LOG"
case "volunteerd $*" in $FAKE_FAIL) exit 3 ;; esac
case $1 in --version) echo "volunteerd 0.0.0" ;; dashboard) exit 1 ;; esac
"""


def stand_ins(tmp_path: Path) -> tuple[dict[str, str], Path]:
    """A new user's environment with stand-ins for Python and volunteerd, which note
    each call (but ``python -c``, run by the real Python) in the returned log: ``-m venv
    DIR`` makes an environment of stand-ins, ``-m pip`` does nothing. A call matching
    the shell pattern ``FAKE_FAIL`` fails (python with 1, volunteerd with 3)."""
    tools = fake_machine(tmp_path / "bin", system="Linux", machine="x86_64", gpu=False)
    log = tmp_path / "calls.log"
    (tools / "python").write_text(FAKE_PYTHON.replace("REAL", sys.executable))
    (tools / "volunteerd").write_text(FAKE_VOLUNTEERD)
    for tool in ("python", "volunteerd"):
        (tools / tool).chmod(0o755)
    env = user_environment(tmp_path / "home", path_prefix=tools)
    env.update(FAKES=str(tools), FAKE_LOG=str(log), FAKE_FAIL="")
    return env, log


def installed_stand_in(env: dict[str, str]) -> Path:
    """An installed environment of stand-ins; its folder."""
    env_dir = Path(env["HOME"]) / ".local" / "share" / "volunteerd" / "env"
    (env_dir / "bin").mkdir(parents=True)
    for tool in ("python", "volunteerd"):
        shutil.copy(Path(env["FAKES"]) / tool, env_dir / "bin" / tool)
    return env_dir


def calls(log: Path) -> list[str]:
    """The calls noted, without pip's options."""
    return [line.replace(" --quiet", "").strip() for line in log.read_text().splitlines()]


def test_a_failed_upgrade_puts_the_installed_volunteerd_back(tmp_path: Path) -> None:
    env, log = stand_ins(tmp_path)
    installed_stand_in(env)
    wheel = tmp_path / "volunteerd-9.0-py3-none-any.whl"
    wheel.touch()

    # pip cannot reach the index: the daemon is not even stopped
    env["FAKE_FAIL"] = "python -m pip * install --quiet --upgrade pip"
    said = refused(INSTALL, "--wheel", str(wheel), env=env)
    assert "the installed volunteerd was not touched" in said
    assert not any("volunteerd service" in call for call in calls(log))

    # nor when the checkout's wheel cannot be built
    checkout = tmp_path / "checkout"
    checkout.mkdir()
    (checkout / "pyproject.toml").write_text('[project]\nname = "volunteerd"\n')
    env["FAKE_FAIL"] = "python -m pip * wheel *"
    log.unlink()
    assert "not touched" in refused(INSTALL, "--source", str(checkout), env=env)
    assert not any("volunteerd service" in call for call in calls(log))

    # installing the wheel fails once the daemon is stopped: its autostart is put back
    env["FAKE_FAIL"] = f"python -m pip * install --quiet --upgrade {wheel}"
    log.unlink()
    said = refused(INSTALL, "--wheel", str(wheel), "--no-tray", env=env)
    assert calls(log)[-3:] == [
        f"python -m pip --disable-pip-version-check install --upgrade {wheel}",
        "volunteerd --version",
        "volunteerd service install --no-tray",
    ]
    assert "volunteerd service uninstall" in calls(log)
    assert "volunteerd is back as it was before" in said

    # the new volunteerd's `service install` refuses (an invalid configuration): said so
    env["FAKE_FAIL"] = "volunteerd service install*"
    said = refused(INSTALL, "--wheel", str(wheel), env=env)
    assert "volunteerd is stopped and does not start at login" in said
    assert calls(log)[-1] == "volunteerd service install"


def test_recreating_the_environment_stops_the_daemon_first(tmp_path: Path) -> None:
    env, log = stand_ins(tmp_path)
    env_dir = installed_stand_in(env)
    python = str(Path(env["FAKES"]) / "python")
    wheel = tmp_path / "volunteerd-9.0-py3-none-any.whl"
    wheel.touch()

    # another Python: the installed volunteerd stops itself before its folder goes
    run_script(INSTALL, "--wheel", wheel, "--python", python, env=env)
    done = calls(log)
    assert done.index("volunteerd service uninstall") < done.index(f"python -m venv {env_dir}")

    # its Python is gone: the daemon named in the data folder's lock is stopped ...
    (env_dir / "bin" / "python").unlink()
    (env_dir / "bin" / "python").symlink_to(tmp_path / "gone")
    (env_dir / "bin" / "volunteerd").write_text(f"#!{tmp_path / 'gone'}\n")
    data_dir = env_dir.parent
    keep = ["import time", "time.sleep(60)"]
    daemon = subprocess.Popen([sys.executable, "-c", ";".join(keep), "volunteerd", "serve"])
    tray = subprocess.Popen(["sleep", "60"])  # ... but not another program with its pid
    try:
        (data_dir / "volunteerd.lock").write_text(f"{daemon.pid}\n")
        (data_dir / "tray.pid").write_text(f"{tray.pid}\n")
        log.unlink()
        said = run_script(INSTALL, "--wheel", wheel, "--python", python, env=env).stdout
        assert daemon.wait(5) == -signal.SIGTERM
        assert tray.poll() is None
        assert f"stopping the running volunteerd daemon (pid {daemon.pid})" in said
        assert said.index(f"(pid {daemon.pid})") < said.index("removing the old environment")
    finally:
        daemon.kill()
        tray.kill()
        daemon.wait()
        tray.wait()


def test_relative_xdg_folders_are_ignored(tmp_path: Path) -> None:
    """The XDG Base Directory spec: a relative value is not a folder, it is ignored."""
    tools = fake_machine(tmp_path / "bin", system="Linux", machine="x86_64", gpu=False)
    (tools / "systemctl").write_text("#!/bin/sh\nexit 1\n")
    (tools / "systemctl").chmod(0o755)
    home = tmp_path / "home"
    env = user_environment(home, path_prefix=tools)
    env.update(XDG_DATA_HOME="data", XDG_CONFIG_HOME="config", XDG_CACHE_HOME="cache")
    cwd = tmp_path / "cwd"
    kept = [cwd / folder / "volunteerd" for folder in ("data", "config", "cache")]
    purged = [home / folder / "volunteerd" for folder in (".local/share", ".config", ".cache")]
    for folder in kept + purged:
        folder.mkdir(parents=True)

    done = subprocess.run(
        ["sh", str(INSTALL), "--dry-run"], cwd=cwd, env=env, capture_output=True, text=True
    )
    env_dir = home / ".local" / "share" / "volunteerd" / "env"
    assert f"would create the environment {env_dir} " in done.stdout, done.stdout + done.stderr
    done = subprocess.run(
        ["sh", str(UNINSTALL), "--purge"], cwd=cwd, env=env, capture_output=True, text=True
    )
    assert done.returncode == 0, done.stdout + done.stderr
    assert [folder for folder in purged if folder.exists()] == []
    assert [folder for folder in kept if folder.exists()] == kept


def test_shell_scripts_pass_shellcheck() -> None:
    if shutil.which("shellcheck") is None:
        pytest.skip("shellcheck is missing (apt install shellcheck)")
    done = subprocess.run(
        ["shellcheck", *map(str, SHELL_SCRIPTS)], capture_output=True, text=True, check=False
    )
    assert done.returncode == 0, done.stdout + done.stderr


def test_powershell_scripts_parse_and_are_ascii() -> None:
    """No PowerShell runs here (none in Debian's archive or on PyPI): tree-sitter's
    PowerShell grammar parses the scripts instead, and is shown to reject a broken one.
    Windows PowerShell 5.1 reads a script without a byte-order mark in the ANSI code
    page: the scripts keep to ASCII."""
    tree_sitter = pytest.importorskip("tree_sitter")
    grammar = pytest.importorskip("tree_sitter_powershell")
    parser = tree_sitter.Parser(tree_sitter.Language(grammar.language()))

    def errors(source: bytes) -> list[str]:
        found: list[str] = []
        stack = [parser.parse(source).root_node]
        while stack:
            node = stack.pop()
            if node.type == "ERROR" or node.is_missing:
                line = node.start_point[0] + 1
                found.append(f"line {line}: {node.text.decode(errors='replace')[:60]!r}")
            stack.extend(node.children)
        return found

    for script in POWERSHELL_SCRIPTS:
        source = script.read_bytes()
        assert source.isascii(), f"{script.name} is not ASCII"
        assert errors(source) == [], script.name
        assert b"Set-StrictMode -Version Latest" in source
        broken = source.replace(b"Set-StrictMode -Version Latest\n", b"Set-StrictMode -Version (\n")
        assert errors(broken), f"a broken {script.name} parses: the check checks nothing"


def test_the_windows_command_shim_names_no_absolute_path() -> None:
    """cmd reads ``volunteerd.cmd`` in the OEM code page, and ``Set-Content -Encoding
    ASCII`` writes "?" for every other letter: a shim naming the environment's full path
    fails under ``C:\\Users\\José Müller``. It names the program through
    %LOCALAPPDATA% (cmd expands it), where the script puts the environment; and no
    ASCII or ANSI write anywhere in the scripts interpolates a path."""
    source = (INSTALLERS / "install.ps1").read_text()
    every = "\n".join(script.read_text() for script in POWERSHELL_SCRIPTS)
    writes = re.findall(r"^.*(?:Set-Content|Add-Content|Out-File).*$", every, re.MULTILINE)
    assert writes, "install.ps1 writes no shim: the check checks nothing"
    for line in writes:
        encoding = re.search(r"-Encoding\s+(\w+)", line)
        assert encoding, f"no -Encoding (Windows PowerShell 5.1 picks one): {line}"
        if encoding[1].lower() in {"ascii", "default", "oem"}:
            value = re.search(r"-Value\s+'[^'$]*'\s*$", line)
            assert value, f"not a literal in an {encoding[1]} write: {line}"
    (shim,) = [line for line in writes if "$Shim" in line]
    text = re.search(r"-Value '([^']*)'", shim)
    assert text, shim
    assert text[1] == '@"%LOCALAPPDATA%\\volunteerd\\env\\Scripts\\volunteerd.exe" %*'
    assert re.search(r"[A-Za-z]:\\", text[1]) is None
    # ...which is where the script installs it
    assert '$Base = Join-Path $env:LOCALAPPDATA "volunteerd"' in source
    assert '$EnvDir = Join-Path $Base "env"' in source
    assert '$Volunteerd = Join-Path $EnvDir "Scripts\\volunteerd.exe"' in source


def dpkg(*args: str) -> subprocess.CompletedProcess[str]:
    """dpkg, waiting while another package manager holds its lock."""
    deadline = time.monotonic() + 300
    while True:
        done = subprocess.run(
            ["dpkg", *args], capture_output=True, text=True, timeout=SCRIPT_TIMEOUT_S, check=False
        )
        if done.returncode == 0 or "lock" not in done.stderr or time.monotonic() > deadline:
            return done
        time.sleep(2)


@pytest.mark.slow
@pytest.mark.timeout(1200)
def test_debian_package_installs_runs_and_removes_cleanly(wheel: Path, tmp_path: Path) -> None:
    if shutil.which("dpkg-deb") is None or shutil.which("dpkg") is None:
        pytest.skip("needs dpkg and dpkg-deb (a Debian system)")
    if os.geteuid() != 0:
        pytest.skip("installs into /opt and /usr with dpkg: needs root (CI's container is)")
    if dpkg("--status", "volunteerd").returncode == 0:
        pytest.skip("a volunteerd package is installed on this machine: not replacing it")

    started = time.monotonic()
    done = subprocess.run(
        # the session's wheel: built once for both installers' tests
        ["bash", str(BUILD_DEB), "--out", str(tmp_path), "--wheel", str(wheel)],
        capture_output=True,
        text=True,
        timeout=SCRIPT_TIMEOUT_S,
        check=False,
    )
    assert done.returncode == 0, done.stdout + done.stderr
    (deb,) = tmp_path.glob("volunteerd_*.deb")
    print(f"deb build: {time.monotonic() - started:.0f} s, {deb.stat().st_size / 2**20:.0f} MiB")
    fields = subprocess.run(
        ["dpkg-deb", "--field", str(deb), "Package", "Architecture", "Depends"],
        capture_output=True,
        text=True,
        check=True,
    ).stdout
    assert "Package: volunteerd\n" in fields
    assert re.search(r"^Depends: python3\.\d+, ", fields, re.MULTILINE), fields

    started = time.monotonic()
    installed = dpkg("--install", str(deb))
    assert installed.returncode == 0, installed.stdout + installed.stderr
    print(f"deb install: {time.monotonic() - started:.0f} s")
    owned = dpkg("--listfiles", "volunteerd").stdout.splitlines()
    try:
        assert "systemctl --user enable --now volunteerd" in installed.stdout
        version = subprocess.run(
            ["/usr/bin/volunteerd", "--version"], capture_output=True, text=True, check=True
        ).stdout
        assert version.startswith("volunteerd ")
        unit = Path("/usr/lib/systemd/user/volunteerd.service")
        assert "ExecStart=/usr/bin/volunteerd serve\n" in unit.read_text()
        check_unit_file(unit)
        check_desktop_entry(Path("/usr/share/applications/volunteerd-tray.desktop"))

        # The daemon runs on Debian's Python with the package's own libraries.
        home = tmp_path / "home"
        (home / ".config" / "volunteerd").mkdir(parents=True)
        (home / ".config" / "volunteerd" / "config.toml").write_text(CONFIG)
        ready, log = tmp_path / "ready.json", tmp_path / "daemon.log"
        with log.open("w") as output:
            daemon = subprocess.Popen(
                ["/usr/bin/volunteerd", "serve", "--ready-file", str(ready)],
                env=user_environment(home),
                stdout=output,
                stderr=subprocess.STDOUT,
            )
        try:
            deadline = time.monotonic() + 60
            while not ready.exists():
                assert daemon.poll() is None, log.read_text()
                assert time.monotonic() < deadline, f"not started:\n{log.read_text()}"
                time.sleep(0.1)
            status = ControlClient.for_data_dir(home / ".local" / "share" / "volunteerd").status()
            assert status.experts == ["ffn.0.0", "ffn.1.0"]
        finally:
            daemon.send_signal(signal.SIGTERM)
            daemon.wait(30)
    finally:
        removed = dpkg("--remove", "volunteerd")
    assert removed.returncode == 0, removed.stdout + removed.stderr
    assert dpkg("--status", "volunteerd").returncode != 0
    assert not Path("/opt/volunteerd").exists()
    assert not Path("/usr/bin/volunteerd").is_symlink()
    assert [p for p in owned if Path(p).is_file() or Path(p).is_symlink()] == []
