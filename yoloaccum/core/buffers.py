"""A module's buffers (BatchNorm's running statistics, bn=window's window statistics) kept aside and put back: the
one helper for each "do this, then leave the statistics as they were" of a run. Its users: a skipped or backed-off
window (engine), the batch=-1 probe (autobatch), compile's warm-up (compiler) and a checkpointed block's
recomputation (model), and the layers a precise_bn pass leaves as they were. Random states have theirs:
process.rng.rng_kept."""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager

import torch
from torch import nn


class Kept:
    """Copies of a module's buffers as they were when kept; put_back() copies them into the module again."""

    def __init__(self, module: nn.Module, tensors: list[torch.Tensor] | None = None):
        self.module = module
        self.tensors = [b.clone() for b in module.buffers()] if tensors is None else tensors

    def keep(self) -> Kept:
        """Keep the buffers as they are now: into the same tensors when the module's buffers are still those kept."""
        buffers = list(self.module.buffers())
        if buffers and [b.shape for b in buffers] == [t.shape for t in self.tensors]:
            torch._foreach_copy_(self.tensors, buffers)
        else:
            self.tensors = [b.clone() for b in buffers]
        return self

    @torch.no_grad()
    def put_back(self) -> None:
        buffers = list(self.module.buffers())
        if buffers and self.tensors:  # none kept: a window opened by micro-steps alone, as tests drive the engine
            torch._foreach_copy_(buffers, self.tensors)


@contextmanager
def kept(module: nn.Module) -> Iterator[Kept]:
    """The module's buffers as they were before the block, after it, also when the block raises."""
    saved = Kept(module)
    try:
        yield saved
    finally:
        saved.put_back()
