"""The settings that make training fast, checked here so that no change undoes them silently (the speed itself is
measured by `make bench`, never by tests)."""

import os
import platform
import subprocess
import sys

import pytest
import torch
from conftest import offline_env

from yoloaccum.runs import seed_everything

THREADS = "import os, torch; print(os.environ.get('OMP_NUM_THREADS'), torch.get_num_threads())"


def python(code: str, env: dict[str, str], *args: str) -> str:
    cmd = [sys.executable, "-c", code, *args]
    return subprocess.run(cmd, env=env, capture_output=True, text=True, check=True).stdout


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


def test_loader_workers_deliver_channels_last_images_on_the_cpu(tmp_path):
    """Without CUDA the workers lay the images out as the model runs, so the training process does not copy them
    again (with CUDA the GPU does it); the pixels are the same either way."""
    from conftest import shapes_yaml

    from yoloaccum import config, data

    spec = data.load_spec(shapes_yaml(tmp_path, num_train=8, num_val=2))
    images = {}
    for channels_last in (True, False):
        cfg = config.resolve(overrides=dict(data=str(spec.yaml_file), imgsz=64, batch=4, workers=1, seed=0,
                                            channels_last=channels_last))  # fmt: skip
        loader = data.build_loader(data.build_dataset(cfg, spec, "train"), cfg, 4, 0, 1, True)
        images[channels_last] = next(iter(loader))["img"]
    in_workers = not torch.cuda.is_available()
    assert images[True].is_contiguous(memory_format=torch.channels_last) == in_workers
    assert images[False].is_contiguous() and not images[False].is_contiguous(memory_format=torch.channels_last)
    assert torch.equal(images[True], images[False])


@pytest.mark.parametrize("name", ["SGD", "AdamW", "Adam"])
def test_fused_optimizers_step_as_torchs_reference_implementation(name):
    """build_optimizer picks torch's fused kernels; two steps with each group's own lr and weight decay land where the
    per-tensor implementation lands (to rounding: the fused kernel orders the arithmetic differently)."""
    from ultralytics.nn.tasks import DetectionModel

    from yoloaccum import config, optim, schedule

    cfg = config.resolve(overrides=dict(batch=8, nbs=64, optimizer=name, lr0=0.01, weight_decay=0.05))
    s = schedule.build(cfg, num_images=64, nc=3)
    models = [DetectionModel("yolo11n.yaml", nc=3, verbose=False) for _ in range(2)]
    models[1].load_state_dict(models[0].state_dict())
    before = [p.detach().clone() for p in models[0].parameters()]
    fused = optim.build_optimizer(models[0], s)
    reference = optim.build_optimizer(models[1], s)
    for group in reference.param_groups:
        group["fused"] = False
    assert all(g["fused"] for g in fused.param_groups)
    torch.manual_seed(0)
    for step in range(2):
        grads = [torch.randn_like(p) for p in models[0].parameters()]
        for model, optimizer in zip(models, (fused, reference)):
            for p, g in zip(model.parameters(), grads):
                p.grad = g.clone()
            optim.set_hyperparameters(optimizer, s, ni=step)
            optimizer.step()
    for a, b in zip(models[0].parameters(), models[1].parameters()):
        torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-7)
    trained = [not torch.equal(a, b) for a, b in zip(models[0].parameters(), before) if a.requires_grad]
    assert all(trained) and len(trained) > 200  # every trainable tensor stepped


def test_objects_built_before_training_are_hidden_from_the_garbage_collector_until_it_ends():
    import gc

    from yoloaccum.trainer import frozen_heap

    assert gc.get_freeze_count() == 0
    with frozen_heap():
        assert gc.get_freeze_count() > 10_000  # this test process's modules alone
    assert gc.get_freeze_count() == 0


def test_a_heap_frozen_by_the_caller_stays_frozen():
    import gc

    from yoloaccum.trainer import frozen_heap

    gc.freeze()
    try:
        frozen = gc.get_freeze_count()
        with frozen_heap():
            pass
        assert gc.get_freeze_count() == frozen
    finally:
        gc.unfreeze()


FAULTS = """
import resource, sys, torch
from yoloaccum.runs import keep_freed_memory
applied = keep_freed_memory() if sys.argv[1] == "keep" else None
def micro_batch():  # as a micro-batch's activations: 12 tensors of 4 MB, written, then all freed together
    return sum(float(t.sum()) for t in [torch.ones(2**20) for _ in range(12)])
micro_batch()  # the first one faults its pages in whatever the setting
before = resource.getrusage(resource.RUSAGE_SELF).ru_minflt
for _ in range(10):
    micro_batch()
print(applied, resource.getrusage(resource.RUSAGE_SELF).ru_minflt - before)
"""


@pytest.mark.skipif(platform.libc_ver()[0] != "glibc", reason="a glibc setting")
def test_freed_tensor_memory_is_reused_without_page_faults():
    """After keep_freed_memory, the memory one micro-batch frees serves the next without faulting its pages in again.
    By default glibc trims the heap when the 48 MB are freed, and each micro-batch faults pages in again."""
    env = {k: v for k, v in offline_env().items() if not k.startswith(("MALLOC_", "GLIBC_TUNABLES"))}
    applied, kept = python(FAULTS, env, "keep").split()
    _, default = python(FAULTS, env, "default").split()
    assert applied == "True"
    assert 10 * int(kept) < int(default), (kept, default)  # measured: 0 to 1,024 against 122,549
