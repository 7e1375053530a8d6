"""The wire format: frames, message headers and tensor buffers. Pure: no I/O, no torch."""

from __future__ import annotations

from volunteerd.wire.frames import (
    MAGIC,
    PREFIX,
    VERSION,
    FrameSizes,
    decode_header,
    encode_frame,
    parse_prefix,
)
from volunteerd.wire.messages import (
    BackwardRequest,
    ErrorReply,
    ExpertInfo,
    ForwardRequest,
    InfoRequest,
    TensorReply,
    Uid,
)
from volunteerd.wire.tensors import (
    DTYPE_SIZES,
    DType,
    TensorMeta,
    TensorSchema,
    WireTensor,
    check_against_schema,
    split_body,
)

__all__ = [
    "DTYPE_SIZES",
    "MAGIC",
    "PREFIX",
    "VERSION",
    "BackwardRequest",
    "DType",
    "ErrorReply",
    "ExpertInfo",
    "ForwardRequest",
    "FrameSizes",
    "InfoRequest",
    "TensorMeta",
    "TensorReply",
    "TensorSchema",
    "Uid",
    "WireTensor",
    "check_against_schema",
    "decode_header",
    "encode_frame",
    "parse_prefix",
    "split_body",
]
