"""End to end through the CLI: train on a small shapes set (and COCO8 when present), then val, predict, and
ultralytics.YOLO on the resulting best.pt. Also: our validation agrees with Ultralytics' own validator."""

import csv
import json
import math
from pathlib import Path

import pytest
import torch
import yaml
from conftest import PLUMBING, shapes_yaml

import yoloaccum.config.ultra  # noqa: F401  (ultralytics offline before it is imported)

COCO8 = Path(__file__).resolve().parents[2] / "shared/datasets/coco8.yaml"
OUTPUTS = ("args.yaml", "results.csv", "results.png", "schedule.csv", "weights/last.pt", "weights/best.pt")
# What Ultralytics' run folder holds with plots=True: for the smoke run (11 iterations an epoch, mosaic closed for the
# second), the batches at ni 0-2 and 11-13, and two validation batches (12 images, 8 a batch).
PLOTS = (
    "labels.jpg",
    *(f"train_batch{ni}.jpg" for ni in (0, 1, 2, 11, 12, 13)),
    *(f"val_batch{i}_{kind}.jpg" for i in (0, 1) for kind in ("labels", "pred")),
    "confusion_matrix.png",
    "confusion_matrix_normalized.png",
    *(f"Box{curve}_curve.png" for curve in ("PR", "F1", "P", "R")),
    "results.png",
    "schedule.png",
)
SMOKE = ("imgsz=64", "batch=4", "nbs=16", "workers=2", "warmup_epochs=1", "close_mosaic=1", "exist_ok=True")


@pytest.fixture(scope="module")
def smoke_data(tmp_path_factory) -> Path:
    return shapes_yaml(tmp_path_factory.mktemp("data"), num_train=42, num_val=12)


@pytest.fixture(scope="module")
def smoke_train(smoke_data, tmp_path_factory, run_cli):
    project = tmp_path_factory.mktemp("runs")
    r = run_cli(
        "train",
        f"data={smoke_data}",
        "model=yolo26n.yaml",
        "epochs=2",
        f"project={project}",
        "name=smoke",
        *SMOKE,
        timeout=600,
    )
    assert r.returncode == 0, r.stdout[-2000:] + r.stderr[-3000:]
    return project / "smoke", r.stdout


@pytest.fixture(scope="module")
def smoke_run(smoke_train) -> Path:
    return smoke_train[0]


def read_results(run: Path) -> list[dict[str, str]]:
    with (run / "results.csv").open() as f:
        return list(csv.DictReader(f))


def test_metrics_print_whole_in_a_log(smoke_train):
    """Captured output is no terminal: each validation's metrics are one line of name-value pairs, none cut short."""
    out = smoke_train[1]
    line = next(x for x in out.splitlines() if x.startswith("epoch 2/2: "))
    for name in ("precision", "recall", "mAP50", "mAP50-95", "val/box_loss", "val/cls_loss"):
        assert f" {name} " in f" {line.split(': ', 1)[1]} ", line
    assert "…" not in line


def test_mosaic_draws_from_the_windows_images_and_the_run_says_so(smoke_train):
    """batch=4 nbs=16: mosaic's pool is 8 windows of 16 images (all 42 here), not Ultralytics' 8 micro-batches of 4."""
    assert (
        "mosaic: each image's partners come from the last 42 images loaded, as a real batch of 16 draws them"
        in (smoke_train[1])
    )
    assert "as Ultralytics does, it would be 32)" in smoke_train[1]


def test_a_small_micro_batch_takes_bn_window_and_the_run_says_so(smoke_train):
    """batch=4 with the default bn=auto: bn=window, said in the run's first lines (best.pt is still a plain model:
    the tests below open, validate, export and predict with it in Ultralytics)."""
    out = " ".join(smoke_train[1].split())
    assert (
        "BatchNorm: bn=auto chose bn=window for 4 images per device: each micro-batch of 4 normalised with the "
        "statistics of its window's 16 images on its device" in out
    )


def test_smoke_run_writes_every_output(smoke_run):
    for name in OUTPUTS:
        assert (smoke_run / name).is_file(), name
    args = yaml.safe_load((smoke_run / "args.yaml").read_text())
    assert (args["batch"], args["nbs"], args["norm"]) == (4, 16, "window")


def test_run_folder_holds_ultralytics_plots_and_the_schedule_as_run(smoke_run):
    import cv2

    for name in PLOTS:
        image = cv2.imread(str(smoke_run / name))
        assert image is not None and min(image.shape[:2]) >= 64, name
    with (smoke_run / "schedule.csv").open() as f:
        steps = list(csv.DictReader(f))
    assert [int(r["ni"]) for r in steps] == sorted({int(r["ni"]) for r in steps})  # one row per step, in order
    assert all(int(r["effective_batch"]) == 4 * int(r["accumulate"]) for r in steps if int(r["ni"]) % 11 != 10)
    assert int(steps[-1]["ni"]) == 21 and int(steps[-1]["accumulate"]) == 3  # the short last window: 11 = 4 + 4 + 3
    assert float(steps[-1]["lr/pg0"]) == pytest.approx(float(read_results(smoke_run)[-1]["lr/pg0"]))


