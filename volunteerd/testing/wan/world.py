"""`open_wan`: hosts in network namespaces, joined by the router process."""

from __future__ import annotations

import atexit
import contextlib
import functools
import json
import os
import re
import shutil
import signal
import subprocess
import sys
import threading
from collections.abc import Iterator, Sequence
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import IO, Any

from volunteerd.testing.wan.packet import address_str
from volunteerd.testing.wan.profile import LinkSpec, Profile
from volunteerd.testing.wan.router import delete_namespace

NAMESPACE_PREFIX = "vdwan"
# vdwan<owner pid>w<wan number in that process>h<host index>
_NAMESPACE = re.compile(rf"^{NAMESPACE_PREFIX}(\d+)w\d+h(\d+)$")
_PUBLIC_BASE = 0x0AC80000  # 10.200.0.0/16: public addresses, 10.200.0.1 is host 0
_READY_TIMEOUT_S = 60.0
_wan_numbers = iter(range(1 << 30))
# The router runs this package's modules without the parent packages' __init__:
# `volunteerd.testing` imports the daemon and torch, seconds of start-up that a packet
# forwarder does not need.
_ROUTER_BOOTSTRAP = """
import sys, types
for name, path in {packages!r}:
    module = types.ModuleType(name)
    module.__path__ = [path]
    sys.modules[name] = module
from volunteerd.testing.wan.router import main
sys.exit(main())
"""


class WanUnavailable(RuntimeError):
    """This machine cannot run the emulator (not root, no `ip netns`, no TUN)."""


@dataclass(frozen=True, slots=True)
class WanAvailability:
    """True when the emulator can run here; else `reason` says why not."""

    reason: str = ""

    def __bool__(self) -> bool:
        return not self.reason


@functools.cache
def wan_available() -> WanAvailability:
    """Whether `open_wan` can work here: root, `ip netns` and /dev/net/tun."""
    if sys.platform != "linux":
        return WanAvailability("the WAN emulator needs Linux network namespaces")
    if os.geteuid() != 0:
        return WanAvailability("the WAN emulator needs root (network namespaces, TUN)")
    if shutil.which("ip") is None:
        return WanAvailability("the WAN emulator needs iproute2's `ip`")
    if subprocess.run(["ip", "netns", "list"], capture_output=True, check=False).returncode:
        return WanAvailability("`ip netns list` fails: no network namespaces here")
    try:
        os.close(os.open("/dev/net/tun", os.O_RDWR))
    except OSError as exc:
        return WanAvailability(f"cannot open /dev/net/tun: {exc.strerror}")
    return WanAvailability()


@dataclass(frozen=True, slots=True)
class HostStats:
    """What crossed one host's link since the WAN opened (see `router.Counters`)."""

    index: int
    sent_packets: int
    sent_bytes: int
    received_packets: int
    received_bytes: int
    lost: int
    queue_dropped: int
    nat_dropped: int
    unroutable: int


@dataclass(frozen=True, slots=True)
class WanHost:
    """One host: a network namespace with one link to the rest of the WAN."""

    index: int
    namespace: str
    # what this host's sockets bind to: its private address when behind NAT
    address: str
    # what other hosts dial: its NAT's public address, else `address`
    public_address: str
    link: LinkSpec
    _wan: Wan = field(repr=False, compare=False)

    def argv(self, args: Sequence[str]) -> list[str]:
        """`args` as a command line that runs inside this host."""
        return ["ip", "netns", "exec", self.namespace, *args]

    def popen(self, args: Sequence[str], **kwargs: Any) -> subprocess.Popen[Any]:
        """Start `args` inside this host; the WAN kills it, if still running, on close."""
        process: subprocess.Popen[Any] = subprocess.Popen(self.argv(args), **kwargs)
        self._wan._processes.append(process)
        return process

    def run(self, args: Sequence[str], **kwargs: Any) -> subprocess.CompletedProcess[Any]:
        """`subprocess.run(args, **kwargs)` inside this host."""
        return subprocess.run(self.argv(args), **kwargs)


class Wan:
    """A running WAN; made by `open_wan`, which closes it."""

    def __init__(self, router: subprocess.Popen[bytes], hosts: list[WanHost]) -> None:
        self._router = router
        self.hosts = hosts
        self._processes: list[subprocess.Popen[Any]] = []
        self._lock = threading.Lock()
        self._closed = False

    def stats(self) -> list[HostStats]:
        """Per-host counters, a snapshot from the router."""
        stdin, stdout = _pipes(self._router)
        with self._lock:
            stdin.write(b"stats\n")
            stdin.flush()
            line = stdout.readline()
        if not line:
            raise RuntimeError("the WAN router has exited")
        counters = json.loads(line)
        return [HostStats(index=i, **entry) for i, entry in enumerate(counters)]

    def close(self) -> None:
        """Kill what runs in the hosts, stop the router, delete the namespaces."""
        if self._closed:
            return
        self._closed = True
        for process in self._processes:
            if process.poll() is None:
                process.kill()
            with contextlib.suppress(subprocess.TimeoutExpired):
                process.wait(timeout=10)
            _close_pipes(process)
        with contextlib.suppress(OSError):
            _pipes(self._router)[0].close()  # the router deletes the namespaces on EOF
        try:
            self._router.wait(timeout=30)
        except subprocess.TimeoutExpired:
            self._router.kill()
            self._router.wait()
        _close_pipes(self._router)
        for host in self.hosts:
            delete_namespace(host.namespace)  # in case the router could not


def _pipes(router: subprocess.Popen[bytes]) -> tuple[IO[bytes], IO[bytes]]:
    if router.stdin is None or router.stdout is None:
        raise RuntimeError("the WAN router was started without pipes")
    return router.stdin, router.stdout


