"""How the process keeps memory while training: glibc's thresholds on the CPU, and the objects alive at the start
hidden from the cyclic garbage collector."""

from __future__ import annotations

import ctypes
import gc
from collections.abc import Iterator
from contextlib import contextmanager

# glibc's mallopt() parameters (malloc.h). 32 MiB is the largest mmap threshold older glibc accepts (HEAP_MAX_SIZE / 2);
# tensors above it still come and go with mmap, as by default.
_M_TRIM_THRESHOLD, _M_MMAP_THRESHOLD = -1, -3
_MMAP_BYTES, _TRIM_BYTES = 32 << 20, 256 << 20


def keep_freed_memory() -> bool:
    """Let glibc keep freed memory for reuse, instead of giving it back to the kernel after every micro-batch.

    By default glibc serves each large tensor with a fresh mmap, or trims the heap when a micro-batch's activations
    are freed, and the next micro-batch faults every page in again; with these thresholds the faults and their kernel
    time mostly go (measured on 2 CPU cores, docs/performance.md). The setting is process-wide and stays, so the
    trainer applies it only when training on the CPU, where it was measured: on CUDA the activations live on the
    device, and each forked loader worker would keep up to the trim threshold of freed heap. Returns whether glibc
    accepted it: False where the C library is not glibc (with jemalloc or tcmalloc preloaded it returns True but
    changes nothing).
    """
    try:
        mallopt = ctypes.CDLL(None).mallopt
    except (OSError, AttributeError, TypeError):
        return False
    return bool(mallopt(_M_MMAP_THRESHOLD, _MMAP_BYTES)) and bool(mallopt(_M_TRIM_THRESHOLD, _TRIM_BYTES))


_depth = 0  # frozen_heap()s open now: only the outermost one unfreezes
_ended = False  # one has ended in this process: the run it held may have left its trainer in reference cycles


@contextmanager
def frozen_heap() -> Iterator[None]:
    """Hide every object alive now (modules, dataset, labels: hundreds of thousands of them) from the cyclic garbage
    collector until the outermost frozen_heap() ends. A full collection would otherwise walk them all: at an
    iteration, a stall measured on the CPU (docs/performance.md); while the run is set up and validated, about 0.1 s
    each time; and in each loader worker, forked from this process, it would copy every page it touched.

    Entered again inside (the run around the training loop), it freezes what was built since, and leaves the
    unfreezing to the outer one. The first run of a process freezes without collecting first: what is garbage then
    (little, after the imports) waits for the end. A later one (a notebook's second train()) collects first: the run
    before left its trainer, model and data in reference cycles, which would otherwise stay alive through this run.
    It is kept on CUDA too: it changes no computation, only which objects the collector scans, and freezing before
    the loader forks its workers is what Python's gc documentation advises to keep the children's pages shared."""
    global _depth, _ended
    if gc.get_freeze_count() and not _depth:  # frozen by whoever runs us: theirs to undo, not ours
        yield
        return
    if not _depth and _ended:
        gc.collect()
    _depth += 1
    try:
        gc.freeze()
        yield
    finally:
        _depth -= 1
        if not _depth:
            gc.unfreeze()
            _ended = True