def test_results_csv_has_ultralytics_and_accumulation_columns(smoke_run):
    rows = read_results(smoke_run)
    assert [r["epoch"] for r in rows] == ["1", "2"]
    for column in ("train/box_loss", "metrics/mAP50(B)", "metrics/mAP50-95(B)", "val/cls_loss", "lr/pg0"):
        assert column in rows[0]
    assert (rows[-1]["accumulate"], rows[-1]["effective_batch"]) == ("4", "16")
    for key, value in rows[-1].items():
        assert math.isfinite(float(value)), key


def test_final_figures_are_best_pts_as_in_ultralytics(smoke_train):
    out = smoke_train[1]
    assert "final figures:" in out and "best.pt validated" in out
    assert out.index("final figures:") > out.index("epoch 2/2: ")  # after the last epoch's own figures


def test_pretrained_false_trains_a_pt_model_from_scratch(smoke_run, smoke_data):
    """As Ultralytics: model=x.pt pretrained=False takes the architecture only."""
    from yoloaccum.config import settings as config
    from yoloaccum.data import datasets as data
    from yoloaccum.model import build as model
    from yoloaccum.model import checkpoint

    spec = data.load_spec(str(smoke_data))
    saved = checkpoint.model_of(checkpoint.load(smoke_run / "weights/best.pt")).state_dict()
    for pretrained, loaded in ((True, True), (False, False)):
        cfg = config.resolve([f"model={smoke_run / 'weights/best.pt'}", f"pretrained={pretrained}"])
        built = model.build(cfg, spec, announce=False).state_dict()
        same = all(torch.equal(built[k], v) for k, v in saved.items() if v.is_floating_point() and v.ndim == 4)
        assert same == loaded, pretrained


def test_save_false_and_val_false(smoke_data, tmp_path, run_cli):
    """No weights and no claim of any; no table of zeros for the epochs not validated; results.csv's time is
    cumulative, as Ultralytics writes it."""
    r = run_cli(
        "train",
        f"data={smoke_data}",
        "epochs=2",
        f"project={tmp_path}",
        "name=nosave",
        "save=False",
        "val=False",
        *SMOKE,
        *PLUMBING,
        timeout=600,
    )
    assert r.returncode == 0, r.stdout[-2000:] + r.stderr[-3000:]
    assert not list((tmp_path / "nosave/weights").iterdir())
    assert "best.pt" not in r.stdout and r.stdout.strip().splitlines()[-1].startswith("no weights saved (save=False)")
    lines = [line.strip() for line in r.stdout.splitlines()]
    # only the final epoch validates, so only it prints figures
    assert not any(x.startswith("epoch 1/2: ") for x in lines) and any(x.startswith("epoch 2/2: ") for x in lines)
    first, second = (float(row["time"]) for row in read_results(tmp_path / "nosave"))
    # Cumulative: the second row includes the first epoch's time (per epoch, the first, with its start-up, is longer).
    assert second > first


def test_best_pt_opens_in_ultralytics_and_predicts(smoke_run):
    from ultralytics import YOLO
    from ultralytics.utils import ASSETS

    model = YOLO(smoke_run / "weights/best.pt")
    assert model.names == {0: "circle", 1: "square", 2: "triangle", 3: "cross"}
    results = model.predict(ASSETS / "bus.jpg", imgsz=64, conf=0.001, verbose=False)
    assert results[0].boxes.xyxy.shape[1] == 4


def test_best_pt_is_stripped_to_the_size_ultralytics_ships(smoke_run, tmp_path):
    """best.pt holds the half-precision EMA only, as Ultralytics' strip_optimizer leaves its best.pt; last.pt keeps
    everything a resume needs."""
    from ultralytics.utils.torch_utils import strip_optimizer

    best = torch.load(smoke_run / "weights/best.pt", map_location="cpu", weights_only=False)
    assert best["optimizer"] is None and best["ema"] is None and best["epoch"] == -1
    assert {p.dtype for p in best["model"].parameters()} == {torch.float16} and isinstance(best["model"].args, dict)
    assert best["yoloaccum"].keys() == {"config", "stripped", "epochs_done", "fitness"}
    last = torch.load(smoke_run / "weights/last.pt", map_location="cpu", weights_only=False)
    assert {"model", "ema", "engine", "ranks", "schedule", "training"} <= last["yoloaccum"].keys()
    del last["yoloaccum"]  # what Ultralytics would hold: its own entries, which its strip_optimizer then strips
    torch.save(last, tmp_path / "ultralytics.pt")
    strip_optimizer(tmp_path / "ultralytics.pt")
    size, theirs = (smoke_run / "weights/best.pt").stat().st_size, (tmp_path / "ultralytics.pt").stat().st_size
    assert size <= 1.2 * theirs, (size, theirs)


