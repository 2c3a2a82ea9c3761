"""The settings that make training fast, checked here so that no change undoes them silently (the speed itself is
measured by `make bench`, never by tests)."""

import os
import platform
import subprocess
import sys

import pytest
import torch
from conftest import offline_env

from yoloaccum.process.rng import seed_everything

THREADS = "import os, torch; print(os.environ.get('OMP_NUM_THREADS'), torch.get_num_threads())"


def python(code: str, env: dict[str, str], *args: str) -> str:
    cmd = [sys.executable, "-c", code, *args]
    return subprocess.run(cmd, env=env, capture_output=True, text=True, check=True).stdout


def test_importing_yoloaccum_keeps_torchs_thread_count():
    """Ultralytics sets OMP_NUM_THREADS=1 when imported; the process and its children must not inherit it."""
    env = {k: v for k, v in offline_env().items() if k != "OMP_NUM_THREADS"}
    plain = python(THREADS, env).split()
    after = python("import yoloaccum.config.ultra; " + THREADS, env).split()
    assert plain[0] == after[0] == "None"
    assert after[1] == plain[1]


def test_a_users_thread_setting_is_kept():
    env = {**offline_env(), "OMP_NUM_THREADS": "1"}
    assert python("import yoloaccum.config.ultra; " + THREADS, env).split() == ["1", "1"]


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


@pytest.mark.parametrize("name", ["yolo26n.yaml", "yolo11n.yaml"])
def test_a_channels_last_model_takes_nchw_images_with_identical_results(name):
    """The trainer feeds the loader's NCHW images to its channels-last model unconverted (micro_batch.model_input): the
    first convolution lays them out itself. Loss and every gradient are the same, bit for bit."""
    from ultralytics.nn.tasks import DetectionModel

    from yoloaccum.config import settings as config
    from yoloaccum.config.ultra import ultralytics_args
    from yoloaccum.core.loss import WindowLoss
    from yoloaccum.core.micro_batch import model_input

    torch.manual_seed(0)
    model = DetectionModel(name, nc=4, verbose=False).to(memory_format=torch.channels_last)
    model.args = ultralytics_args(config.resolve(overrides=dict(imgsz=64)))
    criterion = WindowLoss(model, "window")
    images = torch.randint(0, 256, (4, 3, 64, 64), dtype=torch.uint8)
    batch = {
        "batch_idx": torch.tensor([0.0, 1, 2, 3]),
        "cls": torch.tensor([[0.0], [1], [2], [3]]),
        "bboxes": torch.tensor([[0.5, 0.5, 0.3, 0.4]]).repeat(4, 1),
    }
    results = []
    for layout in (torch.contiguous_format, torch.channels_last):
        model.zero_grad(set_to_none=True)
        x = model_input(images.contiguous(memory_format=layout), torch.device("cpu"))
        loss = criterion(model(x), {**batch, "img": x})[0]
        loss.backward()
        results.append([loss.detach()] + [p.grad for p in model.parameters() if p.grad is not None])
    assert images.is_contiguous() and len(results[0]) > 200
    assert all(torch.equal(a, b) for a, b in zip(*results))


def test_loaders_use_workers_on_cuda_only():
    from yoloaccum.data.batches import loader_workers

    assert loader_workers(8, torch.device("cpu")) == 0
    assert loader_workers(2, torch.device("cuda", 0)) == min(2, os.cpu_count())
    assert loader_workers(10_000, torch.device("cuda", 0)) == os.cpu_count()


def test_workers_share_the_machine_among_its_ranks(monkeypatch):
    """As Ultralytics' cpu_count // devices: each of the machine's ranks takes its share of the cores at most."""
    from yoloaccum.data.batches import loader_workers

    monkeypatch.setenv("LOCAL_WORLD_SIZE", "2")
    assert loader_workers(10_000, torch.device("cuda", 0)) == os.cpu_count() // 2
    assert loader_workers(1, torch.device("cuda", 0)) == 1


def test_objects_built_before_training_are_hidden_from_the_garbage_collector_until_it_ends():
    import gc

    from yoloaccum.process.memory import frozen_heap

    assert gc.get_freeze_count() == 0
    with frozen_heap():
        assert gc.get_freeze_count() > 10_000  # this test process's modules alone
    assert gc.get_freeze_count() == 0


def test_a_heap_frozen_again_inside_freezes_what_was_built_since_and_the_outermost_unfreezes():
    """The run freezes the modules before building its parts, the training loop what was built since."""
    import gc

    from yoloaccum.process.memory import frozen_heap

    with frozen_heap():
        before = gc.get_freeze_count()
        built = [[i] for i in range(1000)]  # lists are tracked by the collector
        with frozen_heap():
            assert gc.get_freeze_count() >= before + len(built)
        assert gc.get_freeze_count() >= before + len(built)  # the inner one leaves them frozen
    assert gc.get_freeze_count() == 0


def test_a_later_run_collects_what_the_run_before_left_before_it_freezes():
    """A notebook's second train(): the first run's trainer is garbage in reference cycles, to be freed, not frozen
    into the second run."""
    import weakref

    from yoloaccum.process.memory import frozen_heap

    class Trainer:
        pass

    with frozen_heap():
        first = Trainer()
        first.itself = first  # a reference cycle, as a trainer and its steps make
    gone = weakref.ref(first)
    del first
    with frozen_heap():
        assert gone() is None


