"""Where a run's time goes (core/timing.py, training/time_report.py): the laps add up, the verdict follows the
figures, a loader slowed on purpose is named, and the hot path keeps one host synchronisation per window."""

from __future__ import annotations

import csv
import time
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch
from conftest import shapes_yaml
from torch.overrides import TorchFunctionMode

from yoloaccum.core.timing import PHASES, PhaseTimer
from yoloaccum.training import time_report


def cfg(**overrides):
    """The keys the verdict reads, at their defaults."""
    keys = {"val": True, "bn_window": 0, "compile": False, "cache": False, "imgsz": 640} | overrides
    return SimpleNamespace(**keys)


def split(**seconds) -> dict[str, float]:
    return {phase: seconds.get(phase, 0.0) for phase in PHASES}


# --- the timer


def test_laps_give_every_second_to_one_phase_and_take_starts_again():
    timer = PhaseTimer(torch.device("cpu"))
    start = time.perf_counter()
    timer.restart()
    time.sleep(0.02)
    timer.lap("data")
    time.sleep(0.01)
    timer.lap("forward_backward")
    timer.lap("forward_backward")
    taken = timer.take()
    wall = time.perf_counter() - start
    assert set(taken) == {"data", "forward_backward"}
    assert taken["data"] >= 0.02 and taken["forward_backward"] >= 0.01
    assert sum(taken.values()) == pytest.approx(wall, abs=2e-3)
    time.sleep(0.005)
    timer.lap("step")
    assert set(timer.take()) == {"step"}  # counted from the last lap, not from the start
    assert timer.total["data"] == taken["data"] and timer.total["step"] >= 0.005


def test_a_timer_that_is_off_measures_nothing():
    timer = PhaseTimer.off()
    timer.restart()
    timer.lap("data")
    assert timer.take() == {} and timer.current() == {} and timer.laps == 0


# --- the verdict's arithmetic


def test_a_run_that_waits_for_its_loader_is_data_bound_with_what_it_does_not_do_yet(monkeypatch):
    v = time_report.verdict(split(data=3.0, forward_backward=7.0), cfg(), "cpu", 0, 3)
    assert v.startswith("data-bound: 30% of training waited for the loader")
    assert v.endswith(
        "try cache=ram (each image decoded once) or an imgsz below 640; on the CPU the data loads in the "
        "training process, beside torch's threads"
    )
    assert "workers" not in v  # on the CPU the data loads in process: workers would change nothing
    cached = time_report.verdict(split(data=3.0, forward_backward=7.0), cfg(cache="ram"), "cpu", 0, 3)
    assert "cache=ram" not in cached  # it has it already
    monkeypatch.setattr(time_report.os, "cpu_count", lambda: 8)  # a GPU machine's cores: the advice's ceiling
    monkeypatch.delenv("LOCAL_WORLD_SIZE", raising=False)
    on_gpu = time_report.verdict(split(data=3.0, forward_backward=7.0), cfg(), "cuda", 2, 3)
    assert on_gpu.endswith("try workers=4 (it had 2), cache=ram (each image decoded once) or an imgsz below 640")
    all_cores = time_report.verdict(split(data=3.0, forward_backward=7.0), cfg(), "cuda", 8, 3)
    assert "workers" not in all_cores


def test_below_the_threshold_the_run_is_compute_bound():
    v = time_report.verdict(split(data=2.0, forward_backward=7.5, step=0.5), cfg(), "cpu", 0, 3)
    assert v == "compute-bound: forward and backward took 75% of training; nothing around them held it up"


def test_validation_heavy_only_where_val_false_would_save_the_time():
    figures = split(forward_backward=5.0, validation=4.5, precise_bn=0.5)  # 5 s over 5 epochs' and the final one's
    v = time_report.verdict(figures, cfg(), "cpu", 0, 5)
    assert v.startswith("validation-heavy: 50% of the run validated, 33% before the last epoch"), v
    assert time_report.verdict(figures, cfg(val=False), "cpu", 0, 5).startswith("compute-bound")
    # one epoch: val=False would validate as often, so nothing to advise
    assert time_report.verdict(figures, cfg(), "cpu", 0, 1).startswith("compute-bound")