def test_pretrained_best_pt_loads_every_tensor(smoke_run, smoke_data):
    from yoloaccum.config import settings as config
    from yoloaccum.data import datasets as data
    from yoloaccum.model import build as model

    cfg = config.resolve([f"data={smoke_data}", f"pretrained={smoke_run / 'weights/best.pt'}"])
    built = model.build(cfg, data.load_spec(smoke_data), announce=False)
    best = torch.load(smoke_run / "weights/best.pt", map_location="cpu", weights_only=False)["model"]
    assert model.load_pretrained(built, best.float()) == (len(built.state_dict()), len(built.state_dict()))
    torch.testing.assert_close(built.state_dict(), best.float().state_dict(), rtol=0, atol=0)


def test_on_the_cpu_data_loads_in_the_training_process(smoke_train):
    """workers=2 was asked for; on the CPU workers would take cores from torch's threads (batches.loader_workers)."""
    if torch.cuda.is_available():
        pytest.skip("the run trained on CUDA, where workers are used")
    assert "data loaded in the training process" in smoke_train[1]


def test_training_runs_channels_last_and_checkpoints_stay_contiguous(smoke_run):
    from yoloaccum.model import checkpoint

    ckpt = checkpoint.load(smoke_run / "weights/last.pt")
    trained = [w for w in ckpt["yoloaccum"]["model"].values() if w.ndim == 4]
    assert trained and all(w.is_contiguous(memory_format=torch.channels_last) for w in trained)
    shipped = [w for w in ckpt["ema"].state_dict().values() if w.ndim == 4 and w.shape[-1] > 1]
    assert shipped and all(w.is_contiguous() for w in shipped)  # Ultralytics' usual layout, for predict and export


def test_best_pt_validates_and_exports_in_ultralytics(smoke_run, smoke_data, tmp_path):
    from ultralytics import YOLO

    metrics = YOLO(smoke_run / "weights/best.pt").val(
        data=str(smoke_data), imgsz=64, batch=4, plots=False, project=str(tmp_path), verbose=False
    )
    assert 0 <= metrics.box.map50 <= 1
    exported = YOLO(smoke_run / "weights/best.pt").export(format="torchscript", imgsz=64)
    assert Path(exported).is_file()


@pytest.mark.parametrize("weights", ["best.pt", "last.pt"])
def test_val_command_prints_metrics(smoke_run, smoke_data, run_cli, weights):
    r = run_cli("val", f"model={smoke_run / 'weights' / weights}", f"data={smoke_data}", "imgsz=64", "batch=4")
    assert r.returncode == 0, r.stderr[-2000:]
    assert "mAP50" in r.stdout and "per class" in r.stdout


def test_val_command_takes_a_cuda_device_string(smoke_run, smoke_data, run_cli):
    """device=cuda:0 once became cuda:cuda:0; without CUDA it is a clear error, as in train and predict."""
    r = run_cli("val", f"model={smoke_run / 'weights/best.pt'}", f"data={smoke_data}", "imgsz=64", "device=cuda:0")
    if torch.cuda.is_available():
        assert r.returncode == 0 and "mAP50" in r.stdout, r.stderr[-2000:]
    else:
        assert r.returncode == 2 and "asks for CUDA, but no CUDA device is available" in r.stderr, r.stderr


def test_predict_command_draws_and_writes_json(smoke_run, tmp_path, run_cli):
    from ultralytics.utils import ASSETS

    r = run_cli(
        "predict",
        f"model={smoke_run / 'weights/best.pt'}",
        f"source={ASSETS}",
        "conf=0.001",
        f"project={tmp_path}",
        "name=pred",
    )
    assert r.returncode == 0, r.stderr[-2000:]
    out = tmp_path / "pred"
    assert (out / "bus.jpg").is_file() and (out / "zidane.jpg").is_file()
    records = json.loads((out / "predictions.json").read_text())
    assert {Path(r["image"]).name for r in records} == {"bus.jpg", "zidane.jpg"}
    assert all({"class", "name", "confidence", "box_xyxy"} <= d.keys() for r in records for d in r["detections"])


@pytest.mark.slow
@pytest.mark.skipif(not COCO8.is_file(), reason="COCO8 is not in ../shared/datasets")
def test_train_on_coco8(tmp_path, run_cli):
    r = run_cli(
        "train",
        f"data={COCO8}",
        "model=yolo11n.yaml",
        "epochs=1",
        f"project={tmp_path}",
        "name=coco8",
        *SMOKE,
        timeout=600,
    )
    assert r.returncode == 0, r.stderr[-3000:]
    for name in OUTPUTS:
        assert (tmp_path / "coco8" / name).is_file(), name
    rows = read_results(tmp_path / "coco8")
    assert all(math.isfinite(float(v)) for v in rows[-1].values())
