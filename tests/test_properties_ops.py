"""Property tests (hypothesis) of the ckpt_ext.ops kernels against the plain-PyTorch references of
helpers/kernel_refs.py (those of test_kernels_ops.py) on random shapes, dtypes (float32, float64, bfloat16,
float16) and layouts (transposed, strided, offset, broadcast), inputs with and without requires_grad; their
outputs' shapes and strides against the fake kernels. Settings, tolerances and reproducibility:
tests/helpers/properties.py.
"""
import math
from typing import Dict, Optional

import pytest
import torch
from hypothesis import given
from hypothesis import strategies as st
from torch._prims_common import check_significant_strides
from torch._subclasses.fake_tensor import FakeTensorMode

from ckpt_ext import ops

transformers = pytest.importorskip("transformers")
from helpers.hf_models import close  # noqa: E402
from helpers.kernel_refs import (as_tuple, assert_close_fp32, clone_inputs, forward_backward, max_err,  # noqa: E402
                                 named_errors, ref_add_layer_norm, ref_bias_dropout_add,
                                 ref_bias_dropout_add_layer_norm, ref_bias_gelu, ref_dropout, ref_rms_norm, ref_rotary,
                                 ref_swiglu)
from helpers.properties import TOL, _one_thread, examples  # noqa: E402,F401  (an autouse fixture)


# --------------------------------------------------------------------------------------------------
# ckpt_ext.ops == the plain-PyTorch references of helpers/kernel_refs.py
# --------------------------------------------------------------------------------------------------
# Memory layouts an op's inputs come in. Each is made by differentiable ops, so the op receives the
# layout and the gradient still reaches the test's leaf; "broadcast" repeats the first row (stride 0),
# so both the op and the reference are given the relaid tensor.
LAYOUTS = ["contiguous", "transposed", "strided", "offset", "broadcast"]


def relaid(t: Optional[torch.Tensor], layout: str) -> Optional[torch.Tensor]:
    if t is None or layout == "contiguous" or t.dim() == 0:
        return t
    if layout == "transposed":  # all strides reversed; dense
        rev = list(reversed(range(t.dim())))
        return t.permute(rev).contiguous().permute(rev)
    if layout == "strided":  # every other element of a buffer twice as wide: inner stride 2
        return torch.stack([t, torch.zeros_like(t)], -1).flatten(-2)[..., ::2]
    if layout == "offset":  # storage offset 3
        return torch.cat([t.new_zeros(3), t.reshape(-1)])[3:].view(t.shape)
    if layout == "broadcast":  # stride 0 in the first dimension
        return t[:1].expand(t.shape)
    raise ValueError(layout)


DTYPES = [torch.float32, torch.float64, torch.bfloat16, torch.float16]
# Leading (row) dimensions and a last dimension: odd sizes, vector-width edges, an empty dimension now and then.
rows = st.lists(st.one_of(st.integers(1, 5), st.just(0), st.just(17)), min_size=0, max_size=2)
hidden_sizes = st.one_of(st.integers(1, 40), st.sampled_from([63, 64, 65, 127, 128, 129, 255, 256, 257, 1000]))


@st.composite
def op_inputs(draw, shapes: Dict[str, tuple], optional=(), scale=None):
    """Named inputs of one op call: random values, dtype, layout and requires_grad per tensor; the names in
    `optional` may be None. Returns (dtype, {name: tensor or None}, {name: layout})."""
    dtype = draw(st.sampled_from(DTYPES), label="dtype")
    seed = draw(st.integers(0, 2**31), label="values seed")
    gen = torch.Generator().manual_seed(seed)
    tensors, layouts = {}, {}
    for name, shape in shapes.items():
        if name in optional and draw(st.booleans(), label=f"{name} is None"):
            tensors[name] = None
            continue
        s = (scale or {}).get(name, 1.0)
        t = (torch.randn(shape, generator=gen) * s).to(dtype)
        tensors[name] = t.requires_grad_(draw(st.booleans(), label=f"{name} requires grad"))
        layouts[name] = draw(st.sampled_from(LAYOUTS), label=f"{name} layout")
    return dtype, tensors, layouts


