"""The run's wall clock: time= (hours to train, epochs re-estimated as Ultralytics does) and save_minutes= (last.pt
every M minutes). Rank 0's clock decides; the ranks learn its decisions through the votes of the window all-reduce."""

from __future__ import annotations

import math
import time
from collections.abc import Callable
from dataclasses import dataclass, field


@dataclass
class RunClock:
    """When the time budget is spent, when the next periodic save is due, and how many epochs fit the budget.
    Only the main rank answers yes; `now` is injectable for tests."""

    hours: float | None  # time=
    save_minutes: float  # save_minutes=; 0 off
    is_main: bool = True
    now: Callable[[], float] = time.monotonic
    start: float = field(init=False)
    last_save: float = field(init=False)

    def __post_init__(self) -> None:
        self.start = self.last_save = self.now()

    def elapsed_hours(self) -> float:
        return (self.now() - self.start) / 3600

    def over_time(self) -> bool:
        """time= is spent: stop at this window boundary."""
        return bool(self.is_main and self.hours and self.elapsed_hours() > self.hours)

    def save_due(self) -> bool:
        """save_minutes have passed since the start or the last save."""
        return bool(self.is_main and self.save_minutes and self.now() - self.last_save >= 60 * self.save_minutes)

    def saved(self) -> None:
        self.last_save = self.now()

    def epochs_for_budget(self, epochs_done: int, epochs_done_here: int) -> int:
        """Ultralytics' rule for time=: as many epochs as the budget holds at the mean epoch time so far (this
        process's epochs), never fewer than are done."""
        assert self.hours and epochs_done_here > 0
        mean_hours = self.elapsed_hours() / epochs_done_here
        return max(math.ceil(self.hours / mean_hours), epochs_done)
