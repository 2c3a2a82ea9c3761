"""A run's parts, built in the order the data flows through them: process group, dataset, run folder, model, EMA,
loss, micro-batch, schedule, loader, engine, evaluator. The trainer, the tests and the benchmarks build runs here.

Nothing here trains; Trainer (trainer.py) composes the parts and runs them, and state.py puts a checkpoint's state
back into them.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import torch

from yoloaccum.batchnorm import window as norm
from yoloaccum.config.settings import Config
from yoloaccum.core import loss, precision
from yoloaccum.core import schedule as schedule_
from yoloaccum.core.ema import EMA
from yoloaccum.core.engine import Engine
from yoloaccum.data import batches, shared_cache
from yoloaccum.data import datasets as data
from yoloaccum.distributed import ddp as distributed
from yoloaccum.evaluation.validate import Evaluator
from yoloaccum.model import autobatch, freeze
from yoloaccum.model import build as model_
from yoloaccum.process.memory import keep_freed_memory
from yoloaccum.process.rng import seed_everything
from yoloaccum.training import resume
from yoloaccum.training.parts import Parts
from yoloaccum.training.runs import RunDir


def build(cfg: Config, ckpt: dict[str, Any] | None = None, ckpt_path: Path | None = None) -> Parts:
    """The run's parts for `cfg`; with `ckpt` (a loaded last.pt, see state.read) those of the run it continues, in
    its folder, with its schedule. The checkpoint's weights and positions are put back by state.restore, not here."""
    ctx = distributed.setup(cfg.device, cfg.ddp_timeout)
    # Augmentation draws differ per rank, as in Ultralytics; DDP broadcasts rank 0's initial weights.
    seed_everything(cfg.seed + ctx.rank, cfg.deterministic)
    if ctx.device.type == "cpu":  # measured where it was tuned: training on the CPU (docs/performance.md)
        keep_freed_memory()
    with distributed.main_first(ctx):  # rank 0 generates shapes and writes the label cache; then the others
        spec = data.load_spec(cfg.data, cfg.split)
        data.check_classes(cfg.classes, spec)
        shared = shared_cache.wanted(cfg.cache, ctx)  # cache=ram once per machine, below, not once per rank
        train_set = data.build_dataset(cfg.replace(cache=False) if shared else cfg, spec, "train")
    if shared:
        shared_cache.cache_once_per_machine(train_set, ctx, "train")
    if not str(cfg.model).endswith(".pt"):
        model_.resolve_yaml(cfg.model)  # a wrong name fails here, before a run folder is made
    raw_model = model_.build(cfg, spec, verbose=False, announce=ctx.is_main).to(ctx.device)
    frozen = freeze.apply(raw_model, cfg.freeze)
    run = None
    if ctx.is_main:
        run = RunDir.reopen(ckpt_path.parent.parent) if ckpt_path else RunDir.create(cfg)
        print(data.summary("train", train_set), flush=True)
    try:
        return _build_on(cfg, ctx, ckpt, spec, train_set, run, raw_model, frozen)
    except BaseException:
        if run is not None and not ckpt_path:
            run.discard()  # a run that failed before training leaves no folder behind
        raise


def _build_on(cfg, ctx, ckpt, spec, train_set, run, raw_model, frozen) -> Parts:
    """build()'s parts from the model on, once the run folder exists."""
    if cfg.channels_last:  # NHWC convolutions run forward and backward faster (docs/performance.md)
        raw_model.to(memory_format=torch.channels_last)
    ema = EMA(raw_model)  # before the criterion is attached, so the EMA copy carries none
    if frozen:
        freeze.keep_in_ema(ema, raw_model, frozen)
    if cfg.grad_checkpointing:  # after the EMA copy, which only evaluates
        model_.checkpoint_blocks(raw_model)
    criterion = loss.WindowLoss(raw_model, cfg.norm)
    if run:
        criterion.set_log(run.console.print)
    amp_dtype = precision.autocast_dtype(cfg.amp, ctx.device)  # None: float32
    amp = amp_dtype is not None
    # batch=-1 or a fraction: measured with the model as it trains, or on resume the run's first choice
    batch_choice = autobatch.for_run(cfg, ctx, ckpt, raw_model, criterion, amp, train_set)
    batch = batch_choice.batch if batch_choice else cfg.batch
    schedule = schedule_.build(cfg.replace(batch=batch), len(train_set), ctx.world_size, spec.nc)
    if ckpt is not None:  # with time=, the epochs the run re-estimated last, which it estimates again
        schedule = resume.resumed_schedule(ckpt["yoloaccum"], schedule, spec.nc, follow_epochs=not cfg.time)
    # mosaic's pool: 8 windows of this device's images, as a real batch of nbs would draw them, or (batch) 8 global
    # micro-batches, as yoloaccum sized it before the key (on one device, Ultralytics' sizing)
    window = schedule.effective_batch // ctx.world_size if cfg.mosaic_buffer == "window" else batch
    data.set_batch(train_set, batch, window)
    loader = batches.build_loader(train_set, cfg, schedule.micro_batch, ctx.rank, ctx.world_size, ctx.device)
    # the mode in force: bn=auto resolved, or on resume the mode the run trained with (last.pt keeps it)
    bn = ckpt["yoloaccum"]["bn"] if ckpt else schedule_.bn_mode(cfg.bn, schedule.micro_batch)
    window_statistics = None
    if bn == "window":  # before the optimizer is built: the layers are replaced, their parameters kept
        norm.convert(raw_model, frozen)
        window_statistics = norm.WindowStatistics(
            raw_model, cfg.bn_window, amp=amp, amp_dtype=amp_dtype or torch.float16
        )
    log = run.console.print if run else (lambda message: None)
    engine = Engine.build(
        raw_model,
        criterion,
        schedule,
        ctx,
        bn,
        amp,
        amp_dtype=amp_dtype or torch.float16,
        clip_grad=cfg.clip_grad,
        ema=ema,
        nan_patience=cfg.nan_patience,
        log=log,
        window_statistics=window_statistics,
    )
    # every rank validates its share of the images, in batches of twice the micro-batch; rank 0 draws the plots
    evaluator = Evaluator(cfg, spec, run.path if run else None, schedule.micro_batch * 2, ctx.device, log, ctx=ctx)
    if run and ckpt is not None and resume.extension_note(ckpt["yoloaccum"], cfg):
        run.write_args(cfg)  # the run's settings now, its new epochs, once every part was built for them
    return Parts(
        cfg,
        ctx,
        spec,
        train_set,
        run,
        raw_model,
        bn,
        frozen,
        ema,
        criterion,
        batch_choice,
        schedule,
        loader,
        engine,
        evaluator,
    )


def build_loader(parts: Parts) -> torch.utils.data.DataLoader:
    """The training loader again (close_mosaic: its workers hold a copy of the dataset as it was)."""
    p = parts
    return batches.build_loader(p.train_set, p.cfg, p.schedule.micro_batch, p.ctx.rank, p.ctx.world_size, p.ctx.device)
