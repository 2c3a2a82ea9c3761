"""Nothing lost: atomic checkpoints, exact resume, clean interruption, and non-finite windows skipped.

The runs use augmentation (mosaic included) and workers=0, so an exact resume must restore every random state and
Ultralytics' mosaic buffer, not only the weights. Runs compared bitwise use one thread (see conftest.SERIAL).
"""

import errno
import math
import os
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch
import yaml
from conftest import PLUMBING, REPO, SERIAL, TINY_MODEL, final_weights, offline_env, relative_difference, shapes_yaml

from yoloaccum.config import settings as config
from yoloaccum.core import schedule
from yoloaccum.errors import UserError
from yoloaccum.model import checkpoint
from yoloaccum.training import faults, resume, state

RUN = (
    *PLUMBING,
    "imgsz=64",
    "batch=4",
    "nbs=8",
    "epochs=4",
    "workers=0",
    "close_mosaic=1",
    "warmup_epochs=1",
    "log_every=1",
)


@pytest.fixture(scope="module")
def data(tmp_path_factory) -> Path:
    return shapes_yaml(tmp_path_factory.mktemp("data"), num_train=24, num_val=6, seed=7)


@pytest.fixture(scope="module")
def uninterrupted(data, tmp_path_factory, run_cli) -> Path:
    project = tmp_path_factory.mktemp("runs")
    r = run_cli(
        "train", f"data={data}", *RUN, "save_period=1", f"project={project}", "name=full", env=SERIAL, timeout=600
    )
    assert r.returncode == 0, r.stderr[-3000:]
    return project / "full"


@pytest.mark.numerics
def test_resume_after_epoch_2_ends_with_the_uninterrupted_weights(uninterrupted, tmp_path, run_cli):
    run = shutil.copytree(uninterrupted, tmp_path / "resumed")  # epoch2.pt is the state after epoch 2 of 4
    r = run_cli("train", f"resume={run / 'weights/epoch2.pt'}", env=SERIAL, timeout=600)
    assert r.returncode == 0, r.stderr[-3000:]
    assert "resuming" in r.stdout and "epoch 3" in r.stdout
    assert relative_difference(final_weights(run), final_weights(uninterrupted)) == 0.0  # bitwise
    assert len((run / "results.csv").read_text().splitlines()) == 1 + 4  # header and one row per epoch
    # schedule.csv was cut back to the checkpoint and appended again: the same steps, lrs and momenta
    assert (run / "schedule.csv").read_text() == (uninterrupted / "schedule.csv").read_text()


@pytest.mark.numerics
def test_a_last_pt_of_format_4_resumes_bitwise(data, uninterrupted, tmp_path, run_cli):
    """tests/fixtures/format4-epoch2.pt is epoch2.pt of this file's uninterrupted run (the same data, model and
    settings), written by yoloaccum 95a1a9a, the last to write format 4 (each part's fields side by side). Resumed
    by today's reader, it ends bitwise where today's uninterrupted run ends. Its config names the folders it was
    written in: they are pointed at this test's."""
    ckpt = checkpoint.load(REPO / "tests/fixtures/format4-epoch2.pt")
    assert ckpt["yoloaccum"]["format"] == 4 and "training" not in ckpt["yoloaccum"]
    here = {"data": str(data), "model": TINY_MODEL, "project": str(tmp_path), "name": "old"}
    ckpt["yoloaccum"]["config"] = {**ckpt["yoloaccum"]["config"], **here}
    run = tmp_path / "old"
    checkpoint.save_atomic(ckpt, run / "weights/last.pt")
    r = run_cli("train", f"resume={run / 'weights/last.pt'}", env=SERIAL, timeout=600)
    assert r.returncode == 0, r.stderr[-3000:]
    assert "resuming" in r.stdout and "epoch 3" in r.stdout
    assert relative_difference(final_weights(run), final_weights(uninterrupted)) == 0.0  # bitwise
    assert checkpoint.load(run / "weights/last.pt")["yoloaccum"]["format"] == state.FORMAT


