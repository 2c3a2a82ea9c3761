"""Ultralytics' callback events in yoloaccum's runs (training/callbacks.py): code written for Ultralytics' trainer runs
unchanged, in Ultralytics' order; mistakes in them are answered; and MLflow, Ultralytics' own integration, logs a real
run to a local file store that its client reads back."""

from __future__ import annotations

import csv
import json
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest
from conftest import OFFLINE, REPO, TINY_MODEL, offline_env, shapes_yaml
from conftest import _run_cli as run_cli

from yoloaccum import UserError, train
from yoloaccum.training.callbacks import EVENTS

SMALL = {"model": TINY_MODEL, "imgsz": 64, "batch": 4, "nbs": 8, "epochs": 2, "plots": False, "workers": 0}


@pytest.fixture(scope="module")
def data(tmp_path_factory) -> Path:
    return shapes_yaml(tmp_path_factory.mktemp("callbacks"), num_train=16, num_val=8)


def rows(run: Path) -> list[dict[str, str]]:
    with (run / "results.csv").open() as f:
        return list(csv.DictReader(f))


def test_a_callback_written_for_ultralytics_sees_the_run_as_its_trainer(data, tmp_path):
    """What Ultralytics' callbacks read (epoch, metrics, save_dir, best, tloss, lr, label_loss_items), at the events
    and in the order Ultralytics' trainer runs them."""
    order, seen = [], []

    def record(event):
        return lambda trainer: order.append(event)

    def on_fit_epoch_end(trainer):
        row = trainer.label_loss_items(trainer.tloss, prefix="train")
        seen.append((trainer.epoch, dict(trainer.metrics), trainer.save_dir, trainer.best.exists(), row, trainer.lr))

    batches = []
    ended = []

    def add_one(trainer):  # as W&B's integration adds its own at its start
        trainer.add_callback("on_train_end", lambda t: ended.append((t.epoch, sorted(p.name for p in t.plots))))

    callbacks = {event: record(event) for event in EVENTS}
    callbacks["on_fit_epoch_end"] = [record("on_fit_epoch_end"), on_fit_epoch_end]
    callbacks["on_train_batch_end"] = [record("on_train_batch_end"), lambda t: batches.append(t.epoch)]
    callbacks["on_pretrain_routine_end"] = [record("on_pretrain_routine_end"), add_one]
    settings = {**SMALL, "plots": True}
    result = train(data=str(data), **settings, project=str(tmp_path), name="run", callbacks=callbacks)

    per_epoch = [
        "on_train_epoch_start",
        *["on_train_batch_start", "on_train_batch_end"] * 4,  # 16 images in micro-batches of 4
        "on_train_epoch_end",
        "on_model_save",
        "on_fit_epoch_end",
    ]
    start = ["on_pretrain_routine_start", "on_pretrain_routine_end", "on_train_start"]
    end = ["on_fit_epoch_end", "on_train_end", "teardown"]  # the final validation's figures, then the end
    assert order == start + per_epoch * 2 + end
    table = rows(result.save_dir)
    for epoch, (at, metrics, save_dir, best_exists, losses, lr) in enumerate(seen[:2]):
        assert at == epoch and save_dir == result.save_dir and best_exists
        row = table[epoch]
        assert metrics["metrics/mAP50-95(B)"] == pytest.approx(float(row["metrics/mAP50-95(B)"]), abs=1e-5)
        assert "fitness" not in metrics and metrics["accumulate"] == 2 and "time/forward_backward" in metrics
        assert losses["train/box_loss"] == pytest.approx(float(row["train/box_loss"]), rel=1e-4)
        assert lr["lr/pg0"] == pytest.approx(float(row["lr/pg0"]), rel=1e-4)
    final_epoch, final, *_ = seen[2]
    assert final_epoch == 2 and final == {k: v for k, v in result.metrics.items() if k != "fitness"}
    assert batches == [0] * 4 + [1] * 4  # each batch event sees its epoch
    (at_end,) = ended
    assert at_end[0] == 1 and "results.png" in at_end[1] and "labels.jpg" in at_end[1]  # epoch set back; pictures


def test_a_callback_that_sets_stop_ends_the_run_after_that_epoch_with_its_final_figures(data, tmp_path):
    def enough(trainer):
        trainer.stop = trainer.epoch == 0

    settings = {**SMALL, "epochs": 4}
    result = train(
        data=str(data), **settings, project=str(tmp_path), name="run", callbacks={"on_fit_epoch_end": enough}
    )
    assert len(rows(result.save_dir)) == 1 and result.metrics and result.best is not None


