"""Validation and cache=ram under torchrun, 1 rank against 2, side by side on this machine.

    python benchmarks/ddp_validation.py [--quick]

Each measurement is a fresh torchrun job (gloo on the CPU, one thread a rank, as torchrun sets it) running this file
with --worker: it builds the shapes set's validation Evaluator, the run's own, and times one validation of yolo26n at
160 px in batches of 16, after a warm-up one; then it builds the training set with cache=ram and reports the memory the
cache added on the machine: the growth, once every image was read, of every rank's proportional set size (shared pages
split among the ranks that map them) summed over the ranks. The 1- and 2-rank jobs alternate within each repeat;
medians. The 2-rank cache is measured twice: shared once per machine (yoloaccum), and one copy per rank (Ultralytics'
way, --per-rank).
Writes benchmarks/results_ddp_validation.json and prints a Markdown table.
"""

from __future__ import annotations

import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent
OUT = HERE / "results_ddp_validation.json"
IMGSZ, BATCH, MODEL = 160, 16, "yolo26n.yaml"


def pss_bytes() -> int:
    """This process's proportional set size: its private pages, and each shared page split among its mappers."""
    for line in Path("/proc/self/smaps_rollup").read_text().splitlines():
        if line.startswith("Pss:"):
            return int(line.split()[1]) * 1024
    return 0


def worker(data: str, out: str, per_rank: bool) -> None:
    """Under torchrun: one validation timed, then the training set cached; rank 0 writes what every rank measured."""
    import torch

    sys.path.insert(0, str(HERE))
    import common  # noqa: F401  (Ultralytics offline and quiet)
    from ultralytics.nn.tasks import DetectionModel

    from yoloaccum.config import settings as config
    from yoloaccum.data import datasets, shared_cache
    from yoloaccum.distributed import ddp as distributed
    from yoloaccum.evaluation.validate import Evaluator

    ctx = distributed.setup("cpu")
    cfg = config.resolve([f"data={data}", f"imgsz={IMGSZ}", f"batch={BATCH}", "workers=0", "cache=False"])
    spec = datasets.load_spec(data)
    torch.manual_seed(0)
    model = DetectionModel(MODEL, nc=spec.nc, verbose=False).fuse(verbose=False)
    evaluator = Evaluator(cfg, spec, None, BATCH, ctx.device, ctx=ctx)
    evaluator.evaluate(model)  # warm-up: kernels, allocator
    distributed.barrier(ctx)
    start = time.perf_counter()
    evaluator.evaluate(model)
    seconds = time.perf_counter() - start
    distributed.barrier(ctx)
    before = pss_bytes()
    cached = cfg.replace(cache="ram")
    if per_rank:  # Ultralytics' way: every rank decodes and keeps its own copy
        dataset = datasets.build_dataset(cached, spec, "train")
    else:
        dataset = datasets.build_dataset(cfg, spec, "train")
        if shared_cache.wanted("ram", ctx):
            shared_cache.cache_once_per_machine(dataset, ctx, "train")
        else:
            dataset.cache = "ram"
            dataset.cache_images()
    int(dataset.ims.buffer.sum())  # every image read once, as an epoch reads them: mapped pages count once touched
    distributed.barrier(ctx)
    added = pss_bytes() - before
    cache_bytes = int(dataset.ims.offsets[-1])
    gathered = distributed.gather_to_main({"seconds": seconds, "added": added}, ctx)
    if ctx.is_main:
        result = {
            "validation_s": max(g["seconds"] for g in gathered),  # the collective ends with the slowest rank
            "cache_added_bytes": sum(g["added"] for g in gathered),
            "cache_bytes": cache_bytes,
            "images": evaluator.num_images,
        }
        Path(out).write_text(json.dumps(result))
    distributed.cleanup()


def job(ranks: int, data: Path, per_rank: bool = False) -> dict:
    out = Path(tempfile.mkdtemp()) / "out.json"
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc_per_node={ranks}", __file__]
    cmd += ["--worker", str(data), str(out), *(["--per-rank"] if per_rank else [])]
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    r = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=1800)
    if r.returncode:
        raise RuntimeError(f"{' '.join(cmd)} failed:\n{r.stderr[-3000:]}")
    return json.loads(out.read_text())


def main(quick: bool) -> None:
    sys.path.insert(0, str(HERE))
    from common import shapes_data

    counts = {"num_train": 64, "num_val": 32, "imgsz": IMGSZ, "seed": 0} if quick else None
    data = shapes_data(tempfile.mkdtemp() if quick else None, smoke=False, counts=counts)
    repeats = 1 if quick else 3
    runs: dict[str, list[dict]] = {"1": [], "2": [], "2_per_rank": []}
    for _ in range(repeats):  # alternated, so that the machine's pace of the moment hits all alike
        runs["1"].append(job(1, data))
        runs["2"].append(job(2, data))
        runs["2_per_rank"].append(job(2, data, per_rank=True))
    median = {k: {m: statistics.median(r[m] for r in v) for m in v[0]} for k, v in runs.items()}
    report = {
        "model": MODEL,
        "imgsz": IMGSZ,
        "batch": BATCH,
        "validation_images": median["1"]["images"],
        "repeats": repeats,
        "threads_per_rank": 1,
        "median": median,
        "validation_speedup_2_ranks": median["1"]["validation_s"] / median["2"]["validation_s"],
        "cache_memory_2_ranks_over_1": median["2"]["cache_added_bytes"] / median["1"]["cache_added_bytes"],
        "cache_memory_2_ranks_per_rank_over_1": median["2_per_rank"]["cache_added_bytes"]
        / median["1"]["cache_added_bytes"],
    }
    if not quick:
        OUT.write_text(json.dumps(report, indent=1))
    print(table(report))


def table(report: dict) -> str:
    m, mb = report["median"], 1 << 20
    return "\n".join(
        [
            f"{report['model']} at {report['imgsz']} px, {report['validation_images']:.0f} validation images in "
            f"batches of {report['batch']}, gloo, {report['threads_per_rank']} thread a rank, median of "
            f"{report['repeats']}",
            "",
            "| | 1 rank | 2 ranks | 2 ranks / 1 |",
            "| --- | --- | --- | --- |",
            f"| one validation (s) | {m['1']['validation_s']:.2f} | {m['2']['validation_s']:.2f} | "
            f"{1 / report['validation_speedup_2_ranks']:.2f}x the time |",
            f"| cache=ram, the machine's added memory (MB), shared once per machine | "
            f"{m['1']['cache_added_bytes'] / mb:.0f} | {m['2']['cache_added_bytes'] / mb:.0f} | "
            f"{report['cache_memory_2_ranks_over_1']:.2f}x |",
            f"| the same, one copy per rank (Ultralytics' way) | {m['1']['cache_added_bytes'] / mb:.0f} | "
            f"{m['2_per_rank']['cache_added_bytes'] / mb:.0f} | "
            f"{report['cache_memory_2_ranks_per_rank_over_1']:.2f}x |",
        ]
    )


if __name__ == "__main__":
    if "--worker" in sys.argv:
        i = sys.argv.index("--worker")
        worker(sys.argv[i + 1], sys.argv[i + 2], "--per-rank" in sys.argv)
    else:
        main("--quick" in sys.argv)
