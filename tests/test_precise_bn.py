"""Precise BatchNorm statistics: exact over micro-batches and over ranks, and wired into training through the CLI."""

import copy
import subprocess
import sys

import pytest
import torch
from conftest import EXACT, REPO, SERIAL, final_weights, offline_env, shapes_yaml

from yoloaccum import precise_bn
from yoloaccum.distributed import Context

CPU = Context(rank=0, local_rank=0, world_size=1, device=torch.device("cpu"))


def make_model() -> torch.nn.Module:
    from ultralytics.nn.tasks import DetectionModel

    from yoloaccum import ultra  # noqa: F401  (ultralytics offline and quiet)

    torch.manual_seed(0)
    return DetectionModel("yolo26n.yaml", nc=4, verbose=False).eval()


def images() -> torch.Tensor:
    return torch.rand(12, 3, 64, 64, generator=torch.Generator().manual_seed(1))


def one_batch_statistics(model: torch.nn.Module, layer: int = 0) -> tuple[torch.Tensor, torch.Tensor]:
    """BatchNorm's own statistics of one batch of all the images: a cumulative average (momentum=None) of one batch."""
    model = copy.deepcopy(model)
    bn = precise_bn.bn_layers(model)[layer]
    bn.reset_running_stats()
    bn.momentum = None
    bn.train()
    with torch.no_grad():
        model(images())
    return bn.running_mean, bn.running_var


# float32 sums over the same 12 x 32 x 32 values per channel in another order: about 1e-6 relative.
TOLERANCE = dict(rtol=1e-5, atol=1e-7)


def test_micro_batches_give_the_statistics_of_one_batch():
    model = make_model()
    expected = one_batch_statistics(model)  # layer 0: its input is the image, which no BatchNorm layer changes
    seen = precise_bn.recompute(model, images().split(4), CPU)  # 3 micro-batches of 4
    first = precise_bn.bn_layers(model)[0]
    assert seen == 12
    torch.testing.assert_close(first.running_mean, expected[0], **TOLERANCE)
    torch.testing.assert_close(first.running_var, expected[1], **TOLERANCE)


def test_the_variance_includes_the_variance_between_micro_batches():
    model = make_model()
    shifted = images() + torch.arange(12).view(12, 1, 1, 1) / 4  # micro-batches with different means
    precise_bn.recompute(model, shifted.split(4), CPU)
    first = precise_bn.bn_layers(model)[0]
    averaged = copy.deepcopy(model)  # the alternative: an average of per-batch variances, which misses it
    bn = precise_bn.bn_layers(averaged)[0]
    bn.reset_running_stats()
    bn.momentum, bn.training = None, True
    with torch.no_grad():
        for x in shifted.split(4):
            averaged(x)
    assert (first.running_var > bn.running_var * 1.01).float().mean() > 0.5


def test_every_layer_is_recomputed_and_modes_are_restored():
    model = make_model()
    before = [m.running_var.clone() for m in precise_bn.bn_layers(model)]
    precise_bn.recompute(model, images().split(6), CPU)
    after = [m.running_var for m in precise_bn.bn_layers(model)]
    assert all(not torch.equal(a, b) for a, b in zip(after, before))
    assert not any(m.training for m in model.modules())  # eval before, eval after
    assert all(torch.isfinite(v).all() for v in after)


@pytest.mark.slow
def test_two_ranks_give_the_statistics_of_one_process(tmp_path):
    out = tmp_path / "ranks.pt"
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node=2",
           str(REPO / "tests/ddp_precise_bn.py"), str(out)]  # fmt: skip
    r = subprocess.run(cmd, cwd=REPO, env=offline_env(), capture_output=True, text=True, timeout=300)
    assert r.returncode == 0, r.stderr[-3000:]
    two_ranks = torch.load(out)
    expected = one_batch_statistics(make_model())
    torch.testing.assert_close(two_ranks[0][0], expected[0], **TOLERANCE)
    torch.testing.assert_close(two_ranks[0][1], expected[1], **TOLERANCE)
    single = make_model()  # every layer, against one process over the ranks' micro-batches of 2
    precise_bn.recompute(single, [*images()[0::2].split(2), *images()[1::2].split(2)], CPU)
    # Deeper layers see float32 activations computed in two processes: ~1e-6 apart, on means near 0.
    for (mean, var), layer in zip(two_ranks, precise_bn.bn_layers(single)):
        torch.testing.assert_close(mean, layer.running_mean, rtol=1e-4, atol=1e-5)
        torch.testing.assert_close(var, layer.running_var, rtol=1e-4, atol=1e-5)


