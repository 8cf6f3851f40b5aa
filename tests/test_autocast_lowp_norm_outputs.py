"""The norm ops writing their normalised output in the GEMMs' dtype (issue 32, autocast with float32 master weights):
`add_rms_norm(..., out_dtype=)` and `bias_dropout_add_layer_norm(..., out_dtype=)` write `out` in bfloat16/float16
beside the float32 stream (the float result rounded once: the bits of `.to(out_dtype)`), and their backward ops read
the gradient of `out` in that dtype as float (exact: the bits of autograd's ToCopyBackward, then the float kernel);
`add_rms_norm_backward(..., grad_out2=)` adds a second gradient of `out` in float, as autograd adds the float
gradients of an output cast twice. The fused pre-norm layers (Llama / Qwen2 / Mistral / Qwen3 / Gemma: n1 and n2;
GPT-2: ln_2) write their GEMM-only norm outputs so (_C.mixed_dtype_norm_outputs, on by default); off: float32, cast by
autocast's linear as before.

Checked: op level -- bit-identical to the float op followed by `.to(out_dtype)` (forward, every gradient), with and
without residual, a float32 or lower-precision x, dropout off and on, odd / wide rows, the two-gradient backward, the
portable CPU loops (ATEN_CPU_CAPABILITY=default), the fake kernels, bad out_dtype errors. Layer level -- Llama, Qwen2,
Qwen3, Gemma and GPT-2 fused models under CPU autocast bfloat16: loss, output, input gradient and every parameter's
gradient bit-identical with the switch on and off, fused alone and checkpointed (every=1, all layers in one segment,
keep="gemms"), dropout off and on, and fewer aten._to_copy calls with it on; peft LoRA on the norms' consumers (with
adapter dropout) keeps the float32 output (same bits, same casts); torch.compile (aot_eager, no graph break) of a
checkpointed fused Llama equals eager. CUDA-marked: the op and layer parity on the GPU (the register kernels write
the lower-precision out / out2 and read their gradients themselves; odd, misaligned, float32-x and the widest rows
convert around the float kernels in the launchers), the dual op's backward with each gradient present and absent.
The fanout (CPU and CUDA-marked): both backward ops' grad_out2 in the stream's dtype beside a grad_out of it (bfloat16,
float16, float32 streams; autocast's lower-precision grad_x), bit-identical to the op on grad_out + grad_out2
(autograd's add, rounded to the stream's dtype), with and without the bias sums, misaligned views.
"""
import copy
import os
import subprocess
import sys

import pytest
import torch

import ckpt_ext
from ckpt_ext import _C, fuse, ops

import helpers.fused
from helpers.cuda_shapes import MIXED_HIDDENS
from helpers.devices import requires_cuda
from helpers.fused import assert_switch_defaults_on, switched

LOWP = [torch.bfloat16, torch.float16]


def switch(on):
    """_C.mixed_dtype_norm_outputs set for a block, restored after."""
    return switched(_C.mixed_dtype_norm_outputs, on)


def test_switch_defaults_on_and_returns_the_previous_setting():
    assert_switch_defaults_on(_C.mixed_dtype_norm_outputs)


# ---- the ops --------------------------------------------------------------------------------------------------------


def _inputs(rows, hidden, x_dtype, device):
    g = torch.Generator().manual_seed(rows * 7919 + hidden)

    def rnd(*shape, scale=1.0):
        return (torch.randn(*shape, generator=g) * scale).to(device)

    return dict(x=rnd(rows, hidden, scale=3.0).to(x_dtype), bias=rnd(hidden, scale=0.5),
                residual=rnd(rows, hidden, scale=2.0), weight=1 + rnd(hidden, scale=0.1),
                ln_bias=rnd(hidden, scale=0.1))


def _grads(rows, hidden, out_dtype, device):
    g = torch.Generator().manual_seed(hidden + 3)
    return (torch.randn(rows, hidden, generator=g).to(device, out_dtype),
            torch.randn(rows, hidden, generator=g).to(device))


def _ln_run(t, p, out_dtype, g_out, g_pre):
    """Forward + backward of bias_dropout_add_layer_norm, out written in out_dtype (None: float32, then cast by
    .to(), autograd's ToCopyBackward taking the gradient back)."""
    leaves = {k: v.detach().requires_grad_() for k, v in t.items()}
    out, pre, mean, rstd, _ = ops.bias_dropout_add_layer_norm(leaves["x"], leaves["bias"], leaves["residual"],
                                                              leaves["weight"], leaves["ln_bias"], p, 1e-5, 11, 5,
                                                              out_dtype=out_dtype)
    if out_dtype is None:
        out = out.to(g_out.dtype)
    torch.autograd.backward([out, pre], [g_out, g_pre])
    return (out, pre, mean, rstd), {k: v.grad for k, v in leaves.items()}