def _assert_op_matches(kernel, ref, dtype, tensors, layouts, out_names):
    """kernel(**relaid tensors) against ref(**the same): the outputs and the gradients of every input that
    requires grad, compared with a float64 reference run. float64: to 1e-10. float32: to 1e-5 (test_kernels'
    assert_close_fp32) or, failing that, within 2x (outputs) / 3x (gradients) PyTorch's own float32 error --
    random rows are often ill-conditioned (LayerNorm of [1.4840, 1.4853]: rstd 1568, and the rounding of the
    stored pre-norm sum alone moves the output by 2e-4 in PyTorch too). bfloat16/float16: within 2x/3x
    PyTorch's own error, as test_kernels. The outputs' shapes, dtypes and (significant) strides are the fake
    kernels' (ckpt_ext/ops.py: what torch.compile traces with)."""
    names = list(tensors)

    def call(fn):
        return lambda *ts: fn(**{n: relaid(t, layouts.get(n, "contiguous")) for n, t in zip(names, ts)})

    inputs = [tensors[n] for n in names]
    # Backward through the outputs that depend on an input requiring grad.
    gen = torch.Generator().manual_seed(99)
    grads = [torch.randn(o.shape, generator=gen).to(dtype) if o.requires_grad else None
             for o in as_tuple(call(ref)(*clone_inputs(inputs)))]
    what = (out_names, [n for n in names if tensors[n] is not None and tensors[n].requires_grad])
    got, got_grads = forward_backward(call(kernel), inputs, grads)
    exact, exact_grads = forward_backward(call(ref), clone_inputs(inputs, torch.float64),
                                           [None if g is None else g.double() for g in grads])
    same, same_grads = forward_backward(call(ref), clone_inputs(inputs), grads)  # PyTorch in this dtype
    for (name, a, r), (_, _, pt) in zip(named_errors(what, got, exact, got_grads, exact_grads),
                                        named_errors(what, got, same, got_grads, same_grads)):
        assert a.shape == r.shape and a.dtype == pt.dtype, f"{name}: {a.dtype}{tuple(a.shape)} vs {tuple(r.shape)}"
        if dtype == torch.float64:
            if a.numel():
                close(a, r, scale=1.0 + r.abs().max().item(), **TOL[torch.float64])
            continue
        if dtype == torch.float32:
            try:
                assert_close_fp32(name, a, r)
                continue
            except AssertionError:
                pass
        factor = 3.0 if name.startswith("grad") else 2.0
        top = r.abs().max().item() if r.numel() else 0.0
        # Plus one unit in the last place of the output's dtype at its largest value: on the tiny inputs drawn here
        # PyTorch's error can be far below one rounding of the result (a 3-row float16 weight gradient: PyTorch
        # 0.00044, a kernel summing in another order 0.0015, one float16 ulp at 1.5 being 0.00098)
        ulp = torch.finfo(a.dtype).eps * top if a.dtype in (torch.float16, torch.bfloat16) else 0.0
        atol = 1e-5 * (1.0 + top) + ulp
        err, pt_err = max_err(a, r), max_err(pt, r)
        if math.isnan(pt_err):  # PyTorch itself fails here (float16 LayerNorm with eps 1e-12): no bound
            pt_err = math.inf
        assert err <= factor * pt_err + atol, (
            f"{name} ({dtype}): kernel max error {err:.3g} > {factor:g} x PyTorch's {pt_err:.3g} + {atol:.1e}")
    detached = [None if t is None else t.detach() for t in inputs]
    real = as_tuple(call(kernel)(*detached))
    mode = FakeTensorMode()
    fakes = [None if t is None else mode.from_tensor(t) for t in detached]
    with mode:
        fake = as_tuple(call(kernel)(*fakes))
    for name, r, f in zip(out_names, real, fake):
        assert (r.shape, r.dtype) == (f.shape, f.dtype), f"{name}: real vs fake kernel"
        assert check_significant_strides(r, f, only_cuda=False)[0], (
            f"{name}: real kernel strides {r.stride()}, fake kernel's {f.stride()}")


@examples(60)
@given(lead=rows, hidden=hidden_sizes, approximate=st.sampled_from(["none", "tanh"]), data=st.data())
def test_op_bias_gelu(lead, hidden, approximate, data):
    shape = (*lead, hidden)
    dtype, t, lay = data.draw(op_inputs({"x": shape, "bias": (hidden,)}, optional=("bias",), scale={"x": 2.0}))
    _assert_op_matches(lambda x, bias: ops.bias_gelu(x, bias, approximate),
                       lambda x, bias: ref_bias_gelu(x, bias, approximate), dtype, t, lay, ["out"])


