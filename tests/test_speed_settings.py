"""The settings that make training fast, checked here so that no change undoes them silently (the speed itself is
measured by `make bench`, never by tests)."""

import os
import subprocess
import sys

import torch
from conftest import offline_env

from yoloaccum.runs import seed_everything

THREADS = "import os, torch; print(os.environ.get('OMP_NUM_THREADS'), torch.get_num_threads())"


def python(code: str, env: dict[str, str]) -> str:
    return subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, check=True).stdout


def test_importing_yoloaccum_keeps_torchs_thread_count():
    """Ultralytics sets OMP_NUM_THREADS=1 when imported; the process and its children must not inherit it."""
    env = {k: v for k, v in offline_env().items() if k != "OMP_NUM_THREADS"}
    plain = python(THREADS, env).split()
    after = python("import yoloaccum.ultra; " + THREADS, env).split()
    assert plain[0] == after[0] == "None"
    assert after[1] == plain[1]


def test_a_users_thread_setting_is_kept():
    env = {**offline_env(), "OMP_NUM_THREADS": "1"}
    assert python("import yoloaccum.ultra; " + THREADS, env).split() == ["1", "1"]


def test_deterministic_mode_does_not_fill_new_tensors():
    before = torch.utils.deterministic.fill_uninitialized_memory, torch.are_deterministic_algorithms_enabled()
    try:
        seed_everything(0, deterministic=True)
        assert torch.are_deterministic_algorithms_enabled()
        assert not torch.utils.deterministic.fill_uninitialized_memory
    finally:
        torch.utils.deterministic.fill_uninitialized_memory = before[0]
        torch.use_deterministic_algorithms(before[1])
        os.environ.pop("CUBLAS_WORKSPACE_CONFIG", None)