def _assert_ln_matches_cast(rows, hidden, x_dtype, out_dtype, p, device):
    t = _inputs(rows, hidden, x_dtype, device)
    g_out, g_pre = _grads(rows, hidden, out_dtype, device)
    fwd, grads = _ln_run(t, p, out_dtype, g_out, g_pre)
    ref_fwd, ref_grads = _ln_run(t, p, None, g_out, g_pre)
    assert fwd[0].dtype == out_dtype and fwd[1].dtype == torch.float32
    for a, b in zip(fwd, ref_fwd):
        assert a.dtype == b.dtype and torch.equal(a, b)
    for k in grads:
        assert grads[k].dtype == ref_grads[k].dtype and torch.equal(grads[k], ref_grads[k]), k
    # The backward op called directly with the lower-precision gradient: the float gradient's bits.
    pre, mean, rstd = fwd[1].detach(), fwd[2], fwd[3]
    for grad_bias in (True, False):  # with and without the dense bias's column sums
        direct = ops.bias_dropout_add_layer_norm_backward(g_out, g_pre, pre, t["weight"], mean, rstd, p, 11, 5, None,
                                                          grad_bias=grad_bias, x_dtype=x_dtype)
        ref = ops.bias_dropout_add_layer_norm_backward(g_out.float(), g_pre, pre, t["weight"], mean, rstd, p, 11, 5,
                                                       None, grad_bias=grad_bias, x_dtype=x_dtype)
        for a, b in zip(direct, ref):
            assert a.dtype == b.dtype and torch.equal(a, b)


@pytest.mark.parametrize("p", [0.0, 0.3], ids=["nodrop", "drop"])
@pytest.mark.parametrize("hidden", [72, 1023, 1024, 8200])
@pytest.mark.parametrize("x_dtype", ["same", "float32"])
@pytest.mark.parametrize("out_dtype", LOWP, ids=["bf16", "fp16"])
def test_layer_norm_lowp_out_is_the_cast_bit_for_bit(out_dtype, x_dtype, hidden, p):
    """x the GEMM's dtype (GPT-2's ln_2: c_proj's output) or float32."""
    x_dtype = out_dtype if x_dtype == "same" else torch.float32
    _assert_ln_matches_cast(6 if hidden > 2000 else 37, hidden, x_dtype, out_dtype, p, "cpu")


def _dual_run(t, p, out2_dtype, dual, g_out, g_out2, g_pre):
    """bias_dropout_add_layer_norm_dual (out float32 and out2), or the plain op with out2 = out.to(out2_dtype).
    g_out / g_out2 None: that output takes no part in the backward (its gradient absent)."""
    leaves = {k: v.detach().requires_grad_() for k, v in t.items()}
    args = (leaves["x"], leaves["bias"], leaves["residual"], leaves["weight"], leaves["ln_bias"], p, 1e-5, 11, 5)
    if dual:
        out, out2, pre, mean, rstd, _ = ops.bias_dropout_add_layer_norm_dual(*args, out2_dtype=out2_dtype)
    else:
        out, pre, mean, rstd, _ = ops.bias_dropout_add_layer_norm(*args)
        out2 = out.to(out2_dtype)
    used = [(o, g) for o, g in ((out, g_out), (out2, g_out2), (pre, g_pre)) if g is not None]
    torch.autograd.backward([o for o, _ in used], [g for _, g in used])
    return (out, out2, pre, mean, rstd), {k: v.grad for k, v in leaves.items()}


def _assert_dual_matches_cast(rows, hidden, x_dtype, out2_dtype, p, device):
    """BERT's h1: the float32 out and its lower-precision copy, their two gradients added in float."""
    t = _inputs(rows, hidden, x_dtype, device)
    g_out2, g_pre = _grads(rows, hidden, out2_dtype, device)
    g_out = torch.randn(rows, hidden, generator=torch.Generator().manual_seed(13)).to(device)
    # Both gradients (BERT's h1: the residual's and the GEMM's), out2's alone (the backward op then reads it as
    # grad_out), out's alone.
    for g1, g2 in ((g_out, g_out2), (None, g_out2), (g_out, None)):
        fwd, grads = _dual_run(t, p, out2_dtype, True, g1, g2, g_pre)
        ref_fwd, ref_grads = _dual_run(t, p, out2_dtype, False, g1, g2, g_pre)
        assert fwd[0].dtype == torch.float32 and fwd[1].dtype == out2_dtype
        for a, b in zip(fwd, ref_fwd):
            assert a.dtype == b.dtype and torch.equal(a, b)
        for k in grads:
            assert grads[k].dtype == ref_grads[k].dtype and torch.equal(grads[k], ref_grads[k]), (k, g1 is None)
    pre, mean, rstd = fwd[2].detach(), fwd[3], fwd[4]
    # The backward op called directly: grad_out2 beside a float32 grad_out, and beside one of its own dtype.
    for g1 in (g_out, g_out.to(out2_dtype)):
        direct = ops.bias_dropout_add_layer_norm_backward(g1, g_pre, pre, t["weight"], mean, rstd, p, 11, 5, None,
                                                          grad_bias=True, x_dtype=x_dtype, grad_out2=g_out2)
        ref = ops.bias_dropout_add_layer_norm_backward(g1.float() + g_out2.float(), g_pre, pre, t["weight"], mean,
                                                       rstd, p, 11, 5, None, grad_bias=True, x_dtype=x_dtype)
        for a, b in zip(direct, ref):
            assert a.dtype == b.dtype and torch.equal(a, b)