def test_the_statistics_pass_names_the_cheaper_modes_it_does_not_use_yet():
    figures = split(forward_backward=6.0, bn_window=3.0, step=1.0)
    v = time_report.verdict(figures, cfg(), "cpu", 0, 3)
    assert v.startswith("bn=window's statistics pass took 30% of training; bn_window=16")
    assert "bn_window=16" not in time_report.verdict(figures, cfg(bn_window=16), "cpu", 0, 3)


def test_no_launch_verdict_on_cuda_until_a_gpu_calibrates_it_but_both_clocks_are_shown():
    """The host's forward-and-backward time holds the loss's read-backs, so host and device agree on CUDA whether or
    not the GPU waited for launches: no verdict is drawn from them (time_report's docstring), the figures are shown."""
    device, host = split(forward_backward=8.0, step=2.0), {"forward_backward": 7.6}
    assert time_report.verdict(device, cfg(), "cuda", 8, 3).startswith("compute-bound")
    report = time_report.Report.of(device, host, cfg(), torch.device("cuda", 0), 8, 3)
    assert report.lines()[2] == (
        "on the GPU, forward and backward took 8.0 s; the host spent 7.6 s launching them and waiting where the "
        "loss reads values back"
    )
    assert len(time_report.Report.of(device, host, cfg(), torch.device("cpu"), 0, 3).lines()) == 2


def test_two_findings_at_most_the_larger_first():
    figures = split(data=4.0, forward_backward=3.0, bn_window=3.0, validation=6.0)  # 4.8 s before the last of 9
    v = time_report.verdict(figures, cfg(), "cpu", 0, 9)
    assert v.startswith("validation-heavy") and "; data-bound" in v and "statistics pass" not in v


def test_the_time_line_lists_the_phases_largest_first():
    report = time_report.Report(split(forward_backward=7.0, data=2.0, save=1.0), "compute-bound: ...")
    assert report.lines()[0] == (
        "time: 10.0 s from the first epoch to the final figures: forward and backward 70%, waiting for data 20%, "
        "saving 10%"
    )


# --- real runs


def _trainer(folder: Path, **changes):
    from yoloaccum.config import settings as config
    from yoloaccum.training.trainer import Trainer

    settings = {
        "data": str(shapes_yaml(folder, num_train=48, num_val=8, imgsz=96, seed=5)),
        "model": "yolo26n.yaml",
        "imgsz": 96,
        "batch": 8,
        "nbs": 16,
        "epochs": 2,
        "plots": False,
        "precise_bn": 0,
        "project": str(folder),
        "name": "run",
        **changes,
    }
    return Trainer.from_config(config.resolve(overrides=settings))


def test_each_rows_split_adds_up_to_the_wall_time_since_the_last_row(tmp_path):
    """results.csv's time/ columns against a clock read from outside, by a step just before each row is made."""
    from yoloaccum.training import epoch_end

    trainer = _trainer(tmp_path, epochs=3, workers=2)
    clock = []
    trainer.add_step(lambda end, decided: clock.append(time.perf_counter()) or decided, before=epoch_end.ResultsRow)
    start = time.perf_counter()
    trainer.train()
    with (trainer.parts.run.path / "results.csv").open() as f:
        rows = list(csv.DictReader(f))
    walls = [b - a for a, b in zip([start, *clock], clock)]
    for row, wall in zip(rows, walls, strict=True):
        split = {k: float(v) for k, v in row.items() if k.startswith("time/")}
        assert set(split) == {f"time/{p}" for p in PHASES}
        assert sum(split.values()) == pytest.approx(wall, rel=0.05), (row, wall)
        assert split["time/forward_backward"] > 0 and split["time/data"] > 0 and split["time/step"] > 0
    assert float(rows[1]["time/save"]) > 0  # the first epoch's last.pt, written after its row
    assert float(rows[-1]["time/validation"]) > 0  # the final epoch validates (val=True)


def shapes_run(folder: Path, images: int, imgsz: int, **settings):
    """train() of yolo26n on a shapes set of `images` at `imgsz`, micro-batch 8, nbs 16, through the API."""
    from yoloaccum import train

    data = shapes_yaml(folder, num_train=images, num_val=8, imgsz=imgsz, seed=5)
    common = {"model": "yolo26n.yaml", "imgsz": imgsz, "batch": 8, "nbs": 16, "plots": False, "name": "run"}
    return train(data=str(data), project=str(folder), **common, **settings)


