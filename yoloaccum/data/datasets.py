"""Datasets: resolve Ultralytics dataset YAMLs, count the images training uses, and build loaders whose image order
is the seed's alone.

The images, labels and augmentations are Ultralytics' YOLODataset. What yoloaccum adds is the order: one permutation
per (seed, epoch), cut into global batches, so every device count and micro-batch size sees the same images in
every accumulation window.
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from functools import cache
from pathlib import Path

import torch
from torch.utils.data import Dataset

from yoloaccum.config.settings import Config, load_yaml, yamls_in
from yoloaccum.errors import UserError

_PACKAGE = Path(__file__).resolve().parents[1]  # yoloaccum/
DATASETS_DIRS = (_PACKAGE / "datasets", _PACKAGE.parent / "datasets")  # wheel copy, then the source checkout
IMG_SUFFIXES = {"bmp", "dng", "jpeg", "jpg", "mpo", "png", "tif", "tiff", "webp", "pfm", "heic"}


@dataclass(frozen=True)
class DatasetSpec:
    """A dataset YAML with every path resolved: `train` and `val` are lists of folders, list files or images."""

    yaml_file: Path
    root: Path
    train: tuple[Path, ...]
    val: tuple[Path, ...]
    names: dict[int, str]

    @property
    def nc(self) -> int:
        return len(self.names)


def find_yaml(name: str | Path) -> Path:
    """A dataset YAML as given, or by bare name from yoloaccum's datasets/ folder (data=coco.yaml)."""
    path = Path(name)
    if path.is_file():
        return path.resolve()
    if path.is_dir():
        raise UserError(
            f"data={name} is a folder{yamls_in(path)}; give the dataset's YAML file (path, train, val, names)"
        )
    for folder in DATASETS_DIRS:
        if not path.is_absolute() and (folder / path.name).is_file() and path.parent == Path("."):
            return (folder / path.name).resolve()
    raise UserError(f"dataset YAML {name} does not exist; give the path to an Ultralytics dataset YAML as data=")


def load_spec(name: str | Path, split: str = "val") -> DatasetSpec:
    """Read and check a dataset YAML. A relative `path` is resolved against the YAML's folder first, then the
    current folder; a missing `path` means the YAML's folder. train/val entries are relative to that root."""
    yaml_file = find_yaml(name)
    raw = load_yaml(yaml_file)
    if not isinstance(raw, dict):
        raise UserError(f"{yaml_file} must be a mapping with path, train, val and names")
    for key in ("train", split, "names"):
        if not raw.get(key):
            raise UserError(f"{yaml_file} has no '{key}' entry; an Ultralytics dataset YAML needs train, val and names")
    root = _root(yaml_file, raw.get("path"))
    if generate := raw.get("yoloaccum_generate"):  # the synthetic shapes set makes itself on first use
        from yoloaccum.data import shapes

        shapes.ensure(root, **generate)
    names = raw["names"]
    if isinstance(names, list):
        names = dict(enumerate(names))
    if not isinstance(names, dict) or sorted(names) != list(range(len(names))):
        raise UserError(f"{yaml_file}: names must be a list or a mapping 0: name, 1: name, ... without gaps")
    if "nc" in raw and raw["nc"] != len(names):  # Ultralytics refuses it too: which one is meant is not known
        raise UserError(
            f"{yaml_file}: nc: {raw['nc']} but names lists {len(names)} classes; make them agree, or drop nc"
        )
    return DatasetSpec(
        yaml_file,
        root,
        _entries(yaml_file, root, raw["train"]),
        _entries(yaml_file, root, raw[split]),
        {int(k): str(v) for k, v in names.items()},
    )


def check_classes(classes: int | list[int] | None, spec: DatasetSpec) -> None:
    """classes= lists ids of the dataset's classes."""
    wrong = [c for c in ([classes] if isinstance(classes, int) else classes or []) if not 0 <= c < spec.nc]
    if wrong:
        raise UserError(f"classes={classes}: {spec.yaml_file.name} has class ids 0 to {spec.nc - 1}, not {wrong[0]}")


def _root(yaml_file: Path, path: str | None) -> Path:
    if not path:
        return yaml_file.parent
    p = Path(path).expanduser()
    if p.is_absolute():
        return p
    beside = yaml_file.parent / p
    return beside if beside.exists() or not (Path.cwd() / p).exists() else Path.cwd() / p


