"""bn=window (norm.py): each window's statistics from a pass over its images, every micro-batch normalised with them,
and everything around it: the plain checkpoints, the engine's pass before each window, the back-off,
grad_checkpointing, compile, resume, remainder=carry and DDP."""

import copy

import pytest
import torch
from conftest import PLUMBING, SERIAL, TINY_MODEL, final_weights, relative_difference, shapes_yaml
from test_engine import make_engine
from torch import nn

from yoloaccum.batchnorm import window as norm
from yoloaccum.batchnorm.window import WindowBatchNorm2d, WindowStatistics
from yoloaccum.errors import UserError
from yoloaccum.training import faults


def conv_net() -> nn.Sequential:
    """Two convolutions, each followed by BatchNorm (non-trivial affine): the second layer's input depends on the
    first's normalisation, so a wrong upstream statistic shows downstream."""
    torch.manual_seed(0)
    net = nn.Sequential(
        nn.Conv2d(3, 8, 3),
        nn.BatchNorm2d(8),
        nn.SiLU(),
        nn.Conv2d(8, 8, 3),
        nn.BatchNorm2d(8),
        nn.SiLU(),
        nn.Conv2d(8, 2, 1),
        nn.Flatten(),
        nn.LazyLinear(2),
    )
    net(torch.rand(2, 3, 9, 9))  # the lazy layer's shape
    for m in net.modules():
        if isinstance(m, nn.BatchNorm2d):
            nn.init.uniform_(m.weight, 0.5, 1.5)
            nn.init.uniform_(m.bias, -0.5, 0.5)
            m.reset_running_stats()
    return net.train()


def windowed(net: nn.Module, **kwargs) -> tuple[nn.Module, WindowStatistics]:
    assert norm.convert(net) == 2
    return net, WindowStatistics(net, **kwargs)


def images(n: int = 8, seed: int = 1) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    return torch.rand(n, 3, 9, 9, generator=g) * 2 - 0.5


def micro_batches(x: torch.Tensor, micro: int) -> list[dict]:
    return [{"img": x[i : i + micro]} for i in range(0, len(x), micro)]


@pytest.mark.numerics
@pytest.mark.parametrize("micro", [1, 2, 4])
def test_every_micro_batch_of_a_window_is_normalised_as_one_batch_of_its_images(micro):
    """A window of 8 images in micro-batches of 1, 2 or 4: after the pass, each micro-batch's output, through both
    BatchNorm layers, is its slice of one batch of all 8. A layer that fell back to its micro-batch's statistics, or
    a pass that normalised upstream layers with anything but the window's, fails here."""
    x = images()
    whole = conv_net()(x)  # plain BatchNorm over the 8 images
    net, stats = windowed(conv_net())
    stats(micro_batches(x, micro))
    outs = torch.cat([net(b["img"]) for b in micro_batches(x, micro)])
    torch.testing.assert_close(outs, whole, rtol=0, atol=1e-5)  # float32 sums in another order
    per_micro = torch.cat([conv_net()(b["img"]) for b in micro_batches(x, 2)])
    assert (per_micro - whole).abs().max() > 1e-2  # what bn=batch would give: far from it


@pytest.mark.numerics
def test_the_running_statistics_take_one_step_per_window_as_a_real_batch_does():
    """After a window's pass and its micro-steps: the running statistics are those one forward of the whole window
    leaves in plain BatchNorm (one momentum step, with the unbiased variance), and the micro-steps add nothing."""
    x = images()
    plain = conv_net()
    plain(x)
    net, stats = windowed(conv_net())
    stats(micro_batches(x, 2))
    for b in micro_batches(x, 2):
        net(b["img"])
    for a, b in zip(plain.buffers(), [t for n, t in net.named_buffers() if not n.split(".")[-1].startswith("window")]):
        torch.testing.assert_close(b, a, rtol=0, atol=1e-6)


