"""The norm ops reading a GEMM's bfloat16/float16 output beside the float32 residual stream (issue 32, autocast with
float32 master weights): bias_dropout_add_layer_norm takes `x` in a lower-precision dtype than `residual`, reads it
as float (exact), and its backward writes x's gradient in x's dtype (rounded once from the float gradient, the
dense bias's gradient summed from the float values). The fused layers hand the norm the GEMM output as it is
(_C.mixed_dtype_norms, on by default) instead of casting it first (like(): off).

Checked: op level -- bit-identical to the op run on `x.float()` with the gradient cast by `.to(x.dtype)` (forward
outputs, every gradient, the kernel's bias gradient), bfloat16/float16/float32 x, dropout off and on (CPU keep bits
and the regenerated mask), odd hidden (the SIMD kernels' tail), hidden 1024 and > 8192 (CUDA's multi-pass kernels);
bad dtype combinations give clear errors. Layer level -- BERT, RoBERTa and GPT-2 fused models under CPU autocast
bfloat16: the output, the input gradient and every parameter's gradient bit-identical with the switch on and off,
fused alone and fused + checkpointed (every=1 and all, BERT's pre-norm boundary on), dropout off and on; with the
switch on the casts are gone (fewer aten._to_copy calls); torch.compile of a checkpointed fused BERT under autocast
(no graph break) equals the eager model. CUDA-marked: the op and layer parity on the GPU (bfloat16, float16); the
RMSNorm register kernels reading x themselves (aligned rows up to 8192, out in the stream's dtype or x's; other rows,
a third out dtype and misaligned views convert x first), each against the op on x.float().
"""
import copy
import os
import subprocess
import sys
import warnings

import pytest
import torch

import ckpt_ext
from ckpt_ext import _C, fuse, ops

import helpers.fused
from helpers.cuda_shapes import MIXED_HIDDENS, MIXED_RMS_HIDDENS
from helpers.devices import requires_cuda
from helpers.fused import assert_switch_defaults_on, switched

LOWP = [torch.bfloat16, torch.float16]


def switch(on):
    """_C.mixed_dtype_norms set for a block, restored after."""
    return switched(_C.mixed_dtype_norms, on)


def test_switch_defaults_on_and_returns_the_previous_setting():
    assert_switch_defaults_on(_C.mixed_dtype_norms)


# ---- the op ----------------------------------------------------------------------------------------------------------


def _inputs(rows, hidden, x_dtype, device, with_bias=True):
    g = torch.Generator().manual_seed(rows * 7919 + hidden)

    def rnd(*shape, scale=1.0):
        return (torch.randn(*shape, generator=g) * scale).to(device)

    x = rnd(rows, hidden, scale=3.0).to(x_dtype)
    t = dict(x=x, bias=rnd(hidden, scale=0.5) if with_bias else None, residual=rnd(rows, hidden, scale=2.0),
             weight=1 + rnd(hidden, scale=0.1), ln_bias=rnd(hidden, scale=0.1))
    return t


def _run(t, x_of, p, grad_out, grad_pre):
    """Forward and backward through autograd: the forward's outputs and every input's gradient."""
    leaves = {k: (x_of(v) if k == "x" else v).detach().requires_grad_() if v is not None else None
              for k, v in t.items()}
    out, pre, mean, rstd, _ = ops.bias_dropout_add_layer_norm(leaves["x"], leaves["bias"], leaves["residual"],
                                                              leaves["weight"], leaves["ln_bias"], p, 1e-5, 11, 5)
    torch.autograd.backward([out, pre], [grad_out, grad_pre])
    return (out, pre, mean, rstd), {k: v.grad for k, v in leaves.items() if v is not None}