def _entries(yaml_file: Path, root: Path, value: str | list[str]) -> tuple[Path, ...]:
    paths = tuple(root / v for v in (value if isinstance(value, list) else [value]))
    for p in paths:
        if not p.exists():
            hint = " (its README or header says how to get the images)" if "coco" in yaml_file.name else ""
            raise UserError(f"{yaml_file}: {p} does not exist; download the dataset or fix 'path'{hint}")
    return paths


def num_training_images(cfg: Config, spec: DatasetSpec) -> int:
    """The images training will use: Ultralytics' `fraction` of the files, less those its label check skips. Runs the
    label check (or reads its cache, as training does) but decodes no image for the cache."""
    from yoloaccum.config import ultra  # noqa: F401  (Ultralytics quiet before its first import: plan --json is pure JSON)

    return len(build_dataset(cfg.replace(cache=False), spec, "train"))


def build_dataset(cfg: Config, spec: DatasetSpec, split: str, stride: int = 32, augment: bool = True) -> Dataset:
    """Ultralytics' YOLODataset with its augmentations, as Ultralytics' build_yolo_dataset makes it for training
    (augment=False: letterboxed only, as inference sees images); it also keeps what the label scan found."""
    from ultralytics.utils import colorstr

    from yoloaccum.config.ultra import ultralytics_args

    args = ultralytics_args(cfg)
    paths = [str(p) for p in (spec.train if split == "train" else spec.val)]
    scanned_dataset = _scanned_dataset_class()
    try:
        dataset = scanned_dataset(
            img_path=paths if len(paths) > 1 else paths[0],
            imgsz=cfg.imgsz,
            batch_size=cfg.batch,
            augment=augment,
            hyp=args,
            rect=False,
            cache=(cfg.cache or None) if augment else None,
            single_cls=cfg.single_cls,
            stride=stride,
            pad=0.0,
            prefix=colorstr(f"{split}: "),
            task="detect",
            classes=cfg.classes,
            fraction=cfg.fraction,
            data={"names": spec.names, "nc": spec.nc, "channels": 3},
        )
    except FileNotFoundError as e:
        raise UserError(f"{spec.yaml_file}: no images found for {split} in {', '.join(paths)}") from e
    except ValueError as e:  # Ultralytics' "No labels found": a training split with no label file at all
        if "No labels found" not in str(e):
            raise
        raise UserError(no_label_files(spec.yaml_file, split, paths)) from e
    except RuntimeError as e:
        if "No valid images" not in str(e):
            raise
        reasons = summary(split, None, scan=scanned_dataset.last_scan).splitlines()[0]
        raise UserError(f"{spec.yaml_file}: no usable {split} images ({reasons})") from e
    check_labels(dataset, spec.yaml_file, split, paths, cfg.classes)
    return dataset


def check_labels(dataset, yaml_file: Path, split: str, paths: list[str], classes: list[int] | None) -> None:
    """A split as Ultralytics built it (training's, or validation's in evaluation/validate.py) has label files, and
    with classes= boxes of those classes: without, a validation's every metric is 0, which Ultralytics reports with
    a warning at most (or, from the label cache an earlier build wrote, not at all)."""
    if not any(Path(f).is_file() for f in dataset.label_files):
        raise UserError(no_label_files(yaml_file, split, paths))
    if classes is not None and not any(len(label["cls"]) for label in dataset.labels):
        raise UserError(
            f"classes={classes}: no {split} image has a box of these classes; give ids of classes "
            f"{yaml_file.name} has boxes of, or drop classes"
        )


def no_label_files(yaml_file: Path, split: str, paths: list[str]) -> str:
    return (
        f"{yaml_file}: no {split} image in {', '.join(paths)} has a label file; Ultralytics reads the boxes of "
        ".../images/x.jpg from .../labels/x.txt (a line 'class x y w h' per box): add the labels folder"
    )


@cache
def _scanned_dataset_class() -> type:
    """Defined on first use, so that `yoloaccum plan` does not import ultralytics."""
    from ultralytics.data.dataset import YOLODataset

    class ScannedDataset(YOLODataset):
        """YOLODataset that keeps the label scan's counts and messages (Ultralytics only logs them)."""

        last_scan: dict | None = None

        def _load_or_scan_cache(self, cache_path, cache_hash):
            cache, exists = super()._load_or_scan_cache(cache_path, cache_hash)
            self.scan = ScannedDataset.last_scan = {"results": cache["results"], "msgs": list(cache["msgs"])}
            return cache, exists

    return ScannedDataset


_ANSI = re.compile(r"\x1b\[[0-9;]*m")

