"""Out-of-memory back-off: a window that runs out of device memory is dropped and run again at half the micro-batch.

The schedule is not touched. Its iterations stay the loader's batches, so the window ends, the warmup ramp, the lr,
the momentum and the weight decay stay as planned; only each batch is now run as `engine.split` consecutive
micro-batches, so twice the micro-batches make the same window of the same images, and the window-normalised
gradient is that of the planned batch.
"""

from __future__ import annotations

from typing import Any

import torch

from yoloaccum import distributed
from yoloaccum.errors import UserError
from yoloaccum.schedule import even_cuts

# Per-label tensors of a collated detection batch, indexed by batch_idx rather than by image.
LABEL_KEYS = ("batch_idx", "cls", "bboxes")

# CUDA reports some allocation failures as other errors: cuBLAS and cuDNN allocate workspaces of their own, and fail
# with these texts when the device is full. Ultralytics' trainer treats the same texts as out of memory.
OUT_OF_MEMORY_TEXTS = ("CUBLAS_STATUS_ALLOC_FAILED", "CUDNN_STATUS_INTERNAL_ERROR", "CUDNN_STATUS_ALLOC_FAILED",
                       "unable to find an engine")  # fmt: skip


def is_out_of_memory(e: BaseException) -> bool:
    """Whether an error means the device ran out of memory: torch.OutOfMemoryError, or a CUDA library's failure to
    allocate (OUT_OF_MEMORY_TEXTS)."""
    if isinstance(e, torch.OutOfMemoryError):
        return True
    return isinstance(e, RuntimeError) and any(text in str(e) for text in OUT_OF_MEMORY_TEXTS)


def has_sync_bn(model: torch.nn.Module) -> bool:
    return any(isinstance(m, torch.nn.SyncBatchNorm) for m in model.modules())


def micro_steps(engine, ni: int, batch: dict[str, Any], last_in_window: bool) -> torch.Tensor:
    """Forward and backward loader batch ni, the newest of engine.window_batches. On an out-of-memory error, back off
    and run the window again from its first batch, as often as it takes; returns the loss items of batch ni."""
    try:
        return engine.iteration(ni, batch, last_in_window)
    except RuntimeError as e:
        if not is_out_of_memory(e):
            raise
    # Outside the except block: its traceback, whose frames hold the failed step's tensors, is gone.
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
    window = engine.window_batches
    if window is None:
        raise UserError(
            f"out of memory at iteration {ni}, in a window reopened from last.pt, whose first batches cannot run "
            "again; resume with grad_checkpointing=True or a smaller batch"
        )
    failed = ni
    while True:
        back_off(engine, failed)
        first, k = ni - len(window) + 1, 0
        try:
            if engine.after_back_off is not None:  # compile=: the new micro-batch sizes, before they run
                engine.after_back_off()
            for k, b in enumerate(window):
                items = engine.iteration(first + k, b, last_in_window and k == len(window) - 1)
            return items
        except RuntimeError as e:
            if not is_out_of_memory(e):
                raise
            failed = first + k


def iteration(engine, ni: int, batch: dict[str, Any], last_in_window: bool) -> torch.Tensor:
    """One loader batch as engine.split micro-steps; DDP all-reduces in the backward of the window's last one only.
    Returns the loss items averaged over the batch's images."""
    parts = chunks(batch, engine.split)
    items = 0.0
    for j, part in enumerate(parts):
        skip = engine.no_sync and not (last_in_window and j == len(parts) - 1)
        with distributed.no_sync(engine.model, skip=skip):
            items = items + engine.micro_step(part) * part["img"].shape[0]
    return items / batch["img"].shape[0]


def chunks(batch: dict[str, Any], parts: int) -> list[dict[str, Any]]:
    """A collated batch cut into `parts` batches of consecutive images, sizes differing by at most one; none empty.

    New dicts, so that micro_step, which replaces "img" by the device copy, leaves the kept batch on the host."""
    n = batch["img"].shape[0]
    if parts == 1:
        return [dict(batch)]
    out = []
    cuts = even_cuts(n, parts)
    for a, b in zip(cuts, cuts[1:]):
        if a == b:
            continue
        part = {}
        if "batch_idx" in batch:
            keep = (batch["batch_idx"] >= a) & (batch["batch_idx"] < b)
            part.update({k: batch[k][keep] for k in LABEL_KEYS if k in batch})
            part["batch_idx"] = part["batch_idx"] - a
        for k, v in batch.items():
            if k not in part:
                part[k] = v[a:b] if isinstance(v, (torch.Tensor, list, tuple)) and len(v) == n else v
        out.append(part)
    return out


def back_off(engine, ni: int) -> None:
    """Drop the window so far (its gradients, counts and BatchNorm statistics) and halve the micro-batch."""
    per_device = -(-engine.schedule.micro_batch // engine.split)
    if per_device <= 1:
        raise UserError(
            f"out of memory at iteration {ni} with 1 image per device; free the GPU, lower imgsz, or set "
            "grad_checkpointing=True"
        )
    engine.optimizer.zero_grad(set_to_none=True)
    engine.window_counts.tensor.zero_()
    engine.micro_batches_in_window = 0
    if engine.window_buffers is not None:
        engine.window_buffers.put_back()
    if engine.ctx.device.type == "cuda":
        torch.cuda.empty_cache()  # give the failed step's cached blocks back before the smaller micro-batches run
    engine.split *= 2
    engine.back_offs.append(ni)
    engine.log(
        f"iteration {ni}: out of memory at {per_device} images per device; the window runs again at "
        f"{micro_batch(engine)} per device, accumulate {engine.schedule.accumulate * engine.split}, the same "
        f"{engine.schedule.effective_batch} images per step"
    )


def micro_batch(engine) -> int:
    """Images per device in one forward pass now: the schedule's micro-batch cut engine.split ways (rounded up)."""
    return -(-engine.schedule.micro_batch // engine.split)
