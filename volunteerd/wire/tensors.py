"""Tensor descriptors, their byte layout, and checks against an expert's schema.

Pure and torch-free: a tensor on the wire is a ``WireTensor`` (dtype name, shape and a
little-endian buffer). Conversion to and from torch lives in ``volunteerd.experts``.
Only the dtypes in ``DTYPE_SIZES`` exist; anything else is refused before a byte of
the body is interpreted.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Annotated, Literal

from pydantic import BaseModel, ConfigDict, Field

from volunteerd.errors import BadDtype, BadShape, FrameTooLarge, MalformedFrame

__all__ = [
    "DTYPE_SIZES",
    "FLOAT_DTYPES",
    "MAX_DIM",
    "MAX_NDIM",
    "Compression",
    "DType",
    "TensorMeta",
    "TensorSchema",
    "WireTensor",
    "check_against_schema",
    "on_wire",
    "split_body",
]

DType = Literal["float32", "float16", "bfloat16", "int64"]
# What floating-point tensors are narrowed to on the wire, chosen per request.
Compression = Literal["none", "float16", "bfloat16"]
FLOAT_DTYPES = frozenset({"float32", "float16", "bfloat16"})
DTYPE_SIZES: dict[str, int] = {"float32": 4, "float16": 2, "bfloat16": 2, "int64": 8}
MAX_NDIM = 8
MAX_DIM = 1 << 31

Dim = Annotated[int, Field(ge=0, le=MAX_DIM)]


class TensorMeta(BaseModel):
    """What the header says about one tensor buffer in the body."""

    model_config = ConfigDict(frozen=True, extra="forbid")

    dtype: DType
    shape: Annotated[tuple[Dim, ...], Field(max_length=MAX_NDIM)]

    @property
    def numel(self) -> int:
        return math.prod(self.shape)

    @property
    def nbytes(self) -> int:
        return self.numel * DTYPE_SIZES[self.dtype]


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
        out.append(WireTensor(meta.dtype, meta.shape, body[offset:end]))
        offset = end
    return out


def on_wire(dtype: str, compression: Compression) -> str:
    """The dtype a tensor of ``dtype`` travels in under ``compression``."""
    return compression if compression != "none" and dtype in FLOAT_DTYPES else dtype


def check_against_schema(
    metas: Sequence[TensorMeta],
    schemas: Sequence[TensorSchema],
    *,
    max_samples: int,
    same_batch: bool = True,
    compression: Compression = "none",
) -> int:
    """Check tensors against an expert's schema; returns the batch size.

    With ``compression``, floating-point tensors must travel in that dtype instead of
    the schema's. Raises BadDtype, BadShape, or FrameTooLarge when the batch exceeds
    ``max_samples``. With ``same_batch`` every tensor must have the same first dimension.
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
        if batch is None:
            batch = meta.shape[0]
        elif same_batch and meta.shape[0] != batch:
            raise BadShape(f"tensor {i}: batch size {meta.shape[0]} differs from {batch}")
    if batch is None or batch == 0:
        raise BadShape("empty batch")
    if batch > max_samples:
        raise FrameTooLarge(f"batch of {batch} samples exceeds the cap of {max_samples}")
    return batch
