# ruff: noqa: E501  (the mutations quote lines of the package as they are)
"""Mutations of the exactness and equivalence code, each with the test that must catch it: applied one at a time to
the package, the test run, the code put back. `python tests/mutations.py` runs them all (a few minutes), or give the
numbers of some; docs/testing.md lists them with their last result. Not collected by pytest (no test_ prefix).
"""

import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
# (what the mutation breaks, file, the code, the mutated code, the test that must fail)
MUTATIONS = [
    (
        "loss.py: the window normaliser left out (norm=window behaves as per micro-batch sums)",
        "yoloaccum/loss.py",
        "factor = world * window_counts[0] / window_counts[1 + j].clamp(min=1)",
        "factor = float(world)",
        "tests/test_equivalence.py::test_window_norm_equals_one_big_batch",
    ),
    (
        "loss.py: normalised by the target-score sum of the last micro-batch's share (counts halved)",
        "yoloaccum/loss.py",
        "factor = world * window_counts[0] / window_counts[1 + j].clamp(min=1)",
        "factor = world * window_counts[0] / (2 * window_counts[1 + j]).clamp(min=1)",
        "tests/test_equivalence.py::test_window_norm_equals_one_big_batch",
    ),
    (
        "engine.py: EMA updated twice per step",
        "yoloaccum/engine.py",
        "                self.ema.update(self.raw_model)",
        "                self.ema.update(self.raw_model)\n                self.ema.update(self.raw_model)",
        "tests/test_engine.py::test_ema_updates_once_per_step",
    ),
    (
        "engine.py: gradients not zeroed after the step (windows leak into each other)",
        "yoloaccum/engine.py",
        "        self.scaler.update()  # after unscale_, also when skipped: an overflow halves the scale (a no-op without AMP)\n        self.optimizer.zero_grad(set_to_none=True)",
        "        self.scaler.update()  # after unscale_, also when skipped: an overflow halves the scale (a no-op without AMP)",
        "tests/test_engine.py::test_windows_of_micro_batches_equal_a_plain_loop_of_big_batch_steps",
    ),
    (
        "engine.py: a skipped window keeps its BatchNorm statistics",
        "yoloaccum/engine.py",
        "        if self.window_buffers is not None:  # None: a window of micro-steps alone, as tests drive the engine\n            self.window_buffers.put_back()",
        "        pass",
        "tests/test_engine.py::test_a_skipped_window_leaves_batchnorm_statistics_as_they_were_at_its_start",
    ),
    (
        "schedule.py: steps one micro-batch late",
        "yoloaccum/schedule.py",
        "        return ni % nb in self._end_sets[ni // nb]",
        "        return (ni - 1) % nb in self._end_sets[(ni - 1) // nb] and ni > 0",
        "tests/test_engine.py::test_steps_exactly_at_window_ends_including_the_short_last_window",
    ),
    (
        "engine.py: clipped with a max norm 10x too large",
        "yoloaccum/engine.py",
        "max_norm=self.clip_grad, foreach=True)",
        "max_norm=self.clip_grad * 10, foreach=True)",
        "tests/test_engine.py::test_clip_once_per_step_on_the_accumulated_gradient",
    ),
    (
        "batches.py: a cut batch's labels keep their image index (not shifted to the part)",
        "yoloaccum/batches.py",
        '            part["batch_idx"] = part["batch_idx"] - a',
        '            part["batch_idx"] = part["batch_idx"]',
        "tests/test_backoff.py::test_split_batch_cuts_a_detection_batch_by_image_with_its_labels",
    ),
    (
        "schedule.py: weight decay not scaled by batch x accumulate / nbs",
        "yoloaccum/schedule.py",
        "        return self.base_weight_decay * self.batch * self.accumulate / self.nbs",
        "        return self.base_weight_decay",
        "tests/test_engine.py::test_weight_decay_in_the_optimizer_is_the_scheduled_value",
    ),
    (
        "state.py: the random states not restored on resume",
        "yoloaccum/state.py",
        '        restore_rng(mine["rng"], t.loader.generator)  # last: building the run consumed random numbers',
        "        pass",
        "tests/test_resume.py::test_resume_after_epoch_2_ends_with_the_uninterrupted_weights",
    ),
    (
        "norm.py: bn=window falls back to each micro-batch's own statistics",
        "yoloaccum/norm.py",
        "            pooled = torch.addmv(moments_b * images, self.queue_moments.t(), w.kept) / w.total",
        "            pooled = moments_b",
        "tests/test_norm.py::test_the_windows_last_micro_batch_is_normalised_with_the_statistics_of_all_its_images",
    ),
    (
        "engine.py: DDP all-reduces after every micro-batch (no_sync ignored)",
        "yoloaccum/engine.py",
        "            skip = self.no_sync and not (last_in_window and j == len(parts) - 1)",
        "            skip = False",
        "tests/test_distributed.py::test_gradients_all_reduce_once_per_window",
    ),
    (
        "precise_bn.py: each rank keeps its own statistics (no all-reduce)",
        "yoloaccum/precise_bn.py",
        "    flat = distributed.all_reduce_sum(torch.cat([m.sums.flatten() for m in moments]), ctx)  # one collective",
        "    flat = torch.cat([m.sums.flatten() for m in moments])",
        "tests/test_precise_bn.py::test_two_ranks_give_the_statistics_of_one_process",
    ),
    (
        "data.py: mosaic's pool sized by the micro-batch whatever mosaic_buffer says",
        "yoloaccum/data.py",
        "    dataset.max_buffer_length = min((dataset.ni, window * 8, 1000)) if dataset.augment else 0",
        "    dataset.max_buffer_length = min((dataset.ni, batch * 8, 1000)) if dataset.augment else 0",
        "tests/test_train.py::test_mosaic_draws_from_the_windows_images_and_the_run_says_so",
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
            r = subprocess.run([sys.executable, "-m", "pytest", "-q", "-x", "-p", "no:cacheprovider", test], cwd=ROOT,
                               capture_output=True, text=True, timeout=1200)  # fmt: skip
        finally:
            file.write_text(text)
        caught = r.returncode == 1  # a failed test; 0 passed, anything else an error in collecting or running it
        missed += not caught
        print(f"{i:2d} {'caught' if caught else 'MISSED'} (pytest exit {r.returncode}): {what} <- {test}", flush=True)
    return 1 if missed else 0


if __name__ == "__main__":
    sys.exit(main({int(a) for a in sys.argv[1:]}))
