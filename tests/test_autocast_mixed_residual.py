"""Autocast's float32 residual stream beside the GEMMs' bfloat16/float16 output, without casts (the last linear of a
GPT-2 / Llama-family layer, csrc/layers/residual_linear.cpp).

* Op level: ckpt_ext::bias_dropout_add with a bfloat16/float16 x beside a float32 residual (and float32 bias) equals
  the float path (x cast to float32 first) bit for bit, forward and backward: x's gradient is the float gradient's
  dropout rounded once to x's dtype, the bias's the float one. ckpt_ext::dropout(dtype=) equals dropout then
  .to(dtype). Dropout off and on, row lengths that are whole SIMD steps and ones that are not (odd sizes: the
  vector paths' tails and the CUDA kernel's scalar path). Other dtype mixes keep a clear error.
* Layer level: fused GPT-2, Llama and Qwen2 under CPU autocast bfloat16 give the same loss and every parameter's
  gradient, bit for bit, with _C.mixed_dtype_residual on (no casts) and off (the casts as before): fused alone,
  fused + enable_checkpointing (every=1, all layers in one segment, keep="gemms"), dropout off and on, a peft LoRA
  model, and one torch.compile case (fullgraph, no graph break).
* CUDA (marked `cuda`): the op and layer parity on the GPU.
"""
import copy

import pytest
import torch

import ckpt_ext
from ckpt_ext import _C, fuse, ops

import helpers.fused
from helpers.devices import requires_cuda
from helpers.fused import switched

LOWP = [torch.bfloat16, torch.float16]
SHAPES = [(4, 64), (3, 37), (2, 5, 100)]  # whole SIMD steps; odd (scalar tails, CUDA's unaligned path)


def mixed_residual(on):
    return switched(_C.mixed_dtype_residual, on)


def _inputs(shape, dtype, device, seed=0):
    g = torch.Generator().manual_seed(seed)
    x = (torch.randn(shape, generator=g) * 3).to(dtype).to(device)
    bias = (torch.randn(shape[-1], generator=g) * 0.5).to(device)
    residual = torch.randn(shape, generator=g).to(device)
    cot = torch.randn(shape, generator=g).to(device)
    return x, bias, residual, cot


def _op_parity(shape, dtype, p, with_bias, bias_grad, device):
    x, bias, residual, cot = _inputs(shape, dtype, device)
    runs = []
    for mixed in (True, False):
        xl = x.clone().requires_grad_()
        b = bias.clone().requires_grad_(bias_grad) if with_bias else None
        r = residual.clone().requires_grad_()
        out = ops.bias_dropout_add(xl if mixed else xl.float(), b, r, p, 11, 3)
        out.backward(cot)
        runs.append((out, xl.grad, None if b is None else b.grad, r.grad))
    (om, gxm, gbm, grm), (of, gxf, gbf, grf) = runs
    assert om.dtype == torch.float32
    assert gxm.dtype == dtype
    assert torch.equal(om, of)
    assert torch.equal(gxm, gxf)
    assert torch.equal(grm, grf)
    if with_bias and bias_grad:
        assert torch.equal(gbm, gbf)
    # x's gradient: the float gradient's dropout rounded once
    assert torch.equal(gxm, ops.dropout(cot, p, 11, 3).to(dtype))


@pytest.mark.parametrize("shape", SHAPES, ids=str)
@pytest.mark.parametrize("p", [0.0, 0.3], ids=["nodrop", "dropout"])
@pytest.mark.parametrize("dtype", LOWP, ids=str)
@pytest.mark.parametrize("bias", ["none", "frozen", "trained"])
def test_op_mixed_equals_the_float_path(shape, dtype, p, bias):
    _op_parity(shape, dtype, p, bias != "none", bias == "trained", "cpu")


@pytest.mark.parametrize("shape", SHAPES, ids=str)
@pytest.mark.parametrize("p", [0.0, 0.3, 1.0], ids=["nodrop", "dropout", "all"])
@pytest.mark.parametrize("dtype", LOWP, ids=str)
def test_dropout_into_a_lower_dtype_equals_dropout_then_cast(shape, dtype, p):
    x = torch.randn(shape, generator=torch.Generator().manual_seed(1)) * 5
    got = ops.dropout(x, p, 7, 2, dtype=dtype)
    assert got.dtype == dtype
    assert torch.equal(got, ops.dropout(x, p, 7, 2).to(dtype))
    # its gradient (a float32 x): the dropout of the incoming gradient in float32
    xg = x.clone().requires_grad_()
    cot = torch.randn(shape, generator=torch.Generator().manual_seed(2)).to(dtype)
    ops.dropout(xg, p, 7, 2, dtype=dtype).backward(cot)
    assert xg.grad.dtype == torch.float32
    assert torch.equal(xg.grad, ops.dropout(cot.float(), p, 7, 2))