def _close_pipes(process: subprocess.Popen[Any]) -> None:
    for pipe in (process.stdin, process.stdout, process.stderr):
        if pipe is not None:
            with contextlib.suppress(OSError):
                pipe.close()


def _wan_namespaces() -> list[tuple[int, int, str]]:
    """(owner pid, host index, name) of every WAN namespace on this machine."""
    listed = subprocess.run(["ip", "netns", "list"], capture_output=True, text=True, check=False)
    found = []
    for line in listed.stdout.splitlines():
        name = line.split(" ", 1)[0]
        match = _NAMESPACE.match(name)
        if match is not None:
            found.append((int(match.group(1)), int(match.group(2)), name))
    return found


def running_namespaces() -> list[tuple[int, int, str]]:
    """(owner pid, host index, name) of the namespaces of WANs whose owner lives."""
    return [entry for entry in _wan_namespaces() if _alive(entry[0])]


def sweep_stale_namespaces() -> list[str]:
    """Delete the namespaces of WANs whose owner process is gone; returns their names."""
    swept = []
    for owner, _, name in _wan_namespaces():
        if not _alive(owner):
            delete_namespace(name)
            swept.append(name)
    return swept


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


def _profile(links: Profile | LinkSpec | Sequence[LinkSpec] | str | Path) -> Profile:
    if isinstance(links, Profile):
        return links
    if isinstance(links, LinkSpec):
        return Profile.of(links)
    if isinstance(links, str | Path):
        return Profile.load(links)
    profile = Profile.of(LinkSpec())
    for index, spec in enumerate(links):
        profile = profile.override(index, **asdict(spec))
    return profile


def _public_address(index: int) -> str:
    return address_str(_PUBLIC_BASE + index + 1)


@contextlib.contextmanager
def open_wan(
    links: Profile | LinkSpec | Sequence[LinkSpec] | str | Path = "lan",
    hosts: int | None = None,
    seed: int = 0,
    mtu: int = 1500,
) -> Iterator[Wan]:
    """A WAN of `hosts` hosts whose links `links` describes: a `Profile`, a built-in
    profile's name or a TOML file's path, one `LinkSpec` for every host, or one per host
    (then `hosts` defaults to their number). `seed` draws the profile's ranges and the
    router's loss and jitter. Host i's public address is 10.200.0.(i+1) (and on).

    Leaving the block kills what the hosts still run and deletes every namespace; so
    does SIGTERM (while no other handler is set) or interpreter exit, and if this process
    is killed outright the router notices and cleans up; the next `open_wan` sweeps
    whatever a crash still left.

    Raises `WanUnavailable` when `wan_available()` is false, `ProfileError` for bad links.
    """
    availability = wan_available()
    if not availability:
        raise WanUnavailable(availability.reason)
    profile = _profile(links)
    if hosts is None:
        hosts = len(links) if isinstance(links, Sequence) and not isinstance(links, str) else 1
    specs = profile.link_specs(hosts, seed)
    sweep_stale_namespaces()
    prefix = f"{NAMESPACE_PREFIX}{os.getpid()}w{next(_wan_numbers)}h"
    router = subprocess.Popen(
        [sys.executable, "-c", _router_bootstrap()],
        stdin=subprocess.PIPE,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        # Ctrl-C reaches us, not it: we clean up first, then close its stdin
        start_new_session=True,
    )
    wan = Wan(router, [])
    for index, spec in enumerate(specs):
        public = _public_address(index)
        private = f"192.168.{index % 256}.2" if spec.nat != "none" else public
        wan.hosts.append(WanHost(index, f"{prefix}{index}", private, public, spec, wan))
    previous_sigterm = _catch_sigterm()
    atexit.register(wan.close)
    try:
        _start(router, {"seed": seed, "mtu": mtu, "hosts": [_entry(h) for h in wan.hosts]})
        yield wan
    finally:
        wan.close()
        atexit.unregister(wan.close)
        if previous_sigterm is not None:
            signal.signal(signal.SIGTERM, previous_sigterm)


def _entry(host: WanHost) -> dict[str, Any]:
    """What the router needs to know of a host."""
    return {
        "namespace": host.namespace,
        "address": host.address,
        "public_address": host.public_address,
        "spec": asdict(host.link),
    }


def _router_bootstrap() -> str:
    here = Path(__file__).resolve().parent
    packages = [
        ("volunteerd", str(here.parents[1])),
        ("volunteerd.testing", str(here.parent)),
    ]
    return _ROUTER_BOOTSTRAP.format(packages=packages)


def _start(router: subprocess.Popen[bytes], config: dict[str, Any]) -> None:
    stdin, stdout = _pipes(router)
    stdin.write(json.dumps(config).encode() + b"\n")
    stdin.flush()
    ready: list[bytes] = []
    reader = threading.Thread(target=lambda: ready.append(stdout.readline()), daemon=True)
    reader.start()
    reader.join(_READY_TIMEOUT_S)
    if ready != [b"ready\n"]:
        router.kill()
        _, stderr = router.communicate()
        raise WanUnavailable(f"the WAN router did not start: {stderr.decode().strip()}")


def _catch_sigterm() -> signal.Handlers | None:
    """Make SIGTERM unwind (so `finally` cleans up) where it would kill outright."""
    if threading.current_thread() is not threading.main_thread():
        return None
    if signal.getsignal(signal.SIGTERM) is not signal.SIG_DFL:
        return None
    signal.signal(signal.SIGTERM, _exit_on_sigterm)
    return signal.SIG_DFL


def _exit_on_sigterm(signum: int, frame: object) -> None:
    raise SystemExit(128 + signum)
