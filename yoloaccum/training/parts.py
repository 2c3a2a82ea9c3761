"""`Parts`: everything a run is made of, as components.build makes them; the trainer composes them, and state.py
reads and restores their states."""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    import torch

    from yoloaccum.config.settings import Config
    from yoloaccum.core.ema import EMA
    from yoloaccum.core.engine import Engine
    from yoloaccum.core.loss import WindowLoss
    from yoloaccum.core.schedule import Schedule
    from yoloaccum.data.datasets import DatasetSpec
    from yoloaccum.distributed.ddp import Context
    from yoloaccum.evaluation.validate import Evaluator
    from yoloaccum.model.autobatch import Choice
    from yoloaccum.training.runs import RunDir


@dataclass(eq=False)
class Parts:
    """Everything a run is made of. `run` exists on rank 0 alone, which owns the run folder; every other part exists
    on every rank (the evaluator too: each rank validates its share of the images)."""

    cfg: Config
    ctx: Context
    spec: DatasetSpec
    train_set: Any  # Ultralytics' YOLODataset
    run: RunDir | None
    raw_model: torch.nn.Module  # the parameters; engine.model is what runs forward (DDP's wrapper under torchrun)
    bn: str  # the BatchNorm mode in force: cfg.bn, with auto resolved (schedule.bn_mode)
    frozen: tuple[str, ...]  # the module-name prefixes of the layers freeze= froze (freeze.py)
    ema: EMA  # Ultralytics' ModelEMA, with a state_dict()
    loss: WindowLoss
    batch_choice: Choice | None  # batch=-1 or a fraction: what was measured; None for batch=N
    schedule: Schedule
    loader: torch.utils.data.DataLoader
    engine: Engine
    evaluator: Evaluator