# What Ultralytics' label check says, and the reason yoloaccum counts it under. The first match wins.
_REASONS = (
    ("duplicate labels removed", "duplicate boxes removed (image kept)"),
    ("corrupt JPEG restored", "corrupt JPEG restored (image kept)"),
    ("<10 pixels", "image smaller than 10 px"),
    ("columns", "wrong column count"),
    ("inhomogeneous shape", "wrong column count"),  # rows of different lengths
    ("cannot reshape", "wrong column count"),  # a polygon with an odd number of coordinates
    ("mix segment and detection", "boxes and polygons mixed"),
    ("codec can't decode", "label file not UTF-8 text"),
    ("could not convert", "non-numeric label"),
    ("out of bounds coordinates", "coordinates outside [0, 1]"),
    ("negative label values", "coordinates outside [0, 1]"),
    ("non-integer class", "class id not an integer"),
    ("exceeds dataset class count", "class id >= nc"),
    ("", "unreadable image"),  # the image checks' messages vary (PIL's, or a missing HEIF plugin)
)


def set_batch(dataset: Dataset, batch: int, window: int) -> None:
    """Set what Ultralytics sizes from the batch, once the run's batch is known (batch=-1 chooses it after the dataset
    is built): `batch` is the micro-batch, `window` the images its mosaic buffer is sized by, 8 times over.

    Mosaic draws each image's three partners from the buffer of recently loaded images, which Ultralytics sizes as
    8 batches (at most 1000). Sized by the micro-batch, a run at micro-batch 2 draws them from its last 16 images
    where a real batch of 64 draws them from 512: a window of 64 mosaics then shows about 80 distinct images instead
    of up to 256. mosaic_buffer=window sizes it by the window's images instead, as the recipe's real batch would.
    """
    dataset.batch_size = batch
    dataset.max_buffer_length = min((dataset.ni, window * 8, 1000)) if dataset.augment else 0


def summary(split: str, dataset: Dataset | None, scan: dict | None = None) -> str:
    """ "train: N images, M skipped: 2 unreadable image, 1 class id >= nc; ..." with a line per skipped file."""
    from collections import Counter

    scan = scan or getattr(dataset, "scan", None) or {"results": (0, 0, 0, 0, 0), "msgs": []}
    found, missing, empty, corrupt, total = scan["results"]
    reasons, lines = Counter(), []
    for msg in scan["msgs"]:
        msg = _ANSI.sub("", msg)  # Ultralytics prefixes a coloured "train: "
        reason = next(r for key, r in _REASONS if key in msg)
        reasons[reason] += 1
        if "kept" not in reason:
            lines.append(f"  skipped {msg.split(': ', 1)[-1].split(': ignoring', 1)[0]}: {reason}")
    skipped = sum(n for r, n in reasons.items() if "kept" not in r)
    counted = ", ".join(f"{n} {r}" for r, n in reasons.most_common())
    head = f"{split}: {total} images, {skipped} skipped" + (f": {counted}" if counted else "")
    head += f"; {missing + empty} without objects (backgrounds)" if missing + empty else ""
    return "\n".join([head, *lines[:10], *(["  ..."] if len(lines) > 10 else [])])


def precise_bn_images(cfg: Config, spec: DatasetSpec, num_images: int, rank: int, world: int) -> torch.Tensor:
    """This rank's share of the N = num_images training images that BatchNorm statistics are recomputed on (the
    trainer's N: schedule.precise_bn_count), as one uint8 tensor (its share of N) x 3 x imgsz x imgsz: the first N of
    the seed's permutation of the training set.

    With cfg.precise_bn_aug each is drawn as the recipe's training augmentation draws it, mosaic included whatever
    close_mosaic does later (measured best: docs/accuracy.md); without, letterboxed only, as inference sees it.
    Every rank draws all N in one sequence seeded by cfg.seed and keeps every world-th, so the images, and the
    statistics, do not depend on how many ranks share them. Training's random states are left as they were."""
    import random

    import numpy as np

    from yoloaccum.process.rng import rng_kept

    with rng_kept():
        dataset = build_dataset(cfg.replace(cache=False), spec, "train", augment=cfg.precise_bn_aug)
        random.seed(cfg.seed)  # Ultralytics' transforms draw from all three generators
        np.random.seed(cfg.seed)
        torch.manual_seed(cfg.seed)
        order = torch.randperm(len(dataset), generator=torch.Generator().manual_seed(cfg.seed))[:num_images]
        images = [dataset[i]["img"] for i in order.tolist()]
    mine = images[rank::world]
    return torch.stack(mine) if mine else torch.zeros(0, 3, cfg.imgsz, cfg.imgsz, dtype=torch.uint8)
