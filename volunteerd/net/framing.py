"""Reading whole frames from a stream, with every size capped.

A clean close between frames is ``None`` and a close inside a frame is
``MalformedFrame`` ("truncated").
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Protocol

from volunteerd.config import WireLimits
from volunteerd.errors import MalformedFrame
from volunteerd.wire import PREFIX, parse_prefix

__all__ = ["RawFrame", "Readable", "read_exactly", "read_frame_rest", "read_prefix"]


class Readable(Protocol):
    """What reading frames needs of a stream (``transport.Stream`` has it)."""

    async def read(self, n: int) -> bytes: ...


@dataclass(slots=True)
class RawFrame:
    header: bytes
    body: memoryview


async def read_exactly(stream: Readable, n: int, *, started: bool) -> bytearray | None:
    """Exactly ``n`` bytes. If the stream ends before the first byte and ``started`` is
    False, returns None (a clean close); any other early end is a truncated frame.

    The bytes are kept as they arrive, not in a buffer allocated for ``n`` up front: a
    peer that declares a large frame and then trickles holds only what it sent. Large
    pieces are kept as they came and joined once at the end (appending them to one
    buffer copied a 2 MiB frame several times over as it grew); small ones are appended
    to a buffer (kept one by one, a byte trickled at a time would cost ~40 bytes each).
    """
    parts: list[bytes | bytearray] = []
    small = bytearray()
    got = 0
    while got < n:
        chunk = await stream.read(n - got)
        if not chunk:
            if not got and not started:
                return None
            raise MalformedFrame(f"stream ended inside a frame ({got} of {n} bytes)")
        got += len(chunk)
        if len(chunk) < _LARGE:
            small += chunk
            continue
        if small:
            parts.append(small)
            small = bytearray()
        parts.append(chunk)
    if not parts:
        return small
    if small:
        parts.append(small)
    return bytearray().join(parts)


_LARGE = 16 * 1024  # a piece kept as it came rather than appended


async def read_prefix(stream: Readable) -> bytearray | None:
    """The next frame's 16-byte prefix, or None if the peer closed between frames."""
    return await read_exactly(stream, PREFIX.size, started=False)


async def read_frame_rest(
    stream: Readable,
    prefix: bytes,
    limits: WireLimits,
    *,
    max_body_bytes: int | None = None,
    check_header: Callable[[bytes], None] | None = None,
) -> RawFrame:
    """Header and body of the frame whose prefix was just read (caps checked first: the
    body's is ``max_body_bytes``, ``limits.max_body_bytes`` if None). ``check_header``
    is called with the header before the body is read: what it raises leaves the body
    unread."""
    body_cap = limits.max_body_bytes if max_body_bytes is None else max_body_bytes
    sizes = parse_prefix(prefix, max_header_bytes=limits.max_header_bytes, max_body_bytes=body_cap)
    if check_header is not None:
        header = await read_exactly(stream, sizes.header_bytes, started=True)
        if header is None:  # pragma: no cover - started=True never returns None
            raise MalformedFrame("stream ended inside a frame")
        check_header(bytes(header))
        body = await read_exactly(stream, sizes.body_bytes, started=True)
        if body is None:  # pragma: no cover
            raise MalformedFrame("stream ended inside a frame")
        return RawFrame(header=bytes(header), body=memoryview(body))
    rest = await read_exactly(stream, sizes.header_bytes + sizes.body_bytes, started=True)
    if rest is None:  # pragma: no cover - started=True never returns None
        raise MalformedFrame("stream ended inside a frame")
    view = memoryview(rest)
    return RawFrame(header=bytes(view[: sizes.header_bytes]), body=view[sizes.header_bytes :])
