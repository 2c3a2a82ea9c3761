"""Our validation loop gives the numbers of Ultralytics' own standalone validator on the same weights and data; each
rank's share of the images (tests/test_validate_ddp.py runs the ranks)."""

import pytest
import torch

from yoloaccum.config import settings as config
from yoloaccum.data import batches
from yoloaccum.data import datasets as data
from yoloaccum.errors import UserError
from yoloaccum.evaluation import validate

METRICS = ("metrics/precision(B)", "metrics/recall(B)", "metrics/mAP50(B)", "metrics/mAP50-95(B)")


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


@pytest.mark.parametrize(
    "num_images, batch, world", [(32, 8, 2), (32, 8, 3), (32, 16, 3), (32, 5, 2), (3, 8, 4), (7, 1, 3)]
)
def test_each_rank_shares_a_contiguous_run_of_whole_batches_and_each_image_is_once_in_one(num_images, batch, world):
    shares = [batches.shard(num_images, batch, rank, world) for rank in range(world)]
    assert shares[0][0] == 0 and shares[-1][1] == num_images
    assert all(end == first for (_, end), (first, _) in zip(shares, shares[1:]))  # no gap, no overlap
    assert all(first % batch == 0 for first, _ in shares if first < num_images)  # whole batches: one process's cuts
    counts = [-(-(end - first) // batch) for first, end in shares]
    assert max(counts) - min(counts) <= 1 and counts == sorted(counts, reverse=True)  # the earlier ranks one more
    last = batches.ShardBatches(num_images, batch, world - 1, world)
    assert [i for b in last for i in b] == list(range(*shares[-1])) and len(last) == counts[-1]
    assert all(len(b) == batch for b in list(last)[:-1])  # one process's batches
    halved = batches.ShardBatches(num_images, batch, 0, world, part=max(1, batch // 2))  # after a back-off
    assert [i for b in halved for i in b] == list(range(*shares[0]))
    assert all(b[0] // batch == b[-1] // batch for b in halved)  # no part spans two of one process's batches
