"""Property tests (hypothesis): random configurations, shapes, dtypes, layouts and masks against the
reference each part of ckpt_ext promises to equal.

* Fused layers (ckpt_ext.fuse) against the Hugging Face modules they replace, dropout off, for each family
  (BERT, RoBERTa, GPT-2, Llama) and attention implementation (eager, sdpa): random head counts, grouped-
  query attention, head_dim apart from hidden, intermediate sizes, epsilons, every supported GELU/SiLU
  spelling, GPT-2's attention scalings, Llama biases and rope variants; float32 and float64; batch and
  sequence lengths down to 1; no mask, all ones, left, right or arbitrary padding, fully padded
  sequences included. Outputs, the input gradient and every parameter gradient. A dropout probability
  of 1e-30 takes the fused layers' explicit-attention and dropout-kernel paths while dropping nothing.
* ckpt_ext.checkpoint and checkpoint_sequential against the plain call, dropout on, bit-identical:
  random blocks, arguments of any structure (nested containers, None, non-tensors, keyword arguments,
  tensors with and without requires_grad), outputs of any structure, nested checkpoints.
* enable_checkpointing(every=k) against the same model unchecked, dropout on, bit-identical: random
  stacks, k, layer keyword arguments and output styles, inputs with and without requires_grad. (A tensor
  used by several groups gets the same gradient terms summed in another order: equal to rounding.)
* Fused + enable_checkpointing (the C++ SegmentFunction) against the plain fused model, dropout on,
  bit-identical, for random configurations, k, masks and dtypes.
* The ckpt_ext.ops kernels against the plain-PyTorch references of test_kernels.py on random shapes,
  dtypes (float32, float64, bfloat16, float16) and layouts (transposed, strided, offset, broadcast),
  inputs with and without requires_grad; their outputs' shapes and strides against the fake kernels.

Tolerances: float32 1e-5 relative to the compared quantity's scale, as test_fused.py and test_kernels.py
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

    CKPT_EXT_PROPERTY_SCALE=10 pytest tests/test_properties.py --hypothesis-seed=$RANDOM

and turn what it finds into a fix and a regression test.
"""
import contextlib
import copy
import math
import os
import warnings
from typing import Dict, List, Optional
from unittest import mock

import pytest
import torch
from hypothesis import HealthCheck, assume, event, given, note, settings
from hypothesis import strategies as st
from torch import nn
from torch._prims_common import check_significant_strides
from torch._subclasses.fake_tensor import FakeTensorMode
from torch.utils import _pytree as pytree

import ckpt_ext
from ckpt_ext import FusedTransformerLayer, fuse, ops
from reference import StepResult, _projection, assert_grads_close, leaf_inputs, make_block, make_stack

transformers = pytest.importorskip("transformers")
from helpers.hf_models import close, grads_close, layers_of, make_model  # noqa: E402
from helpers.kernel_refs import (as_tuple, assert_close_fp32, clone_inputs, forward_backward, max_err,  # noqa: E402
                                 named_errors, ref_add_layer_norm, ref_bias_dropout_add,
                                 ref_bias_dropout_add_layer_norm, ref_bias_gelu, ref_dropout, ref_rms_norm, ref_rotary,
                                 ref_swiglu)

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


@contextlib.contextmanager
def _quiet():
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # transformers' FutureWarnings about its own APIs
        yield


