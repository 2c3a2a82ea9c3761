"""Validation with Ultralytics' own metric code (DetectionValidator's NMS, matching and mAP), driven by our loop.

The loop is ours so that it can also return the val losses from the training criterion and run on the live EMA model;
the numbers are Ultralytics', and a test checks they agree with its standalone validator on the same weights. Under
torchrun every rank evaluates its contiguous share of the images (data/batches.ShardBatches: whole batches, none
padded or repeated); the per-image statistics are gathered to rank 0, which computes the metrics once, and every rank
gets them, so each image is predicted once and the figures are one process's.
"""

from __future__ import annotations

import contextlib
import tempfile
from collections.abc import Callable
from pathlib import Path

import torch
from rich.console import Console
from rich.table import Table

from yoloaccum.config.settings import Config
from yoloaccum.config.ultra import ultralytics_args
from yoloaccum.core import backoff
from yoloaccum.data import batches, shared_cache
from yoloaccum.data import datasets as data
from yoloaccum.data.datasets import DatasetSpec
from yoloaccum.distributed import ddp as distributed
from yoloaccum.distributed.ddp import Context
from yoloaccum.errors import UserError
from yoloaccum.process.rng import rng_kept

METRIC_KEYS = ("metrics/precision(B)", "metrics/recall(B)", "metrics/mAP50(B)", "metrics/mAP50-95(B)")


