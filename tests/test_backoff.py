"""The out-of-memory back-off (Engine._back_off): a window that runs out of memory runs again at half the micro-batch
and ends where a run started at that micro-batch ends. The error is injected with YOLOACCUM_FAULT=oom@NI, which raises
torch.OutOfMemoryError, the type CUDA raises."""

import csv

import pytest
import torch
from conftest import SERIAL, final_weights, relative_difference
from test_engine import make_engine, toy_batches
from torch import nn

from yoloaccum.core.micro_batch import split_batch
from yoloaccum.training import faults


def bn_model() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(6, 16), nn.BatchNorm1d(16), nn.Tanh(), nn.Linear(16, 2))


@pytest.mark.numerics
def test_a_window_that_runs_out_of_memory_ends_as_a_run_at_half_the_micro_batch():
    # 80 images: micro-batches of 8 accumulated 4 times (windows of 32, 32 and 16 images), against micro-batches of 4
    # accumulated 8 times: the same images in each window. The error comes in the first window's second batch, after
    # the first batch has added its gradient and moved BatchNorm's statistics: both must be dropped.
    backed_off = make_engine(bn_model(), num_images=80, batch=8, nbs=32)
    faults.install(backed_off, {"YOLOACCUM_FAULT": "oom@1"})  # as the trainer installs it
    halved = make_engine(bn_model(), num_images=80, batch=4, nbs=32)
    backed_off.train_epoch(0, toy_batches(80, 8))
    halved.train_epoch(0, toy_batches(80, 4))
    assert backed_off.back_offs == [1] and backed_off.split == 2
    assert [r.micro_batches for r in backed_off.history] == [8, 8, 4] == [r.micro_batches for r in halved.history]
    # The same micro-batches in the same order: the same float operations, so equal, not merely close.
    for a, b in zip(backed_off.raw_model.state_dict().values(), halved.raw_model.state_dict().values()):
        torch.testing.assert_close(a, b, rtol=0, atol=0)


def test_out_of_memory_at_one_image_per_device_says_what_to_do():
    from yoloaccum.errors import UserError

    engine = make_engine(bn_model(), num_images=8, batch=2, nbs=2)
    faults.install(engine, {"YOLOACCUM_FAULT": "oom@0"})
    engine.split = 2  # already backed off to one image
    with pytest.raises(UserError, match="1 image per device"):
        engine.train_epoch(0, toy_batches(8, 2))


@pytest.mark.numerics
def test_split_batch_cuts_a_detection_batch_by_image_with_its_labels():
    batch = {
        "img": torch.arange(5).view(5, 1),
        "batch_idx": torch.tensor([0.0, 2, 2, 3, 4, 4]),
        "cls": torch.arange(6.0).view(6, 1),
        "bboxes": torch.arange(24.0).view(6, 4),
        "im_file": ["a", "b", "c", "d", "e"],
        "epoch": 3,
    }
    first, second = split_batch(batch, 2)
    assert first["img"].flatten().tolist() == [0, 1] and first["im_file"] == ["a", "b"]
    assert first["batch_idx"].tolist() == [0] and first["cls"].flatten().tolist() == [0]
    assert second["batch_idx"].tolist() == [0, 0, 1, 2, 2] and second["cls"].flatten().tolist() == [1, 2, 3, 4, 5]
    assert torch.equal(second["bboxes"], batch["bboxes"][1:]) and second["epoch"] == 3
    assert len(split_batch(batch, 8)) == 5  # never an empty micro-batch


@pytest.mark.numerics
@pytest.mark.slow
def test_cli_back_off_ends_with_the_weights_of_a_run_at_half_the_micro_batch(exact_args, tmp_path, run_cli):
    # batch=16 nbs=32 on 42 images: windows of 32 and 10 images; batch=8 nbs=32 cuts them into the same windows.
    # Iteration 1 runs out of memory after iteration 0 has added its gradient.
    r = run_cli(
        "train",
        f"project={tmp_path}",
        "name=oom",
        *exact_args,
        "batch=16",
        "nbs=32",
        env={**SERIAL, "YOLOACCUM_FAULT": "oom@1"},
        timeout=600,
    )
    assert r.returncode == 0, r.stdout[-2000:] + r.stderr[-3000:]
    assert "iteration 1: out of memory at 16 images per device; the window runs again at 8 per device" in r.stdout
    r = run_cli("train", f"project={tmp_path}", "name=half", *exact_args, "batch=8", "nbs=32", env=SERIAL, timeout=600)
    assert r.returncode == 0, r.stdout[-2000:] + r.stderr[-3000:]
    difference = relative_difference(final_weights(tmp_path / "oom"), final_weights(tmp_path / "half"))
    print(f"backed off vs started at batch=8: {difference:.2e} relative")
    # The same images in each window; only the float summation order of the loss and convolutions differs.
    assert difference <= 1e-6
    rows = list(csv.DictReader((tmp_path / "oom/results.csv").open()))
    assert [(float(r["micro_batch"]), float(r["accumulate"]), float(r["effective_batch"])) for r in rows] == [
        (8, 4, 32)
    ] * 2
    state = torch.load(tmp_path / "oom/weights/last.pt", map_location="cpu", weights_only=False)["yoloaccum"]
    assert state["ranks"][0]["engine"]["back_offs"] == [1]  # a resumed run keeps the halved micro-batch
