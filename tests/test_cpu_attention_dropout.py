"""The CPU attention with ckpt_ext's Philox dropout, fused (mask + softmax + dropout in one row pass, one autograd
node: csrc/kernels/cpu/softmax_dropout*, attention.cpp) against the written-out ATen ops it replaces (the same
function with fused=False: gemm_bmm, add, softmax, ops::dropout, gemm_bmm, differentiated by autograd).

What must agree exactly: the dropout mask (the fused pass draws, at flat index i of the [B, heads, S, Sk]
probabilities, what ops::dropout draws for (seed, offset); checked against torch.ops.ckpt_ext.dropout_mask with
v = identity, where the output is the dropped probabilities themselves). What may differ: the softmax's last float
bits (the fused pass's exp is at::vec's exp_u20 and its sums run in its own order; ATen's softmax has its own), so
float32 values and gradients are compared to within a few float ulps; bfloat16 and autocast, where every value is
rounded to bfloat16 at least once after the softmax, to within one bfloat16 rounding in under 1% of the elements
(when written: equal bit for bit at the small shapes, under 0.3% differing at S 128-130). Also: the portable loops (ATEN_CPU_CAPABILITY=default) and the AVX2 rows on
an AVX-512 CPU against the reference; a fused BERT with attention dropout, switch on and off; the memory claim
(one [B, heads, S, Sk] tensor saved instead of two); bad input."""
import os
import subprocess
import sys

import pytest
import torch

import ckpt_ext
from ckpt_ext import _C

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
P, SEED, OFFSET = 0.1, 1234, 7
MASKS = ["none", "padding", "full", "causal"]
MODES = ["fp32", "bf16", "autocast"]


def operands(mode, mask_kind, B=2, H=3, S=37, Sk=None, D=16, seed=0):
    """q as the projection's transposed view (the layers' layout), k, v contiguous; the mask in the model's dtype
    (float32 under autocast, as Hugging Face builds it)."""
    g = torch.Generator().manual_seed(seed)
    Sk = S if Sk is None else Sk
    dt = torch.bfloat16 if mode == "bf16" else torch.float32
    q = torch.randn(B, S, H, D, generator=g).to(dt).transpose(1, 2)
    k = torch.randn(B, H, Sk, D, generator=g).to(dt)
    v = torch.randn(B, H, Sk, D, generator=g).to(dt)
    mask, causal = None, False
    if mask_kind == "padding":  # BERT's extended mask [B, 1, 1, Sk], finite as prepared() makes it
        mask = torch.zeros(B, 1, 1, Sk)
        mask[0, ..., max(1, Sk - 5):] = -1e30  # every row keeps a key (prepared()'s precondition)
        mask[B - 1, ..., :min(2, Sk - 1)] = -1e30
    elif mask_kind == "full":  # a [B, 1, S, Sk] additive mask with arbitrary finite values
        mask = torch.randn(B, 1, S, Sk, generator=g) * 3
        mask[..., ::3] = -1e30
        mask[..., 0] = 0.0  # no row fully masked
    elif mask_kind == "causal":
        causal = True
    if mask is not None and mode == "bf16":
        mask = mask.to(torch.bfloat16)
    grad = torch.randn(B, H, S, D, generator=g)
    return q, k, v, mask, causal, grad


def run(fused, mode, q, k, v, mask, causal, grad, scale):
    leaves = [t.detach().clone().requires_grad_() for t in (q, k, v)]
    with torch.autocast("cpu", dtype=torch.bfloat16, enabled=mode == "autocast"):
        out = _C._attention_philox_dropout_cpu(*leaves, mask, causal, scale, P, SEED, OFFSET, fused)
    out.backward(grad.to(out.dtype))
    return out.detach(), [t.grad for t in leaves]


def check(mode, mask_kind, **shape):
    q, k, v, mask, causal, grad = operands(mode, mask_kind, **shape)
    scale = q.size(-1) ** -0.5  # not a power of two for D = 12, 48: q's scaling rounds
    new = run(True, mode, q, k, v, mask, causal, grad, scale)
    ref = run(False, mode, q, k, v, mask, causal, grad, scale)
    names = ["out", "dq", "dk", "dv"]
    for name, a, b in zip(names, [new[0]] + new[1], [ref[0]] + ref[1]):
        assert a.dtype == b.dtype and a.shape == b.shape, name
        if mode == "fp32":
            torch.testing.assert_close(a, b, rtol=1e-5, atol=2e-6, msg=lambda m: f"{mode} {mask_kind} {name}: {m}")
        else:  # one bfloat16 rounding apart at most, and that rarely: where the float softmax's last bits decide it
            torch.testing.assert_close(a.float(), b.float(), rtol=2 ** -7, atol=2 ** -7,
                                       msg=lambda m: f"{mode} {mask_kind} {name}: {m}")
            differ = (a != b).float().mean().item()
            assert differ < 0.01, f"{mode} {mask_kind} {name}: {differ:.1%} of the elements differ (a rounding the " \
                                  "written-out ops make is made differently, e.g. q's scaling)"


