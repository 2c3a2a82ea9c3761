"""Which device a process touches, NCCL's error handling, and the CUDA runs themselves (marked cuda).

Without a GPU, the calls torch.cuda would make are recorded by replacing them (the only way to see them on a CPU
machine); the tests marked cuda run the same paths for real where torch sees a GPU.
"""

import math
import os

import pytest
import torch
from conftest import shapes_yaml

from yoloaccum import compiler, config, distributed, state
from yoloaccum.errors import UserError


@pytest.fixture
def two_gpus(monkeypatch):
    """torch.cuda as on a machine with two GPUs, with set_device recorded."""
    calls = []
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 2)
    monkeypatch.setattr(torch.cuda, "set_device", lambda d: calls.append(torch.device(d)))
    for k in ("WORLD_SIZE", "RANK", "LOCAL_RANK", "LOCAL_WORLD_SIZE"):
        monkeypatch.delenv(k, raising=False)
    return calls


def test_one_process_on_device_1_makes_it_the_current_device(two_gpus):
    """Else the loader's pin-memory thread and the RNG capture for last.pt use (and make a context on) GPU 0."""
    ctx = distributed.setup("1")
    assert ctx.device == torch.device("cuda", 1) and two_gpus == [torch.device("cuda", 1)]


def test_nccl_keeps_the_watchdog_and_the_window_waits_with_ddp_timeout(two_gpus, monkeypatch):
    """TORCH_NCCL_BLOCKING_WAIT=1 turned off the watchdog and blocked the host on every collective."""
    monkeypatch.delenv("TORCH_NCCL_BLOCKING_WAIT", raising=False)
    monkeypatch.setenv("WORLD_SIZE", "2")
    monkeypatch.setenv("LOCAL_WORLD_SIZE", "2")
    seen = {}
    monkeypatch.setattr(torch.distributed, "is_initialized", lambda: False)
    monkeypatch.setattr(
        torch.distributed, "init_process_group", lambda backend, timeout: seen.update(b=backend, t=timeout)
    )
    ctx = distributed.setup("0,1", timeout_s=100)
    assert "TORCH_NCCL_BLOCKING_WAIT" not in os.environ
    assert seen["b"] == "nccl" and seen["t"].total_seconds() == 100 + distributed.NCCL_WATCHDOG_MARGIN_S
    assert ctx.timeout_s == 100


def test_random_states_of_a_cpu_run_leave_cuda_alone(monkeypatch):
    """device=cpu on a GPU machine: capturing the RNG for last.pt must not ask CUDA (that makes a context on GPU 0)."""

    def touched(*args):
        raise AssertionError("torch.cuda was asked for its random state in a run that does not use CUDA")

    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "get_rng_state", touched)
    monkeypatch.setattr(torch.cuda, "set_rng_state", touched)
    saved = state.rng_state(None)
    assert saved["cuda"] is None
    state.restore_rng({**saved, "cuda": torch.zeros(8, dtype=torch.uint8)}, None)  # a CUDA run resumed on the CPU


@pytest.mark.parametrize("mode", sorted(compiler.CUDA_GRAPH_MODES))
def test_compile_modes_that_record_cuda_graphs_are_refused_on_cuda(mode):
    with pytest.raises(UserError, match=f"compile={mode} records CUDA graphs"):
        compiler.check(config.resolve([f"compile={mode}", "device=0"]))
    compiler.check(config.resolve([f"compile={mode}", "device=cpu"]))  # inductor records none on the CPU


# ----------------------------------------------------------------------------------------------- on a real GPU
CUDA_RUN = ("model=yolo26n.yaml", "imgsz=64", "batch=8", "nbs=16", "epochs=1", "workers=0", "plots=False",
            "precise_bn=0", "exist_ok=True", "seed=0")  # fmt: skip


@pytest.mark.cuda
def test_amp_on_cuda_trains_as_fp32_does(tmp_path, run_cli):
    """16 windows (4 epochs of 4 windows of 8 images): GradScaler starts at 2^16 and halves at each overflow, which
    skipped the first 8 or 9 windows on an H200 (docs/gpu.md); with the 2 windows this test first had, AMP stepped
    none and its epoch's mean loss was nan (mean_losses counts the windows that stepped). The last epoch steps."""
    import csv

    data = shapes_yaml(tmp_path, num_train=32, num_val=8)
    losses = {}
    for amp in ("True", "False"):
        r = run_cli("train", f"data={data}", f"project={tmp_path}", f"name=amp{amp}", "device=0", f"amp={amp}",
                    *CUDA_RUN, "nbs=8", "epochs=4", timeout=600)  # fmt: skip
        assert r.returncode == 0, r.stderr[-3000:]
        row = list(csv.DictReader((tmp_path / f"amp{amp}/results.csv").open()))[-1]
        losses[amp] = float(row["train/box_loss"])
    assert math.isfinite(losses["True"]), "no window of the AMP run's last epoch stepped"
    assert losses["True"] == pytest.approx(losses["False"], rel=0.25)


@pytest.mark.cuda
def test_a_cpu_last_pt_resumes_on_cuda_with_amp(tmp_path, run_cli):
    data = shapes_yaml(tmp_path, num_train=32, num_val=8)
    r = run_cli("train", f"data={data}", f"project={tmp_path}", "name=cpu", "device=cpu", *CUDA_RUN, timeout=600)
    assert r.returncode == 0, r.stderr[-3000:]
    r = run_cli("train", f"resume={tmp_path / 'cpu/weights/last.pt'}", "epochs=2", "device=0", timeout=600)
    assert r.returncode == 0, r.stderr[-3000:]
    assert "resuming with AMP a run that trained without it" in r.stdout
