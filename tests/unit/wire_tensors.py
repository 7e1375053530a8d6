"""Tensors as a request carries them, for tests that call the runtime directly."""

from __future__ import annotations

import torch

from volunteerd.experts import to_wire
from volunteerd.wire import WireTensor


def wire(*tensors: torch.Tensor) -> list[WireTensor]:
    """Each tensor encoded as on the wire (float32), in a buffer of its own."""
    out = []
    for tensor in tensors:
        meta, data = to_wire(tensor)
        out.append(WireTensor(meta.dtype, meta.shape, memoryview(bytearray(data))))
    return out
