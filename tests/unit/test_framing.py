"""Reading whole frames from a stream (net/framing.py): the bytes as they arrived, in
pieces of any size, and a clear error for a stream that ends inside a frame."""

from __future__ import annotations

import os

import pytest

from volunteerd.errors import MalformedFrame
from volunteerd.net.framing import read_exactly


class Pieces:
    """A stream that hands out the given pieces, one per read (never more than asked),
    then ends."""

    def __init__(self, pieces: list[bytes]) -> None:
        self.pieces = pieces

    async def read(self, n: int) -> bytes:
        if not self.pieces:
            return b""
        piece = self.pieces.pop(0)
        if len(piece) > n:
            self.pieces.insert(0, piece[n:])
            piece = piece[:n]
        return piece


@pytest.mark.parametrize(
    "sizes",
    [
        [5],
        [64 * 1024],
        [1] * 300,  # trickled a byte at a time
        [20_000, 3, 1, 40_000, 7, 65_536, 2],  # large and small mixed
        [3, 2, 20_000],
        [16 * 1024 - 1, 16 * 1024, 16 * 1024 + 1],  # around the size kept as it came
    ],
)
async def test_the_bytes_come_back_whole_and_in_order(sizes: list[int]) -> None:
    data = os.urandom(sum(sizes))
    pieces, at = [], 0
    for size in sizes:
        pieces.append(data[at : at + size])
        at += size
    got = await read_exactly(Pieces(pieces), len(data), started=False)  # type: ignore[arg-type]
    assert isinstance(got, bytearray)
    assert got == data


async def test_a_frame_is_read_without_what_follows_it() -> None:
    stream = Pieces([b"abcdef" * 5000])
    assert await read_exactly(stream, 10, started=True) == b"abcdefabcd"  # type: ignore[arg-type]
    assert await read_exactly(stream, 2, started=True) == b"ef"  # type: ignore[arg-type]


async def test_a_clean_close_between_frames_is_none_and_inside_one_an_error() -> None:
    assert await read_exactly(Pieces([]), 16, started=False) is None  # type: ignore[arg-type]
    with pytest.raises(MalformedFrame, match="inside a frame"):
        await read_exactly(Pieces([]), 16, started=True)  # type: ignore[arg-type]
    with pytest.raises(MalformedFrame, match=r"\(20003 of 30000 bytes\)"):
        await read_exactly(Pieces([b"x" * 20_000, b"abc"]), 30_000, started=False)  # type: ignore[arg-type]
