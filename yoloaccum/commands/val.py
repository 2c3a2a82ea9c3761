"""`yoloaccum val` (api.val): the metrics of trained weights on a dataset. Under torchrun, or with `device=0,1`
(torchrun started for it), every rank validates its share of the images and rank 0 prints the figures."""

from __future__ import annotations

import json
import os
import tempfile
from pathlib import Path
from typing import Any

from rich.console import Console

from yoloaccum.commands.launch import launch
from yoloaccum.config import settings as config
from yoloaccum.config.devices import cuda_ids
from yoloaccum.config.settings import Config
from yoloaccum.data import datasets as data
from yoloaccum.distributed import ddp as distributed
from yoloaccum.errors import RanksFailed, UserError
from yoloaccum.evaluation.validate import Evaluator, show_metrics
from yoloaccum.model import checkpoint

# Where rank 0 of a torchrun job that `val(device="0,1")` started writes the metrics, for the process that waits.
METRICS_OUT = "YOLOACCUM_VAL_METRICS"


def run(cfg: Config, given: dict[str, Any] | None = None) -> dict[str, Any]:
    """api.val's work (`yoloaccum val model=best.pt data=...`): print and return the metrics of a checkpoint."""
    if config.is_auto_batch(cfg.batch):
        raise UserError(f"batch={cfg.batch} chooses a training micro-batch from memory; val needs batch=N")
    if not str(cfg.model).endswith(".pt"):
        raise UserError("val needs trained weights: give model=path/to/best.pt")
    if cfg.data is None:
        raise UserError("val needs a dataset: give data=dataset.yaml")
    cfg = cfg.replace(device=distributed.resolve_device(cfg.device))
    if len(cuda_ids(cfg.device)) > 1 and "WORLD_SIZE" not in os.environ:  # device=0,1 outside torchrun
        return _on_several_devices(cfg, given or {})
    ctx = distributed.setup(cfg.device, cfg.ddp_timeout)
    try:
        return _validate(cfg, ctx)
    finally:
        distributed.cleanup()


def _validate(cfg: Config, ctx: distributed.Context) -> dict[str, Any]:
    """Every rank loads the weights and validates its share; rank 0 prints the figures (and, for a waiting process,
    writes them where METRICS_OUT says)."""
    error, model, spec = None, None, None
    with distributed.main_first(ctx):  # rank 0 may generate the shapes set and write the label cache first
        try:  # a weights file or dataset only some ranks' machines see: every rank stops with one line
            ckpt = checkpoint.load(cfg.model, cfg.trust_weights)
            spec = data.load_spec(cfg.data, cfg.split)
            model = checkpoint.model_of(ckpt).fuse(verbose=False)  # Conv+BN fused, as Ultralytics validates weights
            if len(model.names) != spec.nc:
                raise UserError(f"{cfg.model} predicts {len(model.names)} classes but {cfg.data} has {spec.nc}")
        except UserError as e:
            error = str(e)
    distributed.every_rank_ok(error, ctx)
    save_dir = Path(cfg.model).parent if ctx.is_main else None
    evaluator = Evaluator(cfg, spec, save_dir, cfg.batch, ctx.device, ctx=ctx)
    metrics = evaluator.evaluate(model.to(ctx.device))
    if ctx.is_main:
        console = Console()
        show_metrics(console, metrics, f"{cfg.model} on {spec.yaml_file.name} ({cfg.split})")
        console.print(evaluator.class_table())
        if out := os.environ.get(METRICS_OUT):
            Path(out).write_text(json.dumps(metrics))
    return metrics


def _on_several_devices(cfg: Config, given: dict[str, Any]) -> dict[str, Any]:
    """torchrun with one rank per device of `device`; the metrics its rank 0 wrote."""
    with tempfile.TemporaryDirectory(prefix="yoloaccum-val-") as folder:
        out = Path(folder) / "metrics.json"
        code = launch({**given, "device": cfg.device}, cfg.device, command="val", env={METRICS_OUT: str(out)})
        if code:
            raise RanksFailed(code)
        return json.loads(out.read_text())
