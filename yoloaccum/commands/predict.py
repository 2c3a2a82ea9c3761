"""`yoloaccum predict`: detect objects in an image or a folder with Ultralytics' predictor, on safely loaded weights.

Writes each image with its boxes drawn, and predictions.json, under project/name (runs/predict/exp, exp2, ...).
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import cv2

import yoloaccum.config.ultra  # noqa: F401  (Ultralytics offline and quiet before run() imports it)
from yoloaccum.config.settings import Config
from yoloaccum.data.datasets import IMG_SUFFIXES
from yoloaccum.distributed.ddp import select_device
from yoloaccum.errors import UserError
from yoloaccum.model import checkpoint
from yoloaccum.training.runs import next_free


def images_in(source: str) -> list[Path]:
    """The image itself, or the images directly in a folder, sorted; in a folder, files whose content OpenCV cannot
    read are left out, with a line that names them. Ultralytics would stop at the first, half-way through."""
    path = Path(source)
    if path.is_file():
        if not cv2.haveImageReader(str(path)):  # reads the file's first bytes only, whatever its name says
            raise UserError(f"source={source} is not an image OpenCV can read; give an image file or a folder of them")
        return [path]
    if not path.is_dir():
        raise UserError(f"source={source} does not exist; give an image or a folder of images")
    found = sorted(p for p in path.iterdir() if p.suffix[1:].lower() in IMG_SUFFIXES)
    if not found:
        raise UserError(f"no images in {source}; predict reads {', '.join(sorted(IMG_SUFFIXES))} files")
    readable = [p for p in found if cv2.haveImageReader(str(p))]
    if not readable:
        raise UserError(f"none of the {len(found)} image files in {source} is an image OpenCV can read")
    if skipped := [p.name for p in found if p not in readable]:
        names = ", ".join(skipped[:3]) + (f" and {len(skipped) - 3} more" if len(skipped) > 3 else "")
        print(f"{source}: {len(skipped)} of {len(found)} files left out, not images OpenCV can read: {names}")
    return readable


def run(cfg: Config) -> list[dict[str, Any]]:
    """api.predict's work: predict with model=best.pt on source=<image|folder>; returns what predictions.json
    holds."""
    from ultralytics.models.yolo.detect import DetectionPredictor

    if not str(cfg.model).endswith(".pt"):
        raise UserError("predict needs trained weights: give model=path/to/best.pt")
    if cfg.source is None:
        raise UserError("predict needs source=<image or folder>")
    files = images_in(cfg.source)
    model = checkpoint.model_of(checkpoint.load(cfg.model, cfg.trust_weights))
    device = select_device(cfg.device)
    out_dir = next_free(Path(cfg.project or "runs/predict") / (cfg.name or "exp"), cfg.exist_ok)
    out_dir.mkdir(parents=True, exist_ok=True)
    imgsz = model.args.get("imgsz", cfg.imgsz) if isinstance(model.args, dict) else cfg.imgsz
    overrides = {
        "conf": cfg.conf or 0.25,
        "iou": cfg.iou,
        "max_det": cfg.max_det,
        "imgsz": imgsz,
        "save": False,
        "verbose": False,
        "device": "cpu" if device.type == "cpu" else str(device.index),
    }
    predictor = DetectionPredictor(overrides=overrides)
    records = []
    for f, result in zip(files, predictor(source=[str(f) for f in files], model=model, stream=True)):
        cv2.imwrite(str(out_dir / f.name), result.plot())
        boxes = result.boxes
        records.append(
            {
                "image": str(f),
                "detections": [
                    {
                        "class": int(c),
                        "name": result.names[int(c)],
                        "confidence": round(float(p), 4),
                        "box_xyxy": [round(float(v), 1) for v in xyxy],
                    }
                    for c, p, xyxy in zip(boxes.cls, boxes.conf, boxes.xyxy)
                ],
            }
        )
    (out_dir / "predictions.json").write_text(json.dumps(records, indent=1))
    total = sum(len(r["detections"]) for r in records)
    print(f"{total} detections in {len(records)} images; drawn images and predictions.json in {out_dir}")
    return records
