"""The API leaves the process as it found it (global_settings.kept()): after a real train() that returns, one that
fails midway, and predict, torch's deterministic mode, the fill of new memory, cuDNN's modes, the thread count, the
random states, matplotlib's backend and the environment are as they were before the call."""

import logging
import os
import random
import sys
from pathlib import Path

import matplotlib
import numpy as np
import pytest
import torch
from conftest import TINY_MODEL, shapes_yaml

import yoloaccum
import yoloaccum.commands.predict  # noqa: F401
import yoloaccum.commands.train  # noqa: F401
from yoloaccum.process.global_settings import kept

# The commands are imported above, as the API imports them before it keeps anything: their imports' effects are not a
# run's, and one draws from python's random generator (rich.style). settings_kept puts everything back again at
# teardown, for the other tests: each check here runs in the test body, before it, so that it cannot hide a miss.
pytestmark = pytest.mark.usefixtures("settings_kept")
TINY = dict(model=TINY_MODEL, imgsz=64, epochs=1, batch=4, nbs=8, workers=0, warmup_epochs=0, deterministic=True)


@pytest.fixture(scope="module")
def data(tmp_path_factory) -> Path:
    return shapes_yaml(tmp_path_factory.mktemp("data"), num_train=8, num_val=4)


@pytest.fixture(scope="module")
def weights(data, tmp_path_factory) -> Path:
    return yoloaccum.train(data=data, project=tmp_path_factory.mktemp("runs"), name="w", plots=False, **TINY).best


def settings() -> dict:
    """Every setting kept() keeps, as values that compare."""
    kind, keys, pos, has_gauss, gauss = np.random.get_state()
    return {
        "deterministic": torch.are_deterministic_algorithms_enabled(),
        "warn_only": torch.is_deterministic_algorithms_warn_only_enabled(),
        "fill_uninitialized_memory": torch.utils.deterministic.fill_uninitialized_memory,
        "cudnn": (torch.backends.cudnn.deterministic, torch.backends.cudnn.benchmark),
        "threads": torch.get_num_threads(),
        "random": (random.getstate(), keys.tobytes(), pos, has_gauss, gauss, torch.get_rng_state().numpy().tobytes()),
        "environment": dict(os.environ),
        "backend": matplotlib.get_backend(),
        "cpp_extension_log": logging.getLogger("torch.utils.cpp_extension").level,
        "recursion_limit": sys.getrecursionlimit(),
    }


def seed(n: int) -> None:
    random.seed(n)
    np.random.seed(n)
    torch.manual_seed(n)


def test_train_puts_back_what_it_changed_when_it_returns(data, tmp_path, monkeypatch):
    """Each setting away from torch's default, and the run's own value where a flag has three: deterministic mode
    without warn_only (the run turns both on), cuDNN's benchmark on, matplotlib's svg backend (plots=True draws the
    schedule after switching to Agg). The two flags whose only other value is the run's stay at torch's defaults, for
    the run to flip; the next test starts from the run's side of them."""
    torch.use_deterministic_algorithms(True, warn_only=False)
    torch.utils.deterministic.fill_uninitialized_memory = True
    torch.backends.cudnn.deterministic, torch.backends.cudnn.benchmark = False, True
    monkeypatch.delenv("CUBLAS_WORKSPACE_CONFIG", raising=False)  # seed_everything sets it where it is unset
    matplotlib.use("svg")
    seed(11)
    before = settings()
    r = yoloaccum.train(data=data, project=tmp_path, name="returns", plots=True, **TINY)
    assert r.last.exists() and (r.save_dir / "schedule.png").exists()
    assert settings() == before


def test_train_puts_back_what_it_changed_when_it_raises(data, tmp_path, monkeypatch):
    """A run that fails at its first micro-step, after seed_everything, from the other side: warn_only without
    deterministic mode, new memory not filled, cuDNN deterministic, and a CUBLAS_WORKSPACE_CONFIG of the user's."""
    torch.use_deterministic_algorithms(False, warn_only=True)
    torch.utils.deterministic.fill_uninitialized_memory = False
    torch.backends.cudnn.deterministic, torch.backends.cudnn.benchmark = True, True
    monkeypatch.setenv("CUBLAS_WORKSPACE_CONFIG", ":16:8")
    monkeypatch.setenv("YOLOACCUM_FAULT", "raise@0")  # training/faults.py: a RuntimeError at iteration 0
    matplotlib.use("pdf")
    seed(12)
    before = settings()
    with pytest.raises(RuntimeError, match="YOLOACCUM_FAULT: injected failure at iteration 0"):
        yoloaccum.train(data=data, project=tmp_path, name="raises", plots=False, **TINY)
    assert settings() == before


def test_predict_puts_back_the_thread_count(data, weights, tmp_path):
    """Ultralytics' select_device sets torch's thread count to its NUM_THREADS; a notebook's next training would run
    on that many."""
    from ultralytics.utils import NUM_THREADS

    torch.set_num_threads(NUM_THREADS + 1)
    seed(13)
    before = settings()
    records = yoloaccum.predict(model=weights, source=data.parent / "shapes/images/val", project=tmp_path, imgsz=64)
    assert len(records) == 4
    assert settings() == before


def test_kept_puts_back_each_setting_by_itself_and_plan_its_backend(tmp_path):
    """What the runs above need not touch here: compile='s logger and recursion limit, a variable removed, a CUDA-less
    thread count; and plan(plot=), which keeps matplotlib's backend alone."""
    matplotlib.use("svg")
    before = settings()
    with pytest.raises(KeyError), kept():
        torch.use_deterministic_algorithms(True, warn_only=True)
        torch.utils.deterministic.fill_uninitialized_memory = not before["fill_uninitialized_memory"]
        torch.backends.cudnn.deterministic, torch.backends.cudnn.benchmark = True, True
        torch.set_num_threads(before["threads"] + 1)
        seed(14)
        os.environ["YOLOACCUM_TEST_ADDED"] = "1"
        os.environ.pop("PATH")
        matplotlib.use("Agg")
        logging.getLogger("torch.utils.cpp_extension").setLevel(logging.ERROR)
        sys.setrecursionlimit(before["recursion_limit"] + 1000)
        raise KeyError("midway")
    assert settings() == before
    yoloaccum.plan(images=100, batch=4, nbs=8, plot=tmp_path / "plan.png")
    assert (tmp_path / "plan.png").exists() and matplotlib.get_backend() == "svg"
