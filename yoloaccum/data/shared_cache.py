"""cache=ram under torchrun, once per machine: the first rank of each machine decodes the images into a file in
shared memory (/dev/shm) that every rank of the machine maps, where Ultralytics keeps one copy per rank."""

from __future__ import annotations

import os
import pickle
import shutil
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
    all have mapped it (also when a rank fails on the way): the memory lives as long as a rank maps it. Where RAM is
    short for one copy (Ultralytics' check says so), or /dev/shm for the file, nothing is cached, on every rank."""
    path = SHM / f"yoloaccum-{_job()}-{name}"
    meta = Path(f"{path}.meta")
    try:
        if ctx.local_rank == 0:
            dataset.cache = "ram"
            with rng_kept():  # the check samples images at random: the ranks' draws stay in step with each other
                enough = dataset.check_cache_ram()
            if enough:
                dataset.cache_images()
                _write(dataset, path, meta)
        distributed.barrier(ctx)
        if meta.exists():
            _map(dataset, path, meta)
        else:
            dataset.cache = None
        distributed.barrier(ctx)
    finally:
        if ctx.local_rank == 0:
            path.unlink(missing_ok=True)
            meta.unlink(missing_ok=True)


def _job() -> str:
    """A name the ranks of one torchrun job share on a machine, and another job's do not."""
    return f"{os.environ.get('TORCHELASTIC_RUN_ID', 'job')}-{os.environ.get('MASTER_PORT', '0')}"


def _write(dataset, path: Path, meta: Path) -> None:
    """The packed images (Ultralytics' _ImageCache buffer) to `path`, and their layout to `meta`, last: the others map
    only a whole cache. Where /dev/shm has no room (a container's default is 64 MB) nothing is written, and each rank
    decodes as it goes."""
    from ultralytics.utils import LOGGER

    images = dataset.ims
    size = int(images.offsets[-1])
    if shutil.disk_usage(SHM).free < 2 * size:  # the loader's workers pass their batches through it too
        LOGGER.warning(f"{SHM} has no room for the {size / (1 << 30):.1f} GB image cache; not caching images")
        dataset.ims, dataset.cache = [None] * len(dataset.im_files), None
        return
    try:
        images.buffer.numpy().tofile(path)
        layout = {k: getattr(images, k) for k in ("shapes", "dtypes", "offsets")}
        partial = Path(f"{meta}.partial")
        partial.write_bytes(pickle.dumps({**layout, "im_hw0": dataset.im_hw0, "im_hw": dataset.im_hw}))
        partial.rename(meta)
    except OSError as e:  # no meta: every rank goes on without the cache
        LOGGER.warning(f"could not write the image cache to {path} ({e}); not caching images")
        path.unlink(missing_ok=True)


def _map(dataset, path: Path, meta: Path) -> None:
    """`dataset` reads its images from the shared file: an _ImageCache whose buffer is the mapping, copy-on-write, so
    that an augmentation that writes into an image it was given (Ultralytics' HSV does) changes this rank's page
    alone."""
    layout = pickle.loads(meta.read_bytes())
    images = object.__new__(dataset._ImageCache)
    images.shapes, images.dtypes, images.offsets = layout["shapes"], layout["dtypes"], layout["offsets"]
    size = int(images.offsets[-1])
    images.buffer = torch.from_numpy(np.memmap(path, dtype=np.uint8, mode="c", shape=(size,)))
    dataset.ims, dataset.im_hw0, dataset.im_hw = images, list(layout["im_hw0"]), list(layout["im_hw"])
    dataset.cache = "ram"