@pytest.mark.numerics
def test_a_window_of_one_micro_batch_is_batchnorm_gradient_included():
    """When the micro-batch is the whole window, r = 1 and d = 0: the output and every gradient are BatchNorm's."""
    x = images()
    plain = conv_net()
    net, stats = windowed(conv_net())
    stats(micro_batches(x, 8))
    for m in (plain, net):
        m(x).pow(2).sum().backward()
    for (name, p), q in zip(plain.named_parameters(), net.parameters()):
        # float32 sums in another order (gradients of order 10): 1e-5 is rounding, a wrong formula is off by far more
        torch.testing.assert_close(q.grad, p.grad, rtol=1e-5, atol=1e-5, msg=name)


@pytest.mark.numerics
def test_the_gradient_goes_through_the_micro_batchs_statistics_as_batch_renormalization():
    """A micro-batch of 2 in a window of 8: the gradients of the input, gamma and beta are those of
    gamma * (xhat_B * r + d) + beta with xhat_B the micro-batch's own normalisation and r, d constants (Ioffe 2017),
    not those of a constant normalisation (no gradient through the statistics), nor the micro-batch's BatchNorm's."""
    x = images(8, seed=4)
    bn = WindowBatchNorm2d(3)
    nn.init.uniform_(bn.weight, 0.5, 1.5)
    nn.init.uniform_(bn.bias, -0.5, 0.5)
    WindowStatistics(nn.Sequential(bn).train())(micro_batches(x, 8))
    part = x[:2].clone().requires_grad_()
    g = torch.randn(2, 3, 9, 9, generator=torch.Generator().manual_seed(0))
    dx, dgamma, dbeta = torch.autograd.grad(bn(part), (part, bn.weight, bn.bias), g)
    mu, var = bn.window_mean.view(1, -1, 1, 1), bn.window_var.view(1, -1, 1, 1)
    sigma = (var + bn.eps).sqrt()
    ref = part.detach().clone().requires_grad_()
    gamma, beta = bn.weight.detach().clone().requires_grad_(), bn.bias.detach().clone().requires_grad_()
    mu_b, var_b = ref.mean((0, 2, 3), keepdim=True), ref.var((0, 2, 3), unbiased=False, keepdim=True)
    sigma_b = (var_b + bn.eps).sqrt()
    r, d = (sigma_b / sigma).detach(), ((mu_b - mu) / sigma).detach()
    y = ((ref - mu_b) / sigma_b * r + d) * gamma.view(1, -1, 1, 1) + beta.view(1, -1, 1, 1)
    dx_ref, dgamma_ref, dbeta_ref = torch.autograd.grad(y, (ref, gamma, beta), g)
    torch.testing.assert_close(dx, dx_ref, rtol=1e-4, atol=1e-5)
    torch.testing.assert_close(dgamma, dgamma_ref, rtol=1e-4, atol=1e-4)  # sums of 162 terms of order 1
    torch.testing.assert_close(dbeta, dbeta_ref, rtol=1e-4, atol=1e-4)
    constant = g * (bn.weight.view(1, -1, 1, 1) / sigma)
    assert (dx - constant).abs().max() > 1e-2


def test_a_float64_layer_stays_in_float64_and_refuses_a_second_backward():
    """Only fp16 and bf16 inputs are upcast for their statistics; a gradient of a gradient is refused, not wrong."""
    bn = WindowBatchNorm2d(3).double()
    x = torch.randn(2, 3, 5, 5, dtype=torch.float64, generator=torch.Generator().manual_seed(0)).requires_grad_()
    y = bn(x)
    (dx,) = torch.autograd.grad(y.square().sum(), x, create_graph=True)
    assert y.dtype == dx.dtype == torch.float64
    with pytest.raises(RuntimeError, match="differentiate twice"):
        dx.sum().backward()


