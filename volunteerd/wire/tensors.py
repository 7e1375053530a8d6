"""Tensor descriptors, their byte layout, and checks against an expert's schema.

Pure and torch-free: a tensor on the wire is a ``WireTensor`` (dtype name, shape and a
little-endian buffer). Conversion to and from torch lives in ``volunteerd.experts``.
Only the dtypes in ``DTYPE_SIZES`` and ``q8`` exist; anything else is refused before a
byte of the body is interpreted.

``q8`` is blockwise 8-bit quantization of a floating-point tensor: the flattened values
are cut into blocks of ``Q8_BLOCK`` (the last one may be shorter), and each block travels
as one float32 scale and one signed byte per value, ``value ≈ code * scale``, codes in
[-127, 127]. The buffer holds every block's scale first, then every code, so its size
follows from the shape alone (``q8_nbytes``). Absmax-symmetric rather than min/max with
an offset: what crosses the expert boundary (normalised hidden states, their gradients)
is centred on zero, so the offset would buy little for a second scalar per block, while
symmetric codes keep zero exact (padding rows, zeroed gradients) and the error the same
for either sign. ``split_body`` refuses a q8 buffer that no encoder makes (``check_q8``),
on both sides of a call, so a decoded q8 tensor is always finite.
"""

from __future__ import annotations

import math
import struct
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Annotated, Literal

from pydantic import BaseModel, ConfigDict, Field, model_validator

from volunteerd.errors import BadDtype, BadShape, FrameTooLarge, MalformedFrame

__all__ = [
    "DTYPE_SIZES",
    "FLOAT_DTYPES",
    "MAX_DIM",
    "MAX_NDIM",
    "Q8_BLOCK",
    "Q8_CODE_MAX",
    "Q8_MAX_SCALE",
    "Compression",
    "DType",
    "TensorMeta",
    "TensorSchema",
    "WireDType",
    "WireTensor",
    "check_against_schema",
    "check_q8",
    "on_wire",
    "q8_nbytes",
    "split_body",
]

# What tensors are (an expert's schema), and how they may travel.
DType = Literal["float32", "float16", "bfloat16", "int64"]
WireDType = Literal["float32", "float16", "bfloat16", "int64", "q8"]
# What floating-point tensors are narrowed to on the wire, chosen per request.
Compression = Literal["none", "float16", "bfloat16", "q8"]
FLOAT_DTYPES = frozenset({"float32", "float16", "bfloat16"})
DTYPE_SIZES: dict[str, int] = {"float32": 4, "float16": 2, "bfloat16": 2, "int64": 8}
MAX_NDIM = 8
MAX_DIM = 1 << 31
# The most values the dimensions of a shape may make, its zero dimensions left out:
# far more than any frame carries, and torch's strides (int64) still exact. A tensor of
# (0, 2**31, ..., 2**31) takes no bytes and passed every size check, then torch.empty
# overflowed computing its strides (a RuntimeError out of a trainer's step).
MAX_SPAN = 1 << 48
# Values per q8 block: a 4-byte scale per 64 values is 6 % on top of the codes, and a
# block small enough that one outlier coarsens only its 63 neighbours.
Q8_BLOCK = 64
Q8_CODE_MAX = 127
# The largest block scale, a float32 whose codes still dequantize to finite float32
# values (float32's max / 127 itself does not: 127 times it rounds up to infinity).
Q8_MAX_SCALE: float = struct.unpack(
    "<f", struct.pack("<f", 3.4028234663852886e38 / 127 * (1 - 2**-20))
)[0]
# Non-negative float32s are ordered as their bit patterns; a negative one, NaN or an
# infinity has a pattern above this one.
_Q8_MAX_SCALE_BITS: int = struct.unpack("<I", struct.pack("<f", Q8_MAX_SCALE))[0]

Dim = Annotated[int, Field(ge=0, le=MAX_DIM)]


class TensorMeta(BaseModel):
    """What the header says about one tensor buffer in the body."""

    model_config = ConfigDict(frozen=True, extra="forbid")

    dtype: WireDType
    shape: Annotated[tuple[Dim, ...], Field(max_length=MAX_NDIM)]

    @model_validator(mode="after")
    def _spans_what_torch_can_make(self) -> TensorMeta:
        # Only a shape with a zero in it can be vast and still fit a body: any other
        # takes its values' bytes, bounded by the body cap (a quick test first: every
        # header of every request passes here).
        if 0 in self.shape and math.prod(d for d in self.shape if d) > MAX_SPAN:
            raise ValueError(f"shape {list(self.shape)}: more values than any tensor has")
        return self

    @property
    def numel(self) -> int:
        return math.prod(self.shape)

    @property
    def nbytes(self) -> int:
        if self.dtype == "q8":
            return q8_nbytes(self.numel)
        return self.numel * DTYPE_SIZES[self.dtype]