dropout_args = st.tuples(st.sampled_from([0.0, 0.1, 0.5, 0.9]), st.integers(-2**63, 2**63 - 1),
                         st.integers(-2**63, 2**63 - 1))


def _keep_mask(shape, p, seed, offset):
    """The keep mask by logical row-major index, whatever the layout (test_kernels checks it against Philox)."""
    return ops.dropout_mask(math.prod(shape), p, seed, offset).reshape(shape)


@examples(60)
@given(lead=rows, hidden=hidden_sizes, dropout=dropout_args, data=st.data())
def test_op_bias_dropout_add_and_dropout(lead, hidden, dropout, data):
    p, seed, offset = dropout
    shape = (*lead, hidden)
    mask = _keep_mask(shape, p, seed, offset)
    dtype, t, lay = data.draw(op_inputs({"x": shape, "bias": (hidden,), "residual": shape}, optional=("bias",)))
    _assert_op_matches(lambda x, bias, residual: ops.bias_dropout_add(x, bias, residual, p, seed, offset),
                       lambda x, bias, residual: ref_bias_dropout_add(x, bias, residual, mask, p),
                       dtype, t, lay, ["out"])
    _assert_op_matches(lambda grad: ops.dropout(grad, p, seed, offset),
                       lambda grad: ref_dropout(grad, mask, p), dtype, {"grad": t["x"]}, {"grad": lay["x"]}, ["out"])


@examples(80)
@pytest.mark.filterwarnings("ignore:var\\(\\):UserWarning")  # the reference's statistics of empty rows
@given(lead=rows, hidden=hidden_sizes, dropout=dropout_args, eps=st.sampled_from([1e-12, 1e-5, 0.1]),
       fused_dropout=st.booleans(), data=st.data())
def test_op_layer_norms(lead, hidden, dropout, eps, fused_dropout, data):
    """bias_dropout_add_layer_norm, or add_layer_norm: (out, pre-norm sum) and all gradients."""
    p, seed, offset = dropout
    shape = (*lead, hidden)
    if fused_dropout:
        mask = _keep_mask(shape, p, seed, offset)
        dtype, t, lay = data.draw(op_inputs({"x": shape, "bias": (hidden,), "residual": shape, "weight": (hidden,),
                                             "ln_bias": (hidden,)}, optional=("bias", "ln_bias")))
        kernel = lambda x, bias, residual, weight, ln_bias: ops.bias_dropout_add_layer_norm(  # noqa: E731
            x, bias, residual, weight, ln_bias, p, eps, seed, offset)[:2]
        ref = lambda x, bias, residual, weight, ln_bias: ref_bias_dropout_add_layer_norm(  # noqa: E731
            x, bias, residual, weight, ln_bias, mask, p, eps)[:2]
    else:
        dtype, t, lay = data.draw(op_inputs({"x": shape, "residual": shape, "weight": (hidden,), "bias": (hidden,)},
                                            optional=("residual", "bias"), scale={"x": 3.0}))
        kernel = lambda x, residual, weight, bias: ops.add_layer_norm(x, residual, weight, bias, eps)[:2]  # noqa: E731
        ref = lambda x, residual, weight, bias: ref_add_layer_norm(x, residual, weight, bias, eps)[:2]  # noqa: E731
    _assert_op_matches(kernel, ref, dtype, t, lay, ["out", "pre_norm"])


@examples(60)
@given(lead=rows, hidden=hidden_sizes, eps=st.sampled_from([1e-12, 1e-6, 0.1]), data=st.data())
def test_op_add_rms_norm(lead, hidden, eps, data):
    shape = (*lead, hidden)
    dtype, t, lay = data.draw(op_inputs({"x": shape, "residual": shape, "weight": (hidden,)}, optional=("residual",),
                                        scale={"x": 3.0}))
    _assert_op_matches(lambda x, residual, weight: ops.add_rms_norm(x, residual, weight, eps)[:2],
                       lambda x, residual, weight: ref_rms_norm(x, residual, weight, eps)[:2], dtype, t, lay,
                       ["out", "sum"])