# --------------------------------------------------------------------------------------------------
# Hugging Face configurations
# --------------------------------------------------------------------------------------------------
# Every spelling of an activation that fuse() supports (transformers.activations.ACT2FN names).
GELUS = ["gelu", "gelu_python", "gelu_new", "gelu_pytorch_tanh", "gelu_python_tanh", "gelu_fast"]
SILUS = ["silu", "swish"]
ROPES = [
    {"rope_type": "default", "rope_theta": 10.0},
    {"rope_type": "default", "rope_theta": 10000.0},
    {"rope_type": "linear", "rope_theta": 500.0, "factor": 2.0},
    {"rope_type": "dynamic", "rope_theta": 10000.0, "factor": 3.0},
    {"rope_type": "llama3", "rope_theta": 500000.0, "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
     "original_max_position_embeddings": 4},
]
# A dropout probability that sends the fused layers down their dropout paths (explicit softmax attention
# with a Philox mask, the dropout kernels) while, in practice, dropping nothing: torch's dropout keeps
# with probability 1 - 1e-30 == 1, and the Philox mask drops only elements whose 24-bit uniform is
# exactly 0 (2**-24 each, about 1e-4 per example here). The examples are fixed (derandomized), so this
# cannot flake; under --hypothesis-seed, a failure by far more than rounding may be such a drop.
_TINY_P = 1e-30


FAMILIES = ["bert", "roberta", "gpt2", "llama"]


# Degenerate norms: a LayerNorm over 2 features outputs +-weight + bias whatever its input, and an RMSNorm over
# 1 feature +-weight (up to eps), so every gradient below them is zero in exact arithmetic and both
# implementations compute rounding noise amplified by rstd: nothing to compare. (A LayerNorm over 1 feature is
# exact: the centred input is 0.)
@st.composite
def hf_configs(draw, family: str, attn: str, dropout=False):
    """make_model overrides for a `family` model with `attn` attention. dropout=False: no dropout, or _TINY_P
    everywhere; dropout=True: real dropout probabilities."""
    heads = draw(st.integers(1, 4))
    if dropout:
        p = draw(st.sampled_from([0.0, 0.1, 0.5]))
        p2 = draw(st.sampled_from([0.0, 0.1, 0.5]))
    else:
        p = p2 = draw(st.sampled_from([0.0, 0.0, _TINY_P]))
    if family in ("bert", "roberta"):
        head_dim = draw(st.integers(1, 10))
        assume(heads * head_dim != 2)  # degenerate norm, see above
        ov = dict(hidden_size=heads * head_dim, num_attention_heads=heads, intermediate_size=draw(st.integers(1, 40)),
                  layer_norm_eps=draw(st.sampled_from([1e-12, 1e-5, 1e-2])), hidden_act=draw(st.sampled_from(GELUS)),
                  hidden_dropout_prob=p, attention_probs_dropout_prob=p2)
    elif family == "gpt2":
        head_dim = draw(st.integers(1, 10))
        assume(heads * head_dim != 2)  # degenerate norm, see above
        ov = dict(n_embd=heads * head_dim, n_head=heads, n_inner=draw(st.one_of(st.none(), st.integers(1, 40))),
                  activation_function=draw(st.sampled_from(GELUS)),
                  layer_norm_epsilon=draw(st.sampled_from([1e-12, 1e-5, 1e-2])),
                  scale_attn_weights=draw(st.booleans()), scale_attn_by_inverse_layer_idx=draw(st.booleans()),
                  resid_pdrop=p, attn_pdrop=p2, embd_pdrop=0.0)
        if attn == "sdpa":  # Hugging Face's sdpa path ignores it; fuse() refuses it with eager
            ov["reorder_and_upcast_attn"] = draw(st.booleans())
    else:
        kv_heads = draw(st.sampled_from([d for d in range(1, heads + 1) if heads % d == 0]))
        head_dim = 2 * draw(st.integers(1, 5))  # apart from hidden_size, which transformers wants a multiple of heads
        rope = draw(st.sampled_from(ROPES))
        assume(head_dim > 2 or rope["rope_type"] != "dynamic")  # transformers divides by head_dim - 2
        hidden = heads * draw(st.integers(1, 10))
        assume(hidden != 1)  # degenerate norm, see above
        ov = dict(hidden_size=hidden, num_attention_heads=heads, num_key_value_heads=kv_heads,
                  head_dim=head_dim, intermediate_size=draw(st.integers(1, 40)),
                  rms_norm_eps=draw(st.sampled_from([1e-12, 1e-6, 1e-2])), hidden_act=draw(st.sampled_from(SILUS)),
                  rope_parameters=rope, max_position_embeddings=16,
                  attention_bias=draw(st.booleans()), mlp_bias=draw(st.booleans()), attention_dropout=p2)
    return ov


