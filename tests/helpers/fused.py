"""What the fused-layer tests (test_fused_*.py) share: a fixed seed per test (an autouse fixture the test files
import) and a fused model paired with a checkpointed copy."""
import copy
import warnings

import pytest
import torch

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
