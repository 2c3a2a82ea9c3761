"""What BatchNorm loses at small micro-batches, measured inside a real batch of 64 (a diagnostic, not a feature).

    python benchmarks/bn_ghost.py --variants batch ghost brn const pooled --seeds 0 1 2
    python benchmarks/bn_ghost.py --report     # benchmarks/bn_ghost.md from the runs kept in bn_ghost.json

Accumulating micro-batches of 2 to a window of 64 gives exactly the gradient of a batch of 64 whose BatchNorm layers
normalise each pair of images on its own ("ghost" batches of 2, Hoffer et al. 2017): the loss is a sum, and each
micro-batch's forward sees only its own images. So the small-batch gap can be studied at batch 64, where every image
of the window is in memory, by changing what a ghost batch normalises with and what its gradient goes through. Each
variant trains the fidelity benchmark's shapes recipe at batch 64 (nbs 64) with every BatchNorm2d replaced:

- batch:  plain BatchNorm over the 64 images (the real batch of 64);
- ghost:  each pair of images normalised with its own statistics, gradient through them (= batch 2, bn=batch);
- brn:    the forward with the 64 images' statistics, the gradient through the pair's (Batch Renormalization with
          r and d from the whole window: an ideal bn=window, with no stale statistics);
- const:  the forward with the 64 images' statistics, no gradient through any statistics;
- pooled: the forward with the 64 images' statistics, the gradient through the pair's share of them (what a
          micro-batch can differentiate when the rest of the window's statistics are known constants).

The runs, the validation with and without precise statistics and the pairing are fidelity.py's (shapes set, 30
epochs, seeds paired with the plain batch of 64 of this benchmark). Results: benchmarks/bn_ghost.{md,json}.
"""

from __future__ import annotations

import argparse
import json
import sys
import tempfile
from pathlib import Path

import torch
import torch.nn.functional as F
from torch import nn

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))
VARIANTS = ("batch", "ghost", "brn", "const", "pooled")
R_MAX, D_MAX = 3.0, 5.0  # as yoloaccum/batchnorm/window.py


class GhostBN2d(nn.BatchNorm2d):
    """A BatchNorm2d whose training forward normalises groups of `group` images as `variant` says (module docstring).
    Its state is a plain BatchNorm2d's; in eval mode, or with `active` off, it is one."""

    variant = "batch"
    group = 2
    active = True

    def __reduce_ex__(self, protocol):
        """Copied and saved as a plain BatchNorm2d: the EMA (a deepcopy) and the checkpoints hold Ultralytics' own
        layers, which load without trusting this module."""
        plain = nn.BatchNorm2d.__new__(nn.BatchNorm2d)
        plain.__dict__.update(self.__dict__)
        return plain.__reduce_ex__(protocol)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        n, c, h, w = x.shape
        g = self.group
        if not (self.training and GhostBN2d.active) or self.variant == "batch" or n % g or n == g:
            return super().forward(x)
        groups = n // g
        with torch.no_grad():  # the whole batch's statistics: the running statistics follow them
            var_f, mean_f = torch.var_mean(x, dim=(0, 2, 3), correction=0)
            count = n * h * w
            self.running_mean.lerp_(mean_f, self.momentum)
            self.running_var.lerp_(var_f * count / (count - 1), self.momentum)
            self.num_batches_tracked.add_(1)
        weight, bias = self.weight, self.bias
        if self.variant == "const":
            scale = weight / (var_f + self.eps).sqrt()
            return (x - mean_f.view(1, c, 1, 1)) * scale.view(1, c, 1, 1) + bias.view(1, c, 1, 1)
        if self.variant == "pooled":
            x5 = x.reshape(groups, g, c, h, w)
            m1_g = x5.mean((1, 3, 4))  # (groups, c)
            m2_g = (x5 * x5).mean((1, 3, 4))
            m1 = mean_f + (m1_g - m1_g.detach()) / groups  # the value is the whole batch's; the gradient its share
            m2 = (var_f + mean_f * mean_f) + (m2_g - m2_g.detach()) / groups
            inv = (m2 - m1 * m1 + self.eps).rsqrt()
            y = (x5 - m1.view(groups, 1, c, 1, 1)) * (inv * weight).view(groups, 1, c, 1, 1) + bias.view(1, 1, c, 1, 1)
            return y.reshape(n, c, h, w)
        # ghost and brn: the groups side by side as channels, so that one batch_norm call normalises each on its own
        xg = x.reshape(groups, g, c, h, w).transpose(0, 1).reshape(g, groups * c, h, w)
        wg, bg = weight.repeat(groups), bias.repeat(groups)
        if self.variant == "brn":
            with torch.no_grad():
                var_g, mean_g = torch.var_mean(xg, dim=(0, 2, 3), correction=0)
                std_f = (var_f + self.eps).sqrt().repeat(groups)
                r = ((var_g + self.eps).sqrt() / std_f).clamp_(1 / R_MAX, R_MAX)
                d = ((mean_g - mean_f.repeat(groups)) / std_f).clamp_(-D_MAX, D_MAX)
            wg, bg = wg * r, torch.addcmul(bg, wg, d)
        else:
            assert self.variant == "ghost", self.variant
        y = F.batch_norm(xg, None, None, wg, bg, True, 0.0, self.eps)
        return y.reshape(g, groups, c, h, w).transpose(0, 1).reshape(n, c, h, w)


