"""The fused layers' CPU GEMM layout policy (csrc/layers/gemm.cpp, `_C.cpu_gemm_layout`).

Where ATen's reduced-precision CPU GEMM is slow in some operand layouts (no oneDNN bfloat16: AVX2 CPUs),
the layers run every product in a fast layout, forward and backward, through autograd functions of their
own. "auto" applies it where it pays; "nt" applies it to every floating-point CPU product, so that these
tests reach the path on any CPU (an AVX-512 CI machine included); "off" runs ATen's calls as they are,
so that on an AVX2 machine the plain path stays tested too. Each mode reruns the parity tests of the
fused layers that the path touches: float32 parity with Hugging Face (every parameter's gradient),
bfloat16 and autocast error within a multiple of Hugging Face's own, checkpointed == not checkpointed
bitwise with dropout (the replay runs the same products), LoRA parity with peft.
"""
import os
import subprocess
import sys

import pytest
import torch

import ckpt_ext
from ckpt_ext import _C

pytest.importorskip("transformers")
import test_fused_parity as parity  # noqa: E402
import test_fused_segment as segment  # noqa: E402
from helpers.hf_models import embeds_call, fused_copy, inputs_for, make_model  # noqa: E402
from helpers.fused import _seed  # noqa: E402,F401  (an autouse fixture)

MODES = ["nt", "off"]
FAMILIES = ["bert", "gpt2", "llama-gqa"]


@pytest.fixture
def layout(request):
    before = _C.cpu_gemm_layout(request.param)
    yield request.param
    _C.cpu_gemm_layout(before)


def _node_names(out):
    seen, todo, names = set(), [out.grad_fn], set()
    while todo:
        fn = todo.pop()
        if fn is None or fn in seen:
            continue
        seen.add(fn)
        names.add(type(fn).__name__ if fn.name() is None else fn.name())
        todo.extend(f for f, _ in fn.next_functions)
    return names


@pytest.mark.parametrize("layout", MODES, indirect=True)
@pytest.mark.parametrize("family", FAMILIES)
def test_the_policy_decides_which_products_run(family, layout):
    """Under "nt" the layers' GEMMs are the layout functions' nodes (no AddmmBackward / MmBackward of
    theirs); under "off" they are ATen's."""
    model = fused_copy(make_model(family, dropout=0.1)).train()
    _, out = embeds_call(model, family, inputs_for(family, padding=False))
    names = " ".join(sorted(_node_names(out)))
    # attention with dropout on CPU: ckpt_ext's fused node (its products through the same layout functions, without
    # autograd nodes of their own), or the written-out ops' MatmulFunction nodes where it is switched off
    ours = "::LinearFunction>" in names and ("::MatmulFunction>" in names or "::FusedPhiloxAttentionFunction>" in names)
    aten = "AddmmBackward" in names or "MmBackward" in names
    assert (ours, aten) == ((True, False) if layout == "nt" else (False, True)), names


@pytest.mark.parametrize("layout", MODES, indirect=True)
@pytest.mark.parametrize("padding", [False, True], ids=["nomask", "padding"])
@pytest.mark.parametrize("family", parity.FAMILIES)
def test_float32_parity_with_hugging_face(family, padding, layout):
    parity.test_training_parity_outputs_and_all_grads(family, padding, "cpu")


@pytest.mark.parametrize("layout", MODES, indirect=True)
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize("family", FAMILIES)
def test_low_precision_error_within_a_multiple_of_hugging_faces(family, dtype, layout):
    if dtype == torch.float16 and family != "gpt2":
        pytest.skip("one float16 CPU case is enough (slow CPU float16 GEMMs)")
    parity.test_low_precision_error_within_a_multiple_of_hugging_faces(family, dtype, "cpu")


@pytest.mark.parametrize("layout", MODES, indirect=True)
@pytest.mark.parametrize("padding", [False, True], ids=["nomask", "padding"])
@pytest.mark.parametrize("family", FAMILIES)
def test_autocast_error_within_a_multiple_of_hugging_faces(family, padding, layout):
    parity.test_autocast_error_within_a_multiple_of_hugging_faces(family, padding, "cpu", torch.bfloat16)


@pytest.mark.parametrize("layout", ["nt"], indirect=True)
@pytest.mark.parametrize("family", FAMILIES)
def test_replay_is_bit_identical_with_dropout(family, layout):
    """Checkpointed == not checkpointed bitwise with dropout everywhere, float32 and autocast."""
    segment.test_checkpointed_equals_not_checkpointed_exactly_with_dropout(family, 2, "cpu")
    parity.test_autocast_checkpointed_equals_not_checkpointed_exactly_with_dropout(family, "cpu", torch.bfloat16)


@pytest.mark.parametrize("layout", ["nt"], indirect=True)
@pytest.mark.parametrize("family", ["bert", "gpt2", "llama"])
def test_lora_parity_with_peft_and_replay(family, layout):
    lora = pytest.importorskip("test_lora_fused")
    lora.test_parity_with_peft(family, 0.0, "cpu")
    lora.test_dropout_checkpointing_replays_bit_identical(family, 0.2, "cpu")


def _layouts(rows, cols, dtype):
    """The same [rows, cols] values as a row-major tensor, a transposed view and a strided slice."""
    base = torch.randn(rows, cols, dtype=torch.float32)
    return [base.to(dtype), base.t().contiguous().t().to(dtype),
            torch.stack([base, base], -1).to(dtype)[..., 0]]


