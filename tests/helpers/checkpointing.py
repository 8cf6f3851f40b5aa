"""What the checkpoint tests share: the two checkpoint functions side by side, the block sizes, the
CPU pool's stats and a fixture turning warnings into errors."""
import functools
import gc
import warnings

import pytest
import torch.utils.checkpoint as torch_checkpoint

import ckpt_ext

ckpt = functools.partial(ckpt_ext.checkpoint, use_reentrant=False)  # as torch_ckpt: omitted, both warn
torch_ckpt = functools.partial(torch_checkpoint.checkpoint, use_reentrant=False)

DIM = 19
BATCH = 6


def cpu_pool():
    gc.collect()
    return ckpt_ext.pool_stats("cpu")


@pytest.fixture
def no_warnings():
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        yield


def apply_module(module, x):
    return module(x)