def test_a_callback_that_raises_ends_the_run_with_the_last_save_kept(data, tmp_path):
    def fail_in_the_second_epoch(trainer):
        if trainer.epoch == 1:
            raise RuntimeError("the tracker is down")

    with pytest.raises(RuntimeError, match="the tracker is down"):
        callbacks = {"on_train_epoch_end": fail_in_the_second_epoch}
        train(data=str(data), **SMALL, project=str(tmp_path), name="run", callbacks=callbacks)
    from yoloaccum.model import checkpoint

    last = checkpoint.load(tmp_path / "run/weights/last.pt")
    assert last["yoloaccum"]["training"]["position"] == {"epoch": 1, "batch": 0}  # the first epoch's save
    assert len(rows(tmp_path / "run")) == 1


def test_mistakes_in_callbacks_are_answered_in_the_api(data, tmp_path):
    with pytest.raises(UserError, match=r"unknown event 'on_fit_epoc_end'; Ultralytics' training events are: "):
        train(data=str(data), **SMALL, project=str(tmp_path), callbacks={"on_fit_epoc_end": print})
    with pytest.raises(UserError, match=r"callbacks\['on_train_end'\]: 3 is not callable"):
        train(data=str(data), **SMALL, project=str(tmp_path), callbacks={"on_train_end": [print, 3]})
    with pytest.raises(UserError, match="callbacks= takes a dict"):
        train(data=str(data), **SMALL, project=str(tmp_path), callbacks=[print])
    assert not (tmp_path / "exp").exists()  # answered before any run folder


def test_the_cli_runs_the_functions_of_a_callbacks_file(data, tmp_path):
    file = tmp_path / "my_callbacks.py"
    seen = tmp_path / "seen.txt"
    file.write_text(
        "from pathlib import Path\n\n"
        "def helper(x):\n    return x\n\n"
        "def on_fit_epoch_end(trainer):\n"
        f"    with open({str(seen)!r}, 'a') as f:\n"
        "        f.write(f\"{trainer.epoch} {trainer.metrics['metrics/mAP50(B)']}\\n\")\n"
    )
    settings = [f"{k}={v}" for k, v in SMALL.items()]
    r = run_cli("train", f"data={data}", *settings, f"project={tmp_path}", "name=run", f"callbacks={file}")
    assert r.returncode == 0, r.stderr[-2000:]
    epochs = [line.split()[0] for line in seen.read_text().splitlines()]
    assert epochs == ["0", "1", "2"]


def test_the_cli_answers_a_misspelt_event_and_passes_on_a_callbacks_error(data, tmp_path):
    settings = [f"{k}={v}" for k, v in SMALL.items()]
    misspelt = tmp_path / "misspelt.py"
    misspelt.write_text("def on_fit_epoc_end(trainer):\n    pass\n")
    r = run_cli("train", f"data={data}", *settings, f"project={tmp_path}", f"callbacks={misspelt}")
    assert r.returncode == 2 and "unknown event 'on_fit_epoc_end'" in r.stderr and "Traceback" not in r.stderr
    r = run_cli("train", f"data={data}", *settings, f"project={tmp_path}", f"callbacks={tmp_path / 'none.py'}")
    assert r.returncode == 2 and "no such Python file" in r.stderr
    raising = tmp_path / "raising.py"
    raising.write_text("def on_train_epoch_end(trainer):\n    raise RuntimeError('the tracker is down')\n")
    r = run_cli("train", f"data={data}", *settings, f"project={tmp_path}", "name=raised", f"callbacks={raising}")
    assert r.returncode == 1 and "RuntimeError: the tracker is down" in r.stderr  # the user's code: its traceback


TRACKERS = REPO / ".venv/trackers"  # make install puts mlflow-skinny there, outside the venv (Makefile: TRACKERS)
READ_BACK = """
import json, sys
from mlflow.tracking import MlflowClient
client = MlflowClient(tracking_uri=sys.argv[1])
(run,) = client.search_runs([client.get_experiment_by_name(sys.argv[2]).experiment_id])
history = lambda key: {m.step: m.value for m in client.get_metric_history(run.info.run_id, key)}
print(json.dumps({
    "status": run.info.status,
    "params": run.data.params,
    "metrics": {key: history(key) for key in run.data.metrics},
    "weights": sorted(a.path for a in client.list_artifacts(run.info.run_id, "weights")),
    "files": sorted(a.path for a in client.list_artifacts(run.info.run_id)),
}))
"""


