"""What the kernel tests (test_kernels_*.py) share: the dtypes every kernel is tested in, and a fixed seed per
test (an autouse fixture the test files import)."""
import pytest
import torch

DTYPES = [torch.float32, torch.bfloat16, torch.float16]


@pytest.fixture(autouse=True)
def _seed():
    torch.manual_seed(0)