@st.composite
def padding_masks(draw, batch: int, seq: int):
    """None or a [batch, seq] 0/1 attention mask: all ones, right or left padding of random lengths,
    or an arbitrary pattern; rows with no token at all included."""
    kind = draw(st.sampled_from(["none", "ones", "right", "left", "arbitrary"]))
    if kind == "none":
        return None
    mask = torch.ones(batch, seq, dtype=torch.long)
    for b in range(batch):
        if kind == "arbitrary":
            mask[b] = torch.tensor(draw(st.lists(st.integers(0, 1), min_size=seq, max_size=seq)))
        elif kind != "ones":
            n = draw(st.integers(0, seq))  # tokens kept
            if kind == "right":
                mask[b, n:] = 0
            else:
                mask[b, :seq - n] = 0
    return mask


@st.composite
def batches(draw):
    """(batch, seq, attention_mask or None); sequences down to 1 token."""
    batch, seq = draw(st.integers(1, 3)), draw(st.integers(1, 9))
    return batch, seq, draw(padding_masks(batch, seq))


def _fully_masked_queries(mask: Optional[torch.Tensor], causal: bool) -> Optional[torch.Tensor]:
    """[batch, seq] bool: the query positions whose attention row masks every key."""
    if mask is None:
        return None
    keys = mask.bool()
    if causal:  # query i sees keys 0..i
        return ~(keys.long().cumsum(-1) > 0)
    return (~keys.any(-1, keepdim=True)).expand_as(keys)


def _rms_norm_in_input_dtype(self, hidden_states):
    """LlamaRMSNorm.forward without its float32 upcast (Hugging Face computes float64 models' RMSNorm in
    float32; the float64 reference must not)."""
    variance = hidden_states.pow(2).mean(-1, keepdim=True)
    return self.weight * (hidden_states * torch.rsqrt(variance + self.variance_epsilon))


def _float64_reference(family: str, dtype: torch.dtype) -> contextlib.ExitStack:
    """Patches LlamaRMSNorm for float64 Llama models (the fused model's final norm, Hugging Face's module
    outside the layers, runs it too: it is not what is compared)."""
    stack = contextlib.ExitStack()
    if family == "llama" and dtype == torch.float64:
        from transformers.models.llama.modeling_llama import LlamaRMSNorm
        stack.enter_context(mock.patch.object(LlamaRMSNorm, "forward", _rms_norm_in_input_dtype))
    return stack


def _loss_weights(shape, dtype, seed=1234):
    return torch.randn(shape, generator=torch.Generator().manual_seed(seed), dtype=torch.float64).to(dtype)


def _model_step(model, emb, kw, weights):
    """Forward from inputs_embeds (a fresh leaf when `emb` requires grad), backward of sum(out * weights);
    returns (output, input gradient, {name: parameter gradient})."""
    model.zero_grad(set_to_none=True)
    e = emb.detach().clone().requires_grad_(emb.requires_grad)
    out = model(inputs_embeds=e, **kw).last_hidden_state
    (out * weights).sum().backward()
    grads = {n: None if p.grad is None else p.grad.clone() for n, p in model.named_parameters()}
    return out.detach(), e.grad, grads


# --------------------------------------------------------------------------------------------------
# Fused layers == the Hugging Face modules they replace
# --------------------------------------------------------------------------------------------------
@pytest.mark.parametrize("attn", ["eager", "sdpa"])
@pytest.mark.parametrize("family", FAMILIES)
@examples(30)
@given(data=st.data(), layers=st.integers(1, 3), inputs=batches(),
       dtype=st.sampled_from([torch.float32, torch.float64]))
