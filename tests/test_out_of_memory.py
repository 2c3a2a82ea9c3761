"""Running out of device memory where the CPU cannot: the errors CUDA raises, injected into the real Engine and the real
Evaluator. The back-off itself is tests/test_backoff.py's; here, which errors reach it, and what happens where it
cannot help (the optimizer step, the EMA update, SyncBatchNorm under DDP) or where validation runs out."""

import pytest
import torch
from conftest import shapes_yaml
from test_backoff import bn_model
from test_engine import make_engine, toy_batches
from torch import nn

from yoloaccum.core import backoff
from yoloaccum.distributed import ddp as distributed
from yoloaccum.errors import UserError


class FullDevice(nn.Module):
    """`model` on a device that holds `fits` images at a time: a larger input raises `error` (once, or always)."""

    def __init__(self, model: nn.Module, fits: int, error: Exception, once: bool = True):
        super().__init__()
        self.model, self.fits, self.error, self.once = model, fits, error, once

    def forward(self, x):
        if x.shape[0] > self.fits and self.error is not None:
            error = self.error
            if self.once:
                self.error = None
            raise error
        return self.model(x)


CUDA_ALLOCATION_ERRORS = [
    torch.OutOfMemoryError("CUDA out of memory. Tried to allocate 20.00 MiB"),
    RuntimeError("CUDA error: CUBLAS_STATUS_ALLOC_FAILED when calling `cublasCreate(handle)`"),
    RuntimeError("cuDNN error: CUDNN_STATUS_INTERNAL_ERROR"),
    RuntimeError("cuDNN error: CUDNN_STATUS_ALLOC_FAILED"),
    RuntimeError("GET was unable to find an engine to execute this computation"),
]


@pytest.mark.parametrize("error", CUDA_ALLOCATION_ERRORS, ids=lambda e: str(e).split()[2][:24])
def test_each_cuda_allocation_error_backs_off_to_the_run_at_half_the_micro_batch(error):
    """cuBLAS and cuDNN report a full device with their own texts; today only torch.OutOfMemoryError backed off."""
    inner = bn_model()
    backed_off = make_engine(FullDevice(inner, fits=4, error=error), num_images=32, batch=8, nbs=32)
    halved = make_engine(bn_model(), num_images=32, batch=4, nbs=32)
    backed_off.train_epoch(0, toy_batches(32, 8))
    halved.train_epoch(0, toy_batches(32, 4))
    assert backed_off.back_offs == [0] and backed_off.split == 2
    for a, b in zip(inner.state_dict().values(), halved.raw_model.state_dict().values()):
        torch.testing.assert_close(a, b, rtol=0, atol=0)  # the same micro-batches in the same order


def test_other_runtime_errors_are_not_taken_for_out_of_memory():
    engine = make_engine(FullDevice(bn_model(), fits=4, error=RuntimeError("mat1 and mat2 shapes")), 32, 8, 32)
    with pytest.raises(RuntimeError, match="mat1 and mat2"):
        engine.train_epoch(0, toy_batches(32, 8))
    assert not backoff.is_out_of_memory(RuntimeError("DefaultCPUAllocator: not enough memory"))


@pytest.mark.parametrize("where", ["optimizer", "ema"])
def test_out_of_memory_in_the_step_or_the_ema_update_stops_with_one_line(where):
    """AdamW allocates its state at its first step; an error there used to end in a traceback."""
    from ultralytics.utils.torch_utils import ModelEMA

    engine = make_engine(bn_model(), num_images=16, batch=4, nbs=16)
    engine.ema = ModelEMA(engine.raw_model)
    owner = engine.optimizer if where == "optimizer" else engine.ema

    def full(*args, **kwargs):
        raise torch.OutOfMemoryError("CUDA out of memory. Tried to allocate 2.00 MiB")

    setattr(owner, "step" if where == "optimizer" else "update", full)
    with pytest.raises(UserError, match="out of memory in the optimizer step or EMA update at iteration 3"):
        engine.train_epoch(0, toy_batches(16, 4))


def test_sync_batchnorm_under_ddp_refuses_to_back_off_one_rank_alone(monkeypatch):
    """One rank backing off would run more SyncBatchNorm collectives than the others: a hang until ddp_timeout.
    The Engine is told it is one of 2 ranks; the error comes before any collective would run."""
    model = nn.SyncBatchNorm.convert_sync_batchnorm(bn_model())  # without a process group it normalises locally
    engine = make_engine(FullDevice(model, fits=4, error=torch.OutOfMemoryError("CUDA out of memory")), 32, 8, 32)
    engine.ctx = distributed.Context(rank=0, local_rank=0, world_size=2, device=torch.device("cpu"))
    with pytest.raises(UserError, match="bn=sync"):
        engine.train_epoch(0, toy_batches(32, 8))
    assert engine.back_offs == []


def test_validation_that_runs_out_of_memory_runs_again_at_half_the_batch(tmp_path):
    """The same figures as a validation at the smaller batch from the start, and the smaller batch is kept."""
    from ultralytics.nn.tasks import DetectionModel

    from yoloaccum.config import settings as config
    from yoloaccum.data import datasets as data
    from yoloaccum.evaluation import validate

    dataset = shapes_yaml(tmp_path, num_train=4, num_val=8, imgsz=64, seed=2)
    cfg = config.resolve([f"data={dataset}", "imgsz=64", "workers=0"])
    spec = data.load_spec(dataset)
    torch.manual_seed(0)
    model = DetectionModel("yolo26n.yaml", nc=spec.nc, verbose=False)
    said = []
    evaluator = validate.Evaluator(cfg, spec, tmp_path, 8, torch.device("cpu"), said.append)

    def full(module, args):
        if args[0].shape[0] > 2:
            raise RuntimeError("CUDA error: CUBLAS_STATUS_ALLOC_FAILED when calling `cublasCreate(handle)`")

    hook = model.register_forward_pre_hook(full)
    model.train()
    backed_off = evaluator.evaluate(model)
    hook.remove()
    assert evaluator.batch == 2 and len(said) == 2 and model.training  # 8 -> 4 -> 2; the model's mode kept
    reference = validate.Evaluator(cfg, spec, tmp_path, 2, torch.device("cpu")).evaluate(model)
    assert backed_off == pytest.approx(reference, abs=1e-9)


def test_the_assigners_own_out_of_memory_fallback_is_said_in_the_log():
    """Ultralytics' TaskAlignedAssigner catches a CUDA out-of-memory error itself and assigns one image at a time,
    warning through its logger, which yoloaccum keeps quiet. The first time it happens, the run's log says so."""
    from yoloaccum.core.loss import _TargetScoreSum

    class Assigner:  # what the CPU cannot do: run out of memory inside the assignment
        _oom_warned = False

        def __call__(self, *args):
            self._oom_warned = True  # as TaskAlignedAssigner sets it when it falls back
            return (None, None, torch.ones(1, 4, 3), None, None)

    said = []
    tss = _TargetScoreSum(Assigner())
    tss.log = said.append
    tss()
    tss()
    assert len(said) == 1 and "assigns one image at a time" in said[0]
    assert tss.last.item() == 12