@pytest.mark.parametrize("p", [0.0, 0.3], ids=["nodrop", "drop"])
@pytest.mark.parametrize("hidden", [72, 1023, 8200])
@pytest.mark.parametrize("out2_dtype", LOWP, ids=["bf16", "fp16"])
def test_layer_norm_dual_is_the_cast_bit_for_bit(out2_dtype, hidden, p):
    """x the GEMM's dtype (BERT's attention output with mixed_dtype_norms) and float32."""
    for x_dtype in (out2_dtype, torch.float32):
        _assert_dual_matches_cast(6 if hidden > 2000 else 37, hidden, x_dtype, out2_dtype, p, "cpu")


def _misaligned(t):
    """t's values in a contiguous view one element past the start of its allocation (not 16-byte aligned)."""
    v = torch.empty(t.numel() + 1, dtype=t.dtype, device=t.device)[1:].view(t.shape)
    v.copy_(t)
    assert v.data_ptr() % 16 != 0
    return v


def _assert_misaligned_views_match(dtype, device):
    """LayerNorm with out_dtype / the dual op on an x, and its backward on gradients, that are misaligned views (on
    CUDA: the launchers' conversion around the float kernels): the float op's bits."""
    rows, hidden, p = 37, 1024, 0.3
    t = _inputs(rows, hidden, dtype, device)
    g_out2, g_pre = _grads(rows, hidden, dtype, device)
    g_out = torch.randn(rows, hidden, generator=torch.Generator().manual_seed(13)).to(device)
    args = (t["bias"], t["residual"], t["weight"], t["ln_bias"], p, 1e-5, 11, 5)
    ref = ops.bias_dropout_add_layer_norm(t["x"], *args)
    x = _misaligned(t["x"])
    out, pre, mean, rstd, _ = ops.bias_dropout_add_layer_norm(x, *args, out_dtype=dtype)
    assert out.dtype == dtype and torch.equal(out, ref[0].to(dtype))
    assert all(torch.equal(a, b) for a, b in zip((pre, mean, rstd), ref[1:4]))
    dual = ops.bias_dropout_add_layer_norm_dual(x, *args, out2_dtype=dtype)
    assert torch.equal(dual[0], ref[0]) and dual[1].dtype == dtype and torch.equal(dual[1], ref[0].to(dtype))
    assert all(torch.equal(a, b) for a, b in zip(dual[2:5], ref[1:4]))
    for g1, g2 in ((g_out2, None), (g_out, g_out2)):
        total = g1.float() if g2 is None else g1.float() + g2.float()
        want = ops.bias_dropout_add_layer_norm_backward(total, g_pre, pre, t["weight"], mean, rstd, p, 11, 5, None,
                                                        grad_bias=True, x_dtype=dtype)
        views = [(_misaligned(g1), g2)] + ([(g1, _misaligned(g2))] if g2 is not None else [])
        for m1, m2 in views:
            got = ops.bias_dropout_add_layer_norm_backward(m1, g_pre, pre, t["weight"], mean, rstd, p, 11, 5, None,
                                                           grad_bias=True, x_dtype=dtype, grad_out2=m2)
            assert all(a.dtype == b.dtype and torch.equal(a, b) for a, b in zip(got, want))


@pytest.mark.parametrize("dtype", LOWP, ids=["bf16", "fp16"])
def test_layer_norm_lowp_out_on_misaligned_views(dtype):
    _assert_misaligned_views_match(dtype, "cpu")


def _rms_run(t, with_residual, out_dtype, g_out, g_sum, g_out2=None):
    """Forward + backward of add_rms_norm (out in out_dtype, or float32 then .to()); g_out2: a second use of out."""
    x = t["x"].detach().requires_grad_()
    r = t["residual"].detach().requires_grad_() if with_residual else None
    w = t["weight"].detach().requires_grad_()
    out, s, rstd = ops.add_rms_norm(x, r, w, 1e-6, out_dtype=out_dtype)
    outs = [out.to(g_out.dtype) if out_dtype is None else out]
    grads = [g_out]
    if g_out2 is not None:
        outs.append(out.to(g_out.dtype) if out_dtype is None else out)
        grads.append(g_out2)
    if with_residual:
        outs.append(s)
        grads.append(g_sum)
    torch.autograd.backward(outs, grads)
    return (outs[0], s, rstd), (x.grad, r.grad if r is not None else None, w.grad)


