"""`yoloaccum val` (api.val): the metrics of trained weights on a dataset."""

from __future__ import annotations

from pathlib import Path
from typing import Any

from rich.console import Console

from yoloaccum.config import settings as config
from yoloaccum.config.settings import Config
from yoloaccum.data import datasets as data
from yoloaccum.distributed import ddp as distributed
from yoloaccum.errors import UserError
from yoloaccum.evaluation.validate import Evaluator, show_metrics
from yoloaccum.model import checkpoint


def run(cfg: Config) -> dict[str, Any]:
    """api.val's work (`yoloaccum val model=best.pt data=...`): print and return the metrics of a checkpoint."""
    if config.is_auto_batch(cfg.batch):
        raise UserError(f"batch={cfg.batch} chooses a training micro-batch from memory; val needs batch=N")
    if not str(cfg.model).endswith(".pt"):
        raise UserError("val needs trained weights: give model=path/to/best.pt")
    ckpt = checkpoint.load(cfg.model, cfg.trust_weights)
    if cfg.data is None:
        raise UserError("val needs a dataset: give data=dataset.yaml")
    spec = data.load_spec(cfg.data, cfg.split)
    model = checkpoint.model_of(ckpt).fuse(verbose=False)  # Conv+BN fused, as Ultralytics validates saved weights
    if len(model.names) != spec.nc:
        raise UserError(f"{cfg.model} predicts {len(model.names)} classes but {cfg.data} has {spec.nc}")
    device = distributed.select_device(cfg.device)  # validates on the first listed device
    evaluator = Evaluator(cfg, spec, Path(cfg.model).parent, cfg.batch, device)
    metrics = evaluator.evaluate(model.to(device))
    console = Console()
    show_metrics(console, metrics, f"{cfg.model} on {spec.yaml_file.name} ({cfg.split})")
    console.print(evaluator.class_table())
    return metrics