@pytest.mark.numerics
def test_sigint_mid_epoch_saves_and_resumes_to_the_same_weights(data, uninterrupted, tmp_path, run_cli):
    """A SIGINT in the middle of epoch 2 stops at the end of its window and the resumed run ends bitwise where the
    uninterrupted one does. The run sends it to itself at iteration 8 (YOLOACCUM_FAULT), so it lands in a known
    window: one from outside lands wherever the scheduler lets it, and a micro-step of the tiny model is a few tens
    of milliseconds. Signals from outside: test_a_signal_after_the_epochs_last_window_stops_after_validation and
    test_a_second_sigint_stops_at_once_and_leaves_loadable_weights."""
    r = run_cli(
        "train",
        f"data={data}",
        *RUN,
        f"project={tmp_path}",
        "name=sig",
        env={**SERIAL, "YOLOACCUM_FAULT": "sigint@8"},
        timeout=600,
    )
    assert r.returncode == 130, r.stderr[-2000:]
    assert "resume with: yoloaccum train resume=" in r.stderr
    state = checkpoint.load(tmp_path / "sig/weights/last.pt")["yoloaccum"]
    assert state["interrupted"] and state["training"]["position"] == {
        "epoch": 1,
        "batch": 4,
    }  # the window of ni 8 ends at 9
    r = run_cli("train", f"resume={tmp_path / 'sig/weights/last.pt'}", env=SERIAL, timeout=600)
    assert r.returncode == 0, r.stderr[-3000:]
    assert relative_difference(final_weights(tmp_path / "sig"), final_weights(uninterrupted)) == 0.0


def test_sigterm_exits_143_with_a_resumable_checkpoint(data, tmp_path, run_cli):
    r = run_cli(
        "train",
        f"data={data}",
        *RUN,
        f"project={tmp_path}",
        "name=term",
        env={"YOLOACCUM_FAULT": "sigterm@8"},
        timeout=600,
    )
    assert r.returncode == 143, r.stderr[-2000:]
    state = checkpoint.load(tmp_path / "term/weights/last.pt")["yoloaccum"]
    assert state["interrupted"] and state["training"]["position"] == {
        "epoch": 1,
        "batch": 4,
    }  # the window of ni 8 ends at 9


