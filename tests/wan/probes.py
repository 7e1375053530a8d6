"""Measuring programs the WAN tests run inside the emulated hosts.

Run as a script (`python tests/wan/probes.py VERB ...`, stdlib only, so each starts in
a fraction of a second); servers print `ready` once bound, results are one JSON line.
"""

from __future__ import annotations

import json
import socket
import struct
import sys
import time

_SEQUENCE = struct.Struct("!Id")  # datagram number, sender's time.time()
_SO_RCVBUFFORCE = 33  # Linux; the socket module does not name it


def _ready() -> None:
    print("ready", flush=True)


def _result(value: object) -> None:
    print(json.dumps(value), flush=True)


def udp_echo(port: str) -> None:
    """Answer every datagram to its sender, forever."""
    sock = socket.socket(socket.AF_INET, socket.SOCK_DGRAM)
    sock.bind(("0.0.0.0", int(port)))
    _ready()
    while True:
        data, peer = sock.recvfrom(65536)
        sock.sendto(data, peer)


def udp_ping(address: str, port: str, count: str) -> None:
    """Round trips of `count` small datagrams, one at a time, in milliseconds."""
    sock = socket.socket(socket.AF_INET, socket.SOCK_DGRAM)
    sock.settimeout(5)
    rtts = []
    for index in range(int(count)):
        sent = time.monotonic()
        sock.sendto(struct.pack("!I", index) + b"p" * 60, (address, int(port)))
        while True:  # skip a late answer to an earlier ping
            data, _ = sock.recvfrom(2048)
            if struct.unpack_from("!I", data)[0] == index:
                break
        rtts.append((time.monotonic() - sent) * 1000)
    _result({"rtt_ms": rtts})


def tcp_sink(port: str, total: str) -> None:
    """Receive `total` bytes on one connection; the rate over the last 80 % (after slow
    start) in Mbit/s of payload."""
    listener = socket.socket()
    listener.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    listener.bind(("0.0.0.0", int(port)))
    listener.listen(1)
    _ready()
    conn, _ = listener.accept()
    want = int(total)
    mark = want // 5
    got = 0
    marked_at = 0.0
    marked_bytes = 0
    while got < want:
        chunk = conn.recv(1 << 20)
        if not chunk:
            break
        got += len(chunk)
        if not marked_at and got >= mark:
            marked_at, marked_bytes = time.monotonic(), got
    elapsed = time.monotonic() - marked_at
    _result({"bytes": got, "mbit_s": (got - marked_bytes) * 8 / elapsed / 1e6})


def tcp_send(address: str, port: str, total: str) -> None:
    """Send `total` bytes on one connection."""
    sock = socket.create_connection((address, int(port)), timeout=30)
    block = b"x" * (1 << 16)
    left = int(total)
    while left > 0:
        left -= sock.send(block[: min(left, len(block))])
    sock.shutdown(socket.SHUT_WR)
    sock.recv(1)
    _result({"sent": int(total)})


def udp_blast(address: str, port: str, count: str, per_s: str, size: str) -> None:
    """Send `count` numbered, timestamped datagrams of `size` bytes, paced at `per_s`."""
    sock = socket.socket(socket.AF_INET, socket.SOCK_DGRAM)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_SNDBUF, 1 << 22)
    padding = b"b" * (int(size) - _SEQUENCE.size)
    start = time.monotonic()
    interval = 1 / float(per_s)
    for index in range(int(count)):
        delay = start + index * interval - time.monotonic()
        if delay > 0:
            time.sleep(delay)
        sock.sendto(_SEQUENCE.pack(index, time.time()) + padding, (address, int(port)))
    _result({"sent": int(count)})


def udp_count(port: str, idle_s: str) -> None:
    """Receive numbered datagrams until none came for `idle_s`; distinct numbers seen and
    the one-way delays (ms) in arrival order."""
    sock = socket.socket(socket.AF_INET, socket.SOCK_DGRAM)
    # room for seconds of datagrams while this process waits for a CPU (root may exceed
    # the rmem_max cap)
    sock.setsockopt(socket.SOL_SOCKET, _SO_RCVBUFFORCE, 1 << 24)
    sock.bind(("0.0.0.0", int(port)))
    _ready()
    seen: set[int] = set()
    delays = []
    sock.settimeout(60)  # the first one
    while True:
        try:
            data = sock.recv(65536)
        except TimeoutError:
            break
        sock.settimeout(float(idle_s))
        index, sent = _SEQUENCE.unpack_from(data)
        seen.add(index)
        delays.append((time.time() - sent) * 1000)
    _result({"received": len(seen), "delay_ms": delays})


def tcp_connect(address: str, port: str, timeout_s: str) -> None:
    """Try one TCP connection; what happened, and the local address it used."""
    sock = socket.socket()
    sock.settimeout(float(timeout_s))
    try:
        sock.connect((address, int(port)))
    except OSError as exc:
        _result({"connected": False, "error": type(exc).__name__})
        return
    _result({"connected": True, "local": list(sock.getsockname()), "echo": sock.recv(100).decode()})


def tcp_observe(port: str) -> None:
    """Accept connections forever; tell each peer the address it arrived from."""
    listener = socket.socket()
    listener.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    listener.bind(("0.0.0.0", int(port)))
    listener.listen(8)
    _ready()
    while True:
        conn, peer = listener.accept()
        conn.sendall(json.dumps(list(peer)).encode())
        conn.close()


def udp_observe(port: str) -> None:
    """Answer each datagram with the address it arrived from, forever."""
    sock = socket.socket(socket.AF_INET, socket.SOCK_DGRAM)
    sock.bind(("0.0.0.0", int(port)))
    _ready()
    while True:
        _, peer = sock.recvfrom(2048)
        sock.sendto(json.dumps(list(peer)).encode(), peer)


def udp_hello(address: str, port: str, local_port: str, wait_s: str) -> None:
    """From `local_port`, send one datagram and report the answer; then report whatever
    else arrives at `local_port` within `wait_s` (a third host knocking)."""
    sock = socket.socket(socket.AF_INET, socket.SOCK_DGRAM)
    sock.bind(("0.0.0.0", int(local_port)))
    sock.settimeout(5)
    sock.sendto(b"hello", (address, int(port)))
    answer, _ = sock.recvfrom(2048)
    print(json.dumps({"observed": json.loads(answer)}), flush=True)
    sock.settimeout(float(wait_s))
    try:
        data, peer = sock.recvfrom(2048)
    except TimeoutError:
        _result({"knock": None})
        return
    _result({"knock": [data.decode(), *peer]})


def udp_knock(address: str, port: str, times: str) -> None:
    """Send `times` datagrams to a port (expecting no answer)."""
    sock = socket.socket(socket.AF_INET, socket.SOCK_DGRAM)
    for _ in range(int(times)):
        sock.sendto(b"knock", (address, int(port)))
        time.sleep(0.05)
    _result({"sent": int(times)})


VERBS = {
    name.replace("_", "-"): function
    for name, function in list(globals().items())
    if callable(function) and function.__module__ == __name__ and not name.startswith("_")
}

if __name__ == "__main__":
    VERBS[sys.argv[1]](*sys.argv[2:])
