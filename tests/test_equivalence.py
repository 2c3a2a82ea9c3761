"""Proof that k micro-batches equal one big batch: the window-normalised gradient against Ultralytics' own loss.

The reference is Ultralytics' criterion called once on the big batch (its normaliser is then the whole batch's T).
The accumulated side goes through yoloaccum's WindowLoss and its end-of-window rescale, as the trainer runs them.
"""

import copy

import pytest
import torch

import yoloaccum.config.ultra  # noqa: F401  (ultralytics offline before it is imported)
from yoloaccum.config import settings as config
from yoloaccum.config.ultra import ultralytics_args
from yoloaccum.core.loss import WindowLoss
from yoloaccum.model import build as model_

pytestmark = pytest.mark.numerics  # every test here is an exactness proof: `make numerics`

IMGSZ = 64
# Objects per image for 4 micro-batches of 2 images: unequal counts, and one image (the 3rd) with no objects.
OBJECTS = [[5, 3], [1, 0], [2, 7], [1, 1]]


def make_model(yaml: str) -> torch.nn.Module:
    from ultralytics.nn.tasks import DetectionModel

    torch.manual_seed(0)
    m = DetectionModel(yaml, nc=3, verbose=False)
    m.args = ultralytics_args(config.resolve())
    m.train()
    model_.set_bn_mode(m, "frozen")  # BatchNorm statistics would otherwise differ per micro-batch
    return m


def micro_batch(objects: list[int], seed: int) -> dict:
    g = torch.Generator().manual_seed(seed)
    idx, cls, boxes = [], [], []
    for i, n in enumerate(objects):
        idx += [i] * n
        cls += torch.randint(0, 3, (n,), generator=g).tolist()
        xy = torch.rand(n, 2, generator=g) * 0.6 + 0.2
        wh = torch.rand(n, 2, generator=g) * 0.3 + 0.1
        boxes.append(torch.cat([xy, wh], 1))
    return {
        "img": torch.rand(len(objects), 3, IMGSZ, IMGSZ, generator=g),
        "batch_idx": torch.tensor(idx, dtype=torch.float32),
        "cls": torch.tensor(cls, dtype=torch.float32).view(-1, 1),
        "bboxes": torch.cat(boxes) if boxes else torch.zeros(0, 4),
    }


def concat(batches: list[dict]) -> dict:
    offset, idx = 0, []
    for b in batches:
        idx.append(b["batch_idx"] + offset)
        offset += b["img"].shape[0]
    return {
        "img": torch.cat([b["img"] for b in batches]),
        "batch_idx": torch.cat(idx),
        "cls": torch.cat([b["cls"] for b in batches]),
        "bboxes": torch.cat([b["bboxes"] for b in batches]),
    }


def grads(m: torch.nn.Module) -> torch.Tensor:
    return torch.cat([(p.grad if p.grad is not None else torch.zeros_like(p)).flatten() for p in m.parameters()])


def reference_gradient(m: torch.nn.Module, batch: dict) -> torch.Tensor:
    """Ultralytics, unmodified: its criterion on the whole batch, loss summed as its trainer does."""
    m.zero_grad(set_to_none=True)
    criterion = m.init_criterion()
    loss, _ = criterion(m(batch["img"]), batch)
    loss.sum().backward()
    return grads(m)


def accumulated_gradient(m: torch.nn.Module, batches: list[dict], norm: str) -> torch.Tensor:
    """yoloaccum: one backward per micro-batch, then the window's normalisation, as Trainer.step does."""
    m.zero_grad(set_to_none=True)
    window_loss = WindowLoss(m, norm)
    counts = 0
    for b in batches:
        loss, _, c = window_loss(m(b["img"]), b)
        loss.backward()
        counts = counts + c
    window_loss.normalise_gradients(counts, world=1)
    return grads(m)


def relative_error(a: torch.Tensor, b: torch.Tensor) -> float:
    return ((a - b).abs().max() / b.abs().max()).item()


@pytest.fixture(scope="module", params=["yolo11n.yaml", "yolo26n.yaml"])
def model_and_batches(request):
    batches = [micro_batch(n, seed) for seed, n in enumerate(OBJECTS)]
    return make_model(request.param), batches


def test_window_norm_equals_one_big_batch(model_and_batches):
    m, batches = model_and_batches
    reference = reference_gradient(m, concat(batches))
    accumulated = accumulated_gradient(m, batches, "window")
    # float32 sums in a different order: agreement to ~1e-7 is typical; 1e-5 leaves room and still catches any
    # normaliser error, which is of the order of the per-micro-batch T spread (>1e-2 here).
    assert relative_error(accumulated, reference) <= 1e-5


def test_micro_norm_measurably_differs(model_and_batches):
    m, batches = model_and_batches
    reference = reference_gradient(m, concat(batches))
    accumulated = accumulated_gradient(m, batches, "micro")
    assert relative_error(accumulated, reference) > 1e-3


def test_micro_norm_is_ultralytics_per_micro_batch(model_and_batches):
    """norm=micro is exactly Ultralytics' loop: the sum of its per-micro-batch losses, back-propagated."""
    m, batches = model_and_batches
    m.zero_grad(set_to_none=True)
    criterion = m.init_criterion()
    for b in batches:
        criterion(m(b["img"]), b)[0].sum().backward()
    expected = grads(m)
    assert torch.equal(accumulated_gradient(m, batches, "micro"), expected)


def test_single_micro_batch_window_is_ultralytics(model_and_batches):
    """A window of one micro-batch normalises exactly as Ultralytics does on that batch."""
    m, batches = model_and_batches
    reference = reference_gradient(m, batches[0])
    assert relative_error(accumulated_gradient(m, batches[:1], "window"), reference) <= 1e-6


def test_yolo26_branches_train_disjoint_parameters():
    """The one-to-one head sees detached features: each branch's loss reaches only its own parameters."""
    m = make_model("yolo26n.yaml")
    window_loss = WindowLoss(m, "window")
    assert len(window_loss.branches) == 2
    one2many, one2one = window_loss.param_groups()
    assert one2many and one2one and not {id(p) for p in one2many} & {id(p) for p in one2one}
    b = micro_batch([3, 2], seed=0)
    preds = m(b["img"])
    for branch, own, other in ((0, one2many, one2one), (1, one2one, one2many)):
        m.zero_grad(set_to_none=True)
        br = window_loss.branches[branch]
        vec = br.loss.get_assigned_targets_and_loss(preds[br.key], b)[1]
        vec.sum().backward(retain_graph=True)
        assert all(p.grad is None or not p.grad.any() for p in other)
        assert any(p.grad is not None and p.grad.any() for p in own)


def test_window_gradient_does_not_depend_on_the_split():
    """The same 8 images split 4x2 or 2x4 give the same window gradient."""
    m = make_model("yolo11n.yaml")
    images = [micro_batch([n], seed=i) for i, n in enumerate([5, 3, 1, 0, 2, 7, 1, 1])]
    by_two = [concat(images[i : i + 2]) for i in range(0, 8, 2)]
    by_four = [concat(images[i : i + 4]) for i in range(0, 8, 4)]
    a = accumulated_gradient(copy.deepcopy(m), by_two, "window")
    b = accumulated_gradient(copy.deepcopy(m), by_four, "window")
    assert relative_error(a, b) <= 1e-5
