"""batch=-1 or a fraction such as 0.7: the micro-batch from the device's memory, with nbs kept, so accumulate follows.

Each rank measures its own device with yoloaccum's micro-step (forward, window loss, backward) on synthetic images,
in the layout, precision and checkpointing it trains with, and fits memory against images as Ultralytics' AutoBatch
does (ultralytics.utils.autobatch.autobatch: the probe sizes, a linear fit, a fraction of the free memory, at most
1024); all ranks then take the smallest result, so the global batch divides over them.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch
from torch import nn

from yoloaccum.config.settings import Config, is_auto_batch
from yoloaccum.core import backoff
from yoloaccum.core.buffers import kept
from yoloaccum.core.micro_batch import model_input
from yoloaccum.distributed import ddp as distributed
from yoloaccum.distributed.ddp import Context

DEFAULT_FRACTION = 0.6  # batch=-1, as Ultralytics
CPU_MICRO_BATCH = 16  # per device where there is no CUDA memory to measure: Ultralytics' default there
MAX_MICRO_BATCH = 1024  # Ultralytics' cap
GIB = 1 << 30


@dataclass(frozen=True)
class Choice:
    """The global micro-batch a run trains with, and why: what the run's first line and `plan` say."""

    batch: int
    reason: str


def fraction_of(batch: float) -> float:
    return batch if 0 < batch < 1 else DEFAULT_FRACTION


def cpu_choice(cfg: Config, world_size: int) -> Choice:
    """On the CPU there is no device memory to measure: Ultralytics' default, stated as such (within nbs)."""
    per_device = min(CPU_MICRO_BATCH, micro_batch_cap(cfg.nbs, 1 << 30, world_size))
    return Choice(
        per_device * world_size,
        f"batch={cfg.batch:g} measures CUDA memory; on the CPU the micro-batch is {per_device} per device, as in "
        f"Ultralytics{' within nbs' if per_device < CPU_MICRO_BATCH else ''} (give batch=N to choose)",
    )


def choose(cfg: Config, ctx: Context, model: nn.Module, loss, amp: bool, max_objects: int, num_images: int) -> Choice:
    """The global micro-batch for an AutoBatch config: measured on every rank's device, the smallest result taken."""
    assert is_auto_batch(cfg.batch)
    if ctx.device.type != "cuda":
        return cpu_choice(cfg, ctx.world_size)
    fraction = fraction_of(cfg.batch)
    free, total = torch.cuda.mem_get_info(ctx.device)
    available = free + torch.cuda.memory_reserved(ctx.device)  # what this process holds is available to it
    sizes = (1, 2, 4, 8, 16) if total < 16 * GIB else (1, 2, 4, 8, 16, 32, 64)
    peaks = measure(model, loss, cfg.imgsz, amp, ctx.device, sizes, max_objects)
    cap = micro_batch_cap(cfg.nbs, num_images, ctx.world_size)
    held_later = state_bytes(model, cfg.optimizer, ctx.world_size)  # allocated after the probe, kept for the run
    per_device, per_image, base = fit(peaks, fraction * available - held_later, cap)
    mine = per_device
    t = torch.tensor([per_device], device=ctx.device)
    if ctx.world_size > 1:  # a sync point, once per run: every rank takes the smallest device's micro-batch
        torch.distributed.all_reduce(t, op=torch.distributed.ReduceOp.MIN)
    per_device = int(t.item())
    reason = (
        f"batch={cfg.batch:g}: {fraction:.0%} of the {available / GIB:.1f} GiB free on {ctx.device} fits "
        f"{mine} images ({per_image / 2**20:.0f} MiB per image above {base / GIB:.2f} GiB, measured with "
        f"yoloaccum's micro-step at {cfg.imgsz} px{', AMP' if amp else ''}"
        f"{', grad_checkpointing' if cfg.grad_checkpointing else ''})"
    )
    if ctx.world_size > 1:
        reason += f"; the smallest of {ctx.world_size} devices: {per_device} per device"
    return Choice(per_device * ctx.world_size, reason)


def for_run(cfg: Config, ctx: Context, ckpt: dict | None, model: nn.Module, loss, amp: bool, dataset) -> Choice | None:
    """The Trainer's choice: None for batch=N; on resume, the micro-batch the run chose when it began."""
    if not is_auto_batch(cfg.batch):
        return None
    if ckpt is not None:
        batch = ckpt["yoloaccum"]["schedule"]["batch"]
        return Choice(batch, f"batch={cfg.batch:g}: {batch}, as the run chose when it began")
    return choose(cfg, ctx, model, loss, amp, max_objects(dataset), len(dataset))


