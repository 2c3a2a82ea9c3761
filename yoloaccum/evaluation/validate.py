"""Validation with Ultralytics' own metric code (DetectionValidator's NMS, matching and mAP), driven by our loop.

The loop is ours so that it can also return the val losses from the training criterion and run on the live EMA model;
the numbers are Ultralytics', and a test checks they agree with its standalone validator on the same weights.
"""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path

import torch
from rich.console import Console
from rich.table import Table

from yoloaccum.config.settings import Config
from yoloaccum.config.ultra import ultralytics_args
from yoloaccum.core import backoff
from yoloaccum.data import batches
from yoloaccum.data.datasets import DatasetSpec
from yoloaccum.errors import UserError

METRIC_KEYS = ("metrics/precision(B)", "metrics/recall(B)", "metrics/mAP50(B)", "metrics/mAP50-95(B)")


class Evaluator:
    """Validates a model on one split; `evaluate(model, criterion)` returns Ultralytics' metric dict (+ val losses)."""

    def __init__(
        self,
        cfg: Config,
        spec: DatasetSpec,
        save_dir: Path,
        batch: int,
        device: torch.device,
        log: Callable[[str], None] = print,
    ):
        from ultralytics.models.yolo.detect import DetectionValidator

        args = ultralytics_args(
            cfg,
            mode="val",
            batch=batch,
            conf=cfg.conf or 0.001,
            data=str(spec.yaml_file),
            workers=batches.loader_workers(cfg.workers, device),
        )
        self.validator = v = DetectionValidator(save_dir=save_dir, args=args)
        v.data = {"names": spec.names, "nc": spec.nc, "channels": 3, cfg.split: [str(p) for p in spec.val]}
        v.device, v.stride, v.training = device, 32, True  # training=True: no JSON; plots only when asked
        self.yaml_file, self.split, self.log = spec.yaml_file, cfg.split, log
        self.set_batch(batch)

    def set_batch(self, batch: int) -> None:
        """Validate in batches of `batch` images from now on (a new loader)."""
        v, self.batch = self.validator, batch
        paths = v.data[self.split]
        try:
            v.dataloader = v.get_dataloader(paths if len(paths) > 1 else paths[0], batch)
        except FileNotFoundError as e:
            raise UserError(f"{self.yaml_file}: no images found for {self.split} in {', '.join(paths)}") from e

    def evaluate(self, model: torch.nn.Module, criterion=None, plots: bool = False) -> dict[str, float]:
        """Metrics of `model` (eval mode, fp32); val losses too when the training criterion is given.

        With plots, Ultralytics' validator also draws into save_dir what its final validation draws: the first three
        batches with their labels and predictions, both confusion matrices, and the PR, F1, P and R curves.
        On running out of device memory the whole validation runs again at half the batch (validation changes no
        state, so it can), and later validations keep the smaller batch.
        """
        while True:
            try:
                return self._evaluate(model, criterion, plots)
            except RuntimeError as e:
                if not backoff.is_out_of_memory(e) or self.batch == 1:
                    raise
            # outside the except block, so that the failed batch's tensors are freed with its traceback
            if self.validator.device.type == "cuda":
                torch.cuda.empty_cache()
            self.log(f"validation ran out of memory at {self.batch} images a batch; validating at {self.batch // 2}")
            self.set_batch(self.batch // 2)

    @torch.no_grad()
    def _evaluate(self, model: torch.nn.Module, criterion, plots: bool) -> dict[str, float]:
        v = self.validator
        was_training = model.training
        model.eval()
        model.end2end = v.args.nms is False  # as Ultralytics' validator: NMS on the one-to-many head unless nms=False
        v.args.plots = plots  # read by init_metrics, update_metrics (confusion matrix) and get_stats (curves)
        v.init_metrics(model)
        losses = None
        try:
            for i, batch in enumerate(v.dataloader):
                batch = v.preprocess(batch)
                preds = model(batch["img"])
                if criterion is not None:
                    items = torch.stack(list(criterion(preds, batch)[1].values()))
                    losses = items if losses is None else losses + items
                detections = v.postprocess(preds)
                v.update_metrics(detections, batch)
                if plots and i < 3:
                    v.plot_val_samples(batch, i)
                    v.plot_predictions(batch, drawable(detections), i)
            if plots:
                v.finalize_metrics()  # draws the confusion matrices
            stats = v.get_stats()
        finally:  # also when a batch ran out of memory: evaluate() runs again from a model in its own mode
            v.args.plots = False
            model.train(was_training)
        out = {k: float(stats[k]) for k in (*METRIC_KEYS, "fitness")}
        if losses is not None:
            names = getattr(criterion, "one2one", criterion).loss_names
            out.update({f"val/{n}": x / len(v.dataloader) for n, x in zip(names, losses.tolist())})
        return out

    def class_table(self) -> Table:
        """Per-class precision, recall and mAP of the last evaluation."""
        v = self.validator
        table = Table(title="per class", title_justify="left")
        for col in ("class", "images", "instances", "P", "R", "mAP50", "mAP50-95"):
            table.add_column(col, justify="left" if col == "class" else "right")
        for i, c in enumerate(v.metrics.ap_class_index):
            p, r, m50, m = v.metrics.class_result(i)
            table.add_row(
                v.names[c],
                str(v.metrics.nt_per_image[c]),
                str(v.metrics.nt_per_class[c]),
                f"{p:.3f}",
                f"{r:.3f}",
                f"{m50:.3f}",
                f"{m:.3f}",
            )
        return table


def drawable(detections: list[dict[str, torch.Tensor]]) -> list[dict[str, torch.Tensor]]:
    """Copies of the detections whose boxes have their corners in order. An early model can predict a box with x2 < x1
    (YOLO26 regresses the four distances freely), and Ultralytics' plot_images then fails in its drawing thread."""
    out = []
    for d in detections:
        b = d["bboxes"]
        corners = torch.cat([torch.minimum(b[:, :2], b[:, 2:]), torch.maximum(b[:, :2], b[:, 2:])], 1)
        out.append({**d, "bboxes": corners})
    return out


def show_metrics(console: Console, metrics: dict[str, float], title: str) -> None:
    """The metrics as a table on a terminal; in a file or a CI log, where a table is cut to 80 columns, as one line of
    `name value` pairs, whole."""
    if console.is_terminal:
        console.print(metrics_table(metrics, title))
    else:
        pairs = ", ".join(f"{_short(k)} {v:.4g}" for k, v in metrics.items())
        console.print(f"{title}: {pairs}", soft_wrap=True, highlight=False)


def _short(key: str) -> str:
    return key.split("/")[-1].replace("(B)", "") if key.startswith("metrics/") else key


def metrics_table(metrics: dict[str, float], title: str) -> Table:
    table = Table(title=title, title_justify="left")
    for k in metrics:
        table.add_column(k.split("/")[-1].replace("(B)", ""), justify="right")
    table.add_row(*(f"{v:.4g}" for v in metrics.values()))
    return table