def test_bad_dtype_combinations_keep_a_clear_error():
    x16, x32 = torch.randn(2, 8, dtype=torch.bfloat16), torch.randn(2, 8)
    with pytest.raises(RuntimeError, match=r"residual must have the dtype of x .*or be float32 with x in bfloat16"):
        ops.bias_dropout_add(x32, None, x16, 0.0, 0, 0)  # the stream lower than x
    with pytest.raises(RuntimeError, match="residual must have the dtype of x"):
        ops.bias_dropout_add(x16, None, x16.half(), 0.0, 0, 0)  # two low-precision dtypes
    with pytest.raises(RuntimeError, match="residual must have the dtype of x"):
        ops.bias_dropout_add(x32, None, x32.double(), 0.0, 0, 0)  # float64 stream: not autocast's
    with pytest.raises(RuntimeError, match=r"bias must have the dtype of residual"):
        ops.bias_dropout_add(x16, x16[0], x32, 0.0, 0, 0)  # bias in x's dtype beside a float32 stream
    with pytest.raises(RuntimeError, match=r"residual must have the shape of x"):
        ops.bias_dropout_add(x16, None, x32[:1], 0.0, 0, 0)
    with pytest.raises(RuntimeError, match=r"dtype must be x's .*bfloat16 / float16 for a float32 x"):
        ops.dropout(x16, 0.1, 0, 0, dtype=torch.float32)  # only down, from float32
    with pytest.raises(RuntimeError, match=r"dtype must be x's"):
        ops.dropout(x32, 0.1, 0, 0, dtype=torch.float64)
    # the fake kernels say the same under torch.compile's tracing
    with torch._subclasses.fake_tensor.FakeTensorMode():
        fx16, fx32 = torch.empty(2, 8, dtype=torch.bfloat16), torch.empty(2, 8)
        assert ops.bias_dropout_add(fx16, fx32[0], fx32, 0.1, 0, 0).dtype == torch.float32
        assert ops.dropout(fx32, 0.1, 0, 0, dtype=torch.float16).dtype == torch.float16
        with pytest.raises(RuntimeError, match="must have the dtype of"):
            ops.bias_dropout_add(fx32, None, fx16, 0.0, 0, 0)
        with pytest.raises(RuntimeError, match="dtype must be x's"):
            ops.dropout(fx16, 0.1, 0, 0, dtype=torch.float32)


def test_op_compiles_without_graph_breaks():
    x, bias, residual, _ = _inputs((3, 37), torch.bfloat16, "cpu")

    def f(x, b, r):
        return ops.bias_dropout_add(x, b, r, 0.2, 5, 1)

    torch._dynamo.reset()
    compiled = torch.compile(f, backend="aot_eager", fullgraph=True)
    xs = [x.clone().requires_grad_() for _ in range(2)]
    bs = [bias.clone().requires_grad_() for _ in range(2)]
    outs = [compiled(xs[0], bs[0], residual), f(xs[1], bs[1], residual)]
    assert torch.equal(outs[0], outs[1])
    for o in outs:
        o.sum().backward()
    assert torch.equal(xs[0].grad, xs[1].grad) and torch.equal(bs[0].grad, bs[1].grad)


# ---- layers ---------------------------------------------------------------------------------------------------------

transformers = pytest.importorskip("transformers")
from helpers.fused import (_seed, CHECKPOINTING, assert_identical_steps, autocast_step,  # noqa: E402,F401
                           checkpointed, lora_switch_steps)  # (_seed: an autouse fixture)
from helpers.hf_models import inputs_for, make_model  # noqa: E402

FAMILIES = ["gpt2", "llama", "qwen2"]


_step, _assert_identical = autocast_step, assert_identical_steps


CountCasts = helpers.fused.CountCasts


def _on_off(model, family, kw, device="cpu", dtype=torch.bfloat16):
    """The step with the switch on and off: bit for bit the same, with one cast fewer per layer on (the last
    linear's forward cast of its GEMM output; layers: how many ran it)."""
    runs, casts = {}, {}
    for on in (True, False):
        with mixed_residual(on), CountCasts() as count:
            runs[on] = _step(model, family, kw, device, dtype)
        casts[on] = count.casts
    _assert_identical(runs[True], runs[False])
    assert casts[True] < casts[False], casts  # the path without casts ran
    return runs[True]


_checkpointed = checkpointed


