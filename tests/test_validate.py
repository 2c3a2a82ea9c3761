"""Our validation loop gives the numbers of Ultralytics' own standalone validator on the same weights and data."""

import pytest
import torch
from conftest import shapes_yaml

from yoloaccum.config import settings as config
from yoloaccum.data import datasets as data
from yoloaccum.errors import UserError
from yoloaccum.evaluation import validate

METRICS = ("metrics/precision(B)", "metrics/recall(B)", "metrics/mAP50(B)", "metrics/mAP50-95(B)")


@pytest.fixture(scope="module")
def trained(tmp_path_factory, run_cli):
    """A model that has learned something, so that the compared metrics are not all zero."""
    dataset = shapes_yaml(tmp_path_factory.mktemp("data"), num_train=160, num_val=32, imgsz=96, seed=11)
    project = tmp_path_factory.mktemp("runs")
    r = run_cli(
        "train",
        f"data={dataset}",
        "model=yolo11n.yaml",
        "imgsz=96",
        "batch=8",
        "nbs=8",
        "epochs=6",
        "mosaic=0",
        "warmup_epochs=1",
        "close_mosaic=0",
        "workers=0",
        "val=False",
        f"project={project}",
        "name=val",
        timeout=900,
    )
    assert r.returncode == 0, r.stderr[-3000:]
    return project / "val/weights/best.pt", dataset


@pytest.mark.slow
def test_metrics_agree_with_ultralytics_validator(trained, tmp_path):
    from ultralytics.models.yolo.detect import DetectionValidator

    from yoloaccum.model import checkpoint

    weights, dataset = trained
    # The same weights: best.pt's half-precision EMA, as Ultralytics loads it.
    model = checkpoint.model_of(checkpoint.load(weights)).fuse(verbose=False)
    cfg = config.resolve([f"data={dataset}", "imgsz=96", "batch=8"])
    evaluator = validate.Evaluator(cfg, data.load_spec(dataset), tmp_path, 8, torch.device("cpu"))
    ours = evaluator.evaluate(model)
    args = dict(
        model=str(weights),
        data=str(dataset),
        imgsz=96,
        batch=8,
        conf=0.001,
        iou=0.7,
        plots=False,
        device="cpu",
        verbose=False,
    )
    theirs = DetectionValidator(args=args)()
    assert ours["metrics/mAP50(B)"] > 0.02, "the model learned too little for a meaningful comparison"
    for key in METRICS:
        assert ours[key] == pytest.approx(theirs[key], abs=1e-3), key


def test_evaluator_needs_images(tmp_path):
    """An empty val split is a clear error, not a crash."""
    (tmp_path / "images/train").mkdir(parents=True)
    (tmp_path / "images/val").mkdir(parents=True)
    (tmp_path / "d.yaml").write_text("path: .\ntrain: images/train\nval: images/val\nnames: [a]\n")
    spec = data.load_spec(tmp_path / "d.yaml")
    with pytest.raises(UserError, match="no images found for val"):
        validate.Evaluator(config.resolve(), spec, tmp_path, 4, torch.device("cpu"))
