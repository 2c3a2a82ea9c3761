"""The process's random states: seeded at a run's start, saved into last.pt and put back on resume, and kept
aside around work that draws random numbers but must leave training's draws as they were."""

from __future__ import annotations

import os
import random
from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

import numpy as np
import torch


def seed_everything(seed: int, deterministic: bool) -> None:
    """Seed python, numpy and torch; with deterministic, ask torch for deterministic kernels where it has them."""
    random.seed(seed)
    np.random.seed(seed)
    torch.manual_seed(seed)
    torch.cuda.manual_seed_all(seed)
    if deterministic:
        torch.use_deterministic_algorithms(True, warn_only=True)
        # Deterministic mode also fills every new tensor with NaN, to expose reads of uninitialised memory. That is a
        # debugging aid, not part of determinism, and costs a fill kernel per allocation (docs/performance.md).
        # Ultralytics turns it off too.
        torch.utils.deterministic.fill_uninitialized_memory = False
        torch.backends.cudnn.deterministic = True
        os.environ.setdefault("CUBLAS_WORKSPACE_CONFIG", ":4096:8")


@contextmanager
def rng_kept() -> Iterator[None]:
    """Every random state of this process as it was before the block, after it: for work that draws random numbers
    but must leave training's draws as they would have been without it."""
    state = rng_state(None)
    try:
        yield
    finally:
        restore_rng(state, None)


def rng_state(loader_generator: torch.Generator | None) -> dict[str, Any]:
    """Every random state that training consumes, in types that torch.load(weights_only=True) accepts."""
    kind, keys, pos, has_gauss, gauss = np.random.get_state()
    return {
        "python": random.getstate(),
        "numpy": [kind, keys.tolist(), pos, has_gauss, gauss],
        "torch": torch.get_rng_state(),
        # The current device's (distributed.setup sets it to the run's), and only where this process already uses CUDA:
        # asking on a CPU run of a GPU machine would make a context on GPU 0.
        "cuda": torch.cuda.get_rng_state() if torch.cuda.is_initialized() else None,
        "loader": loader_generator.get_state() if loader_generator is not None else None,
    }


def restore_rng(state: dict[str, Any], loader_generator: torch.Generator | None) -> None:
    version, internal, gauss = state["python"]
    random.setstate((version, tuple(internal), gauss))
    kind, keys, pos, has_gauss, gauss = state["numpy"]
    np.random.set_state((kind, np.array(keys, dtype=np.uint32), pos, has_gauss, gauss))
    torch.set_rng_state(state["torch"])
    if state["cuda"] is not None and torch.cuda.is_initialized():  # a CUDA run resumed on the CPU leaves CUDA alone
        torch.cuda.set_rng_state(state["cuda"])
    if loader_generator is not None and state["loader"] is not None:
        loader_generator.set_state(state["loader"])
