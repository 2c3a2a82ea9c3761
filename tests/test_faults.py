"""YOLOACCUM_FAULT parsed, and installed on an engine only when it is set (the trained runs that use it are in
test_resume, test_distributed, test_backoff and test_out_of_memory)."""

import types

import pytest

from yoloaccum.errors import UserError
from yoloaccum.training import faults


def engine(rank: int = 0):
    return types.SimpleNamespace(ctx=types.SimpleNamespace(rank=rank), iteration=lambda ni, batch, last: ni)


def test_without_the_variable_the_engine_is_left_as_it_is():
    e = engine()
    plain = e.iteration
    assert faults.install(e, environ={}) is None and e.iteration is plain


def test_the_fault_fires_at_its_iteration_and_rank_only():
    e = engine(rank=1)
    assert faults.install(e, environ={"YOLOACCUM_FAULT": "raise@3-:1"}) == faults.Fault("raise", 3, onwards=True)
    assert e.iteration(2, {}, False) == 2
    for ni in (3, 4):
        with pytest.raises(RuntimeError, match="injected failure at iteration 3"):
            e.iteration(ni, {}, False)
    other = engine(rank=0)
    assert faults.install(other, environ={"YOLOACCUM_FAULT": "raise@3:1"}) is None


@pytest.mark.parametrize("spec", ["boom@3", "raise", "raise@x", "raise@3:a"])
def test_a_malformed_spec_is_one_line(spec):
    with pytest.raises(UserError, match=r"is not KIND@NI\[-\]\[:RANK\] with KIND one of raise, nan"):
        faults.install(engine(), environ={"YOLOACCUM_FAULT": spec})
