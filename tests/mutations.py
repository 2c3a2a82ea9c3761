# ruff: noqa: E501  (the mutations quote lines of the package as they are)
"""Mutations of the exactness and equivalence code, each with the test that must catch it: applied one at a time to
the package, the test run, the code put back. `python tests/mutations.py` runs them all (about 40 min on 2 cores), or
give the numbers of some; benchmarks/records/mutations.md keeps their runs' results. Not collected by pytest (no test_ prefix).
"""

import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
# (what the mutation breaks, file, the code, the mutated code, the test that must fail)
MUTATIONS = [
    (
        "loss.py: the window normaliser left out (norm=window behaves as per micro-batch sums)",
        "yoloaccum/core/loss.py",
        "factor = world * window_counts[0] / window_counts[1 + j].clamp(min=1)",
        "factor = float(world)",
        "tests/test_equivalence.py::test_window_norm_equals_one_big_batch",
    ),
    (
        "loss.py: normalised by the target-score sum of the last micro-batch's share (counts halved)",
        "yoloaccum/core/loss.py",
        "factor = world * window_counts[0] / window_counts[1 + j].clamp(min=1)",
        "factor = world * window_counts[0] / (2 * window_counts[1 + j]).clamp(min=1)",
        "tests/test_equivalence.py::test_window_norm_equals_one_big_batch",
    ),
    (
        "engine.py: EMA updated twice per step",
        "yoloaccum/core/engine.py",
        "                self.ema.update(self.raw_model)",
        "                self.ema.update(self.raw_model)\n                self.ema.update(self.raw_model)",
        "tests/test_engine.py::test_ema_updates_once_per_step",
    ),
    (
        "engine.py: gradients not zeroed after the step (windows leak into each other)",
        "yoloaccum/core/engine.py",
        "        self.scaler.update()  # after unscale_, also when skipped: an overflow halves the scale (a no-op without AMP)\n        self.optimizer.zero_grad(set_to_none=True)",
        "        self.scaler.update()  # after unscale_, also when skipped: an overflow halves the scale (a no-op without AMP)",
        "tests/test_engine.py::test_windows_of_micro_batches_equal_a_plain_loop_of_big_batch_steps",
    ),
    (
        "engine.py: a skipped window keeps its BatchNorm statistics",
        "yoloaccum/core/engine.py",
        "        if self.window_buffers is not None:  # None: a window of micro-steps alone, as tests drive the engine\n            self.window_buffers.put_back()",
        "        pass",
        "tests/test_engine.py::test_a_skipped_window_leaves_batchnorm_statistics_as_they_were_at_its_start",
    ),
    (
        "schedule.py: steps one micro-batch late",
        "yoloaccum/core/schedule.py",
        "        return ni % nb in self._end_sets[ni // nb]",
        "        return (ni - 1) % nb in self._end_sets[(ni - 1) // nb] and ni > 0",
        "tests/test_engine.py::test_steps_exactly_at_window_ends_including_the_short_last_window",
    ),
    (
        "engine.py: clipped with a max norm 10x too large",
        "yoloaccum/core/engine.py",
        "max_norm=self.clip_grad, foreach=True)",
        "max_norm=self.clip_grad * 10, foreach=True)",
        "tests/test_engine.py::test_clip_once_per_step_on_the_accumulated_gradient",
    ),
    (
        "micro_batch.py: a cut batch's labels keep their image index (not shifted to the part)",
        "yoloaccum/core/micro_batch.py",
        '            part["batch_idx"] = part["batch_idx"] - a',
        '            part["batch_idx"] = part["batch_idx"]',
        "tests/test_backoff.py::test_split_batch_cuts_a_detection_batch_by_image_with_its_labels",
    ),
    (
        "schedule.py: weight decay not scaled by batch x accumulate / nbs",
        "yoloaccum/core/schedule.py",
        "        return self.base_weight_decay * self.batch * self.accumulate / self.nbs",
        "        return self.base_weight_decay",
        "tests/test_engine.py::test_weight_decay_in_the_optimizer_is_the_scheduled_value",
    ),
    (
        "state.py: the random states not restored on resume",
        "yoloaccum/training/state.py",
        '        restore_rng(mine["rng"], parts.loader.generator)  # last: building the run consumed random numbers',
        "        pass",
        "tests/test_resume.py::test_resume_after_epoch_2_ends_with_the_uninterrupted_weights",
    ),
    (
        "norm.py: bn=window falls back to each micro-batch's own statistics (r = 1, d = 0)",
        "yoloaccum/batchnorm/window.py",
        "        r = torch.div(window_invstd, invstd_b).clamp_(1 / R_MAX, R_MAX)\n        d = torch.addcmul(window_shift, mean_b, window_invstd).clamp_(-D_MAX, D_MAX)",
        "        r = torch.ones_like(invstd_b)\n        d = torch.zeros_like(mean_b)",
        "tests/test_norm.py::test_every_micro_batch_of_a_window_is_normalised_as_one_batch_of_its_images",
    ),
    (
        "engine.py: DDP all-reduces after every micro-batch (no_sync ignored)",
        "yoloaccum/core/engine.py",
        "            skip = self.no_sync and not (last_in_window and j == len(parts) - 1)",
        "            skip = False",
        "tests/test_distributed.py::test_gradients_all_reduce_once_per_window",
    ),
    (
        "precise_bn.py: each rank keeps its own statistics (no all-reduce)",
        "yoloaccum/batchnorm/precise.py",
        "    flat = distributed.all_reduce_sum(torch.cat([m.sums.flatten() for m in moments]), ctx)  # one collective",
        "    flat = torch.cat([m.sums.flatten() for m in moments])",
        "tests/test_precise_bn.py::test_two_ranks_give_the_statistics_of_one_process",
    ),
    (
        "data.py: mosaic's pool sized by the micro-batch whatever mosaic_buffer says",
        "yoloaccum/data/datasets.py",
        "    dataset.max_buffer_length = min((dataset.ni, window * 8, 1000)) if dataset.augment else 0",
        "    dataset.max_buffer_length = min((dataset.ni, batch * 8, 1000)) if dataset.augment else 0",
        "tests/test_train.py::test_mosaic_draws_from_the_windows_images_and_the_run_says_so",
    ),
    (
        "engine.py: an out-of-memory back-off leaves the dropped window's BatchNorm statistics in place (_drop_window, which the AMP overflow replay shares)",
        "yoloaccum/core/engine.py",
        "        self.micro_batches_in_window = 0\n        if self.window_buffers is not None:\n            self.window_buffers.put_back()",
        "        self.micro_batches_in_window = 0",
        "tests/test_backoff.py::test_a_window_that_runs_out_of_memory_ends_as_a_run_at_half_the_micro_batch",
    ),
    (
        "engine.py: an out-of-memory back-off keeps the dropped window's gradients (its first batches count twice; _drop_window, which the AMP overflow replay shares)",
        "yoloaccum/core/engine.py",
        "        self.optimizer.zero_grad(set_to_none=True)\n        self.window_counts.tensor.zero_()",
        "        self.window_counts.tensor.zero_()",
        "tests/test_backoff.py::test_cli_back_off_ends_with_the_weights_of_a_run_at_half_the_micro_batch",
    ),
    (
        "compiler.py: the warm-up sets an open window's gradients aside and does not put them back",
        "yoloaccum/model/compiler.py",
        "    finally:\n        for p, g in zip(model.parameters(), grads):\n            p.grad = g",
        "    finally:\n        pass",
        "tests/test_compile.py::test_a_compiled_window_equals_the_eager_one_and_compiling_changes_nothing",
    ),
    (
        "compiler.py: whether every rank compiled is counted on this rank alone (no all-reduce): 2 ranks never compile",
        "yoloaccum/model/compiler.py",
        "    if distributed.all_reduce_sum(compiled_ranks, ctx).item() < ctx.world_size:",
        "    if compiled_ranks.item() < ctx.world_size:",
        "tests/test_compile.py::test_two_compiled_ranks_end_where_two_eager_ranks_do",
    ),
    (
        "loss.py: the world size left out of the normaliser (DDP's average over ranks not turned back into a sum)",
        "yoloaccum/core/loss.py",
        "factor = world * window_counts[0] / window_counts[1 + j].clamp(min=1)",
        "factor = window_counts[0] / window_counts[1 + j].clamp(min=1)",
        "tests/test_distributed.py::test_two_ranks_accumulating_equal_one_process_with_the_whole_batch",
    ),
    (
        "batches.py: each rank shuffles with its own seed (seed + rank), so the ranks' slices are not one permutation",
        "yoloaccum/data/batches.py",
        "    sampler = EpochBatchSampler(len(dataset), micro_batch * world, rank, world, seed=cfg.seed)",
        "    sampler = EpochBatchSampler(len(dataset), micro_batch * world, rank, world, seed=cfg.seed + rank)",
        "tests/test_distributed.py::test_torchrun_cli_run_ends_with_the_big_batch_weights",
    ),
    (
        "engine.py: the window's last micro-batch also runs under no_sync (gradients never all-reduced)",
        "yoloaccum/core/engine.py",
        "            skip = self.no_sync and not (last_in_window and j == len(parts) - 1)",
        "            skip = self.no_sync",
        "tests/test_distributed.py::test_two_nodes_of_one_rank_each_end_with_the_big_batch_weights",
    ),
    (
        "state.py: on resume every rank restores rank 0's own state (random states, mosaic buffer)",
        "yoloaccum/training/state.py",
        "    mine = ranks[rank] if rank < len(ranks) else None",
        "    mine = ranks[0]",
        "tests/test_distributed.py::test_torchrun_resume_after_sigint_ends_with_the_uninterrupted_weights",
    ),
    (
        "engine.py: the iteration index not offset by the epoch (every epoch steps as epoch 0's warmup ramp)",
        "yoloaccum/core/engine.py",
        "            self.ni = ni = epoch * nb + i",
        "            self.ni = ni = i",
        "tests/test_engine.py::test_steps_follow_the_warmup_ramp",
    ),
    (
        "engine.py: each micro-batch's loss divided by accumulate (the window's gradient a mean over micro-batches)",
        "yoloaccum/core/engine.py",
        "        self.scaler.scale(loss).backward()",
        "        self.scaler.scale(loss / self.schedule.accumulate).backward()",
        "tests/test_engine.py::test_four_micro_batches_of_8_equal_one_batch_of_32",
    ),
    (
        "engine.py: lr and momentum set after the optimizer step (each step uses the previous window's)",
        "yoloaccum/core/engine.py",
        "        optim.set_hyperparameters(self.optimizer, self.schedule, ni)  # also for a skipped step: schedule.csv logs it\n        if finite:\n            self.scaler.step(self.optimizer)  # the gradients are finite, so it steps",
        "        if finite:\n            self.scaler.step(self.optimizer)  # the gradients are finite, so it steps\n        optim.set_hyperparameters(self.optimizer, self.schedule, ni)  # also for a skipped step: schedule.csv logs it",
        "tests/test_engine.py::test_learning_rate_and_momentum_at_each_step_come_from_the_schedule",
    ),
    (
        "loss.py: norm=micro ignored, the loss always normalised per window (the control's contrast gone)",
        "yoloaccum/core/loss.py",
        "        self.norm = norm",
        '        self.norm = "window"',
        "tests/test_equivalence.py::test_micro_norm_measurably_differs",
    ),
    (
        "loss.py: norm=micro averages the criterion's box, cls and dfl terms instead of summing them",
        "yoloaccum/core/loss.py",
        "            loss = loss.sum()",
        "            loss = loss.mean()",
        "tests/test_equivalence.py::test_micro_norm_is_ultralytics_per_micro_batch",
    ),
    (
        "loss.py: each micro-batch's loss left divided by its own target-score sum (then by the window's again)",
        "yoloaccum/core/loss.py",
        "                loss = loss + b.weight() * vec.sum() * b.tss.last.clamp(min=1)",
        "                loss = loss + b.weight() * vec.sum()",
        "tests/test_equivalence.py::test_single_micro_batch_window_is_ultralytics",
    ),
    (
        "loss.py: the branches' parameters split by the one-to-many head instead of the one-to-one head",
        "yoloaccum/core/loss.py",
        '        one2one = {id(p) for m in getattr(head, "one2one", {}).values() for p in m.parameters()}',
        '        one2one = {id(p) for m in getattr(head, "one2many", {}).values() for p in m.parameters()}',
        "tests/test_equivalence.py::test_yolo26_branches_train_disjoint_parameters",
    ),
    (
        "loss.py: each micro-batch's sum divided by its images (a per-image mean), so the split changes the window",
        "yoloaccum/core/loss.py",
        "                loss = loss + b.weight() * vec.sum() * b.tss.last.clamp(min=1)",
        "                loss = loss + b.weight() * vec.sum() * b.tss.last.clamp(min=1) / num_images",
        "tests/test_equivalence.py::test_window_gradient_does_not_depend_on_the_split",
    ),
    (
        "engine.py: gradients zeroed before every micro-batch's backward (only the window's last one is stepped on)",
        "yoloaccum/core/engine.py",
        "        self.micro_batches_in_window += 1\n        self.scaler.scale(loss).backward()",
        "        self.micro_batches_in_window += 1\n        self.optimizer.zero_grad(set_to_none=True)\n        self.scaler.scale(loss).backward()",
        "tests/test_exact_cli.py::test_accumulated_run_ends_with_the_big_batch_weights",
    ),
    (
        "components.py: the run's loss built with norm=window whatever norm= says (the control's contrast gone)",
        "yoloaccum/training/components.py",
        "    criterion = loss.WindowLoss(raw_model, cfg.norm)",
        '    criterion = loss.WindowLoss(raw_model, "window")',
        "tests/test_exact_cli.py::test_micro_norm_run_visibly_disagrees",
    ),
    (
        "norm.py: bn=window normalises with the window's statistics as constants (no gradient through any statistics)",
        "yoloaccum/batchnorm/window.py",
        "        return _Renormalize.apply(x, self.weight, self.bias, self.window_invstd, self.window_shift, self.eps)",
        "        return F.batch_norm(x, self.window_mean, self.window_var, self.weight, self.bias, False, 0.0, self.eps)",
        "tests/test_norm.py::test_the_gradient_goes_through_the_micro_batchs_statistics_as_batch_renormalization",
    ),
    (
        "norm.py: bn=window's weight gradient forgets that gamma scales r and d (dgamma of plain BatchNorm)",
        "yoloaccum/batchnorm/window.py",
        "        return dx, dscale.mul_(r).addcmul_(dshift, d), dshift, None, None, None",
        "        return dx, dscale, dshift, None, None, None",
        "tests/test_norm.py::test_the_gradient_goes_through_the_micro_batchs_statistics_as_batch_renormalization",
    ),
    (
        "engine.py: a back-off replays the window without passing over it again (the buffers put back hold the last window's statistics; _run_window_again, which the AMP overflow replay shares)",
        "yoloaccum/core/engine.py",
        "        if self.window_statistics is not None:\n            self.window_statistics(self.window_ahead)\n",
        "",
        "tests/test_norm.py::test_a_back_off_normalises_over_the_same_images_as_a_run_at_half_the_micro_batch",
    ),
    (
        "model.py: grad_checkpointing recomputes on the buffers as they are (BatchNorm statistics updated twice)",
        "yoloaccum/model/build.py",
        "    return _buffers_kept(block, first_saw), _buffers_as_before(block, first_saw)",
        "    return contextlib.nullcontext(), contextlib.nullcontext()",
        "tests/test_model.py::test_checkpointed_blocks_give_the_same_gradients_and_batchnorm_statistics",
    ),
    (
        "compiler.py: the warm-up's forward not under kept() (its blank images stay in BatchNorm's running statistics)",
        "yoloaccum/model/compiler.py",
        "        with kept(model):\n            img = torch.zeros(",
        "        with torch.enable_grad():\n            img = torch.zeros(",
        "tests/test_compile.py::test_a_compiled_window_equals_the_eager_one_and_compiling_changes_nothing",
    ),
    (
        "window.py: the statistics pass sees only the window's first batch (no look-ahead)",
        "yoloaccum/core/window.py",
        "        while not schedule.steps_after(first + window[-1][0]):",
        "        while False:",
        "tests/test_norm.py::test_the_engine_passes_over_each_window_before_its_first_micro_step",
    ),
    (
        "epoch_end.py: last.pt keeps rank 0's own state for every rank",
        "yoloaccum/training/epoch_end.py",
        "        return [self.of(), *self.gathered[1:]]",
        "        return [self.of()] * len(self.gathered)",
        "tests/test_distributed.py::test_torchrun_resume_after_sigint_ends_with_the_uninterrupted_weights",
    ),
    (
        "norm.py: the running statistics take the window's biased variance",
        "yoloaccum/batchnorm/window.py",
        "            unbiased = var * count / (count - 1) if self._count > 1 else var",
        "            unbiased = var",
        "tests/test_norm.py::test_the_running_statistics_take_one_step_per_window_as_a_real_batch_does",
    ),
    (
        "norm.py: a chunk's variance kept as batch_norm leaves it, unbiased (the window's too large by n / (n - 1))",
        "yoloaccum/batchnorm/window.py",
        "        var = self._chunk_var.double() * ((count - 1) / count if count > 1 else 0.0)  # batch_norm keeps it unbiased",
        "        var = self._chunk_var.double()",
        "tests/test_norm.py::test_every_micro_batch_of_a_window_is_normalised_as_one_batch_of_its_images",
    ),
    (
        "norm.py: the statistics reduced over all ranks' images (an all-reduce in the pass) instead of each rank's own",
        "yoloaccum/batchnorm/window.py",
        "        mean = total / count\n        var = (total_sq / count - mean * mean).clamp(min=0)\n        self.window_mean.copy_(mean)",
        "        if torch.distributed.is_initialized():\n            torch.distributed.all_reduce(s := torch.stack([count, total, total_sq]))\n            count, total, total_sq = s\n        mean = total / count\n        var = (total_sq / count - mean * mean).clamp(min=0)\n        self.window_mean.copy_(mean)",
        "tests/test_norm.py::test_two_ranks_normalise_with_their_own_images_statistics",
    ),
    (
        "schedule.py: biases' warmup lr rises from 0 instead of falling from warmup_bias_lr",
        "yoloaccum/core/schedule.py",
        "[self.warmup_bias_lr if bias else 0.0, target]",
        "[0.0, target]",
        "tests/test_parity.py::test_schedule_matches_ultralytics_trainer",
    ),
    (
        "precise_bn.py: BatchNorm's unbiased running variance read as the biased one",
        "yoloaccum/batchnorm/precise.py",
        "        var = layer.running_var.double() * (count - 1) / count",
        "        var = layer.running_var.double()",
        "tests/test_precise_bn.py::test_micro_batches_give_the_statistics_of_one_batch",
    ),
    (
        "precise_bn.py: the sum of squares kept without each micro-batch's mean (the variance between them lost)",
        "yoloaccum/batchnorm/precise.py",
        "        self.sums[2] += (var + mean * mean) * count",
        "        self.sums[2] += var * count",
        "tests/test_precise_bn.py::test_the_variance_includes_the_variance_between_micro_batches",
    ),
    (
        "trainer.py: precise_bn recomputes the training model's statistics instead of the EMA's",
        "yoloaccum/training/trainer.py",
        "epoch_end.PreciseBN(count, p.cfg, p.spec, p.ctx, p.ema, p.frozen)",
        'epoch_end.PreciseBN(count, p.cfg, p.spec, p.ctx, type("EMA", (), {"ema": p.raw_model}), p.frozen)',
        "tests/test_precise_bn.py::test_training_is_the_same_with_and_without_precise_statistics",
    ),
    (
        "precise_bn.py: the recomputed running variance stored biased (BatchNorm keeps the unbiased one)",
        "yoloaccum/batchnorm/precise.py",
        "        var = (total_sq / count - mean * mean).clamp(min=0) * count / (count - 1)",
        "        var = (total_sq / count - mean * mean).clamp(min=0)",
        "tests/test_precise_bn.py::test_one_batch_of_all_images_gives_each_layer_what_it_sees_at_inference",
    ),
    (
        "precise_bn.py: the images cut into `batch` chunks instead of chunks of `batch` images (split and chunk confused)",
        "yoloaccum/batchnorm/precise.py",
        "            parts = images.split(batch) if len(images) else ()",
        "            parts = images.chunk(batch) if len(images) else ()",
        "tests/test_precise_bn.py::test_out_of_memory_halves_the_micro_batch_and_the_statistics_stay_those_of_all_images",
    ),
    (
        "training_state.py: a run stopped mid-epoch resumes that epoch from its first micro-batch",
        "yoloaccum/training/training_state.py",
        '        self.position = (state["position"]["epoch"], state["position"]["batch"])',
        '        self.position = (state["position"]["epoch"], 0)',
        "tests/test_resume.py::test_sigint_mid_epoch_saves_and_resumes_to_the_same_weights",
    ),
    (
        "engine.py: a window reopened from last.pt (remainder=carry) without its accumulated gradients",
        "yoloaccum/core/engine.py",
        "            p.grad = None if g is None else torch.empty_like(p).copy_(g)  # empty_like: the parameter's layout",
        "            p.grad = None",
        "tests/test_resume.py::test_remainder_carry_keeps_a_window_left_open_at_a_stop",
    ),
    (
        "norm.py: bn=window's input gradient that of a constant normalisation, not through the micro-batch's statistics",
        "yoloaccum/batchnorm/window.py",
        "        if not affine:\n            return dx, None, None, None, None, None",
        "        dx = grad * (scale * invstd_b).view(1, -1, 1, 1)\n        if not affine:\n            return dx, None, None, None, None, None",
        "tests/test_norm.py::test_a_window_of_one_micro_batch_is_batchnorm_gradient_included",
    ),
    (
        "engine.py: bn=window's statistics pass runs at the epoch's first window only (later windows use stale statistics)",
        "yoloaccum/core/engine.py",
        "            if upcoming:  # bn=window:",
        "            if upcoming and i == start:  # bn=window:",
        "tests/test_norm.py::test_with_one_micro_batch_a_window_the_engine_trains_as_bn_batch",
    ),
    (
        "engine.py: bn=window's window carried past a stop reopened from last.pt without its accumulated gradients",
        "yoloaccum/core/engine.py",
        "            p.grad = None if g is None else torch.empty_like(p).copy_(g)  # empty_like: the parameter's layout",
        "            p.grad = None",
        "tests/test_norm.py::test_cli_bn_window_resumes_bitwise_with_remainder_carry_and_saves_a_plain_model",
    ),
]


def main(only: set[int]) -> int:
    missed = 0
    for i, (what, path, old, new, test) in enumerate(MUTATIONS):
        if only and i not in only:
            continue
        file = ROOT / path
        text = file.read_text()
        assert text.count(old) == 1, f"{path}: the code to mutate for '{what}' changed; update MUTATIONS"
        file.write_text(text.replace(old, new))
        try:
            r = subprocess.run(
                [sys.executable, "-m", "pytest", "-q", "-x", "-p", "no:cacheprovider", test],
                cwd=ROOT,
                capture_output=True,
                text=True,
                timeout=1200,
            )
        finally:
            file.write_text(text)
        caught = r.returncode == 1  # a failed test; 0 passed, anything else an error in collecting or running it
        missed += not caught
        print(f"{i:2d} {'caught' if caught else 'MISSED'} (pytest exit {r.returncode}): {what} <- {test}", flush=True)
    return 1 if missed else 0


if __name__ == "__main__":
    import argparse

    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument(
        "numbers", nargs="*", type=int, help=f"which mutations (0 to {len(MUTATIONS) - 1}); all if none"
    )
    sys.exit(main(set(parser.parse_args().numbers)))