@_quiet()
def test_fused_layers_match_hugging_face(family, attn, data, layers, inputs, dtype):
    if family == "llama" and attn == "eager":
        # Hugging Face's eager Llama attention takes its softmax in float32 even in float64 models (a fully
        # masked row then becomes NaN): it is no float64 reference.
        dtype = torch.float32
    ov = data.draw(hf_configs(family, attn), label="config")
    event(f"{str(dtype)[6:]}{' dropout paths' if _TINY_P in ov.values() else ''}")  # for --hypothesis-show-statistics
    assert_fused_matches_hugging_face(family, attn, ov, layers, inputs, dtype)


@_quiet()
def test_float64_attention_with_dropout_is_float64():
    """Regression (found by the property above): the explicit attention path (attention dropout > 0) took a
    float32 softmax in float64 models, 1e-10 away from Hugging Face's float64 BERT instead of 1e-16."""
    ov = dict(hidden_size=6, num_attention_heads=2, intermediate_size=5, layer_norm_eps=1e-12, hidden_act="gelu",
              hidden_dropout_prob=_TINY_P, attention_probs_dropout_prob=_TINY_P)
    mask = torch.tensor([[1, 1, 1, 0, 0], [1, 1, 1, 1, 1]])
    assert_fused_matches_hugging_face("bert", "sdpa", ov, 1, (2, 5, mask), torch.float64)


@pytest.mark.xfail(strict=True, reason="torch's CPU SDPA differentiates a fully masked row (additive mask) as seq_len "
                   "times Hugging Face's eager softmax does; the outputs agree")
@_quiet()
def test_eager_gradient_through_a_fully_masked_query_matches_hugging_face():
    """Known difference (the property leaves these positions out of its loss): with eager attention the fused
    layer passes Hugging Face's additive mask to SDPA, whose CPU kernel returns, for a query whose every key is
    masked, seq_len times the gradient of the uniform softmax that Hugging Face's eager attention
    differentiates. Minimal form, torch alone: q, k, v = randn(1, 1, 3, 4) each, mask = zeros(1, 1, 3, 3) with
    row 0 = finfo.min; grad of q[0, 0, 0] through F.scaled_dot_product_attention(q, k, v, attn_mask=mask) is 3x
    that through softmax(q @ k^T / 2 + mask) @ v. Both are artefacts of rounding (the row's output does not
    depend on its scores) and losses ignore padded positions, but it is a divergence from the module replaced."""
    mask = torch.tensor([[1, 1, 1, 1, 1], [0, 0, 0, 0, 0]])  # the second sequence fully padded
    torch.manual_seed(0)
    model = make_model("bert", layers=1, attn="eager", hidden_size=12, num_attention_heads=2, intermediate_size=8)
    fused = fuse(copy.deepcopy(model)).train()
    emb = torch.randn(2, 5, 12)
    weights = _loss_weights(emb.shape, torch.float32)
    ref = _model_step(model.train(), emb.requires_grad_(), {"attention_mask": mask}, weights)
    got = _model_step(fused, emb, {"attention_mask": mask}, weights)
    close(got[0], ref[0])  # the outputs agree
    close(got[1], ref[1])  # the gradient does not, in the padded sequence