class Evaluator:
    """Validates a model on one split; `evaluate(model, criterion)` returns Ultralytics' metric dict (+ val losses).

    Under torchrun (`ctx` of several ranks) every rank builds one and calls evaluate() together: a collective. Only
    rank 0 (`save_dir` given) draws plots; the others' validator writes into a temporary folder it never fills."""

    def __init__(
        self,
        cfg: Config,
        spec: DatasetSpec,
        save_dir: Path | None,
        batch: int,
        device: torch.device,
        log: Callable[[str], None] = print,
        ctx: Context | None = None,
    ):
        from ultralytics.models.yolo.detect import DetectionValidator

        self.ctx = ctx or Context(0, 0, 1, device)
        self.workers = batches.loader_workers(cfg.workers, device)
        args = ultralytics_args(
            cfg, mode="val", batch=batch, conf=cfg.conf or 0.001, data=str(spec.yaml_file), workers=self.workers
        )
        self._scratch = None if save_dir else tempfile.TemporaryDirectory(prefix="yoloaccum-val-")
        self.draws = save_dir is not None
        self.shared = shared_cache.wanted(cfg.cache, self.ctx)  # cache=ram: once per machine (data/shared_cache.py)
        self.cached = None  # the images so cached, kept for the loaders a back-off builds
        if self.shared:
            args.cache = False
        self.validator = v = DetectionValidator(save_dir=Path(save_dir or self._scratch.name), args=args)
        v.data = {"names": spec.names, "nc": spec.nc, "channels": 3, cfg.split: [str(p) for p in spec.val]}
        v.device, v.stride, v.training = device, 32, True  # training=True: no JSON; plots only when asked
        self.yaml_file, self.split, self.log, self.classes = spec.yaml_file, cfg.split, log, cfg.classes
        self.set_batch(batch)

    def set_batch(self, batch: int) -> None:
        """Validate in batches of `batch` images from now on: every rank calls it together (a collective), and cuts
        its share of the images by it. The first rank builds the dataset first (it may write Ultralytics' label
        cache); a folder that only some ranks see stops every rank with one line, none waiting for the others."""
        error, self.share_batch = None, batch
        # Building Ultralytics' dataset draws from Python's random numbers. Rank 0 built one before validation was
        # shared; the other ranks' training draws stay what they were without one.
        kept = contextlib.nullcontext() if self.ctx.is_main else rng_kept()
        with distributed.main_first(self.ctx), kept:
            try:
                self.dataset = self._dataset(batch)
            except UserError as e:
                error = str(e)
        distributed.every_rank_ok(error, self.ctx)
        if self.shared and self.cached is None:
            shared_cache.cache_once_per_machine(self.dataset, self.ctx, self.split)
            self.cached = self.dataset.ims, self.dataset.im_hw0, self.dataset.im_hw, self.dataset.cache
        elif self.shared:  # a later batch: the images cached at the first
            self.dataset.ims, self.dataset.im_hw0, self.dataset.im_hw, self.dataset.cache = self.cached
        self._build_loader(batch)

    def _dataset(self, batch: int):
        """Ultralytics' validation dataset, its rectangular batches grouped by `batch`."""
        v, paths = self.validator, self.validator.data[self.split]
        try:
            dataset = v.build_dataset(paths if len(paths) > 1 else paths[0], mode="val", batch=batch)
        except FileNotFoundError as e:
            raise UserError(f"{self.yaml_file}: no images found for {self.split} in {', '.join(paths)}") from e
        if len(dataset) == 0:
            raise UserError(f"{self.yaml_file}: the {self.split} split holds no images; give it some, or val=False")
        data.check_labels(dataset, self.yaml_file, self.split, paths, self.classes)
        return dataset

    def _build_loader(self, batch: int) -> None:
        """A loader over this rank's share of the dataset: each of its batches of share_batch images (the shapes of
        one process's) cut into batches of at most `batch`, smaller where this rank ran out of memory."""
        from ultralytics.data.build import InfiniteDataLoader, seed_worker

        dataset, self.batch, self.num_images = self.dataset, batch, len(self.dataset)
        share_batch = min(self.share_batch, len(dataset))  # as Ultralytics' loader: a smaller set is one batch
        shares = batches.ShardBatches(len(dataset), share_batch, self.ctx.rank, self.ctx.world_size, batch)
        # Its own generator: starting the loader draws a seed from it, not from training's random states.
        self.validator.dataloader = InfiniteDataLoader(
            dataset,
            batch_sampler=shares,
            num_workers=min(self.workers, len(shares)) if len(shares) > 1 else 0,
            collate_fn=dataset.collate_fn,
            worker_init_fn=seed_worker,
            generator=torch.Generator(),
            pin_memory=self.validator.device.type == "cuda",
        )

    def evaluate(self, model: torch.nn.Module, criterion=None, plots: bool = False) -> dict[str, float]:
        """Metrics of `model` (eval mode, fp32); val losses too when the training criterion is given.

        With plots, Ultralytics' validator also draws into save_dir what its final validation draws: the first three
        batches with their labels and predictions, both confusion matrices (of every rank's images), and the PR, F1, P
        and R curves (rank 0 draws).
        On running out of device memory a rank runs its share again at half the batch (validation changes no state,
        so it can), and later validations keep the smaller batch.
        """
        while True:
            try:
                mine = self._evaluate_share(model, criterion, plots)
                break
            except RuntimeError as e:
                if not backoff.is_out_of_memory(e) or self.batch == 1:
                    raise
            # outside the except block, so that the failed batch's tensors are freed with its traceback
            if self.validator.device.type == "cuda":
                torch.cuda.empty_cache()
            self.log(f"validation ran out of memory at {self.batch} images a batch; validating at {self.batch // 2}")
            self._build_loader(self.batch // 2)
        return self._combine(*mine, plots)

    @torch.no_grad()
    def _evaluate_share(self, model: torch.nn.Module, criterion, plots: bool):
        """This rank's share: its images' statistics (kept in the validator), and the val losses summed per batch."""
        v = self.validator
        was_training = model.training
        model.eval()
        model.end2end = v.args.nms is False  # as Ultralytics' validator: NMS on the one-to-many head unless nms=False
        v.args.plots = plots  # read by init_metrics, update_metrics (confusion matrix) and get_stats (curves)
        v.init_metrics(model)
        losses, count = None, 0
        try:
            for i, batch in enumerate(v.dataloader):
                count += 1
                batch = v.preprocess(batch)
                preds = model(batch["img"])
                if criterion is not None:
                    # float64: the ranks' sums are added in another order than one process adds the batches
                    items = torch.stack(list(criterion(preds, batch)[1].values())).double()
                    losses = items if losses is None else losses + items
                detections = v.postprocess(preds)
                v.update_metrics(detections, batch)
                if plots and self.draws and i < 3:
                    v.plot_val_samples(batch, i)
                    v.plot_predictions(batch, drawable(detections), i)
        finally:  # also when a batch ran out of memory: evaluate() runs again from a model in its own mode
            model.train(was_training)
        return losses, count, getattr(criterion, "one2one", criterion)

    def _combine(self, losses, count: int, criterion, plots: bool) -> dict[str, float]:
        """Every rank's statistics gathered to rank 0, which computes the metrics once; every rank returns them. A
        collective every rank calls, also one whose share is empty."""
        v, ctx = self.validator, self.ctx
        try:
            if ctx.world_size > 1:
                gathered = distributed.gather_to_main(v.metrics.stats, ctx)
                matrix = torch.as_tensor(v.confusion_matrix.matrix, device=ctx.device, dtype=torch.float64)
                distributed.all_reduce_sum(matrix, ctx)  # only rank 0 draws it, with plots
                if ctx.is_main:
                    v.metrics.stats = {k: [x for stats in gathered for x in stats[k]] for k in v.metrics.stats}
                    v.confusion_matrix.matrix = matrix.cpu().numpy()
            out = None
            if ctx.is_main:
                if plots and self.draws:
                    v.finalize_metrics()  # draws the confusion matrices
                stats = v.get_stats()
                out = {k: float(stats[k]) for k in (*METRIC_KEYS, "fitness")}
            else:
                v.metrics.clear_stats()
        finally:
            v.args.plots = False
        if criterion is not None:
            names = criterion.loss_names
            summed = torch.zeros(len(names) + 1, dtype=torch.float64, device=ctx.device)
            summed[-1] = count
            if losses is not None:
                summed[:-1] += losses.to(ctx.device)
            *totals, batches_run = distributed.all_reduce_sum(summed, ctx).tolist()  # every rank's batches
            val_losses = {f"val/{n}": x / batches_run for n, x in zip(names, totals)}
            out = None if out is None else {**out, **val_losses}
        return distributed.from_main(out, ctx)

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
