"""Several processes with real torchrun and gloo on the CPU: the same gradient and weights as one process, one
gradient all-reduce per window, the same outputs, and a failing rank that ends the job."""

import os
import shutil
import signal
import socket
import subprocess
import sys
import threading
import time
from pathlib import Path
from unittest import mock

import pytest
import torch
from conftest import PLUMBING, REPO, SERIAL, TINY_MODEL, final_weights, offline_env, relative_difference, shapes_yaml

from yoloaccum.errors import UserError

TORCHRUN = (sys.executable, "-m", "torch.distributed.run", "--standalone")


def torchrun(nproc: int, *args: object, env: dict | None = None, timeout: float = 600) -> subprocess.CompletedProcess:
    cmd = [*TORCHRUN, f"--nproc_per_node={nproc}", *map(str, args)]
    return subprocess.run(cmd, cwd=REPO, env=offline_env(env), capture_output=True, text=True, timeout=timeout)


def window(tmp_path: Path, nproc: int, batch: int, *extra: str) -> dict:
    """tests/ddp_window.py's window on nproc ranks under torchrun; on one, in this process (no process group to
    join, so no launcher and no fresh interpreter's imports)."""
    out = tmp_path / f"window_{nproc}_{batch}_{'_'.join(extra)}.pt"
    if nproc == 1:
        import ddp_window

        with mock.patch.dict(os.environ):  # one process whatever launched pytest: no torchrun variables
            for key in ("WORLD_SIZE", "RANK", "LOCAL_RANK"):
                os.environ.pop(key, None)
            ddp_window.main(str(out), batch, 16, *ddp_window.options(extra))
    else:
        r = torchrun(nproc, REPO / "tests/ddp_window.py", out, batch, 16, *extra)
        assert r.returncode == 0, r.stderr[-3000:]
    return torch.load(out)


@pytest.fixture(scope="module")
def single(tmp_path_factory) -> dict:
    return window(tmp_path_factory.mktemp("single"), 1, 16)  # one process, one micro-batch of 16


@pytest.fixture(scope="module")
def two_ranks(tmp_path_factory) -> dict:
    return window(tmp_path_factory.mktemp("two_ranks"), 2, 4)  # 2 ranks x micro-batch 2 x accumulate 4


@pytest.mark.numerics
@pytest.mark.slow
def test_two_ranks_accumulating_equal_one_process_with_the_whole_batch(single, two_ranks):
    # float32 sums over 16 images in another order: ~5e-6 also without DDP (1 process, 8 micro-batches of 2).
    assert relative_difference(two_ranks["grad"], single["grad"]) <= 1e-5
    assert relative_difference(two_ranks["weights"], single["weights"]) <= 1e-5


@pytest.mark.numerics
@pytest.mark.slow
def test_gradients_all_reduce_once_per_window(two_ranks, tmp_path):
    with_no_sync, without = two_ranks, window(tmp_path, 2, 4, "sync-all")
    # The comm hook runs once per gradient bucket; what counts is how many backward passes communicated.
    assert with_no_sync["steps"] == 1
    assert sorted(set(with_no_sync["communicated"])) == [4]  # only the window's last micro-batch
    assert sorted(set(without["communicated"])) == [1, 2, 3, 4]  # Ultralytics' way: every micro-batch


@pytest.mark.numerics
@pytest.mark.slow
def test_torchrun_cli_run_ends_with_the_big_batch_weights(big_batch_run, exact_args, tmp_path):
    r = torchrun(2, "-m", "yoloaccum", "train", f"project={tmp_path}", "name=ddp", *exact_args, "batch=4", "nbs=16")
    assert r.returncode == 0, r.stdout[-2000:] + r.stderr[-3000:]
    difference = relative_difference(final_weights(tmp_path / "ddp"), final_weights(big_batch_run))
    print(f"torchrun 2 x 2 x accumulate 4 vs batch=16: {difference:.2e} relative")
    assert difference <= 1e-4