@pytest.mark.parametrize("mask_kind", MASKS)
@pytest.mark.parametrize("mode", MODES)
def test_fused_matches_the_written_out_ops(mode, mask_kind):
    check(mode, mask_kind)


@pytest.mark.parametrize("shape", [dict(S=128, D=64, H=4, B=4), dict(S=130, D=12, H=2, B=1), dict(S=5, Sk=67, D=48, H=3, B=2),
                                   dict(S=1, D=8, H=1, B=1)], ids=["bert", "partial-step", "cross", "one"])
@pytest.mark.parametrize("mode", MODES)
def test_fused_matches_on_other_shapes(mode, shape):
    """Rows that are whole SIMD steps, end in a partial step, are shorter than one; S != Sk (padding mask); many
    rows per dropout-word fill and per thread (B 4, heads 4, S 128: BERT's 6 x 256 benchmark shape)."""
    check(mode, "causal" if "Sk" not in shape else "padding", **shape)
    check(mode, "padding", **shape)


@pytest.mark.parametrize("mask_kind", MASKS)
def test_dropout_mask_is_ops_dropout_mask(mask_kind):
    """v = identity (D = Sk): the output is the dropped probabilities; zero exactly where ckpt_ext's dropout mask
    of (seed, offset) drops the element at its flat index (or the mask or the causal triangle masks it), in both
    paths."""
    B, H, S = 2, 3, 40
    q, k, _, mask, causal, _ = operands("fp32", mask_kind, B=B, H=H, S=S, D=S)
    v = torch.eye(S).expand(B, H, S, S).contiguous()
    keep = torch.ops.ckpt_ext.dropout_mask(B * H * S * S, P, SEED, OFFSET, torch.device("cpu")).view(B, H, S, S)
    want_zero = ~keep
    if causal:
        want_zero = want_zero | torch.ones(S, S, dtype=torch.bool).triu(1)
    if mask is not None:  # masked keys: probability 0
        want_zero = want_zero | (mask <= -1e29).expand(B, H, S, S)
    for fused in (True, False):
        out = _C._attention_philox_dropout_cpu(q, k, v, mask, causal, 0.125, P, SEED, OFFSET, fused)
        assert torch.equal(out == 0, want_zero), f"fused={fused}"
    kept_fraction = keep.float().mean().item()
    assert abs(kept_fraction - (1 - P)) < 0.02


def test_one_probability_tensor_saved():
    """The fused node saves q, k, v and the probabilities; the written-out ops saved the probabilities and the
    dropped probabilities (and more): count the saved tensors of the [B, heads, S, Sk] shape."""
    q, k, v, mask, causal, _ = operands("fp32", "padding", S=40, D=8)
    shape = (q.size(0), q.size(1), 40, 40)
    counts = {}
    for fused in (True, False):
        seen = []

        def pack(t):
            if t.numel() == q.size(0) * q.size(1) * 40 * 40:
                seen.append(t.data_ptr())
            return t

        leaves = [t.detach().clone().requires_grad_() for t in (q, k, v)]
        with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
            _C._attention_philox_dropout_cpu(*leaves, mask, causal, 0.25, P, SEED, OFFSET, fused)
        counts[fused] = len(set(seen))
    assert counts[True] == 1, counts
    assert counts[False] >= 2, counts
    assert shape  # documented shape


def test_fused_node_and_no_grad():
    q, k, v, mask, causal, _ = operands("fp32", "padding")
    leaves = [t.detach().clone().requires_grad_() for t in (q, k, v)]
    out = _C._attention_philox_dropout_cpu(*leaves, mask, causal, 0.25, P, SEED, OFFSET, True)
    assert "FusedPhiloxAttention" in out.grad_fn.name()
    with torch.no_grad():  # the forward without the probabilities stored: the same output
        again = _C._attention_philox_dropout_cpu(*leaves, mask, causal, 0.25, P, SEED, OFFSET, True)
    assert torch.equal(out.detach(), again)
    other = _C._attention_philox_dropout_cpu(q, k, v, mask, causal, 0.25, P, SEED + 1, OFFSET, True)
    assert not torch.equal(other, again)