def replace_batchnorm(model: nn.Module) -> int:
    found = [(p, name, m) for p in model.modules() for name, m in p.named_children() if type(m) is nn.BatchNorm2d]
    for parent, name, bn in found:
        new = GhostBN2d(bn.num_features, eps=bn.eps, momentum=bn.momentum, device=bn.running_mean.device)
        new.load_state_dict(bn.state_dict())
        new.train(bn.training)
        setattr(parent, name, new)
    return len(found)


def train_and_evaluate(variant: str, group: int, seed: int, folder: str) -> dict:
    """In a fresh process (fidelity's): the shapes recipe at batch 64 with every BatchNorm2d a GhostBN2d."""
    import fidelity

    from yoloaccum.model import build as model_

    GhostBN2d.variant, GhostBN2d.group = variant, group
    build = model_.build

    def ghost_build(*args, **kwargs):
        model = build(*args, **kwargs)
        assert replace_batchnorm(model), "no BatchNorm2d to replace"
        return model

    model_.build = ghost_build
    final_metrics = fidelity.final_metrics

    def plain_metrics(*args, **kwargs):  # validation and precise statistics see plain BatchNorm layers
        GhostBN2d.active = False
        return final_metrics(*args, **kwargs)

    fidelity.final_metrics = plain_metrics
    return fidelity.train_and_evaluate("yoloaccum", {"batch": 64}, fidelity.FULL, seed, folder)


def main() -> None:
    from bench import fresh
    from fidelity import FULL, METRICS, paired

    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--variants", nargs="+", choices=VARIANTS, default=list(VARIANTS))
    parser.add_argument("--group", type=int, default=2, help="images per ghost batch (the micro-batch it stands for)")
    parser.add_argument("--seeds", nargs="+", type=int, default=[0, 1, 2])
    parser.add_argument("--report", action="store_true", help="only write the report from the runs kept")
    a = parser.parse_args()
    store = HERE / "bn_ghost.json"
    runs = json.loads(store.read_text()) if store.exists() else {}
    work = Path(tempfile.mkdtemp(prefix="bn-ghost-"))
    names = [v if v == "batch" else f"{v}-{a.group}" for v in a.variants]
    for seed in [] if a.report else a.seeds:  # seed-major: a stopped benchmark still has complete pairs
        for variant, name in zip(a.variants, names):
            if str(seed) in runs.get(name, {}):
                continue
            print(f"{name} seed {seed} ...", flush=True)
            result = fresh("train_and_evaluate", variant, a.group, seed, str(work / name), module="bn_ghost")
            runs.setdefault(name, {})[str(seed)] = result
            print(f"  {result['seconds']:.0f} s, raw {result['raw']}, precise {result['precise']}", flush=True)
            store.write_text(json.dumps(runs, indent=1))
    lines = [
        "# BatchNorm inside a real batch of 64 (`python benchmarks/bn_ghost.py`)",
        "",
        f"Shapes set, {FULL['images']} training images at {FULL['imgsz']} px, yolo26n, {FULL['epochs']} epochs, "
        "batch 64 (nbs 64); each BatchNorm2d replaced by the variant (module docstring). Final mAP50-95 with precise "
        "statistics (256 images, drawn with mosaic, as precise_bn does); paired difference against `batch` of the "
        "same seed.",
        "",
        "| variant | seeds | mAP50-95 per seed | mean | ratio to batch | paired diff [95%] | as trained, mean |",
        "| --- | --- | --- | --- | --- | --- | --- |",
    ]
    ref = runs.get("batch", {})
    for name in sorted(runs, key=lambda k: (k != "batch", k)):
        seeds = sorted(runs[name], key=int)
        values = [runs[name][s]["precise"][METRICS[1]] for s in seeds]
        raw = [runs[name][s]["raw"][METRICS[1]] for s in seeds]
        both = [s for s in seeds if s in ref]
        mine = [runs[name][s]["precise"][METRICS[1]] for s in both]
        theirs = [ref[s]["precise"][METRICS[1]] for s in both]
        d = paired(mine, theirs) if name != "batch" and len(both) > 1 else None
        mean = sum(values) / len(values)
        ref_mean = sum(ref[s]["precise"][METRICS[1]] for s in both) / len(both) if both else float("nan")
        ratio = mean / ref_mean if both else float("nan")
        interval = f"{d['mean']:+.3f} [{d['low']:+.3f}, {d['high']:+.3f}]" if d else "–"
        lines.append(
            f"| {name} | {','.join(seeds)} | {' '.join(f'{v:.3f}' for v in values)} | {mean:.3f} | "
            f"{ratio:.2f} | {interval} | {sum(raw) / len(raw):.3f} |"
        )
    (HERE / "bn_ghost.md").write_text("\n".join(lines) + "\n")
    print("\n".join(lines))


if __name__ == "__main__":
    main()
