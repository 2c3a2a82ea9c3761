"""batch=-1 or a fraction (autobatch.py): the fit from measured peaks, and on the CPU the stated default, through
the real CLI. The CUDA measurement itself needs a GPU."""

import csv
import json

from conftest import shapes_yaml

from yoloaccum.autobatch import GIB, fit


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
    r = run_cli("train", f"data={data}", "model=yolo26n.yaml", "imgsz=64", "epochs=1", "batch=0.7", "nbs=32",
                "grad_checkpointing=True", "workers=0", "val=False", "plots=False", f"project={tmp_path}",
                "name=auto", timeout=300)  # fmt: skip
    assert r.returncode == 0, r.stdout[-2000:] + r.stderr[-3000:]
    assert "micro-batch 16 × accumulate 2" in r.stdout and "micro-batch from memory: batch=0.7" in r.stdout
    (row,) = csv.DictReader((tmp_path / "auto/results.csv").open())
    assert (float(row["micro_batch"]), float(row["accumulate"])) == (16, 2)