@pytest.mark.parametrize("dropout", [0.0, 0.2], ids=["nodrop", "dropout"])
@pytest.mark.parametrize("checkpointing", list(CHECKPOINTING))
@pytest.mark.parametrize("family", FAMILIES)
def test_layers_switch_on_equals_off_bitwise(family, checkpointing, dropout):
    if family != "gpt2" and dropout:
        pytest.skip("Llama and its relatives have no hidden dropout (attention dropout is not the last linear's)")
    model = fuse(make_model(family, dropout=dropout, layers=3)).train()
    kw = inputs_for(family, padding=True)
    plain = _on_off(model, family, kw)
    if CHECKPOINTING[checkpointing] is not None:
        ck = _on_off(_checkpointed(copy.deepcopy(model), **CHECKPOINTING[checkpointing]), family, kw)
        _assert_identical(ck, plain)  # the replay (residual_linear_backward) as without checkpointing


@pytest.mark.parametrize("checkpointing", ["fuse", "every1"])
@pytest.mark.parametrize("family", ["gpt2", "llama"])
def test_lora_switch_on_equals_off_bitwise(family, checkpointing):
    """peft LoRA on the last linear (c_proj / down_proj): the adapter path of last_linear_tail, autograd through
    bias_dropout_add with a bfloat16 x, and (checkpointed) the no_grad forward into a pool slot."""
    targets = {"gpt2": ["c_attn", "c_proj"], "llama": ["q_proj", "v_proj", "o_proj", "down_proj"]}[family]
    casts = lora_switch_steps(family, targets, mixed_residual, 0.2 if family == "gpt2" else 0.0, 0.1,
                              CHECKPOINTING[checkpointing])
    assert casts[True] < casts[False], casts


def test_compiled_fused_model_switch_on_equals_off_without_graph_breaks():
    from torch._dynamo.utils import counters

    model = fuse(make_model("gpt2", dropout=0.0, layers=2)).train()
    _checkpointed(model, every=1)
    kw = inputs_for("gpt2", padding=False)
    eager = {}
    for on in (True, False):
        with mixed_residual(on):
            eager[on] = _step(model, "gpt2", kw)
    _assert_identical(eager[True], eager[False])
    torch._dynamo.reset()
    counters.clear()
    compiled = torch.compile(model, backend="aot_eager", fullgraph=True)
    with mixed_residual(True):
        got = _step(compiled, "gpt2", kw)
    assert not counters["graph_break"], dict(counters["graph_break"])
    _assert_identical(got, eager[True])


def test_the_switch_returns_the_previous_setting():
    before = _C.mixed_dtype_residual(False)
    try:
        assert before is True  # the default
        assert _C.mixed_dtype_residual(True) is False
        assert _C.mixed_dtype_residual() is True
    finally:
        _C.mixed_dtype_residual(before)


# ---- CUDA (the GPU report) -----------------------------------------------------------------------------------------


@requires_cuda
@pytest.mark.cuda
@pytest.mark.parametrize("shape", SHAPES, ids=str)
@pytest.mark.parametrize("p", [0.0, 0.3], ids=["nodrop", "dropout"])
@pytest.mark.parametrize("dtype", LOWP, ids=str)
def test_cuda_op_mixed_equals_the_float_path(shape, dtype, p):
    for bias in ("frozen", "trained"):
        _op_parity(shape, dtype, p, True, bias == "trained", "cuda")
    x = torch.randn(shape, device="cuda") * 5
    assert torch.equal(ops.dropout(x, p, 7, 2, dtype=dtype), ops.dropout(x, p, 7, 2).to(dtype))
    # the CPU kernels' result: the same Philox mask (a dropped element would be off by far more than the tolerance),
    # the same float arithmetic up to the last bits (nvcc may fuse the multiply-add)
    xc, bc, rc, _ = _inputs(shape, dtype, "cpu")
    torch.testing.assert_close(ops.bias_dropout_add(xc.cuda(), bc.cuda(), rc.cuda(), p, 11, 3).cpu(),
                               ops.bias_dropout_add(xc, bc, rc, p, 11, 3), rtol=1e-6, atol=1e-6)


@requires_cuda
@pytest.mark.cuda
@pytest.mark.parametrize("dtype", LOWP, ids=str)
@pytest.mark.parametrize("family", ["gpt2", "llama"])
def test_cuda_layers_switch_on_equals_off_bitwise(family, dtype):
    model = fuse(make_model(family, dropout=0.2 if family == "gpt2" else 0.0, layers=2)).train().cuda()
    kw = inputs_for(family, padding=True, device="cuda")
    plain = _on_off(model, family, kw, "cuda", dtype)
    ck = _on_off(_checkpointed(copy.deepcopy(model), every=1), family, kw, "cuda", dtype)
    _assert_identical(ck, plain)