def _assert_rms_matches_cast(rows, hidden, x_dtype, out_dtype, with_residual, device):
    t = _inputs(rows, hidden, x_dtype, device)
    g_out, g_sum = _grads(rows, hidden, out_dtype, device)
    fwd, grads = _rms_run(t, with_residual, out_dtype, g_out, g_sum)
    ref_fwd, ref_grads = _rms_run(t, with_residual, None, g_out, g_sum)
    assert fwd[0].dtype == out_dtype and fwd[1].dtype == torch.float32
    for a, b in zip(fwd, ref_fwd):
        assert a.dtype == b.dtype and torch.equal(a, b)
    for a, b in zip(grads, ref_grads):
        assert (a is None) == (b is None)
        if a is not None:
            assert a.dtype == b.dtype and torch.equal(a, b)
    # Two gradients of out (grad_out2): added in float, as autograd adds those of a float out cast twice.
    g_out2 = torch.randn(rows, hidden, generator=torch.Generator().manual_seed(9)).to(device, out_dtype)
    ref_two = _rms_run(t, with_residual, None, g_out, g_sum, g_out2)[1]
    sum_, rstd = fwd[1].detach(), fwd[2]
    direct = ops.add_rms_norm_backward(g_out, g_sum if with_residual else None, sum_, t["weight"], rstd,
                                       grad_out2=g_out2)
    assert torch.equal(direct[1], ref_two[2])
    gx = direct[0].to(x_dtype) if x_dtype != torch.float32 else direct[0]
    assert torch.equal(gx, ref_two[0])
    both = ops.add_rms_norm_backward(g_out.float() + g_out2.float(), g_sum if with_residual else None, sum_,
                                     t["weight"], rstd)
    assert all(torch.equal(a, b) for a, b in zip(direct, both))


@pytest.mark.parametrize("with_residual", [True, False], ids=["residual", "noresidual"])
@pytest.mark.parametrize("hidden", [64, 1023, 8200])
@pytest.mark.parametrize("x_dtype", ["same", "float32"])
@pytest.mark.parametrize("out_dtype", LOWP, ids=["bf16", "fp16"])
def test_rms_norm_lowp_out_is_the_cast_bit_for_bit(out_dtype, x_dtype, hidden, with_residual):
    """x float32 without residual (Llama's n1: the stream), x the GEMM's dtype beside a residual (n2: o_proj's)."""
    x_dtype = out_dtype if x_dtype == "same" else torch.float32
    _assert_rms_matches_cast(6 if hidden > 2000 else 37, hidden, x_dtype, out_dtype, with_residual, "cpu")