@pytest.mark.numerics
@pytest.mark.slow
def test_two_nodes_of_one_rank_each_end_with_the_big_batch_weights(big_batch_run, exact_args, tmp_path):
    """torchrun --nnodes=2 with c10d rendezvous: two launchers, as on two machines, here both on 127.0.0.1."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    node = [
        sys.executable,
        "-m",
        "torch.distributed.run",
        "--nnodes=2",
        "--nproc_per_node=1",
        "--rdzv_backend=c10d",
        f"--rdzv_endpoint=127.0.0.1:{port}",
        "--rdzv_id=two-nodes",
        "--local_addr=127.0.0.1",
        "-m",
        "yoloaccum",
        "train",
        f"project={tmp_path}",
        "name=nodes",
        *exact_args,
        "batch=4",
        "nbs=16",
    ]
    # One thread a rank, as torchrun sets when it starts several on one machine: with one each it does not, and two
    # launchers of two threads each on a 2-core runner made this test two to three times slower.
    env = offline_env({"GLOO_SOCKET_IFNAME": "lo", **SERIAL})
    nodes = [
        subprocess.Popen(node, cwd=REPO, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
        for _ in range(2)
    ]
    errors = [n.communicate(timeout=600)[1] for n in nodes]
    # torchrun's c10d rendezvous lives in one launcher: when it exits first, the other's agent, still polling it for
    # waiting nodes after its rank finished, can fail with RendezvousConnectionError (pytorch/pytorch#69197), a race
    # in the launcher's shutdown after training has ended. Only that, and only where both ranks finished, is allowed.
    shutdown_race = [
        n.returncode != 0 and "num_nodes_waiting" in e and "RendezvousConnectionError" in e
        for n, e in zip(nodes, errors)
    ]
    finished = (tmp_path / "nodes/weights/last.pt").exists()
    assert all(n.returncode == 0 or (race and finished) for n, race in zip(nodes, shutdown_race)), (
        errors[0][-2000:] + errors[1][-2000:]
    )
    difference = relative_difference(final_weights(tmp_path / "nodes"), final_weights(big_batch_run))
    print(f"2 nodes x 1 rank x 2 x accumulate 4 vs batch=16: {difference:.2e} relative")
    assert difference <= 1e-4  # as for one machine's two ranks: the same sums in another order


@pytest.mark.slow
def test_torchrun_smoke_run_writes_the_outputs_of_a_single_process_run(tmp_path, run_cli):
    data = shapes_yaml(tmp_path, num_train=24, num_val=6, seed=7)
    # plots on: they are outputs too
    args = (
        "train",
        f"data={data}",
        f"model={TINY_MODEL}",
        "imgsz=64",
        "batch=4",
        "nbs=8",
        "epochs=1",
        "workers=0",
        f"project={tmp_path}",
    )
    r = torchrun(2, "-m", "yoloaccum", *args, "name=ddp")
    assert r.returncode == 0, r.stderr[-3000:]
    assert run_cli(*args, "name=single", timeout=600).returncode == 0
    # Validation batches are micro-batch x 2 images, as in Ultralytics, so the val_batch pictures differ in number.
    files = {
        name: sorted(p.relative_to(tmp_path / name) for p in (tmp_path / name).rglob("*") if "val_batch" not in p.name)
        for name in ("ddp", "single")
    }
    assert files["ddp"] == files["single"]
    assert Path("weights/best.pt") in files["ddp"]


@pytest.fixture(scope="module")
def two_rank_run(tmp_path_factory) -> tuple[tuple[str, ...], Path]:
    """A 2-rank job with mosaic on, never interrupted: its arguments (less project=) and its run folder."""
    folder = tmp_path_factory.mktemp("two_rank_run")
    data = shapes_yaml(folder, num_train=24, num_val=6, seed=7)
    args = (
        "-m",
        "yoloaccum",
        "train",
        f"data={data}",
        *PLUMBING,
        "imgsz=64",
        "batch=4",
        "nbs=8",
        "epochs=2",
        "workers=0",
        "warmup_epochs=1",
        "close_mosaic=0",
        "val=False",
    )
    full = torchrun(2, *args, f"project={folder}", "name=full", env=SERIAL)
    assert full.returncode == 0, full.stderr[-3000:]
    return args, folder / "full"


@pytest.mark.numerics
@pytest.mark.slow
def test_torchrun_resume_after_sigint_ends_with_the_uninterrupted_weights(two_rank_run, tmp_path, run_cli):
    """Every rank restores its own random states and mosaic buffer: 2 ranks, mosaic on, stopped mid-epoch by a SIGINT
    that reaches rank 1 only, resume bitwise equal to the uninterrupted run. On 1 process it resumes, and says so."""
    args, full = two_rank_run
    args = (*args, f"project={tmp_path}")
    r = torchrun(2, *args, "name=sig", env={**SERIAL, "YOLOACCUM_FAULT": "sigint@8:1"})
    from yoloaccum.model import checkpoint

    state = checkpoint.load(tmp_path / "sig/weights/last.pt")["yoloaccum"]
    assert state["interrupted"] and state["training"]["position"] == {"epoch": 1, "batch": 4}, r.stderr[-3000:]
    assert len(state["ranks"]) == 2 and state["ranks"][0]["rng"]["python"] != state["ranks"][1]["rng"]["python"]
    shutil.copytree(tmp_path / "sig", tmp_path / "one")
    r = torchrun(2, "-m", "yoloaccum", "train", f"resume={tmp_path / 'sig/weights/last.pt'}", env=SERIAL)
    assert r.returncode == 0, r.stderr[-3000:]
    assert relative_difference(final_weights(tmp_path / "sig"), final_weights(full)) == 0.0  # bitwise
    r = run_cli("train", f"resume={tmp_path / 'one/weights/last.pt'}", timeout=600)
    assert r.returncode == 0, r.stderr[-3000:]
    assert "resuming 2 rank(s) on 1: the weights, optimizer, image order and schedule continue exactly" in r.stdout


def kill_every_process_of(folder: Path) -> None:
    """SIGKILL to every process whose command line names `folder` (the test's own tmp_path)."""
    for proc in Path("/proc").iterdir():
        try:
            if proc.name.isdigit() and str(folder) in (proc / "cmdline").read_bytes().decode(errors="replace"):
                os.kill(int(proc.name), signal.SIGKILL)
        except (OSError, ProcessLookupError):
            pass  # gone meanwhile


@pytest.mark.slow
def test_a_hung_rank_ends_the_job_within_ddp_timeout_and_is_named(tmp_path):
    """Rank 1 sleeps forever at iteration 8; rank 0 waits at its window's end, 9, for ddp_timeout, names it and exits
    with an error. The test ends as the line appears: what follows is torchrun's own grace of 30 s before it kills
    the hung rank, which takes SIGTERM as any rank does, as a stop at its next window boundary, which never comes.
    test_a_failing_rank_ends_the_job covers torchrun ending the job once a rank has exited."""
    from yoloaccum.model import checkpoint

    data = shapes_yaml(tmp_path, num_train=24, num_val=6, seed=7)
    cmd = [
        *TORCHRUN,
        "--nproc_per_node=2",
        "-m",
        "yoloaccum",
        "train",
        f"data={data}",
        *PLUMBING,
        "imgsz=64",
        "batch=4",
        "nbs=8",
        "epochs=2",
        "workers=0",
        "ddp_timeout=10",
        f"project={tmp_path}",
        "name=hang",
    ]
    start, lines = time.monotonic(), []
    job = subprocess.Popen(
        cmd,
        cwd=REPO,
        env=offline_env({"YOLOACCUM_FAULT": "hang@8:1"}),
        stdout=subprocess.DEVNULL,
        stderr=subprocess.PIPE,
        text=True,
        start_new_session=True,
    )
    watchdog = threading.Timer(150, kill_every_process_of, (tmp_path,))  # a job that never says it: ends stderr
    watchdog.start()
    try:
        for line in job.stderr:  # rank 0's one line, printed as it exits with code 2
            lines.append(line)
            if "did not reach iteration" in line:
                break
    finally:
        watchdog.cancel()
        kill_every_process_of(tmp_path)  # torchrun and its ranks, which run in sessions of their own
        job.wait()
    stderr = "".join(lines)
    assert "error: rank 1 (last at iteration 7) did not reach iteration 9 within ddp_timeout=10s" in stderr, stderr
    assert time.monotonic() - start < 120  # startup and epoch 1, then ddp_timeout
    assert checkpoint.load(tmp_path / "hang/weights/last.pt")["epoch"] == 0  # epoch 1's, whole


@pytest.mark.slow
@pytest.mark.parametrize("kind", ["raise", "kill"])
def test_a_failing_rank_ends_the_job(kind, tmp_path):
    """Rank 1 fails in the second epoch: the job exits non-zero promptly, and epoch 1's last.pt still loads."""
    data = shapes_yaml(tmp_path, num_train=24, num_val=6, seed=7)
    start = time.monotonic()
    r = torchrun(
        2,
        "-m",
        "yoloaccum",
        "train",
        f"data={data}",
        *PLUMBING,
        "imgsz=64",
        "batch=4",
        "nbs=8",
        "epochs=2",
        "workers=0",
        f"project={tmp_path}",
        "name=fail",
        env={"YOLOACCUM_FAULT": f"{kind}@8:1"},
        timeout=300,
    )
    assert r.returncode != 0
    assert time.monotonic() - start < 240
    from yoloaccum.model import checkpoint

    ckpt = checkpoint.load(tmp_path / "fail/weights/last.pt")
    assert ckpt["epoch"] == 0


@pytest.mark.skipif(torch.cuda.is_available(), reason="with CUDA, device=0,1 starts a real job")
def test_several_cuda_devices_without_cuda_is_a_clear_error(run_cli, tmp_path):
    data = shapes_yaml(tmp_path, num_train=8, num_val=4)
    r = run_cli("train", f"data={data}", "device=0,1")
    assert r.returncode == 2 and "no CUDA device is available" in r.stderr and "Traceback" not in r.stderr


def test_device_ids_count_within_cuda_visible_devices():
    """device= ids are torch's indices: with CUDA_VISIBLE_DEVICES=4,5,6,7, device=0,1 means physical 4 and 5."""
    from yoloaccum.distributed.ddp import visible_devices

    assert visible_devices([0, 1], None) == "0,1"
    assert visible_devices([0, 1], "4,5,6,7") == "4,5"
    assert visible_devices([3, 1], "4, 5,6,7") == "7,5"
    with pytest.raises(UserError, match="makes only 2 device"):
        visible_devices([2], "4,5")


def test_under_torchrun_each_local_rank_takes_its_listed_device():
    """device=2,3 under torchrun: local rank 0 on cuda:2, 1 on cuda:3 (not cuda:0 and cuda:1); too few is an error."""
    from yoloaccum.distributed.ddp import rank_device

    assert [rank_device([2, 3], r, 2) for r in range(2)] == [2, 3]
    assert rank_device([1], 0, 1) == 1
    with pytest.raises(UserError, match="lists 1 device"):
        rank_device([0], 1, 2)


def test_ddp_is_built_with_the_buffer_switch_this_torch_names():
    """torch 2.13 renamed DDP's broadcast_buffers to forward_sync_buffers; torch 2.11, on the lent GPU machines,
    knows only the old name, and a keyword it does not take would fail every multi-GPU run at its start."""
    import inspect

    from torch import nn

    from yoloaccum.distributed import ddp as distributed

    class Before213:
        def __init__(self, module, device_ids=None, broadcast_buffers=True): ...

    assert distributed.no_buffer_sync(Before213) == {"broadcast_buffers": False}
    (name,) = distributed.no_buffer_sync()
    assert name in inspect.signature(nn.parallel.DistributedDataParallel.__init__).parameters


@pytest.mark.numerics
@pytest.mark.slow
def test_a_rank_killed_under_max_restarts_is_restarted_and_the_job_ends_with_the_uninterrupted_weights(
    two_rank_run, tmp_path
):
    """torchrun --max-restarts=1: rank 1 is killed with SIGKILL in epoch 2 (a lost machine); torch's elastic agent
    restarts both ranks with the same command, they find their run by the job's id and resume from epoch 1's
    last.pt, and the job ends bitwise where a job that was never interrupted ends, in the same run folder."""
    args, full = two_rank_run
    args = (*args, f"project={tmp_path}")
    r = torchrun(2, "--max-restarts=1", *args, "name=elastic", env={**SERIAL, "YOLOACCUM_FAULT": "kill@8:1"})
    assert r.returncode == 0, r.stderr[-3000:]
    assert "torchrun restarted this job (restart 1): resuming from" in r.stdout
    assert sorted(p.name for p in tmp_path.iterdir() if p.is_dir() and p.name.startswith("elastic")) == ["elastic"]
    assert relative_difference(final_weights(tmp_path / "elastic"), final_weights(full)) == 0.0


def test_every_rank_validates_rank_0s_ema_and_reads_one_ram_cache_per_machine(tmp_path):
    """bn=batch: each rank's BatchNorm statistics are its own images', so the ranks' EMA buffers differ at the epoch's
    end; at validation they are rank 0's on every rank (SameBuffers). cache=ram under torchrun: every rank reads the
    images one rank decoded into /dev/shm (mapped, its name removed), the same images a rank decodes itself."""
    import json

    data = shapes_yaml(tmp_path, num_train=16, num_val=6)
    out = tmp_path / "seen.json"
    r = torchrun(2, REPO / "tests/ddp_epoch_end.py", data, TINY_MODEL, out, env=SERIAL)
    assert r.returncode == 0, r.stderr[-3000:]
    expected = {"before": False, "at_validation": True, "cache": "ram", "identical": True, "mapped": True}
    assert json.loads(out.read_text()) == {**expected, "every_rank": True}