def assert_fused_matches_hugging_face(family, attn, ov, layers, inputs, dtype):
    """make_model(family, ...) against fuse() of a copy, training mode, from inputs_embeds: the outputs, the
    input gradient and every parameter gradient, to TOL[dtype]."""
    batch, seq, mask = inputs
    torch.manual_seed(0)
    model = make_model(family, layers=layers, attn=attn, **ov).to(dtype).train()
    fused = fuse(copy.deepcopy(model))
    assert all(isinstance(m, FusedTransformerLayer) for m in layers_of(fused))
    kw = {} if mask is None else {"attention_mask": mask}
    if family in ("gpt2", "llama"):
        kw["use_cache"] = False
    emb = torch.randn(batch, seq, model.get_input_embeddings().embedding_dim, dtype=dtype)
    weights = _loss_weights(emb.shape, dtype)
    if attn == "eager" and mask is not None and _TINY_P not in ov.values():
        # A query whose every key is masked: same outputs, different gradients, because of torch's SDPA
        # (see the strict xfail above). Training losses ignore padded positions; so does this one here
        # (their outputs are still compared). The explicit attention of the dropout paths agrees in full.
        dead = _fully_masked_queries(mask, causal=family in ("gpt2", "llama"))
        weights = weights.masked_fill(dead[..., None], 0.0)
    with _float64_reference(family, dtype):
        ref = _model_step(model, emb.requires_grad_(), kw, weights)
        got = _model_step(fused, emb, kw, weights)
    tol = TOL[dtype]
    close(got[0], ref[0], **tol)
    # The input gradient on the scale of all gradients (as grads_close does for the parameters'): where it
    # is zero in exact arithmetic (masked positions...), both sides hold rounding noise.
    scale = max(g.abs().max().item() for g in [ref[1], *ref[2].values()] if g is not None)
    close(got[1], ref[1], scale=max(1e-2 * scale, ref[1].abs().max().item()), **tol)
    grads_close(model, fused, **tol)


# --------------------------------------------------------------------------------------------------
# ckpt_ext.checkpoint == the plain call, bit for bit
# --------------------------------------------------------------------------------------------------
def _step(fn, inputs: List, params: Dict[str, torch.Tensor], seed: int) -> StepResult:
    """reference.run_step, except that each output leaf is projected by its position in the output tree.
    run_step numbers only the leaves that require grad, and a checkpointed call returns its float outputs
    as differentiable even when the plain call's do not (README: "What is not done"); their gradient is
    zero, but counting them would shift every later leaf's projection."""
    for p in params.values():
        p.grad = None
    leaves = [t.detach().clone().requires_grad_(t.requires_grad) if isinstance(t, torch.Tensor) else t for t in inputs]
    torch.manual_seed(seed)
    out = fn(*leaves)
    terms = [(t.float() * _projection(t, i)).sum() for i, t in enumerate(pytree.tree_leaves(out))
             if isinstance(t, torch.Tensor) and t.is_floating_point() and t.requires_grad]
    if terms:
        sum(terms).backward()
    outputs = pytree.tree_map(lambda v: v.detach() if isinstance(v, torch.Tensor) else v, out)
    grads = {n: None if p.grad is None else p.grad.clone() for n, p in params.items()}
    for p in params.values():
        p.grad = None
    return StepResult(outputs, [t.grad for t in leaves if isinstance(t, torch.Tensor)], grads)


# Output leaves: what a function may return besides its result h.
_LEAVES = ["h", "h2", "sum", "argmax", "x", "none", "int", "str"]
output_trees = st.recursive(
    st.sampled_from(_LEAVES),
    lambda children: st.one_of(st.lists(children, min_size=1, max_size=3).map(tuple),
                               st.lists(children, min_size=1, max_size=3),
                               st.dictionaries(st.sampled_from("abc"), children, min_size=1, max_size=3)),
    max_leaves=6)


def _build_output(tree, h, x):
    if isinstance(tree, (tuple, list)):
        return type(tree)(_build_output(t, h, x) for t in tree)
    if isinstance(tree, dict):
        return {k: _build_output(v, h, x) for k, v in tree.items()}
    return {"h": lambda: h, "h2": lambda: h * 2.0 + 1.0, "sum": lambda: h.sum(), "argmax": lambda: h.argmax(-1),
            "x": lambda: x, "none": lambda: None, "int": lambda: 7, "str": lambda: "text"}[tree]()