@pytest.mark.slow
def test_training_is_the_same_with_and_without_precise_statistics(tmp_path, run_cli):
    """The recompute reads and writes only the EMA's statistics, and draws no random number that training uses:
    with augmentation on, the trained weights are bitwise those of precise_bn=0."""
    data = shapes_yaml(tmp_path, num_train=24, num_val=4)
    args = [a for a in EXACT if a.split("=")[0] not in {"mosaic", "fliplr", "hsv_h", "scale", "translate", "val"}]
    for n in (0, 16):
        r = run_cli("train", f"data={data}", f"project={tmp_path}", f"name=pbn{n}", *args, "batch=8", "nbs=16",
                    f"precise_bn={n}", env=SERIAL, timeout=600)  # fmt: skip
        assert r.returncode == 0, r.stdout[-2000:] + r.stderr[-3000:]
    assert torch.equal(final_weights(tmp_path / "pbn0"), final_weights(tmp_path / "pbn16"))


def test_the_kept_images_give_the_statistics_of_loading_them_again(tmp_path):
    """The trainer loads precise_bn's images once and keeps them: every recompute, from the kept images, gives what
    loading them afresh through the loader gives, and keeping them draws no random number that training uses."""
    from yoloaccum import config
    from yoloaccum.engine import model_input
    from yoloaccum.trainer import Trainer

    data = shapes_yaml(tmp_path, num_train=12, num_val=4)
    settings = {"data": str(data), "model": "yolo26n.yaml", "imgsz": 64, "batch": 4, "precise_bn": 10, "workers": 0,
                "plots": False, "project": str(tmp_path)}  # fmt: skip
    cfg = config.resolve(overrides=settings)
    trainer = Trainer(cfg, None, None)
    fresh = copy.deepcopy(trainer.ema.ema)
    random_state = torch.get_rng_state()
    trainer.recompute_bn()
    assert torch.equal(torch.get_rng_state(), random_state)
    assert sum(img.shape[0] for img in trainer.bn_images) == 10
    precise_bn.recompute(fresh, (model_input(b["img"], CPU.device) for b in trainer.bn_loader), CPU)
    trainer.recompute_bn()  # from the kept images
    for kept, loaded in zip(precise_bn.bn_layers(trainer.ema.ema), precise_bn.bn_layers(fresh)):
        assert torch.equal(kept.running_mean, loaded.running_mean) and torch.equal(kept.running_var, loaded.running_var)


def test_layerwise_statistics_are_those_each_layer_sees_at_inference():
    """recompute_layerwise: every layer's running statistics are the mean and variance, over all images, of its
    input in eval mode, every layer before it normalising with its own new statistics: what inference sees."""
    model = make_model()
    precise_bn.recompute_layerwise(model, list(images().split(5)), CPU)  # micro-batches of 5, 5 and 2
    layers = precise_bn.bn_layers(model)
    seen: dict[torch.nn.Module, torch.Tensor] = {}
    hooks = [layer.register_forward_pre_hook(lambda m, i: seen.setdefault(m, i[0].clone())) for layer in layers]
    with torch.no_grad():
        model(images())  # one batch of all the images, in eval mode: what inference sees
    for h in hooks:
        h.remove()
    assert model.training is False and len(seen) == len(layers)
    for layer in layers:
        var, mean = torch.var_mean(seen[layer].double(), dim=(0, 2, 3))
        torch.testing.assert_close(layer.running_mean, mean.float(), rtol=1e-4, atol=1e-5)
        torch.testing.assert_close(layer.running_var, var.float(), rtol=1e-4, atol=1e-5)
