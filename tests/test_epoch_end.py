"""The end-of-epoch steps (epoch_end.py), each run alone: the deciding ones (validate, early stopping) on what they
read (a fake evaluator, a real TrainingState), the ones that write the run's files on a real trainer (tiny model and
data, nothing trained unless the test says so), and the TensorBoard log read back from its event file."""

from __future__ import annotations

import csv
from types import SimpleNamespace

import pytest
from conftest import PLUMBING, shapes_yaml

from yoloaccum.config import settings as config
from yoloaccum.model import checkpoint
from yoloaccum.training import epoch_end
from yoloaccum.training.tensorboard import TensorBoard
from yoloaccum.training.trainer import Trainer
from yoloaccum.training.training_state import TrainingState


def _trainer(tmp_path, **changes) -> Trainer:
    settings = {
        "data": str(shapes_yaml(tmp_path, num_train=8, num_val=4)),
        "model": "yolo26n.yaml",
        "imgsz": 64,
        "batch": 4,
        "nbs": 8,
        "epochs": 2,
        "workers": 0,
        "plots": False,
        "verbose": False,
        "precise_bn": 0,
        "project": str(tmp_path),
        "name": "run",
        **changes,
    }
    return Trainer.from_config(config.resolve(overrides=settings))


def test_rank_zero_runs_every_step_in_order_and_the_collectives_come_first(tmp_path):
    t = _trainer(tmp_path)
    names = [type(s).__name__ for s in t.epoch_end]
    every = ["PreciseBN", "SameBuffers", "Validate", "EarlyStopping", "RankStates"]  # collectives: every rank
    assert names == [*every, "ResultsRow", "Save"]
    t.parts.run = None  # a rank without a run folder: the collective steps alone
    assert [type(s).__name__ for s in t._steps()] == every


def test_save_false_adds_no_save_step(tmp_path):
    assert not any(isinstance(s, epoch_end.Save) for s in _trainer(tmp_path, save=False).epoch_end)


class FakeEvaluator:
    """Validation's figures, one fitness per call, and how often it ran."""

    def __init__(self, *fitness: float):
        self.fitness, self.calls = list(fitness), 0

    def evaluate(self, model, criterion=None) -> dict[str, float]:
        self.calls += 1
        return {"metrics/mAP50-95(B)": self.fitness[0], "fitness": self.fitness.pop(0)}


def _validate(val: bool = True, patience: int = 100, fitness: tuple[float, ...] = ()) -> epoch_end.Validate:
    """The validate step on what it reads, and nothing else: an evaluator, the EMA, the training state."""
    state = TrainingState(patience=patience)
    return epoch_end.Validate(FakeEvaluator(*fitness), SimpleNamespace(ema=None), None, state, val)


def _end(epoch: int, final: bool = False) -> epoch_end.EpochEnd:
    return epoch_end.EpochEnd(epoch=epoch, final=final, images_per_second=1.0)


def test_validate_records_the_figures_and_says_whether_they_are_the_best():
    validate = _validate(fitness=(0.3, 0.2, 0.4))
    decided = [validate(_end(e), epoch_end.Decided()) for e in range(3)]
    assert [(d.validated, d.best) for d in decided] == [(True, True), (True, False), (True, True)]
    assert validate.state.best_fitness == 0.4 and validate.state.metrics["metrics/mAP50-95(B)"] == 0.4


def test_validate_with_val_false_runs_only_at_the_final_epoch_and_when_early_stopping_could_end_the_run():
    validate = _validate(val=False, patience=2, fitness=(0.5, 0.1))
    not_due = validate(_end(0), epoch_end.Decided())
    assert validate.evaluator.calls == 0 and not not_due.validated and not_due.best  # 0 before any: the best so far
    validate.state.possible_stop = True  # early stopping could end the run after this epoch: a fresh figure
    validate(_end(1), epoch_end.Decided())
    final = validate(_end(2, final=True), epoch_end.Decided())
    assert validate.evaluator.calls == 2 and final.validated and not final.best
    assert validate.state.best_fitness == 0.5


def test_validate_keeps_the_last_figures_when_no_validation_is_due():
    validate = _validate(val=False)
    validate.state.fitness, validate.state.best_fitness = 0.3, 0.4
    decided = validate(_end(0), epoch_end.Decided())
    assert not decided.validated and not decided.best and validate.state.best_fitness == 0.4


def test_early_stopping_ends_the_run_only_before_its_final_epoch():
    state = TrainingState(patience=1)
    stopping = epoch_end.EarlyStopping(state)
    state.fitness = 0.5
    state.stop_early(1)  # epoch 1 was the best
    state.fitness = 0.1
    assert stopping(_end(2), epoch_end.Decided()).stop == "patience"
    assert stopping(_end(2, final=True), epoch_end.Decided()).stop is None  # the last epoch ends the run anyway


def test_each_step_returns_what_it_decided_and_leaves_the_others_decisions():
    before = epoch_end.Decided(validated=True, best=True, row={"epoch": 1})
    state = TrainingState(patience=1)
    state.fitness, state.stop_best_epoch, state.stop_best_fitness = 0.1, 1, 0.5
    after = epoch_end.EarlyStopping(state)(_end(2), before)
    assert after == epoch_end.Decided(validated=True, best=True, stop="patience", row={"epoch": 1})
    assert before.stop is None  # a new record: the one it was given is left as it was