def q8_nbytes(numel: int) -> int:
    """Bytes of a q8 buffer of ``numel`` values: a float32 scale per started block, then
    a byte per value."""
    return 4 * -(-numel // Q8_BLOCK) + numel


class TensorSchema(BaseModel):
    """What an expert accepts: a dtype and a shape where ``None`` is a free dimension.

    The first dimension is the batch (samples) dimension.
    """

    model_config = ConfigDict(frozen=True, extra="forbid")

    dtype: DType
    shape: Annotated[tuple[Dim | None, ...], Field(min_length=1, max_length=MAX_NDIM)]


@dataclass(frozen=True, slots=True)
class WireTensor:
    dtype: str
    shape: tuple[int, ...]
    data: memoryview

    @property
    def meta(self) -> TensorMeta:
        return TensorMeta(dtype=self.dtype, shape=self.shape)  # type: ignore[arg-type]


def split_body(metas: Sequence[TensorMeta], body: memoryview) -> list[WireTensor]:
    """Cut ``body`` into the buffers ``metas`` describe; sizes must add up exactly."""
    expected = sum(m.nbytes for m in metas)
    if expected != body.nbytes:
        raise MalformedFrame(
            f"header describes {expected} bytes of tensors but the body has {body.nbytes}"
        )
    out: list[WireTensor] = []
    offset = 0
    for meta in metas:
        end = offset + meta.nbytes
        if meta.dtype == "q8":
            check_q8(body[offset:end], meta.numel)
        out.append(WireTensor(meta.dtype, meta.shape, body[offset:end]))
        offset = end
    return out


def check_q8(data: memoryview, numel: int) -> None:
    """Refuse (MalformedFrame) a q8 buffer of ``numel`` values that no encoder makes: a
    block scale that is negative (-0 too), NaN, infinite or above ``Q8_MAX_SCALE``, or
    a code of -128. Two scans in C; the wire is little-endian, as the machine must be
    (``volunteerd.experts`` refuses to load on any other)."""
    if data.nbytes != q8_nbytes(numel):
        raise MalformedFrame(f"a q8 tensor of {numel} values takes {q8_nbytes(numel)} bytes")
    scales = 4 * -(-numel // Q8_BLOCK)
    if scales and max(data[:scales].cast("B").cast("I")) > _Q8_MAX_SCALE_BITS:
        raise MalformedFrame("q8 tensor: a block scale is negative, not finite, or too large")
    if b"\x80" in data[scales:].tobytes():
        raise MalformedFrame(f"q8 tensor: code {-Q8_CODE_MAX - 1} is not a q8 code")


def on_wire(dtype: str, compression: Compression) -> str:
    """The wire dtype a tensor of ``dtype`` travels in under ``compression``: floating
    point ones are narrowed (or quantized, ``q8``), integers never."""
    return compression if compression != "none" and dtype in FLOAT_DTYPES else dtype


def check_against_schema(
    metas: Sequence[TensorMeta],
    schemas: Sequence[TensorSchema],
    *,
    max_samples: int,
    max_sequence: int | None = None,
    same_batch: bool = True,
    compression: Compression = "none",
) -> int:
    """Check tensors against an expert's schema; returns the batch size.

    With ``compression``, floating-point tensors must travel in that dtype instead of
    the schema's. Raises BadDtype, BadShape, or FrameTooLarge when the batch exceeds
    ``max_samples`` or another dimension the schema leaves open (a sequence) exceeds
    ``max_sequence``: only the body cap bounded a sequence, and one request of a million
    tokens kept a transformer expert's device busy for an hour (attention is quadratic).
    With ``same_batch`` every tensor must have the same first dimension.
    """
    if len(metas) != len(schemas):
        raise BadShape(f"expected {len(schemas)} tensors, got {len(metas)}")
    batch = None
    for i, (meta, schema) in enumerate(zip(metas, schemas, strict=True)):
        expected = on_wire(schema.dtype, compression)
        if meta.dtype != expected:
            raise BadDtype(f"tensor {i}: dtype {meta.dtype} where {expected} is expected")
        if len(meta.shape) != len(schema.shape) or any(
            want is not None and got != want
            for got, want in zip(meta.shape, schema.shape, strict=True)
        ):
            pretty = tuple("*" if d is None else d for d in schema.shape)
            raise BadShape(f"tensor {i}: shape {meta.shape} does not match {pretty}")
        if max_sequence is not None:
            for got, want in zip(meta.shape[1:], schema.shape[1:], strict=True):
                if want is None and got > max_sequence:
                    raise FrameTooLarge(
                        f"tensor {i}: a sequence of {got} exceeds the cap of {max_sequence}"
                    )
        if batch is None:
            batch = meta.shape[0]
        elif same_batch and meta.shape[0] != batch:
            raise BadShape(f"tensor {i}: batch size {meta.shape[0]} differs from {batch}")
    if batch is None or batch == 0:
        raise BadShape("empty batch")
    if batch > max_samples:
        raise FrameTooLarge(f"batch of {batch} samples exceeds the cap of {max_samples}")
    return batch