@examples(80)
@given(dim=st.integers(1, 12), hidden=st.integers(1, 16), n_blocks=st.integers(1, 3),
       p=st.sampled_from([0.0, 0.1, 0.5]), batch=st.integers(1, 4), tree=output_trees,
       x_grad=st.booleans(), y=st.sampled_from([None, False, True]), shift=st.sampled_from([None, False, True]),
       params_grad=st.booleans(), scale=st.floats(-2.0, 2.0), nested=st.booleans(), seed=st.integers(0, 2**31))
def test_checkpoint_matches_the_plain_call(dim, hidden, n_blocks, p, batch, tree, x_grad, y, shift, params_grad, scale,
                                           nested, seed):
    """Any arguments (a dict, a list with a tensor or None, a float, None; keyword tensors or None and a
    string), any output structure, tensors with and without requires_grad, a checkpoint nested inside:
    the outputs, the inputs' gradients and the parameters' gradients are bit-identical to the plain call's
    under the same seed, dropout on."""
    stack = make_stack(n_blocks, dim, hidden, p, seed=seed % 1000).requires_grad_(params_grad)
    params = dict(stack.named_parameters())

    def fn(d, lst, scale, none_arg, *, shift=None, tag="t"):
        assert none_arg is None and tag == "tag"
        x = d["x"]
        h = x
        for i, block in enumerate(stack):
            h = ckpt_ext.checkpoint(block, h) if nested and i == 0 else block(h)
        h = h * scale
        if lst[0] is not None:
            h = h + lst[0]
        if shift is not None:
            h = h + shift
        return _build_output(tree, h, x)

    def call(wrap):
        def run(x, yv, sv):
            args = ({"x": x}, [yv], scale, None)
            if wrap is None:
                return fn(*args, shift=sv, tag="tag")
            return wrap(fn, *args, shift=sv, tag="tag")
        return run

    tensors = leaf_inputs((batch, dim), (dim,), (dim,), seed=seed, requires_grad=[x_grad, bool(y), bool(shift)])
    inputs = [tensors[0], None if y is None else tensors[1], None if shift is None else tensors[2]]
    plain = _step(call(None), inputs, params, seed)
    ours = _step(call(ckpt_ext.checkpoint), inputs, params, seed)
    if str(tree).count("'h'") > 1 or str(tree).count("'x'") > 1:
        # One tensor returned several times: its gradient terms are summed in another order (see the strict
        # xfail below): the outputs bit-identical, the gradients equal to rounding.
        assert_grads_close(*(r._replace(input_grads=[], param_grads={}) for r in (plain, ours)), exact=True)
        assert_grads_close(plain, ours)
    else:
        assert_grads_close(plain, ours, exact=True)
    anything_needs_grad = params_grad or any(isinstance(t, torch.Tensor) and t.requires_grad for t in inputs)
    pooled = [ckpt_ext.is_pooled(t) for t in pytree.tree_leaves(ours.outputs) if isinstance(t, torch.Tensor)]
    assert not any(pooled)  # torch's design (issue 13): outputs are the function's own tensors
    del anything_needs_grad


def test_checkpoint_of_a_tensor_returned_several_times_is_bit_identical():
    """Found by test_checkpoint_matches_the_plain_call (under --hypothesis-seed). fn returns (h, h, h, h): without
    checkpointing h is one tensor whose gradient autograd sums as the terms arrive, g3 + g2 + g1 + g0. ckpt_ext
    used to return four pooled copies of h (out[0] is out[1] no longer held, h was stored four times) and the
    replay's autograd.grad summed g0 + g1 + g2 + g3 -- 1 ulp apart. Now one slot per distinct output tensor."""
    block = make_block(p=0.0, seed=3)
    x, = leaf_inputs((3, 19), seed=3)
    fn = lambda t: (lambda h: (h, h, h, h))(block(t))  # noqa: E731
    params = dict(block.named_parameters())
    assert_grads_close(_step(fn, [x], params, 0), _step(lambda t: ckpt_ext.checkpoint(fn, t), [x], params, 0),
                       exact=True)
    out = ckpt_ext.checkpoint(fn, x)
    assert out[0] is out[1] is out[3]


