"""bn=window (norm.py): micro-batches normalised with the statistics of the window's last images, and everything
around it: the plain checkpoints, the back-off, grad_checkpointing, compile, resume, remainder=carry and DDP."""

import copy

import pytest
import torch
import torch.nn.functional as F
from conftest import SERIAL, final_weights, relative_difference, shapes_yaml
from test_engine import make_engine, toy_batches
from torch import nn

from yoloaccum import faults, norm
from yoloaccum.errors import UserError
from yoloaccum.norm import WindowBatchNorm2d


def window_bn(channels: int = 8, window: int = 8) -> nn.Module:
    """One WindowBatchNorm2d (in a Sequential, which holds the window's hooks) with a non-trivial affine."""
    torch.manual_seed(0)
    bn = nn.BatchNorm2d(channels)
    nn.init.uniform_(bn.weight, 0.5, 1.5)
    nn.init.uniform_(bn.bias, -0.5, 0.5)
    model = nn.Sequential(bn)
    norm.convert(model, window)
    assert isinstance(model[0], WindowBatchNorm2d)
    return model


def images(n: int = 8, channels: int = 8, seed: int = 1) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    return torch.randn(n, channels, 5, 5, generator=g) * 2 + 0.5


@pytest.mark.numerics
@pytest.mark.parametrize("micro", [1, 2, 4])
def test_the_windows_last_micro_batch_is_normalised_with_the_statistics_of_all_its_images(micro):
    """Micro-batches of 1, 2 or 4 through a window of 8 images: the last is normalised exactly as in one batch of 8;
    the first only with its own. A layer that fell back to per-micro-batch statistics fails the first assertion."""
    model, x = window_bn(), images()
    bn = model[0]
    outs = [model(x[i : i + micro]) for i in range(0, 8, micro)]
    whole = F.batch_norm(x, None, None, bn.weight, bn.bias, training=True, eps=bn.eps)
    torch.testing.assert_close(outs[-1], whole[8 - micro :], rtol=0, atol=1e-5)  # float32 sums in another order
    own = F.batch_norm(x[:micro], None, None, bn.weight, bn.bias, training=True, eps=bn.eps)
    torch.testing.assert_close(outs[0], own, rtol=0, atol=1e-5)
    assert not torch.allclose(outs[-1], F.batch_norm(x[8 - micro :], None, None, bn.weight, bn.bias, training=True))


def test_the_window_is_counted_in_images_and_slides():
    """Window 8: after micro-batches of 4, 2, 2 and 4 images the last normalises with the last 8 images only."""
    model, x = window_bn(), images(12)
    bn = model[0]
    for a, b in [(0, 4), (4, 6), (6, 8)]:
        model(x[a:b])
    last = model(x[8:12])
    expected = F.batch_norm(x[4:12], None, None, bn.weight, bn.bias, training=True, eps=bn.eps)[4:]
    torch.testing.assert_close(last, expected, rtol=0, atol=1e-5)


@pytest.mark.numerics
def test_without_a_queue_the_layer_is_batchnorm_gradient_included():
    """The first micro-batch (nothing queued yet): the same output and the same gradients as BatchNorm."""
    model, x = window_bn(), images(4).requires_grad_()
    bn = model[0]
    plain = copy.deepcopy(nn.BatchNorm2d(8))
    plain.weight, plain.bias = copy.deepcopy(bn.weight), copy.deepcopy(bn.bias)
    x2 = x.detach().clone().requires_grad_()
    model(x).pow(2).sum().backward()
    plain.train()(x2).pow(2).sum().backward()
    # float32 sums in another order (gradients of order 10 here): 1e-5 is rounding, a wrong formula is off by 1
    torch.testing.assert_close(x.grad, x2.grad, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(bn.weight.grad, plain.weight.grad, rtol=1e-5, atol=1e-5)


def test_eval_mode_and_the_state_dict_are_a_plain_batchnorms():
    model = window_bn()
    bn = model[0]
    for i in range(3):
        model(images(2, seed=i))
    plain = nn.BatchNorm2d(8)
    assert set(bn.state_dict()) == set(plain.state_dict())
    plain.load_state_dict(bn.state_dict())
    x = images(2, seed=9)
    torch.testing.assert_close(bn.eval()(x), plain.eval()(x))
    assert bn.running_var.ne(1).all()  # training moved the running statistics


def test_convert_keeps_the_parameters_and_refuses_a_model_without_batchnorm():
    from ultralytics.nn.tasks import DetectionModel

    model = DetectionModel("yolo26n.yaml", nc=4, verbose=False)
    params = {id(p) for p in model.parameters()}
    before = {k: v.clone() for k, v in model.state_dict().items()}
    count = norm.convert(model, 16)
    assert count == sum(isinstance(m, nn.BatchNorm2d) for m in model.modules()) > 50
    assert {id(p) for p in model.parameters()} == params  # the optimizer, built after, sees the same tensors
    assert model.state_dict().keys() == before.keys()
    model.train()(torch.rand(2, 3, 64, 64))
    assert all(m.queue_count.sum() == 2 and m.queue_moments.abs().sum() > 0 for _, m in norm.layers(model))
    with pytest.raises(UserError, match="bn=window needs BatchNorm2d layers"):
        norm.convert(nn.Sequential(nn.Linear(2, 2)), 16)


def conv_bn_model() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Unflatten(1, (6, 1, 1)), nn.Conv2d(6, 8, 1), nn.BatchNorm2d(8), nn.Tanh(), nn.Flatten(),
                         nn.Linear(8, 2))  # fmt: skip