def test_a_pass_in_chunks_backs_off_on_out_of_memory_and_the_first_layer_stays_exact():
    """A pass that runs out of memory at 8 images halves its chunk until it fits. The first layer's statistics stay
    exact (its input does not depend on any normalisation); downstream ones are approximations, since each chunk
    normalises upstream with its own statistics."""

    class Fails(nn.Module):
        def forward(self, x):
            if x.shape[0] > 2:
                raise torch.OutOfMemoryError("CUDA out of memory. Tried to allocate 2.00 GiB")
            return x

    x = images()
    exact_net, exact = windowed(conv_net())
    exact(micro_batches(x, 8))
    net = conv_net()
    net.insert(0, Fails())
    net, stats = windowed(net)
    stats(micro_batches(x, 2))
    assert stats.chunk == 2
    first, second = (m for m in net.modules() if isinstance(m, WindowBatchNorm2d))
    exact_first, exact_second = (m for m in exact_net.modules() if isinstance(m, WindowBatchNorm2d))
    torch.testing.assert_close(first.window_mean, exact_first.window_mean, rtol=0, atol=1e-6)
    torch.testing.assert_close(first.window_var, exact_first.window_var, rtol=0, atol=1e-6)
    torch.testing.assert_close(second.window_var, exact_second.window_var, rtol=0.2, atol=0)
    assert first._sums is None and second._sums is None  # the failed pass left nothing half-counted


def test_eval_mode_and_the_state_dict_are_a_plain_batchnorms():
    net, stats = windowed(conv_net())
    stats(micro_batches(images(), 4))
    bn = net[1]
    plain = nn.BatchNorm2d(8)
    assert set(bn.state_dict()) == set(plain.state_dict())
    plain.load_state_dict(bn.state_dict())
    x = torch.rand(2, 8, 7, 7)
    torch.testing.assert_close(bn.eval()(x), plain.eval()(x))
    assert bn.running_var.ne(1).all()  # the pass moved the running statistics


def test_convert_keeps_the_parameters_and_refuses_a_model_without_batchnorm():
    from ultralytics.nn.tasks import DetectionModel

    model = DetectionModel("yolo26n.yaml", nc=4, verbose=False)
    params = {id(p) for p in model.parameters()}
    before = {k: v.clone() for k, v in model.state_dict().items()}
    count = norm.convert(model)
    assert count == sum(isinstance(m, nn.BatchNorm2d) for m in model.modules()) > 50
    assert {id(p) for p in model.parameters()} == params  # the optimizer, built after, sees the same tensors
    assert model.state_dict().keys() == before.keys()
    WindowStatistics(model.train())([{"img": torch.rand(2, 3, 64, 64)}])
    layers = [m for m in model.modules() if isinstance(m, WindowBatchNorm2d)]
    assert all(m.num_batches_tracked == 1 and m.window_var.ne(1).any() for m in layers)  # every layer reached
    with pytest.raises(UserError, match="bn=window needs BatchNorm2d layers"):
        norm.convert(nn.Sequential(nn.Linear(2, 2)))


class Flat(nn.Module):
    """conv_net's input from the engine tests' flat toy batches."""

    def forward(self, x):
        return x.view(-1, 3, 1, 2).repeat(1, 1, 9, 5)[..., :9]


def engine_net() -> nn.Module:
    net = conv_net()
    net.insert(0, Flat())
    return net


@pytest.mark.numerics
def test_the_engine_passes_over_each_window_before_its_first_micro_step():
    """Windows of 4 micro-batches over 40 images in micro-batches of 4 (the last window short, 2 micro-batches): the
    pass sees each window's batches, at its first micro-step, before that micro-step's forward."""
    engine = make_engine(engine_net(), num_images=40, batch=4, nbs=16)
    passes, order = [], []
    norm.convert(engine.raw_model)
    statistics = WindowStatistics(engine.raw_model)
    engine.window_statistics = lambda batches: (
        passes.append([b["img"] for b in batches]),
        order.append("pass"),
        statistics(batches),
    )
    engine.raw_model.register_forward_pre_hook(lambda *_: order.append("forward"))
    g = torch.Generator().manual_seed(0)
    batches = [{"img": torch.randn(4, 6, generator=g), "target": torch.randn(4, 2, generator=g)} for _ in range(10)]
    engine.train_epoch(0, batches)
    assert [len(p) for p in passes] == [4, 4, 2]
    assert all(torch.equal(p[k], batches[4 * w + k]["img"]) for w, p in enumerate(passes) for k in range(len(p)))
    forwards_of_pass = len(order) - 10 - len(passes)  # each pass is one forward of its window (one chunk)
    assert forwards_of_pass == 3
    assert order[:6] == ["pass", "forward", "forward", "forward", "forward", "forward"]  # the pass's own, then 4


