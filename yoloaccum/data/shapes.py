"""A deterministic synthetic detection set of filled shapes, written in the Ultralytics YOLO layout.

It lets the quick start and the tests train on real images without a download, and it is easy enough that a nano
model learns it on a CPU in minutes. The same seed gives byte-identical files; a marker written last proves completion.
"""

from __future__ import annotations

import json
import logging
import os
import re
from pathlib import Path
from typing import Any

import cv2
import numpy as np
import yaml

from yoloaccum.errors import UserError

LOGGER = logging.getLogger(__name__)

CLASSES: tuple[str, ...] = ("circle", "square", "triangle", "cross")
SPLITS: tuple[str, ...] = ("train", "val")
MARKER = ".complete"
# Bump when the drawing changes, so `ensure` regenerates sets written by an older version.
GENERATOR_VERSION = 1
YAML_KEY = "yoloaccum_generate"
DEFAULTS: dict[str, int] = {"num_train": 512, "num_val": 100, "imgsz": 160, "seed": 0}

# Probabilities of 0..4 objects in an image; the 5% of empty images teach the model background.
_COUNT_PROBS = (0.05, 0.20, 0.25, 0.25, 0.25)
_MIN_SIZE, _MAX_SIZE, _REF_IMGSZ = 12.0, 60.0, 160  # shape extent in px at the reference image size
_MAX_COVERED = 0.5  # most of a shape that later shapes may hide, so every labelled shape stays mostly visible
_MIN_CONTRAST = 100.0  # RGB distance from the 5th-percentile background pixel under the shape
_NUM_COLOUR_TRIES, _NUM_PLACE_TRIES = 24, 20
_FILE_RE = re.compile(r"^\d{6}\.(png|txt)$")
_SHIFT = 4  # cv2 fixed-point bits: sub-pixel vertices, so small shapes keep their form


def image_rng(seed: int, split: str, index: int) -> np.random.Generator:
    """The generator for one image, keyed by (seed, split, index) so one split never depends on the other's size."""
    return np.random.default_rng([seed, SPLITS.index(split), index])


def shape_mask(cls: int, cx: float, cy: float, size: float, angle: float, imgsz: int) -> np.ndarray:
    """Boolean imgsz x imgsz mask of one filled shape of extent `size` px, rotated by `angle` degrees."""
    mask = np.zeros((imgsz, imgsz), np.uint8)
    scale = 1 << _SHIFT
    if CLASSES[cls] == "circle":
        centre = (round(cx * scale), round(cy * scale))
        cv2.circle(mask, centre, round(size / 2 * scale), 1, thickness=-1, lineType=cv2.LINE_8, shift=_SHIFT)
        return mask.astype(bool)
    s = size / 2
    if CLASSES[cls] == "square":
        pts = np.array([[-s, -s], [s, -s], [s, s], [-s, s]])
    elif CLASSES[cls] == "triangle":
        # Equilateral with circumradius 0.6 * size, so its side is about `size`.
        a = np.deg2rad([90.0, 210.0, 330.0])
        pts = 1.2 * s * np.stack([np.cos(a), -np.sin(a)], axis=1)
    else:  # cross: a plus sign whose arms are a third of its span thick
        t = s / 3
        pts = np.array(
            [[-t, -s], [t, -s], [t, -t], [s, -t], [s, t], [t, t], [t, s], [-t, s], [-t, t], [-s, t], [-s, -t], [-t, -t]]
        )
    r = np.deg2rad(angle)
    rot = np.array([[np.cos(r), -np.sin(r)], [np.sin(r), np.cos(r)]])
    pts = pts @ rot.T + [cx, cy]
    cv2.fillPoly(mask, [np.round(pts * scale).astype(np.int32)], 1, lineType=cv2.LINE_8, shift=_SHIFT)
    return mask.astype(bool)


def mask_box(mask: np.ndarray) -> tuple[int, int, int, int]:
    """Tight pixel-edge box (x0, y0, x1, y1) of a non-empty mask; x1 and y1 are exclusive."""
    xs, ys = np.flatnonzero(mask.any(axis=0)), np.flatnonzero(mask.any(axis=1))
    return int(xs[0]), int(ys[0]), int(xs[-1]) + 1, int(ys[-1]) + 1


