"""Precise BatchNorm with the upstream layers on batch statistics or on their new running statistics, compared on
the same final weights: the fidelity benchmark's kept checkpoints.

    python benchmarks/precise_upstream.py /tmp/fidelity-*/b8/run*/weights/last.pt ...

yoloaccum's precise_bn recomputes every layer in one forward pass, the layers upstream of each normalising with the
micro-batch's own statistics (as detectron2's PreciseBN). precise_bn.recompute_layerwise measures each layer with
the layers before it already on their new running statistics, as inference will see them: exact, at a pass per
layer. Each checkpoint (a fidelity run folder: <config>/run<seed>/weights/last.pt) is validated as trained and with
each recompute on the fidelity set; the rows go to benchmarks/precise_upstream.json, the table to stdout.
"""

from __future__ import annotations

import json
import statistics
import sys
import tempfile
from pathlib import Path

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))
from fidelity import FULL, METRICS, final_metrics  # noqa: E402


def main() -> None:
    from common import shapes_data  # imports yoloaccum.ultra first: ultralytics offline before it is imported

    data = shapes_data(tempfile.mkdtemp(), smoke=False, counts={"num_train": FULL["images"],
                       "num_val": FULL["val_images"], "imgsz": FULL["imgsz"], "seed": 0})  # fmt: skip
    store = HERE / "precise_upstream.json"
    rows = json.loads(store.read_text()) if store.exists() else {}
    for weights in map(Path, sys.argv[1:]):
        run = weights.parent.parent
        key = f"{run.parent.name} seed {run.name.removeprefix('run')}"
        rows[key] = final_metrics(weights, data, FULL["imgsz"], FULL["images"], layerwise=True)
        print(key, rows[key], flush=True)
        store.write_text(json.dumps(rows, indent=1))
    print("| run | mAP50-95 as trained | precise (batch upstream) | layerwise (running upstream) | seconds |")
    print("| --- | --- | --- | --- | --- |")
    for key, r in sorted(rows.items()):
        m = [r[v][METRICS[1]] for v in ("raw", "precise", "layerwise")]
        t = r["recompute_seconds"]
        print(f"| {key} | {m[0]:.3f} | {m[1]:.3f} | {m[2]:.3f} | {t['precise']:.1f} / {t['layerwise']:.1f} |")
    diffs = [r["layerwise"][METRICS[1]] - r["precise"][METRICS[1]] for r in rows.values()]
    if len(diffs) > 1:
        print(
            f"layerwise - precise, mAP50-95: mean {statistics.fmean(diffs):+.4f}, sd {statistics.stdev(diffs):.4f}, "
            f"{sum(d > 0 for d in diffs)} of {len(diffs)} higher"
        )


if __name__ == "__main__":
    main()
