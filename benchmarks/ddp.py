"""DDP benchmark: seconds per optimizer step and gradient all-reduces per step, with no_sync and without it.

    python -m torch.distributed.run --standalone --nproc_per_node=2 benchmarks/ddp.py [--quick]

Runs yoloaccum's Engine under real DDP (gloo on the CPU, nccl on CUDA) on synthetic batches held in memory, for
accumulate 1, 4 and 8. The two modes alternate within each repeat, so machine noise hits both alike; each figure is
the median over the repeats. Rank 0 writes benchmarks/results_ddp.json and prints a Markdown table.
"""

from __future__ import annotations

import json
import os
import platform
import statistics
import sys
import time
from pathlib import Path

import torch
from torch.distributed.algorithms.ddp_comm_hooks import default_hooks

import yoloaccum.config.ultra  # noqa: F401  (ultralytics offline before it is imported)
from yoloaccum.config import settings as config
from yoloaccum.config.ultra import ultralytics_args
from yoloaccum.core import schedule
from yoloaccum.core.engine import Engine
from yoloaccum.core.loss import WindowLoss
from yoloaccum.distributed import ddp as distributed

sys.path.insert(0, str(Path(__file__).resolve().parent))
from common import make_batches  # noqa: E402

OUT = Path(__file__).resolve().parent / "results_ddp.json"
MICRO, IMGSZ, MODEL = 4, 96, "yolo11n.yaml"


def engine_for(ctx, accumulate: int, windows: int, no_sync: bool) -> tuple[Engine, list[int]]:
    from ultralytics.nn.tasks import DetectionModel

    batch = MICRO * ctx.world_size
    cfg = config.resolve(
        overrides=dict(batch=batch, nbs=batch * accumulate, epochs=1, warmup_epochs=0, optimizer="SGD", imgsz=IMGSZ)
    )
    s = schedule.build(cfg, num_images=batch * accumulate * windows, world_size=ctx.world_size, nc=4)
    torch.manual_seed(0)
    raw = DetectionModel(MODEL, nc=4, verbose=False).to(ctx.device)
    raw.args = ultralytics_args(cfg)
    loss = WindowLoss(raw, "window")
    engine = Engine.build(raw, loss, s, ctx, no_sync=no_sync)
    calls = [0]

    def counting_hook(state, bucket):
        calls[0] += 1
        return default_hooks.allreduce_hook(None, bucket)

    engine.model.register_comm_hook(None, counting_hook)
    engine.model.train()
    return engine, calls


def measure(ctx, accumulate: int, no_sync: bool, windows: int) -> tuple[float, float]:
    """Seconds per optimizer step and gradient all-reduce calls (buckets) per step, after one warm-up window."""
    engine, calls = engine_for(ctx, accumulate, windows + 1, no_sync)
    batches = make_batches(accumulate * (windows + 1), MICRO, IMGSZ, seed=ctx.rank)  # each rank its own images
    start = [0.0]

    def after_warm_up(i, *_):  # the first window builds DDP's buckets and warms the kernels: not timed
        if i == accumulate - 1:
            distributed.barrier(ctx)
            calls[0], start[0] = 0, time.perf_counter()

    engine.train_epoch(0, batches, after_warm_up)
    distributed.barrier(ctx)
    return (time.perf_counter() - start[0]) / windows, calls[0] / windows


def main(quick: bool) -> None:
    ranks_here = int(os.environ.get("LOCAL_WORLD_SIZE", "1"))  # one listed device per rank of this machine
    ctx = distributed.setup(",".join(map(str, range(ranks_here))) if torch.cuda.is_available() else "cpu")
    repeats, windows = (1, 1) if quick else (3, 3)
    rows = []
    for accumulate in (1, 4, 8):
        times = {True: [], False: []}
        calls = {}
        for _ in range(repeats):
            for no_sync in (True, False):  # alternate, so noise hits both modes alike
                seconds, per_step = measure(ctx, accumulate, no_sync, windows)
                times[no_sync].append(seconds)
                calls[no_sync] = per_step
        with_ns, without = statistics.median(times[True]), statistics.median(times[False])
        rows.append(
            {
                "accumulate": accumulate,
                "seconds_per_step_no_sync": with_ns,
                "seconds_per_step_sync_each": without,
                "speedup": without / with_ns,
                "allreduce_calls_per_step_no_sync": calls[True],
                "allreduce_calls_per_step_sync_each": calls[False],
            }
        )
    if ctx.is_main:
        report = {
            "machine": platform.processor() or platform.machine(),
            "torch": torch.__version__,
            "backend": "nccl" if ctx.device.type == "cuda" else "gloo",
            "world_size": ctx.world_size,
            "model": MODEL,
            "imgsz": IMGSZ,
            "micro_batch_per_rank": MICRO,
            "repeats": repeats,
            "windows_per_repeat": windows,
            "rows": rows,
        }
        if not quick:
            OUT.write_text(json.dumps(report, indent=1))
        print(table(report))
    distributed.cleanup()


def table(report: dict) -> str:
    lines = [
        f"{report['world_size']} ranks ({report['backend']}), {report['model']} at {report['imgsz']} px, "
        f"micro-batch {report['micro_batch_per_rank']} per rank, median of {report['repeats']}",
        "",
        "| accumulate | s/step, no_sync | s/step, sync every micro-batch | speed-up | all-reduce calls/step, "
        "no_sync | all-reduce calls/step, every micro-batch |",
        "| --- | --- | --- | --- | --- | --- |",
    ]
    for r in report["rows"]:
        lines.append(
            f"| {r['accumulate']} | {r['seconds_per_step_no_sync']:.2f} | {r['seconds_per_step_sync_each']:.2f} "
            f"| {r['speedup']:.2f}x | {r['allreduce_calls_per_step_no_sync']:.0f} | "
            f"{r['allreduce_calls_per_step_sync_each']:.0f} |"
        )
    return "\n".join(lines)


if __name__ == "__main__":
    main("--quick" in sys.argv)
