"""What the tests of bad input (test_errors_*.py) share.

Each case checks three things: the exception type, a message that names what was wrong (and, where
there is one, what to do), and that nothing was left behind -- the pool holds what it held before, no
replay is marked as running, the global RNG did not move, and a model keeps the checkpointing setup it
had before the failed call (see the autouse fixture, which the test files import, and `_setup_of` in
test_errors_checkpointing.py). Cases that are not errors (a non-contiguous input, a no-op) check that
they give the right answer instead.
"""
import gc

import pytest
import torch

import ckpt_ext


@pytest.fixture(autouse=True)
def nothing_left_behind():
    gc.collect()
    before = ckpt_ext.pool_stats("cpu")
    rng = torch.get_rng_state()
    grad_mode = torch.is_grad_enabled()
    yield
    gc.collect()
    after = ckpt_ext.pool_stats("cpu")
    assert after["in_use_bytes"] == before["in_use_bytes"], "a failed call left slots in the pool"
    assert after["live_slots"] == before["live_slots"]
    assert not ckpt_ext.is_recomputing()
    assert torch.is_grad_enabled() == grad_mode


def _same_rng(before):
    assert torch.equal(torch.get_rng_state(), before), "a failed call moved the global RNG"


def _raises(exc, match, fn, *args, **kwargs):
    rng = torch.get_rng_state()
    with pytest.raises(exc, match=match):
        fn(*args, **kwargs)
    _same_rng(rng)