@pytest.mark.numerics
def test_a_back_off_normalises_over_the_same_images_as_a_run_at_half_the_micro_batch():
    """Out of memory in the second batch: the window runs again at micro-batches of 4. Its queue is put back with the
    other buffers, and the window counts images: the run ends bitwise where one started at 4 does."""
    backed = conv_bn_model()
    norm.convert(backed, 32)
    halved = conv_bn_model()
    norm.convert(halved, 32)
    a = make_engine(backed, num_images=64, batch=8, nbs=32)
    faults.install(a, {"YOLOACCUM_FAULT": "oom@1"})  # as the trainer installs it
    b = make_engine(halved, num_images=64, batch=4, nbs=32)
    a.train_epoch(0, toy_batches(64, 8))
    b.train_epoch(0, toy_batches(64, 4))
    assert a.back_offs == [1]
    for x, y in zip(list(backed.state_dict().values()) + list(backed.buffers()),
                    list(halved.state_dict().values()) + list(halved.buffers())):  # fmt: skip
        torch.testing.assert_close(x, y, rtol=0, atol=0)


@pytest.mark.numerics
def test_grad_checkpointing_recomputes_with_the_statistics_the_first_forward_used():
    """The recomputation in backward sees the queues as the first forward did (not extended by it): the same
    gradients as without checkpointing."""
    from ultralytics.nn.tasks import DetectionModel

    from yoloaccum import model as model_

    torch.manual_seed(0)
    plain = DetectionModel("yolo26n.yaml", nc=4, verbose=False)
    norm.convert(plain, 8)
    checkpointed = copy.deepcopy(plain)
    model_.checkpoint_blocks(checkpointed)
    x = torch.rand(6, 3, 64, 64, generator=torch.Generator().manual_seed(0))
    for m in (plain, checkpointed):
        m.train()
        for part in x.split(2):
            out = m(part)
            sum(o.float().pow(2).mean() for o in (out["one2many"]["boxes"], out["one2many"]["scores"])).backward()
    for (name, p), q in zip(plain.named_parameters(), checkpointed.parameters()):
        torch.testing.assert_close(q.grad, p.grad, rtol=1e-4, atol=1e-6, msg=name)
    for a, b in zip(plain.buffers(), checkpointed.buffers()):
        torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-6)


@pytest.mark.numerics
@pytest.mark.slow
def test_compiled_bn_window_equals_eager(tmp_path):
    """tests/models/tiny26.yaml with bn=window, compiled (inductor) against eager over one window of 4 micro-batches:
    the same gradient to float tolerance, and the same queues."""
    import sys

    from conftest import REPO

    from yoloaccum import compiler

    sys.path.insert(0, str(REPO / "benchmarks"))
    from common import CTX, engine_for, make_batches

    tiny = str(REPO / "tests/models/tiny26.yaml")
    engines = [engine_for(tiny, 64, batch=2, nbs=8, num_batches=4) for _ in range(2)]
    for e in engines:
        norm.convert(e.raw_model, 8)  # the parameters stay those the optimizer holds
    eager, compiled = engines
    assert compiler.compile_model(compiled.raw_model, "default", (2,), 64, CTX.device, False, warn=pytest.fail)
    batches = make_batches(4, 2, 64, seed=3)
    grads = []
    for e in (eager, compiled):
        e.raw_model.train()
        for b in batches:
            e.micro_step(dict(b))
        grads.append(torch.cat([p.grad.flatten() for p in e.raw_model.parameters() if p.grad is not None]))
    torch.testing.assert_close(grads[1], grads[0], rtol=1e-4, atol=1e-5)
    for (_, a), (_, b) in zip(norm.layers(eager.raw_model), norm.layers(compiled.raw_model)):
        torch.testing.assert_close(b.queue_moments, a.queue_moments, rtol=1e-4, atol=1e-5)