def test_lowp_out_on_the_portable_path():
    """The portable loops (ATEN_CPU_CAPABILITY=default) in a subprocess: the same checks, a SIMD tail and none."""
    script = (
        "import sys, torch; sys.path[:0] = [{tests!r}]\n"
        "import test_autocast_lowp_norm_outputs as t\n"
        "for dt in (torch.bfloat16, torch.float16):\n"
        "    for hidden in (40, 1023):\n"
        "        for p in (0.0, 0.3):\n"
        "            t._assert_ln_matches_cast(7, hidden, dt, dt, p, 'cpu')\n"
        "            t._assert_dual_matches_cast(7, hidden, dt, dt, p, 'cpu')\n"
        "        t._assert_rms_matches_cast(7, hidden, torch.float32, dt, False, 'cpu')\n"
        "        t._assert_rms_matches_cast(7, hidden, dt, dt, True, 'cpu')\n"
        "print('ok')\n").format(tests=os.path.dirname(os.path.abspath(__file__)))
    env = dict(os.environ, ATEN_CPU_CAPABILITY="default")
    r = subprocess.run([sys.executable, "-c", script], env=env, capture_output=True, text=True, timeout=300,
                       cwd=os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    assert r.returncode == 0 and r.stdout.strip().endswith("ok"), r.stdout + r.stderr


def test_no_rows_and_stream_dtype_out():
    t = _inputs(1, 16, torch.float32, "cpu")
    x = t["x"][:0].requires_grad_()
    out, s, _ = ops.add_rms_norm(x, None, t["weight"], 1e-6, out_dtype=torch.bfloat16)
    assert out.dtype == torch.bfloat16 and s.dtype == torch.float32 and out.shape == (0, 16)
    out.float().sum().backward()
    assert x.grad.shape == (0, 16)
    # out_dtype equal to the stream's: the plain op
    a = ops.add_rms_norm(t["x"], None, t["weight"], 1e-6, out_dtype=torch.float32)
    b = ops.add_rms_norm(t["x"], None, t["weight"], 1e-6)
    assert all(torch.equal(u, v) for u, v in zip(a, b))


def test_bad_out_dtype_gives_clear_errors():
    t = _inputs(4, 8, torch.float32, "cpu")
    x, r, w = t["x"], t["residual"], t["weight"]
    with pytest.raises(RuntimeError, match="out_dtype must be the stream's dtype"):
        ops.add_rms_norm(x, r, w, 1e-6, out_dtype=torch.float64)
    with pytest.raises(RuntimeError, match="out_dtype must be the stream's dtype"):
        ops.add_rms_norm(x.bfloat16(), r.bfloat16(), w.bfloat16(), 1e-6, out_dtype=torch.float16)
    with pytest.raises(RuntimeError, match="out_dtype must be the stream's dtype"):
        ops.bias_dropout_add_layer_norm(x, t["bias"], r, w, t["ln_bias"], out_dtype=torch.float64)
    with pytest.raises(RuntimeError, match="out2_dtype must be bfloat16 or float16 beside a float32 stream"):
        ops.bias_dropout_add_layer_norm_dual(x, t["bias"], r, w, t["ln_bias"], out2_dtype=torch.float32)
    out, s, rstd = ops.add_rms_norm(x, r, w, 1e-6)
    with pytest.raises(RuntimeError, match="grad_out must have the dtype of sum"):
        ops.add_rms_norm_backward(out.double(), None, s, w, rstd)
    with pytest.raises(RuntimeError, match="grad_out2 must have the shape of sum"):
        ops.add_rms_norm_backward(out.bfloat16(), None, s, w, rstd, grad_out2=out[:2].bfloat16())


def test_fake_kernels_follow_out_dtype():
    from torch._subclasses.fake_tensor import FakeTensorMode
    t = _inputs(4, 8, torch.bfloat16, "cpu")
    with FakeTensorMode() as mode:
        f = {k: mode.from_tensor(v) for k, v in t.items()}
        out, pre, *_ = torch.ops.ckpt_ext.bias_dropout_add_layer_norm(
            f["x"], f["bias"], f["residual"], f["weight"], f["ln_bias"], 0.1, 1e-5, 0, 0, torch.bfloat16)
        assert out.dtype == torch.bfloat16 and pre.dtype == torch.float32
        out, out2, pre, *_ = torch.ops.ckpt_ext.bias_dropout_add_layer_norm_dual(
            f["x"], f["bias"], f["residual"], f["weight"], f["ln_bias"], 0.1, 1e-5, 0, 0, torch.bfloat16)
        assert out.dtype == pre.dtype == torch.float32 and out2.dtype == torch.bfloat16
        gx = torch.ops.ckpt_ext.bias_dropout_add_layer_norm_backward(out, None, pre, f["weight"], pre[..., 0], pre[..., 0],
                                                                     0.1, 0, 0, None, True, torch.bfloat16, out2)[0]
        assert gx.dtype == torch.bfloat16
        out, s, rstd = torch.ops.ckpt_ext.add_rms_norm(f["x"], f["residual"], f["weight"], 1e-6, torch.float16)
        assert out.dtype == torch.float16 and s.dtype == torch.float32
        out, s, rstd = torch.ops.ckpt_ext.add_rms_norm(f["residual"], None, f["weight"], 1e-6, torch.bfloat16)
        assert out.dtype == torch.bfloat16 and s.dtype == torch.float32
        gi, gw = torch.ops.ckpt_ext.add_rms_norm_backward(out, None, s, f["weight"], rstd, out)
        assert gi.dtype == gw.dtype == torch.float32
        with pytest.raises(RuntimeError, match="out_dtype must be the stream's dtype"):
            torch.ops.ckpt_ext.add_rms_norm(f["residual"], None, f["weight"], 1e-6, torch.float64)
        # meta tensors, as bench_work's trace runs them
    m = {k: v.to("meta") for k, v in t.items()}
    out = torch.ops.ckpt_ext.add_rms_norm(m["residual"], None, m["weight"], 1e-6, torch.bfloat16)[0]
    assert out.dtype == torch.bfloat16 and out.device.type == "meta"


# ---- the layers -----------------------------------------------------------------------------------------------------

transformers = pytest.importorskip("transformers")
from helpers.fused import (_seed, CHECKPOINTING, assert_identical_steps, autocast_step,  # noqa: E402,F401
                           checkpointed, lora_switch_steps)  # (_seed: an autouse fixture)
from helpers.hf_models import inputs_for, make_model  # noqa: E402


CountCasts = helpers.fused.CountCasts


_step, _assert_identical = autocast_step, assert_identical_steps


# Casts a layer's forward saves (the step's forward and backward both lose them; counted over the whole step):
# Llama and relatives: n1's (one q/k/v GEMM) and n2's two (gate, up); GPT-2: ln_2's (c_fc); BERT / RoBERTa: h1's
# (the intermediate GEMM; the dual op writes it beside the float32 h1, LN2's residual). Each forward cast also
# had a ToCopyBackward cast in backward, and a checkpointed replay runs the forward's casts again.
FORWARD_CASTS_SAVED = {"llama": 3, "qwen2": 3, "qwen3": 3, "gemma": 3, "gemma3": 3, "gemma2": 3, "gpt2": 1, "bert": 1,
                       "roberta": 1}
FAMILIES = list(FORWARD_CASTS_SAVED)
DECODER_FAMILIES = ("llama", "qwen2", "qwen3", "gemma", "gemma3", "gemma2")


def _on_off(model, family, kw, layers, device="cpu", dtype=torch.bfloat16, saved=None):
    runs, casts = {}, {}
    for on in (True, False):
        with switch(on), CountCasts() as count:
            runs[on] = _step(model, family, kw, device, dtype)
        casts[on] = count.casts
    _assert_identical(runs[True], runs[False])
    saved = FORWARD_CASTS_SAVED[family] * 2 * layers if saved is None else saved
    assert casts[False] - casts[True] >= saved, casts
    return runs[True], casts


_checkpointed = checkpointed


@pytest.mark.parametrize("dropout", [0.0, 0.2], ids=["nodrop", "dropout"])
@pytest.mark.parametrize("checkpointing", list(CHECKPOINTING))
@pytest.mark.parametrize("family", FAMILIES)
def test_layers_switch_on_equals_off_bitwise(family, checkpointing, dropout):
    if family not in ("gpt2", "bert", "roberta") and dropout:
        pytest.skip("Llama and its relatives have no hidden dropout (attention dropout is covered by gpt2)")
    assert _C.pre_norm_boundaries() is True  # BERT's pre-norm boundary on (checkpointed: its replay path runs)
    model = fuse(make_model(family, dropout=dropout, layers=3)).train()
    kw = inputs_for(family, padding=True)
    plain, _ = _on_off(model, family, kw, 3)
    if CHECKPOINTING[checkpointing] is not None:
        ck, casts = _on_off(_checkpointed(copy.deepcopy(model), **CHECKPOINTING[checkpointing]), family, kw, 3)
        _assert_identical(ck, plain)  # and the replay as without checkpointing


@pytest.mark.parametrize("lora_dropout", [0.0, 0.1], ids=["nodrop", "dropout"])
@pytest.mark.parametrize("family", ["gpt2", "llama", "bert"])
def test_lora_on_the_norms_consumers_keeps_float_outputs(family, lora_dropout):
    """peft LoRA on the GEMMs a norm feeds (q/k/v, gate/up; c_attn, c_fc), with adapter dropout (which, on a
    bfloat16 input, would round differently) and without (another consumer, whose gradient autograd would add in
    bfloat16): the float32 output is kept there (same bits, switch on and off; no cast saved on those norms, but
    BERT's h1, which the dual op also writes in the GEMM's dtype for the base GEMM, docs/lora-work.md (b))."""
    targets = {"gpt2": ["c_attn", "c_fc"], "llama": ["q_proj", "v_proj", "gate_proj"],
               "bert": ["query", "intermediate.dense"]}[family]
    casts = lora_switch_steps(family, targets, switch, 0.0 if family == "llama" else 0.2, lora_dropout, dict(every=1))
    # GPT-2: ln_2 feeds c_fc (adapted): nothing saved. Llama: n1 (q/v adapted) and n2 (gate adapted) keep float.
    # BERT: the adapter reads the float32 h1, the base intermediate GEMM the dual op's bfloat16 one: per layer (2) the
    # forward's cast, the replay's and the backward's saved.
    assert casts[False] - casts[True] == (3 * 2 if family == "bert" else 0), casts


def test_compiled_checkpointed_llama_equals_eager_without_graph_breaks():
    from torch._dynamo.utils import counters

    model = fuse(make_model("llama", layers=2)).train()
    _checkpointed(model, every=1)
    kw = inputs_for("llama", padding=False)
    eager = {}
    for on in (True, False):
        with switch(on):
            eager[on] = _step(model, "llama", kw)
    _assert_identical(eager[True], eager[False])
    torch._dynamo.reset()
    counters.clear()
    compiled = torch.compile(model, backend="aot_eager", fullgraph=True)
    with switch(True):
        got = _step(compiled, "llama", kw)
    assert not counters["graph_break"], dict(counters["graph_break"])
    _assert_identical(got, eager[True])
    torch._dynamo.reset()


# ---- the fanout: a second gradient of out in the stream's dtype -----------------------------------------------------


def _fanout_inputs(rows, hidden, stream, x_dtype, device):
    t = _inputs(rows, hidden, x_dtype, device)
    return {k: (v if k == "x" else v.to(stream)) for k, v in t.items()}


def _assert_fanout_matches_add(stream, hidden, device, rows=None, misaligned=False):
    """A norm output with two uses whose backward receives both gradients in the stream's dtype (gradfold's fanout:
    BERT's h1 in bfloat16, or float32 under autocast; Llama's n2): the backward ops' grad_out2 beside a grad_out of the
    stream's dtype give the bits of the op on grad_out + grad_out2 (autograd's add: rounded to the stream's dtype).
    CUDA: the register kernels add them (aligned rows they take), other rows add them first."""
    rows = rows or (6 if hidden > 2000 else 37)
    gen = torch.Generator().manual_seed(hidden + 17)

    def rnd():
        return torch.randn(rows, hidden, generator=gen).to(device, stream)

    g1, g2, g_pre = rnd(), rnd(), rnd()
    views = [(g1, g2)] + ([(_misaligned(g1), g2), (g1, _misaligned(g2))] if misaligned else [])
    x_dtypes = [stream] + (LOWP if stream == torch.float32 else [])  # autocast: x (and grad_x) the GEMMs' dtype
    for x_dtype in x_dtypes:
        t = _fanout_inputs(rows, hidden, stream, x_dtype, device)
        for p in (0.0, 0.3):
            _, pre, mean, rstd, _ = ops.bias_dropout_add_layer_norm(t["x"], t["bias"], t["residual"], t["weight"],
                                                                    t["ln_bias"], p, 1e-5, 11, 5)
            for grad_bias in (True, False):  # 4097..8192: the BIAS kernels do not take the row, the others do
                args = (pre, t["weight"], mean, rstd, p, 11, 5, None)
                kw = dict(grad_bias=grad_bias, x_dtype=x_dtype)
                want = ops.bias_dropout_add_layer_norm_backward(g1 + g2, g_pre, *args, **kw)
                for m1, m2 in views:
                    got = ops.bias_dropout_add_layer_norm_backward(m1, g_pre, *args, **kw, grad_out2=m2)
                    for a, b in zip(got, want):
                        assert a.dtype == b.dtype and torch.equal(a, b), (x_dtype, p, grad_bias)
    s_x = _fanout_inputs(rows, hidden, stream, stream, device)
    for with_residual in (True, False):
        r = s_x["residual"] if with_residual else None
        _, s, rstd = ops.add_rms_norm(s_x["x"], r, s_x["weight"], 1e-6)
        g_sum = g_pre if with_residual else None
        want = ops.add_rms_norm_backward(g1 + g2, g_sum, s, s_x["weight"], rstd)
        for m1, m2 in views:
            got = ops.add_rms_norm_backward(m1, g_sum, s, s_x["weight"], rstd, grad_out2=m2)
            for a, b in zip(got, want):
                assert a.dtype == b.dtype and torch.equal(a, b), with_residual


@pytest.mark.parametrize("hidden", [72, 1023, 8200])
@pytest.mark.parametrize("stream", [torch.bfloat16, torch.float16, torch.float32], ids=["bf16", "fp16", "fp32"])
def test_fanout_grad_out2_in_the_stream_dtype_is_the_add(stream, hidden):
    _assert_fanout_matches_add(stream, hidden, "cpu", misaligned=hidden == 72)


# ---- CUDA (the GPU report) ------------------------------------------------------------------------------------------


@requires_cuda
@pytest.mark.cuda
@pytest.mark.parametrize("hidden", MIXED_HIDDENS)
@pytest.mark.parametrize("out_dtype", LOWP, ids=["bf16", "fp16"])
def test_cuda_lowp_out_is_the_cast_bit_for_bit(out_dtype, hidden):
    """The LayerNorm register kernels write out / out2 and read their gradients in out_dtype where x has it and the
    row is aligned (72, 200, 384, 1024, 1536, 4096: every launch bucket, helpers/cuda_shapes.py; 6000: forward, and
    backward without the bias's sums, which convert); 1023 (unaligned), 8200 (multi-pass) and a float32 x convert
    around the float kernels. Each the float op's bits."""
    rows = 6 if hidden > 2000 else 37
    for p in (0.0, 0.3):
        for x_dtype in (out_dtype, torch.float32):
            _assert_ln_matches_cast(rows, hidden, x_dtype, out_dtype, p, "cuda")
            _assert_dual_matches_cast(rows, hidden, x_dtype, out_dtype, p, "cuda")
        # More rows than the resident grid holds at once (grid-stride; column partials of several rows per block).
        _assert_ln_matches_cast(4099, hidden, out_dtype, out_dtype, p, "cuda")
        _assert_dual_matches_cast(4099, hidden, out_dtype, out_dtype, p, "cuda")
    _assert_rms_matches_cast(rows, hidden, torch.float32, out_dtype, False, "cuda")
    _assert_rms_matches_cast(rows, hidden, out_dtype, out_dtype, True, "cuda")


@requires_cuda
@pytest.mark.cuda
@pytest.mark.parametrize("dtype", LOWP, ids=["bf16", "fp16"])
def test_cuda_layer_norm_lowp_out_on_misaligned_views(dtype):
    _assert_misaligned_views_match(dtype, "cuda")


@requires_cuda
@pytest.mark.cuda
@pytest.mark.parametrize("dtype", LOWP, ids=["bf16", "fp16"])
@pytest.mark.parametrize("checkpointing", ["fuse", "every1"])
@pytest.mark.parametrize("family", FAMILIES)
def test_cuda_layers_switch_on_equals_off_bitwise(family, checkpointing, dtype):
    model = fuse(make_model(family, dropout=0.0 if family in DECODER_FAMILIES else 0.2, layers=2)).train().cuda()
    if checkpointing != "fuse":
        _checkpointed(model, every=1)
    kw = inputs_for(family, padding=True, device="cuda")
    # The casts counted are the step's own (the mode does not see inside the ops, whose CUDA launchers convert around
    # the float kernels for the rows the register kernels do not take).
    _on_off(model, family, kw, 2, device="cuda", dtype=dtype)


@requires_cuda
@pytest.mark.cuda
@pytest.mark.parametrize("hidden", MIXED_HIDDENS)
@pytest.mark.parametrize("stream", [torch.bfloat16, torch.float16, torch.float32], ids=["bf16", "fp16", "fp32"])
def test_cuda_fanout_grad_out2_in_the_stream_dtype_is_the_add(stream, hidden):
    """The register kernels add grad_out2 of the stream's dtype (G2) on aligned rows (72, 200, 384, 1024, 1536, 4096;
    6000 without the bias sums; misaligned views at 1024 and 1023's odd rows add first, as do 8200 and 6000 with the
    bias sums): the bits of the op on the ATen sum, one and several rows per block."""
    _assert_fanout_matches_add(stream, hidden, "cuda", misaligned=hidden == 1024)
    if hidden == 1024:
        _assert_fanout_matches_add(stream, hidden, "cuda", rows=4099)  # grid-stride: more rows than resident blocks


def _assert_add_layer_norm_lowp_grad(hidden, dtype, device, rows=37):
    """add_layer_norm_backward with a bfloat16/float16 grad_out beside a float32 sum (the op's checks accept it; CUDA's
    register kernels read it in place, TG with no grad_x): the bits of the op on grad_out.float()."""
    gen = torch.Generator().manual_seed(hidden + 29)
    x, r, g_sum = (torch.randn(rows, hidden, generator=gen).to(device) for _ in range(3))
    w, b = (1 + torch.randn(hidden, generator=gen) * 0.1).to(device), torch.randn(hidden, generator=gen).to(device)
    g = torch.randn(rows, hidden, generator=gen).to(device, dtype)
    _, s, mean, rstd = ops.add_layer_norm(x, r, w, b, 1e-5)
    for gs in (g_sum, None):
        got = ops.add_layer_norm_backward(g, gs, s, w, mean, rstd)
        want = ops.add_layer_norm_backward(g.float(), gs, s, w, mean, rstd)
        assert all(a.dtype == c.dtype == torch.float32 and torch.equal(a, c) for a, c in zip(got, want))


@pytest.mark.parametrize("hidden", [72, 1023])
@pytest.mark.parametrize("dtype", LOWP, ids=["bf16", "fp16"])
def test_add_layer_norm_backward_reads_a_lowp_grad_out(dtype, hidden):
    _assert_add_layer_norm_lowp_grad(hidden, dtype, "cpu")


@requires_cuda
@pytest.mark.cuda
@pytest.mark.parametrize("hidden", MIXED_HIDDENS)
@pytest.mark.parametrize("dtype", LOWP, ids=["bf16", "fp16"])
def test_cuda_add_layer_norm_backward_reads_a_lowp_grad_out(dtype, hidden):
    """The TG register kernels without grad_x (aligned rows up to 8192; 1023 and 8200 add in float first)."""
    _assert_add_layer_norm_lowp_grad(hidden, dtype, "cuda", rows=6 if hidden > 2000 else 37)
    if hidden == 1024:
        _assert_add_layer_norm_lowp_grad(hidden, dtype, "cuda", rows=4099)  # grid-stride


@requires_cuda
@pytest.mark.cuda
@pytest.mark.parametrize("hidden", [h for h in MIXED_HIDDENS if h % 8 == 0 and h <= 8192])
def test_cuda_column_sums_are_the_float_paths_at_full_grids(hidden):
    """More rows than any resident grid holds, so each backward kernel's grid is SMs x blocks per SM: the weight and
    bias gradients of a lower-precision out, x or second gradient are still the float path's bits. The variants'
    occupancy differs from the float kernel's by a few registers (ptxas: e.g. the float fanout at 200, 104 registers
    against 96: 4 blocks a SM against 5); every variant of a row shape runs the shape's one grid
    (docs/cuda-audit.md)."""
    rows = 16385 if hidden <= 2048 else 4099  # 128-thread blocks hold up to 16 x 4 rows a SM; 256-thread ones 8
    for dtype in LOWP:
        _assert_ln_matches_cast(rows, hidden, dtype, dtype, 0.3, "cuda")
        _assert_rms_matches_cast(rows, hidden, dtype, dtype, True, "cuda")
        _assert_rms_matches_cast(rows, hidden, torch.float32, dtype, False, "cuda")
    for stream in (torch.bfloat16, torch.float16, torch.float32):
        _assert_fanout_matches_add(stream, hidden, "cuda", rows=rows)
