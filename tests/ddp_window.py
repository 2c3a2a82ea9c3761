"""Run under torchrun by tests/test_distributed.py: one accumulation window through the real Engine and DDP.

    python -m torch.distributed.run --standalone --nproc_per_node=N tests/ddp_window.py OUT.pt BATCH NBS [OPTIONS]

With one rank there is no process group to join: test_distributed.window() calls main() in the test's own process.

16 synthetic images (tests/test_equivalence.py's batches) form one window of global micro-batches of BATCH images;
each rank takes its contiguous slice of each, as yoloaccum's sampler does. Rank 0 saves the gradient seen by the
optimizer, the weights after the step, and which micro-steps all-reduced gradients (counted by a DDP comm hook).

Options: sync-all (all-reduce after every micro-batch, as Ultralytics); bn-window (BatchNorm trains, as bn=window:
each rank passes over its own images of the window first); as-ranks=K (one process only, with bn-window: the window
of K ranks run here one rank after another, each with its own images' statistics, then one step: the reference
for K ranks).
"""

import sys
from pathlib import Path

import torch
from torch.distributed.algorithms.ddp_comm_hooks import default_hooks

sys.path.insert(0, str(Path(__file__).resolve().parent))
from test_equivalence import OBJECTS, concat, grads, make_model, micro_batch  # noqa: E402

from yoloaccum.batchnorm import window as norm
from yoloaccum.config import settings as config  # noqa: E402
from yoloaccum.core import schedule
from yoloaccum.core.engine import Engine  # noqa: E402
from yoloaccum.core.loss import WindowLoss  # noqa: E402
from yoloaccum.distributed import ddp as distributed


def main(out: str, batch: int, nbs: int, sync_all: bool, bn_window: bool, as_ranks: int) -> None:
    ctx = distributed.setup("cpu")
    objects = OBJECTS + [[0, 4], [2, 2], [6, 1], [3, 0]]  # 16 images, 0 to 7 objects each
    images = concat([micro_batch(n, seed) for seed, n in enumerate(objects)])
    cfg = config.resolve(overrides=dict(batch=batch, nbs=nbs, epochs=1, warmup_epochs=0, optimizer="SGD", lr0=0.01))
    s = schedule.build(cfg, num_images=16, world_size=ctx.world_size, nc=3)
    model = make_model("yolo11n.yaml")
    loss = WindowLoss(model, "window")
    engine = Engine.build(model, loss, s, ctx, "batch" if bn_window else "frozen", clip_grad=1e9, no_sync=not sync_all)
    if bn_window:  # make_model froze BatchNorm; here it trains, with each window's statistics
        norm.convert(model.train())
        engine.window_statistics = norm.WindowStatistics(model)
    ddp = engine.model

    forward_passes, communicated = [0], []
    model.register_forward_hook(lambda *_: forward_passes.__setitem__(0, forward_passes[0] + 1))
    if ctx.world_size > 1:

        def counting_hook(state, bucket):
            communicated.append(forward_passes[0])  # the micro-step whose backward all-reduces this bucket
            return default_hooks.allreduce_hook(None, bucket)

        ddp.register_comm_hook(None, counting_hook)
    seen = {}
    engine.optimizer.register_step_pre_hook(lambda opt, *_: seen.__setitem__("grad", grads(model)))
    if as_ranks:  # the reference: each simulated rank's micro-batches with its own statistics, one window
        assert ctx.world_size == 1 and bn_window
        micro = batch // as_ranks
        for rank in range(as_ranks):
            mine = list(rank_batches(images, micro, distributed.Context(rank, rank, as_ranks, ctx.device)))
            engine.window_statistics(mine)
            for b in mine:
                engine.micro_step(b)
        engine.step(s.total_iterations - 1)
    else:
        engine.train_epoch(0, list(rank_batches(images, s.micro_batch, ctx)))
    if ctx.is_main:
        weights = torch.cat([p.detach().flatten() for p in model.parameters()])
        torch.save(
            {"grad": seen["grad"], "weights": weights, "communicated": communicated, "steps": s.total_steps}, out
        )
    distributed.cleanup()


def rank_batches(images: dict, micro: int, ctx: distributed.Context):
    """This rank's slice of each global micro-batch of micro x world images."""
    step = micro * ctx.world_size
    for start in range(0, images["img"].shape[0], step):
        lo, hi = start + ctx.rank * micro, start + (ctx.rank + 1) * micro
        keep = (images["batch_idx"] >= lo) & (images["batch_idx"] < hi)
        yield {
            "img": images["img"][lo:hi],
            "batch_idx": images["batch_idx"][keep] - lo,
            "cls": images["cls"][keep],
            "bboxes": images["bboxes"][keep],
        }


def options(given: list[str] | tuple[str, ...]) -> tuple[bool, bool, int]:
    """main's sync_all, bn_window and as_ranks from the options as the command line names them."""
    as_ranks = next((int(o.split("=")[1]) for o in given if o.startswith("as-ranks=")), 0)
    return "sync-all" in given, "bn-window" in given, as_ranks


if __name__ == "__main__":
    main(sys.argv[1], int(sys.argv[2]), int(sys.argv[3]), *options(sys.argv[4:]))
