"""The fork server behind `run_cli` (tests/cli_server.py): a child forked from it is what a fresh `python -m
yoloaccum` would be, so the end-to-end tests that run through it prove what they would prove in fresh interpreters.

With YOLOACCUM_TESTS_FORK=0 every run_cli call is a fresh interpreter: the whole suite can be run that way too."""

import os
import subprocess
from pathlib import Path

import pytest
import torch
from conftest import PLUMBING, SERIAL, _fork_server, final_weights, offline_env, run_fresh, shapes_yaml

pytestmark = pytest.mark.skipif(os.environ.get("YOLOACCUM_TESTS_FORK") == "0", reason="the fork server is off")

RUN = (*PLUMBING, "imgsz=64", "batch=4", "nbs=8", "epochs=2", "workers=0", "warmup_epochs=1", "exist_ok=True")


def test_a_forked_run_ends_where_a_fresh_interpreter_does(tmp_path: Path, run_cli):
    """The same training run, forked and fresh: the same exit code, the same weights bit for bit, the same
    results.csv columns and the same first lines (the settings the run resolved and prints)."""
    if not _fork_server().forks(offline_env(SERIAL)):  # one thread is the test processes' setting under make test
        pytest.skip("OMP_NUM_THREADS=1 is not this process' setting: that run would not be forked")
    data_yaml = shapes_yaml(tmp_path, num_train=12, num_val=4)
    common = (f"data={data_yaml}", f"project={tmp_path}", *RUN)
    forked = run_cli("train", *common, "name=forked", env=SERIAL)
    new = run_fresh("train", *common, "name=fresh", env=SERIAL, timeout=300)
    assert forked.returncode == new.returncode == 0, forked.stderr[-2000:] + new.stderr[-2000:]
    assert torch.equal(final_weights(tmp_path / "forked"), final_weights(tmp_path / "fresh"))
    head = [(tmp_path / f"{name}/results.csv").read_text().splitlines()[0] for name in ("forked", "fresh")]
    assert head[0] == head[1]
    first = [
        r.stdout.replace(str(tmp_path / name), "RUN").splitlines()[:3]
        for r, name in ((forked, "forked"), (new, "fresh"))
    ]
    assert first[0] == first[1]


def test_a_user_error_exits_2_with_its_one_line_as_a_fresh_interpreter_does(run_cli):
    forked, new = run_cli("train", "nbs=abc"), run_fresh("train", "nbs=abc")
    assert forked.returncode == new.returncode == 2
    assert forked.stderr == new.stderr and forked.stderr.count("\n") == 1, forked.stderr


def test_what_a_fresh_interpreter_reads_while_importing_is_not_forked():
    """TORCH_LOGS and CXX are read when torch is imported: a request that sets them gets a fresh interpreter. A
    fault to inject is read while the run runs: that request is forked."""
    server = _fork_server()
    assert not server.forks(offline_env({"TORCH_LOGS": "recompiles"}))
    assert not server.forks(offline_env({"CXX": "/no/such/compiler"}))
    assert not server.differences(offline_env({"YOLOACCUM_FAULT": "sigint@3"}))


def test_a_variable_this_process_sets_for_good_starts_the_server_again(monkeypatch):
    """Inductor, for one, sets TORCHINDUCTOR_CACHE_DIR in the process that first compiles: the runs this process
    starts from then on carry it, and a new server, started with it, forks them."""
    before = _fork_server()
    monkeypatch.setenv("TORCHINDUCTOR_CACHE_DIR", "/tmp/torchinductor_set_by_a_test")
    after = _fork_server()
    assert after is not before and before.proc.poll() is not None
    assert after.forks(offline_env({"YOLOACCUM_FAULT": "sigint@3"}))


def test_a_run_past_its_timeout_is_killed_and_says_so(tmp_path: Path, run_cli):
    data_yaml = shapes_yaml(tmp_path, num_train=12, num_val=4)
    with pytest.raises(subprocess.TimeoutExpired):
        run_cli("train", f"data={data_yaml}", f"project={tmp_path}", "name=slow", *RUN, timeout=0.5)
    assert run_cli("plan", "images=100", "batch=8").returncode == 0  # the server goes on


def test_a_server_that_has_ended_is_started_again(run_cli):
    server = _fork_server()
    server.proc.kill()
    server.proc.wait()
    assert _fork_server() is not server
    assert run_cli("plan", "images=100", "batch=8").returncode == 0