def _assert_op_matches_float(rows, hidden, x_dtype, p, device, with_bias=True):
    t = _inputs(rows, hidden, x_dtype, device, with_bias)
    g = torch.Generator().manual_seed(5)
    grad_out = torch.randn(rows, hidden, generator=g).to(device)
    grad_pre = torch.randn(rows, hidden, generator=g).to(device)
    fwd, grads = _run(t, lambda x: x, p, grad_out, grad_pre)
    ref_fwd, ref_grads = _run(t, lambda x: x.float(), p, grad_out, grad_pre)
    for a, b in zip(fwd, ref_fwd):
        assert a.dtype == b.dtype and torch.equal(a, b)
    assert grads["x"].dtype == x_dtype
    assert torch.equal(grads["x"], ref_grads["x"].to(x_dtype))
    for k in ("bias", "residual", "weight", "ln_bias"):
        if k in grads:
            assert grads[k].dtype == torch.float32 and torch.equal(grads[k], ref_grads[k]), k
    # The backward op called directly: the regenerated mask (keep_bits None) and the kernel's bias gradient.
    out, pre, mean, rstd, kb = fwd[0], fwd[1], fwd[2], fwd[3], None
    direct = ops.bias_dropout_add_layer_norm_backward(grad_out, None, pre.detach(), t["weight"], mean, rstd, p, 11,
                                                      5, kb, grad_bias=True, x_dtype=x_dtype)
    ref = ops.bias_dropout_add_layer_norm_backward(grad_out, None, pre.detach(), t["weight"], mean, rstd, p, 11, 5,
                                                   kb, grad_bias=True)
    assert direct[0].dtype == x_dtype and torch.equal(direct[0], ref[0].to(x_dtype))
    for a, b in zip(direct[1:], ref[1:]):
        assert torch.equal(a, b)


@pytest.mark.parametrize("p", [0.0, 0.3], ids=["nodrop", "drop"])
@pytest.mark.parametrize("hidden", [72, 1023, 1024, 8200])
@pytest.mark.parametrize("x_dtype", LOWP + [torch.float32], ids=["bf16", "fp16", "fp32"])
def test_mixed_x_is_the_float_op_bit_for_bit(x_dtype, hidden, p):
    _assert_op_matches_float(rows=6 if hidden > 2000 else 37, hidden=hidden, x_dtype=x_dtype, p=p, device="cpu")


def test_mixed_x_without_dense_bias_and_without_rows():
    _assert_op_matches_float(rows=9, hidden=40, x_dtype=torch.bfloat16, p=0.2, device="cpu", with_bias=False)
    t = _inputs(1, 16, torch.bfloat16, "cpu")
    x = t["x"][:0].requires_grad_()
    out, pre, *_ = ops.bias_dropout_add_layer_norm(x, t["bias"], t["residual"][:0], t["weight"], t["ln_bias"])
    assert out.dtype == pre.dtype == torch.float32 and out.shape == (0, 16)
    out.sum().backward()
    assert x.grad.dtype == torch.bfloat16 and x.grad.shape == (0, 16)


def test_mixed_x_non_contiguous():
    t = _inputs(5, 19, torch.bfloat16, "cpu")
    t["x"] = torch.cat([t["x"], t["x"]], 1)[:, ::2]  # non-contiguous
    _assert_op_matches_float_t(t, p=0.25)


def _assert_op_matches_float_t(t, p):
    rows, hidden = t["residual"].shape
    grad_out = torch.randn(rows, hidden).to(t["residual"].device)
    grad_pre = torch.randn(rows, hidden).to(t["residual"].device)
    fwd, grads = _run(t, lambda x: x, p, grad_out, grad_pre)
    ref_fwd, ref_grads = _run(t, lambda x: x.float(), p, grad_out, grad_pre)
    for a, b in zip(fwd, ref_fwd):
        assert torch.equal(a, b)
    assert torch.equal(grads["x"], ref_grads["x"].to(grads["x"].dtype))
    for k in ("bias", "residual", "weight", "ln_bias"):
        assert torch.equal(grads[k], ref_grads[k]), k