RUN = ("model=yolo26n.yaml", "imgsz=64", "batch=2", "nbs=8", "epochs=2", "workers=0", "warmup_epochs=1",
       "close_mosaic=0", "bn=window", "plots=False", "exist_ok=True")  # fmt: skip


@pytest.mark.numerics
@pytest.mark.slow
def test_cli_bn_window_resumes_bitwise_with_remainder_carry_and_saves_a_plain_model(tmp_path, run_cli):
    """Stopped by a SIGINT inside a window that spans two epochs (remainder=carry), resumed: the same weights as the
    uninterrupted run, so the queues are in last.pt. best.pt holds plain BatchNorm2d layers and predicts in
    Ultralytics."""
    from ultralytics import YOLO

    data = shapes_yaml(tmp_path, num_train=14, num_val=4, seed=7)  # 7 micro-batches of 2 an epoch
    common = (f"data={data}", f"project={tmp_path}", *RUN, "remainder=carry", "val=False")
    full = run_cli("train", *common, "name=full", env=SERIAL, timeout=600)
    assert full.returncode == 0, full.stderr[-3000:]
    assert "BatchNorm: bn=window, each layer normalises micro-batches of 2 with the statistics" in (
        full.stdout.replace("\n", " ")
    )
    r = run_cli("train", *common, "name=sig", env={**SERIAL, "YOLOACCUM_FAULT": "sigint@5"}, timeout=600)
    assert r.returncode == 130, r.stderr[-3000:]
    r = run_cli("train", f"resume={tmp_path / 'sig/weights/last.pt'}", env=SERIAL, timeout=600)
    assert r.returncode == 0, r.stderr[-3000:]
    assert relative_difference(final_weights(tmp_path / "sig"), final_weights(tmp_path / "full")) == 0.0
    best = YOLO(str(tmp_path / "full/weights/best.pt"))
    kinds = {type(m) for m in best.model.modules() if isinstance(m, nn.modules.batchnorm._BatchNorm)}
    assert kinds <= {nn.BatchNorm2d}
    assert len(best.predict(torch.zeros(1, 3, 64, 64), verbose=False)) == 1


@pytest.mark.numerics
@pytest.mark.slow
def test_two_ranks_keep_their_own_queues_and_resume_bitwise(tmp_path):
    """Under DDP each rank normalises with its own images' statistics (nothing is reduced, no extra collective); the
    queues are saved per rank, so a run stopped mid-epoch on rank 1 resumes bitwise."""
    from test_distributed import torchrun

    data = shapes_yaml(tmp_path, num_train=16, num_val=4, seed=7)
    args = ("-m", "yoloaccum", "train", f"data={data}", f"project={tmp_path}", *RUN, "batch=4", "val=False")
    full = torchrun(2, *args, "name=full", env=SERIAL)
    assert full.returncode == 0, full.stderr[-3000:]
    torchrun(2, *args, "name=sig", env={**SERIAL, "YOLOACCUM_FAULT": "sigint@4:1"})
    from yoloaccum import checkpoint

    state = checkpoint.load(tmp_path / "sig/weights/last.pt")["yoloaccum"]
    assert state["interrupted"], "the run was not stopped"
    queues = [r["bn_window"] for r in state["ranks"]]
    layer = next(iter(queues[0]))
    assert not torch.equal(queues[0][layer]["queue_moments"], queues[1][layer]["queue_moments"])
    r = torchrun(2, "-m", "yoloaccum", "train", f"resume={tmp_path / 'sig/weights/last.pt'}", env=SERIAL)
    assert r.returncode == 0, r.stderr[-3000:]
    assert relative_difference(final_weights(tmp_path / "sig"), final_weights(tmp_path / "full")) == 0.0
