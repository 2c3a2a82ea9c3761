"""What bn=window costs: the engine's images/s against bn=batch, side by side in one process.

    python benchmarks/bn_window.py            # yolo26n at 160 px, micro-batches of 2 and 8, nbs 64
    python benchmarks/bn_window.py --smoke    # a few windows at 64 px, for the test suite

Both engines train the same in-memory batches (whole windows, steps included); their repetitions alternate, so a
slow spell of the machine falls on both, and the median of the repetitions is reported. Writes
benchmarks/bn_window.{md,json} (not with --smoke).
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent


def measure(micro: int, imgsz: int, windows: int, repeats: int) -> dict:
    from common import engine_for, make_batches, on_device, synchronize

    from yoloaccum import norm

    nbs = 64
    per_window = max(1, nbs // micro)
    engines = {}
    for mode in ("batch", "window"):
        e = engine_for("yolo26n.yaml", imgsz, batch=micro, nbs=nbs, num_batches=per_window * windows * repeats)
        if mode == "window":
            norm.convert(e.raw_model, nbs)
        engines[mode] = e
    batches = on_device(make_batches(per_window * windows, micro, imgsz, seed=0))
    rates = {mode: [] for mode in engines}
    for r in range(repeats + 1):  # the first repetition warms up and is not counted
        for mode, e in engines.items():
            synchronize()
            start = time.perf_counter()
            _windows(e, batches)
            synchronize()
            if r:
                rates[mode].append(len(batches) * micro / (time.perf_counter() - start))
    medians = {mode: statistics.median(v) for mode, v in rates.items()}
    cost = {"window": medians["batch"] / medians["window"]}
    return {"micro_batch": micro, "imgsz": imgsz, "images_per_second": medians, "cost": cost, "repeats": rates}


def _windows(engine, batches: list[dict]) -> None:
    """The batches' micro-steps, and a step at each window's end (accumulate = nbs / micro)."""
    k = engine.schedule.accumulate
    for i, b in enumerate(batches):
        engine.micro_step(dict(b))
        if (i + 1) % k == 0:
            engine.step(i)


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--smoke", action="store_true")
    args = p.parse_args()
    if args.smoke:
        rows = [measure(micro, 64, windows=1, repeats=1) for micro in (8, 16)]
    else:
        rows = [measure(micro, 160, windows=1, repeats=5) for micro in (2, 8)]
    for r in rows:
        ips = r["images_per_second"]
        costs = ", ".join(f"bn={m} {ips[m]:.1f} img/s ({c:.3f}x)" for m, c in r["cost"].items())
        print(f"micro-batch {r['micro_batch']}: bn=batch {ips['batch']:.1f} img/s, {costs}", flush=True)
    if args.smoke:
        return
    (HERE / "bn_window.json").write_text(json.dumps(rows, indent=1))
    lines = ["# The cost of bn=window (`python benchmarks/bn_window.py`)", "",
             "yolo26n at 160 px, nbs 64, synthetic batches in memory, the engine's micro-steps and steps; the modes "
             "alternate, 5 repetitions each after a warm-up, median. The 2-core CPU machine, nothing else running. "
             "Cost: time per image against bn=batch.", "",
             "| micro-batch | bn=batch img/s | bn=window img/s | cost |", "| --- | --- | --- | --- |"]  # fmt: skip
    for r in rows:
        ips, c = r["images_per_second"], r["cost"]
        lines.append(f"| {r['micro_batch']} | {ips['batch']:.1f} | {ips['window']:.1f} | {c['window']:.3f}x |")
    (HERE / "bn_window.md").write_text("\n".join(lines) + "\n")


if __name__ == "__main__":
    import sys

    sys.path.insert(0, str(HERE))
    main()
