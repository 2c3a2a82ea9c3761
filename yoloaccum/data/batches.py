"""Batches: which images each rank trains on and in what order, set by the seed alone (EpochBatchSampler), and the
training loader."""

from __future__ import annotations

import math
import os
from collections.abc import Iterator

import torch
from torch.utils.data import DataLoader, Dataset, Sampler

from yoloaccum.config.settings import Config
from yoloaccum.core.schedule import cut_sizes, even_cuts
from yoloaccum.errors import UserError


class EpochBatchSampler(Sampler[list[int]]):
    """Batches of dataset indices for one rank, in an order set by (seed, epoch) alone.

    Each epoch draws one permutation of all images, cuts it into global batches of `batch` images and gives rank r
    the r-th contiguous slice of each. A window of k global batches therefore holds the same images whatever the
    number of ranks. The last global batch is short and split as evenly as the ranks allow; nothing is dropped
    or padded. Like DistributedSampler, call set_epoch() before each epoch.
    """

    def __init__(self, num_images: int, batch: int, rank: int = 0, world_size: int = 1, seed: int = 0):
        assert batch % world_size == 0 and 0 <= rank < world_size
        if num_images % batch and num_images % batch < world_size:
            raise UserError(
                f"{num_images} images end in a last batch of {num_images % batch}, too few for {world_size} devices; "
                f"choose a batch that leaves at least {world_size} images in the last one"
            )
        self.num_images, self.batch, self.rank, self.world_size = num_images, batch, rank, world_size
        self.seed, self.epoch, self.start = seed, 0, 0

    def set_epoch(self, epoch: int, start: int = 0) -> None:
        """Draw epoch's order; skip its first `start` batches (a resumed run continues from the next image)."""
        self.epoch, self.start = epoch, start

    def __len__(self) -> int:
        return math.ceil(self.num_images / self.batch) - self.start

    def __iter__(self) -> Iterator[list[int]]:
        g = torch.Generator().manual_seed(self.seed + self.epoch)
        order = torch.randperm(self.num_images, generator=g).tolist()
        for first in range(self.start * self.batch, self.num_images, self.batch):
            global_batch = order[first : first + self.batch]
            cuts = even_cuts(len(global_batch), self.world_size)
            yield global_batch[cuts[self.rank] : cuts[self.rank + 1]]


class ShardBatches(Sampler[list[int]]):
    """This rank's share of a fixed order of images (validation), as detectron2's InferenceSampler shares it, in
    batches: a contiguous run of whole batches of `batch` images, the earlier ranks taking one more where they do not
    divide. Nothing is padded or counted twice, a rank may hold none, and its batches are those one process cuts from
    the whole, so a rectangular batch keeps its shape and each image its predictions. A rank that ran out of memory
    cuts each batch into parts of at most `part` images: the shares, and the images a batch's shape was set by,
    stay the same."""

    def __init__(self, num_images: int, batch: int, rank: int = 0, world_size: int = 1, part: int | None = None):
        assert batch > 0 and 0 <= rank < world_size
        self.first, self.end = shard(num_images, batch, rank, world_size)
        self.batch, self.part = batch, min(part or batch, batch)

    @property
    def indices(self) -> range:
        return range(self.first, self.end)

    def __len__(self) -> int:
        return sum(-(-len(group) // self.part) for group in self._groups())

    def __iter__(self) -> Iterator[list[int]]:
        for group in self._groups():
            for start in range(0, len(group), self.part):
                yield list(group[start : start + self.part])

    def _groups(self) -> Iterator[range]:
        for start in range(self.first, self.end, self.batch):
            yield range(start, min(start + self.batch, self.end))


def shard(num_images: int, batch: int, rank: int, world_size: int) -> tuple[int, int]:
    """The image indices [first, end) of `rank`'s contiguous share of ceil(num_images / batch) batches."""
    batches = math.ceil(num_images / batch)
    each, extra = divmod(batches, world_size)
    start = rank * each + min(rank, extra)
    stop = start + each + (rank < extra)
    return min(start * batch, num_images), min(stop * batch, num_images)


def micro_batch_sizes(num_images: int, micro_batch: int, world_size: int) -> tuple[int, ...]:
    """Every size of micro-batch that EpochBatchSampler gives any rank in an epoch, largest first: the micro-batch,
    and each rank's share of a short last global batch."""
    batch = micro_batch * world_size
    sizes = {micro_batch} if num_images >= batch else set()
    sizes |= cut_sizes(num_images % batch, world_size)
    return tuple(sorted(sizes, reverse=True))


def loader_workers(requested: int, device: torch.device) -> int:
    """Worker processes for a loader that feeds `device`: none on the CPU, where the data loads in the training process.

    There, workers would take cores from torch's threads, which compute on all of them: whenever a worker runs, the
    thread it displaced holds up the others at their next barrier, so a worker's CPU time costs about as much as
    loading in process, plus the transfer: the forward pass is slower with workers than without (measured in
    docs/performance.md). Validation, and Ultralytics' trainer, do the same.
    """
    if device.type == "cpu":
        return 0
    # The machine's cores are shared by its ranks (torchrun's LOCAL_WORLD_SIZE), as Ultralytics caps workers at
    # cpu_count // devices: one rank's workers must not take the cores another rank's workers need.
    ranks_here = int(os.environ.get("LOCAL_WORLD_SIZE", "1"))
    return min(requested, (os.cpu_count() or 1) // ranks_here)


def build_loader(
    dataset: Dataset, cfg: Config, micro_batch: int, rank: int, world: int, device: torch.device
) -> DataLoader:
    """The training DataLoader over one rank's share; workers are seeded from the run seed for reproducible
    augmentation. (Validation's loader is evaluation/validate.py's, over ShardBatches.)"""
    from ultralytics.data.build import seed_worker

    sampler = EpochBatchSampler(len(dataset), micro_batch * world, rank, world, seed=cfg.seed)
    workers = loader_workers(cfg.workers, device)
    return DataLoader(
        dataset,
        batch_sampler=sampler,
        num_workers=workers,
        collate_fn=dataset.collate_fn,
        pin_memory=device.type == "cuda",
        persistent_workers=workers > 0,
        worker_init_fn=seed_worker,
        generator=torch.Generator().manual_seed(cfg.seed + rank),
    )
