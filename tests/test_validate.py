"""Our validation loop gives the numbers of Ultralytics' own standalone validator on the same weights and data; shared
by 2 and 3 ranks under real torchrun and gloo, it gives one process's numbers, each image evaluated once."""

import json
import subprocess
import sys

import pytest
import torch
from conftest import REPO, SERIAL, offline_env, shapes_yaml

from yoloaccum.config import settings as config
from yoloaccum.data import batches
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


TORCHRUN = (sys.executable, "-m", "torch.distributed.run", "--standalone")


def _shared(
    trained, folder, nproc: int, batch: int, data: str | None = None
) -> tuple[subprocess.CompletedProcess, list]:
    """tests/ddp_validate.py on nproc ranks (one: a plain process); each rank's metrics and image files."""
    weights, dataset = trained
    out = folder / f"val_{nproc}_{batch}"
    script = [REPO / "tests/ddp_validate.py", weights, data or dataset, batch, out]
    cmd = [*TORCHRUN, f"--nproc_per_node={nproc}", *script] if nproc > 1 else [sys.executable, *script]
    r = subprocess.run(
        list(map(str, cmd)), cwd=REPO, env=offline_env(SERIAL), capture_output=True, text=True, timeout=600
    )
    ranks = [json.loads(f.read_text()) for f in sorted(folder.glob(f"{out.name}.*.json"))]
    return r, ranks


@pytest.mark.slow
@pytest.mark.numerics
@pytest.mark.parametrize(
    "nproc, batch",
    [(2, 8), (3, 8), (3, 16), (2, 5)],
    ids=["2 ranks", "3 ranks, 32 images not a multiple of 24", "3 ranks, the third holding none", "2, a short last"],
)
def test_validation_shared_by_the_ranks_gives_one_process_figures(trained, tmp_path, nproc, batch):
    """32 images in batches of `batch`: each rank takes a contiguous run of whole batches, none padded or repeated,
    and every rank returns the figures of one process, val losses included, to 1e-6."""
    r, (one,) = _shared(trained, tmp_path, 1, batch)
    assert r.returncode == 0, r.stderr[-3000:]
    r, ranks = _shared(trained, tmp_path, nproc, batch)
    assert r.returncode == 0, r.stderr[-3000:]
    assert len(ranks) == nproc
    assert one["metrics"]["metrics/mAP50(B)"] > 0.02 and one["metrics"]["val/box_loss"] > 0  # not all zero
    for rank in ranks:
        assert rank["metrics"].keys() == one["metrics"].keys()
        for key, value in one["metrics"].items():
            assert rank["metrics"][key] == pytest.approx(value, abs=1e-6, rel=0), key
    shares = [rank["files"] for rank in ranks]
    assert [f for share in shares for f in share] == one["files"]  # each image once, in one process's order
    if batch == 16:
        assert shares[2] == []


def test_a_validation_set_one_rank_cannot_see_stops_every_rank_with_one_line(trained, tmp_path):
    """Rank 1's dataset is not there: both ranks stop with the same line (no rank waits in a collective)."""
    weights, dataset = trained
    r, ranks = _shared(trained, tmp_path, 2, 8, data=f"{dataset}:missing-on-rank-1")
    assert r.returncode != 0 and ranks == []
    assert r.stderr.count("(on rank 1)") == 2 and "absent.yaml does not exist" in r.stderr, r.stderr[-3000:]
    assert "every_rank_ok" not in r.stderr  # the ranks' own lines; torchrun then reports the failed job itself


@pytest.mark.slow
@pytest.mark.numerics
@pytest.mark.parametrize("nproc", [2, 3])
def test_val_under_torchrun_equals_the_one_process_val(trained, tmp_path, nproc, run_cli):
    """`yoloaccum val` under torchrun: the same figures as one process; rank 0 alone prints them."""
    from yoloaccum.commands.val import METRICS_OUT

    weights, dataset = trained
    args = ("val", f"model={weights}", f"data={dataset}", "imgsz=96", "batch=8", "device=cpu")
    one = tmp_path / "one.json"
    r = run_cli(*args, env=offline_env({**SERIAL, METRICS_OUT: str(one)}), timeout=600)
    assert r.returncode == 0, r.stderr[-3000:]
    shared = tmp_path / "shared.json"
    cmd = [*TORCHRUN, f"--nproc_per_node={nproc}", "-m", "yoloaccum", *args]
    env = offline_env({**SERIAL, METRICS_OUT: str(shared)})
    r = subprocess.run(cmd, cwd=REPO, env=env, capture_output=True, text=True, timeout=600)
    assert r.returncode == 0, r.stderr[-3000:]
    expected, got = json.loads(one.read_text()), json.loads(shared.read_text())
    assert got.keys() == expected.keys()
    for key, value in expected.items():
        assert got[key] == pytest.approx(value, abs=1e-6, rel=0), key
    assert r.stdout.count("per class") == 1  # the figures printed once


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