def test_results_and_save_write_the_row_last_pt_and_best_pt(tmp_path):
    t = _trainer(tmp_path)
    t.rank_states.gather()
    t.state.position = (1, 0)  # as the trainer sets it when the epoch's last window is done
    end = epoch_end.EpochEnd(epoch=0, final=False, images_per_second=12.5, train_losses=(1.0, 2.0, 3.0))
    row_step = next(s for s in t.epoch_end if isinstance(s, epoch_end.ResultsRow))
    save = next(s for s in t.epoch_end if isinstance(s, epoch_end.Save))
    decided = row_step(end, epoch_end.Decided(best=True))
    save(end, decided)
    with (t.parts.run.path / "results.csv").open() as f:
        (row,) = list(csv.DictReader(f))
    assert row["epoch"].strip() == "1" and float(row["images_per_second"]) == 12.5 and float(row["accumulate"]) == 2
    assert float(row["train/box_loss"]) == 1.0 and decided.row["train/box_loss"] == 1.0
    last = checkpoint.load(t.parts.run.weights / "last.pt")
    assert last["yoloaccum"]["training"]["position"] == {"epoch": 1, "batch": 0} and not last["yoloaccum"]["finished"]
    assert checkpoint.load(t.parts.run.weights / "best.pt")["yoloaccum"]["stripped"]


def test_a_step_added_from_outside_runs_at_every_epoch_end_and_sees_the_live_state(tmp_path):
    """Trainer.add_step: a step of one's own, before the save, sees each epoch's record, the row the steps before it
    decided, and the training state's position as the run's: the next epoch's start."""
    t = _trainer(tmp_path, warmup_epochs=0)
    seen = []

    def watch(end, decided):
        seen.append((end.epoch, end.final, len(end.steps), decided.row["epoch"], t.state.position))
        return decided

    t.add_step(watch, before=epoch_end.Save)
    assert [type(s).__name__ for s in t.epoch_end][-2:] == ["function", "Save"]
    t.train()
    assert seen == [(0, False, 1, 1, (1, 0)), (1, True, 1, 2, (2, 0))]
    assert t.state.position == (2, 0) and t.state.state_dict()["position"] == {"epoch": 2, "batch": 0}


def _scalars(folder) -> dict[str, list[tuple[int, float]]]:
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    events = EventAccumulator(str(folder))
    events.Reload()
    return {tag: [(e.step, e.value) for e in events.Scalars(tag)] for tag in events.Tags()["scalars"]}


def test_a_run_with_tensorboard_logs_every_step_and_epoch(tmp_path):
    """Trained for real (2 epochs of 8 images, windows of 2 micro-batches of 4): the log holds what schedule.csv and
    results.csv hold, read back from the event file."""
    pytest.importorskip("tensorboard")
    t = _trainer(tmp_path, tensorboard=True, warmup_epochs=0)
    assert isinstance(t.epoch_end[6], TensorBoard)
    t.train()
    scalars = _scalars(t.parts.run.path)
    with (t.parts.run.path / "schedule.csv").open() as f:
        steps = list(csv.DictReader(f))
    assert [s for s, _ in scalars["step/lr/pg0"]] == [int(r["ni"]) for r in steps] == [1, 3]
    assert [v for _, v in scalars["step/accumulate"]] == [2.0, 2.0]
    assert [v for _, v in scalars["step/effective_batch"]] == [8.0, 8.0]
    assert [v for _, v in scalars["step/skipped_windows"]] == [0.0, 0.0]
    assert [pytest.approx(v) for _, v in scalars["step/momentum"]] == [float(r["momentum"]) for r in steps]
    with (t.parts.run.path / "results.csv").open() as f:
        rows = list(csv.DictReader(f))
    for tag in ("train/box_loss", "metrics/mAP50-95(B)", "val/box_loss", "lr/pg0", "effective_batch"):
        logged = [v for _, v in scalars[tag]]
        assert [s for s, _ in scalars[tag]] == [1, 2]
        assert logged == [pytest.approx(float(r[tag]), rel=1e-5, abs=1e-6) for r in rows], tag


def test_tensorboard_true_without_the_package_says_so_and_trains_on(tmp_path, monkeypatch, capsys):
    import importlib.util

    real = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec", lambda name, *a: None if name == "tensorboard" else real(name))
    t = _trainer(tmp_path, tensorboard=True)
    assert not any(isinstance(s, TensorBoard) for s in t.epoch_end)
    assert "tensorboard package is not installed" in capsys.readouterr().out


def test_a_stop_inside_an_epoch_logs_its_steps_and_the_resumed_run_logs_on(tmp_path, run_cli):
    """SIGINT at iteration 5 of 8 (windows of 2): the steps up to the stop are in the log when last.pt is written, and
    the resumed run logs the rest, each step once, with the skipped-window count carried over."""
    pytest.importorskip("tensorboard")
    from conftest import offline_env

    data = shapes_yaml(tmp_path, num_train=16, num_val=4)
    args = (
        "train",
        f"data={data}",
        *PLUMBING,
        "imgsz=64",
        "batch=4",
        "nbs=8",
        "epochs=2",
        "workers=0",
        "precise_bn=0",
        "warmup_epochs=0",
        "tensorboard=True",
        f"project={tmp_path}",
        "name=run",
    )
    stopped = run_cli(*args, env=offline_env({"YOLOACCUM_FAULT": "sigint@5"}), timeout=600)
    assert stopped.returncode != 0 and "resume with" in stopped.stderr, stopped.stderr[-2000:]
    assert [s for s, _ in _scalars(tmp_path / "run")["step/accumulate"]] == [1, 3, 5]
    resumed = run_cli("train", f"resume={tmp_path / 'run/weights/last.pt'}", timeout=600)
    assert resumed.returncode == 0, resumed.stderr[-2000:]
    assert [s for s, _ in _scalars(tmp_path / "run")["step/accumulate"]] == [1, 3, 5, 7]
