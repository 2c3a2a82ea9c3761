"""Out-of-memory errors: which errors mean the device is full, and where a back-off cannot run a window again.

The back-off itself is the Engine's (Engine._back_off): a window that runs out of device memory is dropped and run
again at half the micro-batch. The schedule is not touched. Its iterations stay the loader's batches, so the window
ends, the warmup ramp, the lr, the momentum and the weight decay stay as planned; only each batch is now run as
`engine.split` consecutive micro-batches, so twice the micro-batches make the same window of the same images, and
the window-normalised gradient is that of the planned batch.
"""

from __future__ import annotations

import torch

from yoloaccum.errors import UserError

# CUDA reports some allocation failures as other errors: cuBLAS and cuDNN allocate workspaces of their own, and fail
# with these texts when the device is full. Ultralytics' trainer treats the same texts as out of memory.
OUT_OF_MEMORY_TEXTS = (
    "CUBLAS_STATUS_ALLOC_FAILED",
    "CUDNN_STATUS_INTERNAL_ERROR",
    "CUDNN_STATUS_ALLOC_FAILED",
    "unable to find an engine",
)


def is_out_of_memory(e: BaseException) -> bool:
    """Whether an error means the device ran out of memory: torch.OutOfMemoryError, or a CUDA library's failure to
    allocate (OUT_OF_MEMORY_TEXTS)."""
    if isinstance(e, torch.OutOfMemoryError):
        return True
    return isinstance(e, RuntimeError) and any(text in str(e) for text in OUT_OF_MEMORY_TEXTS)


def has_sync_bn(model: torch.nn.Module) -> bool:
    return any(isinstance(m, torch.nn.SyncBatchNorm) for m in model.modules())


def check_can_back_off(engine, ni: int, last_in_window: bool) -> None:
    """Refuse, with what to do instead, a back-off that cannot run the window again as it ran."""
    if engine.ctx.world_size > 1 and has_sync_bn(engine.model):
        raise UserError(  # this rank would run more micro-steps than the others: their collectives would not match
            f"out of memory at iteration {ni} with bn=sync: under DDP one rank cannot run its batch as smaller "
            "micro-batches, since SyncBatchNorm's collectives must match on every rank; resume with "
            "grad_checkpointing=True or a smaller batch"
        )
    if last_in_window and engine.ctx.world_size > 1:
        raise UserError(  # DDP's reducer may have started all-reducing this backward's buckets: no way back
            f"out of memory at iteration {ni}, in the backward that all-reduces the window's gradients, which cannot "
            "run again; resume with grad_checkpointing=True or a smaller batch"
        )
    if engine.window_batches is None:
        raise UserError(
            f"out of memory at iteration {ni}, in a window reopened from last.pt, whose first batches cannot run "
            "again; resume with grad_checkpointing=True or a smaller batch"
        )


def check_room(per_device: int, ni: int) -> None:
    """A micro-batch of one image cannot be halved."""
    if per_device <= 1:
        raise UserError(
            f"out of memory at iteration {ni} with 1 image per device; free the GPU, lower imgsz, or set "
            "grad_checkpointing=True"
        )


def in_the_step(ni: int) -> UserError:
    """Out of memory in the optimizer step or the EMA update: the weights or the EMA may be half updated, so the window
    cannot run again as a micro-step can."""
    return UserError(
        f"out of memory in the optimizer step or EMA update at iteration {ni}, after the window's micro-batches "
        "fitted; last.pt holds the last saved state. Resume with grad_checkpointing=True (activations then leave room "
        "for the optimizer's state), or start again with a smaller batch or optimizer=SGD (one state tensor per "
        "weight; AdamW keeps two)"
    )
