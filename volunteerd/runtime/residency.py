"""Where the hosted experts live while a volunteer pauses: off the compute device.

``release_device`` moves every hosted expert's weights, gradient buffers and optimizer
state to the CPU and returns the device's cached memory to the driver, so a paused
daemon leaves the GPU to its owner; ``restore_device`` moves them back. On a CPU-only
machine the moves are no-ops, but the same path runs. Both run each move on the device
worker in its turn, after the queued optimizer steps, so no batch sees half-moved
weights. The caller stops new requests first and lets the ones in flight finish.
"""

from __future__ import annotations

import logging

import torch

from volunteerd.runtime.service import ExpertRuntime

__all__ = ["release_device", "restore_device"]

logger = logging.getLogger(__name__)

_CPU = torch.device("cpu")


async def release_device(runtime: ExpertRuntime) -> None:
    """Move the experts to the CPU and free the device's cached memory."""
    await runtime.settled()
    runtime.retained.clear()  # kept forwards hold activations (and weight aliases)
    for uid in runtime.uids:
        await runtime.with_expert(uid, lambda backend: backend.move_to(_CPU))
    await runtime.executor.run(lambda: _empty_cache(runtime.device))
    logger.info("released %s: %d experts moved to the CPU", runtime.device, len(runtime.uids))


async def restore_device(runtime: ExpertRuntime) -> None:
    """Move the experts back to the runtime's device."""
    for uid in runtime.uids:
        await runtime.with_expert(uid, lambda backend: backend.move_to(runtime.device))
    logger.info("%d experts back on %s", len(runtime.uids), runtime.device)


def _empty_cache(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)
        # cuBLAS's workspaces (one per handle and stream, 32 MiB each on an H200: 65 MiB
        # of the cache stayed allocated without this) go back too; cuBLAS takes new ones
        # at its next call. A private torch call, hence the care.
        clear_workspaces = getattr(torch._C, "_cuda_clearCublasWorkspaces", None)
        if clear_workspaces is not None:
            clear_workspaces()
        torch.cuda.empty_cache()
    elif device.type == "mps":
        torch.mps.empty_cache()