def test_bad_input_is_refused():
    q, k, v, mask, _, _ = operands("fp32", "padding")
    with pytest.raises(RuntimeError, match="additive"):
        _C._attention_philox_dropout_cpu(q, k, v, mask < -1, False, 0.25, P, SEED, OFFSET, True)
    with pytest.raises(RuntimeError, match="causal"):
        _C._attention_philox_dropout_cpu(q, k, v, mask, True, 0.25, P, SEED, OFFSET, True)
    with pytest.raises(RuntimeError, match="0 < p < 1"):
        _C._attention_philox_dropout_cpu(q, k, v, mask, False, 0.25, 0.0, SEED, OFFSET, True)


def test_float64_and_mask_gradients_take_the_written_out_ops():
    """What the fused pass does not cover runs the reference: float64 (gradcheck-able), a mask that takes a gradient."""
    q, k, v, mask, _, _ = operands("fp32", "full", S=6, D=4, H=1, B=1)
    qd, kd, vd = (t.double().detach().requires_grad_() for t in (q, k, v))
    md = mask.clamp_min(-30).double()
    torch.autograd.gradcheck(lambda a, b, c: _C._attention_philox_dropout_cpu(a, b, c, md, False, 0.5, P, SEED, OFFSET,
                                                                            True), (qd, kd, vd))
    m = mask.clamp_min(-30).requires_grad_()
    out = _C._attention_philox_dropout_cpu(q, k, v, m, False, 0.5, P, SEED, OFFSET, True)
    out.sum().backward()
    assert m.grad is not None


# ---- the other code paths of the row pass: the portable loops, AVX2 on an AVX-512 CPU ---------------------------

_CHILD = """
import sys
sys.path.insert(0, {root!r}); sys.path.insert(0, {tests!r})
import test_cpu_attention_dropout as t
for mode in t.MODES:
    for mask_kind in t.MASKS:
        t.check(mode, mask_kind)
    t.check(mode, "padding", S=130, D=12, H=2, B=1)
    t.check(mode, "causal", S=130, D=12, H=2, B=1)
print("ok")
"""


def capabilities_below():
    native = torch.backends.cpu.get_cpu_capability()
    return {"AVX512": ["default", "avx2"], "AVX2": ["default"]}.get(native, [])


@pytest.mark.skipif(not capabilities_below(), reason="this CPU has no SIMD kernels to compare")
@pytest.mark.parametrize("cap", capabilities_below() or ["none"])
def test_other_code_paths_match_the_written_out_ops(cap):
    env = dict(os.environ, ATEN_CPU_CAPABILITY=cap)
    code = _CHILD.format(root=ROOT, tests=os.path.join(ROOT, "tests"))
    r = subprocess.run([sys.executable, "-c", code], env=env, cwd=ROOT, capture_output=True, text=True)
    assert r.returncode == 0 and "ok" in r.stdout, r.stderr[-3000:]


# ---- in a fused BERT ---------------------------------------------------------------------------------------------


def test_fused_bert_switch_on_and_off():
    """A fused BERT layer stack with attention dropout: the fused attention (default) and the written-out ops give
    the same loss and gradients to within the softmax's rounding, and the same mask (a mask difference would be
    O(1) in the gradients); eval (no dropout) never takes either path."""
    transformers = pytest.importorskip("transformers")
    sys.path.insert(0, os.path.join(ROOT, "tests"))
    from helpers.hf_models import inputs_for, make_model

    model = ckpt_ext.fuse(make_model("bert", dropout=0.1)).train()
    kw = inputs_for("bert", padding=True)
    results = {}
    before = _C.cpu_fused_attention()
    try:
        for on in (True, False):
            _C.cpu_fused_attention(on)
            model.zero_grad()
            torch.manual_seed(3)
            loss = model(**kw).last_hidden_state.square().mean()
            loss.backward()
            results[on] = [loss.detach()] + [p.grad.clone() for p in model.parameters() if p.grad is not None]
    finally:
        _C.cpu_fused_attention(before)
    assert _C.cpu_fused_attention() == before
    for a, b in zip(results[True], results[False]):
        torch.testing.assert_close(a, b, rtol=1e-4, atol=1e-6)
    del transformers