@pytest.mark.skipif(not (TRACKERS / "mlflow").is_dir(), reason="needs MLflow in .venv/trackers (make install)")
def test_mlflow_logs_a_run_to_its_local_file_store(data, tmp_path):
    """Ultralytics' MLflow integration, on by default in its settings, logs yoloaccum's run to a local file store:
    the parameters, a row of metrics per epoch as results.csv has it, and the weights; MLflow's client reads them
    back. (Ultralytics' callbacks log nothing under pytest, except in a test whose name has test_mlflow.)"""
    store, experiment = (tmp_path / "mlruns").as_uri(), "yoloaccum-test"
    env = {
        "PYTHONPATH": os.pathsep.join([str(OFFLINE), str(TRACKERS)]),  # the network guard stays first
        "MLFLOW_TRACKING_URI": store,
        "MLFLOW_EXPERIMENT_NAME": experiment,
        "MLFLOW_ALLOW_FILE_STORE": "true",  # MLflow 3 keeps its file store for those who ask for it
    }
    settings = [f"{k}={v}" for k, v in SMALL.items()]
    r = run_cli("train", f"data={data}", *settings, f"project={tmp_path}", "name=run", env=env, timeout=300)
    assert r.returncode == 0, r.stdout[-2000:] + r.stderr[-2000:]
    assert "trackers: mlflow, as Ultralytics' settings switch them on" in r.stdout
    read = subprocess.run(
        [sys.executable, "-c", READ_BACK, store, experiment],
        capture_output=True,
        text=True,
        env=offline_env(env),
        timeout=120,
    )
    assert read.returncode == 0, read.stderr[-2000:]
    logged = json.loads(read.stdout)
    assert logged["status"] == "FINISHED" and logged["params"]["batch"] == "4" and logged["params"]["nbs"] == "8"
    metrics, table = logged["metrics"], rows(tmp_path / "run")
    for epoch, row in enumerate(table):
        assert metrics["metrics/mAP50-95B"][str(epoch)] == pytest.approx(float(row["metrics/mAP50-95(B)"]), abs=1e-5)
        assert metrics["train/box_loss"][str(epoch)] == pytest.approx(float(row["train/box_loss"]), rel=1e-4)
        assert metrics["lr/pg0"][str(epoch)] == pytest.approx(float(row["lr/pg0"]), rel=1e-4)
        assert metrics["accumulate"][str(epoch)] == float(row["accumulate"])  # yoloaccum's own columns too
        assert metrics["time/forward_backward"][str(epoch)] == pytest.approx(float(row["time/forward_backward"]))
    assert str(len(table)) in metrics["metrics/mAP50-95B"]  # the final figures, one past the last epoch
    assert logged["weights"] == ["weights/best.pt", "weights/last.pt"]
    assert {"results.csv", "args.yaml"} <= set(logged["files"])


DVCLIVE = REPO / ".venv/trackers-dvclive"  # make install puts dvclive there (Makefile: TRACKERS_DVCLIVE)


@pytest.mark.skipif(not (DVCLIVE / "dvclive").is_dir(), reason="needs DVCLive in .venv/trackers-dvclive (make install)")
def test_dvclive_logs_a_run_to_its_folder(data, tmp_path):
    """A second tracker that writes locally: Ultralytics' DVCLive integration (its setting is on by default) logs
    yoloaccum's run into ./dvclive, a metrics file per metric with a row per epoch, which match results.csv. Its
    integration logs nothing where it sees pytest, so the run's environment leaves pytest's variable out."""
    env = {k: v for k, v in offline_env().items() if k != "PYTEST_CURRENT_TEST"}
    env["PYTHONPATH"] = os.pathsep.join([str(OFFLINE), str(DVCLIVE)])  # the network guard stays first
    settings = [f"{k}={v}" for k, v in SMALL.items()]
    command = [sys.executable, "-m", "yoloaccum", "train", f"data={data}", *settings, f"project={tmp_path}", "name=run"]
    r = subprocess.run(command, cwd=tmp_path, env=env, capture_output=True, text=True, timeout=300)
    assert r.returncode == 0, r.stdout[-2000:] + r.stderr[-2000:]
    assert "trackers: dvc, as Ultralytics' settings switch them on" in r.stdout
    logged = tmp_path / "dvclive/plots/metrics"

    def series(name: str) -> dict[int, float]:
        with (logged / f"{name}.tsv").open() as f:
            return {int(row["step"]): float(row[Path(name).name]) for row in csv.DictReader(f, delimiter="\t")}

    table = rows(tmp_path / "run")
    maps, losses, accumulate = series("metrics/mAP50-95(B)"), series("train/box_loss"), series("accumulate")
    assert sorted(maps) == list(range(len(table)))  # a row per epoch
    for epoch, row in enumerate(table):
        assert maps[epoch] == pytest.approx(float(row["metrics/mAP50-95(B)"]), abs=1e-5)
        assert losses[epoch] == pytest.approx(float(row["train/box_loss"]), rel=1e-4)
        assert accumulate[epoch] == float(row["accumulate"])  # yoloaccum's own columns too
    params = (tmp_path / "dvclive/params.yaml").read_text()
    assert "batch: 4" in params and "nbs: 8" in params
    final = json.loads((tmp_path / "dvclive/metrics.json").read_text())["metrics"]  # on_train_end: best.pt's figures
    shown = re.search(r"final figures: .* validated: .*mAP50-95 ([\d.]+)", r.stdout)
    assert shown and final["mAP50-95(B)"] == pytest.approx(float(shown[1]), abs=1e-3)
    # DVCLive keeps artifacts (best.pt) only inside a DVC repository: there it says so and skips them
    assert not (tmp_path / "dvclive/artifacts").exists()
