"""Bad data: every broken or unusual file in a training split is either used correctly or skipped with a reason, the
run starts with a summary that counts the reasons, training proceeds on the rest, and an empty split is an error.

What Ultralytics 8.4.190 does with each file was found by running it; `make_bad_dataset` says so case by case.
"""

import re
import shutil
from pathlib import Path

import cv2
import numpy as np
import pytest
import torch
import yaml
from conftest import PLUMBING, TINY_MODEL

import yoloaccum.config.ultra  # noqa: F401  (ultralytics offline before it is imported)
from yoloaccum.config import settings as config
from yoloaccum.data import datasets as data
from yoloaccum.data import shapes

NAMES = {0: "circle", 1: "square", 2: "triangle", 3: "cross"}
BOX = "0 0.5 0.5 0.2 0.2\n"
NUM_GENERATED = 12  # good shapes images in images/train, before the bad ones are added

# The added files Ultralytics skips, and the reason the summary gives for each.
SKIPPED = {
    "corrupt.jpg": "unreadable image",
    "truncated.png": "unreadable image",
    "truncated.jpg": "unreadable image",
    "four_columns.png": "wrong column count",
    "non_numeric.png": "non-numeric label",
    "outside.png": "coordinates outside [0, 1]",
    "class_7.png": "class id >= nc",
    "tiny_8px.png": "image smaller than 10 px",
}
# The added files that are trained on.
USED = (
    "trailing_bytes.jpg",
    "duplicates.png",
    "no_label.png",
    "gray.png",
    "rgba.png",
    "uint16.png",
    "wide_300x40.png",
    "small_10px.png",
)
NUM_IMAGES = NUM_GENERATED + len(SKIPPED) + len(USED)
REASONS = {
    "unreadable image": 3,
    "wrong column count": 1,
    "non-numeric label": 1,
    "coordinates outside [0, 1]": 1,
    "class id >= nc": 1,
    "image smaller than 10 px": 1,
    "duplicate boxes removed (image kept)": 1,
    "corrupt JPEG restored (image kept)": 1,
}
TRAIN = (*PLUMBING, "imgsz=64", "batch=4", "nbs=8", "epochs=1", "workers=0")


def write_yaml(folder: Path, root: Path, name: str = "bad.yaml") -> Path:
    spec = {"path": str(root), "train": "images/train", "val": "images/val", "names": NAMES}
    path = folder / name
    path.write_text(yaml.safe_dump(spec))
    return path