@pytest.mark.numerics
def test_with_one_micro_batch_a_window_the_engine_trains_as_bn_batch():
    """bn=window at accumulate 1 (the micro-batch is the window): the same weights and running statistics as
    bn=batch, step after step; a difference would be in the pass or in the renormalisation."""
    runs = []
    for window in (False, True):
        net = engine_net()
        engine = make_engine(net, num_images=32, batch=8, nbs=8)
        if window:
            norm.convert(net)
            engine.window_statistics = WindowStatistics(net)
        g = torch.Generator().manual_seed(0)
        batches = [{"img": torch.randn(8, 6, generator=g), "target": torch.randn(8, 2, generator=g)} for _ in range(4)]
        engine.train_epoch(0, batches)
        runs.append(net)
    for (name, a), b in zip(runs[0].state_dict().items(), runs[1].state_dict().values()):
        torch.testing.assert_close(b, a, rtol=1e-5, atol=1e-6, msg=name)  # float32 sums in another order


@pytest.mark.numerics
def test_a_back_off_normalises_over_the_same_images_as_a_run_at_half_the_micro_batch():
    """Out of memory in the second batch: the window runs again at micro-batches of 2, its statistics passed again
    over the same images (the back-off puts the buffers back): the run ends bitwise where one started at 2 does."""
    nets = []
    for batch, fault in ((4, "oom@1"), (2, None)):
        net = engine_net()
        engine = make_engine(net, num_images=32, batch=batch, nbs=16)
        norm.convert(net)
        engine.window_statistics = WindowStatistics(net)
        if fault:
            faults.install(engine, {"YOLOACCUM_FAULT": fault})  # as the trainer installs it
        g = torch.Generator().manual_seed(0)
        x, y = torch.randn(32, 6, generator=g), torch.randn(32, 2, generator=g)
        engine.train_epoch(0, [{"img": x[i : i + batch], "target": y[i : i + batch]} for i in range(0, 32, batch)])
        assert engine.back_offs == ([1] if fault else [])
        nets.append(net)
    for x, y in zip(
        list(nets[0].state_dict().values()) + list(nets[0].buffers()),
        list(nets[1].state_dict().values()) + list(nets[1].buffers()),
    ):
        torch.testing.assert_close(x, y, rtol=0, atol=0)


def test_grad_checkpointing_recomputes_with_the_statistics_the_first_forward_used():
    """The recomputation in backward normalises with the window's statistics as the first forward did: the same
    gradients and buffers as without checkpointing. A guard of the combination, not a numerics gate: bn=window's
    training forward only reads its buffers, so no mutation of the package makes the two differ; checkpointing's own
    buffer handling (bn=batch updates the running statistics in every training forward) is the numerics test
    tests/test_model.py's."""
    from ultralytics.nn.tasks import DetectionModel

    from yoloaccum.model import build as model_

    torch.manual_seed(0)
    plain = DetectionModel("yolo26n.yaml", nc=4, verbose=False)
    norm.convert(plain)
    checkpointed = copy.deepcopy(plain)
    model_.checkpoint_blocks(checkpointed)
    x = torch.rand(6, 3, 64, 64, generator=torch.Generator().manual_seed(0))
    for m in (plain, checkpointed):
        m.train()
        WindowStatistics(m)(micro_batches(x, 2))
        for part in x.split(2):
            out = m(part)
            sum(o.float().pow(2).mean() for o in (out["one2many"]["boxes"], out["one2many"]["scores"])).backward()
    for (name, p), q in zip(plain.named_parameters(), checkpointed.parameters()):
        torch.testing.assert_close(q.grad, p.grad, rtol=1e-4, atol=1e-6, msg=name)
    for a, b in zip(plain.buffers(), checkpointed.buffers()):
        torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-6)