def test_mixed_x_on_the_portable_path():
    """The portable loops (ATEN_CPU_CAPABILITY=default, as tests/test_kernels_paths.py runs them) in a subprocess:
    the same checks as above, LayerNorm and RMSNorm, on a row with a SIMD tail and one without."""
    script = (
        "import sys, torch; sys.path[:0] = [{tests!r}]\n"
        "import test_autocast_mixed_norms as t\n"
        "for dt in (torch.bfloat16, torch.float16):\n"
        "    for hidden in (40, 1023):\n"
        "        for p in (0.0, 0.3):\n"
        "            t._assert_op_matches_float(7, hidden, dt, p, 'cpu')\n"
        "        t._assert_rms_matches_float(7, hidden, dt, True, 'cpu')\n"
        "print('ok')\n").format(tests=os.path.dirname(os.path.abspath(__file__)))
    env = dict(os.environ, ATEN_CPU_CAPABILITY="default")
    r = subprocess.run([sys.executable, "-c", script], env=env, capture_output=True, text=True, timeout=300,
                       cwd=os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    assert r.returncode == 0 and r.stdout.strip().endswith("ok"), r.stdout + r.stderr


# ---- add_rms_norm ---------------------------------------------------------------------------------------------------


def _assert_rms_matches_float(rows, hidden, x_dtype, with_residual, device):
    t = _inputs(rows, hidden, x_dtype, device)
    res = t["residual"] if with_residual else None
    grad_out = torch.randn(rows, hidden, generator=torch.Generator().manual_seed(2)).to(device)
    grad_sum = torch.randn(rows, hidden, generator=torch.Generator().manual_seed(4)).to(device)
    runs = []
    for x_of in (lambda x: x, lambda x: x.float()):
        x = x_of(t["x"]).detach().requires_grad_()
        r = res.detach().requires_grad_() if res is not None else None
        w = t["weight"].detach().requires_grad_()
        out, s, rstd = ops.add_rms_norm(x, r, w, 1e-6)
        torch.autograd.backward([out, s] if with_residual else [out], [grad_out, grad_sum] if with_residual
                                else [grad_out])
        runs.append(((out, s, rstd), x.grad, r.grad if r is not None else None, w.grad))
    (fwd, gx, gr, gw), (ref_fwd, ref_gx, ref_gr, ref_gw) = runs
    for a, b in zip(fwd, ref_fwd):
        assert a.dtype == b.dtype and torch.equal(a, b)
    assert gx.dtype == x_dtype and torch.equal(gx, ref_gx.to(x_dtype))
    assert torch.equal(gw, ref_gw)
    if with_residual:
        assert torch.equal(gr, ref_gr)


@pytest.mark.parametrize("with_residual", [True, False], ids=["residual", "noresidual"])
@pytest.mark.parametrize("hidden", [64, 1023, 8200])
@pytest.mark.parametrize("x_dtype", LOWP, ids=["bf16", "fp16"])
def test_rms_norm_mixed_x_is_the_float_op_bit_for_bit(x_dtype, hidden, with_residual):
    _assert_rms_matches_float(6 if hidden > 2000 else 37, hidden, x_dtype, with_residual, "cpu")


def _assert_rms_out_dtypes_match_float(rows, hidden, x_dtype, device):
    """add_rms_norm's forward with a lower-precision x, out in the stream's dtype, in x's and in the other
    lower-precision dtype (CUDA: read in the kernels' pass, TO = TX; the third converts x first), and on a misaligned
    view of x: the bits of the op on x.float()."""
    t = _inputs(rows, hidden, x_dtype, device)
    xm = torch.empty(t["x"].numel() + 1, dtype=x_dtype, device=device)[1:].view(t["x"].shape)
    xm.copy_(t["x"])
    assert xm.data_ptr() % 16 != 0
    for r in (t["residual"], None):
        for out_dtype in (None, *LOWP):
            ref = ops.add_rms_norm(t["x"].float(), r, t["weight"], 1e-6, out_dtype=out_dtype)
            for x in (t["x"], xm):
                got = ops.add_rms_norm(x, r, t["weight"], 1e-6, out_dtype=out_dtype)
                for a, b in zip(got, ref):
                    assert a.dtype == b.dtype and torch.equal(a, b), (r is None, out_dtype)


@pytest.mark.parametrize("hidden", [64, 1023])
@pytest.mark.parametrize("x_dtype", LOWP, ids=["bf16", "fp16"])
def test_rms_norm_mixed_x_out_dtypes_and_misaligned_x(x_dtype, hidden):
    _assert_rms_out_dtypes_match_float(37, hidden, x_dtype, "cpu")


def test_rms_norm_bad_dtypes():
    t = _inputs(4, 8, torch.bfloat16, "cpu")
    with pytest.raises(RuntimeError, match="weight must have the dtype of residual"):
        ops.add_rms_norm(t["x"], t["residual"], t["weight"].bfloat16(), 1e-6)
    with pytest.raises(RuntimeError, match="residual must have the dtype of x"):
        ops.add_rms_norm(t["x"].float(), t["residual"].bfloat16(), t["weight"], 1e-6)
    with pytest.raises(RuntimeError, match="weight must have the dtype of x"):
        ops.add_rms_norm(t["x"], None, t["weight"].double(), 1e-6)


def test_bad_dtype_combinations_give_clear_errors():
    t = _inputs(4, 8, torch.bfloat16, "cpu")
    x, b, r, w, lb = t["x"], t["bias"], t["residual"], t["weight"], t["ln_bias"]
    op = ops.bias_dropout_add_layer_norm
    with pytest.raises(RuntimeError, match="residual must have the dtype of x"):
        op(x.float(), b, r.bfloat16(), w, lb)  # a float x beside a bfloat16 stream
    with pytest.raises(RuntimeError, match="residual must have the dtype of x"):
        op(x, b.double(), r.double(), w.double(), lb.double())  # a float64 stream
    with pytest.raises(RuntimeError, match="residual must have the dtype of x"):
        op(x.half(), b, r.bfloat16(), w, lb)  # two low-precision dtypes
    with pytest.raises(RuntimeError, match="weight must have the dtype of residual"):
        op(x, b, r, w.bfloat16(), lb)
    with pytest.raises(RuntimeError, match="bias must have the dtype of residual"):
        op(x, b.bfloat16(), r, w, lb)
    with pytest.raises(RuntimeError, match="residual must have the shape of x"):
        op(x, b, r[:2], w, lb)
    out, pre, mean, rstd, kb = op(x, b, r, w, lb)
    bwd = ops.bias_dropout_add_layer_norm_backward
    with pytest.raises(RuntimeError, match="x_dtype must be the pre-norm tensor's dtype"):
        bwd(out, None, pre, w, mean, rstd, 0.0, 0, 0, None, x_dtype=torch.float64)
    _, pre16, mean16, rstd16, _ = op(x, b.bfloat16(), r.bfloat16(), w.bfloat16(), lb.bfloat16())
    with pytest.raises(RuntimeError, match="x_dtype must be the pre-norm tensor's dtype"):
        bwd(pre16, None, pre16, w.bfloat16(), mean16, rstd16, 0.0, 0, 0, None, x_dtype=torch.float16)
    assert bwd(pre16, None, pre16, w.bfloat16(), mean16, rstd16, 0.0, 0, 0, None,
               x_dtype=torch.bfloat16)[0].dtype == torch.bfloat16


def test_fake_kernel_follows_the_mixed_dtypes():
    from torch._subclasses.fake_tensor import FakeTensorMode
    t = _inputs(4, 8, torch.bfloat16, "cpu")
    with FakeTensorMode() as mode:
        f = {k: mode.from_tensor(v) for k, v in t.items()}
        out, pre, mean, rstd, kb = torch.ops.ckpt_ext.bias_dropout_add_layer_norm(
            f["x"], f["bias"], f["residual"], f["weight"], f["ln_bias"], 0.1, 1e-5, 0, 0)
        assert out.dtype == pre.dtype == torch.float32
        gx = torch.ops.ckpt_ext.bias_dropout_add_layer_norm_backward(out, None, pre, f["weight"], mean, rstd, 0.1, 0,
                                                                     0, kb, True, torch.bfloat16)[0]
        assert gx.dtype == torch.bfloat16
        with pytest.raises(RuntimeError, match="weight must have the dtype of residual"):
            torch.ops.ckpt_ext.bias_dropout_add_layer_norm(f["x"], f["bias"], f["residual"],
                                                           f["weight"].bfloat16(), f["ln_bias"], 0.1, 1e-5, 0, 0)


# ---- the layers -----------------------------------------------------------------------------------------------------

transformers = pytest.importorskip("transformers")
from helpers.hf_models import embeds_call, inputs_for, make_model  # noqa: E402
from helpers.fused import _seed  # noqa: E402,F401  (an autouse fixture)


CountCasts = helpers.fused.CountCasts


def _step(model, family, kw, device, dtype, count=None):
    model.zero_grad(set_to_none=True)
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # no fallback warning: the fused path runs
        with torch.autocast(device, dtype=dtype):
            torch.manual_seed(7)
            if count is not None:
                with count:
                    e, out = embeds_call(model, family, kw)
            else:
                e, out = embeds_call(model, family, kw)
    g = torch.randn(out.shape, generator=torch.Generator().manual_seed(3)).to(out.device, out.dtype)
    out.backward(g)
    return out.detach(), e.grad, {n: p.grad for n, p in model.named_parameters() if p.grad is not None}


def _checkpointed(model, every):
    ck = copy.deepcopy(model)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", FutureWarning)
        ckpt_ext.enable_checkpointing(ck, every=every)
    return ck


def _assert_switch_changes_nothing(family, dropout, every, device, dtype, layers=3):
    model = fuse(make_model(family, dropout=dropout, layers=layers)).train().to(device)
    if every is not None:
        model = _checkpointed(model, every)
    kw = inputs_for(family, padding=True, device=device)
    runs, casts = [], []
    for on in (False, True):
        with switch(on):
            count = CountCasts()
            runs.append(_step(copy.deepcopy(model), family, kw, device, dtype, count))
            casts.append(count.casts)
    (out0, e0, g0), (out1, e1, g1) = runs
    assert out0.dtype == out1.dtype and torch.equal(out0, out1)
    assert torch.equal(e0, e1)
    assert g0.keys() == g1.keys() and len(g0) > 0
    for n in g0:
        assert g1[n].dtype == torch.float32 and torch.equal(g0[n], g1[n]), n
    # One cast fewer per norm fed by a GEMM, per layer, in the forward.
    assert casts[0] - casts[1] >= CASTS_SAVED[family] * layers, casts


# The norms of a layer fed by a GEMM: BERT's two, GPT-2's attention projection, Llama's attention output and
# Qwen3's q/k norms besides; Gemma 3: its q/k norms, the norms of the attention output (and the MLP's input
# norm after it: the first one writes the GEMMs' dtype) and of the MLP output; Gemma 2: those, without q/k norms.
CASTS_SAVED = {"bert": 2, "roberta": 2, "gpt2": 1, "llama": 1, "qwen3": 3, "gemma3": 5, "gemma2": 3}
FAMILIES = list(CASTS_SAVED)


@pytest.mark.parametrize("dropout", [0.0, 0.2], ids=["nodrop", "drop"])
@pytest.mark.parametrize("every", [None, 1, 3], ids=["fused", "every1", "all"])
@pytest.mark.parametrize("family", FAMILIES)
def test_layers_bit_identical_with_switch_on_and_off_cpu_autocast(family, every, dropout):
    assert _C.pre_norm_boundaries() is True  # BERT's boundary on (the tail's mixed gradient is exercised)
    _assert_switch_changes_nothing(family, dropout, every, "cpu", torch.bfloat16)


def test_compiled_fused_bert_under_autocast_equals_eager():
    """torch.compile (aot_eager, fullgraph: no graph break) of a checkpointed fused BERT under CPU autocast with the
    switch on: the eager fused model's output and gradients, bit for bit, which equal the switch-off run's."""
    import torch._dynamo
    from torch._dynamo.utils import counters
    torch._dynamo.reset()
    counters.clear()
    model = fuse(make_model("bert", dropout=0.0, layers=2)).train()
    kw = inputs_for("bert", padding=True)
    eager = _step(copy.deepcopy(model), "bert", kw, "cpu", torch.bfloat16)
    with switch(False):
        eager_off = _step(copy.deepcopy(model), "bert", kw, "cpu", torch.bfloat16)
    ck = _checkpointed(model, every=2)
    compiled = torch.compile(ck, backend="aot_eager", fullgraph=True)
    ck.zero_grad(set_to_none=True)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        e = ck.get_input_embeddings()(kw["input_ids"]).detach().requires_grad_()
        out = compiled(inputs_embeds=e, attention_mask=kw["attention_mask"]).last_hidden_state
    g = torch.randn(out.shape, generator=torch.Generator().manual_seed(3)).to(out.dtype)
    out.backward(g)
    assert not counters["graph_break"]
    for ref in (eager, eager_off):
        assert torch.equal(out.detach(), ref[0])
        assert torch.equal(e.grad, ref[1])
        for n, p in ck.named_parameters():
            if p.grad is not None:
                assert torch.equal(p.grad, ref[2][n]), n
    torch._dynamo.reset()


# ---- CUDA (the GPU report) ------------------------------------------------------------------------------------------


@requires_cuda
@pytest.mark.cuda
@pytest.mark.parametrize("p", [0.0, 0.3], ids=["nodrop", "drop"])
@pytest.mark.parametrize("hidden", MIXED_HIDDENS)
@pytest.mark.parametrize("x_dtype", LOWP, ids=["bf16", "fp16"])
def test_cuda_mixed_x_is_the_float_op_bit_for_bit(x_dtype, hidden, p):
    """The register kernels with a bfloat16/float16 x and grad_x (aligned: 72, 1024, 4096 -- the widest with the
    bias sum in the kernel; element by element: 1023), 6000 (a float grad_x rounded after, the bias summed from
    it) and 8200 (the multi-pass kernels, x converted first); 200, 384, 1536: the other launch buckets
    (helpers/cuda_shapes.py)."""
    _assert_op_matches_float(rows=6 if hidden > 2000 else 37, hidden=hidden, x_dtype=x_dtype, p=p, device="cuda")
    # An x whose pointer is not 16-byte aligned (contiguous, one element in): the element-by-element kernels.
    t = _inputs(5, 1024, x_dtype, "cuda")
    t["x"] = torch.cat([t["x"].new_zeros(1), t["x"].reshape(-1)])[1:].view(5, 1024)
    _assert_op_matches_float_t(t, p)


@requires_cuda
@pytest.mark.cuda
@pytest.mark.parametrize("hidden", MIXED_RMS_HIDDENS)
@pytest.mark.parametrize("x_dtype", LOWP, ids=["bf16", "fp16"])
def test_cuda_rms_norm_mixed_x_is_the_float_op_bit_for_bit(x_dtype, hidden):
    """The RMSNorm register kernels read a bfloat16/float16 x beside a float32 residual / weight (TX) on aligned rows
    up to 8192 (64, 72, 200, 384, 1024, 1536, 4096, 6000: every launch bucket); 1023 (unaligned), 8200 and misaligned
    views convert x first."""
    _assert_rms_matches_float(6, hidden, x_dtype, True, "cuda")
    _assert_rms_matches_float(6, hidden, x_dtype, False, "cuda")
    _assert_rms_out_dtypes_match_float(6 if hidden > 2000 else 37, hidden, x_dtype, "cuda")
    if hidden == 1024:
        _assert_rms_out_dtypes_match_float(4099, hidden, x_dtype, "cuda")  # grid-stride


@requires_cuda
@pytest.mark.cuda
@pytest.mark.parametrize("dtype", LOWP, ids=["bf16", "fp16"])
@pytest.mark.parametrize("every", [None, 1], ids=["fused", "every1"])
@pytest.mark.parametrize("family", FAMILIES)
def test_cuda_layers_bit_identical_with_switch_on_and_off(family, every, dtype):
    _assert_switch_changes_nothing(family, 0.2, every, "cuda", dtype)