@examples(50)
@given(lead=rows, hidden=hidden_sizes, data=st.data())
def test_op_swiglu(lead, hidden, data):
    shape = (*lead, hidden)
    dtype, t, lay = data.draw(op_inputs({"gate": shape, "up": shape}, scale={"gate": 2.0}))
    _assert_op_matches(ops.swiglu, ref_swiglu, dtype, t, lay, ["out"])


@examples(60)
@given(b=st.integers(1, 3), h=st.integers(1, 4), s=st.integers(1, 9), half=st.integers(1, 12),
       tables=st.sampled_from(["[S, D]", "[1, S, D]", "[B, S, D]"]), llama_view=st.booleans(), data=st.data())
def test_op_rotary(b, h, s, half, tables, llama_view, data):
    """x [B, H, S, D] (or Llama's [B, S, H, D] projection viewed as it), cos/sin tables of any supported
    shape with halves that differ (general tables: their gradients too); an x with a contiguous last
    dimension is read in place and its output laid out like it."""
    d = 2 * half
    table_shape = {"[S, D]": (s, d), "[1, S, D]": (1, s, d), "[B, S, D]": (b, s, d)}[tables]
    dtype, t, lay = data.draw(op_inputs({"x": (b, s, h, d) if llama_view else (b, h, s, d), "cos": table_shape,
                                         "sin": table_shape}))
    if llama_view:  # q = q_proj(h).view(B, S, H, D).transpose(1, 2)
        x = t["x"].detach().transpose(1, 2).requires_grad_(t["x"].requires_grad)
        t["x"], lay["x"] = x, "contiguous"
    _assert_op_matches(ops.rotary, ref_rotary, dtype, t, lay, ["out"])
    x = relaid(t["x"].detach(), lay["x"])
    if x.stride(-1) == 1:  # read in place: the output is laid out like x
        assert ops.rotary(x, t["cos"], t["sin"]).stride() == torch.empty_like(x).stride()


@pytest.mark.parametrize("hidden", [37, 1000, 4096])
def test_norms_of_rows_with_a_large_mean(hidden):
    """Regression (found by test_op_layer_norms with a broadcast, i.e. constant, row): the CPU kernels summed a
    row in float, so the mean of a constant row came out hidden/2 ulps off and LayerNorm returned that error
    times rstd (1e-2 at hidden 1000) where PyTorch's float32 LayerNorm is exact; rows with a large mean
    relative to their spread were likewise tens of times less accurate than PyTorch's. Now within 2x of it."""
    gen = torch.Generator().manual_seed(hidden)
    x = torch.stack([torch.full((hidden,), 1.7665), 50.0 + torch.randn(hidden, generator=gen)])
    w, b = torch.randn(hidden, generator=gen), torch.randn(hidden, generator=gen)
    for kernel, ref in [(lambda x, w, b: ops.add_layer_norm(x, None, w, b, 1e-5)[0],
                         lambda x, w, b: ref_add_layer_norm(x, None, w, b, 1e-5)[0]),
                        (lambda x, w, b: ops.add_rms_norm(x, None, w, 1e-6)[0],
                         lambda x, w, b: ref_rms_norm(x, None, w, 1e-6)[0])]:
        exact = ref(x.double(), w.double(), b.double())
        for row in range(2):
            err = max_err(kernel(x, w, b)[row], exact[row])
            pytorch_err = max_err(ref(x, w, b)[row], exact[row])
            assert err <= 2 * pytorch_err + 1e-6 * exact[row].abs().max().item(), (row, err, pytorch_err)


def test_rotary_table_gradients_in_bfloat16():
    """Regression (found by test_op_rotary under --hypothesis-seed): the cos/sin gradients were reduced over
    batch and heads in two sums, rounding twice in bfloat16; up to 3.7x PyTorch's own error. Now one
    reduction, as autograd's."""
    for seed in range(50):
        gen = torch.Generator().manual_seed(seed)
        x = torch.randn(4, 4, 9, 6, generator=gen).bfloat16().requires_grad_(False)
        cos, sin = (torch.randn(9, 6, generator=gen).bfloat16().requires_grad_() for _ in range(2))
        _assert_op_matches(ops.rotary, ref_rotary, torch.bfloat16, {"x": x, "cos": cos, "sin": sin}, {}, ["out"])
