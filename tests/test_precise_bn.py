"""Precise BatchNorm statistics: exact over micro-batches and over ranks, and wired into training through the CLI."""

import copy
import subprocess
import sys

import pytest
import torch
from conftest import EXACT, PLUMBING, REPO, SERIAL, final_weights, offline_env, shapes_yaml

from yoloaccum.batchnorm import precise as precise_bn
from yoloaccum.distributed.ddp import Context

CPU = Context(rank=0, local_rank=0, world_size=1, device=torch.device("cpu"))


def make_model() -> torch.nn.Module:
    from ultralytics.nn.tasks import DetectionModel

    from yoloaccum.config import ultra  # noqa: F401  (ultralytics offline and quiet)

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


@pytest.mark.numerics
def test_micro_batches_give_the_statistics_of_one_batch():
    model = make_model()
    expected = one_batch_statistics(model)  # layer 0: its input is the image, which no BatchNorm layer changes
    seen = precise_bn.recompute(model, images().split(4), CPU)  # 3 micro-batches of 4
    first = precise_bn.bn_layers(model)[0]
    assert seen == 12
    torch.testing.assert_close(first.running_mean, expected[0], **TOLERANCE)
    torch.testing.assert_close(first.running_var, expected[1], **TOLERANCE)


@pytest.mark.numerics
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
    assert all(m.momentum == 0.03 for m in precise_bn.bn_layers(model))  # Ultralytics' momentum, back after the pass
    assert all(torch.isfinite(v).all() for v in after)


def test_precise_bn_is_auto_or_a_count_of_images():
    from yoloaccum.config import settings as config
    from yoloaccum.errors import UserError

    assert config.resolve([]).precise_bn == "auto"
    assert config.resolve(["precise_bn=32"]).precise_bn == 32 and config.resolve(["precise_bn=0"]).precise_bn == 0
    with pytest.raises(UserError, match="precise_bn=some is not an integer or one of auto"):
        config.resolve(["precise_bn=some"])
    with pytest.raises(UserError, match="must not be negative"):
        config.resolve(["precise_bn=-1"])


@pytest.mark.numerics
@pytest.mark.slow
def test_two_ranks_give_the_statistics_of_one_process(tmp_path):
    out = tmp_path / "ranks.pt"
    cmd = [
        sys.executable,
        "-m",
        "torch.distributed.run",
        "--standalone",
        "--nproc_per_node=2",
        str(REPO / "tests/ddp_precise_bn.py"),
        str(out),
    ]
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


@pytest.mark.numerics
@pytest.mark.slow
def test_training_is_the_same_with_and_without_precise_statistics(tmp_path, run_cli):
    """The recompute reads and writes only the EMA's statistics, and draws no random number that training uses:
    with augmentation on, the trained weights are bitwise those of precise_bn=0."""
    data = shapes_yaml(tmp_path, num_train=24, num_val=4)
    # EXACT's settings with augmentation and validation back on, on the tiny model (bitwise within one model), and
    # BatchNorm training: bn=frozen refuses a recompute
    dropped = {"model", "plots", "mosaic", "fliplr", "hsv_h", "scale", "translate", "val", "bn"}
    args = [*PLUMBING, *(a for a in EXACT if a.split("=")[0] not in dropped), "bn=batch"]
    for n in (0, 16):
        r = run_cli(
            "train",
            f"data={data}",
            f"project={tmp_path}",
            f"name=pbn{n}",
            *args,
            "batch=8",
            "nbs=16",
            f"precise_bn={n}",
            env=SERIAL,
            timeout=600,
        )
        assert r.returncode == 0, r.stdout[-2000:] + r.stderr[-3000:]
    assert torch.equal(final_weights(tmp_path / "pbn0"), final_weights(tmp_path / "pbn16"))


def _draw_settings(data, tmp_path, **changes):
    from yoloaccum.config import settings as config

    settings = {
        "data": str(data),
        "model": "yolo26n.yaml",
        "imgsz": 64,
        "batch": 4,
        "precise_bn": 10,
        "workers": 0,
        "plots": False,
        "project": str(tmp_path),
        **changes,
    }
    return config.resolve(overrides=settings)


def _random_states():
    import random

    import numpy as np

    return random.getstate(), np.random.get_state()[1].tolist(), torch.get_rng_state().tolist()


def test_the_kept_images_are_drawn_from_the_seed_alone_and_leave_training_random_states(tmp_path):
    """The trainer draws precise_bn's images once and keeps them: drawing them again gives the same images (so a
    resumed run recomputes over the same ones), and drawing them leaves every random state training uses."""
    from yoloaccum.data import datasets as data
    from yoloaccum.training.trainer import Trainer

    cfg = _draw_settings(shapes_yaml(tmp_path, num_train=12, num_val=4), tmp_path)
    trainer = Trainer.from_config(cfg)
    step = trainer.precise_bn
    before = _random_states()
    step.recompute()
    assert _random_states() == before
    assert step.images.shape == (10, 3, 64, 64) and step.batch == precise_bn.BATCH
    assert torch.equal(step.images, data.precise_bn_images(cfg, trainer.parts.spec, 10, 0, 1))
    torch.manual_seed(123)  # another moment of training: the draws do not depend on it
    assert torch.equal(step.images, data.precise_bn_images(cfg, trainer.parts.spec, 10, 0, 1))


