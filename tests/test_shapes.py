"""Tests for the synthetic shapes set: determinism, label format, tight boxes, `ensure`, and Ultralytics loading."""

import json
import os
from pathlib import Path

import numpy as np
import pytest
import yaml

from yoloaccum.data import shapes
from yoloaccum.errors import UserError

# Before ultralytics is imported (only inside a test below): no downloads, no pip installs from a test.
os.environ.setdefault("YOLO_OFFLINE", "1")
os.environ.setdefault("YOLO_AUTOINSTALL", "false")

REPO = Path(__file__).resolve().parents[1]
SMALL = {"num_train": 20, "num_val": 5, "imgsz": 160, "seed": 0}


def _files(root: Path) -> dict[str, bytes]:
    return {str(p.relative_to(root)): p.read_bytes() for p in sorted(root.rglob("*")) if p.is_file()}


@pytest.fixture(scope="module")
def small_set(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return shapes.generate(tmp_path_factory.mktemp("shapes"), **SMALL)


def test_layout_and_marker(small_set: Path) -> None:
    for split, num in (("train", 20), ("val", 5)):
        assert len(list((small_set / "images" / split).glob("*.png"))) == num
        assert len(list((small_set / "labels" / split).glob("*.txt"))) == num
    marker = json.loads((small_set / shapes.MARKER).read_text())
    assert {k: marker[k] for k in SMALL} == SMALL


def test_same_seed_is_byte_identical(small_set: Path, tmp_path: Path) -> None:
    assert _files(shapes.generate(tmp_path / "again", **SMALL)) == _files(small_set)


def test_other_seed_differs(small_set: Path, tmp_path: Path) -> None:
    other = _files(shapes.generate(tmp_path / "other", **{**SMALL, "seed": 1}))
    ours = _files(small_set)
    assert other.keys() == ours.keys()
    assert sum(other[k] != ours[k] for k in ours if k.endswith(".png")) == 25


def test_a_split_does_not_depend_on_the_other_splits_size(small_set: Path, tmp_path: Path) -> None:
    bigger_val = shapes.generate(tmp_path / "v", **{**SMALL, "num_val": 7})
    train = (small_set / "images" / "train" / "000003.png").read_bytes()
    assert (bigger_val / "images" / "train" / "000003.png").read_bytes() == train


def test_label_format_and_ranges(small_set: Path) -> None:
    num_boxes = 0
    for txt in (small_set / "labels").rglob("*.txt"):
        for line in txt.read_text().splitlines():
            fields = line.split()
            assert len(fields) == 5
            assert all(len(f.split(".")[1]) == 6 for f in fields[1:]), line  # 6 decimals
            cls, cx, cy, w, h = int(fields[0]), *map(float, fields[1:])
            assert 0 <= cls < len(shapes.CLASSES)
            assert 0 < w <= 1 and 0 < h <= 1
            # the box, not only its centre, lies inside the image (allow the 6-decimal rounding)
            assert -1e-6 <= cx - w / 2 <= cx + w / 2 <= 1 + 1e-6
            assert -1e-6 <= cy - h / 2 <= cy + h / 2 <= 1 + 1e-6
            num_boxes += 1
    assert num_boxes > 20


@pytest.mark.parametrize("cls", range(len(shapes.CLASSES)))
def test_box_is_tight_for_each_class(cls: int) -> None:
    mask = shapes.shape_mask(cls, 80.3, 70.6, 40.0, 17.0, 160)
    x0, y0, x1, y1 = shapes.mask_box(mask)
    assert mask[:, x0].any() and mask[:, x1 - 1].any() and mask[y0].any() and mask[y1 - 1].any()
    assert not mask[:, :x0].any() and not mask[:, x1:].any() and not mask[:y0].any() and not mask[y1:].any()
    assert 20 < x1 - x0 < 70 and 20 < y1 - y0 < 70


def test_known_square_and_circle_boxes() -> None:
    square = shapes.mask_box(shapes.shape_mask(shapes.CLASSES.index("square"), 50.0, 60.0, 20.0, 0.0, 160))
    assert square == pytest.approx((40, 50, 60, 70), abs=1)
    circle = shapes.mask_box(shapes.shape_mask(shapes.CLASSES.index("circle"), 100.0, 30.0, 30.0, 0.0, 160))
    assert circle == pytest.approx((85, 15, 115, 45), abs=1)


def test_box_clipped_at_the_image_edge() -> None:
    mask = shapes.shape_mask(shapes.CLASSES.index("square"), 5.0, 155.0, 30.0, 0.0, 160)
    x0, y0, x1, y1 = shapes.mask_box(mask)
    assert (x0, y1) == (0, 160)  # clipped exactly at the image's left and bottom edges
    assert (y0, x1) == pytest.approx((140, 20), abs=1)  # cv2 fills edge pixels, hence the tolerance of one


def test_rendered_labels_match_what_is_drawn() -> None:
    # A shape is one flat colour (plus mild noise) that contrasts with its surround, so the pixels near its box that
    # share the colour at the box centre should span exactly the labelled box: this catches x/y swaps and off-by-ones.
    num_checked = 0
    for index in range(60):
        image, labels = shapes.render(0, "train", index)
        if len(labels) != 1:
            continue
        _, cx, cy, w, h = labels[0] * [1, 160, 160, 160, 160]
        x0, y0, x1, y1 = (round(v) for v in (cx - w / 2, cy - h / 2, cx + w / 2, cy + h / 2))
        wx0, wy0 = max(x0 - 3, 0), max(y0 - 3, 0)
        window = image[wy0 : y1 + 3, wx0 : x1 + 3].astype(float)
        centre = image[int(cy), int(cx)].astype(float)
        alike = np.linalg.norm(window - centre, axis=2) < 45
        bx0, by0, bx1, by1 = shapes.mask_box(alike)
        assert (bx0 + wx0, by0 + wy0, bx1 + wx0, by1 + wy0) == (x0, y0, x1, y1), f"image {index}"
        num_checked += 1
    assert num_checked >= 3


def test_some_images_are_backgrounds_at_default_size() -> None:
    counts = [len(shapes.render(0, "train", i)[1]) for i in range(512)]
    assert 0.02 * 512 <= counts.count(0) <= 0.10 * 512
    assert 1.5 < np.mean(counts) < 3.5
    assert max(counts) <= 4


def test_ensure_is_a_noop_when_complete(tmp_path: Path) -> None:
    root = shapes.ensure(tmp_path / "s", **SMALL)
    png = root / "images" / "train" / "000000.png"
    before = (png.stat().st_mtime_ns, (root / shapes.MARKER).stat().st_mtime_ns)
    assert shapes.ensure(root, **SMALL) == root
    assert (png.stat().st_mtime_ns, (root / shapes.MARKER).stat().st_mtime_ns) == before


def test_ensure_regenerates_without_marker_or_on_other_params(tmp_path: Path) -> None:
    root = shapes.ensure(tmp_path / "s", **SMALL)
    (root / shapes.MARKER).unlink()
    (root / "images" / "train" / "000000.png").write_bytes(b"half-written")
    shapes.ensure(root, **SMALL)
    assert (root / shapes.MARKER).exists()
    assert (root / "images" / "train" / "000000.png").read_bytes()[:4] == b"\x89PNG"
    # Fewer images: the old extra files must go, or Ultralytics would train on them.
    shapes.ensure(root, **{**SMALL, "num_train": 8})
    assert len(list((root / "images" / "train").glob("*.png"))) == 8
    assert len(list((root / "labels" / "train").glob("*.txt"))) == 8


def test_refuses_to_clear_files_it_did_not_write(tmp_path: Path) -> None:
    (tmp_path / "images" / "train").mkdir(parents=True)
    (tmp_path / "images" / "train" / "holiday.jpg").write_bytes(b"x")
    with pytest.raises(UserError, match="not written by the shapes generator"):
        shapes.generate(tmp_path, **SMALL)
    assert (tmp_path / "images" / "train" / "holiday.jpg").exists()


@pytest.mark.parametrize("bad", [{"num_train": 0}, {"num_val": -1}, {"imgsz": 16}, {"seed": -1}, {"seed": 1.5}])
def test_bad_arguments_raise_user_error(tmp_path: Path, bad: dict) -> None:
    with pytest.raises(UserError):
        shapes.ensure(tmp_path, **{**SMALL, **bad})


def test_repo_yaml_matches_classes_and_generator_defaults() -> None:
    data = yaml.safe_load((REPO / "datasets" / "shapes.yaml").read_text())
    assert [data["names"][i] for i in range(len(data["names"]))] == list(shapes.CLASSES)
    assert data[shapes.YAML_KEY] == shapes.DEFAULTS
    assert (data["path"], data["train"], data["val"]) == ("shapes", "images/train", "images/val")


def test_yaml_loads_with_ultralytics(small_set: Path, tmp_path: Path) -> None:
    from ultralytics.data.utils import check_det_dataset

    data = yaml.safe_load((REPO / "datasets" / "shapes.yaml").read_text())
    data["path"] = str(small_set)  # Ultralytics resolves a relative path against the cwd, so give it an absolute one
    copy = tmp_path / "shapes.yaml"
    copy.write_text(yaml.safe_dump(data))
    info = check_det_dataset(str(copy), autodownload=False)
    assert info["nc"] == len(shapes.CLASSES)
    assert list(info["names"].values()) == list(shapes.CLASSES)
    assert Path(info["train"]) == small_set / "images" / "train"
    assert Path(info["val"]) == small_set / "images" / "val"


def test_ensure_from_yaml_resolves_path_beside_the_yaml(tmp_path: Path) -> None:
    spec = {
        "path": "gen",
        "train": "images/train",
        "val": "images/val",
        "names": {0: "circle"},
        shapes.YAML_KEY: {"num_train": 3, "num_val": 2},
    }
    (tmp_path / "d.yaml").write_text(yaml.safe_dump(spec))
    assert shapes.ensure_from_yaml(tmp_path / "d.yaml") == tmp_path / "gen"
    assert len(list((tmp_path / "gen" / "images" / "val").glob("*.png"))) == 2
    (tmp_path / "plain.yaml").write_text(yaml.safe_dump({k: v for k, v in spec.items() if k != shapes.YAML_KEY}))
    assert shapes.ensure_from_yaml(tmp_path / "plain.yaml") is None