def test_a_run_whose_loader_keeps_up_is_not_data_bound(tmp_path):
    """The shapes set with workers=2 (on the CPU its images load in the training process), as `make train` runs it."""
    result = shapes_run(tmp_path, 64, 160, epochs=2, workers=2)
    assert "data-bound" not in result.verdict, result.verdict
    training = sum(result.time_split[p] for p in ("data", "to_device", "forward_backward", "step", "other"))
    assert 0 < result.time_split["data"] < 0.25 * training


def test_a_loader_slowed_on_purpose_ends_with_the_data_bound_verdict(tmp_path, monkeypatch):
    """Every image read sleeps 20 ms (the real pipeline around it), as a slow disk or a starved loader would: 55% of
    the epoch's training beside another training run, well above the verdict's quarter (at 5 ms, 29%, and once
    below it)."""
    from ultralytics.data.base import BaseDataset

    read = BaseDataset.load_image

    def slow_read(self, i, rect_mode=True):
        time.sleep(0.02)
        return read(self, i, rect_mode)

    monkeypatch.setattr(BaseDataset, "load_image", slow_read)
    result = shapes_run(tmp_path, 48, 96, epochs=1)
    assert result.verdict.startswith("data-bound: "), result.verdict
    assert "cache=ram" in result.verdict and "workers" not in result.verdict  # the CPU: workers would not help


# --- host synchronisations


SYNCS = {"item", "tolist", "__float__", "__int__", "__bool__", "__index__", "numpy"}


class CountSyncs(TorchFunctionMode):
    """Counts what reads a tensor back to the host, where on CUDA each would wait for the device. Reads of the
    optimizer's step counters are left out: torch keeps them on the host (`step` is a CPU tensor unless the optimizer
    is capturable or fused), so on CUDA too they wait for nothing."""

    def __init__(self, optimizer: torch.optim.Optimizer):
        super().__init__()
        self.optimizer = optimizer
        self.calls: list[str] = []

    def __torch_function__(self, func, types, args=(), kwargs=None):
        name = getattr(func, "__name__", "")
        if name in SYNCS:
            on_host = {id(state["step"]) for state in self.optimizer.state.values() if "step" in state}
            if not (args and id(args[0]) in on_host):
                self.calls.append(name)
        return func(*args, **(kwargs or {}))


@pytest.mark.parametrize("bn", ["batch", "window"])
def test_the_hot_path_reads_back_from_the_device_once_per_window(tmp_path, bn):
    """An epoch of micro-steps and steps through the engine, as the trainer runs it, on the loader's batches (drawn
    beforehand: the loader's own reads are of host tensors) and without the progress display (it reads the losses
    every log_every micro-batches): one read-back per window, the step's, whatever the BatchNorm mode."""
    from yoloaccum.model import build

    trainer = _trainer(tmp_path, bn=bn, batch=4, nbs=16, epochs=1, warmup_epochs=0, workers=0)
    engine = trainer.parts.engine
    batches = list(trainer.parts.loader)
    engine.model.train()
    build.set_bn_mode(engine.model, trainer.parts.bn, trainer.parts.frozen)
    with CountSyncs(engine.optimizer) as counted:
        result = engine.train_epoch(0, batches)
    windows = len(engine.history)
    assert result.done == trainer.parts.schedule.batches_per_epoch and windows == 3
    assert counted.calls == ["tolist"] * windows, counted.calls


# --- what was cut


def test_the_final_validation_takes_best_pts_weights_as_written_without_reading_the_file_back(tmp_path):
    """The model that best.pt was written with, kept in memory, gives the weights the file gives when read back, to
    the bit; a process that did not write best.pt (a resumed run's) reads the file."""
    from yoloaccum.model import checkpoint
    from yoloaccum.training import epoch_end

    trainer = _trainer(tmp_path, epochs=2, val=False)
    trainer.train()
    best = trainer.parts.run.weights / "best.pt"
    save = next(s for s in trainer.epoch_end if isinstance(s, epoch_end.Save))
    assert save.best_model is not None
    kept, read = trainer._best_weights(best), checkpoint.model_of(checkpoint.load(best)).state_dict()
    assert kept.keys() == read.keys()
    for name, tensor in read.items():
        assert kept[name].dtype == tensor.dtype and kept[name].device == tensor.device, name
        assert torch.equal(kept[name], tensor), name
    save.best_model = None
    assert all(torch.equal(a, b) for a, b in zip(trainer._best_weights(best).values(), read.values(), strict=True))