def test_the_images_are_the_same_on_any_number_of_ranks(tmp_path):
    """Every rank draws the same N augmented images and keeps its share, so 2 ranks' statistics are 1 process's."""
    from yoloaccum.data import datasets as data

    cfg = _draw_settings(shapes_yaml(tmp_path, num_train=12, num_val=4), tmp_path, precise_bn=9)
    spec = data.load_spec(cfg.data)
    one, first, second = (data.precise_bn_images(cfg, spec, 9, rank, world) for rank, world in ((0, 1), (0, 2), (1, 2)))
    assert one.shape == (9, 3, 64, 64) and first.shape[0] == 5 and second.shape[0] == 4
    assert torch.equal(one[0::2], first) and torch.equal(one[1::2], second)


def test_augmented_images_follow_the_recipe_and_plain_ones_are_letterboxed(tmp_path):
    """precise_bn_aug draws the recipe's augmentation, mosaic included (mosaic=0 draws other images); without it the
    images are the letterboxed ones inference sees, whatever the recipe's augmentation."""
    from yoloaccum.data import datasets as data

    yaml_file = shapes_yaml(tmp_path, num_train=12, num_val=4)
    spec = data.load_spec(yaml_file)

    def draw(**changes):
        return data.precise_bn_images(_draw_settings(yaml_file, tmp_path, **changes), spec, 10, 0, 1)

    mosaic, single = draw(), draw(mosaic=0.0)
    plain = draw(precise_bn_aug=False)
    assert not torch.equal(mosaic, single) and not torch.equal(mosaic, plain)
    assert torch.equal(plain, draw(precise_bn_aug=False, mosaic=0.0, hsv_v=0.0))


@pytest.mark.numerics
def test_one_batch_of_all_images_gives_each_layer_what_it_sees_at_inference():
    """With one micro-batch of all the images, every layer's running statistics are the mean and variance, over all
    images, of its input in eval mode, every layer before it normalising with its own new statistics: what inference
    sees. (With smaller micro-batches, upstream layers normalise with each micro-batch's statistics.)

    Exactly so up to one convention: training mode normalises with the biased variance, and running_var keeps the
    unbiased one, a factor count / (count - 1) apart (1.02 for the 2 x 2 maps of 12 images at 64 px; 1.0002 for 256
    images at 160 px). So inference here reads the biased variance, as the pass normalised."""
    model = make_model()
    precise_bn.recompute(model, [images()], CPU)
    layers = precise_bn.bn_layers(model)
    unbiased = {layer: layer.running_var.clone() for layer in layers}
    seen: dict[torch.nn.Module, torch.Tensor] = {}

    def biased(layer, inputs):
        count = inputs[0].numel() // inputs[0].shape[1]
        layer.running_var.copy_(unbiased[layer] * (count - 1) / count)
        seen.setdefault(layer, inputs[0].clone())

    hooks = [layer.register_forward_pre_hook(biased) for layer in layers]
    with torch.no_grad():
        model(images())  # eval mode: what inference sees
    for h in hooks:
        h.remove()
    assert model.training is False and len(seen) == len(layers)
    for layer in layers:
        var, mean = torch.var_mean(seen[layer].double(), dim=(0, 2, 3))
        # float32 rounding through some 60 layers upstream, each normalising in another order than the pass did:
        # up to 2e-5 on this machine for means near 0; a wrong statistic (another batch's) is off by 1e-2 or more
        torch.testing.assert_close(layer.running_mean, mean.float(), rtol=1e-4, atol=5e-5)
        torch.testing.assert_close(unbiased[layer], var.float(), rtol=1e-4, atol=5e-5)


class _SmallDevice(torch.nn.Module):
    """A model on a device that holds `fits` images at a time: larger inputs raise what CUDA raises."""

    def __init__(self, fits: int):
        super().__init__()
        self.fits, self.conv, self.bn, self.sizes = fits, torch.nn.Conv2d(3, 4, 3), torch.nn.BatchNorm2d(4), []

    def forward(self, x):
        if x.shape[0] > self.fits:
            raise torch.OutOfMemoryError("CUDA out of memory (this test's device holds few images)")
        self.sizes.append(x.shape[0])
        return self.bn(self.conv(x))


@pytest.mark.numerics
def test_out_of_memory_halves_the_micro_batch_and_the_statistics_stay_those_of_all_images():
    pixels = torch.randint(0, 256, (12, 3, 16, 16), dtype=torch.uint8, generator=torch.Generator().manual_seed(0))
    small, large = _SmallDevice(fits=3), _SmallDevice(fits=12)
    large.load_state_dict(small.state_dict())
    assert precise_bn.recompute_images(small, pixels, CPU, batch=12) == 3  # 12, then 6, then 3 fit
    assert small.sizes == [3, 3, 3, 3]
    assert precise_bn.recompute_images(large, pixels, CPU, batch=12) == 12
    torch.testing.assert_close(small.bn.running_mean, large.bn.running_mean, **TOLERANCE)
    torch.testing.assert_close(small.bn.running_var, large.bn.running_var, **TOLERANCE)


def test_a_rank_without_images_keeps_the_statistics_and_still_joins():
    """precise_bn=1 on 2 ranks leaves one rank no image: it runs no forward pass but still reaches the all-reduce
    (here a world of one, whose sums of nothing keep every layer's statistics)."""
    model = make_model()
    before = [layer.running_var.clone() for layer in precise_bn.bn_layers(model)]
    assert precise_bn.recompute_images(model, torch.zeros(0, 3, 64, 64, dtype=torch.uint8), CPU) == precise_bn.BATCH
    assert all(torch.equal(b, layer.running_var) for b, layer in zip(before, precise_bn.bn_layers(model)))