def make_bad_dataset(folder: Path) -> Path:
    """A shapes set whose train split also holds one file per bad-data case; returns its dataset YAML."""
    root = shapes.generate(folder / "shapes", num_train=NUM_GENERATED, num_val=4, imgsz=64, seed=1)
    images, labels = root / "images/train", root / "labels/train"
    base = cv2.imread(str(images / "000000.png"))  # a 64 x 64 BGR image to derive the odd ones from
    jpeg = cv2.imencode(".jpg", base)[1].tobytes()
    png = (images / "000001.png").read_bytes()

    def add(name: str, image: np.ndarray | bytes, label: str | None = BOX) -> None:
        if isinstance(image, bytes):
            (images / name).write_bytes(image)
        else:
            assert cv2.imwrite(str(images / name), image)
        if label is not None:
            (labels / name).with_suffix(".txt").write_text(label)

    # Skipped. PIL cannot identify random bytes, and cannot decode a PNG or JPEG cut in half ("image file is
    # truncated"): all three are "unreadable image".
    add("corrupt.jpg", np.random.default_rng(0).integers(0, 256, 2000, dtype=np.uint8).tobytes())
    add("truncated.png", png[: len(png) // 2])
    add("truncated.jpg", jpeg[: len(jpeg) // 2])
    # Skipped, for the label file: 4 columns, a letter, x = 1.5 (over Ultralytics' 1% tolerance), class 7 of 4.
    add("four_columns.png", base, "0 0.5 0.5 0.2\n")
    add("non_numeric.png", base, "0 a b c d\n")
    add("outside.png", base, "0 1.5 0.5 0.2 0.2\n")
    add("class_7.png", base, "7 0.5 0.5 0.2 0.2\n")
    # Skipped: Ultralytics refuses images under 10 px on a side.
    add("tiny_8px.png", cv2.resize(base, (8, 8)))
    # Used. A whole JPEG with bytes after its end marker is "corrupt JPEG restored": Ultralytics re-saves it in place.
    add("trailing_bytes.jpg", jpeg + b"\x00\x00")
    # Used: the same box twice is kept once.
    add("duplicates.png", base, BOX + BOX)
    # Used: no label file at all is a background image.
    add("no_label.png", base, label=None)
    # Used: cv2.imread(IMREAD_COLOR) makes grayscale and RGBA images 3-channel BGR, and 16-bit ones 8-bit.
    add("gray.png", cv2.cvtColor(base, cv2.COLOR_BGR2GRAY))
    add("rgba.png", cv2.cvtColor(base, cv2.COLOR_BGR2BGRA))
    add("uint16.png", base.astype(np.uint16) * 257)
    # Used: any aspect ratio, and 10 px is just large enough.
    add("wide_300x40.png", cv2.resize(base, (300, 40)))
    add("small_10px.png", cv2.resize(base, (10, 10)))
    return write_yaml(folder, root)


def num_backgrounds(root: Path) -> int:
    """Generated images with an empty label file, plus no_label.png."""
    return sum(not f.read_text().strip() for f in (root / "labels/train").glob("0*.txt")) + 1


def one_line(text: str) -> str:
    """Rich wraps long lines at spaces when stdout is not a terminal; this undoes that for one summary line."""
    return " ".join(text.split())


def squash(text: str) -> str:
    """Without any whitespace: compares text that rich may have wrapped or folded anywhere."""
    return "".join(text.split())


def headline(stdout: str) -> str:
    """The summary's first line (`train: N images, M skipped: ...`), unwrapped."""
    start = stdout.index("train: ")
    return one_line(stdout[start : stdout.index("\n  skipped", start)])


@pytest.fixture(scope="module")
def bad_run(tmp_path_factory, run_cli):
    """The real CLI, training one epoch on the bad dataset; returns (folder, CompletedProcess)."""
    folder = tmp_path_factory.mktemp("bad_data")
    yaml_file = make_bad_dataset(folder)
    result = run_cli("train", f"data={yaml_file}", *TRAIN, f"project={folder}", "name=bad", timeout=600)
    return folder, result


def test_training_proceeds_on_the_usable_images(bad_run) -> None:
    folder, r = bad_run
    assert r.returncode == 0, r.stdout[-2000:] + r.stderr[-3000:]
    assert "Traceback" not in r.stderr
    assert f"yoloaccum {NUM_GENERATED + len(USED)} images, 1 epochs" in r.stdout
    assert (folder / "bad/weights/last.pt").is_file()


def test_summary_counts_each_reason(bad_run) -> None:
    folder, r = bad_run
    head = headline(r.stdout)
    assert re.match(rf"train: \d+ images, {len(SKIPPED)} skipped: ", head), head
    found = {}
    for reason in {reason for _, reason in data._REASONS}:
        if m := re.search(rf"(\d+) {re.escape(reason)}", head):
            found[reason] = int(m[1])
    assert found == REASONS
    assert head.endswith(f"; {num_backgrounds(folder / 'shapes')} without objects (backgrounds)"), head


def test_usable_images_are_not_listed_as_skipped(bad_run) -> None:
    _, r = bad_run
    for name in USED:
        assert squash(f"/images/train/{name}:") not in squash(r.stdout)


def test_summary_headline_counts_every_image_once(bad_run) -> None:
    _, r = bad_run
    assert headline(r.stdout).startswith(f"train: {NUM_IMAGES} images, {len(SKIPPED)} skipped: ")


def test_summary_names_each_skipped_file(bad_run) -> None:
    folder, r = bad_run
    for name, reason in SKIPPED.items():
        path = folder / "shapes/images/train" / name
        assert squash(f"  skipped {path}: {reason}") in squash(r.stdout)


def test_summary_lines_are_not_wrapped(bad_run) -> None:
    _, r = bad_run
    lines = r.stdout.splitlines()
    heads = [line for line in lines if line.startswith("train: ")]
    assert len(heads) == 1 and heads[0].endswith("without objects (backgrounds)"), heads
    skipped = [line for line in lines if line.startswith("  skipped ")]
    assert len(skipped) == len(SKIPPED)
    assert all(line.endswith(tuple(REASONS)) for line in skipped), skipped


def test_used_images_load_as_8_bit_bgr(tmp_path: Path) -> None:
    """In-process, Ultralytics' dataset holds exactly the usable images, each loaded as 3-channel uint8."""
    spec = data.load_spec(make_bad_dataset(tmp_path))
    dataset = data.build_dataset(config.resolve(TRAIN), spec, "train")
    index = {Path(f).name: i for i, f in enumerate(dataset.im_files)}
    assert set(index) == {f"{i:06d}.png" for i in range(NUM_GENERATED)} | set(USED)
    train = spec.root / "images/train"
    base = cv2.imread(str(train / "000000.png"))
    gray = cv2.imread(str(train / "gray.png"), cv2.IMREAD_UNCHANGED)
    expected = {"gray.png": cv2.cvtColor(gray, cv2.COLOR_GRAY2BGR), "rgba.png": base, "uint16.png": base}
    for name in (*expected, "wide_300x40.png", "small_10px.png"):
        image = dataset.load_image(index[name])[0]
        assert image.dtype == np.uint8 and image.ndim == 3 and image.shape[2] == 3, name
        if name in expected:  # 16 bit to 8 bit rounds, so a value may move by one
            assert np.abs(image.astype(int) - expected[name]).max() <= 1, name
    assert len(dataset.labels[index["duplicates.png"]]["cls"]) == 1
    assert len(dataset.labels[index["no_label.png"]]["cls"]) == 0


# A split that cannot be trained on: one clear line, exit code 2, no traceback.


def split_folders(folder: Path) -> Path:
    root = folder / "set"
    for sub in ("images/train", "images/val", "labels/train", "labels/val"):
        (root / sub).mkdir(parents=True)
    return root


def add_good_image(root: Path, split: str, name: str) -> None:
    assert cv2.imwrite(str(root / "images" / split / f"{name}.png"), np.full((64, 64, 3), 128, np.uint8))
    (root / "labels" / split / f"{name}.txt").write_text(BOX)


def assert_one_error_line(r, *phrases: str) -> str:
    assert r.returncode == 2, r.stdout[-2000:] + r.stderr[-3000:]
    assert "Traceback" not in r.stdout + r.stderr
    lines = [line for line in r.stderr.splitlines() if line.strip()]
    assert len(lines) == 1, r.stderr
    for phrase in phrases:
        assert phrase in lines[0]
    return lines[0]


@pytest.mark.parametrize("empty", ["train", "val"])
def test_an_empty_split_is_an_error(tmp_path: Path, run_cli, empty: str) -> None:
    root = split_folders(tmp_path)
    full = "val" if empty == "train" else "train"
    for i in range(4):
        add_good_image(root, full, f"{i}")
    r = run_cli("train", f"data={write_yaml(tmp_path, root)}", *TRAIN, f"project={tmp_path}", timeout=300)
    assert_one_error_line(r, f"no images found for {empty} in {root / 'images' / empty}")


@pytest.fixture(scope="module")
def unusable_run(tmp_path_factory, run_cli):
    """A train split of two images that are both skipped: random bytes, and a label with class 9 of 4."""
    folder = tmp_path_factory.mktemp("unusable")
    root = split_folders(folder)
    add_good_image(root, "val", "v")
    (root / "images/train/noise.jpg").write_bytes(b"not an image")
    add_good_image(root, "train", "class_9")
    (root / "labels/train/class_9.txt").write_text("9 0.5 0.5 0.2 0.2\n")
    return run_cli("train", f"data={write_yaml(folder, root)}", *TRAIN, f"project={folder}", timeout=300)


def test_a_split_without_one_usable_image_is_an_error(unusable_run) -> None:
    line = assert_one_error_line(unusable_run, "no usable train images")
    assert re.search(r"train: \d+ images, 2 skipped: ", line), line
    assert "1 unreadable image" in line and "1 class id >= nc" in line


def test_a_split_without_one_usable_image_counts_each_once(unusable_run) -> None:
    assert "train: 2 images, 2 skipped" in unusable_run.stderr


@pytest.fixture(scope="module")
def labelled(tmp_path_factory) -> Path:
    """A small shapes set, to copy the images of."""
    return shapes.generate(tmp_path_factory.mktemp("labelled") / "shapes", num_train=4, num_val=2, imgsz=64, seed=1)


def unlabelled_yaml(folder: Path, labelled: Path) -> Path:
    """A set of images with no labels folder (its train and val splits are the same folder, images/)."""
    shutil.copytree(labelled / "images/train", folder / "bare/images")
    path = folder / "unlabelled.yaml"
    path.write_text(yaml.safe_dump({"path": str(folder / "bare"), "train": "images", "val": "images", "names": NAMES}))
    return path


@pytest.fixture(scope="module")
def untrained_pt(tmp_path_factory) -> Path:
    """A checkpoint of the tiny model, untrained: what val needs to get as far as the data."""
    from ultralytics.nn.tasks import DetectionModel

    model = DetectionModel(TINY_MODEL, nc=len(NAMES), verbose=False)
    model.names, model.args = dict(NAMES), {"imgsz": 64}
    path = tmp_path_factory.mktemp("untrained") / "untrained.pt"
    torch.save({"model": model}, path)
    return path


def test_training_on_images_without_labels_is_refused(tmp_path: Path, labelled: Path, cli_in_process) -> None:
    """Ultralytics raises "No labels found" for a training split."""
    r = cli_in_process("train", f"data={unlabelled_yaml(tmp_path, labelled)}", *TRAIN, f"project={tmp_path}/runs")
    line = assert_one_error_line(r, f"no train image in {tmp_path / 'bare/images'} has a label file")
    assert ".../images/x.jpg from .../labels/x.txt" in line and "add the labels folder" in line
    assert not (tmp_path / "runs").exists()


def test_validating_on_images_without_labels_is_refused(tmp_path, labelled, untrained_pt, cli_in_process) -> None:
    """Ultralytics only warns for a validation split, whose metrics are then all zero, and writes a label cache
    that would let a later training through without a word."""
    data_yaml = unlabelled_yaml(tmp_path, labelled)
    r = cli_in_process("val", f"model={untrained_pt}", f"data={data_yaml}", "imgsz=64", "batch=2")
    assert_one_error_line(r, f"no val image in {tmp_path / 'bare/images'} has a label file")
    assert (tmp_path / "bare/labels.cache").exists()
    r = cli_in_process("train", f"data={data_yaml}", *TRAIN, f"project={tmp_path}/runs")
    assert_one_error_line(r, "no train image in", "has a label file")


def test_training_with_an_unlabelled_val_split_is_refused(tmp_path, labelled, cli_in_process) -> None:
    spec = {**yaml.safe_load(unlabelled_yaml(tmp_path, labelled).read_text()), "path": str(labelled)}
    spec.update(train="images/train", val=str(tmp_path / "bare/images"))
    (tmp_path / "val_unlabelled.yaml").write_text(yaml.safe_dump(spec))
    r = cli_in_process("train", f"data={tmp_path / 'val_unlabelled.yaml'}", *TRAIN, f"project={tmp_path}/runs")
    assert_one_error_line(r, "no val image in", "has a label file")
    assert not (tmp_path / "runs").exists()


# summary() on hand-made scans: no files, no Ultralytics. Messages are worded as Ultralytics 8.4.190 words them.
P = "train: "  # Ultralytics' prefix, without its colour codes


def msg(path: str, problem: str) -> str:
    return f"{P}{path}: ignoring corrupt image/label: {problem}"


def test_summary_format() -> None:
    # Ultralytics' (found, missing, empty, corrupt, total): 5 images skipped for the image itself, 5 with a label
    # file (one of them empty, one with a duplicate box).
    scan = {
        "results": (5, 0, 1, 5, 10),
        "msgs": [
            msg("/d/a.jpg", "cannot identify image file '/d/a.jpg'"),
            f"{P}/d/b.png: 1 duplicate labels removed",
            msg("/d/c.png", "Truncated File Read"),
            msg("/d/d.png", "image size (8, 8) <10 pixels"),
            msg("/d/e.jpg", "image file is truncated (310 bytes not processed)"),
            msg("/d/f.png", "image size (4, 64) <10 pixels"),
        ],
    }
    assert data.summary("train", None, scan=scan) == "\n".join(
        [
            "train: 10 images, 5 skipped: 3 unreadable image, 2 image smaller than 10 px, "
            "1 duplicate boxes removed (image kept); 1 without objects (backgrounds)",
            "  skipped /d/a.jpg: unreadable image",
            "  skipped /d/c.png: unreadable image",
            "  skipped /d/d.png: image smaller than 10 px",
            "  skipped /d/e.jpg: unreadable image",
            "  skipped /d/f.png: image smaller than 10 px",
        ]
    )


@pytest.mark.parametrize(
    ("message", "reason"),
    [
        (f"{P}/d/x.png: corrupt JPEG restored and saved", "corrupt JPEG restored (image kept)"),
        (f"{P}/d/x.png: 2 duplicate labels removed", "duplicate boxes removed (image kept)"),
        (msg("/d/x.png", "image size (8, 8) <10 pixels"), "image smaller than 10 px"),
        (msg("/d/x.png", "labels require 5 columns, 4 columns detected"), "wrong column count"),
        (msg("/d/x.png", "could not convert string to float: 'a'"), "non-numeric label"),
        (msg("/d/x.png", "non-normalized or out of bounds coordinates [1.5]"), "coordinates outside [0, 1]"),
        (msg("/d/x.png", "negative label values [-0.5]"), "coordinates outside [0, 1]"),
        (msg("/d/x.png", "non-integer class labels [0.5]"), "class id not an integer"),
        (
            msg("/d/x.png", "Label class 7 exceeds dataset class count 4. Possible class labels are 0-3"),
            "class id >= nc",
        ),
        (msg("/d/x.png", "Truncated File Read"), "unreadable image"),
        (msg("/d/x.png", "Invalid image format GIF."), "unreadable image"),
        (msg("/d/x.png", "cannot reshape array of size 7 into shape (2)"), "wrong column count"),
        (
            msg("/d/x.png", "setting an array element with a sequence. The requested array has an inhomogeneous shape"),
            "wrong column count",
        ),
        (msg("/d/x.png", "labels mix segment and detection rows"), "boxes and polygons mixed"),
        (msg("/d/x.png", "'utf-8' codec can't decode byte 0xff in position 0"), "label file not UTF-8 text"),
    ],
)
def test_summary_reason_of_each_ultralytics_message(message: str, reason: str) -> None:
    kept = "kept" in reason  # (found, missing, empty, corrupt, total): one image, kept or skipped
    text = data.summary(
        "train", None, scan={"results": (1, 0, 0, 0, 1) if kept else (0, 0, 0, 1, 1), "msgs": [message]}
    )
    if kept:
        assert text == f"train: 1 images, 0 skipped: 1 {reason}"
    else:
        assert text == f"train: 1 images, 1 skipped: 1 {reason}\n  skipped /d/x.png: {reason}"


@pytest.mark.parametrize(
    ("label", "reason"),
    [
        (b"0 0.1 0.2 0.3 0.4 0.5 0.6 0.7\n", "wrong column count"),  # a polygon with an odd number of coordinates
        (b"0 0.5 0.5 0.2 0.2\n0 0.5 0.5 0.2\n", "wrong column count"),  # rows of 5 and 4 columns
        (b"0 0.5 0.5 0.2 0.2\n0 0.1 0.1 0.2 0.1 0.2 0.2\n", "boxes and polygons mixed"),
        ("0 0.5 0.5 0.2 0.2 \u00e9\n".encode("latin-1"), "label file not UTF-8 text"),
    ],
    ids=["odd-polygon", "ragged-rows", "box-and-polygon", "not-utf8"],
)
def test_a_malformed_label_is_not_called_an_unreadable_image(tmp_path: Path, label: bytes, reason: str) -> None:
    """Ultralytics' own label check on a good image with a malformed label file: the summary names the label."""
    from ultralytics.data.utils import verify_image_label

    image, label_file = tmp_path / "x.png", tmp_path / "x.txt"
    assert cv2.imwrite(str(image), np.full((64, 64, 3), 128, np.uint8))
    label_file.write_bytes(label)
    message = verify_image_label((str(image), str(label_file), P, False, len(NAMES), 0, 0, False))[-1]
    scan = {"results": (1, 0, 0, 1, 1), "msgs": [message]}
    assert data.summary("train", None, scan=scan).splitlines()[1] == f"  skipped {image}: {reason}"


def test_summary_of_a_clean_split() -> None:
    assert data.summary("val", None, scan={"results": (5, 0, 0, 0, 5), "msgs": []}) == "val: 5 images, 0 skipped"
    assert data.summary("val", None, scan={"results": (5, 0, 2, 0, 5), "msgs": []}) == (
        "val: 5 images, 0 skipped; 2 without objects (backgrounds)"
    )


def test_summary_lists_ten_skipped_files_at_most() -> None:
    scan = {"results": (0, 0, 0, 12, 12), "msgs": [msg(f"/d/{i}.jpg", "Truncated File Read") for i in range(12)]}
    lines = data.summary("train", None, scan=scan).splitlines()
    assert lines[0] == "train: 12 images, 12 skipped: 12 unreadable image"
    assert lines[1:] == [f"  skipped /d/{i}.jpg: unreadable image" for i in range(10)] + ["  ..."]


@pytest.mark.parametrize(
    ("scan", "text"),
    [
        # ok.png and class_7.png: both label files found (2), class_7.png also corrupt (1).
        (
            {
                "results": (2, 0, 0, 1, 2),
                "msgs": [msg("/d/class_7.png", "Label class 7 exceeds dataset class count 4")],
            },
            "train: 2 images, 1 skipped: 1 class id >= nc\n  skipped /d/class_7.png: class id >= nc",
        ),
        # ok.png and no_label.png: one label file found, one missing.
        ({"results": (1, 1, 0, 0, 2), "msgs": []}, "train: 2 images, 0 skipped; 1 without objects (backgrounds)"),
    ],
    ids=["bad-label", "missing-label"],
)
def test_summary_counts_each_image_once(scan: dict, text: str) -> None:
    assert data.summary("train", None, scan=scan) == text


def test_summary_drops_the_colour_codes_of_ultralytics_prefix() -> None:
    coloured = "\x1b[34m\x1b[1mtrain: \x1b[0m"  # colorstr("train: "), the prefix build_dataset gives Ultralytics
    scan = {"results": (0, 0, 0, 1, 1), "msgs": [f"{coloured}/d/x.jpg: ignoring corrupt image/label: Truncated"]}
    assert data.summary("train", None, scan=scan).splitlines()[1] == "  skipped /d/x.jpg: unreadable image"