def test_the_command_line_leaves_its_objects_to_the_os_at_exit():
    """The CLI's last exit handler freezes the heap, so the interpreter's teardown walks none of it (a handler
    registered before the CLI starts runs after it, and sees it frozen)."""
    script = (
        "import atexit, gc, sys\n"
        "atexit.register(lambda: print('frozen at exit:', gc.get_freeze_count() > 0))\n"
        "from yoloaccum import cli\n"
        "sys.argv = ['yoloaccum', '--version']\n"
        "cli.run()\n"
    )
    done = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr
    assert "frozen at exit: True" in done.stdout


def test_a_heap_frozen_by_the_caller_stays_frozen():
    import gc

    from yoloaccum.process.memory import frozen_heap

    gc.freeze()
    try:
        frozen = gc.get_freeze_count()
        with frozen_heap():
            pass
        assert gc.get_freeze_count() == frozen
    finally:
        gc.unfreeze()


MALLOC = """
import ctypes, resource, sys, torch
from yoloaccum.process.memory import keep_freed_memory
class MallInfo2(ctypes.Structure):
    _fields_ = [(n, ctypes.c_size_t) for n in ("arena", "ordblks", "smblks", "hblks", "hblkhd", "usmblks", "fsmblks",
                                               "uordblks", "fordblks", "keepcost")]
libc = ctypes.CDLL(None)
libc.mallinfo2.restype = MallInfo2
applied = keep_freed_memory() if sys.argv[1] == "keep" else None
def activations():  # as a micro-batch's: 12 tensors of 4 MB, written
    return [torch.ones(2**20) for _ in range(12)]
before = libc.mallinfo2()
tensors = activations()
mapped = libc.mallinfo2().hblkhd - before.hblkhd  # bytes served by mmap of their own, unmapped again when freed
del tensors
heap = libc.mallinfo2().arena - before.arena  # bytes the heap kept after they were all freed
faults = resource.getrusage(resource.RUSAGE_SELF).ru_minflt
for _ in range(10):
    sum(float(t.sum()) for t in activations())
faults = resource.getrusage(resource.RUSAGE_SELF).ru_minflt - faults
print(applied, mapped >> 20, heap >> 20, faults)
"""


@pytest.mark.skipif(platform.libc_ver()[0] != "glibc", reason="a glibc setting")
def test_freed_tensor_memory_stays_in_the_heap_for_the_next_micro_batch():
    """After keep_freed_memory, a micro-batch's tensors come from the heap, which keeps their memory when they are
    freed, so the next micro-batch reuses it without faulting its pages in again. By default glibc serves each
    large tensor with a fresh mmap (or, once it has adapted its threshold, trims the heap), and returns it."""
    env = {k: v for k, v in offline_env().items() if not k.startswith(("MALLOC_", "GLIBC_TUNABLES"))}
    applied, mapped, heap, faults = python(MALLOC, env, "keep").split()
    _, mapped_default, _, _ = python(MALLOC, env, "default").split()
    assert applied == "True"
    assert int(mapped_default) >= 40 and int(mapped) == 0  # MB, of the 48 (the heap may already hold a little)
    assert int(heap) >= 40
    # 10 micro-batches write 480 MB, 122,880 pages; they fault in a few (measured 0 to 3,072), not all of them
    assert int(faults) < 12_288, faults


@pytest.mark.parametrize("name", ["SGD", "Adam", "Adamax", "AdamW", "RMSprop"])
def test_foreach_optimizer_steps_equal_the_per_tensor_loop_bit_for_bit(name):
    """These optimizers update all tensors per operation (foreach); torch's per-tensor loop, its CPU default, must give
    the same weights exactly, over steps whose lr and momentum change as the schedule's do. (NAdam and RAdam keep
    torch's default: their foreach versions round differently.)"""
    from ultralytics.nn.tasks import DetectionModel

    from yoloaccum.config import settings as config
    from yoloaccum.core import optim, schedule

    s = schedule.build(config.resolve(overrides=dict(optimizer=name, warmup_epochs=1, epochs=2)), num_images=256)
    torch.manual_seed(0)
    models = [DetectionModel("yolo11n.yaml", nc=3, verbose=False) for _ in range(2)]
    models[1].load_state_dict(models[0].state_dict())
    optimizers = [optim.build_optimizer(m, s) for m in models]
    assert all(g["foreach"] for g in optimizers[0].param_groups)
    for g in optimizers[1].param_groups:
        g["foreach"] = False
    for ni in (0, 5, 40):
        grads = [torch.randn_like(p) for p in models[0].parameters()]
        for model, optimizer in zip(models, optimizers):
            for p, grad in zip(model.parameters(), grads):
                p.grad = grad.clone()
            optim.set_hyperparameters(optimizer, s, ni)
            optimizer.step()
    assert all(torch.equal(a, b) for a, b in zip(models[0].parameters(), models[1].parameters()))


def test_foreach_clipping_gives_the_same_norm_and_gradients_bit_for_bit():
    torch.manual_seed(0)
    params = [torch.nn.Parameter(torch.randn(*shape)) for shape in ((64, 3, 3, 3), (64,), (128, 64, 1, 1), (7,))]
    grads = [torch.randn_like(p) * 10 for p in params]
    results = []
    for foreach in (False, True):
        for p, grad in zip(params, grads):
            p.grad = grad.clone()
        norm = torch.nn.utils.clip_grad_norm_(params, max_norm=1.0, foreach=foreach)
        results.append((norm, [p.grad.clone() for p in params]))
    (norm_loop, grads_loop), (norm_foreach, grads_foreach) = results
    assert norm_loop > 1.0 and torch.equal(norm_loop, norm_foreach)  # it did clip
    assert all(torch.equal(a, b) for a, b in zip(grads_loop, grads_foreach))
