"""Where a run's time goes: every second of an epoch, from one lap to the next, given to the phase that took it.

`PhaseTimer.lap(phase)` gives the time since the previous lap to `phase`, so the phases of an epoch add up to its wall
time by construction: nothing falls between two laps. The engine laps around each part of a micro-step (waiting for
the loader, moving the batch to the device, forward and backward, bn=window's statistics pass, the window's step), the
trainer around each end-of-epoch step (precise BatchNorm statistics, validation, saving, logs).

On the CPU the host's clock is the truth: torch computes synchronously. On CUDA the host only queues kernels, and its
clock would put the GPU's work wherever the host next waits (the window's one sync, in the step). There each lap also
records a CUDA event on the current stream, and the split is the device's: the time between consecutive events, read
only once the events have completed (`query()` does not block), so the timer adds no host synchronisation. The host's
own time per phase is kept beside it (`total_host`); the time report shows its forward and backward next to the
device's, unjudged (training/time_report.py says why).
"""

from __future__ import annotations

import time
from collections import defaultdict

import torch

# The phases, in the order a report lists them. Inside an epoch: the engine's; at its end: the trainer's steps.
TRAINING = ("data", "to_device", "forward_backward", "bn_window", "step", "plots", "other")
EPOCH_END = ("precise_bn", "validation", "save", "logs")
PHASES = TRAINING + EPOCH_END


class PhaseTimer:
    """Seconds per phase since the last `take()`, on the host and (on CUDA) on the device."""

    def __init__(self, device: torch.device | None = None, enabled: bool = True):
        self.enabled = enabled
        self.cuda = enabled and device is not None and device.type == "cuda"
        self.host: dict[str, float] = defaultdict(float)
        self.device: dict[str, float] = defaultdict(float)
        self.last = time.perf_counter()
        # CUDA: (phase, event) in order, the first the event the next one's time counts from; read once completed
        self.events: list[tuple[str, torch.cuda.Event]] = []
        self.laps = 0  # how many laps were taken (for the report's own cost)
        self.total: dict[str, float] = defaultdict(float)  # every take() so far: the run's split
        self.total_host: dict[str, float] = defaultdict(float)  # the same on the host (on the CPU: the same figures)

    @classmethod
    def off(cls) -> PhaseTimer:
        """A timer that measures nothing (the report's cost, measured side by side)."""
        return cls(enabled=False)

    def restart(self) -> None:
        """Count from now, dropping what was not yet given to a phase (the time before training starts)."""
        if not self.enabled:
            return
        self.last = time.perf_counter()
        if self.cuda:
            self.events = [("", self._event())]

    def lap(self, phase: str) -> None:
        """The time since the last lap was `phase`'s."""
        if not self.enabled:
            return
        now = time.perf_counter()
        self.host[phase] += now - self.last
        self.last = now
        self.laps += 1
        if self.cuda:
            self.events.append((phase, self._event()))
            if len(self.events) > 64:  # read what has completed, without waiting for the rest
                self._read_events(wait=False)

    def take(self) -> dict[str, float]:
        """The seconds per phase since the last take (the device's on CUDA, after one synchronisation, which the
        caller makes at an epoch's end, where validation has synchronised anyway), and start counting again."""
        if not self.enabled:
            return {}
        if self.cuda:
            self._read_events(wait=True)
        taken = self.current()
        for phase, seconds in taken.items():
            self.total[phase] += seconds
        for phase, seconds in self.host.items():
            self.total_host[phase] += seconds
        self.host.clear()
        self.device.clear()
        return taken

    def current(self) -> dict[str, float]:
        """The seconds per phase since the last take, as far as they are known now (on CUDA: the events completed)."""
        if self.cuda:
            self._read_events(wait=False)
        return dict(self.device if self.cuda else self.host)

    def _event(self) -> torch.cuda.Event:
        event = torch.cuda.Event(enable_timing=True)
        event.record()
        return event

    def _read_events(self, wait: bool) -> None:
        """Give each completed event's time since the one before to its phase; keep the last one read as the start."""
        if wait and self.events:
            self.events[-1][1].synchronize()
        done = 1
        while done < len(self.events) and (wait or self.events[done][1].query()):
            phase, event = self.events[done]
            self.device[phase] += self.events[done - 1][1].elapsed_time(event) / 1000
            done += 1
        self.events = self.events[done - 1 :]
