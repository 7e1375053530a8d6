"""Length-prefixed frames: a fixed prefix, a JSON header, then raw tensor buffers.

::

    offset  size  field
    0       2     magic b"VD"
    2       1     version (1)
    3       1     flags (reserved, 0)
    4       4     header length H, unsigned little-endian
    8       8     body length B, unsigned little-endian
    16      H     header: UTF-8 JSON of a pydantic model (extra fields forbidden)
    16+H    B     body: the tensor buffers back to back, in header order, little-endian

Both lengths are checked against the caps before anything is allocated. This module
is pure: reading from a stream lives in ``volunteerd.net``.
"""

from __future__ import annotations

import struct
from collections.abc import Sequence
from dataclasses import dataclass
from typing import TypeVar

from pydantic import BaseModel, ValidationError

from volunteerd.errors import FrameTooLarge, MalformedFrame, UnsupportedVersion

__all__ = [
    "MAGIC",
    "PREFIX",
    "VERSION",
    "FrameSizes",
    "decode_header",
    "encode_frame",
    "parse_prefix",
]

MAGIC = b"VD"
VERSION = 1
PREFIX = struct.Struct("<2sBBIQ")

M = TypeVar("M", bound=BaseModel)


@dataclass(frozen=True, slots=True)
class FrameSizes:
    header_bytes: int
    body_bytes: int


def encode_frame(
    header: BaseModel, buffers: Sequence[bytes | bytearray | memoryview] = ()
) -> bytes:
    """One frame as bytes: prefix, the header's JSON, then ``buffers`` in order."""
    header_json = header.model_dump_json().encode()
    body_len = sum(memoryview(b).nbytes for b in buffers)
    return b"".join(
        [PREFIX.pack(MAGIC, VERSION, 0, len(header_json), body_len), header_json, *buffers]
    )


def parse_prefix(prefix: bytes, *, max_header_bytes: int, max_body_bytes: int) -> FrameSizes:
    """Check the 16-byte prefix and the sizes it declares against the caps."""
    if len(prefix) != PREFIX.size:
        raise MalformedFrame(f"frame prefix has {len(prefix)} bytes, expected {PREFIX.size}")
    magic, version, flags, header_len, body_len = PREFIX.unpack(prefix)
    if magic != MAGIC:
        raise MalformedFrame("not a volunteerd frame (bad magic)")
    if version != VERSION:
        raise UnsupportedVersion(f"frame version {version} is not supported (we speak {VERSION})")
    if flags != 0:
        raise MalformedFrame(f"unknown frame flags {flags:#x}")
    if header_len == 0:
        raise MalformedFrame("empty frame header")
    if header_len > max_header_bytes:
        raise FrameTooLarge(f"header of {header_len} bytes exceeds the cap of {max_header_bytes}")
    if body_len > max_body_bytes:
        raise FrameTooLarge(f"body of {body_len} bytes exceeds the cap of {max_body_bytes}")
    return FrameSizes(header_len, body_len)


def decode_header(model: type[M], raw: bytes | bytearray | memoryview) -> M:
    """Validate a header's JSON against ``model``; any failure is MalformedFrame.

    The RPC server decodes every request header with this (tests/unit/test_fuzz.py)."""
    try:
        # strict: "64" or 64.0 is not a dimension, "yes" not a flag (docs/security.md)
        return model.model_validate_json(bytes(raw), strict=True)
    except ValidationError as exc:
        first = exc.errors()[0]
        # A key is the sender's text (an unknown one of 65,000 characters went into the
        # log whole): its start says which well enough.
        where = ".".join(_cut(str(p), _SHOWN_KEY) for p in first["loc"]) or "header"
        message = f"bad {model.__name__} header: {where}: {first['msg']}"
        raise MalformedFrame(_cut(message, _SHOWN_MESSAGE)) from None
    except ValueError as exc:  # e.g. undecodable text, should pydantic not wrap it
        raise MalformedFrame(_cut(f"bad {model.__name__} header: {exc}", _SHOWN_MESSAGE)) from None


_SHOWN_KEY = 64  # characters of a header key a refusal quotes
_SHOWN_MESSAGE = 400  # characters of a refusal of a header


def _cut(text: str, most: int) -> str:
    return text if len(text) <= most else f"{text[:most]}…"