def test_a_signal_after_the_epochs_last_window_stops_after_validation(data, tmp_path):
    """From outside, as a user's Ctrl-C. plots=True: the epoch's end (validation, its pictures, last.pt) then lasts
    seconds, the margin for the signal to land before epoch 2's first window ends."""
    cmd = [
        sys.executable,
        "-m",
        "yoloaccum",
        "train",
        f"data={data}",
        *RUN,
        "plots=True",
        f"project={tmp_path}",
        "name=val",
    ]
    proc = subprocess.Popen(cmd, cwd=REPO, env=offline_env(), stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    for line in proc.stdout:
        if line.startswith("epoch 1/4 6/6"):  # printed after the last window's step: its stop vote is past
            proc.send_signal(signal.SIGINT)
            break
    _, err = proc.communicate(timeout=300)
    assert proc.returncode == 130, err[-2000:]
    state = checkpoint.load(tmp_path / "val/weights/last.pt")["yoloaccum"]
    assert state["training"]["position"] == {"epoch": 1, "batch": 0}  # not a window into epoch 2


def test_a_second_sigint_stops_at_once_and_leaves_loadable_weights(data, tmp_path):
    cmd = [sys.executable, "-m", "yoloaccum", "train", f"data={data}", *RUN, f"project={tmp_path}", "name=twice"]
    proc = subprocess.Popen(cmd, cwd=REPO, env=offline_env(), stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    for line in proc.stdout:
        if line.startswith("epoch 2/4 1/6"):  # epoch 1's last.pt is on disk by now
            proc.send_signal(signal.SIGINT)
            proc.send_signal(signal.SIGINT)
            break
    proc.communicate(timeout=300)
    assert proc.returncode == 130
    checkpoint.load(tmp_path / "twice/weights/last.pt")


def test_a_second_sigint_before_anything_was_saved_leaves_no_run_folder(data, tmp_path, run_cli):
    """Both in the first window: the run sends them to itself at iterations 0 and 1 (warmup off, so that the window
    holds both). It stops at once with nothing saved, and args.yaml and an empty weights/ are no run to keep."""
    env = {"YOLOACCUM_FAULT": "sigint@0-"}
    r = run_cli("train", f"data={data}", *RUN, "warmup_epochs=0", f"project={tmp_path}", "name=twice", env=env)
    assert r.returncode == 130, r.stderr[-2000:]
    assert not (tmp_path / "twice").exists()


def test_ctrl_c_while_compiling_leaves_no_run_folder(data, tmp_path, monkeypatch):
    """compile= compiles before the first window, where a Ctrl-C is not yet a graceful stop: it ends the run at once
    (the CLI exits 130), and the folder it made goes with it. Compiling takes long on the CPU; a KeyboardInterrupt
    raised where it starts stands in for the Ctrl-C."""
    import yoloaccum
    from yoloaccum.model import compiler

    def interrupted(*args, **kwargs):
        raise KeyboardInterrupt

    monkeypatch.setattr(compiler, "for_run", interrupted)
    with pytest.raises(KeyboardInterrupt):
        yoloaccum.train(**config.parse_args(RUN), data=data, compile=True, project=tmp_path, name="compiling")
    assert not (tmp_path / "compiling").exists()


def test_resume_refuses_arguments_that_change_the_schedule(uninterrupted, cli_in_process):
    for arg in ("batch=8", "nbs=16", "lr0=0.1", "lr_scale=sqrt"):
        r = cli_in_process("train", f"resume={uninterrupted / 'weights/epoch2.pt'}", arg)
        assert r.returncode == 2 and "resume continues the run as planned" in r.stderr, r.stderr
        assert "only epochs= may change" in r.stderr and "Traceback" not in r.stderr
    r = cli_in_process("train", f"resume={uninterrupted / 'weights/epoch2.pt'}", "epochs=2")
    assert r.returncode == 2 and "has done 2 epochs; to continue it, give epochs greater than 2" in r.stderr


def test_resume_of_a_finished_run_without_epochs_is_a_clear_error(uninterrupted, cli_in_process):
    r = cli_in_process("train", f"resume={uninterrupted / 'weights/last.pt'}")
    assert r.returncode == 2 and "has finished (4 epochs); to train it further, give epochs=N" in r.stderr


def test_a_finished_run_trained_with_time_is_extended_with_epochs_and_time_none(
    uninterrupted, tmp_path, cli_in_process, run_cli
):
    """time= sets the epochs (re-estimated after each epoch), whatever epochs= says: the uninterrupted run, as a
    time= run ends, its config at epochs=100 with time=, its schedule at the 4 epochs the clock allowed. epochs=N
    alone, which the finished message once suggested, is refused with what to add (it ended in an IndexError, after
    rewriting args.yaml); with time=None the run goes on to N epochs."""
    run = shutil.copytree(uninterrupted, tmp_path / "timed")
    last, args = run / "weights/last.pt", (run / "args.yaml").read_text()
    ckpt = checkpoint.load(last)
    ckpt["yoloaccum"]["config"] = {**ckpt["yoloaccum"]["config"], "time": 1e-05, "epochs": 100}
    checkpoint.save_atomic(ckpt, last)
    r = cli_in_process("train", f"resume={last}", "epochs=6")
    assert r.returncode == 2 and "epochs=6 has no effect with time=1e-05" in r.stderr, r.stderr
    assert "add time=None" in r.stderr
    r = cli_in_process("train", f"resume={last}")
    assert r.returncode == 2 and "has finished (4 epochs in time=1e-05 hours)" in r.stderr, r.stderr
    assert f"e.g. resume={last} epochs=6 time=None" in " ".join(r.stderr.split())
    assert (run / "args.yaml").read_text() == args
    r = run_cli("train", f"resume={last}", "epochs=5", "time=None", env=SERIAL, timeout=600)
    assert r.returncode == 0, r.stderr[-3000:]
    state = checkpoint.load(last)["yoloaccum"]
    assert (state["finished"], state["schedule"]["epochs"], state["training"]["position"]["epoch"]) == (True, 5, 5)
    saved = yaml.safe_load((run / "args.yaml").read_text())
    assert (saved["epochs"], saved["time"]) == (5, None)


def test_best_pt_is_stripped_and_resume_points_to_last_pt(uninterrupted, cli_in_process):
    r = cli_in_process("train", f"resume={uninterrupted / 'weights/best.pt'}", "epochs=6")
    assert r.returncode == 2 and f"resume from {uninterrupted / 'weights/last.pt'}" in r.stderr, r.stderr


def test_the_training_state_is_versioned_an_older_format_converted_and_a_newer_one_refused(
    uninterrupted, tmp_path, cli_in_process
):
    path = uninterrupted / "weights/last.pt"
    ckpt = checkpoint.load(path)
    assert ckpt["yoloaccum"]["format"] == state.FORMAT
    old = checkpoint.load(REPO / "tests/fixtures/format4-epoch2.pt")  # format 4: each part's fields side by side
    before_versions = {k: v for k, v in old["yoloaccum"].items() if k not in ("format", "bn")}  # format 1: no version
    for entry in (old["yoloaccum"], before_versions):
        read = state.read({**old, "yoloaccum": entry}, path)
        assert read["format"] == state.FORMAT and read.keys() == ckpt["yoloaccum"].keys()
        assert read["training"]["position"] == {"epoch": 2, "batch": 0} and read["engine"]["skipped_in_a_row"] == 0
        assert read["ema"]["updates"] == old["updates"] and read["training"]["best_fitness"] == old["best_fitness"]
    newer = tmp_path / "run/weights/last.pt"
    checkpoint.save_atomic({**ckpt, "yoloaccum": {**ckpt["yoloaccum"], "format": state.FORMAT + 1}}, newer)
    r = cli_in_process("train", f"resume={newer}", "epochs=6")
    assert r.returncode == 2 and "Traceback" not in r.stderr
    assert f"holds a training state of format {state.FORMAT + 1}, newer than this yoloaccum reads" in r.stderr


def test_a_run_resumes_with_the_batchnorm_mode_it_trained_with_also_from_a_file_before_format_4(uninterrupted):
    """last.pt keeps the mode in force (bn=auto resolved), which the resumed run takes whatever bn=auto takes today:
    a run from weights that trained with bn=batch below 8 images per device (bn=auto's choice there for a while) goes
    on with it. An earlier file's mode is the one its bn=auto took, by micro-batch alone."""
    path = uninterrupted / "weights/last.pt"
    ckpt = checkpoint.load(path)
    saved = ckpt["yoloaccum"]
    s = saved["schedule"]
    micro = s["batch"] // s["world_size"]
    assert saved["config"]["bn"] == "auto" and micro < schedule.BN_AUTO_BELOW
    assert saved["bn"] == "window" and state.read(ckpt, path)["bn"] == "window"
    tuned = {**saved, "config": {**saved["config"], "model": "weights.pt"}, "bn": "batch"}
    assert config.Config(tuned["config"]).from_weights and schedule.bn_mode("auto", micro) == "window"
    assert state.read({**ckpt, "yoloaccum": tuned}, path)["bn"] == "batch"
    old = checkpoint.load(REPO / "tests/fixtures/format4-epoch2.pt")  # the same run's settings, in format 4
    before = {k: v for k, v in old["yoloaccum"].items() if k != "bn"}
    assert state.read({**old, "yoloaccum": {**before, "format": 3}}, path)["bn"] == "window"


def test_a_run_saved_before_a_key_existed_resumes_with_how_it_trained(uninterrupted, tmp_path):
    """mosaic_buffer=window is the default now; a last.pt written before the key resumes with the buffer it trained
    with (Ultralytics' sizing), not the new default, and giving the new default is refused as a change."""
    ckpt = checkpoint.load(uninterrupted / "weights/last.pt")
    saved = {k: v for k, v in ckpt["yoloaccum"]["config"].items() if k != "mosaic_buffer"}
    path = tmp_path / "old/weights/last.pt"
    checkpoint.save_atomic({**ckpt, "yoloaccum": {**ckpt["yoloaccum"], "config": saved}}, path)
    given = {"resume": str(path), "epochs": 6}
    cfg, _, _ = resume.load(config.resolve(overrides=given), given)
    assert cfg.mosaic_buffer == resume.BEFORE_THE_KEY["mosaic_buffer"] == "batch"
    with pytest.raises(UserError, match="mosaic_buffer=window differs from its mosaic_buffer=batch"):
        given = {**given, "mosaic_buffer": "window"}
        resume.load(config.resolve(overrides=given), given)


def test_a_bn_frozen_run_saved_with_a_precise_bn_count_resumes_without_the_recompute(uninterrupted, tmp_path):
    """bn=frozen now refuses precise_bn=N; a last.pt saved with both before that resumes, without the recompute (which
    wrote only the EMA's statistics), rather than meeting a refusal it cannot act on: precise_bn cannot change."""
    ckpt = checkpoint.load(uninterrupted / "weights/last.pt")
    saved = {**ckpt["yoloaccum"]["config"], "bn": "frozen", "precise_bn": 8}
    path = tmp_path / "old/weights/last.pt"
    checkpoint.save_atomic({**ckpt, "yoloaccum": {**ckpt["yoloaccum"], "config": saved, "bn": "frozen"}}, path)
    given = {"resume": str(path), "epochs": 6}
    cfg, _, _ = resume.load(config.resolve(overrides=given), given)
    assert (cfg.bn, cfg.precise_bn) == ("frozen", 0)
    schedule.check_precise_bn(cfg)
    with pytest.raises(UserError, match="precise_bn=8 would recompute"):
        schedule.check_precise_bn(config.Config(saved))


def test_resume_with_more_epochs_continues_a_finished_run(uninterrupted, tmp_path, run_cli):
    run = shutil.copytree(uninterrupted, tmp_path / "longer")
    r = run_cli("train", f"resume={run / 'weights/last.pt'}", "epochs=5", env=SERIAL, timeout=600)
    assert r.returncode == 0, r.stderr[-3000:]
    first = r.stdout.splitlines()[0]
    assert first.startswith("continuing the run to 5 epochs (planned 4, 4 done): the lr schedule is rebuilt for 5"), (
        first
    )
    assert (
        "close_mosaic=1 now turns mosaic off from epoch 5 of 5" in first
        and "warmup (1 epochs) is already done" in first
    )
    rows = (run / "results.csv").read_text().splitlines()
    assert len(rows) == 1 + 5 and rows[1:5] == (uninterrupted / "results.csv").read_text().splitlines()[1:]
    assert relative_difference(final_weights(run), final_weights(uninterrupted)) > 0  # it trained on
    steps = (run / "schedule.csv").read_text().splitlines()
    last_epoch = [line.split(",") for line in steps[1:] if line.split(",")[1] == "5"]
    header = steps[0].split(",")
    lr = float(last_epoch[0][header.index("lr/pg0")])
    state = checkpoint.load(run / "weights/last.pt")["yoloaccum"]
    s = state["schedule"]
    assert (state["config"]["epochs"], s["epochs"], state["finished"]) == (5, 5, True)
    # epoch 5 of 5 (index 4): the linear decay of the 5-epoch schedule, lr0 x ((1 - 4/5)(1 - lrf) + lrf)
    assert lr == pytest.approx(s["lr0"] * ((1 - 4 / 5) * (1 - s["lrf"]) + s["lrf"]), rel=1e-5)
    assert "epochs: 5" in (run / "args.yaml").read_text()


def test_resume_true_picks_the_newest_run(uninterrupted, tmp_path, run_cli):
    project = tmp_path / "runs"
    older, newer = (shutil.copytree(uninterrupted, project / name) for name in ("a", "b"))
    for run in (older, newer):
        shutil.copy(run / "weights/epoch2.pt", run / "weights/last.pt")
    os.utime(older / "weights/last.pt", (time.time() - 100, time.time() - 100))
    # Stopped in its first window (epoch 3 of 4, 6 iterations an epoch, 2 per window): which run it took is all this
    # asks, and that its stop was saved there.
    r = run_cli("train", "resume=True", f"project={project}", env={"YOLOACCUM_FAULT": "sigint@12"}, timeout=600)
    assert r.returncode == 130, r.stderr[-2000:]
    assert f"resuming {newer}" in r.stdout.replace("\n", "")
    assert checkpoint.load(newer / "weights/last.pt")["yoloaccum"]["training"]["position"] == {"epoch": 2, "batch": 2}


def test_a_non_finite_window_is_skipped_and_counted(data, tmp_path, run_cli):
    r = run_cli(
        "train",
        f"data={data}",
        *RUN,
        "epochs=1",
        f"project={tmp_path}",
        "name=nan",
        env={"YOLOACCUM_FAULT": "nan@2"},
        timeout=600,
    )
    assert r.returncode == 0, r.stderr[-2000:]
    # One epoch, so no warmup: windows of 2 micro-batches; the one holding ni=2 ends at ni=3.
    assert "iteration 3: non-finite loss, window skipped (1 so far)" in r.stdout  # a NaN input: the loss says it
    state = checkpoint.load(tmp_path / "nan/weights/last.pt")["yoloaccum"]
    assert state["engine"]["skipped_windows"] == [3]
    header, row = (line.split(",") for line in (tmp_path / "nan/results.csv").read_text().splitlines())
    train_losses = [float(v) for k, v in zip(header, row) if k.startswith("train/")]
    assert len(train_losses) == 3 and all(map(math.isfinite, train_losses))  # the skipped window is not averaged in
    assert all(torch.isfinite(v).all() for v in state["model"].values() if v.is_floating_point())


def test_nan_patience_stops_the_run_with_the_last_good_state(data, tmp_path, run_cli):
    r = run_cli(
        "train",
        f"data={data}",
        *RUN,
        "nan_patience=2",
        f"project={tmp_path}",
        "name=diverged",
        env={"YOLOACCUM_FAULT": "nan@7-"},
        timeout=600,
    )
    assert r.returncode == 3  # not 2, a usage error: the recipe was valid, the run diverged
    lines = r.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("error: training diverged: 2 windows in a row"), r.stderr
    state = checkpoint.load(tmp_path / "diverged/weights/last.pt")["yoloaccum"]
    assert state["engine"]["skipped_windows"] == [7, 9]  # windows of 2 micro-batches end at odd ni after warmup
    assert all(torch.isfinite(v).all() for v in state["model"].values() if v.is_floating_point())


def test_checkpoints_follow_the_umask_as_ultralytics_files_do(tmp_path):
    """mkstemp creates 0600 files; a checkpoint must be readable as any file this process writes (0644 typically)."""
    mask = os.umask(0o022)
    os.umask(mask)
    checkpoint.write_bytes_atomic(b"weights", tmp_path / "w.pt")
    (tmp_path / "plain").write_bytes(b"x")
    assert (tmp_path / "w.pt").stat().st_mode & 0o777 == (tmp_path / "plain").stat().st_mode & 0o777 == 0o666 & ~mask


def test_kill_during_checkpoint_writes_never_leaves_a_truncated_file(tmp_path):
    """A process rewrites last.pt in a loop and is killed with SIGKILL at random moments; last.pt always loads."""
    script = (
        "import sys, torch\n"
        "from yoloaccum.model.checkpoint import save_atomic\n"
        "from pathlib import Path\n"
        "state = {'weights': torch.randn(4_000_000), 'epoch': 0}\n"
        "while True:\n"
        "    state['epoch'] += 1\n"
        "    save_atomic(state, Path(sys.argv[1]))\n"
    )
    target = tmp_path / "last.pt"
    for delay in (0.35, 0.5, 0.8, 1.1, 1.4):
        proc = subprocess.Popen([sys.executable, "-c", script, str(target)], cwd=REPO, env=offline_env())
        deadline = time.monotonic() + 60
        while not target.exists() and time.monotonic() < deadline:
            time.sleep(0.05)
        time.sleep(delay)
        proc.send_signal(signal.SIGKILL)
        proc.wait()
        ckpt = torch.load(target, weights_only=True)
        assert ckpt["weights"].numel() == 4_000_000 and ckpt["epoch"] >= 1
    # A killed writer may leave the temporary file it was writing, one at most per kill; a successful write leaves none
    assert len(list(tmp_path.glob(".last.pt.*.tmp"))) <= 5


@pytest.mark.slow
def test_a_full_disk_stops_the_run_and_keeps_the_previous_last_pt(data, tmp_path, run_cli):
    """From iteration 8 (epoch 2) every write into the run folder fails halfway with ENOSPC. The first is epoch 2's
    rows of schedule.csv: one line, epoch 1's last.pt stays and resumes, and the logs keep every whole row."""
    r = run_cli(
        "train",
        f"data={data}",
        *RUN,
        "epochs=2",
        f"project={tmp_path}",
        "name=full",
        env={"YOLOACCUM_FAULT": "enospc@8"},
        timeout=600,
    )
    assert r.returncode == 2, r.stderr[-2000:]
    run, lines = tmp_path / "full", r.stderr.strip().splitlines()
    assert len(lines) == 1 and f"writing {run / 'schedule.csv'} failed: No space left on device" in lines[0]
    assert f"{run / 'weights/last.pt'} holds the last saved epoch" in lines[0] and "resume with: " in lines[0]
    weights = run / "weights"
    assert checkpoint.load(weights / "last.pt")["epoch"] == 0  # epoch 1's
    assert not list(weights.glob(".*.tmp"))
    r = run_cli("train", f"resume={weights / 'last.pt'}", timeout=600)
    assert r.returncode == 0, r.stderr[-2000:]
    assert checkpoint.load(weights / "last.pt")["epoch"] == 1
    steps = (run / "schedule.csv").read_text().splitlines()
    assert [int(row.split(",")[0]) for row in steps[1:]] == sorted({int(row.split(",")[0]) for row in steps[1:]})
    assert len((run / "results.csv").read_text().splitlines()) == 3  # the header and both epochs, once each


def test_a_full_disk_under_any_log_of_the_run_folder_is_one_line(tmp_path):
    """results.csv (and schedule.csv, args.yaml: the same writer) on a full disk: one line that says what is kept,
    and the rows already written stay."""
    from yoloaccum.training.progress import Results

    results = Results(tmp_path)
    results.append({"epoch": 1, "loss": 0.5, "mAP": 0.25})
    faults.fail_writes(errno.ENOSPC)
    try:
        with pytest.raises(UserError, match=r"results.csv failed: No space left on device; no last.pt was written"):
            results.append({"epoch": 2, "loss": 0.123457, "mAP": 0.375})  # half written: "2,0.12345"
    finally:
        faults.writes_work_again()
    results.truncate(2)  # a resumed run's, at epoch 2: the cut row goes (too few fields), the whole ones stay
    assert (tmp_path / "results.csv").read_text().splitlines() == ["epoch,loss,mAP", "1,0.5,0.25"]
    with (
        pytest.raises(
            UserError,
            match=r"schedule.png failed: Input/output error; training had finished, and its "
            "weights in .* are complete",
        ),
        checkpoint.disk_errors(tmp_path / "schedule.png", trained=True),
    ):
        raise OSError(errno.EIO, os.strerror(errno.EIO))


def test_a_failing_disk_leaves_the_old_file_and_no_temporary_one(tmp_path):
    target = tmp_path / "last.pt"
    checkpoint.save_atomic({"epoch": 1}, target)
    faults.fail_writes(errno.EIO)
    try:
        with pytest.raises(UserError, match="Input/output error; the previous last.pt is intact"):
            checkpoint.save_atomic({"epoch": 2}, target)
    finally:
        faults.writes_work_again()
    assert torch.load(target, weights_only=True) == {"epoch": 1}
    assert [p.name for p in tmp_path.iterdir()] == ["last.pt"]


@pytest.mark.numerics
@pytest.mark.slow
def test_remainder_carry_keeps_a_window_left_open_at_a_stop(data, tmp_path, run_cli):
    """With remainder=carry a window spans epochs 2 and 3 (ni 11 to 14); a SIGINT at ni 11 stops at epoch 2's end,
    after validation, and last.pt keeps the open window's gradients and counts: the resumed run ends bitwise equal."""
    carry = (f"data={data}", *RUN, "nbs=16", "epochs=3", "remainder=carry", f"project={tmp_path}")
    full = run_cli("train", *carry, "name=full", env=SERIAL, timeout=600)
    assert full.returncode == 0, full.stderr[-2000:]
    r = run_cli("train", *carry, "name=sig", env={**SERIAL, "YOLOACCUM_FAULT": "sigint@11"}, timeout=600)
    assert r.returncode == 130, r.stderr[-2000:]
    state = checkpoint.load(tmp_path / "sig/weights/last.pt")["yoloaccum"]
    assert state["training"]["position"] == {"epoch": 2, "batch": 0}
    assert state["ranks"][0]["engine"]["open_window"]["micro_batches"] == 1
    r = run_cli("train", f"resume={tmp_path / 'sig/weights/last.pt'}", env=SERIAL, timeout=600)
    assert r.returncode == 0, r.stderr[-2000:]
    assert relative_difference(final_weights(tmp_path / "sig"), final_weights(tmp_path / "full")) == 0.0
