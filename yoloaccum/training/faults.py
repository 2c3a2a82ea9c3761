"""YOLOACCUM_FAULT: failures injected into a real run, for this project's tests and for users' own failure tests.

YOLOACCUM_FAULT=KIND@NI[-][:RANK] makes iteration NI (NI- : NI and every later one) fail on RANK (every rank when
omitted). KIND is `raise` (an exception, as a crashing rank), `kill` (SIGKILL, as a lost machine), `nan` (a
non-finite input, hence a non-finite loss), `sigint` / `sigterm` (the signal, sent to this process), `hang` (sleeps
forever, as a rank stuck in a driver or a file system), `enospc` / `eio` (every write into the run folder from then
on fails halfway, as on a full or failing disk: checkpoints, results.csv, schedule.csv, args.yaml), or `oom`
(torch.OutOfMemoryError, what CUDA raises when the device is full), once.

Under torchrun --max-restarts a fault fires in the job's first attempt only, so the restarted job shows the
recovery. The trainer calls install() once, as it builds the run. Without the variable it returns at once and
nothing else looks for a fault: the engine and the checkpoint writer carry no test branches. With it, the one
engine's `iteration` is wrapped, and a disk fault replaces checkpoint._write and checkpoint._open.
"""

from __future__ import annotations

import errno
import os
import signal
import time
from dataclasses import dataclass, field
from typing import Any

import torch

from yoloaccum.errors import UserError
from yoloaccum.model import checkpoint

_SIGNALS = {"kill": signal.SIGKILL, "sigint": signal.SIGINT, "sigterm": signal.SIGTERM}
KINDS = ("raise", "nan", "hang", "enospc", "eio", "oom", *_SIGNALS)


@dataclass
class Fault:
    kind: str
    ni: int
    onwards: bool = False
    fired: bool = field(default=False, compare=False)  # oom: once, not again when the window runs again

    @classmethod
    def parse(cls, spec: str, rank: int) -> Fault | None:
        """The fault for this rank, or None where it names another rank."""
        kind, _, where = spec.partition("@")
        ni, _, only_rank = where.partition(":")
        if kind not in KINDS or not ni.rstrip("-").isdigit() or only_rank and not only_rank.isdigit():
            raise UserError(f"YOLOACCUM_FAULT={spec} is not KIND@NI[-][:RANK] with KIND one of {', '.join(KINDS)}")
        if only_rank and int(only_rank) != rank:
            return None
        return cls(kind, int(ni.rstrip("-")), ni.endswith("-"))

    def applies(self, ni: int) -> bool:
        return ni == self.ni or (self.onwards and ni > self.ni)

    def trigger(self, batch: dict[str, Any]) -> None:
        if self.kind == "raise":
            raise RuntimeError(f"YOLOACCUM_FAULT: injected failure at iteration {self.ni}")
        while self.kind == "hang":  # signals run their handlers and the sleep goes on; only SIGKILL ends it
            time.sleep(3600)
        if self.kind == "nan":
            batch["img"] = batch["img"].float() * float("nan")
        elif self.kind == "oom":
            if not self.fired:
                self.fired = True
                raise torch.OutOfMemoryError(f"YOLOACCUM_FAULT: injected out-of-memory error at iteration {self.ni}")
        elif self.kind in {"enospc", "eio"}:
            fail_writes(errno.ENOSPC if self.kind == "enospc" else errno.EIO)
        else:
            os.kill(os.getpid(), _SIGNALS[self.kind])


def install(engine, environ=os.environ) -> Fault | None:
    """Wrap engine.iteration with the fault YOLOACCUM_FAULT names for this rank, if any; returns it."""
    spec = environ.get("YOLOACCUM_FAULT")
    if int(environ.get("TORCHELASTIC_RESTART_COUNT", "0")):  # the first attempt fails; the restarted job recovers
        return None
    fault = Fault.parse(spec, engine.ctx.rank) if spec else None
    if fault is None:
        return None
    inner = engine.iteration

    def iteration(ni: int, batch: dict[str, Any], last_in_window: bool) -> torch.Tensor:
        if fault.applies(ni):
            fault.trigger(batch)
        return inner(ni, batch, last_in_window)

    engine.iteration = iteration
    return fault


class _HalfThenFail:
    """A file of the run folder on a disk that fills up: each write writes half, then fails."""

    def __init__(self, f, code: int):
        self.f, self.code = f, code

    def write(self, data) -> None:
        self.f.write(data[: len(data) // 2])
        self.f.flush()
        raise OSError(self.code, os.strerror(self.code), self.f.name)

    def __getattr__(self, name: str):
        return getattr(self.f, name)

    def __enter__(self):
        return self

    def __exit__(self, *exc) -> None:
        self.f.close()


def fail_writes(code: int) -> None:
    """From now on, every write into a run folder (checkpoints, results.csv, schedule.csv, args.yaml) fails halfway
    with OSError(code), as on a disk that filled up or fails."""
    checkpoint._write = lambda f, data: _HalfThenFail(f, code).write(data)
    checkpoint._open = lambda *args, **kwargs: _HalfThenFail(_plain_open(*args, **kwargs), code)


def writes_work_again() -> None:
    checkpoint._write, checkpoint._open = _plain_write, _plain_open


_plain_write, _plain_open = checkpoint._write, checkpoint._open
