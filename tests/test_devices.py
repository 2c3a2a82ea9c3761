"""Which device a process touches, NCCL's error handling, and the CUDA runs themselves (marked cuda).

Without a GPU, the calls torch.cuda would make are recorded by replacing them (the only way to see them on a CPU
machine); the tests marked cuda run the same paths for real where torch sees a GPU.
"""

import math
import os

import pytest
import torch
from conftest import shapes_yaml

from yoloaccum.config import settings as config
from yoloaccum.distributed import ddp as distributed
from yoloaccum.errors import UserError
from yoloaccum.model import compiler
from yoloaccum.process import rng


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
    saved = rng.rng_state(None)
    assert saved["cuda"] is None
    rng.restore_rng({**saved, "cuda": torch.zeros(8, dtype=torch.uint8)}, None)  # a CUDA run resumed on the CPU


@pytest.mark.parametrize("mode", sorted(compiler.CUDA_GRAPH_MODES))
def test_compile_modes_that_record_cuda_graphs_are_refused_on_cuda(mode):
    with pytest.raises(UserError, match=f"compile={mode} records CUDA graphs"):
        compiler.check(config.resolve([f"compile={mode}", "device=0"]))
    compiler.check(config.resolve([f"compile={mode}", "device=cpu"]))  # inductor records none on the CPU


# ----------------------------------------------------------------------------------------------- on a real GPU
CUDA_RUN = (
    "model=yolo26n.yaml",
    "imgsz=64",
    "batch=8",
    "nbs=16",
    "epochs=1",
    "workers=0",
    "plots=False",
    "precise_bn=0",
    "exist_ok=True",
    "seed=0",
)


@pytest.mark.cuda
def test_amp_on_cuda_trains_as_fp32_does(tmp_path, run_cli):
    """16 windows (4 epochs of 4 windows of 8 images): GradScaler starts at 2^16 and halves at each overflow, which
    skipped the first 8 or 9 windows on an H200 (docs/gpu.md); with the 2 windows this test first had, AMP stepped
    none and its epoch's mean loss was nan (mean_losses counts the windows that stepped). The last epoch steps."""
    import csv

    data = shapes_yaml(tmp_path, num_train=32, num_val=8)
    losses = {}
    for amp in ("True", "False"):
        r = run_cli(
            "train",
            f"data={data}",
            f"project={tmp_path}",
            f"name=amp{amp}",
            "device=0",
            f"amp={amp}",
            *CUDA_RUN,
            "nbs=8",
            "epochs=4",
            timeout=600,
        )
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


def test_an_empty_device_takes_the_first_gpu_where_there_is_one(two_gpus):
    """As Ultralytics: device unset trains on CUDA where torch sees a GPU, not on the CPU."""
    assert distributed.resolve_device(None) == "0" and distributed.resolve_device("") == "0"
    assert distributed.setup(None).device == torch.device("cuda", 0)


def test_an_empty_device_under_torchrun_gives_each_local_rank_its_gpu(two_gpus, monkeypatch):
    monkeypatch.setenv("LOCAL_WORLD_SIZE", "2")
    assert distributed.resolve_device("") == "0,1"
    assert distributed.select_device("", local_rank=1) == torch.device("cuda", 1)


def test_an_empty_device_without_cuda_is_the_cpu(monkeypatch):
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    assert distributed.resolve_device("") == "cpu" and distributed.select_device(None) == torch.device("cpu")


@pytest.mark.parametrize("given, expected", [("0", "0"), ("cuda:1", "cuda:1"), ("0,1", "0,1"), ("cpu", "cpu")])
def test_explicit_devices_are_kept(two_gpus, given, expected):
    assert distributed.resolve_device(given) == expected


def test_minus_one_picks_the_least_busy_gpus(two_gpus, monkeypatch):
    """device=-1 (and -1,-1): the devices with the most free memory, as Ultralytics picks idle GPUs."""
    free = {0: 1 << 30, 1: 5 << 30}
    monkeypatch.setattr(torch.cuda, "mem_get_info", lambda i: (free[i], 8 << 30))
    assert distributed.resolve_device("-1") == "1"
    assert distributed.resolve_device("-1,-1") == "0,1"
    with pytest.raises(UserError, match="asks for 3 CUDA device"):
        distributed.resolve_device("-1,-1,-1")
    monkeypatch.setenv("WORLD_SIZE", "2")
    with pytest.raises(UserError, match="under torchrun: list the devices"):
        distributed.resolve_device("-1")


@pytest.mark.parametrize(
    "given, message",
    [("mps", "not Apple's MPS; use device=cpu"), ("0,-1", "not both"), ("gpu", "is not understood")],
)
def test_devices_that_cannot_run_say_so_in_one_line(given, message):
    with pytest.raises(UserError, match=message):
        distributed.resolve_device(given)


def test_the_run_names_the_cpu_in_its_first_lines(cli_in_process, tmp_path):
    """On this machine the README's commands, which give no device, train on the CPU and say so."""
    if torch.cuda.is_available():
        pytest.skip("this machine has CUDA")
    data = shapes_yaml(tmp_path, num_train=4, num_val=2)
    args = ("imgsz=64", "epochs=1", "batch=4", "nbs=4", "plots=False", "val=False", "precise_bn=0")
    r = cli_in_process("train", f"data={data}", *args, f"project={tmp_path}/runs")
    assert r.returncode == 0, r.stderr[-2000:]
    first = next(line for line in r.stdout.splitlines() if line.startswith("yoloaccum "))
    assert "on 1 × cpu" in first
