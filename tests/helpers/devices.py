"""Which devices the tests run on: CPU always, CUDA where a GPU is visible (marked ``cuda``)."""
import pytest
import torch

HAS_CUDA = torch.cuda.is_available()
requires_cuda = pytest.mark.skipif(not HAS_CUDA, reason="needs a CUDA device")
DEVICES = ["cpu", pytest.param("cuda", marks=[requires_cuda, pytest.mark.cuda])]
