"""The trainer: builds a run (data, model, engine), then each epoch trains, validates, logs and saves.

The accumulation loop itself is engine.Engine; *when* to step comes from schedule, the loss normaliser from
loss.WindowLoss. Rank 0 alone validates, logs and writes; every rank trains.
"""

from __future__ import annotations

import os
import time
from typing import Any

import torch

from yoloaccum import checkpoint, data, distributed, loss, optim
from yoloaccum import model as model_
from yoloaccum import schedule as schedule_
from yoloaccum.config import Config, resolve
from yoloaccum.engine import Engine
from yoloaccum.errors import UserError
from yoloaccum.progress import EXTRA_COLUMNS, EpochProgress
from yoloaccum.runs import RunDir, seed_everything
from yoloaccum.validate import Evaluator, metrics_table


class Trainer:
    """Trains cfg.model on cfg.data with gradient accumulation (see Engine for the step contract).

    Outputs, on rank 0 under project/name: args.yaml, results.csv, results.png, weights/last.pt and best.pt.
    """

    def __init__(self, cfg: Config):
        from ultralytics.utils.torch_utils import EarlyStopping, ModelEMA

        self.cfg = cfg
        self.ctx = distributed.setup(cfg.device)
        seed_everything(cfg.seed, cfg.deterministic)
        self.spec = data.load_spec(cfg.data, cfg.split)
        self.run = RunDir.create(cfg) if self.ctx.is_main else None
        self.train_set = data.build_dataset(cfg, self.spec, "train")
        self.schedule = schedule_.build(cfg, len(self.train_set), self.ctx.world_size, self.spec.nc)
        self.loader = self._loader()
        self.raw_model = model_.build(cfg, self.spec, verbose=False).to(self.ctx.device)
        ema = ModelEMA(self.raw_model)  # before the criterion is attached, so the EMA copy carries none
        self.loss = loss.WindowLoss(self.raw_model, cfg.norm)
        amp = cfg.amp and self.ctx.device.type == "cuda"  # AMP is a CUDA feature; on the CPU it stays fp32
        self.engine = Engine(
            model=distributed.wrap(self.raw_model, self.ctx, cfg.bn),
            raw_model=self.raw_model,
            loss=self.loss,
            optimizer=optim.build_optimizer(self.raw_model, self.schedule),
            schedule=self.schedule,
            ctx=self.ctx,
            clip_grad=cfg.clip_grad,
            scaler=torch.amp.GradScaler("cuda", enabled=amp),
            ema=ema,
            amp=amp,
        )
        self.ema, self.optimizer = ema, self.engine.optimizer
        self.stopper = EarlyStopping(patience=cfg.patience)
        self.evaluator = Evaluator(cfg, self.spec, self.run.path, cfg.batch * 2, self.ctx.device) if self.run else None
        self.start_epoch, self.best_fitness, self.metrics, self.mosaic_closed = 0, None, {}, False

    def _loader(self):
        s = self.schedule
        return data.build_loader(self.train_set, self.cfg, s.micro_batch, self.ctx.rank, self.ctx.world_size, True)

    def train(self) -> dict[str, float]:
        """Run every epoch; returns the final validation metrics."""
        s, cfg = self.schedule, self.cfg
        if self.run:
            self.run.announce(s, len(self.train_set), self.ctx)
        for epoch in range(self.start_epoch, s.epochs):
            t0 = time.perf_counter()
            if cfg.close_mosaic and epoch >= s.epochs - cfg.close_mosaic and not self.mosaic_closed:
                self._close_mosaic()
            images_per_second = self.train_epoch(epoch)
            self.loss.end_epoch()
            final = epoch + 1 == s.epochs
            stop = self.end_epoch(epoch, final, images_per_second, time.perf_counter() - t0)
            if stop:
                break
        distributed.barrier(self.ctx)
        return self.metrics

    def train_epoch(self, epoch: int) -> float:
        """One pass over the data through the engine; returns images per second over all devices."""
        s = self.schedule
        self.loader.batch_sampler.set_epoch(epoch)
        self.engine.model.train()
        model_.set_bn_mode(self.engine.model, self.cfg.bn)
        progress = EpochProgress(epoch, s.epochs, s.batches_per_epoch, self.loss_names, self.cfg.log_every,
                                 self.ctx.device, enabled=self.run is not None)  # fmt: skip

        def on_micro_step(i, items, images, fill, accumulate, lr):
            progress.update(i, items, images, fill, accumulate, s.batch * accumulate, lr)

        try:
            self.engine.train_epoch(epoch, self.loader, on_micro_step)
        finally:
            progress.close()
        self.train_losses = progress.mean_losses(s.batches_per_epoch)
        return progress.images_per_second() * self.ctx.world_size

    @property
    def loss_names(self) -> tuple[str, ...]:
        return tuple(getattr(self.loss.criterion, "one2one", self.loss.criterion).loss_names)

    def _close_mosaic(self) -> None:
        from yoloaccum.ultra import ultralytics_args

        self.train_set.close_mosaic(hyp=ultralytics_args(self.cfg))  # sets mosaic, mixup, cutmix to 0
        self.loader = self._loader()  # workers hold a copy of the dataset: start them again
        self.mosaic_closed = True

    def end_epoch(self, epoch: int, final: bool, images_per_second: float, seconds: float) -> bool:
        """Validate, log and save on rank 0; returns whether to stop (early stopping or the final epoch)."""
        stop = final
        if self.run is not None:
            if self.cfg.val or final:
                self.metrics = self.evaluator.evaluate(self.ema.ema, self.loss.criterion)
            fitness = self.metrics.get("fitness", 0.0)
            if self.best_fitness is None or fitness > self.best_fitness:
                self.best_fitness = fitness
            self.run.results.append(self._row(epoch, seconds, images_per_second))
            if self.cfg.verbose and self.metrics:
                self.run.console.print(metrics_table(self.metrics, f"epoch {epoch + 1}/{self.schedule.epochs}"))
            self.save(epoch, best=fitness == self.best_fitness)
            stop |= self.stopper(epoch + 1, fitness)
        return self._agree(stop)

    def _agree(self, stop: bool) -> bool:
        flag = torch.tensor([float(stop)], device=self.ctx.device)
        return bool(distributed.all_reduce_sum(flag, self.ctx).item())  # every rank stops together

    def _row(self, epoch: int, seconds: float, images_per_second: float) -> dict[str, float]:
        s = self.schedule
        row: dict[str, float] = {"epoch": epoch + 1, "time": round(seconds, 3)}
        row.update({f"train/{n}": v for n, v in zip(self.loss_names, self.train_losses)})
        row.update(self.metrics)
        row.pop("fitness", None)
        row.update({f"lr/pg{i}": g["lr"] for i, g in enumerate(self.optimizer.param_groups)})
        row.update(zip(EXTRA_COLUMNS, (s.accumulate, s.effective_batch, s.weight_decay, images_per_second)))
        return row

    def save(self, epoch: int, best: bool) -> None:
        """last.pt every epoch (and best.pt when fitness improved), in Ultralytics' layout."""
        if not self.cfg.save:
            return
        ckpt = self.checkpoint(epoch)
        w = self.run.weights
        checkpoint.save_atomic(ckpt, w / "last.pt")
        if best:
            checkpoint.save_atomic(ckpt, w / "best.pt")
        if self.cfg.save_period > 0 and (epoch + 1) % self.cfg.save_period == 0:
            checkpoint.save_atomic(ckpt, w / f"epoch{epoch + 1}.pt")

    def checkpoint(self, epoch: int) -> dict[str, Any]:
        from yoloaccum.ultra import VERSION, ultralytics_args

        self.ema.update_attr(self.raw_model, include=["yaml", "nc", "args", "names", "stride"])
        return {
            "epoch": epoch,
            "best_fitness": self.best_fitness,
            "model": None,
            "ema": checkpoint.ultralytics_model(self.ema.ema),
            "updates": self.ema.updates,
            "optimizer": None,  # kept in full precision under "yoloaccum" for an exact resume
            "train_args": vars(ultralytics_args(self.cfg)),
            "train_metrics": dict(self.metrics),
            "date": time.strftime("%Y-%m-%dT%H:%M:%S"),
            "version": VERSION,
            "license": "AGPL-3.0",
            "yoloaccum": {
                "config": dict(self.cfg),
                "epoch": epoch,
                "model": self.raw_model.state_dict(),
                "ema": self.ema.ema.state_dict(),
                "optimizer": self.optimizer.state_dict(),
                "scaler": self.engine.scaler.state_dict(),
                "stopper": {"best_fitness": self.stopper.best_fitness, "best_epoch": self.stopper.best_epoch},
            },
        }


def run(args: list[str]) -> dict[str, float]:
    """`yoloaccum train ...`: resolve the config, train, and print where the weights are."""
    cfg = resolve(args)
    if cfg.data is None:
        raise UserError("train needs a dataset: give data=path/to/dataset.yaml (e.g. data=datasets/shapes.yaml)")
    if len(distributed.cuda_ids(cfg.device)) > 1 and "WORLD_SIZE" not in os.environ:
        raise SystemExit(distributed.launch(args, cfg.device))  # several devices: one process each, via torchrun
    trainer = Trainer(cfg)
    try:
        metrics = trainer.train()
        if trainer.run is not None:
            trainer.run.finish(trainer.evaluator, trainer.cfg)
        return metrics
    finally:
        distributed.cleanup()