@pytest.mark.slow
def test_compiled_bn_window_equals_eager(tmp_path):
    """tests/models/tiny26.yaml with bn=window, compiled (inductor) against eager over one window of 4 micro-batches,
    the pass run eager on both: the same gradient to float tolerance, and the same statistics. A guard of the
    combination (it traces, and trains as eager does), not a numerics gate: both sides run the same norm.py, and
    running the pass compiled too, the one compile-specific choice, still gives the same figures (tried as a
    mutation: benchmarks/records/mutations.md)."""
    import sys

    from conftest import REPO

    from yoloaccum.model import compiler

    sys.path.insert(0, str(REPO / "benchmarks"))
    from common import CTX, engine_for, make_batches

    engines = [engine_for(TINY_MODEL, 64, batch=2, nbs=8, num_batches=4) for _ in range(2)]
    for e in engines:
        norm.convert(e.raw_model)  # the parameters stay those the optimizer holds
    eager, compiled = engines
    assert compiler.compile_model(compiled.raw_model, "default", (2,), 64, CTX.device, None, warn=pytest.fail)
    batches = make_batches(4, 2, 64, seed=3)
    grads = []
    for e in (eager, compiled):
        e.raw_model.train()
        WindowStatistics(e.raw_model)([dict(b) for b in batches])
        for b in batches:
            e.micro_step(dict(b))
        grads.append(torch.cat([p.grad.flatten() for p in e.raw_model.parameters() if p.grad is not None]))
    torch.testing.assert_close(grads[1], grads[0], rtol=1e-4, atol=1e-5)
    for a, b in zip(eager.raw_model.buffers(), compiled.raw_model.buffers()):
        torch.testing.assert_close(b, a, rtol=1e-4, atol=1e-5)


RUN = (
    *PLUMBING,
    "imgsz=64",
    "batch=2",
    "nbs=8",
    "epochs=2",
    "workers=0",
    "warmup_epochs=1",
    "close_mosaic=0",
    "bn=window",
    "exist_ok=True",
)


@pytest.mark.numerics
@pytest.mark.slow
def test_cli_bn_window_resumes_bitwise_with_remainder_carry_and_saves_a_plain_model(tmp_path, run_cli):
    """Stopped by a SIGINT inside a window that spans two epochs (remainder=carry), resumed: the same weights as the
    uninterrupted run (each window's statistics come from its own images: nothing else to keep). bn=batch ends
    elsewhere, so the mode was in force. best.pt holds plain BatchNorm2d layers and predicts in Ultralytics."""
    from ultralytics import YOLO

    data = shapes_yaml(tmp_path, num_train=14, num_val=4, seed=7)  # 7 micro-batches of 2 an epoch
    common = (f"data={data}", f"project={tmp_path}", *RUN, "remainder=carry", "val=False")
    full = run_cli("train", *common, "name=full", env=SERIAL, timeout=600)
    assert full.returncode == 0, full.stderr[-3000:]
    assert "BatchNorm: bn=window: each micro-batch of 2 normalised with the statistics of its window's 8 images" in (
        " ".join(full.stdout.split())
    )
    r = run_cli("train", *common, "name=sig", env={**SERIAL, "YOLOACCUM_FAULT": "sigint@5"}, timeout=600)
    assert r.returncode == 130, r.stderr[-3000:]
    r = run_cli("train", f"resume={tmp_path / 'sig/weights/last.pt'}", env=SERIAL, timeout=600)
    assert r.returncode == 0, r.stderr[-3000:]
    assert relative_difference(final_weights(tmp_path / "sig"), final_weights(tmp_path / "full")) == 0.0
    batch = run_cli("train", *common[:-1], "val=False", "bn=batch", "name=batch", env=SERIAL, timeout=600)
    assert batch.returncode == 0, batch.stderr[-3000:]
    assert relative_difference(final_weights(tmp_path / "batch"), final_weights(tmp_path / "full")) > 1e-3
    best = YOLO(str(tmp_path / "full/weights/best.pt"))
    kinds = {type(m) for m in best.model.modules() if isinstance(m, nn.modules.batchnorm._BatchNorm)}
    assert kinds <= {nn.BatchNorm2d}
    assert len(best.predict(torch.zeros(1, 3, 64, 64), verbose=False)) == 1


