"""What the property tests (test_properties_*.py, hypothesis) share: the settings of a property, the
tolerances, and one intra-op thread (an autouse fixture the test files import).

Tolerances: float32 1e-5 relative to the compared quantity's scale, as test_fused_parity.py and test_kernels_ops.py
(ops that miss it must be within 2x/3x PyTorch's own float32 error: small random rows are often
ill-conditioned); float64 1e-10 (Llama's reference RMSNorm is made to compute in float64, which Hugging
Face's does not); bfloat16/float16 ops within 2x/3x PyTorch's own error, test_kernels' scheme. Whole
layers are not drawn in bfloat16: slow on this CPU, and the kernels' bfloat16 error is covered op by op.

Found so far, each with a test here: a float32 softmax in float64 models' attention with dropout (fixed);
CPU norm kernels summing rows in float (fixed); rotary table gradients rounded twice in bfloat16 (fixed);
a tensor returned several times from ckpt_ext.checkpoint gets its gradient summed in another order (strict
xfail); eager attention's gradient through a fully masked query differs from Hugging Face's because torch's
CPU SDPA differs (strict xfail).

Reproducibility: every test is derandomized (its examples depend only on the test and the Hypothesis
version) and uses no example database, so CI runs the same examples every time and cannot go red on a
newly found example unrelated to the change under test. To hunt for new counter-examples, give a seed
(it overrides derandomize) and scale the number of examples:

    CKPT_EXT_PROPERTY_SCALE=10 pytest tests/test_properties_*.py --hypothesis-seed=$RANDOM

and turn what it finds into a fix and a regression test.
"""
import os

import pytest
import torch
from hypothesis import HealthCheck, settings

_SCALE = int(os.environ.get("CKPT_EXT_PROPERTY_SCALE", "1"))


def examples(n: int) -> settings:
    """Settings of one property: n examples (times CKPT_EXT_PROPERTY_SCALE), derandomized, no database."""
    return settings(max_examples=n * _SCALE, deadline=None, derandomize=True, database=None, print_blob=True,
                    suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large])


@pytest.fixture(autouse=True, scope="module")
def _one_thread():
    """Every example here is tiny: intra-op threads would only add synchronisation, which on a loaded machine
    costs milliseconds per operator (a [3, 13] GELU: 8 ms with 2 threads on a busy 2-core box, 36 us with 1)."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


TOL = {torch.float32: dict(rtol=1e-5, atol=1e-6), torch.float64: dict(rtol=1e-10, atol=1e-11)}
