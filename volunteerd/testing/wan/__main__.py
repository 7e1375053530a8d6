"""`python -m volunteerd.testing.wan`: a WAN to use by hand.

up --profile home --hosts 4 [--seed 0] [--mtu 1500] [--nat 1=symmetric ...]
    start the WAN, print its hosts and how to run commands inside them, and keep it
    up until Ctrl-C (or SIGTERM); then everything it made is deleted
profiles
    list the built-in profiles
"""

from __future__ import annotations

import argparse
import contextlib
import os
import signal
import sys

from volunteerd.testing.wan.profile import BUILTIN, NAT_KINDS, Profile, ProfileError
from volunteerd.testing.wan.world import WanUnavailable, open_wan, running_namespaces


def _nat(text: str) -> tuple[int, str]:
    index, _, kind = text.partition("=")
    if not index.isdigit() or kind not in NAT_KINDS:
        raise argparse.ArgumentTypeError(
            f"expected HOST=KIND ({'|'.join(NAT_KINDS)}), not {text!r}"
        )
    return int(index), kind


def _parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="python -m volunteerd.testing.wan")
    verbs = parser.add_subparsers(dest="verb", required=True)
    up = verbs.add_parser("up", help="start a WAN and keep it up until Ctrl-C")
    up.add_argument("--profile", default="home", help="built-in name or TOML file")
    up.add_argument("--hosts", type=int, default=4)
    up.add_argument("--seed", type=int, default=0)
    up.add_argument("--mtu", type=int, default=1500)
    up.add_argument("--nat", type=_nat, action="append", default=[], metavar="HOST=KIND")
    run = verbs.add_parser("exec", help="run a command inside a host of a running WAN")
    run.add_argument("--owner", type=int, help="the pid of the `up` whose WAN is meant")
    run.add_argument("host", type=int)
    run.add_argument("command", nargs=argparse.REMAINDER)
    shell = verbs.add_parser("shell", help="a shell inside a host of a running WAN")
    shell.add_argument("--owner", type=int, help="the pid of the `up` whose WAN is meant")
    shell.add_argument("host", type=int)
    verbs.add_parser("profiles", help="list the built-in profiles")
    return parser


def _enter(owner: int | None, host: int, command: list[str]) -> int:
    names = running_namespaces()
    owners = {pid for pid, _, _ in names} if owner is None else {owner}
    if len(owners) != 1:
        found = ", ".join(str(pid) for pid in sorted(owners)) or "none"
        print(f"error: say which WAN with --owner PID (running: {found})", file=sys.stderr)
        return 2
    matching = [name for pid, index, name in names if pid in owners and index == host]
    if len(matching) != 1:
        print(f"error: no single host {host} in the WANs of {owners.pop()}", file=sys.stderr)
        return 2
    os.execvp("ip", ["ip", "netns", "exec", matching[0], *(command or ["true"])])


def main(argv: list[str] | None = None) -> int:
    args = _parser().parse_args(argv)
    if args.verb == "exec":
        return _enter(args.owner, args.host, args.command)
    if args.verb == "shell":
        return _enter(args.owner, args.host, [os.environ.get("SHELL", "/bin/sh")])
    if args.verb == "profiles":
        for name, profile in BUILTIN.items():
            print(f"{name:10} {profile.description}")
        return 0
    # started in the background by a shell, SIGINT arrives ignored: Ctrl-C/kill -INT
    # should still end the WAN
    signal.signal(signal.SIGINT, signal.default_int_handler)
    try:
        profile = Profile.load(args.profile)
        for index, kind in args.nat:
            profile = profile.override(index, nat=kind)
        with open_wan(profile, hosts=args.hosts, seed=args.seed, mtu=args.mtu) as wan:
            print(f"WAN {profile.name!r}: {len(wan.hosts)} hosts (Ctrl-C ends it)")
            for host in wan.hosts:
                link = host.link
                behind = "" if link.nat == "none" else f" behind {link.nat} NAT as {host.address}"
                print(
                    f"  host {host.index}  {host.public_address:15}{behind}  "
                    f"{link.delay_ms:.0f}±{link.jitter_ms:.0f} ms  "
                    f"{link.down_mbit:g} down/{link.up_mbit:g} up Mbit/s  loss {link.loss:.2%}"
                )
            print(
                f"run inside host 0:  ip netns exec {wan.hosts[0].namespace} COMMAND\n"
                f"               or:  python -m volunteerd.testing.wan exec --owner "
                f"{os.getpid()} 0 COMMAND"
            )
            sys.stdout.flush()
            with contextlib.suppress(KeyboardInterrupt, SystemExit):
                signal.pause()  # open_wan turns SIGTERM into SystemExit
            for stats in wan.stats():
                print(
                    f"  host {stats.index}: sent {stats.sent_packets} received "
                    f"{stats.received_packets} lost {stats.lost} queue-dropped "
                    f"{stats.queue_dropped} NAT-dropped {stats.nat_dropped}"
                )
    except (ProfileError, WanUnavailable) as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    return 0


if __name__ == "__main__":
    sys.exit(main())