def _background(rng: np.random.Generator, imgsz: int) -> np.ndarray:
    """A float32 background: a solid colour, a linear gradient, or a smooth blotchy texture."""
    kind = rng.choice(3, p=(0.35, 0.35, 0.30))
    if kind == 0:
        return np.broadcast_to(rng.uniform(0, 255, 3), (imgsz, imgsz, 3)).astype(np.float32)
    if kind == 1:
        c0, c1, theta = rng.uniform(0, 255, 3), rng.uniform(0, 255, 3), rng.uniform(0, 2 * np.pi)
        yy, xx = np.mgrid[0:imgsz, 0:imgsz]
        t = xx * np.cos(theta) + yy * np.sin(theta)
        t = (t - t.min()) / (t.max() - t.min())
        return (c0 + (c1 - c0) * t[..., None]).astype(np.float32)
    grid = int(rng.integers(3, 9))
    low = rng.uniform(0, 255, 3) + rng.normal(0, 35, (grid, grid, 3))
    bg = cv2.resize(low.astype(np.float32), (imgsz, imgsz), interpolation=cv2.INTER_CUBIC)
    return np.clip(bg, 0, 255)


def _pick_colour(rng: np.random.Generator, canvas: np.ndarray, mask: np.ndarray) -> np.ndarray:
    """A colour that stands out from what lies under the mask; the most distinct try if none is distinct enough."""
    under = canvas[mask]
    under = under[:: max(1, len(under) // 256)]  # a strided sample judges contrast as well and keeps this cheap
    colours = rng.integers(0, 256, (_NUM_COLOUR_TRIES, 3)).astype(np.float32)
    dist = np.linalg.norm(under[:, None, :] - colours[None, :, :], axis=2)  # (pixels, tries)
    score = np.quantile(dist, 0.05, axis=0)  # a low quantile, so gradients are judged at their closest part
    ok = np.flatnonzero(score >= _MIN_CONTRAST)
    return colours[ok[0] if ok.size else int(score.argmax())]


def _place(
    rng: np.random.Generator, cls: int, imgsz: int, masks: list[np.ndarray], covered: list[np.ndarray]
) -> np.ndarray | None:
    """Mask of a new shape that hides at most _MAX_COVERED of each earlier one, or None if no try fits."""
    scale = imgsz / _REF_IMGSZ
    size = rng.uniform(_MIN_SIZE, _MAX_SIZE) * scale
    angle = rng.uniform(0, 360) if CLASSES[cls] == "triangle" else rng.uniform(-30, 30)
    margin = 0.35 * size  # up to ~30% of the shape may fall off the edge; its box is clipped to the image
    for _ in range(_NUM_PLACE_TRIES):
        cx, cy = rng.uniform(margin, imgsz - margin, 2)
        mask = shape_mask(cls, cx, cy, size, angle, imgsz)
        if mask.sum() < 0.25 * (_MIN_SIZE * scale) ** 2:  # mostly off the image: too little left to learn from
            continue
        if all((m & (c | mask)).sum() <= _MAX_COVERED * m.sum() for m, c in zip(masks, covered, strict=True)):
            return mask
    return None


def render(seed: int, split: str, index: int, imgsz: int = 160) -> tuple[np.ndarray, np.ndarray]:
    """One image (BGR uint8) and its labels, an (n, 5) array of `cls cx cy w h` normalised to [0, 1]."""
    rng = image_rng(seed, split, index)
    canvas = _background(rng, imgsz)
    num_objects = int(rng.choice(len(_COUNT_PROBS), p=_COUNT_PROBS))
    classes, masks, covered = [], [], []
    for cls in rng.integers(len(CLASSES), size=num_objects):
        mask = _place(rng, int(cls), imgsz, masks, covered)
        if mask is None:
            continue
        canvas[mask] = _pick_colour(rng, canvas, mask)
        for c in covered:
            c |= mask
        classes.append(int(cls))
        masks.append(mask)
        covered.append(np.zeros_like(mask))
    if rng.random() < 0.35:  # mild sensor-like noise on some images, over shapes too, so flat fill is no cue
        canvas += rng.normal(0, rng.uniform(2, 6), canvas.shape).astype(np.float32)
    labels = np.zeros((len(masks), 5))
    for i, (cls, mask) in enumerate(zip(classes, masks, strict=True)):
        # The box is the whole shape as drawn, hidden parts included (at most _MAX_COVERED of it is hidden).
        x0, y0, x1, y1 = mask_box(mask)
        labels[i] = cls, (x0 + x1) / 2 / imgsz, (y0 + y1) / 2 / imgsz, (x1 - x0) / imgsz, (y1 - y0) / imgsz
    return np.clip(np.rint(canvas), 0, 255).astype(np.uint8), labels


def _params(num_train: int, num_val: int, imgsz: int, seed: int) -> dict[str, Any]:
    """The marker's content; also where arguments a user typed are checked."""
    for name, value, low in (
        ("num_train", num_train, 1),
        ("num_val", num_val, 1),
        ("imgsz", imgsz, 64),
        ("seed", seed, 0),
    ):
        if isinstance(value, bool) or not isinstance(value, int) or value < low:
            raise UserError(f"shapes: {name} must be an integer >= {low}, got {value!r}")
    return {
        "version": GENERATOR_VERSION,
        "classes": list(CLASSES),
        "num_train": num_train,
        "num_val": num_val,
        "imgsz": imgsz,
        "seed": seed,
    }


def _read_marker(root: Path) -> dict[str, Any] | None:
    try:
        return json.loads((root / MARKER).read_text())
    except (OSError, ValueError):
        return None


def _is_complete(root: Path, params: dict[str, Any]) -> bool:
    """The marker matches and no image was deleted since; a cheap listing, no image is read."""
    if _read_marker(root) != params:
        return False
    nums = (params["num_train"], params["num_val"])
    return all(len(list((root / "images" / s).glob("*.png"))) == n for s, n in zip(SPLITS, nums, strict=True))


def _clear_split(root: Path, split: str) -> None:
    """Remove a split's earlier files, refusing to touch anything this module could not have written."""
    dirs = [root / "images" / split, root / "labels" / split]
    files = [f for d in dirs if d.is_dir() for f in d.iterdir()]
    foreign = [f for f in files if not (f.is_file() and _FILE_RE.match(f.name))]
    if foreign:
        raise UserError(
            f"shapes: {foreign[0]} was not written by the shapes generator; "
            f"choose an empty or new folder instead of {root}"
        )
    for f in files:
        f.unlink()
    # Ultralytics caches labels beside the split folder; a stale cache would describe the old files.
    for cache in (root / "labels" / f"{split}.cache", root / "labels" / f"{split}.cache.npy"):
        cache.unlink(missing_ok=True)


def _write_split(root: Path, split: str, num: int, imgsz: int, seed: int) -> None:
    img_dir, lbl_dir = root / "images" / split, root / "labels" / split
    img_dir.mkdir(parents=True, exist_ok=True)
    lbl_dir.mkdir(parents=True, exist_ok=True)
    for index in range(num):
        image, labels = render(seed, split, index, imgsz)
        if not cv2.imwrite(str(img_dir / f"{index:06d}.png"), image):
            raise UserError(f"shapes: could not write {img_dir / f'{index:06d}.png'}; check the folder is writable")
        lines = "".join(f"{int(c)} {x:.6f} {y:.6f} {w:.6f} {h:.6f}\n" for c, x, y, w, h in labels)
        (lbl_dir / f"{index:06d}.txt").write_text(lines)  # empty file = a background image for Ultralytics


def generate(root: Path, num_train: int = 512, num_val: int = 100, imgsz: int = 160, seed: int = 0) -> Path:
    """Write the set under `root` (images/{train,val}, labels/{train,val}) and, last, the completion marker."""
    root = Path(root)
    params = _params(num_train, num_val, imgsz, seed)
    # Drop the marker first: from here until it is rewritten, an interrupted run reads as incomplete.
    (root / MARKER).unlink(missing_ok=True)
    for split in SPLITS:
        _clear_split(root, split)
    LOGGER.info(
        "generating %d train + %d val shapes images (%d px, seed %d) in %s", num_train, num_val, imgsz, seed, root
    )
    for split, num in zip(SPLITS, (num_train, num_val), strict=True):
        _write_split(root, split, num, imgsz, seed)
    tmp = root / (MARKER + ".tmp")
    tmp.write_text(json.dumps(params, indent=1) + "\n")
    os.replace(tmp, root / MARKER)  # atomic, so a marker on disk is always whole
    return root


def ensure(root: Path, num_train: int = 512, num_val: int = 100, imgsz: int = 160, seed: int = 0) -> Path:
    """Generate the set unless `root` already holds a complete one made with these exact parameters."""
    root = Path(root)
    params = _params(num_train, num_val, imgsz, seed)
    if _is_complete(root, params):
        return root
    return generate(root, num_train, num_val, imgsz, seed)


def ensure_from_yaml(data_yaml: Path) -> Path | None:
    """Ensure the set a dataset YAML describes if it has a `yoloaccum_generate` key; return its root, else None.

    The YAML's `path` is taken relative to the YAML's folder. Ultralytics itself resolves a relative `path` against
    the working directory, then its datasets dir, so callers should pass it the absolute root returned here.
    """
    data_yaml = Path(data_yaml)
    try:
        data = yaml.safe_load(data_yaml.read_text()) or {}
    except (OSError, yaml.YAMLError) as e:
        raise UserError(f"shapes: cannot read dataset YAML {data_yaml}: {e}") from e
    spec = data.get(YAML_KEY) if isinstance(data, dict) else None
    if spec is None:
        return None
    if not isinstance(spec, dict) or set(spec) - set(DEFAULTS):
        raise UserError(f"{data_yaml}: '{YAML_KEY}' must be a mapping with keys from {sorted(DEFAULTS)}, got {spec!r}")
    root = data_yaml.parent / str(data.get("path") or ".")
    return ensure(root, **{**DEFAULTS, **spec})