def _grads(fn, *tensors):
    leaves = [t.detach().clone().requires_grad_() if t is not None else None for t in tensors]
    out = fn(*leaves)
    g = torch.linspace(-1, 1, out.numel()).view(out.shape)
    out.float().backward(g)
    return [out.float()] + [t.grad.float() if t is not None else None for t in leaves]


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_products_in_every_operand_layout_match_aten(dtype):
    """The layout functions themselves (_C._gemm_linear / _C._gemm_matmul under "nt"), on operands in
    every layout -- row-major, transposed, strided; 2-D, 3-D and 4-D; with and without bias -- against
    ATen's linear / matmul of the same values: outputs and gradients of every operand (float32: 1e-5
    relative; bfloat16: both round their products to bfloat16 once, so within bfloat16's resolution)."""
    tol = dict(rtol=1e-5, atol=1e-5) if dtype == torch.float32 else dict(rtol=2e-2, atol=2e-2)
    before = _C.cpu_gemm_layout("nt")
    try:
        for x in _layouts(12, 24, dtype):
            x = x.view(3, 4, 24) if x.is_contiguous() else x
            for w in _layouts(16, 24, dtype):
                for b in (None, torch.randn(16, dtype=dtype)):
                    got = _grads(_C._gemm_linear, x, w, b)
                    ref = _grads(lambda x, w, b: torch.nn.functional.linear(x, w, b), x, w, b)
                    for i, (g, r) in enumerate(zip(got, ref)):
                        if r is not None:
                            torch.testing.assert_close(g, r, **tol, msg=lambda m: f"linear item {i}: {m}")
        a4 = torch.randn(2, 3, 5, 8, dtype=dtype)
        for a in (a4, a4.transpose(-2, -1).contiguous().transpose(-2, -1), torch.randn(2, 5, 3, 8, dtype=dtype).transpose(1, 2)):
            b4 = torch.randn(2, 3, 8, 7, dtype=dtype)
            for b in (b4, b4.transpose(-2, -1).contiguous().transpose(-2, -1), torch.randn(2, 8, 3, 7, dtype=dtype).transpose(1, 2)):
                got = _grads(_C._gemm_matmul, a, b)
                ref = _grads(torch.matmul, a, b)
                for i, (g, r) in enumerate(zip(got, ref)):
                    torch.testing.assert_close(g, r, **tol, msg=lambda m: f"matmul item {i}: {m}")
    finally:
        _C.cpu_gemm_layout(before)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_linear_with_bias_is_at_linears_product_bit_for_bit(dtype):
    """With nn.Linear's layouts (row-major input and weight) the layout function's forward is ATen's own
    product: the bias is added by the GEMM (addmm, one rounding), as at::linear adds it, not in a second
    pass that would round a bfloat16 output twice."""
    before = _C.cpu_gemm_layout("nt")
    try:
        x, w, b = torch.randn(3, 40, 96, dtype=dtype), torch.randn(64, 96, dtype=dtype), torch.randn(64, dtype=dtype)
        assert torch.equal(_C._gemm_linear(x, w, b), torch.nn.functional.linear(x, w, b))
    finally:
        _C.cpu_gemm_layout(before)


def test_products_under_autocast_cast_as_autocast_does():
    """Under CPU autocast: float32 operands are cast to bfloat16 (the output is bfloat16) and the gradients
    arrive in float32, as for ATen's linear under autocast; the values agree with it."""
    before = _C.cpu_gemm_layout("nt")
    try:
        x, w, b = torch.randn(4, 6, 24), torch.randn(16, 24), torch.randn(16)
        runs = []
        for fn in (_C._gemm_linear, torch.nn.functional.linear):
            leaves = [t.clone().requires_grad_() for t in (x, w, b)]
            with torch.autocast("cpu", dtype=torch.bfloat16):
                out = fn(*leaves)
            assert out.dtype == torch.bfloat16
            out.float().sum().backward()
            assert all(t.grad.dtype == torch.float32 for t in leaves)
            runs.append([out.float()] + [t.grad for t in leaves])
        for g, r in zip(*runs):
            torch.testing.assert_close(g, r, rtol=2e-2, atol=2e-2)
    finally:
        _C.cpu_gemm_layout(before)


def test_setting_is_validated_and_read_from_the_environment():
    before = _C.cpu_gemm_layout()
    assert before in ("auto", "nt", "off")
    with pytest.raises(RuntimeError, match="must be 'auto', 'nt' or 'off', got 'fast'"):
        _C.cpu_gemm_layout("fast")
    assert _C.cpu_gemm_layout() == before
    code = "import ckpt_ext; print(ckpt_ext._C.cpu_gemm_layout())"
    env = dict(os.environ, CKPT_EXT_CPU_GEMM_LAYOUT="off")
    r = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=300)
    assert r.returncode == 0 and r.stdout.strip() == "off", r.stderr[-2000:]
    env["CKPT_EXT_CPU_GEMM_LAYOUT"] = "fast"
    r = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=300)
    assert r.returncode != 0 and "CKPT_EXT_CPU_GEMM_LAYOUT" in r.stderr, r.stderr[-2000:]
