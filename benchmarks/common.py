"""Shared pieces of the benchmarks: the data, engines on batches held in memory, and the two trainers' epochs."""

from __future__ import annotations

import tempfile
import time
from pathlib import Path

import torch
import yaml

import yoloaccum.ultra  # noqa: F401  (ultralytics offline before it is imported)
from yoloaccum import config, distributed, optim, schedule
from yoloaccum.engine import Engine
from yoloaccum.loss import WindowLoss
from yoloaccum.ultra import ultralytics_args

REPO = Path(__file__).resolve().parents[1]
SHAPES_YAML = "datasets/shapes.yaml"
CPU = distributed.Context(0, 0, 1, torch.device("cpu"))


def shapes_data(folder: str | None, smoke: bool) -> Path:
    """The shapes set as an absolute-path YAML (Ultralytics resolves relative paths elsewhere); small for --smoke."""
    from yoloaccum import shapes

    root = Path(folder) / "shapes" if folder else REPO / "datasets/shapes"
    recipe = yaml.safe_load((REPO / SHAPES_YAML).read_text())["yoloaccum_generate"]
    counts = {"num_train": 48, "num_val": 8, "imgsz": 64, "seed": 0} if smoke else recipe
    shapes.ensure(root, **counts)
    spec = {"path": str(root), "train": "images/train", "val": "images/val", "names": dict(enumerate(shapes.CLASSES))}
    path = Path(tempfile.mkdtemp()) / "shapes.yaml"
    path.write_text(yaml.safe_dump(spec))
    return path


def make_batches(n: int, micro: int, imgsz: int, seed: int = 0) -> list[dict]:
    """n synthetic micro-batches, 1 to 4 objects an image, already in memory."""
    g = torch.Generator().manual_seed(seed)
    out = []
    for _ in range(n):
        per_image = torch.randint(1, 5, (micro,), generator=g)
        k = int(per_image.sum())
        xy, wh = torch.rand(k, 2, generator=g) * 0.6 + 0.2, torch.rand(k, 2, generator=g) * 0.2 + 0.1
        out.append(
            {"img": torch.rand(micro, 3, imgsz, imgsz, generator=g),
             "batch_idx": torch.repeat_interleave(torch.arange(micro), per_image).float(),
             "cls": torch.randint(0, 4, (k, 1), generator=g).float(), "bboxes": torch.cat([xy, wh], 1)}
        )  # fmt: skip
    return out


def engine_for(model: str, imgsz: int, batch: int, nbs: int, num_batches: int) -> Engine:
    """yoloaccum's engine around a fresh model, with a schedule of exactly num_batches micro-batches, no warmup."""
    from ultralytics.nn.tasks import DetectionModel

    cfg = config.resolve(overrides=dict(batch=batch, nbs=nbs, epochs=1, warmup_epochs=0, imgsz=imgsz, optimizer="SGD"))
    s = schedule.build(cfg, num_images=batch * num_batches, nc=4)
    torch.manual_seed(0)
    raw = DetectionModel(model, nc=4, verbose=False)
    raw.args = ultralytics_args(cfg)
    raw.train()
    return Engine(raw, raw, WindowLoss(raw, "window"), optim.build_optimizer(raw, s), s, CPU, clip_grad=10.0,
                  scaler=torch.amp.GradScaler("cuda", enabled=False))  # fmt: skip


def train_from_memory(model: str, imgsz: int, batch: int, nbs: int, steps: int) -> None:
    """The memory probe: `steps` micro-batches (whole windows) through the engine."""
    accumulate = max(round(nbs / batch), 1)
    n = max(steps // accumulate, 1) * accumulate
    engine_for(model, imgsz, batch, nbs, n).train_epoch(0, make_batches(n, batch, imgsz))


def yoloaccum_images_per_second(model: str, data: str, imgsz: int, epochs: int, fraction: float) -> float:
    """yoloaccum's trainer: images/s of its last epoch, as it logs them in results.csv."""
    import csv

    from yoloaccum import trainer

    project = tempfile.mkdtemp()
    trainer.run([f"model={model}", f"data={data}", f"imgsz={imgsz}", "batch=8", "nbs=64", f"epochs={epochs}",
                 "workers=2", "close_mosaic=0", "val=False", "plots=False", "verbose=False", f"fraction={fraction}",
                 f"project={project}", "name=bench"])  # fmt: skip
    with open(Path(project) / "bench/results.csv") as f:
        return float(list(csv.DictReader(f))[-1]["images_per_second"])


def ultralytics_images_per_second(model: str, data: str, imgsz: int, epochs: int, fraction: float) -> float:
    """Ultralytics' own trainer (YOLO.train) on the same settings: images/s of its last epoch's batch loop."""
    from ultralytics import YOLO

    marks = {}
    yolo = YOLO(model)
    yolo.add_callback("on_train_epoch_start", lambda t: marks.__setitem__("start", time.perf_counter()))
    yolo.add_callback("on_train_epoch_end", lambda t: marks.__setitem__("end", time.perf_counter()))
    yolo.add_callback("on_train_epoch_end", lambda t: marks.__setitem__("images", len(t.train_loader.dataset)))
    yolo.train(data=data, imgsz=imgsz, batch=8, nbs=64, epochs=epochs, workers=2, close_mosaic=0, val=False,
               plots=False, amp=False, device="cpu", fraction=fraction, project=tempfile.mkdtemp(), name="bench",
               pretrained=False, verbose=False)  # fmt: skip
    return marks["images"] / (marks["end"] - marks["start"])
