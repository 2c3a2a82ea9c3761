"""The run's own state, apart from its parts': where training continues, the last validation's figures, the best
fitness, and early stopping's count. The trainer owns one; the end-of-epoch steps tell it what they measured and ask
it what follows; last.pt holds its state_dict under `training` (state.py), from which Ultralytics' entries derive.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Any


@dataclass
class TrainingState:
    """What the run has decided so far. Early stopping is Ultralytics' rule (its EarlyStopping), kept here so that
    it is saved and restored with the rest: a validation whose fitness beats the best (or any, while the best is 0)
    resets the count; `patience` epochs without one end the run; 0 never does."""

    patience: int
    position: tuple[int, int] = (0, 0)  # (epoch, micro-batches of it done): where training continues
    metrics: dict[str, float] = field(default_factory=dict)  # the last validation's (zeros before the first)
    fitness: float | None = None  # of the last validation; None before the first
    best_fitness: float | None = None  # the best so far, best.pt's
    stop_best_fitness: float = 0.0  # early stopping's best and its epoch (Ultralytics counts them apart)
    stop_best_epoch: int = 0
    possible_stop: bool = False  # early stopping could end the run after the next epoch: validate it
    mosaic_closed: bool = False  # close_mosaic has turned mosaic off in this process

    def record_validation(self, metrics: dict[str, float]) -> None:
        self.metrics = dict(metrics)
        self.fitness = metrics.get("fitness", 0.0)

    def note_best(self) -> bool:
        """Whether the last fitness (0 before any validation) is the best so far; it becomes the best."""
        fitness = self.fitness or 0.0
        if self.best_fitness is None or fitness > self.best_fitness:
            self.best_fitness = fitness
        return fitness == self.best_fitness

    def stop_early(self, epoch: int) -> bool:
        """Early stopping after `epoch` (from 1) epochs, with the last validation's fitness."""
        if self.fitness is None:  # never validated (val=False): nothing to count
            return False
        if self.fitness > self.stop_best_fitness or self.stop_best_fitness == 0:
            self.stop_best_epoch, self.stop_best_fitness = epoch, self.fitness
        patience = self.patience or math.inf
        self.possible_stop = epoch - self.stop_best_epoch >= patience - 1
        return epoch - self.stop_best_epoch >= patience

    def state_dict(self) -> dict[str, Any]:
        return {
            "position": {"epoch": self.position[0], "batch": self.position[1]},
            "stopper": {"best_fitness": self.stop_best_fitness, "best_epoch": self.stop_best_epoch},
            "best_fitness": self.best_fitness,
            "metrics": dict(self.metrics),
        }

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.position = (state["position"]["epoch"], state["position"]["batch"])
        self.stop_best_fitness = state["stopper"]["best_fitness"]
        self.stop_best_epoch = state["stopper"]["best_epoch"]
        self.best_fitness = state["best_fitness"]
        self.metrics.update(state.get("metrics") or {})
