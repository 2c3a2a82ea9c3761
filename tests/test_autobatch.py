"""batch=-1 or a fraction (autobatch.py): the fit from measured peaks, and on the CPU the stated default, through
the real CLI. The CUDA measurement itself needs a GPU."""

import csv
import json

import pytest
from conftest import shapes_yaml

from yoloaccum.model.autobatch import GIB, fit, micro_batch_cap, state_bytes


def test_fit_takes_the_fraction_of_free_memory_by_a_linear_fit():
    # 1 GiB of model and optimizer state, 0.1 GiB per image: 3 GiB hold 20 images.
    peaks = {b: int((1 + 0.1 * b) * GIB) for b in (1, 2, 4, 8, 16)}
    images, per_image, base = fit(peaks, 3 * GIB, cap=1024)
    assert images == 20 and abs(per_image - 0.1 * GIB) < 1e3 and abs(base - GIB) < 1e3
    assert fit(peaks, 3 * GIB, cap=12)[0] == 12  # never more images than a device's share of the dataset


def test_fit_stays_below_a_size_that_ran_out_of_memory():
    peaks = {1: int(1.1 * GIB), 2: int(1.2 * GIB), 4: int(1.4 * GIB), 8: None}
    assert fit(peaks, 3 * GIB, cap=1024)[0] == 7


def test_plan_says_which_micro_batch_it_chose_and_why(run_cli):
    r = run_cli("plan", "batch=-1", "nbs=64", "images=1000", "--json")
    assert r.returncode == 0, r.stderr
    s = json.loads(r.stdout)["summary"]
    assert (s["batch"], s["accumulate"], s["effective_batch"]) == (16, 4, 64)
    assert "on the CPU the micro-batch is 16 per device" in s["batch_from_memory"]


def test_train_with_batch_from_memory_runs_and_says_so(tmp_path, run_cli):
    data = shapes_yaml(tmp_path, num_train=20, num_val=4)
    r = run_cli(
        "train",
        f"data={data}",
        "model=yolo26n.yaml",
        "imgsz=64",
        "epochs=1",
        "batch=0.7",
        "nbs=32",
        "grad_checkpointing=True",
        "workers=0",
        "val=False",
        "plots=False",
        f"project={tmp_path}",
        "name=auto",
        timeout=300,
    )
    assert r.returncode == 0, r.stdout[-2000:] + r.stderr[-3000:]
    assert "micro-batch 16 × accumulate 2" in r.stdout and "micro-batch from memory: batch=0.7" in r.stdout
    (row,) = csv.DictReader((tmp_path / "auto/results.csv").open())
    assert (float(row["micro_batch"]), float(row["accumulate"])) == (16, 2)


def test_batch_from_memory_never_exceeds_nbs():
    """On a large GPU the fit could choose more than nbs (up to the dataset), so accumulate fell to 1 and the
    effective batch was no longer the recipe's."""
    assert micro_batch_cap(nbs=64, num_images=118_287, world_size=1) == 64
    assert micro_batch_cap(nbs=64, num_images=118_287, world_size=4) == 16
    assert micro_batch_cap(nbs=64, num_images=20, world_size=1) == 20
    assert micro_batch_cap(nbs=2, num_images=100, world_size=4) == 1


def test_the_fit_leaves_room_for_the_optimizer_state_and_ddp_buckets():
    """Memory the probe's micro-step does not hold: AdamW's two moments, SGD's momentum, DDP's gradient buckets."""
    from torch import nn

    model = nn.Linear(1000, 1000)  # 1001000 float32 weights
    weights = 1001000 * 4
    assert state_bytes(model, "SGD", 1) == weights
    assert state_bytes(model, "adamw", 1) == 2 * weights
    assert state_bytes(model, "AdamW", 2) == 3 * weights


def test_on_the_cpu_the_stated_default_stays_within_nbs(run_cli):
    r = run_cli("plan", "batch=-1", "nbs=8", "images=1000", "--json")
    assert r.returncode == 0, r.stderr
    s = json.loads(r.stdout)["summary"]
    assert (s["batch"], s["accumulate"], s["effective_batch"]) == (8, 1, 8)


@pytest.mark.cuda
def test_a_cuda_library_allocation_failure_in_the_probe_counts_as_did_not_fit():
    import torch
    from ultralytics.nn.tasks import DetectionModel

    from yoloaccum.config import settings as config
    from yoloaccum.config.ultra import ultralytics_args
    from yoloaccum.core import loss
    from yoloaccum.model.autobatch import measure

    device = torch.device("cuda", 0)
    model = DetectionModel("yolo26n.yaml", nc=4, verbose=False).to(device).train()
    model.args = ultralytics_args(config.resolve(overrides={}))

    def full(module, args):
        if args[0].shape[0] > 2:
            raise RuntimeError("CUDA error: CUBLAS_STATUS_ALLOC_FAILED when calling `cublasCreate(handle)`")

    model.register_forward_pre_hook(full)
    peaks = measure(model, loss.WindowLoss(model, "window"), 64, False, device, (1, 2, 4, 8), 4)
    assert peaks[1] and peaks[2] and peaks[4] is None and 8 not in peaks
