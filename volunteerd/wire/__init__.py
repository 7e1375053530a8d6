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
    BackwardBatchRequest,
    BackwardRequest,
    BatchReply,
    ErrorReply,
    ExpertInfo,
    ForwardBatchRequest,
    ForwardRequest,
    InfoRequest,
    TensorReply,
    Uid,
)
from volunteerd.wire.tensors import (
    DTYPE_SIZES,
    FLOAT_DTYPES,
    Compression,
    DType,
    TensorMeta,
    TensorSchema,
    WireTensor,
    check_against_schema,
    on_wire,
    split_body,
)

__all__ = [
    "DTYPE_SIZES",
    "FLOAT_DTYPES",
    "MAGIC",
    "PREFIX",
    "VERSION",
    "BackwardBatchRequest",
    "BackwardRequest",
    "BatchReply",
    "Compression",
    "DType",
    "ErrorReply",
    "ExpertInfo",
    "ForwardBatchRequest",
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
    "on_wire",
    "parse_prefix",
    "split_body",
]
