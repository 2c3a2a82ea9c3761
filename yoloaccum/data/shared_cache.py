"""cache=ram under torchrun, once per machine: the first rank of each machine decodes the images into a file in
shared memory (/dev/shm) that every rank of the machine maps, where Ultralytics keeps one copy per rank."""

from __future__ import annotations

import os
import pickle
from pathlib import Path

import numpy as np
import torch

from yoloaccum.distributed import ddp as distributed
from yoloaccum.process.rng import rng_kept

SHM = Path("/dev/shm")


def wanted(cache: bool | str | None, ctx: distributed.Context) -> bool:
    """Whether a dataset with this `cache=` is cached once per machine here: cache=ram with several ranks on this
    machine, where Linux's shared memory is. Elsewhere each rank caches its own, as Ultralytics does."""
    ranks_here = int(os.environ.get("LOCAL_WORLD_SIZE", "1"))
    return cache in (True, "ram") and ctx.world_size > 1 and ranks_here > 1 and SHM.is_dir()


def cache_once_per_machine(dataset, ctx: distributed.Context, name: str) -> None:
    """Cache `dataset` (built without a cache) in RAM once on this machine; every rank calls it, as a collective.

    Local rank 0 decodes the images with Ultralytics' own cache_images() and writes them to /dev/shm; every rank of
    the machine, local rank 0 too, then maps that file in place of its own copy, and the file's name is removed once
    all have mapped it: the memory lives as long as a rank maps it, and a job that dies leaves nothing behind. Where
    RAM is short for one copy, Ultralytics' check says so and nothing is cached, on every rank."""
    path = SHM / f"yoloaccum-{_job()}-{name}"
    if ctx.local_rank == 0:
        dataset.cache = "ram"
        with rng_kept():  # the check samples images at random: the ranks' draws stay in step with each other
            enough = dataset.check_cache_ram()
        if enough:
            dataset.cache_images()
            _write(dataset, path)
    distributed.barrier(ctx)
    if path.with_suffix(".meta").exists():
        _map(dataset, path)
    else:
        dataset.cache = None
    distributed.barrier(ctx)
    if ctx.local_rank == 0:
        path.unlink(missing_ok=True)
        path.with_suffix(".meta").unlink(missing_ok=True)


def _job() -> str:
    """A name the ranks of one torchrun job share on a machine, and another job's do not."""
    return f"{os.environ.get('TORCHELASTIC_RUN_ID', 'job')}-{os.environ.get('MASTER_PORT', '0')}"


def _write(dataset, path: Path) -> None:
    """The packed images (Ultralytics' _ImageCache buffer) to `path`, and their layout beside it."""
    images = dataset.ims
    images.buffer.numpy().tofile(path)
    layout = {
        "shapes": images.shapes,
        "dtypes": images.dtypes,
        "offsets": images.offsets,
        "im_hw0": dataset.im_hw0,
        "im_hw": dataset.im_hw,
    }
    partial = path.with_suffix(".meta.partial")
    partial.write_bytes(pickle.dumps(layout))
    partial.rename(path.with_suffix(".meta"))  # written last and whole: the others map only a finished cache


def _map(dataset, path: Path) -> None:
    """`dataset` reads its images from the shared file: an _ImageCache whose buffer is the mapping."""
    layout = pickle.loads(path.with_suffix(".meta").read_bytes())
    images = object.__new__(dataset._ImageCache)
    images.shapes, images.dtypes, images.offsets = layout["shapes"], layout["dtypes"], layout["offsets"]
    size = int(images.offsets[-1])
    images.buffer = torch.from_numpy(np.memmap(path, dtype=np.uint8, mode="r+", shape=(size,)))
    dataset.ims, dataset.im_hw0, dataset.im_hw = images, list(layout["im_hw0"]), list(layout["im_hw"])
    dataset.cache = "ram"
