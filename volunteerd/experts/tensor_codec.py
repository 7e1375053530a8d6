"""torch tensors to and from wire buffers, without pickle and with one copy at most.

Compression happens here: ``to_wire`` narrows floating-point tensors to float16 or
bfloat16, or quantizes them to ``q8`` (layout in ``volunteerd.wire.tensors``), and
``from_wire`` reads every wire dtype back, ``q8`` as float32. Quantization rounds to
the nearest code, deterministically: every value is within half its block's scale of
what it was, and two replicas that computed the same output send the same bytes (the
trainer compares replicas' answers). Non-finite values cannot be quantized and are
refused (``Rejected``) when encoding; a ``q8`` buffer whose scales or codes no encoder
makes is refused (``MalformedFrame``) before its values are used, so a decoded ``q8``
tensor is always finite.
"""

from __future__ import annotations

import ctypes
import math
import sys

import torch
import torch.nn.functional as F

from volunteerd.errors import BadDtype, MalformedFrame, Rejected
from volunteerd.wire import (
    DTYPE_SIZES,
    Q8_BLOCK,
    Q8_CODE_MAX,
    Q8_MAX_SCALE,
    Compression,
    TensorMeta,
    WireTensor,
    check_q8,
    on_wire,
    q8_nbytes,
)

__all__ = ["TORCH_DTYPES", "from_wire", "to_wire"]

TORCH_DTYPES: dict[str, torch.dtype] = {
    "float32": torch.float32,
    "float16": torch.float16,
    "bfloat16": torch.bfloat16,
    "int64": torch.int64,
}
_NAMES = {v: k for k, v in TORCH_DTYPES.items()}

if sys.byteorder != "little":  # pragma: no cover - every supported platform is little-endian
    raise ImportError("volunteerd's wire format needs a little-endian machine")


def from_wire(tensor: WireTensor, device: torch.device | str = "cpu") -> torch.Tensor:
    """A tensor viewing ``tensor``'s buffer (no copy on CPU; ``q8`` is dequantized to
    float32); moved to ``device``. Raises MalformedFrame for a buffer of the wrong size
    or a ``q8`` buffer no encoder makes."""
    expected = (
        q8_nbytes(math.prod(tensor.shape))
        if tensor.dtype == "q8"
        else math.prod(tensor.shape) * DTYPE_SIZES[tensor.dtype]
    )
    if tensor.data.nbytes != expected:
        raise MalformedFrame(
            f"a {tensor.dtype} tensor of shape {tensor.shape} takes {expected} bytes, "
            f"not {tensor.data.nbytes}"
        )
    try:
        if tensor.dtype == "q8":
            out = _dequantize(tensor)
        elif tensor.data.nbytes == 0:
            out = torch.empty(tensor.shape, dtype=TORCH_DTYPES[tensor.dtype])
        else:
            out = torch.frombuffer(_writable(tensor.data), dtype=TORCH_DTYPES[tensor.dtype])
            out = out.reshape(tensor.shape)
    except (RuntimeError, ValueError, OverflowError) as exc:
        # A shape torch cannot make, even of no bytes (its strides overflow): a
        # descriptor checked on the wire (TensorMeta) never is one; one made here may be.
        raise MalformedFrame(f"a {tensor.dtype} tensor of shape {tensor.shape}: {exc}") from exc
    return out.to(device) if torch.device(device).type != "cpu" else out


def to_wire(tensor: torch.Tensor, compression: Compression = "none") -> tuple[TensorMeta, bytes]:
    """The tensor's descriptor and its bytes (little-endian, C order). Under
    ``compression`` a floating-point tensor travels narrowed or quantized; others as
    they are. Raises BadDtype for a dtype the wire lacks, Rejected for a non-finite
    value under ``q8``."""
    name = _NAMES.get(tensor.dtype)
    if name is None:
        raise BadDtype(f"dtype {tensor.dtype} cannot travel on the wire")
    wire = on_wire(name, compression)
    flat = tensor.detach().to("cpu").contiguous()
    data = _quantize(flat) if wire == "q8" else _bytes(flat.to(TORCH_DTYPES[wire]))
    return TensorMeta(dtype=wire, shape=tuple(flat.shape)), data  # type: ignore[arg-type]


def _quantize(values: torch.Tensor) -> bytes:
    """The q8 buffer of ``values``: the blocks' scales, then the codes."""
    flat = values.reshape(-1).float()
    n = flat.numel()
    blocks_BV = _whole_blocks(flat)
    absmax_B = blocks_BV.abs().amax(dim=1)
    if not bool(torch.isfinite(absmax_B).all()):  # amax keeps a NaN
        raise Rejected("non-finite values cannot be quantized to q8")
    scales_B = (absmax_B / Q8_CODE_MAX).clamp_(max=Q8_MAX_SCALE)
    # A block of zeros has scale 0 and codes 0; dividing by 1 there avoids 0/0.
    divisors_B = torch.where(scales_B > 0, scales_B, 1.0)
    codes_BV = (blocks_BV / divisors_B[:, None]).round_().clamp_(-Q8_CODE_MAX, Q8_CODE_MAX)
    codes = codes_BV.to(torch.int8).view(-1)[:n]
    return _bytes(scales_B) + _bytes(codes)


def _dequantize(tensor: WireTensor) -> torch.Tensor:
    """The float32 values of a q8 buffer of the right size, or MalformedFrame."""
    n = math.prod(tensor.shape)
    if n == 0:
        return torch.empty(tensor.shape, dtype=torch.float32)
    blocks = -(-n // Q8_BLOCK)
    check_q8(tensor.data, n)  # split_body did, for a frame; a tensor made here may not
    data = _writable(tensor.data)
    scales_B = torch.frombuffer(data, dtype=torch.float32, count=blocks)
    codes = torch.frombuffer(data, dtype=torch.int8, count=n, offset=4 * blocks)
    values_BV = _whole_blocks(codes.float()).mul_(scales_B[:, None])
    return values_BV.view(-1)[:n].reshape(tensor.shape)


def _whole_blocks(flat: torch.Tensor) -> torch.Tensor:
    """``flat`` as rows of ``Q8_BLOCK``, the last one padded with zeros (a copy then)."""
    if flat.numel() % Q8_BLOCK:
        flat = F.pad(flat, (0, -flat.numel() % Q8_BLOCK))
    return flat.view(-1, Q8_BLOCK)


def _writable(data: memoryview) -> memoryview | bytearray:
    # torch wants a writable buffer; frames read from the network always are.
    return data if not data.readonly else bytearray(data)


def _bytes(tensor: torch.Tensor) -> bytes:
    nbytes = tensor.numel() * tensor.element_size()
    return ctypes.string_at(tensor.data_ptr(), nbytes) if nbytes else b""