@examples(30)
@given(n=st.integers(1, 6), dim=st.integers(1, 12), p=st.sampled_from([0.0, 0.2]), x_grad=st.booleans(),
       data=st.data())
def test_checkpoint_sequential_matches_the_plain_stack(n, dim, p, x_grad, data):
    segments = data.draw(st.integers(1, n), label="segments")
    stack = make_stack(n, dim, 2 * dim + 1, p, seed=n)
    x, = leaf_inputs((3, dim), seed=n, requires_grad=x_grad)
    params = dict(stack.named_parameters())
    plain = _step(stack, [x], params, seed=5)
    ours = _step(lambda t: ckpt_ext.checkpoint_sequential(stack, segments, t), [x], params, seed=5)
    assert_grads_close(plain, ours, exact=True)


# --------------------------------------------------------------------------------------------------
# enable_checkpointing(every=k) == the same model unchecked, bit for bit
# --------------------------------------------------------------------------------------------------
class KwargLayer(nn.Module):
    """A block called as Hugging Face's stacks call their layers: hidden states, a positional mask, keyword
    arguments (a float, a tensor that may require grad, a string), returning a tensor or a tuple/list whose
    first element is the hidden state."""

    def __init__(self, dim, hidden, p, style, seed):
        super().__init__()
        self.block = make_block(dim, hidden, p, seed)
        self.style = style

    def forward(self, x, mask=None, *, scale=1.0, shift=None, tag=None):
        h = self.block(x) * scale
        if shift is not None:
            h = h + shift
        if mask is not None:
            h = h.masked_fill(mask, 0.0)
        return {"tensor": lambda: h, "tuple": lambda: (h,), "tuple_none": lambda: (h, None),
                "tuple_aux": lambda: (h, h.sum(), tag), "list": lambda: [h]}[self.style]()


class KwargStack(nn.Module):
    def __init__(self, layers):
        super().__init__()
        self.layers = nn.ModuleList(layers)

    def forward(self, x, mask, shift, scale, tag):
        h, out = x, None
        for layer in self.layers:
            out = layer(h, mask, scale=scale, shift=shift, tag=tag)
            h = out if isinstance(out, torch.Tensor) else out[0]
        return h, out


@examples(80)
@given(n=st.integers(1, 5), dim=st.integers(1, 10), style=st.sampled_from(["tensor", "tuple", "tuple_none", "tuple_aux",
                                                                          "list"]),
       ps=st.lists(st.sampled_from([0.0, 0.1, 0.5]), min_size=5, max_size=5), x_grad=st.booleans(),
       mask=st.booleans(), shift=st.sampled_from([None, False, True]), scale=st.floats(0.5, 2.0),
       explicit_layers=st.booleans(), data=st.data())
def test_enable_checkpointing_matches_the_unchecked_model(n, dim, style, ps, x_grad, mask, shift, scale,
                                                          explicit_layers, data):
    every = data.draw(st.integers(1, n), label="every")
    model = KwargStack([KwargLayer(dim, dim + 3 * i, ps[i], style, seed=i) for i in range(n)]).train()
    x, s = leaf_inputs((4, dim), (dim,), seed=n, requires_grad=[x_grad, bool(shift)])
    m = (torch.arange(4 * dim).reshape(4, dim) % 3 == 0) if mask else None
    inputs = [x, m, None if shift is None else s, scale, "tag"]
    params = dict(model.named_parameters())
    plain = _step(model, inputs, params, seed=3)
    ckpt_ext.enable_checkpointing(model, every=every, layers=model.layers if explicit_layers or n == 1 else None)
    try:
        ours = _step(model, inputs, params, seed=3)
        torch.manual_seed(3)
        frames = ckpt_ext._C.checkpoint_frames_created()
        model(*inputs)
        assert ckpt_ext._C.checkpoint_frames_created() > frames  # the stack really ran checkpointed
    finally:
        ckpt_ext.disable_checkpointing(model)
    if shift and 1 < every < n:
        # `shift` is used by every layer. Without checkpointing its gradient is summed layer by layer, last
        # to first: ((g2 + g1) + g0). A group of layers is one autograd node that returns its layers' sum,
        # (g2 + (g1 + g0)): the same terms associated differently, so equal up to rounding only.
        close(ours.input_grads[-1], plain.input_grads[-1], rtol=1e-6, atol=1e-6)
        plain, ours = (r._replace(input_grads=r.input_grads[:-1]) for r in (plain, ours))
    assert_grads_close(plain, ours, exact=True)