def test_a_last_pt_of_the_queue_era_bn_window_is_refused_with_one_line(tmp_path):
    """A format-2 last.pt of a bn=window run trained with the earlier queue: one line, naming what to do."""
    from conftest import REPO

    from yoloaccum.model import checkpoint
    from yoloaccum.training import state

    old = checkpoint.load(REPO / "tests/fixtures/format4-epoch2.pt")  # a run's whole entry, as format 2 had it
    entry = {k: v for k, v in old["yoloaccum"].items() if k != "bn"}
    ckpt = {**old, "yoloaccum": {**entry, "format": 2, "config": {**entry["config"], "bn": "window"}}}
    with pytest.raises(UserError, match="earlier queue.*pretrained="):
        state.read(ckpt, tmp_path / "last.pt")
    ckpt["yoloaccum"]["config"]["bn"] = "batch"
    assert state.read(ckpt, tmp_path / "last.pt")["format"] == state.FORMAT


@pytest.mark.numerics
@pytest.mark.slow
def test_two_ranks_normalise_with_their_own_images_statistics(tmp_path):
    """Under torchrun (gloo), 2 ranks x micro-batch 2 x accumulate 4 with bn=window: each rank passes over its own 8
    images of the window (per rank: nothing is reduced, no collective added), and the step equals one process that
    runs each rank's micro-batches with that rank's statistics. Against one process whose statistics are the whole
    window's, the gradient differs: the statistics are per rank."""
    from test_distributed import window

    ddp = window(tmp_path, 2, 4, "bn-window")
    reference = window(tmp_path, 1, 4, "bn-window", "as-ranks=2")
    whole = window(tmp_path, 1, 4, "bn-window")  # one process, micro-batches of 4, the window's 16 images
    # float32 sums over 16 images in another order, as the DDP equivalence test allows
    assert relative_difference(ddp["grad"], reference["grad"]) <= 1e-5
    assert relative_difference(ddp["weights"], reference["weights"]) <= 1e-5
    assert relative_difference(ddp["grad"], whole["grad"]) > 1e-3


def test_every_batch_norm_the_layer_calls_has_a_positive_eps():
    """torch 2.11 refuses F.batch_norm with eps <= 0 even in eval mode, where torch 2.14 lets it pass: bn=window once
    handed its micro-step batch_norm eps=0 (the variance already held eps) and failed at its first micro-step on an
    H200 with torch 2.11 (docs/gpu.md). The layer runs for real here, forward and backward; a torch function mode
    only records the eps of each batch_norm call it makes."""
    from torch.overrides import TorchFunctionMode

    class Recorder(TorchFunctionMode):
        def __init__(self):
            super().__init__()
            self.eps = []

        def __torch_function__(self, func, types, args=(), kwargs=None):
            kwargs = kwargs or {}
            if func is torch.nn.functional.batch_norm:
                self.eps.append(kwargs.get("eps", args[7] if len(args) > 7 else 1e-5))
            return func(*args, **kwargs)

    layer = WindowBatchNorm2d(4).train()
    x = torch.randn(2, 4, 5, 5, requires_grad=True)
    with Recorder() as recorder:
        layer(x).sum().backward()
    assert recorder.eps and all(e > 0 for e in recorder.eps), recorder.eps