def micro_batch_cap(nbs: int, num_images: int, world_size: int) -> int:
    """The most images per device batch=-1 may choose: the global micro-batch stays within nbs, so accumulate is at
    least 1 and the effective batch is the recipe's (as the README says), and within the dataset."""
    return max(1, min(MAX_MICRO_BATCH, num_images // world_size, nbs // world_size))


# Tensors the optimizer keeps per weight: momentum for SGD-type (MuSGD's orthogonalisation keeps no more), the two
# moments for Adam-type; "auto" may choose AdamW.
OPTIMIZER_SLOTS = {
    "SGD": 1,
    "MuSGD": 1,
    "RMSProp": 2,
    "Adam": 2,
    "AdamW": 2,
    "NAdam": 2,
    "RAdam": 2,
    "Adamax": 2,
    "auto": 2,
}


def state_bytes(model: nn.Module, optimizer: str, world_size: int) -> int:
    """Device memory the run holds beside what one micro-step peaks at, which the probe cannot see: the optimizer's
    state (allocated at its first step), and under DDP the gradient buckets (one copy of the gradients). SyncBatchNorm
    adds per-channel statistics only, which is nothing beside these."""
    weights = sum(p.numel() * p.element_size() for p in model.parameters() if p.requires_grad)
    slots = {k.lower(): v for k, v in OPTIMIZER_SLOTS.items()}.get(str(optimizer).lower(), 2)
    return weights * (slots + (world_size > 1))


def fit(peaks: dict[int, int], budget: float, cap: int) -> tuple[int, float, float]:
    """Images per device whose peak memory, by a linear fit of the measured peaks, stays within budget bytes; never
    above a size that ran out of memory, nor above cap. Returns (images, bytes per image, bytes at zero images)."""
    ok = sorted((b, p) for b, p in peaks.items() if p is not None)
    assert ok, "the smallest probe did not fit; measure() raises then"
    per_image, base = np.polyfit(*zip(*ok), deg=1) if len(ok) > 1 else (ok[0][1], 0.0)
    images = int((budget - base) / per_image) if per_image > 0 else cap
    failed = [b for b, p in peaks.items() if p is None]
    if failed:
        images = min(images, min(failed) - 1)
    return max(1, min(images, cap)), float(per_image), float(base)


def measure(
    model: nn.Module, loss, imgsz: int, amp: bool, device: torch.device, sizes: tuple[int, ...], max_objects: int
) -> dict[int, int | None]:
    """Peak bytes one micro-step reserves at each size (None: out of memory, and no larger size is tried).

    Reserved, not allocated: the caching allocator holds blocks beyond the tensors alive, and what it reserves is
    what the device no longer has. A cuBLAS or cuDNN allocation failure counts as out of memory, as in the back-off.

    The micro-step is engine.Engine.micro_step's: model_input, forward and loss under autocast, backward. The model's
    gradients and BatchNorm statistics are put back as they were: probing changes nothing the run computes."""
    from yoloaccum.errors import UserError

    peaks: dict[int, int | None] = {}
    with kept(model):
        for b in sizes:
            torch.cuda.empty_cache()
            torch.cuda.reset_peak_memory_stats(device)
            try:
                batch = synthetic_batch(b, imgsz, max_objects, device)
                batch["img"] = model_input(batch["img"], device)
                with torch.autocast(device.type, enabled=amp):
                    value = loss(model(batch["img"]), batch)[0]
                value.backward()
                peaks[b] = torch.cuda.max_memory_reserved(device)
            except RuntimeError as e:
                if not backoff.is_out_of_memory(e):
                    raise
                peaks[b] = None
            model.zero_grad(set_to_none=True)
            if peaks[b] is None:
                break
    torch.cuda.empty_cache()
    if peaks.get(sizes[0]) is None:
        raise UserError(
            f"one image does not fit in {device}'s free memory; free the GPU, lower imgsz, or set "
            "grad_checkpointing=True"
        )
    return peaks


def synthetic_batch(num_images: int, imgsz: int, max_objects: int, device: torch.device) -> dict[str, torch.Tensor]:
    """num_images random images with max_objects boxes each: the most the loss's assigner sees in one image."""
    g = torch.Generator().manual_seed(0)
    k = num_images * max_objects
    xy, wh = torch.rand(k, 2, generator=g) * 0.6 + 0.2, torch.rand(k, 2, generator=g) * 0.2 + 0.05
    return {
        "img": torch.randint(0, 255, (num_images, 3, imgsz, imgsz), dtype=torch.uint8, generator=g),
        "batch_idx": torch.arange(num_images).repeat_interleave(max_objects).float().to(device),
        "cls": torch.zeros(k, 1, device=device),
        "bboxes": torch.cat([xy, wh], 1).to(device),
    }


def max_objects(dataset) -> int:
    """The most boxes one training image can hold: the dataset's most per image, times 4 for mosaic (as Ultralytics)."""
    return max((len(label["cls"]) for label in dataset.labels), default=1) * 4 or 1


def for_plan(cfg: Config, num_images: int, spec) -> Choice:
    """`yoloaccum plan batch=-1`: the same measurement, in this process, on the first listed device; a run under DDP
    measures every device and may take less. Without a dataset (images=N), each image gets 4 boxes (one, times 4
    for mosaic)."""
    from yoloaccum.core import loss
    from yoloaccum.data import datasets as data
    from yoloaccum.model import build as model

    ctx = Context(0, 0, distributed.world_size(cfg.device), distributed.select_device(cfg.device))
    if ctx.device.type != "cuda":
        return cpu_choice(cfg, ctx.world_size)
    raw = model.build(cfg, spec, announce=False).to(ctx.device)
    if cfg.channels_last:
        raw.to(memory_format=torch.channels_last)
    if cfg.grad_checkpointing:
        model.checkpoint_blocks(raw)
    objects = max_objects(data.build_dataset(cfg.replace(batch=16), spec, "train")) if spec.train else 4
    single = Context(0, 0, 1, ctx.device)
    choice = choose(cfg, single, raw.train(), loss.WindowLoss(raw, cfg.norm), cfg.amp, objects, num_images)
    return Choice(choice.batch * ctx.world_size, choice.reason + f"; {ctx.world_size} device(s)")
