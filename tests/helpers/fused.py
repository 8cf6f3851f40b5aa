"""What the fused-layer tests (test_fused_*.py) share: a fixed seed per test (an autouse fixture the test files
import) and a fused model paired with a checkpointed copy."""
import copy
import warnings

import pytest
import torch
from torch.utils._python_dispatch import TorchDispatchMode

import ckpt_ext
from ckpt_ext import fuse

from helpers.hf_models import make_model


@pytest.fixture(autouse=True)
def _seed():
    torch.manual_seed(0)


def _checkpointed_pair(family, every, layers=3, dropout=0.2):
    model = fuse(make_model(family, dropout=dropout, layers=layers)).train()
    ck = copy.deepcopy(model)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", FutureWarning)  # transformers' is_gradient_checkpointing rename
        ckpt_ext.enable_checkpointing(ck, every=every)
    return model, ck


class CountKernels(TorchDispatchMode):
    """Counts the GEMMs (keep.GEMM_OPS) and the attention kernels with a log-sum-exp (keep.LSE_OPS) a region runs:
    what a replay skips at each recompute level."""

    def __init__(self):
        super().__init__()
        self.gemms = self.attention = 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        from ckpt_ext.keep import GEMM_OPS, LSE_OPS
        self.gemms += func in GEMM_OPS
        self.attention += func in LSE_OPS
        return func(*args, **(kwargs or {}))

