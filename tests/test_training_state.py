"""The run's own state on small fakes: early stopping as Ultralytics' EarlyStopping decides, the best fitness, and
the state_dict round trip last.pt relies on."""

import random

import pytest

from yoloaccum.training.training_state import TrainingState


@pytest.mark.parametrize("patience", [0, 1, 3, 5])
def test_early_stopping_decides_as_ultralytics_early_stopping(patience):
    from ultralytics.utils.torch_utils import EarlyStopping

    rng = random.Random(patience)
    for _ in range(20):
        ours, theirs = TrainingState(patience=patience), EarlyStopping(patience=patience)
        for epoch in range(1, 30):
            fitness = None if rng.random() < 0.1 else round(rng.random(), 2)
            if fitness is not None:
                ours.record_validation({"fitness": fitness})
            assert ours.stop_early(epoch) == theirs(epoch, ours.fitness)
            assert (ours.stop_best_epoch, ours.possible_stop) == (theirs.best_epoch, theirs.possible_stop)


def test_the_best_fitness_is_zero_before_any_validation_and_then_the_highest():
    s = TrainingState(patience=10)
    assert s.note_best() and s.best_fitness == 0.0
    for fitness, best in ((0.3, True), (0.2, False), (0.3, True), (0.5, True)):
        s.record_validation({"fitness": fitness, "metrics/mAP50(B)": fitness})
        assert s.note_best() is best
    assert s.best_fitness == 0.5 and s.metrics["metrics/mAP50(B)"] == 0.5


def test_state_dict_round_trips():
    s = TrainingState(patience=5, position=(3, 7))
    s.record_validation({"fitness": 0.4})
    s.note_best()
    s.stop_early(3)
    again = TrainingState(patience=5)
    again.load_state_dict(s.state_dict())
    assert again.state_dict() == s.state_dict() and again.position == (3, 7)
