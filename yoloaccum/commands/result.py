"""What a training run returns: its metrics, folder and weights. Light: the API imports it before torch loads."""

from __future__ import annotations

import csv
from dataclasses import dataclass, field
from pathlib import Path


@dataclass(frozen=True)
class TrainResult:
    """What a training run left: its final metrics (Ultralytics' names: "metrics/mAP50-95(B)", ...), its folder,
    where its time went, and its weights (None where the run saved none)."""

    metrics: dict[str, float]
    save_dir: Path | None
    time_split: dict[str, float] = field(default_factory=dict)  # seconds per phase (training/time_report.py)
    verdict: str = ""  # what bound the run, and what to try (empty from torchrun's launcher: rank 0 printed it)
    best: Path | None = field(init=False)
    last: Path | None = field(init=False)

    def __post_init__(self) -> None:
        for name in ("best", "last"):
            path = self.save_dir / "weights" / f"{name}.pt" if self.save_dir else None
            object.__setattr__(self, name, path if path and path.exists() else None)


def result_of_folder(save_dir: Path) -> TrainResult:
    """The result of a run made by other processes (torchrun's ranks): the metrics of results.csv's last row."""
    metrics: dict[str, float] = {}
    results = save_dir / "results.csv"
    if results.exists():
        with results.open() as f:
            rows = list(csv.DictReader(f, skipinitialspace=True))
        if rows:
            metrics = {k.strip(): float(v) for k, v in rows[-1].items() if k.strip().startswith("metrics/")}
    return TrainResult(metrics, save_dir)
