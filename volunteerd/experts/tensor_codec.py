"""torch tensors to and from wire buffers, without pickle and with one copy at most."""

from __future__ import annotations

import ctypes
import sys

import torch

from volunteerd.errors import BadDtype
from volunteerd.wire import TensorMeta, WireTensor

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
    """A tensor viewing ``tensor``'s buffer (no copy on CPU); moved to ``device``."""
    dtype = TORCH_DTYPES[tensor.dtype]
    if tensor.data.nbytes == 0:
        out = torch.empty(tensor.shape, dtype=dtype)
    else:
        # torch wants a writable buffer; frames read from the network always are.
        data = tensor.data if not tensor.data.readonly else bytearray(tensor.data)
        out = torch.frombuffer(data, dtype=dtype).reshape(tensor.shape)
    return out.to(device) if torch.device(device).type != "cpu" else out


def to_wire(tensor: torch.Tensor) -> tuple[TensorMeta, bytes]:
    """The tensor's descriptor and its bytes (little-endian, C order)."""
    name = _NAMES.get(tensor.dtype)
    if name is None:
        raise BadDtype(f"dtype {tensor.dtype} cannot travel on the wire")
    flat = tensor.detach().to("cpu").contiguous()
    nbytes = flat.numel() * flat.element_size()
    data = ctypes.string_at(flat.data_ptr(), nbytes) if nbytes else b""
    return TensorMeta(dtype=name, shape=tuple(flat.shape)), data  # type: ignore[arg-type]
