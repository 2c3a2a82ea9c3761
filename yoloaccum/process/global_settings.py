"""The process-wide settings a run changes, put back when api.train, val or predict returns or raises: a notebook or
a script that calls them goes on under its own settings."""

from __future__ import annotations

import os
import sys
from collections.abc import Iterator
from contextlib import ExitStack, contextmanager, suppress
from types import ModuleType
from typing import Any

# The loggers whose level a run sets: compiler.py quiets cpp_extension's when it compiles for the CPU.
_LOGGERS = ("torch.utils.cpp_extension",)


@contextmanager
def kept() -> Iterator[None]:
    """Every process-wide setting a run changes, after the block as it was before, also when the block raises:

    - torch's deterministic mode and its warn_only, the fill of new memory, cuDNN's deterministic and benchmark modes
      (seed_everything; Ultralytics' stream loader turns benchmark on);
    - torch's CPU thread count (Ultralytics' select_device, which predict runs, sets its own), and the current CUDA
      device where CUDA had started before the block (distributed.setup and select_device set it);
    - the random states of python, numpy and torch, and the current CUDA device's (seed_everything);
    - every environment variable (seed_everything sets CUBLAS_WORKSPACE_CONFIG; Ultralytics and inductor set theirs
      as they run, and set them again where they need them);
    - matplotlib's backend (plots.py draws after matplotlib.use("Agg"), which would switch a notebook's inline backend
      off), the levels of the loggers in _LOGGERS, and the recursion limit (inductor raises it to compile).

    torch's settings and the random states are kept where torch is imported before the block. Left as they are,
    deliberately:

    - what importing torch and Ultralytics does, once: the environment config/ultra.py sets (offline, quiet),
      Ultralytics' print options, OpenCV's thread count, warnings filters and loggers; rich, as it is imported, draws
      from python's random generator. The API imports them before it enters: undone, these would be missing from
      then on, as an import does not run again;
    - glibc's malloc thresholds (memory.keep_freed_memory): mallopt has no getter, and setting the mmap threshold
      turns glibc's own adjustment of it off for good, so there is no earlier value to put back;
    - CUDA once started: its context and cached memory, and the current device where CUDA started inside the block
      (setting it to 0 could make a context on a device the run never used);
    - what torch.compile keeps: compiled code, its caches and worker threads;
    - signal handlers and the garbage collector's frozen objects: GracefulStop and frozen_heap put those back.
    """
    with_torch = "torch" in sys.modules
    with ExitStack() as stack:  # put back in the reverse order
        if with_torch:  # the random states last, after whatever the others' putting back draws (a backend's import)
            from yoloaccum.process.rng import rng_kept

            stack.enter_context(rng_kept())
        stack.enter_context(_environment())
        stack.enter_context(_recursion_limit())
        stack.enter_context(_logger_levels())
        stack.enter_context(backend_kept())
        if with_torch:  # the current device before its random state
            stack.enter_context(_torch())
        yield


@contextmanager
def backend_kept() -> Iterator[None]:
    """matplotlib's backend as it was before the block, or, where the block imported matplotlib, as importing it
    chooses. It imports nothing itself: plan, which needs no torch, keeps only this."""
    before = _backend(sys.modules.get("matplotlib"))
    try:
        yield
    finally:
        if (mpl := sys.modules.get("matplotlib")) is not None:
            _set_backend(mpl, *(before or _backend_at_import(mpl)))


def _backend(mpl: ModuleType | None) -> tuple[Any, bool] | None:
    # The raw value: rcParams["backend"] would resolve the not-yet-chosen default, importing pyplot to do it.
    return None if mpl is None else (dict.__getitem__(mpl.rcParams, "backend"), mpl.rcParams["backend_fallback"])


def _backend_at_import(mpl: ModuleType) -> tuple[Any, bool]:
    """What `import matplotlib` sets: its rc files' backend, which MPLBACKEND overrides (Jupyter sets it)."""
    orig = mpl.rcParamsOrig
    return os.environ.get("MPLBACKEND") or dict.__getitem__(orig, "backend"), orig["backend_fallback"]


def _set_backend(mpl: ModuleType, backend: Any, fallback: bool) -> None:
    if dict.__getitem__(mpl.rcParams, "backend") != backend:
        pyplot = sys.modules.get("matplotlib.pyplot")
        if pyplot is None:  # read when pyplot is imported; rcParams' own setter ignores the not-yet-chosen default
            dict.__setitem__(mpl.rcParams, "backend", backend)
        else:
            with suppress(ImportError):  # a GUI backend that cannot start here now: the block's one stays
                pyplot.switch_backend(backend)
    mpl.rcParams["backend_fallback"] = fallback


@contextmanager
def _environment() -> Iterator[None]:
    """Every environment variable as it was. Only those that differ are written, so that another thread reading the
    environment meanwhile never finds one missing."""
    before = dict(os.environ)
    try:
        yield
    finally:
        for key in os.environ.keys() - before.keys():
            del os.environ[key]
        for key, value in before.items():
            if os.environ.get(key) != value:
                os.environ[key] = value


@contextmanager
def _recursion_limit() -> Iterator[None]:
    limit = sys.getrecursionlimit()
    try:
        yield
    finally:
        sys.setrecursionlimit(limit)


@contextmanager
def _logger_levels() -> Iterator[None]:
    import logging  # here, not at the top: the CLI's start, through api.py, imports no logging

    loggers = [logging.getLogger(name) for name in _LOGGERS]
    levels = [logger.level for logger in loggers]
    try:
        yield
    finally:
        for logger, level in zip(loggers, levels):
            logger.setLevel(level)


@contextmanager
def _torch() -> Iterator[None]:
    import torch

    deterministic = torch.are_deterministic_algorithms_enabled(), torch.is_deterministic_algorithms_warn_only_enabled()
    fill = torch.utils.deterministic.fill_uninitialized_memory
    cudnn = torch.backends.cudnn.deterministic, torch.backends.cudnn.benchmark
    threads = torch.get_num_threads()
    device = torch.cuda.current_device() if torch.cuda.is_initialized() else None
    try:
        yield
    finally:
        torch.use_deterministic_algorithms(deterministic[0], warn_only=deterministic[1])
        torch.utils.deterministic.fill_uninitialized_memory = fill
        torch.backends.cudnn.deterministic, torch.backends.cudnn.benchmark = cudnn
        if torch.get_num_threads() != threads:
            torch.set_num_threads(threads)
        if device is not None and torch.cuda.current_device() != device:
            torch.cuda.set_device(device)