# --------------------------------------------------------------------------------------------------
# Fused layers checkpointed (C++ SegmentFunction) == the same fused model unchecked, bit for bit
# --------------------------------------------------------------------------------------------------
def _graph_names(t: torch.Tensor) -> set:
    names, seen, todo = set(), set(), [t.grad_fn]
    while todo:
        fn = todo.pop()
        if fn is None or fn in seen:
            continue
        seen.add(fn)
        names.add(fn.name())
        todo.extend(f for f, _ in fn.next_functions)
    return names


@pytest.mark.parametrize("attn", ["eager", "sdpa"])
@pytest.mark.parametrize("family", FAMILIES)
@examples(20)
@given(data=st.data(), stack=st.integers(1, 4).flatmap(lambda n: st.tuples(st.just(n), st.integers(1, n))),
       inputs=batches(), dtype=st.sampled_from([torch.float32, torch.float64]), embeds=st.booleans())
@_quiet()
def test_checkpointed_fused_layers_match_unchecked_fused_layers(family, attn, data, stack, inputs, dtype, embeds):
    """Dropout on (hidden and attention-probability dropout drawn independently), any group size: outputs,
    the input gradient (inputs_embeds) or none (input_ids) and every parameter gradient bit-identical."""
    ov = data.draw(hf_configs(family, attn, dropout=True), label="config")
    layers, every = stack
    batch, seq, mask = inputs
    note(f"{family} {attn} {dtype} layers={layers} every={every} batch={batch} seq={seq} {ov} mask={mask}")
    torch.manual_seed(0)
    plain = fuse(make_model(family, layers=layers, attn=attn, **ov)).to(dtype).train()
    ck = copy.deepcopy(plain)
    ckpt_ext.enable_checkpointing(ck, every=every, layers=layers_of(ck))  # named: one layer is no stack to find
    kw = {} if mask is None else {"attention_mask": mask}
    if family in ("gpt2", "llama"):
        kw["use_cache"] = False
    if embeds:
        emb = torch.randn(batch, seq, plain.get_input_embeddings().embedding_dim, dtype=dtype, requires_grad=True)
    else:
        kw["input_ids"] = torch.randint(3, 61, (batch, seq))
        emb = None
    weights = _loss_weights((batch, seq, plain.get_input_embeddings().embedding_dim), dtype)
    results = []
    for model in (plain, ck):
        e = None if emb is None else emb.detach().clone().requires_grad_()
        torch.manual_seed(11)
        out = model(inputs_embeds=e, **kw).last_hidden_state
        results.append((out, e))
        (out * weights).sum().backward()
    (ref, e_ref), (out, e_out) = results
    assert any("SegmentFunction" in n for n in _graph_names(out))  # checkpointed through the C++ segment
    assert torch.equal(out, ref)
    assert e_ref is None or torch.equal(e_out.grad, e_ref.grad)
    for (name, p), q in zip(plain.named_parameters(), ck.parameters()):
        assert (p.grad is None) == (q.grad is None), name
        assert p.grad is None or torch.equal(p.grad, q.grad), name


# --------------------------------------------------------------------------------------------------
# ckpt_ext.ops == the plain-PyTorch references of test_kernels.py
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
        atol = 1e-5 * (1.0 + (r.abs().max().item() if r.numel() else 0.0))
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
